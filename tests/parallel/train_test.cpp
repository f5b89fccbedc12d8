// Data- and expert-parallel training on the ranks the suite runs on (2 or 4), against a one-rank
// run that every rank makes on its own (self communicator): per-step losses within the tolerance
// of docs/numerics.md for every parallel.ep of kExpertParallelSizes that divides the world (ep = 2
// on 4 ranks: two ep groups, expert gradients summed over ep-dp pairs), ZeRO-1 on and off equal,
// parameters identical on every rank, a checkpoint written by 2 ranks resuming on 1 rank and on
// all ranks, checkpoints of ep > 1 runs resuming on other dp / ep layouts, and the eval of such a
// checkpoint on one rank giving the run's eval loss.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf.h"
#include "model/layout.h"
#include "parallel/comm.h"
#include "parallel/mpi_test_util.h"
#include "support/test_util.h"
#include "train/model_state.h"
#include "train/evaluate.h"
#include "train/trainer.h"

namespace moe::testing {
namespace {

namespace fs = std::filesystem;

// Worst relative difference of per-step losses allowed between layouts (docs/numerics.md):
// FP32 gradients summed in a different order (per rank, then over ranks) drift by rounding.
constexpr double kLossTolerance = 1e-6;
// parallel.ep values to run (those that divide the world size).
const std::vector<int64_t> kExpertParallelSizes = {1, 2};

bool needs_ranks(int at_least) { return world_comm().size() >= at_least; }
bool fits(int64_t ep) { return world_comm().size() % ep == 0; }

std::vector<double> losses_of(const Config& cfg, Comm& comm) {
  std::ostringstream log;
  return train(cfg, log, comm).losses;
}

// Every parameter of a checkpoint as one flat vector, in layout order, then the expert biases.
std::vector<float> checkpoint_params(const std::string& step_dir, const Config& cfg) {
  const LoadedCheckpoint ck = LoadedCheckpoint::open(step_dir);
  const ParamLayout layout = build_param_layout(cfg.model, cfg.moe);
  std::vector<float> out;
  for (const ParamEntry& e : layout.entries()) {
    std::vector<float> t(size_t(e.numel));
    ck.read_model(e.name, e.shape, t.data());
    out.insert(out.end(), t.begin(), t.end());
  }
  for (int64_t m = 0; m < num_moe_layers(cfg.model); ++m) {
    std::vector<float> b(size_t(cfg.moe.num_experts));
    ck.read_model(expert_bias_name(cfg.model, m), {cfg.moe.num_experts}, b.data());
    out.insert(out.end(), b.begin(), b.end());
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
      if (!fits(ep)) continue;
      Config cfg = small_parallel_config(dir / ("dp-" + routing + "-ep" + std::to_string(ep)));
      cfg.moe.routing = routing;
      cfg.parallel.ep = ep;
      const TrainSummary s = train(cfg, log, w);
      const double worst = worst_relative_difference(s.losses, ref.losses);
      EXPECT_LT(worst, kLossTolerance) << routing << " ep " << ep;
      EXPECT_LT(std::abs(s.final_eval_loss - ref.final_eval_loss), kLossTolerance * ref.final_eval_loss) << routing;
      // Only rank 0 writes the run's files; it logged every step.
      // and its per-layer loads group the experts by ep rank in order (E / ep each).
      if (w.rank() == 0) {
        EXPECT_EQ(train_losses(cfg.run.dir).size(), 20u);
        for (const auto& r : read_metrics(cfg.run.dir)) {
          if (!r.contains("moe")) continue;
          EXPECT_EQ(r["ep"].get<int64_t>(), ep);
          for (const auto& m : r["moe"]) {
            const std::vector<int64_t> tpe = m["tokens_per_expert"].get<std::vector<int64_t>>();
            const int64_t per_rank = int64_t(tpe.size()) / ep;
            std::vector<double> ranks(size_t(ep), 0.0);
            for (size_t i = 0; i < tpe.size(); ++i) ranks[i / size_t(per_rank)] += double(tpe[i]);
            double total = 0, mx = 0;
            for (const double v : ranks) total += v, mx = std::max(mx, v);
            EXPECT_DOUBLE_EQ(m["rank_load_max_mean"].get<double>(), mx / (total / double(ep))) << "ep " << ep;
          }
        }
      }
      // The sliced checkpoint holds the one-rank run's model (expert tensors reassembled from
      // their ep ranks' slices, expert biases from global counts), within the same rounding.
      const std::vector<float> a = checkpoint_params(s.last_checkpoint, cfg);
      const std::vector<float> b = checkpoint_params(ref.last_checkpoint, ref_cfg);
      ASSERT_EQ(a.size(), b.size());
      double worst_param = 0;
      for (size_t i = 0; i < a.size(); ++i) worst_param = std::max(worst_param, double(std::abs(a[i] - b[i])));
      if (w.rank() == 0)
        std::printf("dp=%d ep=%lld routing=%s: worst relative loss difference vs 1 rank over %zu steps: %.3g, "
                    "worst parameter difference after them: %.3g\n",
                    w.size(), (long long)ep, routing.c_str(), ref.losses.size(), worst, worst_param);
      EXPECT_LT(worst_param, 1e-5) << routing << " ep " << ep;
      w.barrier();
    }
  }
}

// log.trace over the job: every rank writes trace.rank<R>.json with its rank as pid, holding the
// window's step only.
TEST(DataParallel, TraceHasOneFilePerRank) {
  Comm& w = world_comm();
  if (!needs_ranks(2)) GTEST_SKIP() << "needs >= 2 ranks";
  const SharedDir dir(w, "trace");
  Config cfg = small_parallel_config(dir / "run", /*steps=*/3);
  cfg.log.trace = "2:2";
  std::ostringstream log;
  train(cfg, log, w);
  w.barrier();
  for (int r = 0; r < w.size(); ++r) {
    std::ifstream f(fs::path(cfg.run.dir) / ("trace.rank" + std::to_string(r) + ".json"));
    ASSERT_TRUE(f.good()) << "rank " << r << "'s trace";
    const nlohmann::json doc = nlohmann::json::parse(f);
    int64_t phases = 0;
    for (const auto& e : doc["traceEvents"]) {
      EXPECT_EQ(e["pid"].get<int>(), r);
      if (e["ph"] != "X") continue;
      EXPECT_EQ(e["args"]["step"].get<int64_t>(), 2);
      phases += e["cat"] == "phase";
    }
    EXPECT_GT(phases, 0) << "rank " << r;
  }
  EXPECT_FALSE(fs::exists(fs::path(cfg.run.dir) / "trace.json"));
  w.barrier();
}

TEST(DataParallel, ZeroOnAndOffAgree) {
  Comm& w = world_comm();
  if (!needs_ranks(2)) GTEST_SKIP() << "needs >= 2 ranks";
  const SharedDir dir(w, "zero");
  for (int64_t ep : kExpertParallelSizes) {
    if (!fits(ep)) continue;
    Config on = small_parallel_config(dir / ("on-ep" + std::to_string(ep)));
    Config off = small_parallel_config(dir / ("off-ep" + std::to_string(ep)));
    on.parallel.ep = off.parallel.ep = ep;
    off.parallel.zero = false;
    std::ostringstream log;
    const TrainSummary a = train(on, log, w);
    const TrainSummary b = train(off, log, w);
    const double worst = worst_relative_difference(a.losses, b.losses);
    if (w.rank() == 0)
      std::printf("dp=%d ep=%lld: worst relative loss difference ZeRO-1 on vs off: %.3g\n", w.size(), (long long)ep,
                  worst);
    // Two ranks: a + b is the same sum in either collective, so the runs are bitwise equal.
    if (w.size() == 2) {
      EXPECT_EQ(a.losses, b.losses) << "ep " << ep;
    }
    EXPECT_LT(worst, kLossTolerance) << "ep " << ep;
    // Replicas never drift: the final parameters are identical on every rank (checksums gathered).
    for (const TrainSummary* s : {&a, &b}) {
      const std::vector<float> p = checkpoint_params(s->last_checkpoint, on);
      double sum = 0;
      for (size_t i = 0; i < p.size(); ++i) sum += double(p[i]) * double(i % 97 + 1);
      std::vector<double> all(size_t(w.size()));
      all[size_t(w.rank())] = sum;
      w.all_reduce(all.data(), w.size(), ReduceOp::kSum);
      for (double x : all) EXPECT_EQ(x, all[0]) << "ep " << ep;
    }
  }
}

// BF16 moments (optim.moment_dtype = "bf16") under ZeRO-1: each rank's shard keeps them as BF16
// values, and on two ranks the run is the replicated one bit for bit, as with FP32 moments; it is
// not the FP32 moments' run.
TEST(DataParallel, Bf16MomentsZeroOnAndOffAgree) {
  Comm& w = world_comm();
  if (!needs_ranks(2)) GTEST_SKIP() << "needs >= 2 ranks";
  const SharedDir dir(w, "zero-bf16-moments");
  Config on = small_parallel_config(dir / "on"), off = small_parallel_config(dir / "off");
  Config fp32 = small_parallel_config(dir / "fp32");
  on.optim.moment_dtype = off.optim.moment_dtype = "bf16";
  off.parallel.zero = false;
  std::ostringstream log;
  const TrainSummary a = train(on, log, w), b = train(off, log, w), f = train(fp32, log, w);
  if (w.size() == 2) {
    EXPECT_EQ(a.losses, b.losses);
  }
  EXPECT_LT(worst_relative_difference(a.losses, b.losses), kLossTolerance);
  EXPECT_NE(a.losses, f.losses) << "optim.moment_dtype changed nothing";
  EXPECT_LT(worst_relative_difference(a.losses, f.losses), 1e-2);
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


// The parallel layout of one run: `ranks` ranks (the first ones of the world) with parallel.ep.
struct RunLayout {
  int ranks = 1;
  int64_t ep = 1;
  std::string str() const { return std::to_string(ranks) + " rank(s) ep=" + std::to_string(ep); }
};

// `moecore eval` of a checkpoint sliced over 2 ranks (ep = 2), on one rank: the loss of the
// trainer's eval at that step (2 ranks, batches dealt round-robin and the sums all-reduced) to
// 1e-6 relative (the same batches; the sums and the expert exchange in another order).
TEST(ExpertParallel, EvalOfASlicedCheckpointIsTheRunsEvalLoss) {
  Comm& w = world_comm();
  if (!needs_ranks(2)) GTEST_SKIP() << "needs >= 2 ranks";
  const SharedDir dir(w, "ep-eval");
  Config c = small_parallel_config(dir / "run", 6);
  c.parallel.ep = 2;
  c.train.eval_batches = 3;
  c.checkpoint.interval = 6;
  std::unique_ptr<Comm> part = w.split(w.rank() < 2 ? 0 : 1, w.rank());
  double trained = -1;
  if (w.rank() < 2) {
    std::ostringstream log;
    trained = train(c, log, *part).final_eval_loss;
  }
  w.barrier();
  if (w.rank() == 0) {
    const std::string ckpt = checkpoint_dir(c) + "/step_6";
    EXPECT_TRUE(LoadedCheckpoint::open(ckpt).sliced());
    std::ostringstream lines;
    const EvalResult r = evaluate_checkpoint(ckpt, c, lines);
    EXPECT_EQ(r.batches, 3);
    EXPECT_EQ(r.tokens, 3 * c.train.micro_batch * c.train.seq_len);
    ASSERT_GT(trained, 0);
    EXPECT_LT(std::abs(r.loss() - trained) / trained, 1e-6) << r.loss() << " vs " << trained;
  }
  w.barrier();
}

// parallel.ep_backend = "rowwise" in the trainer (ep = 2 on the first two ranks): dropless it
// trains bitwise as the all-to-all exchange; with parallel.ep_capacity_factor = 1 it drops rows,
// and metrics.jsonl says so.
TEST(ExpertParallel, RowwiseTrainsAsAllToAllAndLogsItsDrops) {
  Comm& w = world_comm();
  if (!needs_ranks(2)) GTEST_SKIP() << "needs >= 2 ranks";
  const SharedDir dir(w, "ep-rowwise");
  std::unique_ptr<Comm> pair = w.split(w.rank() < 2 ? 0 : 1, w.rank());
  auto config = [&](const std::string& name, const std::string& backend, double cf) {
    Config c = small_parallel_config(dir / name, 6);
    c.parallel.ep = 2;
    c.parallel.ep_backend = backend;
    c.parallel.ep_capacity_factor = cf;
    c.log.interval = 1;
    return c;
  };
  if (w.rank() < 2) {
    const std::vector<double> a2a = losses_of(config("a2a", "alltoall", 0), *pair);
    const std::vector<double> row = losses_of(config("row", "rowwise", 0), *pair);
    EXPECT_EQ(row, a2a);
    const Config capped = config("cap", "rowwise", 1.0);
    const std::vector<double> cap = losses_of(capped, *pair);
    ASSERT_EQ(cap.size(), a2a.size());
    if (pair->rank() == 0) {
      double dropped = 0;
      for (const nlohmann::json& r : read_metrics(capped.run.dir))
        if (r.contains("dropped_frac")) dropped += r.at("dropped_frac").get<double>();
      EXPECT_GT(dropped, 0.0) << "capacity 1.0 drops rows of the skewed early routing";
    }
  }
  w.barrier();
}

TEST(ExpertParallel, CheckpointResumesOnOtherLayouts) {
  Comm& w = world_comm();
  if (!needs_ranks(2)) GTEST_SKIP() << "needs >= 2 ranks";
  const SharedDir dir(w, "ep-resume");
  auto self = make_self_comm();
  // Dense layer and expert-bias updates on: the biases travel through the checkpoint too.
  auto config = [&](const std::string& name, const RunLayout& l) {
    Config c = small_parallel_config(dir / name, 20);
    c.parallel.ep = l.ep;
    return c;
  };
  const std::vector<double> ref = losses_of(config("ref-" + std::to_string(w.rank()), {}), *self);
  const std::vector<double> tail(ref.begin() + 10, ref.end());
  // Runs `cfg` on the first l.ranks ranks (one rank: every rank its own copy, on its own
  // directory); the others wait. Returns the losses, empty on ranks that did not take part.
  auto run_on = [&](const RunLayout& l, Config cfg) {
    std::vector<double> losses;
    if (l.ranks == 1) {
      cfg.run.dir += "-" + std::to_string(w.rank());
      losses = losses_of(cfg, *self);
    } else {
      std::unique_ptr<Comm> part = w.split(w.rank() < l.ranks ? 0 : 1, w.rank());
      if (w.rank() < l.ranks) losses = losses_of(cfg, *part);
    }
    w.barrier();
    return losses;
  };

  // Writer layout -> the layouts that resume its step-10 checkpoint: 2 ranks ep 2 -> 1 rank and
  // 2 ranks ep 1 (4 ranks ep 4 on a 4-rank world); 4 ranks ep 2 (ep-dp 2) -> 2 ranks ep 1.
  std::vector<std::pair<RunLayout, std::vector<RunLayout>>> cases = {
      {{2, 2}, {{1, 1}, w.size() >= 4 ? RunLayout{4, 4} : RunLayout{2, 1}}}};
  if (w.size() >= 4) cases.push_back({{4, 2}, {{2, 1}}});
  for (const auto& [writer, readers] : cases) {
    const std::string wname = "w" + std::to_string(writer.ranks) + "ep" + std::to_string(writer.ep);
    Config first = config(wname, writer);
    first.checkpoint.interval = 10;
    first.checkpoint.keep_last = 0;
    const std::vector<double> full = run_on(writer, first);
    if (w.rank() < writer.ranks) {
      EXPECT_LT(worst_relative_difference(full, ref), kLossTolerance) << writer.str();
    }
    const std::string ckpt = checkpoint_dir(first) + "/step_10";
    const LoadedCheckpoint ck = LoadedCheckpoint::open(ckpt);
    EXPECT_TRUE(ck.sliced());
    EXPECT_EQ(ck.world_size(), writer.ranks);
    // Global FP32 tensors: expert tensors of all 4 experts, from at least one slice per ep rank;
    // their moments likewise (ZeRO shards of the ep-dp group).
    const ParamLayout global = build_param_layout(first.model, first.moe);
    auto check_global = [&](const std::vector<GlobalTensorInfo>& tensors, const std::string& suffix) {
      for (const ParamEntry& e : global.entries()) {
        const std::string name = e.name + suffix;
        auto it = std::find_if(tensors.begin(), tensors.end(), [&](const GlobalTensorInfo& t) { return t.name == name; });
        ASSERT_NE(it, tensors.end()) << name;
        EXPECT_EQ(it->shape, e.shape) << name;
        EXPECT_EQ(it->dtype_name, "F32") << name;
        if (e.expert) {
          EXPECT_GE(it->num_slices, writer.ep) << name;
        }
      }
    };
    check_global(ck.model_tensors(), "");
    check_global(ck.optim_tensors(), ".exp_avg");
    check_global(ck.optim_tensors(), ".exp_avg_sq");

    for (const RunLayout& reader : readers) {
      Config next = config(wname + "-to-" + std::to_string(reader.ranks) + "ep" + std::to_string(reader.ep), reader);
      next.checkpoint.resume = ckpt;
      const std::vector<double> resumed = run_on(reader, next);
      if (resumed.empty()) continue;
      const double worst = worst_relative_difference(resumed, tail);
      if (w.rank() == 0)
        std::printf("checkpoint of %s at step 10 resumed on %s: worst relative loss difference vs uninterrupted "
                    "1 rank over steps 11-20: %.3g\n", writer.str().c_str(), reader.str().c_str(), worst);
      EXPECT_LT(worst, kLossTolerance) << writer.str() << " -> " << reader.str();
    }
  }
}

}  // namespace
}  // namespace moe::testing
