// Data-parallel training on the ranks the suite runs on (2 or 4), against a one-rank run that
// every rank makes on its own (self communicator): per-step losses within the tolerance of
// docs/numerics.md, ZeRO-1 on and off equal, parameters identical on every rank, and a
// checkpoint written by 2 ranks resuming on 1 rank and on all ranks. The expert-parallel
// layouts join through kExpertParallelSizes once the CPU model holds experts per ep rank.
#include <gtest/gtest.h>

#include <cstdio>
#include <sstream>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf.h"
#include "model/layout.h"
#include "parallel/comm.h"
#include "parallel/mpi_test_util.h"
#include "support/test_util.h"
#include "train/trainer.h"

namespace moe::testing {
namespace {

namespace fs = std::filesystem;

// Worst relative difference of per-step losses allowed between layouts (docs/numerics.md):
// FP32 gradients summed in a different order (per rank, then over ranks) drift by rounding.
constexpr double kLossTolerance = 1e-6;
// parallel.ep values to run; 2 joins when the expert-parallel CPU model lands.
const std::vector<int64_t> kExpertParallelSizes = {1};

bool needs_ranks(int at_least) { return world_comm().size() >= at_least; }

std::vector<double> losses_of(const Config& cfg, Comm& comm) {
  std::ostringstream log;
  return train(cfg, log, comm).losses;
}

// Every parameter of a checkpoint as one flat vector, in layout order.
std::vector<float> checkpoint_params(const std::string& step_dir, const Config& cfg) {
  const LoadedCheckpoint ck = LoadedCheckpoint::open(step_dir);
  const ParamLayout layout = build_param_layout(cfg.model, cfg.moe);
  std::vector<float> out;
  for (const ParamEntry& e : layout.entries()) {
    std::vector<float> t(size_t(e.numel));
    ck.read_model(e.name, e.shape, t.data());
    out.insert(out.end(), t.begin(), t.end());
  }
  return out;
}

TEST(DataParallel, FollowsOneRankLosses) {
  Comm& w = world_comm();
  if (!needs_ranks(2)) GTEST_SKIP() << "needs >= 2 ranks";
  const SharedDir dir(w, "dp");
  auto self = make_self_comm();
  for (const std::string routing : {"learned", "random"}) {
    const std::string ref_dir = "ref-" + routing + "-" + std::to_string(w.rank());
    Config ref_cfg = small_parallel_config(dir / ref_dir);
    ref_cfg.moe.routing = routing;
    std::ostringstream log;
    const TrainSummary ref = train(ref_cfg, log, *self);
    ASSERT_EQ(ref.losses.size(), 20u);
    for (int64_t ep : kExpertParallelSizes) {
      Config cfg = small_parallel_config(dir / ("dp-" + routing + "-ep" + std::to_string(ep)));
      cfg.moe.routing = routing;
      cfg.parallel.ep = ep;
      const TrainSummary s = train(cfg, log, w);
      const double worst = worst_relative_difference(s.losses, ref.losses);
      if (w.rank() == 0)
        std::printf("dp=%d ep=%lld routing=%s: worst relative loss difference vs 1 rank over %zu steps: %.3g\n",
                    w.size(), (long long)ep, routing.c_str(), ref.losses.size(), worst);
      EXPECT_LT(worst, kLossTolerance) << routing;
      EXPECT_LT(std::abs(s.final_eval_loss - ref.final_eval_loss), kLossTolerance * ref.final_eval_loss) << routing;
      // Only rank 0 writes the run's files; it logged every step.
      if (w.rank() == 0) {
        EXPECT_EQ(train_losses(cfg.run.dir).size(), 20u);
      }
      // The sliced checkpoint holds the one-rank run's model, within the same rounding.
      const std::vector<float> a = checkpoint_params(s.last_checkpoint, cfg);
      const std::vector<float> b = checkpoint_params(ref.last_checkpoint, ref_cfg);
      ASSERT_EQ(a.size(), b.size());
      double worst_param = 0;
      for (size_t i = 0; i < a.size(); ++i) worst_param = std::max(worst_param, double(std::abs(a[i] - b[i])));
      EXPECT_LT(worst_param, 1e-5) << routing;
      w.barrier();
    }
  }
}

TEST(DataParallel, ZeroOnAndOffAgree) {
  Comm& w = world_comm();
  if (!needs_ranks(2)) GTEST_SKIP() << "needs >= 2 ranks";
  const SharedDir dir(w, "zero");
  Config on = small_parallel_config(dir / "on");
  Config off = small_parallel_config(dir / "off");
  off.parallel.zero = false;
  std::ostringstream log;
  const TrainSummary a = train(on, log, w);
  const TrainSummary b = train(off, log, w);
  const double worst = worst_relative_difference(a.losses, b.losses);
  if (w.rank() == 0) std::printf("dp=%d: worst relative loss difference ZeRO-1 on vs off: %.3g\n", w.size(), worst);
  // Two ranks: a + b is the same sum in either collective, so the runs are bitwise equal.
  if (w.size() == 2) {
    EXPECT_EQ(a.losses, b.losses);
  }
  EXPECT_LT(worst, kLossTolerance);
  // Replicas never drift: the final parameters are identical on every rank (checksums gathered).
  for (const TrainSummary* s : {&a, &b}) {
    const std::vector<float> p = checkpoint_params(s->last_checkpoint, on);
    double sum = 0;
    for (size_t i = 0; i < p.size(); ++i) sum += double(p[i]) * double(i % 97 + 1);
    std::vector<double> all(size_t(w.size()));
    all[size_t(w.rank())] = sum;
    w.all_reduce(all.data(), w.size(), ReduceOp::kSum);
    for (double x : all) EXPECT_EQ(x, all[0]);
  }
}

TEST(DataParallel, CheckpointOfTwoRanksResumesOnOtherLayouts) {
  Comm& w = world_comm();
  if (!needs_ranks(2)) GTEST_SKIP() << "needs >= 2 ranks";
  const SharedDir dir(w, "resume");
  auto self = make_self_comm();
  // The uninterrupted one-rank run (every rank makes its own copy).
  // No expert bias and no dense layer here: export-hf below refuses what OLMoE cannot express.
  auto config = [&](const std::string& name, int64_t steps) {
    Config c = small_parallel_config(dir / name, steps);
    c.moe.bias_update_rate = 0;
    c.model.dense_layers = {};
    return c;
  };
  const std::vector<double> ref = losses_of(config("ref-" + std::to_string(w.rank()), 20), *self);
  // Ranks 0 and 1 train (saving at step 10); the other ranks wait.
  std::unique_ptr<Comm> pair = w.split(w.rank() < 2 ? 0 : 1, w.rank());
  Config first = config("two", 20);
  first.checkpoint.interval = 10;
  first.checkpoint.keep_last = 0;
  if (w.rank() < 2) {
    std::ostringstream log;
    train(first, log, *pair);
  }
  w.barrier();
  const std::string ckpt = checkpoint_dir(first) + "/step_10";
  const LoadedCheckpoint ck = LoadedCheckpoint::open(ckpt);
  EXPECT_TRUE(ck.sliced());
  EXPECT_EQ(ck.world_size(), 2);

  std::vector<double> tail(ref.begin() + 10, ref.end());
  // Resume on one rank (rank-local copy of the run directory's checkpoint target).
  Config one = config("one-" + std::to_string(w.rank()), 20);
  one.checkpoint.resume = ckpt;
  const std::vector<double> on_one = losses_of(one, *self);
  const double worst_one = worst_relative_difference(on_one, tail);
  // Resume on every rank of the job.
  Config all = config("all", 20);
  all.checkpoint.resume = ckpt;
  const std::vector<double> on_all = losses_of(all, w);
  const double worst_all = worst_relative_difference(on_all, tail);
  if (w.rank() == 0)
    std::printf("checkpoint of 2 ranks at step 10: worst relative loss difference vs uninterrupted 1 rank: "
                "resumed on 1 rank %.3g, on %d ranks %.3g\n", worst_one, w.size(), worst_all);
  EXPECT_LT(worst_one, kLossTolerance);
  EXPECT_LT(worst_all, kLossTolerance);

  // The tools read sliced checkpoints: export-hf reassembles the global tensors.
  if (w.rank() == 0) {
    HfExportOptions opt;
    opt.dtype = "fp32";
    EXPECT_EQ(export_hf(ckpt, (dir / "hf").string(), opt), 1);
    const SafetensorsFile hf = SafetensorsFile::open((dir / "hf" / "model-00001-of-00001.safetensors").string());
    const TensorInfo* emb = hf.find("model.embed_tokens.weight");
    ASSERT_NE(emb, nullptr);
    std::vector<float> a(size_t(emb->numel())), b(a.size());
    hf.read_f32(emb->name, a.data(), emb->numel());
    ck.read_model(emb->name, emb->shape, b.data());
    EXPECT_EQ(a, b);
  }
}

}  // namespace
}  // namespace moe::testing
