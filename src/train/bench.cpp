// Benchmark loop of the CPU reference backend: same model, optimizer and loss scaling as
// train(), random tokens, median over timed steps. Also the record helpers (commit, date,
// JSON file) that the GPU bench shares.
#include "train/bench.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <thread>

#include "core/error.h"
#include "core/rng.h"
#include "model/layout.h"
#include "model/model.h"
#include "optim/adamw.h"

namespace moe {

namespace fs = std::filesystem;

namespace {

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

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

double peak_rss_gib() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_maxrss) * 1024.0 / double(1ull << 30);  // ru_maxrss is in KiB on Linux
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
  std::ofstream f(path);
  f << rec.dump(2) << "\n";
  MOE_CHECK(f.good(), "bench: cannot write the JSON record to ", path.string());
  out << "wrote " << path.string() << "\n";
  return path.string();
}

nlohmann::json run_bench(const Config& cfg, const BenchOptions& opt, std::ostream& out) {
  MOE_CHECK(opt.steps >= 1, "bench: --steps must be >= 1, got ", opt.steps);
  MOE_CHECK(opt.warmup >= 0, "bench: --warmup must be >= 0, got ", opt.warmup);
  MOE_CHECK(cfg.train.global_batch % cfg.train.micro_batch == 0, "bench: train.global_batch (",
            cfg.train.global_batch, ") must be a multiple of train.micro_batch (", cfg.train.micro_batch, ")");
  const int64_t seq = cfg.train.seq_len, mb = cfg.train.micro_batch;
  const int64_t micro_steps = cfg.train.global_batch / mb;
  const int64_t tokens_per_step = cfg.train.global_batch * seq;

  Model<float> model(cfg.model, cfg.moe);
  model.init_params(cfg.train.seed);
  AdamW opt_state(model.layout(), cfg.optim);
  const int64_t total = model.layout().total_numel();
  std::vector<int32_t> inputs(mb * seq), targets(mb * seq);
  const LossScales scales{1.0 / double(tokens_per_step), cfg.moe.lb_loss_weight / double(micro_steps),
                          cfg.moe.z_loss_weight / double(micro_steps)};

  std::vector<double> step_s;
  PhaseTimer& timer = model.timer();
  double loss = 0;
  for (int64_t step = 0; step < opt.warmup + opt.steps; ++step) {
    const bool timed = step >= opt.warmup;
    if (step == opt.warmup) {
      timer.reset();
      timer.enable(true);
    }
    const auto t0 = std::chrono::steady_clock::now();
    model.zero_grads();
    double ce = 0;
    for (int64_t m = 0; m < micro_steps; ++m) {
      for (int64_t i = 0; i < mb * seq; ++i) {
        const uint64_t idx = uint64_t((step * micro_steps + m) * mb * seq + i);
        inputs[i] = int32_t(bits_at(cfg.train.seed, 1, idx) % uint32_t(cfg.model.vocab_size));
        targets[i] = int32_t(bits_at(cfg.train.seed, 2, idx) % uint32_t(cfg.model.vocab_size));
      }
      ce += model.forward(inputs.data(), targets.data(), mb, seq, uint64_t(step * micro_steps + m)).ce_sum;
      model.backward(scales);
    }
    timer.lap(Phase::kOptimizer);
    const double norm = global_grad_norm(model.grads(), total);
    clip_grads(model.grads(), total, norm, cfg.optim.grad_clip);
    opt_state.step(model.params(), model.grads(), lr_at(cfg.optim, step, opt.warmup + opt.steps));
    timer.stop();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (timed) step_s.push_back(s);
    loss = ce / double(tokens_per_step);
  }

  std::vector<double> sorted = step_s;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  const ModelCounts counts = count_model(cfg.model, cfg.moe, seq);
  const double tps = double(tokens_per_step) / median;
  const double tflops = counts.flops_per_token * tps / 1e12;

  nlohmann::json phases = nlohmann::json::object();
  double phase_sum = 0;
  for (int p = 0; p < static_cast<int>(Phase::kCount); ++p) {
    const double ms = 1e3 * timer.seconds(static_cast<Phase>(p)) / double(opt.steps);
    phases[std::string(kPhaseNames[p])] = ms;
    phase_sum += ms;
  }
  const std::string date = utc_date();
  const std::string commit = bench_commit();
  nlohmann::json rec = {
      {"config", opt.config_name},
      {"device", "cpu"},
      {"machine", {{"cpu", cpu_model()}, {"hardware_threads", std::thread::hardware_concurrency()}}},
      {"commit", commit},
      {"command", opt.command},
      {"date", date},
      {"warmup_steps", opt.warmup},
      {"timed_steps", opt.steps},
      {"tokens_per_step", tokens_per_step},
      {"step_ms", {{"median", 1e3 * median}, {"min", 1e3 * sorted.front()}, {"max", 1e3 * sorted.back()}}},
      {"tokens_per_s", tps},
      {"flops_per_token", counts.flops_per_token},
      {"tflops_per_device", tflops},
      {"mfu", nullptr},  // no defined dense peak for a CPU
      {"phase_ms", phases},
      {"mem_peak_gib", peak_rss_gib()},
      {"total_params", counts.total_params},
      {"active_params", counts.active_params},
      {"last_loss", loss}};

  char buf[256];
  out << "moecore bench " << opt.config_name << " on cpu (" << cpu_model() << "), " << opt.steps << " timed steps after "
      << opt.warmup << " warm-up\n";
  std::snprintf(buf, sizeof buf, "  %-14s %10s\n", "phase", "ms/step");
  out << buf;
  for (int p = 0; p < static_cast<int>(Phase::kCount); ++p) {
    std::snprintf(buf, sizeof buf, "  %-14s %10.2f\n", std::string(kPhaseNames[p]).c_str(),
                  phases[std::string(kPhaseNames[p])].get<double>());
    out << buf;
  }
  std::snprintf(buf, sizeof buf, "  %-14s %10.2f   (step median %.2f ms, min %.2f, max %.2f)\n", "sum", phase_sum,
                1e3 * median, 1e3 * sorted.front(), 1e3 * sorted.back());
  out << buf;
  std::snprintf(buf, sizeof buf, "tokens/s %.0f | TFLOP/s %.4f | MFU n/a on cpu | peak memory %.3f GiB\n", tps, tflops,
                peak_rss_gib());
  out << buf;
  write_bench_record(rec, opt, "cpu", date, out);
  return rec;
}

}  // namespace moe
