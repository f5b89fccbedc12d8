// RunLog: interval sums, the metrics.jsonl record (docs/report.md lists its keys) and the
// console line; durations as mm:ss or h:mm:ss, rates with k/M suffixes. The per-layer MoE
// figures cost O(layers x experts) per step (integer sums) and per record.
#include "train/run_log.h"

#include <cmath>
#include <cstdio>
#include <ctime>
#include <ostream>
#include <string>

#include "core/error.h"
#include "model/layout.h"
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

RunLog::RunLog(const Config& cfg, int64_t tokens_per_step, int64_t ep, std::ostream& out, MetricsWriter* metrics,
               bool tty, int64_t start_step, double wall_offset_s)
    : cfg_(cfg), tokens_per_step_(tokens_per_step), ep_(ep), out_(out), metrics_(metrics), tty_(tty),
      start_(start_step), t_start_(Clock::now()), t_run_(t_start_), wall_offset_(wall_offset_s) {
  MOE_CHECK(ep >= 1 && cfg.moe.num_experts % ep == 0, "RunLog: ep = ", ep, " must divide moe.num_experts = ",
            cfg.moe.num_experts);
  for (int64_t l = 0; l < cfg.model.n_layers; ++l)
    if (!is_dense_layer(cfg.model, l)) moe_layer_ids_.push_back(l);
}

void RunLog::add_moe(const StepStats& s) {
  const size_t layers = s.tokens_per_expert.size();
  layer_tokens_.resize(layers);
  layer_lb_.resize(layers, 0.0);
  layer_z_.resize(layers, 0.0);
  layer_dropped_.resize(layers, 0);
  for (size_t l = 0; l < layers; ++l) {
    const std::vector<int64_t>& c = s.tokens_per_expert[l];
    layer_tokens_[l].resize(c.size(), 0);
    for (size_t e = 0; e < c.size(); ++e) layer_tokens_[l][e] += c[e];
    if (l < s.layer_lb_loss.size()) layer_lb_[l] += s.layer_lb_loss[l];
    if (l < s.layer_z_loss.size()) layer_z_[l] += s.layer_z_loss[l];
    if (l < s.layer_dropped.size()) layer_dropped_[l] += s.layer_dropped[l];
  }
  if (!s.expert_bias.empty()) bias_ = s.expert_bias;
}

nlohmann::json RunLog::moe_record(double n, double& worst, int64_t& worst_layer, double& worst_rank,
                                  double& bias_max) const {
  nlohmann::json layers = nlohmann::json::array();
  worst = 1.0, worst_rank = 1.0, bias_max = 0.0;
  worst_layer = -1;
  for (size_t l = 0; l < layer_tokens_.size(); ++l) {
    const std::vector<int64_t>& c = layer_tokens_[l];
    int64_t routes = 0;
    for (const int64_t v : c) routes += v;
    const double load = max_over_mean(c);
    const double rank_load = max_over_mean(tokens_per_rank(c, ep_));
    const int64_t id = l < moe_layer_ids_.size() ? moe_layer_ids_[l] : int64_t(l);
    nlohmann::json rec = {{"layer", id},
                          {"tokens_per_expert", c},
                          {"load_max_mean", load},
                          {"rank_load_max_mean", rank_load},
                          {"lb_loss", layer_lb_[l] / n},
                          {"z_loss", layer_z_[l] / n},
                          {"dropped_frac", routes > 0 ? double(layer_dropped_[l]) / double(routes) : 0.0}};
    if (load > worst || worst_layer < 0) worst = load, worst_layer = id;
    worst_rank = std::max(worst_rank, rank_load);
    const size_t e = c.size();
    if (bias_.size() >= (l + 1) * e && e > 0) {
      double sum = 0, mx = 0;
      for (size_t i = 0; i < e; ++i) {
        const double b = std::abs(double(bias_[l * e + i]));
        sum += b;
        mx = std::max(mx, b);
      }
      rec["bias_abs_mean"] = sum / double(e);
      rec["bias_abs_max"] = mx;
      bias_max = std::max(bias_max, mx);
    }
    layers.push_back(std::move(rec));
  }
  return layers;
}

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
  add_moe(s);
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
  double worst = 1.0, worst_rank = 1.0, bias_max = 0.0;
  int64_t worst_layer = -1;
  rec["moe"] = moe_record(n, worst, worst_layer, worst_rank, bias_max);
  rec["ep"] = ep_;
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
  // The worst MoE layer of the interval by max/mean of its summed tokens per expert (the record's
  // load_max_mean; with ep > 1 also the worst rank_load_max_mean) and, with the bias on, the
  // largest |bias| of any layer.
  char moe_part[96] = "";
  if (worst_layer >= 0) {
    int at = std::snprintf(moe_part, sizeof moe_part, " | load %.2f L%lld", worst, (long long)worst_layer);
    if (ep_ > 1) at += std::snprintf(moe_part + at, sizeof moe_part - size_t(at), " rank %.2f", worst_rank);
    if (cfg_.moe.bias_update_rate > 0)
      std::snprintf(moe_part + at, sizeof moe_part - size_t(at), " | bias %.3f", bias_max);
  }
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "%sstep %*lld/%lld | loss %.4f | lb %.3f | z %.3f | gnorm %.3f | lr %.2e | %s tok/s%s | imb %.2f%s | "
                "%s elapsed | ETA %s\n",
                clear(), int(std::to_string(cfg_.train.steps).size()), (long long)done, (long long)cfg_.train.steps,
                loss_ / n, lb_ / n, z_ / n, s.grad_norm, lr, fmt_rate(tps).c_str(), gpu_part, imb_ / n, moe_part,
                fmt_duration(elapsed).c_str(), fmt_duration(eta).c_str());
  out_ << buf << std::flush;
  loss_ = lb_ = z_ = s_ = imb_ = dropped_ = 0;
  layer_imb_.assign(layer_imb_.size(), 0.0);
  for (auto& c : layer_tokens_) c.assign(c.size(), 0);
  layer_lb_.assign(layer_lb_.size(), 0.0);
  layer_z_.assign(layer_z_.size(), 0.0);
  layer_dropped_.assign(layer_dropped_.size(), 0);
  phase_ms_.assign(phase_ms_.size(), 0.0);
  n_ = skipped_ = phase_steps_ = 0;
}

}  // namespace moe
