// The trainer on the CUDA backend (BF16) follows the CPU reference (FP32) loss curve: the same
// config, data, initial weights and schedule for 20 steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "e2e/cli_util.h"
#include "gpu/gpu_test_util.h"
#include "support/test_util.h"
#include "train/device.h"
#include "train/trainer.h"

namespace moe::testing {
namespace {

Config small(const std::filesystem::path& run, const std::string& device, const std::string& precision) {
  Config c = small_gpu_train_config(run, /*micro_batch=*/4, /*steps=*/20, device, precision);
  c.train.eval_interval = 10;
  c.optim.warmup_steps = 5;
  return c;
}

TEST(CudaTrain, FollowsCpuLossCurve) {
  MOE_SKIP_WITHOUT_GPU();
  const TempDir tmp("cuda_train");
  std::ostringstream log;
  const TrainSummary cpu = train(small(tmp / "cpu", "cpu", "fp32"), log);
  const TrainSummary gpu = train(small(tmp / "gpu", "cuda", "bf16"), log);
  const std::vector<double> a = train_losses(tmp / "cpu"), b = train_losses(tmp / "gpu");
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 20u);
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double rel = std::abs(a[i] - b[i]) / a[i];
    std::printf("step %2zu loss cpu %.5f cuda %.5f rel diff %.2e\n", i + 1, a[i], b[i], rel);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 3e-2) << "step " << i + 1;
  }
  std::printf("worst relative loss difference %.3e; eval loss cpu %.4f -> %.4f, cuda %.4f -> %.4f\n", worst,
              cpu.initial_eval_loss, cpu.final_eval_loss, gpu.initial_eval_loss, gpu.final_eval_loss);
  EXPECT_LT(b.back(), 0.9 * b.front());  // it trains
  EXPECT_FALSE(gpu.last_checkpoint.empty());
}

// optim.moment_dtype = "bf16" on the GPU (the moments as BF16 bits): the loss follows the CPU
// reference with BF16 moments, a run resumed from its step-10 checkpoint (the moments widened to
// FP32 in the checkpoint, rounded again on load) is the straight run bit for bit, and the run is
// not the FP32 moments' run.
TEST(CudaTrain, Bf16MomentsFollowCpuAndResumeBitExact) {
  MOE_SKIP_WITHOUT_GPU();
  const TempDir tmp("cuda_bf16_moments");
  std::ostringstream log;
  auto config = [&](const char* name, const char* device, const char* precision, const char* moments) {
    Config c = small(tmp / name, device, precision);
    c.optim.moment_dtype = moments;
    c.checkpoint.interval = 10;
    return c;
  };
  train(config("cpu", "cpu", "fp32", "bf16"), log);
  train(config("gpu", "cuda", "bf16", "bf16"), log);
  train(config("gpu_fp32", "cuda", "bf16", "fp32"), log);
  Config resume = config("resumed", "cuda", "bf16", "bf16");
  resume.checkpoint.resume = (tmp / "gpu" / "checkpoints" / "step_10").string();
  resume.checkpoint.dir = (tmp / "resumed_ckpt").string();
  const TrainSummary r = train(resume, log);
  EXPECT_EQ(r.start_step, 10);
  const std::vector<double> cpu = train_losses(tmp / "cpu"), gpu = train_losses(tmp / "gpu"),
                            gpu32 = train_losses(tmp / "gpu_fp32"), resumed = train_losses(tmp / "resumed");
  ASSERT_EQ(cpu.size(), 20u);
  ASSERT_EQ(gpu.size(), 20u);
  ASSERT_EQ(gpu32.size(), 20u);
  ASSERT_EQ(resumed.size(), 10u);
  for (size_t i = 0; i < 20; ++i) {
    const double rel = std::abs(cpu[i] - gpu[i]) / cpu[i];
    std::printf("step %2zu loss cpu %.5f cuda %.5f (fp32 moments %.5f) rel diff %.2e\n", i + 1, cpu[i], gpu[i],
                gpu32[i], rel);
    EXPECT_LE(rel, 3e-2) << "step " << i + 1;
  }
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(resumed[i], gpu[10 + i]) << "step " << 11 + i;
  EXPECT_NE(gpu, gpu32) << "optim.moment_dtype changed nothing on the GPU";
  EXPECT_LT(gpu.back(), 0.9 * gpu.front());  // it trains
}

// Capacity and random routing on the GPU trainer (the CUDA graph on): the loss follows the CPU
// reference, and each record's dropped_frac is the CPU's (random routing draws the same experts,
// the same routes are dropped).
TEST(CudaTrain, CapacityFollowsCpuAndLogsDroppedRoutes) {
  MOE_SKIP_WITHOUT_GPU();
  const TempDir tmp("cuda_capacity");
  auto config = [&](const char* name, const char* device, const char* precision) {
    Config c = small(tmp / name, device, precision);
    c.train.steps = 8;
    c.train.eval_interval = 0;
    c.moe.routing = "random";
    c.moe.capacity_factor = 1.0;
    c.log.interval = 1;
    return c;
  };
  std::ostringstream log;
  train(config("cpu", "cpu", "fp32"), log);
  train(config("gpu", "cuda", "bf16"), log);
  const std::vector<nlohmann::json> a = read_metrics(tmp / "cpu"), b = read_metrics(tmp / "gpu");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  for (size_t i = 0; i < a.size(); ++i) {
    const double la = a[i].at("loss").get<double>(), lb = b[i].at("loss").get<double>();
    const double da = a[i].at("dropped_frac").get<double>(), db = b[i].at("dropped_frac").get<double>();
    std::printf("step %zu loss cpu %.5f cuda %.5f, dropped_frac cpu %.5f cuda %.5f\n", i + 1, la, lb, da, db);
    EXPECT_LE(std::abs(la - lb) / la, 3e-2) << "step " << i + 1;
    EXPECT_GT(db, 0.0) << "step " << i + 1;
    EXPECT_DOUBLE_EQ(da, db) << "step " << i + 1;
    // Per MoE layer (the device record's per-layer counts, drops, losses and the bias copy): the
    // same experts and drops, so the same counts, drop shares and bias; lb/z to the BF16 bound.
    const nlohmann::json &ma = a[i].at("moe"), &mb = b[i].at("moe");
    ASSERT_EQ(ma.size(), mb.size());
    ASSERT_GT(mb.size(), 0u);
    for (size_t l = 0; l < ma.size(); ++l) {
      const std::string at = "step " + std::to_string(i + 1) + " layer " + std::to_string(l);
      EXPECT_EQ(ma[l].at("tokens_per_expert"), mb[l].at("tokens_per_expert")) << at;
      EXPECT_DOUBLE_EQ(ma[l].at("dropped_frac").get<double>(), mb[l].at("dropped_frac").get<double>()) << at;
      EXPECT_DOUBLE_EQ(ma[l].at("bias_abs_max").get<double>(), mb[l].at("bias_abs_max").get<double>()) << at;
      EXPECT_DOUBLE_EQ(ma[l].at("bias_abs_mean").get<double>(), mb[l].at("bias_abs_mean").get<double>()) << at;
      const double la = ma[l].at("lb_loss").get<double>(), lb = mb[l].at("lb_loss").get<double>();
      EXPECT_LE(std::abs(la - lb), 2e-2 * std::abs(la)) << at;
    }
  }
}

// log.trace on the GPU: steps 2 and 3 run eagerly with CUDA events; trace.json holds their phases
// only, in order, non-negative, each step's phases within its measured time; their metrics
// records carry phase_ms and the others (graph steps, log.phase_times off) do not.
TEST(CudaTrain, TraceWindowRecordsEagerSteps) {
  MOE_SKIP_WITHOUT_GPU();
  const TempDir tmp("cuda_trace");
  Config c = small(tmp / "gpu", "cuda", "bf16");
  c.train.steps = 6;
  c.train.eval_interval = 0;
  c.log.interval = 1;
  c.log.trace = "2:3";
  std::ostringstream log;
  train(c, log);
  EXPECT_NE(log.str().find("the CUDA graph resumes at step 4"), std::string::npos) << log.str();
  for (const auto& r : read_metrics(tmp / "gpu")) {
    if (!r.contains("loss")) continue;
    const int64_t step = r["step"].get<int64_t>();
    EXPECT_EQ(r.contains("phase_ms"), step == 2 || step == 3) << r.dump();
  }
  std::ifstream f(tmp / "gpu" / "trace.json");
  ASSERT_TRUE(f.good());
  const nlohmann::json doc = nlohmann::json::parse(f);
  std::map<int64_t, double> phase_us, step_us;
  std::map<int64_t, std::pair<double, double>> bar, span;  // step -> [begin, end) us
  std::set<std::string> names;
  double last_ts = -1;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] != "X") continue;
    const double ts = e["ts"].get<double>(), d = e["dur"].get<double>();
    EXPECT_GE(ts, last_ts);
    last_ts = ts;
    EXPECT_GE(d, 0.0);
    const int64_t step = e["args"]["step"].get<int64_t>();
    EXPECT_TRUE(step == 2 || step == 3) << step;
    if (e["cat"] == "phase") {
      phase_us[step] += d;
      names.insert(e["name"].get<std::string>());
      auto& sp = span.try_emplace(step, ts, ts + d).first->second;
      sp.first = std::min(sp.first, ts);
      sp.second = std::max(sp.second, ts + d);
    } else {
      step_us[step] = d;
      bar[step] = {ts, ts + d};
    }
  }
  // The step bars line up with the device's phases of the same step (the loop collects a GPU step
  // one submit later, which must not shift them).
  for (const auto& [step, sp] : span) {
    EXPECT_NEAR(bar[step].first, sp.first, 1e-3) << "step " << step;
    EXPECT_NEAR(bar[step].second, sp.second, 1e-3) << "step " << step;
  }
  for (const char* p : {"embedding", "attention", "router", "dispatch", "experts", "combine", "lm_head", "optimizer"})
    EXPECT_TRUE(names.count(p)) << p;
  ASSERT_EQ(phase_us.size(), 2u);
  for (const auto& [step, us] : phase_us) {
    EXPECT_GT(us, 0.0);
    EXPECT_LE(us, 1.1 * step_us[step]) << "step " << step;
  }
}

TEST(CudaTrain, DeviceResolution) {
  TrainConfig t;
  t.device = "cpu";
  t.precision = "bf16";
  EXPECT_NE(error_of([&] { resolve_device(t); }).find("train.precision"), std::string::npos);
  t.precision = "fp32";
  EXPECT_EQ(resolve_device(t), "cpu");
  t.device = "auto";
  EXPECT_EQ(resolve_device(t), "cpu");  // fp32 always runs on the cpu backend
  if (gpu_available()) {
    t.precision = "bf16";
    EXPECT_EQ(resolve_device(t), "cuda");
    t.precision = "fp8";  // the FP8 recipe runs on the GPU when there is one
    EXPECT_EQ(resolve_device(t), "cuda");
    t.device = "cuda";
    EXPECT_EQ(resolve_device(t), "cuda");
    t.precision = "fp32";
    EXPECT_NE(error_of([&] { resolve_device(t); }).find("train.precision"), std::string::npos);
  }
}

std::vector<float> read_f32(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<float> v(std::filesystem::file_size(p) / sizeof(float));
  in.read(reinterpret_cast<char*>(v.data()), std::streamsize(v.size() * sizeof(float)));
  return v;
}

nlohmann::json last_json(const std::string& out) {
  std::istringstream in(out);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty() && line[0] == '{') last = line;
  return last.empty() ? nlohmann::json() : nlohmann::json::parse(last);
}

// `moecore generate` on a checkpoint the GPU trained (bf16): auto runs it on the GPU, greedy is
// deterministic there, every id is the argmax of its logits, and the first logits (the prompt's
// last position) follow the CPU model's (--device cpu) to BF16 accuracy.
TEST(CudaGenerate, CliRunsOnTheGpuAndFollowsTheCpu) {
  MOE_SKIP_WITHOUT_GPU();
  const TempDir tmp("cuda_generate");
  std::ostringstream log;
  const TrainSummary s = train(small(tmp / "gpu", "cuda", "bf16"), log);
  ASSERT_FALSE(s.last_checkpoint.empty());
  auto gen = [&](const std::string& extra, const std::string& name) -> std::pair<nlohmann::json, std::vector<float>> {
    const std::filesystem::path out = tmp / name;
    const CmdResult r = run_cli("generate " + s.last_checkpoint + " --prompt 'The cat' --max-new-tokens 16 --json " +
                                "--logits-out " + out.string() + " " + extra);
    EXPECT_EQ(r.status, 0) << r.output;
    if (r.status != 0) return {};
    return {last_json(r.output), read_f32(out)};
  };
  const auto [a, la] = gen("", "a.f32");
  const auto [b, lb] = gen("--device cuda", "b.f32");
  const auto [c, lc] = gen("--device cpu", "c.f32");
  ASSERT_FALSE(a.is_null());
  ASSERT_FALSE(c.is_null());
  EXPECT_EQ(a["device"], "cuda");
  EXPECT_EQ(c["device"], "cpu");
  EXPECT_EQ(a["ids"], b["ids"]);
  EXPECT_EQ(la, lb);
  const int64_t v = 256;
  const size_t n = a["ids"].size();
  ASSERT_EQ(la.size(), n * v);
  for (size_t k = 0; k < n; ++k) {
    const float* row = la.data() + k * v;
    EXPECT_EQ(a["ids"][k].get<int64_t>(), std::max_element(row, row + v) - row);
  }
  const std::vector<float> g(la.begin(), la.begin() + v), want(lc.begin(), lc.begin() + v);
  double num = 0, den = 0;
  for (int64_t i = 0; i < v; ++i) {
    num += (double(g[i]) - want[i]) * (double(g[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  const double diff = std::sqrt(num / den);
  std::printf("first logits GPU vs CPU: normwise %.3e; ids gpu %s cpu %s\n", diff, a["ids"].dump().c_str(),
              c["ids"].dump().c_str());
  EXPECT_LE(diff, 3e-2);
  const CmdResult bad = run_cli("generate " + s.last_checkpoint + " --prompt x --device tpu");
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.output.find("--device: expected auto, cpu or cuda, got 'tpu'"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace moe::testing
