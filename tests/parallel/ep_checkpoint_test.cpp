// Expert-parallel models and global checkpoints: a checkpoint written by a 1-rank model loads
// into every rank of an EP group (each rank keeps its experts' rows of the global tensors), and
// model_state_shards describes every ref of model_state_refs. Ranks are threads.
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
      const std::vector<TensorShard> shards = model_state_shards(local);
      EXPECT_EQ(refs.size(), shards.size()) << tag;
      for (size_t i = 0; i < refs.size() && i < shards.size(); ++i) {
        const bool expert = refs[i].name.find("mlp.experts.") != std::string::npos;
        EXPECT_EQ(shards[i].sharded, expert) << tag << refs[i].name;
        if (!global.layout().contains(refs[i].name)) continue;  // expert biases
        const ParamEntry& g = global.layout().find(refs[i].name);
        EXPECT_EQ(shards[i].global_shape, g.shape) << tag << refs[i].name;
        const int64_t numel = shape_numel(refs[i].shape);
        const int64_t start = shards[i].dim0_offset * (g.numel / g.shape[0]);
        EXPECT_EQ(shards[i].dim0_offset, expert ? ep.first_expert() : 0) << tag << refs[i].name;
        EXPECT_EQ(std::memcmp(refs[i].data, global.params() + g.offset + start, numel * sizeof(float)), 0)
            << tag << "loaded values of " << refs[i].name;
        // Optimizer moments through the same shard description.
        std::vector<float> got(numel);
        read_tensor_shard(ck, true, refs[i].name + ".exp_avg", refs[i].shape, shards[i], got.data());
        EXPECT_EQ(std::memcmp(got.data(), moment.data() + g.offset + start, numel * sizeof(float)), 0)
            << tag << "moment of " << refs[i].name;
      }
      // A shard that does not fit its global tensor is refused, naming the tensor.
      const std::string name = "model.layers.0.mlp.experts.down_proj";
      TensorShard bad{{8, 8, 6}, 7, true};
      std::vector<float> out(2 * 8 * 6);
      const std::string msg = error_of([&] { read_tensor_shard(ck, false, name, {2, 8, 6}, bad, out.data()); });
      EXPECT_NE(msg.find(name), std::string::npos) << msg;
    });
  }
}

}  // namespace
}  // namespace moe::testing
