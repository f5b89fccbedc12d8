// End-to-end training checks on CPU: exact resume, the default run's loss falls, and the
// CLI's behaviour (dry run, errors, inspect) through the real binary.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "e2e/cli_util.h"
#include "core/config.h"
#include "core/config_io.h"
#include "checkpoint/checkpoint.h"
#include "core/phase.h"
#include "model/layout.h"
#include "support/test_util.h"
#include "train/device.h"
#include "train/model_state.h"
#include "train/run_plan.h"
#include "train/trainer.h"

namespace moe::testing {
namespace {

namespace fs = std::filesystem;

Config small_config(const fs::path& run_dir) {
  Config c = small_train_config(run_dir, /*n_layers=*/3, /*global_batch=*/4, /*steps=*/8);
  c.moe.shared_experts = 1;
  return c;
}

TEST(Train, ResumeIsBitExact) {
  const TempDir tmp("resume");
  const fs::path root = tmp.root();
  Config a = small_config(root / "straight");
  a.checkpoint.interval = 4;
  std::ostringstream log;
  train(a, log);
  const std::vector<double> straight = train_losses(root / "straight");
  ASSERT_EQ(straight.size(), 8u);

  // Resume from the step-4 checkpoint of the straight run into a fresh run directory.
  Config b = small_config(root / "resumed");
  b.checkpoint.resume = (root / "straight" / "checkpoints" / "step_4").string();
  b.checkpoint.dir = (root / "resumed_ckpt").string();
  const TrainSummary s = train(b, log);
  EXPECT_EQ(s.start_step, 4);
  const std::vector<double> resumed = train_losses(root / "resumed");
  ASSERT_EQ(resumed.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed[i], straight[4 + i]) << "step " << 5 + i;
}

// optim.moment_dtype = "bf16" on the CPU: a resumed run is the straight run bit for bit (the
// checkpoint holds the BF16 moments' values as FP32), the losses part from the FP32 moments'
// run after the first steps, by little, and either setting resumes the other's checkpoint.
TEST(Train, Bf16MomentsResumeBitExact) {
  const TempDir tmp("resume-bf16-moments");
  const fs::path root = tmp.root();
  std::ostringstream log;
  Config a = small_config(root / "straight");
  a.optim.moment_dtype = "bf16";
  a.checkpoint.interval = 4;
  train(a, log);
  const std::vector<double> straight = train_losses(root / "straight");
  ASSERT_EQ(straight.size(), 8u);
  Config b = small_config(root / "resumed");
  b.optim.moment_dtype = "bf16";
  b.checkpoint.resume = (root / "straight" / "checkpoints" / "step_4").string();
  b.checkpoint.dir = (root / "resumed_ckpt").string();
  train(b, log);
  const std::vector<double> resumed = train_losses(root / "resumed");
  ASSERT_EQ(resumed.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed[i], straight[4 + i]) << "step " << 5 + i;
  Config f = small_config(root / "fp32");
  f.checkpoint.interval = 4;
  train(f, log);
  const std::vector<double> fp32 = train_losses(root / "fp32");
  ASSERT_EQ(fp32.size(), 8u);
  EXPECT_EQ(fp32[0], straight[0]);  // the same weights before any update
  EXPECT_NE(fp32.back(), straight.back()) << "optim.moment_dtype changed nothing";
  for (size_t i = 0; i < 8; ++i) EXPECT_NEAR(straight[i], fp32[i], 1e-2 * fp32[i]) << "step " << i + 1;
  // Either setting resumes the other's checkpoint: the same weights give the same next loss.
  for (const auto& [from, moments, want] :
       {std::tuple{"fp32", "bf16", fp32[4]}, std::tuple{"straight", "fp32", straight[4]}}) {
    Config x = small_config(root / (std::string(from) + "-as-" + moments));
    x.optim.moment_dtype = moments;
    x.checkpoint.resume = (root / from / "checkpoints" / "step_4").string();
    x.checkpoint.dir = (root / (std::string(from) + "-as-" + moments + "-ckpt")).string();
    const TrainSummary r = train(x, log);
    EXPECT_EQ(r.start_step, 4) << from;
    const std::vector<double> l = train_losses(root / (std::string(from) + "-as-" + moments));
    ASSERT_EQ(l.size(), 4u) << from;
    EXPECT_EQ(l[0], want) << from << " resumed with " << moments << " moments";
  }
}

TEST(Train, CheckpointsOffWritesNone) {
  const TempDir tmp("no-ckpt");
  Config a = small_config(tmp.root() / "run");
  a.train.steps = 3;
  a.checkpoint.enabled = false;
  std::ostringstream log;
  const TrainSummary s = train(a, log);
  EXPECT_EQ(s.steps_done, 3);
  EXPECT_TRUE(s.last_checkpoint.empty());
  EXPECT_FALSE(fs::exists(tmp.root() / "run" / "checkpoints")) << log.str();
  EXPECT_EQ(train_losses(tmp.root() / "run").size(), 3u);
  const CmdResult r = run_cli("train --train.steps=2 --checkpoint.enabled=false --run.dir=" +
                              (tmp.root() / "cli").string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("; no checkpoint written"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(tmp.root() / "cli" / "checkpoints"));
}

// The deferred update schedules the GPU step; the CPU step refuses it, naming the key, before
// anything is written.
TEST(Train, CpuRefusesTheDeferredUpdate) {
  const TempDir tmp("deferred-cpu");
  Config c = small_config(tmp.root() / "run");
  c.train.device = "cpu";
  c.optim.deferred_update = true;
  std::ostringstream log;
  try {
    train(c, log);
    FAIL() << "the CPU step accepted optim.deferred_update = true";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("optim.deferred_update"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(tmp.root() / "run" / "checkpoints"));
}

// train.precision = "fp8" on the CPU: the FP8 recipe emulated; the run trains and its losses are
// not the FP32 run's. fp8 resolves to the cpu backend; bf16 does not run there.
TEST(Train, Fp8EmulationOnTheCpuTrains) {
  TrainConfig t;
  t.device = "cpu";
  t.precision = "fp8";
  EXPECT_EQ(resolve_device(t), "cpu");
  t.precision = "bf16";
  EXPECT_THROW(resolve_device(t), Error);
  const TempDir tmp("fp8-cpu");
  Config a = small_config(tmp.root() / "fp8");
  a.train.device = "cpu";
  a.train.precision = "fp8";
  a.train.steps = 6;
  a.checkpoint.enabled = false;
  std::ostringstream log;
  const TrainSummary s8 = train(a, log);
  Config b = a;
  b.train.precision = "fp32";
  b.run.dir = (tmp.root() / "fp32").string();
  const TrainSummary s32 = train(b, log);
  ASSERT_EQ(s8.losses.size(), 6u);
  EXPECT_TRUE(std::isfinite(s8.last_loss));
  EXPECT_LT(s8.last_loss, s8.first_loss);
  EXPECT_EQ(s8.first_loss == s32.first_loss, false) << "the FP8 recipe changed nothing";
  EXPECT_NEAR(s8.last_loss, s32.last_loss, 0.1 * s32.last_loss);
}

TEST(Train, ResumeAutoContinuesFromLatest) {
  const TempDir tmp("auto");
  const fs::path root = tmp.root();
  Config a = small_config(root / "run");
  a.train.steps = 4;
  a.optim.schedule = "constant";
  std::ostringstream log;
  train(a, log);
  a.train.steps = 6;
  a.checkpoint.resume = "auto";
  const TrainSummary s = train(a, log);
  EXPECT_EQ(s.start_step, 4);
  EXPECT_EQ(s.steps_done, 6);
  EXPECT_EQ(train_losses(root / "run").size(), 6u);  // appended
}

TEST(Train, MetricsHaveContractKeys) {
  const TempDir tmp("metrics");
  const fs::path root = tmp.root();
  Config a = small_config(root / "run");
  a.train.steps = 2;
  a.train.eval_interval = 1;
  std::ostringstream log;
  train(a, log);
  bool saw_train = false, saw_eval = false;
  for (const auto& r : read_metrics(root / "run")) {
    if (r.contains("loss")) {
      saw_train = true;
      for (const char* k : {"step", "loss", "lb_loss", "z_loss", "grad_norm", "lr", "tokens_per_s", "step_ms",
                            "load_imbalance", "dropped_frac"})
        EXPECT_TRUE(r.contains(k)) << k;
      EXPECT_GE(r["load_imbalance"].get<double>(), 1.0);
    }
    saw_eval |= r.contains("eval_loss");
  }
  EXPECT_TRUE(saw_train);
  EXPECT_TRUE(saw_eval);
  EXPECT_TRUE(fs::exists(root / "run" / "config.toml"));
  // The resolved config round-trips.
  std::ifstream f(root / "run" / "config.toml");
  std::stringstream ss;
  ss << f.rdbuf();
  EXPECT_EQ(config_to_toml(parse_config_toml(ss.str(), "config.toml")), config_to_toml(a));
}

// The per-layer MoE figures of every step record: tokens per expert summed over the interval
// (they add up to the interval's routes per layer), max/mean per expert and per rank recomputed
// from them, lb/z per layer whose mean over layers is the record's lb_loss/z_loss, dropped
// fractions whose mean is dropped_frac (capacity on, one step per record), and bias magnitudes
// equal to the final checkpoint's expert bias.
TEST(Train, MetricsCarryPerLayerMoeFigures) {
  const TempDir tmp("moe-metrics");
  for (const int64_t interval : {int64_t(1), int64_t(2)}) {
    Config a = small_config(tmp.root() / ("run" + std::to_string(interval)));
    a.train.steps = 3;  // an odd number of +-rate bias steps: nonzero biases
    a.log.interval = interval;
    a.moe.capacity_factor = 1.0;
    a.moe.bias_update_rate = 0.01;
    std::ostringstream log;
    const TrainSummary s = train(a, log);
    const int64_t e = a.moe.num_experts;
    const int64_t routes_per_step = a.train.global_batch * a.train.seq_len * a.moe.top_k;  // per layer
    const std::vector<int64_t> moe_layers = {1, 2};  // layer 0 is dense
    std::vector<nlohmann::json> steps;
    for (const auto& r : read_metrics(a.run.dir))
      if (r.contains("loss")) steps.push_back(r);
    ASSERT_EQ(steps.size(), size_t(interval == 1 ? 3 : 2));  // steps 2 and 3 (the last)
    for (const auto& r : steps) {
      ASSERT_TRUE(r.contains("moe")) << r.dump();
      EXPECT_EQ(r["ep"].get<int64_t>(), 1);
      const auto& layers = r["moe"];
      ASSERT_EQ(layers.size(), moe_layers.size());
      double lb = 0, z = 0, dropped = 0;
      for (size_t l = 0; l < layers.size(); ++l) {
        const auto& m = layers[l];
        EXPECT_EQ(m["layer"].get<int64_t>(), moe_layers[l]);
        const std::vector<int64_t> tpe = m["tokens_per_expert"].get<std::vector<int64_t>>();
        ASSERT_EQ(int64_t(tpe.size()), e);
        int64_t sum = 0, mx = 0;
        for (const int64_t c : tpe) sum += c, mx = std::max(mx, c);
        const int64_t interval_steps = r["step"].get<int64_t>() == 3 && interval == 2 ? 1 : interval;
        EXPECT_EQ(sum, interval_steps * routes_per_step) << "step " << r["step"] << " layer " << l;
        EXPECT_DOUBLE_EQ(m["load_max_mean"].get<double>(), double(mx) / (double(sum) / double(e)));
        EXPECT_EQ(m["rank_load_max_mean"].get<double>(), 1.0);  // one rank holds every expert
        lb += m["lb_loss"].get<double>() / double(layers.size());
        z += m["z_loss"].get<double>() / double(layers.size());
        dropped += m["dropped_frac"].get<double>() / double(layers.size());
        EXPECT_GE(m["bias_abs_max"].get<double>(), m["bias_abs_mean"].get<double>());
      }
      EXPECT_NEAR(lb, r["lb_loss"].get<double>(), 1e-12);
      EXPECT_NEAR(z, r["z_loss"].get<double>(), 1e-12);
      if (interval == 1) {
        EXPECT_NEAR(dropped, r["dropped_frac"].get<double>(), 1e-12);
      }
    }
    EXPECT_GT(steps.back()["dropped_frac"].get<double>(), 0.0) << "capacity 1.0 drops some routes";
    // The last record's bias magnitudes are the trained model's (the final checkpoint).
    const LoadedCheckpoint ck = LoadedCheckpoint::open(s.last_checkpoint);
    double bias_max = 0;
    for (size_t l = 0; l < moe_layers.size(); ++l) {
      std::vector<float> b(static_cast<size_t>(e));
      ck.read_model(expert_bias_name(a.model, int64_t(l)), {e}, b.data());
      double sum = 0, mx = 0;
      for (const float v : b) sum += std::abs(double(v)), mx = std::max(mx, std::abs(double(v)));
      bias_max = std::max(bias_max, mx);
      EXPECT_EQ(steps.back()["moe"][l]["bias_abs_mean"].get<double>(), sum / double(e));
      EXPECT_EQ(steps.back()["moe"][l]["bias_abs_max"].get<double>(), mx);
    }
    EXPECT_GT(bias_max, 0.0);
    // The console line names the worst layer and the bias.
    EXPECT_NE(log.str().find("| load "), std::string::npos) << log.str();
    EXPECT_NE(log.str().find("| bias "), std::string::npos) << log.str();
  }
}

// log.trace = 2:3 on the CPU: trace.json holds a complete event for every phase that ran in
// steps 2 and 3 (those with time in the metrics records) and for nothing else, non-negative, in
// start order, their durations summing per step to most of the step's measured time (never more) and
// per phase to the record's phase_ms.
TEST(Train, TraceWindowHoldsEveryPhaseOfItsSteps) {
  const TempDir tmp("trace");
  const fs::path root = tmp.root();
  Config a = small_config(root / "run");
  a.train.steps = 4;
  a.log.interval = 1;  // one record per step: step_ms and phase_ms of that step
  a.log.trace = "2:3";
  std::ostringstream log;
  train(a, log);
  EXPECT_NE(log.str().find("trace: wrote"), std::string::npos) << log.str();
  std::map<int64_t, nlohmann::json> records;
  for (const auto& r : read_metrics(root / "run"))
    if (r.contains("loss")) records[r["step"].get<int64_t>()] = r;
  ASSERT_EQ(records.size(), 4u);

  std::ifstream f(root / "run" / "trace.json");
  ASSERT_TRUE(f.good());
  const nlohmann::json doc = nlohmann::json::parse(f);  // throws when not JSON
  ASSERT_TRUE(doc.contains("traceEvents"));
  std::map<int64_t, std::map<std::string, double>> dur;  // step -> phase -> summed us
  std::map<int64_t, std::pair<double, double>> step_bar, phase_span;  // step -> [begin, end) us
  for (const int64_t step : {2, 3}) phase_span[step] = {1e300, -1e300};
  double last_ts = -1;
  bool named = false;
  for (const auto& e : doc["traceEvents"]) {
    ASSERT_EQ(e["pid"].get<int>(), 0);
    if (e["ph"] == "M") {
      named |= e["name"] == "process_name";
      continue;
    }
    ASSERT_EQ(e["ph"], "X");
    const double ts = e["ts"].get<double>(), d = e["dur"].get<double>();
    EXPECT_GE(ts, last_ts) << "events out of order";
    last_ts = ts;
    EXPECT_GE(d, 0.0);
    const int64_t step = e["args"]["step"].get<int64_t>();
    EXPECT_TRUE(step == 2 || step == 3) << "event of step " << step << " outside the window";
    if (e["cat"] == "phase") {
      dur[step][e["name"].get<std::string>()] += d;
      phase_span[step].first = std::min(phase_span[step].first, ts);
      phase_span[step].second = std::max(phase_span[step].second, ts + d);
    } else {
      step_bar[step] = {ts, ts + d};
      EXPECT_GT(e["args"]["step_ms"].get<double>(), 0.0) << "step " << step;
    }
  }
  // Each step's bar spans exactly its phases (what a viewer lines up).
  for (const int64_t step : {2, 3}) {
    ASSERT_TRUE(step_bar.count(step)) << "no step event for step " << step;
    EXPECT_NEAR(step_bar[step].first, phase_span[step].first, 1e-3) << "step " << step;
    EXPECT_NEAR(step_bar[step].second, phase_span[step].second, 1e-3) << "step " << step;
  }
  EXPECT_TRUE(named) << "no process_name metadata event";
  ASSERT_EQ(dur.size(), 2u);
  for (const int64_t step : {2, 3}) {
    const nlohmann::json& rec = records[step];
    ASSERT_TRUE(rec.contains("phase_ms")) << rec.dump();
    std::set<std::string> ran, traced;
    for (const auto& [name, ms] : rec["phase_ms"].items())
      if (ms.get<double>() > 0) ran.insert(name);
    double sum_us = 0;
    for (const auto& [name, us] : dur[step]) {
      traced.insert(name);
      sum_us += us;
      EXPECT_NEAR(us, 1e3 * rec["phase_ms"][name].get<double>(), 1e-3 * us + 1e-3) << name << " step " << step;
    }
    EXPECT_EQ(traced, ran) << "step " << step;
    for (const char* p : {"embedding", "attention", "router", "dispatch", "experts", "combine", "lm_head", "optimizer"})
      EXPECT_TRUE(traced.count(p)) << p << " missing in step " << step;
    const double step_us = 1e3 * rec["step_ms"].get<double>();
    // The phases are a part of the step (the loader and the loop's own work are not timed): at most
    // the step, and most of it (a loose lower bound: these steps take milliseconds and a loaded
    // machine stretches the untimed part).
    EXPECT_LE(sum_us, 1.02 * step_us + 50.0) << "step " << step;
    EXPECT_GE(sum_us, 0.5 * step_us) << "step " << step;
  }
}

TEST(Train, MetricsCarryPhaseTimes) {
  const TempDir tmp("phases");
  const fs::path root = tmp.root();
  Config a = small_config(root / "run");
  a.train.steps = 4;
  a.log.interval = 2;
  std::ostringstream log;
  train(a, log);
  int records = 0;
  for (const auto& r : read_metrics(root / "run")) {
    if (!r.contains("loss")) continue;
    ++records;
    ASSERT_TRUE(r.contains("phase_ms")) << r.dump();
    EXPECT_EQ(r["phase_steps"].get<int64_t>(), 2);
    EXPECT_EQ(r["phase_ms"].size(), size_t(kNumPhases));
    double sum = 0;
    for (const auto& [name, ms] : r["phase_ms"].items()) {
      EXPECT_GE(ms.get<double>(), 0.0) << name;
      sum += ms.get<double>();
    }
    EXPECT_GT(r["phase_ms"]["attention"].get<double>(), 0.0);
    EXPECT_LE(sum, 1.1 * r["step_ms"].get<double>());  // a part of the step (not the data loader's)
    EXPECT_GT(sum, 0.0);
  }
  EXPECT_EQ(records, 2);
  EXPECT_FALSE(fs::exists(root / "run" / "trace.json"));  // no log.trace, no trace
}

TEST(Train, NonFiniteStepsAreSkipped) {
  // Weights of 1e30 overflow the logits: every step's loss is non-finite and is skipped,
  // leaving the parameters as initialised.
  const TempDir tmp("skip");
  const fs::path root = tmp.root();
  Config a = small_config(root / "run");
  a.train.steps = 2;
  a.model.init_std = 1e30;
  std::ostringstream log;
  train(a, log);
  EXPECT_NE(log.str().find("skipped: non-finite loss"), std::string::npos) << log.str();
  int64_t skipped = 0;
  for (const auto& r : read_metrics(root / "run"))
    if (r.contains("skipped_steps")) skipped += r["skipped_steps"].get<int64_t>();
  EXPECT_EQ(skipped, 2);
}

TEST(Train, DefaultRunLossFalls) {
  // The embedded default with fewer steps: eval loss must fall at least 30%.
  const TempDir tmp("default");
  const fs::path root = tmp.root();
  Config c;
  c.run.dir = (root / "run").string();
  c.train.steps = 40;
  c.train.eval_interval = 40;  // at step 0 and at the end
  c.optim.warmup_steps = 10;
  c.log.interval = 20;
  std::ostringstream log;
  const TrainSummary s = train(c, log);
  std::printf("%s", log.str().c_str());
  ASSERT_GT(s.initial_eval_loss, 0);
  EXPECT_LT(s.final_eval_loss, 0.7 * s.initial_eval_loss)
      << "initial " << s.initial_eval_loss << " final " << s.final_eval_loss;
}

// The GPU memory estimate of the run plan with expert parallelism: one GPU's share of the expert
// state, plus the exchange buffers (received rows and maps per MoE layer, two row buffers) on top
// of the activations; the dense state stays whole.
TEST(RunPlan, GpuMemoryExpertParallelShareAndExchangeBuffers) {
  Config c;
  ASSERT_NO_THROW(c = load_config(std::string(MOECORE_SOURCE_DIR) + "/configs/olmoe-1b-7b.toml", {}));
  c.parallel.ep = 1;  // the config file sets ep = 2
  c.parallel.zero = false;  // replicated moments: 18 B per local parameter
  c.train.global_batch = 2 * c.train.micro_batch;  // two GPUs
  const RunPlan one = make_run_plan(c, 2, "cuda");
  const double one_state = one.memory.params + one.memory.grads + one.memory.moments;
  EXPECT_DOUBLE_EQ(one_state, 18.0 * double(build_param_layout(c.model, c.moe).total_numel()));
  EXPECT_NEAR(one_state, 18.0 * double(one.counts.total_params), 1e-3 * one_state);
  c.parallel.ep = 2;
  const RunPlan two = make_run_plan(c, 2, "cuda");
  const ExpertSlice half{0, c.moe.num_experts / 2};
  const double two_state = two.memory.params + two.memory.grads + two.memory.moments;
  EXPECT_DOUBLE_EQ(two_state, 18.0 * double(build_param_layout(c.model, c.moe, half).total_numel()));
  EXPECT_LT(two_state, 0.6 * one_state);  // experts are most of olmoe-1b-7b
  const double rows = double(c.train.micro_batch * c.train.seq_len * c.moe.top_k);
  const double d = double(c.model.d_model);
  EXPECT_DOUBLE_EQ(two.memory.activations(), one.memory.activations());
  EXPECT_DOUBLE_EQ(two.memory.exchange - one.memory.exchange,
                   double(num_moe_layers(c.model)) * rows * (2 * d + 8) + 4 * rows * d);
}

// ZeRO-1 on GPUs: moments of the dense tensors over dp, of the local experts over ep-dp; the FP32
// master, BF16 copy and gradients stay whole on every rank.
TEST(RunPlan, GpuZeroShardsMomentsOverDpAndEpDp) {
  Config c;
  ASSERT_NO_THROW(c = load_config(std::string(MOECORE_SOURCE_DIR) + "/configs/olmoe-1b-7b.toml", {}));
  c.parallel.ep = 2;
  c.train.global_batch = 4 * c.train.micro_batch;  // four GPUs: dp 4, ep 2, ep-dp 2
  const RunPlan z = make_run_plan(c, 4, "cuda");
  c.parallel.zero = false;
  const RunPlan r = make_run_plan(c, 4, "cuda");
  EXPECT_TRUE(z.zero);
  EXPECT_FALSE(r.zero);
  EXPECT_EQ(z.ep_dp, 2);
  const ParamLayout layout = build_param_layout(c.model, c.moe, ExpertSlice{0, c.moe.num_experts / 2});
  double dense = 0, expert = 0;
  for (const FlatRange& f : flat_ranges(layout, false)) dense += double(f.end - f.begin);
  for (const FlatRange& f : flat_ranges(layout, true)) expert += double(f.end - f.begin);
  EXPECT_DOUBLE_EQ(z.memory.moments, 8.0 * (dense / 4 + expert / 2));
  EXPECT_DOUBLE_EQ(r.memory.moments, 8.0 * double(layout.total_numel()));
  EXPECT_DOUBLE_EQ(z.memory.params, r.memory.params);
  EXPECT_DOUBLE_EQ(z.memory.grads, r.memory.grads);
  EXPECT_NE(describe_run_plan(z).find("ZeRO-1"), std::string::npos);
  // One GPU: nothing to shard.
  c.parallel.zero = true;
  c.parallel.ep = 1;
  c.train.global_batch = c.train.micro_batch;
  EXPECT_FALSE(make_run_plan(c, 1, "cuda").zero);
}

// A GPU-only setting on the CPU backend is refused by the run plan, naming the key.
TEST(RunPlan, GpuOnlyGradReduceDtypeIsRefusedOnCpu) {
  Config c;
  c.parallel.grad_reduce_dtype = "bf16";
  const std::string err = error_of([&] { make_run_plan(c, 1, "cpu"); });
  EXPECT_NE(err.find("parallel.grad_reduce_dtype = \"bf16\" on train.device = \"cpu\""), std::string::npos) << err;
  EXPECT_NO_THROW(make_run_plan(c, 1, "cuda"));
}

// The batch arithmetic is derived once, for the world size; a bad layout fails with its arithmetic.
TEST(RunPlan, BatchArithmeticAndZeroShards) {
  Config c;
  c.train.global_batch = 16;
  c.train.micro_batch = 2;
  const RunPlan p = make_run_plan(c, 4, "cpu");
  EXPECT_EQ(p.sizes.dp, 4);
  EXPECT_EQ(p.micro_steps, 2);
  EXPECT_EQ(p.micro_batches, 8);
  EXPECT_EQ(p.tokens_per_step, 16 * c.train.seq_len);
  EXPECT_TRUE(p.zero);  // parallel.zero defaults on, dp > 1
  const RunPlan one = make_run_plan(c, 1, "cpu");
  EXPECT_FALSE(one.zero);
  EXPECT_LT(p.memory.moments, 0.3 * one.memory.moments);  // a quarter of the moments per rank (dense over 4 ranks)
  EXPECT_DOUBLE_EQ(p.memory.params, one.memory.params);
  EXPECT_NE(error_of([&] { make_run_plan(c, 3, "cpu"); }).find("16 % 6 = 4"), std::string::npos);
}

TEST(Cli, DryRunPrintsCountsAndConfig) {
  const CmdResult r = run_cli("train --dry-run");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("[model]"), std::string::npos);
  EXPECT_NE(r.output.find("# parameters"), std::string::npos);
  EXPECT_NE(r.output.find("# FLOPs per token"), std::string::npos);
  EXPECT_NE(r.output.find("# memory estimate"), std::string::npos);
  // Under --world N: the per-rank figures of N ranks.
  const CmdResult w = run_cli("train --dry-run --world 4 --train.global_batch=16 --train.micro_batch=2");
  EXPECT_EQ(w.status, 0) << w.output;
  EXPECT_NE(w.output.find("4 rank(s) on cpu: dp 4"), std::string::npos) << w.output;
  EXPECT_NE(w.output.find("dp 4 x micro-batch 2 x 2 micro-steps"), std::string::npos) << w.output;
  EXPECT_NE(w.output.find("ZeRO-1"), std::string::npos) << w.output;
}

// One bench for both backends: on the CPU its record carries the settings that change the figures,
// the phases of the one phase list and the step's figures.
TEST(Cli, BenchOnCpuRecordsSettingsAndPhases) {
  const TempDir tmp("bench");
  const std::string json = (tmp.root() / "bench.json").string();
  const CmdResult r = run_cli("bench --warmup 1 --steps 2 --json " + json + " --train.steps=3");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("tokens/s "), std::string::npos) << r.output;
  std::ifstream f(json);
  const nlohmann::json rec = nlohmann::json::parse(f);
  EXPECT_EQ(rec.at("device"), "cpu");
  for (const char* key : {"device", "precision", "fp8_scaling", "recompute", "routing", "capacity_factor", "ep_backend", "dp", "ep",
                          "pp", "zero", "overlap_grad_reduce"})
    EXPECT_TRUE(rec.at("settings").contains(key)) << key;
  EXPECT_EQ(rec.at("cuda_graph"), false);
  EXPECT_EQ(rec.at("timed_steps"), 2);
  EXPECT_GT(rec.at("tokens_per_s").get<double>(), 0.0);
  EXPECT_GT(rec.at("phase_ms").at("attention").get<double>(), 0.0);
  EXPECT_GT(rec.at("phase_ms").at("optimizer").get<double>(), 0.0);
  EXPECT_TRUE(rec.at("loss_finite").get<bool>());
  // A recompute mode runs and is recorded; a setting the backend cannot honour is refused by name.
  const std::string json2 = (tmp.root() / "bench-full.json").string();
  const CmdResult full = run_cli("bench --warmup 0 --steps 1 --json " + json2 + " --train.recompute=full");
  ASSERT_EQ(full.status, 0) << full.output;
  std::ifstream f2(json2);
  EXPECT_EQ(nlohmann::json::parse(f2).at("settings").at("recompute"), "full");
  const CmdResult bad = run_cli("bench --steps 1 --out= --train.precision=bf16 --train.device=cpu");
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.output.find("train.precision = \"bf16\""), std::string::npos) << bad.output;
}

// moecore sweep: every config that fits runs through the bench (its record in the sweep list, with
// the figures relative to the first), one that does not fit is listed with the reason; --inputs
// reaches each record's settings.
TEST(Cli, SweepRunsWhatFitsAndSaysWhyNot) {
  const TempDir tmp("sweep");
  const std::string tiny = std::string(MOECORE_SOURCE_DIR) + "/configs/tiny.toml";
  std::ifstream in(tiny);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto write = [&](const std::string& name, const std::string& from, const std::string& to) {
    std::string t = text;
    const size_t at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    t.replace(at, from.size(), to);
    const std::string path = (tmp.root() / name).string();
    std::ofstream(path) << t;
    return path;
  };
  const std::string e8 = write("tiny-e8.toml", "num_experts = 8", "num_experts = 8");
  const std::string e16 = write("tiny-e16.toml", "num_experts = 8", "num_experts = 16");
  const std::string huge = write("huge.toml", "d_model = 128", "d_model = 65536");
  const std::string json = (tmp.root() / "sweep.json").string();
  const CmdResult r = run_cli("sweep " + e8 + " " + huge + " " + e16 + " --warmup 0 --steps 1 --inputs zeros --json " +
                              json + " --train.steps=2");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("huge: not run: it needs about"), std::string::npos) << r.output;
  std::ifstream f(json);
  const nlohmann::json rec = nlohmann::json::parse(f);
  const nlohmann::json& list = rec.at("sweep");
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[0].at("config"), "tiny-e8");
  EXPECT_DOUBLE_EQ(list[0].at("tokens_per_s_per_device_vs_first").get<double>(), 1.0);
  EXPECT_EQ(list[1].at("config"), "huge");
  EXPECT_TRUE(list[1].at("skipped").get<bool>());
  EXPECT_NE(list[1].at("reason").get<std::string>().find("host memory"), std::string::npos);
  EXPECT_EQ(list[2].at("config"), "tiny-e16");
  EXPECT_GT(list[2].at("tokens_per_s_per_device_vs_first").get<double>(), 0.0);
  EXPECT_GT(list[2].at("total_params").get<int64_t>(), list[0].at("total_params").get<int64_t>());
  for (size_t i : {size_t(0), size_t(2)}) EXPECT_EQ(list[i].at("settings").at("inputs"), "zeros");
  // Zero weights: every router score ties, so the learned router sends every token to experts 0..k-1.
  EXPECT_GT(list[0].at("load_imbalance").get<double>(), 2.0);
  const CmdResult bad = run_cli("bench --steps 1 --out= --inputs ones");
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.output.find("--inputs must be random, zeros or corpus, got \"ones\""), std::string::npos) << bad.output;
}

// --inputs corpus: the embedded corpus through the trainer's loader (real text ids < 256).
TEST(Cli, BenchOnCorpusInputs) {
  const TempDir tmp("bench-corpus");
  const std::string json = (tmp.root() / "b.json").string();
  const CmdResult r = run_cli("bench --warmup 0 --steps 2 --inputs corpus --json " + json + " --train.steps=3");
  ASSERT_EQ(r.status, 0) << r.output;
  std::ifstream f(json);
  const nlohmann::json rec = nlohmann::json::parse(f);
  EXPECT_EQ(rec.at("settings").at("inputs"), "corpus");
  EXPECT_TRUE(rec.at("loss_finite").get<bool>());
}

TEST(Cli, HelpAndInspect) {
  EXPECT_EQ(run_cli("--help").status, 0);
  EXPECT_EQ(run_cli("train --help").status, 0);
  EXPECT_EQ(run_cli("inspect --help").status, 0);
  const TempDir tmp("inspect");
  const fs::path root = tmp.root();
  Config c = small_config(root / "run");
  c.train.steps = 1;
  std::ostringstream log;
  train(c, log);
  const CmdResult i = run_cli("inspect " + (root / "run" / "checkpoints").string());
  EXPECT_EQ(i.status, 0) << i.output;
  EXPECT_NE(i.output.find("step 1"), std::string::npos) << i.output;
  EXPECT_NE(i.output.find("model.layers.1.mlp.experts.gate_up_proj"), std::string::npos);
  EXPECT_NE(i.output.find("exp_avg_sq"), std::string::npos);
}

}  // namespace
}  // namespace moe::testing
