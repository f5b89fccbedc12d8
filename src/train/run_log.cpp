// RunLog: interval sums, the metrics.jsonl record (docs/report.md lists its keys) and the
// console line; durations as mm:ss or h:mm:ss, rates with k/M suffixes.
#include "train/run_log.h"

#include <cmath>
#include <cstdio>
#include <ctime>
#include <ostream>
#include <string>

#include "train/run_plan.h"
#include "train/step.h"

namespace moe {

namespace {

std::string fmt_duration(double s) {
  char buf[32];
  const int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", (long long)(t / 3600), (long long)(t / 60 % 60), (long long)(t % 60));
  else
    std::snprintf(buf, sizeof buf, "%02lld:%02lld", (long long)(t / 60), (long long)(t % 60));
  return buf;
}

std::string fmt_rate(double tokens_per_s) {
  char buf[32];
  if (tokens_per_s >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", tokens_per_s / 1e6);
  else if (tokens_per_s >= 1e3) std::snprintf(buf, sizeof buf, "%.1fk", tokens_per_s / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", tokens_per_s);
  return buf;
}

// The current UTC time as "2026-01-31T12:34:56.789Z".
std::string utc_now() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[96];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03lldZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                tm.tm_hour, tm.tm_min, tm.tm_sec, (long long)ms);
  return buf;
}

}  // namespace

RunLog::RunLog(const Config& cfg, int64_t tokens_per_step, std::ostream& out, MetricsWriter* metrics, bool tty,
               int64_t start_step, double wall_offset_s)
    : cfg_(cfg), tokens_per_step_(tokens_per_step), out_(out), metrics_(metrics), tty_(tty), start_(start_step),
      t_start_(Clock::now()), t_run_(t_start_), wall_offset_(wall_offset_s) {}

void RunLog::stamp(nlohmann::json& rec, int64_t step) const {
  rec["wall_s"] = wall_offset_ + std::chrono::duration<double>(Clock::now() - t_run_).count();
  rec["time"] = utc_now();
  rec["tokens"] = step * tokens_per_step_;
}

void RunLog::eval(int64_t step, double loss) {
  if (metrics_) {
    nlohmann::json rec = {{"step", step}, {"eval_loss", loss}};
    stamp(rec, step);
    metrics_->write(rec);
  }
  char buf[96];
  std::snprintf(buf, sizeof buf, "%sstep %lld | eval_loss %.4f\n", step ? clear() : "", (long long)step, loss);
  out_ << buf << std::flush;
}

void RunLog::skipped(int64_t step, double loss, double grad_norm) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "step %lld skipped: non-finite %s (loss %g, grad norm %g)\n", (long long)step,
                std::isfinite(loss) ? "grad norm" : "loss", loss, grad_norm);
  out_ << buf << std::flush;
  ++skipped_;
}

void RunLog::saved(const std::string& path, bool last) {
  if (!last || cfg_.checkpoint.interval > 0) out_ << clear() << "saved checkpoint " << path << "\n" << std::flush;
}

void RunLog::step(const StepStats& s, double lr, double step_s, const Step& step) {
  const int64_t done = s.step;
  const double loss = s.loss();
  loss_ += loss;
  lb_ += s.lb_loss;
  z_ += s.z_loss;
  s_ += step_s;
  imb_ += load_imbalance(s.tokens_per_expert);
  layer_imb_.resize(s.tokens_per_expert.size(), 0.0);
  for (size_t l = 0; l < s.tokens_per_expert.size(); ++l) layer_imb_[l] += load_imbalance({s.tokens_per_expert[l]});
  dropped_ += s.num_routes ? double(s.num_dropped) / double(s.num_routes) : 0.0;
  if (!s.phase_ms.empty()) {
    phase_ms_.resize(s.phase_ms.size(), 0.0);
    for (size_t p = 0; p < s.phase_ms.size(); ++p) phase_ms_[p] += s.phase_ms[p];
    ++phase_steps_;
  }
  ++n_;
  if (done % cfg_.log.interval != 0 && done != cfg_.train.steps) {
    if (tty_) {
      char buf[128];
      std::snprintf(buf, sizeof buf, "\r\033[K  step %lld/%lld  loss %.4f  %.0f ms/step", (long long)done,
                    (long long)cfg_.train.steps, loss, step_s * 1e3);
      out_ << buf << std::flush;
    }
    return;
  }
  const double n = double(n_);
  const double elapsed = std::chrono::duration<double>(Clock::now() - t_start_).count();
  const double tps = double(tokens_per_step_) * n / s_;
  const double eta = elapsed / double(done - start_) * double(cfg_.train.steps - done);
  nlohmann::json rec = {{"step", done},
                        {"loss", loss_ / n},
                        {"lb_loss", lb_ / n},
                        {"z_loss", z_ / n},
                        {"grad_norm", s.grad_norm},
                        {"lr", lr},
                        {"tokens_per_s", tps},
                        {"step_ms", 1e3 * s_ / n},
                        {"load_imbalance", imb_ / n},
                        {"dropped_frac", dropped_ / n},
                        {"skipped_steps", skipped_}};
  nlohmann::json layers = nlohmann::json::array();
  for (const double v : layer_imb_) layers.push_back(v / n);
  rec["layer_load_imbalance"] = layers;
  if (phase_steps_ > 0) {
    nlohmann::json phases = nlohmann::json::object();
    for (size_t p = 0; p < phase_ms_.size(); ++p) phases[phase_name(Phase(int(p)))] = phase_ms_[p] / double(phase_steps_);
    rec["phase_ms"] = phases;
    rec["phase_steps"] = phase_steps_;
  }
  stamp(rec, done);
  char gpu_part[128] = "";
  if (step.has_device_figures()) {
    const DeviceFigures g = step.device_figures(n_, s_);
    rec["tflops_per_gpu"] = g.tflops_per_gpu;
    rec["mfu"] = g.tflops_per_gpu / kGpuPeakTflops;
    rec["mem_peak_gib"] = g.mem_peak_gib;
    rec["mem_used_gib"] = g.mem_used_gib;
    if (g.num_gpus > 1) {
      rec["num_gpus"] = g.num_gpus;
      rec["tokens_per_s_per_gpu"] = tps / double(g.num_gpus);
    }
    std::snprintf(gpu_part, sizeof gpu_part, " | %.1f TFLOP/s (mfu %.1f%%) | mem %.2f GiB", g.tflops_per_gpu,
                  100.0 * g.tflops_per_gpu / kGpuPeakTflops, g.mem_peak_gib);
  }
  if (metrics_) metrics_->write(rec);
  char buf[400];
  std::snprintf(buf, sizeof buf,
                "%sstep %*lld/%lld | loss %.4f | lb %.3f | z %.3f | gnorm %.3f | lr %.2e | %s tok/s%s | imb %.2f | "
                "%s elapsed | ETA %s\n",
                clear(), int(std::to_string(cfg_.train.steps).size()), (long long)done, (long long)cfg_.train.steps,
                loss_ / n, lb_ / n, z_ / n, s.grad_norm, lr, fmt_rate(tps).c_str(), gpu_part, imb_ / n,
                fmt_duration(elapsed).c_str(), fmt_duration(eta).c_str());
  out_ << buf << std::flush;
  loss_ = lb_ = z_ = s_ = imb_ = dropped_ = 0;
  layer_imb_.assign(layer_imb_.size(), 0.0);
  phase_ms_.assign(phase_ms_.size(), 0.0);
  n_ = skipped_ = phase_steps_ = 0;
}

}  // namespace moe
