// The GPU benchmark loop of gpu_bench.h: memory check, device-side initialisation, warm-up and
// timed steps with at most two in flight (submit step s, then collect step s-1), two eager steps
// with the phase timer (the first fills the event pool, the second is reported), then the table
// and the JSON record. Tokens: splitmix64 streams per (seed, step, sequence), targets = next token.
#include "train/gpu_bench.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>

#include "core/error.h"
#include "model/layout.h"

#ifdef MOECORE_HAS_CUDA
#include <array>
#include <chrono>
#include <string>
#include <vector>

#include "cuda/event_timer.h"
#include "cuda/ops/device_info.h"
#include "cuda/ops/init.h"
#include "cuda/ops/memory.h"
#include "data/dataset.h"
#include "model/cuda_model.h"
#include "optim/adamw.h"
#include "train/cuda_step.h"
#include "train/metrics.h"
#endif

namespace moe {

GpuMemoryEstimate estimate_gpu_memory(const Config& cfg) {
  GpuMemoryEstimate est;
  est.total_params = count_model(cfg.model, cfg.moe, cfg.train.seq_len).total_params;
  est.micro_batch_tokens = cfg.train.micro_batch * cfg.train.seq_len;
  est.state_bytes = 18.0 * double(est.total_params);
  est.activation_bytes = 2.0 * double(activation_elements(cfg.model, cfg.moe, est.micro_batch_tokens));
  return est;
}

#ifndef MOECORE_HAS_CUDA

nlohmann::json run_gpu_bench(const Config&, const BenchOptions&, std::ostream&) {
  MOE_FAIL("the GPU bench needs a build with the CUDA backend (cmake --preset cuda)");
}

#else

namespace {

constexpr double kGiB = double(1ull << 30);
constexpr uint64_t kTokenStream = 0x62656E6368746F6Bull;  // separates bench tokens from other seeds

uint64_t splitmix64_next(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The micro-batches of step `step` (1-based): sequence j of micro-batch m is seq_len + 1 tokens
// of the splitmix64 stream mix_seed(mix_seed(seed ^ kTokenStream, step), m * micro_batch + j),
// each uniform in [0, vocab) by multiply-shift of the high 32 bits; targets = inputs shifted by one.
void fill_synthetic_step(std::vector<Batch>& micro, int64_t step, const Config& cfg) {
  const int64_t seq = cfg.train.seq_len, mb = cfg.train.micro_batch;
  const uint64_t vocab = static_cast<uint64_t>(cfg.model.vocab_size);
  const uint64_t step_seed = mix_seed(cfg.train.seed ^ kTokenStream, static_cast<uint64_t>(step));
  for (size_t m = 0; m < micro.size(); ++m) {
    Batch& b = micro[m];
    b.batch = step - 1;
    b.seq_len = seq;
    b.inputs.resize(static_cast<size_t>(mb * seq));
    b.targets.resize(static_cast<size_t>(mb * seq));
    for (int64_t j = 0; j < mb; ++j) {
      uint64_t state = mix_seed(step_seed, static_cast<uint64_t>(int64_t(m) * mb + j));
      auto draw = [&] { return static_cast<int32_t>(((splitmix64_next(state) >> 32) * vocab) >> 32); };
      int32_t prev = draw();
      for (int64_t t = 0; t < seq; ++t) {
        const int32_t next = draw();
        b.inputs[j * seq + t] = prev;
        b.targets[j * seq + t] = next;
        prev = next;
      }
    }
  }
}

double step_loss(const StepStats& s) {
  return s.num_targets > 0 ? s.ce_sum / double(s.num_targets) : std::nan("");
}

std::string gib_str(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", bytes / kGiB);
  return buf;
}

}  // namespace

nlohmann::json run_gpu_bench(const Config& cfg, const BenchOptions& opt, std::ostream& out) {
  MOE_CHECK(opt.steps >= 1, "bench: --steps must be >= 1, got ", opt.steps);
  MOE_CHECK(opt.warmup >= 0, "bench: --warmup must be >= 0, got ", opt.warmup);
  MOE_CHECK(cfg.train.global_batch % cfg.train.micro_batch == 0, "bench: train.global_batch (",
            cfg.train.global_batch, ") must be a multiple of train.micro_batch (", cfg.train.micro_batch, ")");
  const int64_t seq = cfg.train.seq_len, mb = cfg.train.micro_batch;
  const int64_t micro_steps = cfg.train.global_batch / mb;
  const int64_t tokens_per_step = cfg.train.global_batch * seq;
  const ModelCounts counts = count_model(cfg.model, cfg.moe, seq);

  // Refuse what cannot fit before allocating anything.
  const cuda::DeviceInfo dev = cuda::device_info();
  const GpuMemoryEstimate est = estimate_gpu_memory(cfg);
  MOE_CHECK(est.total_bytes() <= double(dev.free_bytes), "bench: config '", opt.config_name, "' does not fit on one ",
            dev.name, ": it needs about ", gib_str(est.total_bytes()), " GiB (", est.total_params, " parameters x 18 B = ",
            gib_str(est.state_bytes), " GiB of FP32 weights, BF16 copy, FP32 gradients and two AdamW moments, plus ~",
            gib_str(est.activation_bytes), " GiB of activations for a micro-batch of ", est.micro_batch_tokens,
            " tokens) but the GPU has ", gib_str(double(dev.free_bytes)), " GiB free of ",
            gib_str(double(dev.total_bytes)),
            " GiB; use a config with fewer layers or experts (configs/olmoe-8l.toml fits one H200) or lower "
            "train.micro_batch / train.seq_len");
  const size_t used_before = cuda::device_used_bytes();
  cuda::reset_device_peak_bytes();

  CudaStepRunner runner(cfg);
  CudaModel& model = runner.model();
  cuda::init_params(model.layout(), model.params(), cfg.train.seed, cfg.model.init_std, model.stream());
  model.refresh_bf16();
  model.load_expert_bias(std::vector<float>(size_t(model.num_moe_layers() * cfg.moe.num_experts), 0.0f));
  cuda::stream_sync(model.stream());

  const int64_t profile_steps = 2;  // the first fills the timer's event pool; the second is reported
  const int64_t total_steps = opt.warmup + opt.steps + profile_steps;
  std::vector<Batch> micro(static_cast<size_t>(micro_steps));  // submit() stages the ids in pinned memory
  int64_t step = 0, skipped = 0;
  StepStats first, last;
  auto submit_next = [&] {
    ++step;
    fill_synthetic_step(micro, step, cfg);
    runner.submit(step, micro, tokens_per_step, lr_at(cfg.optim, step - 1, total_steps), cfg.train.seed);
  };
  auto collect_one = [&] {
    StepStats s = runner.collect();
    if (s.step == 1) first = s;
    skipped += s.skipped ? 1 : 0;
    last = std::move(s);
  };
  auto run_steps = [&](int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      submit_next();
      if (runner.pending() >= 2) collect_one();
    }
    while (runner.pending() > 0) collect_one();
  };

  using Clock = std::chrono::steady_clock;
  run_steps(opt.warmup);
  const auto t0 = Clock::now();
  run_steps(opt.steps);
  const double timed_s = std::chrono::duration<double>(Clock::now() - t0).count();

  // Phase profile: eager steps (set_phase_timer turns the graph off while set).
  cuda::EventTimer timer(model.stream());
  runner.set_phase_timer(&timer);
  std::array<double, cuda::kNumPhases> phase_ms{};
  double profiled_ms = 0;
  for (int64_t i = 0; i < profile_steps; ++i) {
    const auto p0 = Clock::now();
    run_steps(1);
    profiled_ms = 1e3 * std::chrono::duration<double>(Clock::now() - p0).count();
    phase_ms = timer.collect();
  }
  runner.set_phase_timer(nullptr);
  const size_t used_after = cuda::device_used_bytes();
  const size_t peak_bytes = cuda::device_peak_bytes();
  const int64_t graph_launches = runner.graph_launches();

  const double step_ms = 1e3 * timed_s / double(opt.steps);
  const double tps = double(tokens_per_step) * double(opt.steps) / timed_s;
  const double tflops = counts.flops_per_token * tps / 1e12;
  const double mfu = tflops / kGpuPeakTflops;
  double phase_sum = 0;
  for (const double ms : phase_ms) phase_sum += ms;
  const double imbalance = load_imbalance(last.tokens_per_expert);
  const double first_loss = step_loss(first), last_loss = step_loss(last);
  const bool loss_finite = std::isfinite(last_loss);
  const bool graph = runner.uses_graph();

  nlohmann::json phases = nlohmann::json::object(), scaled = nlohmann::json::object();
  for (int p = 0; p < cuda::kNumPhases; ++p) {
    const char* name = cuda::phase_name(static_cast<cuda::Phase>(p));
    phases[name] = phase_ms[p];
    scaled[name] = phase_sum > 0 ? phase_ms[p] / phase_sum * step_ms : 0.0;
  }
  const std::string date = utc_date();
  nlohmann::json rec = {
      {"config", opt.config_name},
      {"device", "gpu"},
      {"gpu",
       {{"name", dev.name},
        {"compute_capability", std::to_string(dev.cc_major) + "." + std::to_string(dev.cc_minor)},
        {"sm_count", dev.sm_count},
        {"memory_gib", double(dev.total_bytes) / kGiB}}},
      {"num_gpus", 1},
      {"commit", bench_commit()},
      {"command", opt.command},
      {"date", date},
      {"warmup_steps", opt.warmup},
      {"timed_steps", opt.steps},
      {"seq_len", seq},
      {"micro_batch", mb},
      {"micro_batches_per_step", micro_steps},
      {"tokens_per_step", tokens_per_step},
      {"cuda_graph", graph},
      {"graph_launches", graph_launches},
      {"step_ms", {{"mean", step_ms}}},
      {"step_ms_source", "wall clock from the first timed submit to the last collect, divided by timed_steps"},
      {"tokens_per_s", tps},
      {"tokens_per_s_per_gpu", tps},
      {"flops_per_token", counts.flops_per_token},
      {"tflops_per_gpu", tflops},
      {"peak_tflops", kGpuPeakTflops},
      {"mfu", mfu},
      {"phase_ms", phases},
      {"phase_ms_scaled_to_step", scaled},
      {"phase_sum_ms", phase_sum},
      {"profiled_step_ms", profiled_ms},
      {"phase_source", "CUDA events around each phase of one eager step (after one eager warm step)"},
      {"mem_peak_gib", double(peak_bytes) / kGiB},
      {"mem_peak_source", "high-water mark of moecore's device allocations (cuda::device_peak_bytes)"},
      {"mem_used_gib", double(used_after) / kGiB},
      {"mem_used_source", "cudaMemGetInfo total - free after the run (CUDA context, cuBLASLt and other processes included)"},
      {"mem_bench_gib", double(used_after - std::min(used_after, used_before)) / kGiB},
      {"mem_estimate_gib", est.total_bytes() / kGiB},
      {"load_imbalance", imbalance},
      {"moe_layers", int64_t(last.tokens_per_expert.size())},
      {"first_loss", first_loss},
      {"last_loss", last_loss},
      {"loss_finite", loss_finite},
      {"last_grad_norm", last.grad_norm},
      {"skipped_steps", skipped},
      {"total_params", counts.total_params},
      {"active_params", counts.active_params}};

  char buf[320];
  std::snprintf(buf, sizeof buf,
                "moecore bench %s on %s (%d SMs, %.1f GiB), %lld timed steps after %lld warm-up, CUDA graph %s "
                "(%lld launches)\n",
                opt.config_name.c_str(), dev.name.c_str(), dev.sm_count, double(dev.total_bytes) / kGiB,
                (long long)opt.steps, (long long)opt.warmup, graph ? "on" : "off", (long long)graph_launches);
  out << buf;
  std::snprintf(buf, sizeof buf, "  %.3gB parameters (%.3gB active), %lld tokens/step (%lld x %lld x %lld)\n",
                double(counts.total_params) / 1e9, double(counts.active_params) / 1e9, (long long)tokens_per_step,
                (long long)micro_steps, (long long)mb, (long long)seq);
  out << buf;
  std::snprintf(buf, sizeof buf, "  %-12s %12s %8s %14s\n", "phase", "eager ms", "share", "ms of step");
  out << buf;
  for (int p = 0; p < cuda::kNumPhases; ++p) {
    const char* name = cuda::phase_name(static_cast<cuda::Phase>(p));
    std::snprintf(buf, sizeof buf, "  %-12s %12.2f %7.1f%% %14.2f\n", name, phase_ms[p],
                  phase_sum > 0 ? 100.0 * phase_ms[p] / phase_sum : 0.0, scaled[name].get<double>());
    out << buf;
  }
  std::snprintf(buf, sizeof buf, "  %-12s %12.2f %7.1f%% %14.2f   (eager step %.2f ms wall; timed step %.2f ms)\n",
                "sum", phase_sum, 100.0, step_ms, profiled_ms, step_ms);
  out << buf;
  std::snprintf(buf, sizeof buf, "tokens/s/GPU %.0f | TFLOP/s/GPU %.1f | MFU %.1f%% (of %.0f) | step %.2f ms\n", tps,
                tflops, 100.0 * mfu, kGpuPeakTflops, step_ms);
  out << buf;
  std::snprintf(buf, sizeof buf,
                "memory: peak %.2f GiB allocated (device_alloc high-water mark) | %.2f GiB in use after the run "
                "(cudaMemGetInfo total - free; %.2f GiB more than before the run) | estimate %.2f GiB\n",
                double(peak_bytes) / kGiB, double(used_after) / kGiB, rec["mem_bench_gib"].get<double>(),
                est.total_bytes() / kGiB);
  out << buf;
  std::snprintf(buf, sizeof buf,
                "expert load: max/mean tokens per expert %.3f (mean over %zu MoE layers, step %lld) | loss %.4f "
                "(step 1) -> %.4f (step %lld)%s | skipped steps %lld\n",
                imbalance, last.tokens_per_expert.size(), (long long)last.step, first_loss, last_loss,
                (long long)last.step, loss_finite ? "" : " NOT FINITE", (long long)skipped);
  out << buf;
  write_bench_record(rec, opt, "gpu", date, out);
  return rec;
}

#endif  // MOECORE_HAS_CUDA

}  // namespace moe
