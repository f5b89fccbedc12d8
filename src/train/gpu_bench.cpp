// The GPU benchmark loop of gpu_bench.h: (several ranks: GPU binding and the NCCL group), memory
// check, device-side initialisation, warm-up and timed steps with at most two in flight (submit
// step s, then collect step s-1), two eager steps with the phase timer (the first fills the event
// pool, the second is reported), then the table and the JSON record. Tokens: splitmix64 streams
// per (seed, step, sequence of the global batch), targets = next token. With --parallel.ep=N the
// experts are split over ep groups; the profiled step adds dispatch/combine time and bytes moved.
#include "train/gpu_bench.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>

#include "core/error.h"
#include "model/layout.h"
#include "parallel/comm.h"

#ifdef MOECORE_HAS_CUDA
#include <array>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "cuda/event_timer.h"
#include "cuda/ops/device_info.h"
#include "cuda/ops/init.h"
#include "cuda/ops/memory.h"
#include "cuda/ops/nccl.h"
#include "data/dataset.h"
#include "model/cuda_model.h"
#include "optim/adamw.h"
#include "parallel/nccl_comm.h"
#include "parallel/topology.h"
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
  const int64_t ep = cfg.parallel.ep;
  if (ep > 1 && cfg.moe.num_experts % ep == 0) {
    // Parameter state of one GPU's share (its experts only), and the exchange buffers CudaModel
    // adds per MoE layer (received BF16 rows, regroup and ungroup maps) and once (two row buffers).
    const ExpertSlice slice{0, cfg.moe.num_experts / ep};
    est.state_bytes = 18.0 * double(build_param_layout(cfg.model, cfg.moe, slice).total_numel());
    const double rows = double(est.micro_batch_tokens) * double(cfg.moe.top_k);
    const double d = double(cfg.model.d_model);
    est.activation_bytes += double(num_moe_layers(cfg.model)) * rows * (2.0 * d + 8.0) + 2.0 * rows * 2.0 * d;
  }
  return est;
}

#ifndef MOECORE_HAS_CUDA

nlohmann::json run_gpu_bench(const Config&, const BenchOptions&, std::ostream&, Comm*) {
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

// The micro-batches of step `step` (1-based) from micro-batch `first_micro` of the global batch on:
// sequence j of global micro-batch g is seq_len + 1 tokens of the splitmix64 stream
// mix_seed(mix_seed(seed ^ kTokenStream, step), g * micro_batch + j), each uniform in [0, vocab) by
// multiply-shift of the high 32 bits; targets = inputs shifted by one.
void fill_synthetic_step(std::vector<Batch>& micro, int64_t step, const Config& cfg, int64_t first_micro) {
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
      uint64_t state = mix_seed(step_seed, static_cast<uint64_t>((first_micro + int64_t(m)) * mb + j));
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

nlohmann::json run_gpu_bench(const Config& cfg_in, const BenchOptions& opt, std::ostream& console, Comm* world) {
  MOE_CHECK(opt.steps >= 1, "bench: --steps must be >= 1, got ", opt.steps);
  MOE_CHECK(opt.warmup >= 0, "bench: --warmup must be >= 0, got ", opt.warmup);
  MOE_CHECK(cfg_in.train.global_batch % cfg_in.train.micro_batch == 0, "bench: train.global_batch (",
            cfg_in.train.global_batch, ") must be a multiple of train.micro_batch (", cfg_in.train.micro_batch, ")");
  const int64_t dp = world ? world->size() : 1;
  const int64_t rank = world ? world->rank() : 0;
  std::ostream null_out(nullptr);  // ranks other than 0 print nothing
  std::ostream& out = rank == 0 ? console : null_out;
  // Data parallel: every GPU runs the one-GPU step's micro-batches; the global batch grows with dp.
  Config cfg = cfg_in;
  LocalRank local;
  if (dp > 1) {
    MOE_CHECK(cfg.parallel.dp == 0 || cfg.parallel.dp == dp, "bench: parallel.dp = ", cfg.parallel.dp, " but the job has ",
              dp, " ranks; the GPU bench is data parallel over every rank: set parallel.dp = 0");
    MOE_CHECK(cfg.parallel.pp == 1, "bench: parallel.pp = ", cfg.parallel.pp, ": no pipeline parallelism yet");
    cfg.train.global_batch *= dp;
    bind_local_gpu(*world, &local);  // before anything touches a GPU
  }
  const int64_t ep = std::max<int64_t>(1, cfg.parallel.ep);
  MOE_CHECK(ep == 1 || (dp % ep == 0 && cfg.moe.num_experts % ep == 0), "bench: parallel.ep = ", ep,
            " must divide the number of GPUs (", dp, ") and moe.num_experts (", cfg.moe.num_experts, ")");
  const int64_t seq = cfg.train.seq_len, mb = cfg.train.micro_batch;
  const int64_t micro_steps = cfg.train.global_batch / (dp * mb);  // per GPU
  const int64_t tokens_per_step = cfg.train.global_batch * seq;    // all GPUs
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

  std::unique_ptr<cuda::NcclComm> nccl, nccl_ep, nccl_ep_dp;
  if (dp > 1) nccl = make_nccl_comm(*world);
  ExpertParallelGroups groups;
  if (ep > 1) {
    groups = split_expert_parallel(*world, ep);
    nccl_ep = make_nccl_comm(*groups.ep);
    if (groups.ep_dp->size() > 1) nccl_ep_dp = make_nccl_comm(*groups.ep_dp);
  }
  cfg.parallel.ep = ep;
  CudaStepRunner runner(cfg, nccl.get(), nccl_ep.get(), nccl_ep_dp.get());
  CudaModel& model = runner.model();
  // The same seed on every rank: replicas start identical (each GPU's experts at their offsets).
  model.init_params_device(cfg.train.seed, cfg.model.init_std);
  model.load_expert_bias(std::vector<float>(size_t(model.num_moe_layers() * cfg.moe.num_experts), 0.0f));
  cuda::stream_sync(model.stream());

  const int64_t profile_steps = 2;  // the first fills the timer's event pool; the second is reported
  const int64_t total_steps = opt.warmup + opt.steps + profile_steps;
  std::vector<Batch> micro(static_cast<size_t>(micro_steps));  // submit() stages the ids in pinned memory
  int64_t step = 0, skipped = 0;
  StepStats first, last;
  auto submit_next = [&] {
    ++step;
    fill_synthetic_step(micro, step, cfg, rank * micro_steps);
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
  if (world && dp > 1) world->barrier();  // the timed steps start together on every host
  const auto t0 = Clock::now();
  run_steps(opt.steps);
  double timed_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (world && dp > 1) world->all_reduce(&timed_s, 1, ReduceOp::kMax);  // the slowest rank's

  // Phase profile: eager steps (set_phase_timer turns the graph off while set), on every rank.
  cuda::EventTimer timer(model.stream());
  runner.set_phase_timer(&timer);
  std::array<double, cuda::kNumPhases> phase_ms{};
  double profiled_ms = 0;
  EpTraffic traffic;
  for (int64_t i = 0; i < profile_steps; ++i) {
    model.reset_ep_traffic();
    const auto p0 = Clock::now();
    run_steps(1);
    profiled_ms = 1e3 * std::chrono::duration<double>(Clock::now() - p0).count();
    phase_ms = timer.collect();
    traffic = model.ep_traffic();
  }
  runner.set_phase_timer(nullptr);
  // The gradient all-reduce alone (every rank): one reduction of the whole FP32 gradient buffer,
  // as the step without overlap runs it, for the bandwidth figure.
  double full_reduce_ms = 0, reduce_bytes = 0;
  if (dp > 1) full_reduce_ms = runner.time_grad_all_reduce(&reduce_bytes);
  const size_t used_after = cuda::device_used_bytes();
  double peak_bytes = double(cuda::device_peak_bytes());
  if (world && dp > 1) world->all_reduce(&peak_bytes, 1, ReduceOp::kMax);  // the fullest GPU
  const int64_t graph_launches = runner.graph_launches();

  const double step_ms = 1e3 * timed_s / double(opt.steps);
  const double tps = double(tokens_per_step) * double(opt.steps) / timed_s;
  const double tps_gpu = tps / double(dp);
  const double tflops = counts.flops_per_token * tps_gpu / 1e12;  // per GPU
  const double mfu = tflops / kGpuPeakTflops;
  double phase_sum = 0;
  for (const double ms : phase_ms) phase_sum += ms;
  const double imbalance = load_imbalance(last.tokens_per_expert);
  const double first_loss = step_loss(first), last_loss = step_loss(last);
  const bool loss_finite = std::isfinite(last_loss);
  const bool graph = runner.uses_graph();
  // Gradient all-reduce: the part of the profiled step that waits for it after backward (all of it
  // without overlap), and the timed reduction of the whole buffer with its algorithm and bus
  // bandwidth as nccl-tests define them (busbw = algbw x 2 (n - 1) / n).
  const double reduce_ms = phase_ms[int(cuda::Phase::kGradReduce)];
  const bool overlapped = dp > 1 && cfg.parallel.overlap_grad_reduce && ep == 1;
  const double algbw = dp > 1 && full_reduce_ms > 0 ? reduce_bytes / (full_reduce_ms * 1e-3) / 1e9 : 0.0;
  const double busbw = algbw * 2.0 * double(dp - 1) / double(dp);

  // Expert parallelism: dispatch and combine phases of the profiled step (count read, row exchange
  // and regroup, forward and backward), bytes this rank sent to other GPUs over that time.
  const double exchange_ms = phase_ms[int(cuda::Phase::kDispatch)] + phase_ms[int(cuda::Phase::kCombine)];
  const double a2a_gbs = ep > 1 && exchange_ms > 0 ? double(traffic.bytes_sent) / (exchange_ms * 1e-3) / 1e9 : 0.0;

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
      {"num_gpus", dp},
      {"commit", bench_commit()},
      {"command", opt.command},
      {"date", date},
      {"warmup_steps", opt.warmup},
      {"timed_steps", opt.steps},
      {"seq_len", seq},
      {"micro_batch", mb},
      {"micro_batches_per_step", micro_steps},
      {"global_batch", cfg.train.global_batch},
      {"tokens_per_step", tokens_per_step},
      {"cuda_graph", graph},
      {"graph_launches", graph_launches},
      {"step_ms", {{"mean", step_ms}}},
      {"step_ms_source", "wall clock from the first timed submit to the last collect, divided by timed_steps"
                         " (the slowest rank's)"},
      {"tokens_per_s", tps},
      {"tokens_per_s_per_gpu", tps_gpu},
      {"flops_per_token", counts.flops_per_token},
      {"tflops_per_gpu", tflops},
      {"peak_tflops", kGpuPeakTflops},
      {"mfu", mfu},
      {"phase_ms", phases},
      {"phase_ms_scaled_to_step", scaled},
      {"phase_sum_ms", phase_sum},
      {"profiled_step_ms", profiled_ms},
      {"phase_source", "CUDA events around each phase of one eager step (after one eager warm step), rank 0"},
      {"mem_peak_gib", peak_bytes / kGiB},
      {"mem_peak_source", "high-water mark of moecore's device allocations (cuda::device_peak_bytes), largest over GPUs"},
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
  if (ep > 1) {
    rec["expert_parallel"] = {
        {"ep", ep},
        {"experts_per_gpu", cfg.moe.num_experts / ep},
        {"dispatch_ms", phase_ms[int(cuda::Phase::kDispatch)]},
        {"combine_ms", phase_ms[int(cuda::Phase::kCombine)]},
        {"bytes_sent_per_rank", traffic.bytes_sent},
        {"bytes_received_per_rank", traffic.bytes_received},
        {"row_exchanges", traffic.exchanges},
        {"alltoall_gbs", a2a_gbs},
        {"alltoall_source", "BF16 row bytes rank 0 sent to other GPUs in the profiled eager step (dispatch and "
                            "combine, forward and backward) over its dispatch + combine phase time (which includes "
                            "the host count read, the regroup gathers and waiting for the peer)"}};
  }
  if (dp > 1) {
    rec["data_parallel"] = {
        {"nccl_version", cuda::nccl_version()},
        {"local_rank_source", local.source},
        {"overlap_grad_reduce", overlapped},
        {"grad_reduce_exposed_ms", reduce_ms},
        {"grad_reduce_exposed_source", "CUDA events of the eager profiled step on rank 0 from the end of backward to "
                                       "the gradients and statistics being summed (with overlap: the blocks' "
                                       "all-reduces still running after backward, then the statistics)"},
        {"grad_reduce_ms", full_reduce_ms},
        {"grad_reduce_bytes", reduce_bytes},
        {"grad_reduce_algbw_gbs", algbw},
        {"grad_reduce_busbw_gbs", busbw},
        {"grad_reduce_source", "CUDA events around one all-reduce of the whole FP32 gradient buffer on rank 0 after "
                               "the profiled step, waiting for the slower rank included"},
        {"scaling_efficiency_source", "tokens_per_s_per_gpu here divided by tokens_per_s of a one-GPU run of the "
                                      "same config (moecore bench without mpirun), a separate run"}};
  }

  char buf[640];
  std::snprintf(buf, sizeof buf,
                "moecore bench %s on %s%s (%d SMs, %.1f GiB), %lld timed steps after %lld warm-up, CUDA graph %s "
                "(%lld launches)\n",
                opt.config_name.c_str(), dp > 1 ? (std::to_string(dp) + " x ").c_str() : "", dev.name.c_str(),
                dev.sm_count, double(dev.total_bytes) / kGiB, (long long)opt.steps, (long long)opt.warmup,
                graph ? "on" : "off", (long long)graph_launches);
  out << buf;
  std::snprintf(buf, sizeof buf, "  %.3gB parameters (%.3gB active), %lld tokens/step (%s%lld x %lld x %lld)\n",
                double(counts.total_params) / 1e9, double(counts.active_params) / 1e9, (long long)tokens_per_step,
                dp > 1 ? (std::to_string(dp) + " GPUs x ").c_str() : "", (long long)micro_steps, (long long)mb,
                (long long)seq);
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
  std::snprintf(buf, sizeof buf, "tokens/s/GPU %.0f | TFLOP/s/GPU %.1f | MFU %.1f%% (of %.0f) | step %.2f ms\n", tps_gpu,
                tflops, 100.0 * mfu, kGpuPeakTflops, step_ms);
  out << buf;
  if (dp > 1) {
    std::snprintf(buf, sizeof buf,
                  "data parallel: %lld GPUs, NCCL %s | tokens/s all GPUs %.0f | grad all-reduce %.2f ms exposed in "
                  "the eager step (%s) | alone: %.2f ms for %.2f GB FP32, algbw %.1f GB/s, busbw %.1f GB/s | "
                  "scaling efficiency: tokens/s/GPU over a one-GPU run's tokens/s (run `moecore bench` without "
                  "mpirun)\n",
                  (long long)dp, cuda::nccl_version().c_str(), tps, reduce_ms,
                  overlapped ? "overlapped with backward" : "after backward, not overlapped", full_reduce_ms,
                  reduce_bytes / 1e9, algbw, busbw);
    out << buf;
  }
  if (ep > 1) {
    std::snprintf(buf, sizeof buf,
                  "expert parallel: ep %lld (%lld experts per GPU) | dispatch %.2f ms + combine %.2f ms of the eager "
                  "step | %.3f GB sent per rank to other GPUs | all-to-all %.1f GB/s per rank (no CUDA graph)\n",
                  (long long)ep, (long long)(cfg.moe.num_experts / ep), phase_ms[int(cuda::Phase::kDispatch)],
                  phase_ms[int(cuda::Phase::kCombine)], double(traffic.bytes_sent) / 1e9, a2a_gbs);
    out << buf;
  }
  std::snprintf(buf, sizeof buf,
                "memory: peak %.2f GiB allocated (device_alloc high-water mark%s) | %.2f GiB in use after the run "
                "(cudaMemGetInfo total - free; %.2f GiB more than before the run) | estimate %.2f GiB\n",
                peak_bytes / kGiB, dp > 1 ? ", largest GPU" : "", double(used_after) / kGiB,
                rec["mem_bench_gib"].get<double>(), est.total_bytes() / kGiB);
  out << buf;
  std::snprintf(buf, sizeof buf,
                "expert load: max/mean tokens per expert %.3f (mean over %zu MoE layers, step %lld) | loss %.4f "
                "(step 1) -> %.4f (step %lld)%s | skipped steps %lld\n",
                imbalance, last.tokens_per_expert.size(), (long long)last.step, first_loss, last_loss,
                (long long)last.step, loss_finite ? "" : " NOT FINITE", (long long)skipped);
  out << buf;
  if (rank == 0) write_bench_record(rec, opt, dp > 1 ? "gpux" + std::to_string(dp) : "gpu", date, out);
  return rec;
}

#endif  // MOECORE_HAS_CUDA

}  // namespace moe
