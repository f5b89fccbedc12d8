// What a training run tells its user: console lines and metrics.jsonl records, step figures
// averaged over each log interval (loss, lb/z, grad norm, lr, tokens/s, load imbalance, dropped
// routes; device figures when the step has them), eval losses, skipped steps, saved
// checkpoints, and the live line on a terminal. Every step and eval record carries wall_s (seconds
// since the run started, continued across a resume from the kept records), time (UTC, ISO 8601)
// and tokens (trained through that step); step records also layer_load_imbalance, max/mean tokens
// per expert of each MoE layer averaged over the interval (docs/report.md), and phase_ms, this
// rank's milliseconds per phase averaged over the interval's timed steps (phase_steps of them:
// every step on the CPU; on the GPU only with log.phase_times or in the log.trace window), and
// moe: one object per MoE layer with its tokens per expert summed over the interval, max/mean load
// per expert and per expert-parallel rank, its lb/z losses, dropped fraction and the magnitude of
// its aux-loss-free bias after the interval (docs/report.md). The console line adds the worst
// layer's max/mean (and the largest |bias| when the bias is on).
#pragma once

#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <vector>

#include "core/config.h"
#include "train/metrics.h"

namespace moe {

class Step;
struct StepStats;

class RunLog {
 public:
  using Clock = std::chrono::steady_clock;

  // metrics (may be null: ranks other than 0); tty: refresh a live line between records;
  // tokens_per_step: the run plan's, for tokens/s and tokens seen; ep: the run plan's
  // expert-parallel size (load per rank groups E / ep experts); wall_offset_s: the wall_s of the
  // last record kept from before a resume (0 for a new run).
  RunLog(const Config& cfg, int64_t tokens_per_step, int64_t ep, std::ostream& out, MetricsWriter* metrics, bool tty,
         int64_t start_step, double wall_offset_s = 0);

  // The clock of elapsed time, ETA and wall time starts here (after the initial eval).
  void start_clock() { t_start_ = Clock::now(); }
  Clock::time_point start_time() const { return t_start_; }

  void eval(int64_t step, double loss);
  void skipped(int64_t step, double loss, double grad_norm);
  void saved(const std::string& path, bool last);
  // Adds step s (which took step_s seconds at learning rate lr); at the end of a log interval
  // writes the record and the console line (with step.device_figures() when it has them),
  // otherwise refreshes the live line on a terminal.
  void step(const StepStats& s, double lr, double step_s, const Step& step);

 private:
  const char* clear() const { return tty_ ? "\r\033[K" : ""; }
  // wall_s, time and tokens of a record of step `step`.
  void stamp(nlohmann::json& rec, int64_t step) const;
  // Adds step s's per-layer figures to the interval's.
  void add_moe(const StepStats& s);
  // The record's "moe" array from the interval's figures (n steps); worst: the largest per-expert
  // max/mean and its layer, bias_max: the largest |bias| of any layer.
  nlohmann::json moe_record(double n, double& worst, int64_t& worst_layer, double& worst_rank, double& bias_max) const;
  const Config& cfg_;
  int64_t tokens_per_step_;
  int64_t ep_;
  std::vector<int64_t> moe_layer_ids_;  // the block index of each MoE layer
  std::ostream& out_;
  MetricsWriter* metrics_;
  bool tty_;
  int64_t start_;
  Clock::time_point t_start_;
  Clock::time_point t_run_;  // wall_s counts from here (construction), plus wall_offset_
  double wall_offset_;
  std::vector<double> layer_imb_;  // per MoE layer, summed over the interval
  std::vector<double> phase_ms_;   // per phase, summed over the interval's timed steps
  // Per MoE layer over the interval: tokens per expert, lb/z sums, dropped routes; the bias
  // [layer x expert] of the interval's last step.
  std::vector<std::vector<int64_t>> layer_tokens_;
  std::vector<double> layer_lb_, layer_z_;
  std::vector<int64_t> layer_dropped_;
  std::vector<float> bias_;
  int64_t phase_steps_ = 0;
  double loss_ = 0, lb_ = 0, z_ = 0, s_ = 0, imb_ = 0, dropped_ = 0;
  int64_t n_ = 0, skipped_ = 0;
};

}  // namespace moe
