// The benchmark loop of `moecore bench`, one for both backends: run plan and topology, the step
// (GPU: parameters initialised on the device; CPU: a HostState), warm-up and timed steps with
// in_flight() steps submitted (the host stages step s + 1 while the GPU runs step s), two
// profiled steps (GPU: eager, CUDA events; the first fills the event pool, the second is
// reported), the backend's details, the GPU's clocks through the timed steps (train/gpu_clocks.h),
// then the table and the JSON record. Tokens: splitmix64
// streams per (seed, step, sequence of the global batch), targets = next token.
#include "train/bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <ostream>
#include <sstream>

#include "checkpoint/files.h"
#include "core/error.h"
#include "data/dataset.h"
#include "data/sources.h"
#include "optim/adamw.h"
#include "parallel/comm.h"
#include "parallel/topology.h"
#include "train/ceilings.h"
#include "train/checkpointing.h"
#include "train/device.h"
#include "train/gpu_clocks.h"
#include "train/metrics.h"
#include "train/phase_ceilings.h"
#include "train/run_plan.h"
#include "train/step.h"

namespace moe {

namespace fs = std::filesystem;

namespace {

constexpr double kGiB = double(1ull << 30);
constexpr uint64_t kTokenStream = 0x62656E6368746F6Bull;  // separates bench tokens from other seeds

std::string shell_line(const char* cmd) {
  std::string out;
  if (FILE* p = popen(cmd, "r")) {
    char buf[256];
    while (fgets(buf, sizeof buf, p)) out += buf;
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

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

// The settings that change a bench's figures, as the record names them.
nlohmann::json bench_settings(const Config& cfg, const RunPlan& plan, const std::string& inputs) {
  return {{"device", plan.device},
          {"inputs", inputs},
          {"precision", cfg.train.precision},
          {"fp8_scaling", cfg.train.fp8_scaling},
          {"recompute", cfg.train.recompute},
          {"routing", cfg.moe.routing},
          {"capacity_factor", cfg.moe.capacity_factor},
          {"ep_backend", cfg.parallel.ep_backend},
          {"dp", plan.sizes.dp},
          {"ep", plan.sizes.ep},
          {"pp", plan.sizes.pp},
          {"zero", plan.zero},
          {"overlap_grad_reduce", cfg.parallel.overlap_grad_reduce},
          {"deferred_update", cfg.optim.deferred_update},
          {"deferred_update_sms", cfg.optim.deferred_update_sms},
          {"moment_dtype", cfg.optim.moment_dtype}};
}

}  // namespace

std::string bench_commit() {
  if (const char* env = std::getenv("MOECORE_COMMIT"); env != nullptr && *env != '\0') return env;
  const std::string commit = shell_line("git rev-parse --short HEAD 2>/dev/null");
  return commit.empty() ? "unknown" : commit;
}

std::string utc_date() {
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return date;
}

std::string write_bench_record(const nlohmann::json& rec, const BenchOptions& opt, const std::string& device,
                               const std::string& date, std::ostream& out) {
  fs::path path;
  if (!opt.json_path.empty()) {
    path = opt.json_path;
  } else if (!opt.out_dir.empty()) {
    std::string stamp = date;
    stamp.erase(std::remove(stamp.begin(), stamp.end(), ':'), stamp.end());
    path = fs::path(opt.out_dir) / ("bench-" + opt.config_name + "-" + device + "-" + stamp + ".json");
  } else {
    return "";
  }
  if (path.has_parent_path()) fs::create_directories(path.parent_path());
  write_file_atomic(path.string(), rec.dump(2) + "\n");
  out << "wrote " << path.string() << "\n";
  return path.string();
}

namespace {

// The config a bench of `cfg_in` on `ranks` ranks runs (checked): every GPU the one-GPU step's
// micro-batches, and with --inputs zeros every weight matrix 0. run_bench and the sweep's fit check
// both plan from it.
Config bench_config(const Config& cfg_in, const BenchOptions& opt, int64_t ranks, const std::string& device) {
  MOE_CHECK(opt.steps >= 1, "bench: --steps must be >= 1, got ", opt.steps);
  MOE_CHECK(opt.warmup >= 0, "bench: --warmup must be >= 0, got ", opt.warmup);
  Config cfg = cfg_in;
  if (ranks > 1) {
    MOE_CHECK(device == "cuda", "moecore bench on the cpu backend runs one process, but the job has ", ranks,
              " ranks; multi-rank benchmarks run on GPUs (train.device = \"cuda\", one GPU per rank)");
    MOE_CHECK(cfg.parallel.dp == 0 || cfg.parallel.dp == ranks, "bench: parallel.dp = ", cfg.parallel.dp,
              " but the job has ", ranks, " ranks; the bench is data parallel over every rank: set parallel.dp = 0");
    cfg.train.global_batch *= ranks;  // every GPU runs the one-GPU step's micro-batches
  }
  MOE_CHECK(opt.inputs == "random" || opt.inputs == "zeros" || opt.inputs == "corpus",
            "bench: --inputs must be random, zeros or corpus, got \"", opt.inputs, "\"");
  if (opt.inputs == "zeros") cfg.model.init_std = 0.0;  // every weight matrix 0 (norm weights stay 1)
  return cfg;
}

}  // namespace

nlohmann::json run_bench(const Config& cfg_in, const BenchOptions& opt, std::ostream& console, Comm& world) {
  const std::string device = resolve_device(cfg_in.train);
  const int64_t ranks = world.size();
  std::ostream null_out(nullptr);  // ranks other than 0 print nothing
  std::ostream& out = world.rank() == 0 ? console : null_out;
  const Config cfg = bench_config(cfg_in, opt, ranks, device);
  world.set_timeout_s(cfg.parallel.timeout_s);
  const RunPlan plan = make_run_plan(cfg, ranks, device);
  const Topology topo = make_topology(cfg, world);
  std::optional<HostState> state;  // the CPU step trains host state; the GPU step initialises on the device
  if (device == "cpu") state.emplace(cfg, plan, topo);
  const std::unique_ptr<Step> step = make_step(cfg, plan, topo, state ? &*state : nullptr, out);

  const int64_t profile_steps = 2;  // the first fills the GPU timer's event pool; the second is reported
  const int64_t total_steps = opt.warmup + opt.steps + profile_steps;
  std::vector<Batch> micro(static_cast<size_t>(plan.micro_steps));
  std::optional<DataLoader> corpus;  // --inputs corpus: the trainer's loader over the data config
  if (opt.inputs == "corpus") {
    std::ostringstream lines;
    DataSources data = open_data(cfg, lines);
    corpus.emplace(data.train_sources, plan.seq_len, plan.global_batch, plan.micro_batch, cfg.train.seed, topo.dp_rank,
                   plan.sizes.dp);
  }
  auto fill_step = [&](int64_t step) {
    if (corpus) {
      micro = corpus->next();
    } else {
      fill_synthetic_step(micro, step, cfg, topo.dp_rank * plan.micro_steps);
      if (opt.inputs == "zeros")
        for (Batch& b : micro) {
          std::fill(b.inputs.begin(), b.inputs.end(), 0);
          std::fill(b.targets.begin(), b.targets.end(), 0);
        }
    }
  };
  int64_t submitted = 0, skipped = 0;
  StepStats first, last;
  using Clock = std::chrono::steady_clock;
  std::vector<double> intervals;  // seconds between consecutive collects of the timed steps
  Clock::time_point last_collect;
  bool timing = false;
  auto collect_one = [&] {
    StepStats s = step->collect();
    const auto now = Clock::now();
    if (timing) intervals.push_back(std::chrono::duration<double>(now - last_collect).count());
    last_collect = now;
    if (s.step == 1) first = s;
    skipped += s.skipped ? 1 : 0;
    last = std::move(s);
  };
  auto run_steps = [&](int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      ++submitted;
      fill_step(submitted);
      step->submit({submitted, &micro, plan.tokens_per_step, lr_at(cfg.optim, submitted - 1, total_steps)});
      if (step->pending() >= step->in_flight()) collect_one();
    }
    while (step->pending() > 0) collect_one();
  };

  run_steps(opt.warmup);
  if (ranks > 1) world.barrier();  // the timed steps start together on every host
  // The GPU's SM clock, power and clock-event reasons through the timed steps, every 100 ms.
  const bool gpu = device == "cuda";
  std::optional<GpuClockSampler> clocks;
  if (gpu) clocks.emplace(visible_gpu_pci_bus_id(), 100);
  const auto t0 = Clock::now();
  last_collect = t0;
  timing = true;
  run_steps(opt.steps);
  timing = false;
  if (clocks) clocks->stop();
  double timed_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (ranks > 1) world.all_reduce(&timed_s, 1, ReduceOp::kMax);  // the slowest rank's

  // Phase profile (GPU: eager steps, on every rank).
  std::vector<std::pair<std::string, double>> phases;
  double profiled_ms = 0;
  step->set_profiling(true);
  for (int64_t i = 0; i < profile_steps; ++i) {
    const auto p0 = Clock::now();
    run_steps(1);
    profiled_ms = 1e3 * std::chrono::duration<double>(Clock::now() - p0).count();
    phases = step->profiled_phases_ms();
  }
  step->set_profiling(false);
  const nlohmann::json details = step->bench_details();

  const double step_ms = 1e3 * timed_s / double(opt.steps);
  std::vector<double> sorted = intervals;
  std::sort(sorted.begin(), sorted.end());
  const double tps = double(plan.tokens_per_step) * double(opt.steps) / timed_s;
  const double tps_dev = tps / double(plan.sizes.dp);
  const double tflops = plan.counts.flops_per_token * tps_dev / 1e12;  // per device
  const double mfu = tflops / kGpuPeakTflops;
  double phase_sum = 0;
  for (const auto& [name, ms] : phases) phase_sum += ms;
  const double imbalance = load_imbalance(last.tokens_per_expert);
  const double first_loss = first.loss(), last_loss = last.loss();
  const bool loss_finite = std::isfinite(last_loss);

  nlohmann::json phase_json = nlohmann::json::object(), scaled = nlohmann::json::object();
  for (const auto& [name, ms] : phases) {
    phase_json[name] = ms;
    scaled[name] = phase_sum > 0 ? ms / phase_sum * step_ms : 0.0;
  }
  const std::string date = utc_date();
  nlohmann::json rec = {{"config", opt.config_name},
                        {"device", gpu ? "gpu" : "cpu"},
                        {"commit", bench_commit()},
                        {"command", opt.command},
                        {"date", date},
                        {"settings", bench_settings(cfg, plan, opt.inputs)},
                        {"warmup_steps", opt.warmup},
                        {"timed_steps", opt.steps},
                        {"seq_len", plan.seq_len},
                        {"micro_batch", plan.micro_batch},
                        {"micro_batches_per_step", plan.micro_steps},
                        {"global_batch", plan.global_batch},
                        {"tokens_per_step", plan.tokens_per_step},
                        {"step_ms",
                         {{"mean", step_ms},
                          {"median", sorted.empty() ? step_ms : 1e3 * sorted[sorted.size() / 2]},
                          {"min", sorted.empty() ? step_ms : 1e3 * sorted.front()},
                          {"max", sorted.empty() ? step_ms : 1e3 * sorted.back()}}},
                        {"step_ms_source", "mean: wall clock from the first timed submit to the last collect, divided "
                                           "by timed_steps (the slowest rank's); median/min/max: between consecutive "
                                           "collects on rank 0"},
                        {"tokens_per_s", tps},
                        {"tokens_per_s_per_gpu", gpu ? nlohmann::json(tps_dev) : nlohmann::json(nullptr)},
                        {"flops_per_token", plan.counts.flops_per_token},
                        {"tflops_per_device", tflops},
                        {"tflops_per_gpu", gpu ? nlohmann::json(tflops) : nlohmann::json(nullptr)},
                        {"peak_tflops", gpu ? nlohmann::json(kGpuPeakTflops) : nlohmann::json(nullptr)},
                        {"mfu", gpu ? nlohmann::json(mfu) : nlohmann::json(nullptr)},  // no defined dense peak for a CPU
                        {"phase_ms", phase_json},
                        {"phase_ms_scaled_to_step", scaled},
                        {"phase_sum_ms", phase_sum},
                        {"profiled_step_ms", profiled_ms},
                        {"phase_source", gpu ? "CUDA events around each phase of one eager step (after one eager warm "
                                               "step), rank 0"
                                             : "wall clock around each phase of one step (after one profiled step)"},
                        {"mem_estimate_gib", plan.memory.total() / kGiB},
                        // The run plan's split of that estimate: model state (weights, gradients,
                        // moments as this rank holds them) and one micro-batch's activations.
                        {"mem_estimate_state_gib",
                         (plan.memory.params + plan.memory.grads + plan.memory.moments) / kGiB},
                        {"mem_estimate_activations_gib", plan.memory.activations() / kGiB},
                        {"load_imbalance", imbalance},
                        {"moe_layers", int64_t(last.tokens_per_expert.size())},
                        {"first_loss", first_loss},
                        {"last_loss", last_loss},
                        {"loss_finite", loss_finite},
                        {"last_grad_norm", last.grad_norm},
                        {"skipped_steps", skipped},
                        {"gpu_clocks", clocks ? clocks->summary() : nlohmann::json(nullptr)},
                        {"total_params", plan.counts.total_params},
                        {"active_params", plan.counts.active_params}};
  rec.update(details);
  // Each phase against its ceiling (GPU steps: the measured rates of this kind of GPU in
  // train/ceilings.h; a GPU without them is held to the H200's, and the line says so).
  std::string ceiling_line;
  if (gpu && !phases.empty()) {
    const std::string device_name = details.at("gpu").at("name").get<std::string>();
    const GpuRates* measured = measured_rates(device_name);
    const GpuRates& rates = measured != nullptr ? *measured : h200_ceilings();
    nlohmann::json cj = nlohmann::json::object();
    double ideal_sum = 0, measured_sum = 0;
    for (const PhaseCeiling& c : phase_ceilings(cfg, plan, rates)) {
      double measured = 0;
      for (const auto& [name, ms] : phases)
        if (name == c.phase) measured = ms;
      if (measured <= 0) continue;
      const double fraction = c.ideal_ms / measured;
      cj[c.phase] = {{"ideal_ms", c.ideal_ms}, {"measured_ms", measured}, {"fraction", fraction},
                     {"flops", c.flops},       {"bytes", c.bytes},        {"ceiling", c.ceiling}};
      ideal_sum += c.ideal_ms;
      measured_sum += measured;
      char part[64];
      std::snprintf(part, sizeof part, "%s%s %.0f%%", ceiling_line.empty() ? "" : " | ", c.phase.c_str(),
                    100.0 * fraction);
      ceiling_line += part;
    }
    rec["phase_ceilings"] = cj;
    rec["phase_ceilings_gpu"] = rates.name;
    rec["phase_ceilings_source"] = std::string("ideal_ms: the phase's FLOPs or bytes of one step at the ") + rates.name +
                                   "'s measured rates of train/ceilings.h (docs/benchmarks.md)" +
                                   (measured != nullptr ? "" : ", no rates measured on " + device_name) +
                                   "; measured_ms: phase_ms";
    char tail[160];
    std::snprintf(tail, sizeof tail, " (these phases: %.1f ms at their ceilings, %.1f ms measured)", ideal_sum,
                  measured_sum);
    const std::string against =
        measured != nullptr ? "" : std::string(" (the ") + rates.name + "'s: none measured on this GPU)";
    ceiling_line = "of ceiling" + against + ": " + ceiling_line + tail + "\n";
  }

  char buf[640];
  if (gpu) {
    const nlohmann::json& g = details.at("gpu");
    std::snprintf(buf, sizeof buf,
                  "moecore bench %s on %s%s (%d SMs, %.1f GiB), %lld timed steps after %lld warm-up, CUDA graph %s "
                  "(%lld launches)\n",
                  opt.config_name.c_str(), ranks > 1 ? (std::to_string(ranks) + " x ").c_str() : "",
                  g.at("name").get<std::string>().c_str(), g.at("sm_count").get<int>(), g.at("memory_gib").get<double>(),
                  (long long)opt.steps, (long long)opt.warmup, details.at("cuda_graph").get<bool>() ? "on" : "off",
                  (long long)details.at("graph_launches").get<int64_t>());
  } else {
    std::snprintf(buf, sizeof buf, "moecore bench %s on cpu (%s), %lld timed steps after %lld warm-up\n",
                  opt.config_name.c_str(), details.at("machine").at("cpu").get<std::string>().c_str(),
                  (long long)opt.steps, (long long)opt.warmup);
  }
  out << buf;
  if (gpu && details.contains("kernel_variants")) {  // the kernel choices this run used
    std::string line;
    for (const auto& [name, value] : details.at("kernel_variants").items())
      line += (line.empty() ? "" : ", ") + name + " " + value.get<std::string>();
    out << "kernels: " << line << "\n";
  }
  std::string update_note;  // where the AdamW update runs, when not at the end of the step, and its moments
  if (cfg.optim.moment_dtype != "fp32") update_note = ", AdamW moments " + cfg.optim.moment_dtype;
  if (cfg.optim.deferred_update) {
    update_note += ", update deferred into the next forward";
    if (cfg.optim.deferred_update_sms > 0)
      update_note += " on " + std::to_string(cfg.optim.deferred_update_sms) + " reserved SMs";
  }
  std::snprintf(buf, sizeof buf,
                "  %.3gB parameters (%.3gB active), %lld tokens/step (%s%lld x %lld x %lld), inputs %s, routing %s%s\n",
                double(plan.counts.total_params) / 1e9, double(plan.counts.active_params) / 1e9,
                (long long)plan.tokens_per_step, ranks > 1 ? (std::to_string(ranks) + " GPUs x ").c_str() : "",
                (long long)plan.micro_steps, (long long)plan.micro_batch, (long long)plan.seq_len, opt.inputs.c_str(),
                cfg.moe.routing.c_str(), update_note.c_str());
  out << buf;
  std::snprintf(buf, sizeof buf, "  %-12s %12s %8s %14s\n", "phase", gpu ? "eager ms" : "ms", "share", "ms of step");
  out << buf;
  for (const auto& [name, ms] : phases) {
    std::snprintf(buf, sizeof buf, "  %-12s %12.2f %7.1f%% %14.2f\n", name.c_str(), ms,
                  phase_sum > 0 ? 100.0 * ms / phase_sum : 0.0, scaled[name].get<double>());
    out << buf;
  }
  std::snprintf(buf, sizeof buf, "  %-12s %12.2f %7.1f%% %14.2f   (profiled step %.2f ms wall; timed step %.2f ms)\n",
                "sum", phase_sum, 100.0, step_ms, profiled_ms, step_ms);
  out << buf;
  out << ceiling_line;
  const nlohmann::json& st = rec["step_ms"];  // mean, and the median / range of the timed steps
  if (gpu) {
    std::snprintf(buf, sizeof buf,
                  "tokens/s/GPU %.0f | TFLOP/s/GPU %.1f | MFU %.1f%% (of %.0f) | step %.2f ms (median %.2f, "
                  "%.2f-%.2f)\n",
                  tps_dev, tflops, 100.0 * mfu, kGpuPeakTflops, step_ms, st["median"].get<double>(),
                  st["min"].get<double>(), st["max"].get<double>());
  } else {
    std::snprintf(buf, sizeof buf, "tokens/s %.0f | TFLOP/s %.4f | MFU n/a on cpu | step %.2f ms (median %.2f)\n", tps,
                  tflops, step_ms, st["median"].get<double>());
  }
  out << buf;
  if (clocks) out << gpu_clocks_line(rec["gpu_clocks"]);
  if (details.contains("data_parallel")) {
    const nlohmann::json& d = details["data_parallel"];
    std::snprintf(buf, sizeof buf,
                  "data parallel: %lld GPUs, NCCL %s | tokens/s all GPUs %.0f | grad all-reduce %.2f ms exposed in "
                  "the eager step (%s) | alone: %.2f ms for %.2f GB FP32, algbw %.1f GB/s, busbw %.1f GB/s | "
                  "scaling efficiency: tokens/s/GPU over a one-GPU run's tokens/s (run `moecore bench` without "
                  "mpirun)\n",
                  (long long)plan.sizes.dp, d["nccl_version"].get<std::string>().c_str(), tps,
                  d["grad_reduce_exposed_ms"].get<double>(),
                  d["overlap_grad_reduce"].get<bool>() ? "overlapped with backward" : "after backward, not overlapped",
                  d["grad_reduce_ms"].get<double>(), d["grad_reduce_bytes"].get<double>() / 1e9,
                  d["grad_reduce_algbw_gbs"].get<double>(), d["grad_reduce_busbw_gbs"].get<double>());
    out << buf;
  }
  if (details.contains("expert_parallel")) {
    const nlohmann::json& e = details["expert_parallel"];
    std::snprintf(buf, sizeof buf,
                  "expert parallel: ep %lld (%lld experts per GPU, %s) | dispatch %.2f ms + combine %.2f ms of the "
                  "eager step | %.3f GB sent per rank to other GPUs | exchange %.1f GB/s per rank | NCCL all-to-all "
                  "busbw %.1f GB/s\n",
                  (long long)plan.sizes.ep, (long long)e["experts_per_gpu"].get<int64_t>(),
                  e.value("backend", std::string("alltoall")).c_str(), e["dispatch_ms"].get<double>(),
                  e["combine_ms"].get<double>(), double(e["bytes_sent_per_rank"].get<int64_t>()) / 1e9,
                  e["alltoall_gbs"].get<double>(), e.value("nccl_alltoall_busbw_gbs", 0.0));
    out << buf;
  }
  if (gpu) {
    std::snprintf(buf, sizeof buf,
                  "memory: peak %.2f GiB allocated (device_alloc high-water mark%s) | %.2f GiB in use after the run "
                  "(cudaMemGetInfo total - free; %.2f GiB more than before the run) | estimate %.2f GiB\n",
                  details["mem_peak_gib"].get<double>(), ranks > 1 ? ", largest GPU" : "",
                  details["mem_used_gib"].get<double>(), details["mem_bench_gib"].get<double>(),
                  plan.memory.total() / kGiB);
  } else {
    std::snprintf(buf, sizeof buf, "memory: peak %.3f GiB resident (peak RSS) | estimate %.3f GiB\n",
                  details["mem_peak_gib"].get<double>(), plan.memory.total() / kGiB);
  }
  out << buf;
  std::snprintf(buf, sizeof buf,
                "expert load: max/mean tokens per expert %.3f (mean over %zu MoE layers, step %lld) | loss %.4f "
                "(step 1) -> %.4f (step %lld)%s | skipped steps %lld\n",
                imbalance, last.tokens_per_expert.size(), (long long)last.step, first_loss, last_loss,
                (long long)last.step, loss_finite ? "" : " NOT FINITE", (long long)skipped);
  out << buf;
  if (world.rank() == 0)
    write_bench_record(rec, opt, gpu ? (ranks > 1 ? "gpux" + std::to_string(ranks) : "gpu") : "cpu", date, out);
  return rec;
}

namespace {

// Why `cfg` cannot run here (as run_bench would configure it), or "": the GPU's free memory
// against the run plan's estimate on every rank (any rank's reason), the host's on the cpu.
std::string sweep_fit_problem(const Config& cfg_in, const BenchOptions& opt, Comm& world) {
  const std::string device = resolve_device(cfg_in.train);
  const RunPlan plan = make_run_plan(bench_config(cfg_in, opt, world.size(), device), world.size(), device);
  std::string problem = device == "cuda" ? gpu_fit_problem(plan) : host_memory_problem(plan);
  int64_t bad = problem.empty() ? 0 : 1;
  if (world.size() > 1) {
    int64_t worst = bad;
    world.all_reduce(&worst, 1, ReduceOp::kMax);
    if (worst != 0 && problem.empty()) problem = "it does not fit on another rank's GPU";
  }
  return problem;
}

}  // namespace

nlohmann::json run_sweep(const std::vector<std::pair<std::string, Config>>& configs, const BenchOptions& opt,
                         std::ostream& console, Comm& world) {
  MOE_CHECK(!configs.empty(), "sweep: no config given");
  std::ostream null_out(nullptr);
  std::ostream& out = world.rank() == 0 ? console : null_out;
  nlohmann::json list = nlohmann::json::array();
  for (const auto& [name, cfg] : configs) {
    const std::string problem = sweep_fit_problem(cfg, opt, world);
    if (!problem.empty()) {
      out << "sweep: " << name << ": not run: " << problem << "\n" << std::flush;
      list.push_back({{"config", name}, {"skipped", true}, {"reason", problem}});
      continue;
    }
    out << "sweep: " << name << "\n" << std::flush;
    BenchOptions one = opt;
    one.config_name = name;
    one.out_dir.clear();  // the sweep's record holds every bench record
    one.json_path.clear();
    list.push_back(run_bench(cfg, one, console, world));
    out << "\n";
  }
  const nlohmann::json* base = nullptr;
  for (const nlohmann::json& r : list)
    if (!r.contains("skipped")) {
      base = &r;
      break;
    }
  char buf[512];
  std::snprintf(buf, sizeof buf, "%-20s %8s %10s %14s %7s %12s %7s %10s %9s\n", "config", "experts", "params",
                "tokens/s/dev", "rel", "TFLOP/s/dev", "rel", "step ms", "peak GiB");
  out << buf;
  for (nlohmann::json& r : list) {
    if (r.contains("skipped")) {
      std::snprintf(buf, sizeof buf, "%-20s not run: %s\n", r["config"].get<std::string>().c_str(),
                    r["reason"].get<std::string>().substr(0, 160).c_str());
      out << buf;
      continue;
    }
    // Per device (GPU, or the one CPU process): tokens_per_s over the data-parallel ranks.
    auto per_device = [](const nlohmann::json& x) {
      return x["tokens_per_s"].get<double>() / double(x["settings"]["dp"].get<int64_t>());
    };
    const double tps = per_device(r), tf = r["tflops_per_device"].get<double>();
    const double rel_tps = tps / per_device(*base);
    const double rel_tf = tf / (*base)["tflops_per_device"].get<double>();
    r["tokens_per_s_per_device_vs_first"] = rel_tps;
    r["tflops_per_device_vs_first"] = rel_tf;
    const int64_t experts = configs[size_t(&r - &list[0])].second.moe.num_experts;
    std::snprintf(buf, sizeof buf, "%-20s %8lld %9.3gB %14.0f %6.1f%% %12.1f %6.1f%% %10.2f %9.2f\n",
                  r["config"].get<std::string>().c_str(), (long long)experts,
                  double(r["total_params"].get<int64_t>()) / 1e9, tps, 100 * rel_tps, tf, 100 * rel_tf,
                  r["step_ms"]["mean"].get<double>(), r["mem_peak_gib"].get<double>());
    out << buf;
  }
  const std::string date = utc_date();
  nlohmann::json rec = {{"command", opt.command}, {"commit", bench_commit()}, {"date", date}, {"sweep", list}};
  if (world.rank() == 0) {
    BenchOptions named = opt;
    named.config_name = "sweep-" + configs.front().first;
    const std::string device = resolve_device(configs.front().second.train);
    write_bench_record(rec, named, device == "cuda" ? "gpu" : "cpu", date, out);
  }
  return rec;
}

}  // namespace moe
