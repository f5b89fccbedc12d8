// Expert-parallel models and global checkpoints: a checkpoint written by a 1-rank model loads
// into every rank of an EP group (each rank keeps its experts' rows of the global tensors), and
// model_state_placements places every ref of model_state_refs. Ranks are threads.
#include "ep_check.h"
#include "ep_thread_comm.h"
#include "support/test_util.h"
#include "train/model_state.h"

namespace moe::testing {
namespace {

TEST(EpCheckpoint, GlobalCheckpointLoadsIntoEveryEpLayout) {
  if (world_comm().size() > 1) GTEST_SKIP() << "thread-rank test; runs in a one-rank process";
  const ModelConfig m = ep_tiny_model();
  const MoeConfig e = ep_tiny_moe(8, 2);
  TempDir dir("ep_ckpt");
  // Global model with values that differ per expert row, plus moments, saved once.
  Model<float> global(m, e);
  global.init_params(21);
  for (size_t i = 0; i < global.expert_bias().size(); ++i) global.expert_bias()[i] = 0.01f * float(i);
  std::vector<float> moment(global.layout().total_numel());
  for (size_t i = 0; i < moment.size(); ++i) moment[i] = float(i % 1000) * 0.5f;
  CheckpointFiles files;
  files.model = model_state_refs(global);
  for (const ParamEntry& pe : global.layout().entries())
    files.optim.push_back({pe.name + ".exp_avg", DType::kF32, pe.shape, moment.data() + pe.offset});
  files.train_state = nlohmann::json::object();
  const std::string step_dir = save_checkpoint(dir.path(), 1, files, 0);
  const LoadedCheckpoint ck = LoadedCheckpoint::open(step_dir);

  for (int ranks : {2, 4}) {
    run_thread_ranks(ranks, [&](Comm& comm) {
      const ExpertParallel ep = make_expert_parallel(comm, e.num_experts);
      Model<float> local(m, e, &ep);
      load_model_state(ck, local);
      const std::string tag = rank_tag(comm) + "ep=" + std::to_string(ranks) + " ";
      EXPECT_EQ(local.expert_bias(), global.expert_bias()) << tag;
      const std::vector<TensorRef> refs = model_state_refs(local);
      const std::vector<GlobalPlacement> places = model_state_placements(local);
      EXPECT_EQ(refs.size(), places.size()) << tag;
      for (size_t i = 0; i < refs.size() && i < places.size(); ++i) {
        const bool expert = refs[i].name.find("mlp.experts.") != std::string::npos;
        const int64_t numel = shape_numel(refs[i].shape);
        if (!global.layout().contains(refs[i].name)) {  // expert biases: replicated, whole
          EXPECT_EQ(places[i].global_shape, refs[i].shape) << tag << refs[i].name;
          EXPECT_EQ(places[i].offset, 0) << tag << refs[i].name;
          continue;
        }
        const ParamEntry& g = global.layout().find(refs[i].name);
        EXPECT_EQ(places[i].global_shape, g.shape) << tag << refs[i].name;
        const int64_t start = expert ? ep.first_expert() * (g.numel / g.shape[0]) : 0;
        EXPECT_EQ(places[i].offset, start) << tag << refs[i].name;
        EXPECT_EQ(std::memcmp(refs[i].data, global.params() + g.offset + start, numel * sizeof(float)), 0)
            << tag << "loaded values of " << refs[i].name;
        // Optimizer moments through the same placement.
        std::vector<float> got(numel);
        ck.read_optim_range(refs[i].name + ".exp_avg", places[i].global_shape, places[i].offset, numel, got.data());
        EXPECT_EQ(std::memcmp(got.data(), moment.data() + g.offset + start, numel * sizeof(float)), 0)
            << tag << "moment of " << refs[i].name;
      }
      // A range that does not fit its global tensor is refused, naming the tensor.
      const std::string name = "model.layers.0.mlp.experts.down_proj";
      std::vector<float> out(2 * 8 * 6);
      const std::string msg =
          error_of([&] { ck.read_model_range(name, {8, 8, 6}, 7 * 8 * 6, 2 * 8 * 6, out.data()); });
      EXPECT_NE(msg.find(name), std::string::npos) << msg;
    });
  }
}

}  // namespace
}  // namespace moe::testing
