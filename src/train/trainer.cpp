// The training loop, written once for every backend over the step interface (train/step.h): the
// run plan and topology, data, the host state and its resume, then per step: the micro-batches,
// the global target count (host counts summed over dp), submit; collect and log the oldest step
// once in_flight() steps are submitted (the CPU step: at once; the GPU step: one step late, so
// the host stages step s + 1 while the GPU runs step s); every submitted step is collected
// before an eval, a checkpoint and the end. Rank 0 prints and writes metrics.jsonl; every rank
// takes part in evals and checkpoints (train/checkpointing.h). Phase times: every step where they
// are cheap (CPU), else the last step of each log interval with log.phase_times; log.trace's steps
// also keep their phase intervals, and each rank writes its trace file (train/trace.h) once the
// window's last step is collected.
#include "train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <ostream>
#include <sstream>

#include "checkpoint/checkpoint.h"
#include "checkpoint/files.h"
#include "core/config_io.h"
#include "core/error.h"
#include "core/signals.h"
#include "data/dataset.h"
#include "data/sources.h"
#include "data/token_file.h"
#include "optim/adamw.h"
#include "parallel/comm.h"
#include "parallel/topology.h"
#include "train/checkpointing.h"
#include "train/device.h"
#include "train/evaluate.h"
#include "train/metrics.h"
#include "train/routing_seed.h"
#include "train/run_log.h"
#include "train/run_plan.h"
#include "train/step.h"
#include "train/trace.h"

namespace moe {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

// Test-only fault injection: MOECORE_FAULT_EXIT_RANK=r and MOECORE_FAULT_EXIT_STEP=n make rank r
// leave with _exit(3) when step n begins, as a crashed process would (no MPI_Finalize).
struct FaultInjection {
  int rank = -1;
  int64_t step = -1;
  static FaultInjection from_env() {
    FaultInjection f;
    const char* r = std::getenv("MOECORE_FAULT_EXIT_RANK");
    const char* n = std::getenv("MOECORE_FAULT_EXIT_STEP");
    if (r && n && *r && *n) {
      f.rank = std::atoi(r);
      f.step = std::atoll(n);
    }
    return f;
  }
  void maybe_exit(int rank_now, int64_t step_now) const {
    if (rank_now != rank || step_now != step) return;
    std::fprintf(stderr, "[rank %d] fault injection: exiting at step %lld (MOECORE_FAULT_EXIT_*)\n", rank_now,
                 (long long)step_now);
    std::fflush(nullptr);
    ::_exit(3);
  }
};

// Refuses a run whose host memory (the CPU step's state and activations, or the GPU step's host
// mirror) exceeds 90% of the machine's, before allocating it.
void check_host_memory(const RunPlan& plan) {
  const std::string problem = host_memory_problem(plan);
  MOE_CHECK(problem.empty(), "this run does not fit in host memory: ", problem);
}

void print_header(const Config& cfg, const RunPlan& plan, const Comm& world, std::ostream& out) {
  const std::string precision =
      cfg.train.fp8_scaling == "blocks" ? cfg.train.precision : cfg.train.precision + ", " + cfg.train.fp8_scaling + " scaling";
  char head[256];
  std::snprintf(head, sizeof head, "moecore train: %.2fM params (%.2fM active), %lld steps x %lld tokens on %s (%s), ",
                plan.counts.total_params / 1e6, plan.counts.active_params / 1e6, (long long)cfg.train.steps,
                (long long)plan.tokens_per_step, plan.device.c_str(), precision.c_str());
  out << head << "run dir " << cfg.run.dir << "\n" << std::flush;
  if (world.size() > 1) {
    // Under the FP8 recipe on the cpu backend the experts' input rows travel as FP8 payloads.
    const bool fp8_rows = plan.sizes.ep > 1 && plan.device == "cpu" && cfg.train.precision == "fp8";
    out << "parallel: " << world.size() << " ranks (" << world.backend() << "), dp " << plan.sizes.dp << ", ep "
        << plan.sizes.ep << (fp8_rows ? " (expert rows in FP8)" : "") << ", pp " << plan.sizes.pp << ", ZeRO-1 "
        << (plan.zero ? "on" : "off") << ", collective timeout " << world.timeout_s() << " s\n"
        << std::flush;
  }
}

// A run directory is never replaced by accident: without checkpoint.resume, a checkpoint
// directory that already holds steps is refused with the commands that continue or start over.
void check_fresh_or_resumed(const Config& cfg) {
  if (cfg.checkpoint.resume != "none") return;
  const std::string dir = checkpoint_dir(cfg);
  const std::vector<int64_t> steps = fs::exists(dir) ? list_steps(dir) : std::vector<int64_t>{};
  MOE_CHECK(steps.empty(), "the run directory '", cfg.run.dir, "' already holds checkpoints up to step ",
            steps.empty() ? 0 : steps.back(), " (", dir, "): continue that run with --checkpoint.resume=auto, or ",
            "start a new one with a fresh --run.dir (or remove '", cfg.run.dir, "' first)");
}

// The signal of a stop request on any rank (every rank agrees: a collective when the job has
// several ranks), or 0.
int stop_request(Comm& world) {
  int64_t signo = StopSignals::requested();
  if (world.size() > 1) world.all_reduce(&signo, 1, ReduceOp::kMax);
  return int(signo);
}

int64_t count_targets(const std::vector<Batch>& micro) {
  int64_t n = 0;
  for (const Batch& b : micro)
    for (int32_t t : b.targets) n += t >= 0;
  return n;
}

// One run's loop once everything is set up: submit, collect and log, eval, checkpoints, and a
// stop on a signal. Every rank runs it; `out` prints on rank 0 only.
class TrainLoop {
 public:
  TrainLoop(const Config& cfg, const RunPlan& plan, const Topology& topo, HostState& state, DataLoader& loader,
            const DataLoader* eval, Step& step, RunLog& log, MetricsWriter* metrics, TrainSummary& summary,
            std::ostream& out)
      : cfg_(cfg), plan_(plan), topo_(topo), state_(state), loader_(loader), eval_(eval), step_(step), log_(log),
        metrics_(metrics), summary_(summary), out_(out), saved_step_(summary.start_step) {
    if (!cfg.log.trace.empty()) parse_step_range(cfg.log.trace, &trace_first_, &trace_last_);
  }

  void run() {
    const FaultInjection fault = FaultInjection::from_env();
    const StopSignals signals;
    const int64_t start = summary_.start_step;
    summary_.steps_done = start;
    if (eval_due(0)) evaluate_at(0);
    log_.start_clock();
    last_done_ = log_.start_time();
    for (int64_t s = start; s < cfg_.train.steps; ++s) {
      if ((summary_.stopped_by = stop_request(*topo_.world)) != 0) break;
      fault.maybe_exit(topo_.rank, s + 1);
      submit(s + 1);
      const int64_t done = s + 1;
      const bool last = done == cfg_.train.steps;
      const bool ckpt = cfg_.checkpoint.enabled &&
                        ((cfg_.checkpoint.interval > 0 && done % cfg_.checkpoint.interval == 0) || last);
      if (eval_due(done) || ckpt) collect_all();
      if (eval_due(done)) evaluate_at(done);
      if (ckpt) log_.saved(save(done), last);
    }
    collect_all();
    if (trace_ && !trace_written_ && !trace_->empty()) write_trace();  // stopped inside the window
    if (summary_.stopped_by != 0) stop_early();
    summary_.wall_s = std::chrono::duration<double>(Clock::now() - log_.start_time()).count();
  }

 private:
  // Step `step` (1-based): its micro-batches, the global target count (host counts summed over
  // dp: no device value is read inside a step), submit; the oldest step collected once
  // in_flight() are submitted.
  void submit(int64_t step) {
    const bool traced = in_trace(step);
    if (traced && !trace_) start_trace();
    const bool interval_end = step % cfg_.log.interval == 0 || step == cfg_.train.steps;
    step_.set_phase_recording(step_.cheap_phase_times() || traced || (cfg_.log.phase_times && interval_end), traced);
    submitted_.push_back(Clock::now());
    const std::vector<Batch> micro = loader_.next();
    int64_t global_targets = count_targets(micro);
    if (plan_.sizes.dp > 1) topo_.dp_comm->all_reduce(&global_targets, 1, ReduceOp::kSum);
    step_.submit({step, &micro, global_targets, lr_at(cfg_.optim, step - 1, cfg_.train.steps)});
    if (step_.pending() >= step_.in_flight()) collect_one();
  }

  // Step time: from the later of its submission and the previous step's collection to its collection.
  void collect_one() {
    const StepStats s = step_.collect();
    const auto now = Clock::now();
    const auto began = std::max(submitted_.front(), last_done_);
    const double step_s = std::chrono::duration<double>(now - began).count();
    submitted_.pop_front();
    if (trace_ && in_trace(s.step)) {
      trace_->add_step(s.step, s.phase_intervals, steady_seconds(began), steady_seconds(now));
      if (s.step == trace_last_) write_trace();
    }
    last_done_ = now;
    const double loss = s.loss();
    if (s.skipped || !std::isfinite(loss)) log_.skipped(s.step, loss, s.grad_norm);
    if (summary_.losses.empty()) summary_.first_loss = loss;
    summary_.last_loss = loss;
    summary_.steps_done = s.step;
    summary_.losses.push_back(loss);
    log_.step(s, lr_at(cfg_.optim, s.step - 1, cfg_.train.steps), step_s, step_);
  }

  void collect_all() {
    while (step_.pending() > 0) collect_one();
  }

  bool in_trace(int64_t step) const { return trace_last_ > 0 && step >= trace_first_ && step <= trace_last_; }

  // The window's first step is next: every rank keeps its own trace (train/trace.h).
  void start_trace() {
    const int rank = topo_.rank, ranks = topo_.world->size();
    trace_.emplace(trace_path(cfg_.run.dir, rank, ranks), rank, steady_seconds(log_.start_time()));
    out_ << "trace: recording every phase of steps " << trace_first_ << ".." << trace_last_ << " into "
         << (ranks > 1 ? trace_path(cfg_.run.dir, 0, ranks) + " (one file per rank)" : trace_->path());
    if (plan_.device != "cpu")
      out_ << "; these steps run eagerly with CUDA events (no CUDA graph), each waited for; the CUDA graph resumes "
           << "at step " << trace_last_ + 1;
    out_ << "\n" << std::flush;
  }

  void write_trace() {
    fs::create_directories(cfg_.run.dir);
    const int64_t n = trace_->write();
    trace_written_ = true;
    out_ << "trace: wrote " << n << " phase events to " << trace_->path()
         << (topo_.world->size() > 1 ? " (and the other ranks' files)" : "")
         << "; open it at https://ui.perfetto.dev (Open trace file: read in the browser, nothing uploaded)\n"
         << std::flush;
  }

  // At step 0 of a fresh run, every eval_interval steps and at the end; never with interval 0.
  bool eval_due(int64_t done) const {
    const int64_t every = cfg_.train.eval_interval;
    if (eval_ == nullptr || every <= 0) return false;
    if (done == 0) return summary_.start_step == 0;
    return done % every == 0 || done == cfg_.train.steps;
  }

  void evaluate_at(int64_t done) {
    const double loss = evaluate_held_out(step_, *eval_, cfg_, *topo_.dp_comm).loss();
    (done == 0 ? summary_.initial_eval_loss : summary_.final_eval_loss) = loss;
    log_.eval(done, loss);
  }

  // The checkpoint of step `done` (every submitted step collected).
  std::string save(int64_t done) {
    step_.sync_host_state(/*all_ranks=*/!writes_replicated_checkpoint(plan_));
    summary_.last_checkpoint = save_run_checkpoint(cfg_, plan_, topo_, state_, done, loader_);
    report_mix(done);
    saved_step_ = done;
    return summary_.last_checkpoint;
  }

  // A mix's realised shares (every step collected, so the loader is at step `done`): one console
  // line and a metrics record {"step", "data_mix": [{source, weight_share, instances, share,
  // tokens}]}, tokens = instances x train.seq_len (the targets trained on).
  void report_mix(int64_t done) {
    if (loader_.num_sources() < 2) return;
    nlohmann::json mix = nlohmann::json::array();
    std::ostringstream line;
    line << "data mix through step " << done << ":";
    int64_t total = 0;
    for (const int64_t d : loader_.source_draws()) total += d;
    for (int64_t s = 0; s < loader_.num_sources(); ++s) {
      const int64_t n = loader_.source_draws()[size_t(s)];
      const double share = total ? double(n) / double(total) : 0.0;
      char buf[160];
      std::snprintf(buf, sizeof buf, "%s source %lld %lld instances = %.2f%% (weight %.2f%%), %lld tokens", s ? ";" : "",
                    (long long)s, (long long)n, 100 * share, 100 * loader_.source_share(s),
                    (long long)(n * loader_.seq_len()));
      line << buf;
      mix.push_back({{"source", s}, {"weight_share", loader_.source_share(s)}, {"instances", n}, {"share", share},
                     {"tokens", n * loader_.seq_len()}});
    }
    out_ << line.str() << "\n" << std::flush;
    if (metrics_) metrics_->write({{"step", done}, {"data_mix", mix}});
  }

  // Stopped by a signal: the last step completed is saved, and the way back is said.
  void stop_early() {
    const int64_t done = summary_.steps_done;
    if (cfg_.checkpoint.enabled && done > saved_step_) save(done);
    out_ << "stopped by " << StopSignals::name(summary_.stopped_by) << " after step " << done << " of "
         << cfg_.train.steps;
    if (!summary_.last_checkpoint.empty())
      out_ << "; checkpoint " << summary_.last_checkpoint << "; continue with the same command and "
           << "--checkpoint.resume=auto\n";
    else if (!cfg_.checkpoint.enabled)
      out_ << "; no checkpoint (checkpoint.enabled = false)\n";
    else
      out_ << "; nothing new to save\n";
    out_ << std::flush;
  }

  const Config& cfg_;
  const RunPlan& plan_;
  const Topology& topo_;
  HostState& state_;
  DataLoader& loader_;
  const DataLoader* eval_;
  Step& step_;
  RunLog& log_;
  MetricsWriter* metrics_;  // rank 0's, else null
  TrainSummary& summary_;
  std::ostream& out_;
  int64_t saved_step_;
  std::deque<Clock::time_point> submitted_;  // submission time of each pending step
  Clock::time_point last_done_;
  int64_t trace_first_ = 0, trace_last_ = 0;  // log.trace's window; 0: none
  std::optional<StepTrace> trace_;
  bool trace_written_ = false;
};

}  // namespace

TrainSummary train(const Config& cfg, std::ostream& out) { return train(cfg, out, world_comm()); }

TrainSummary train(const Config& cfg, std::ostream& console, Comm& world) {
  world.set_timeout_s(cfg.parallel.timeout_s);
  const RunPlan plan = make_run_plan(cfg, world.size(), resolve_device(cfg.train));
  const Topology topo = make_topology(cfg, world);
  const bool lead = world.rank() == 0;
  std::ostream null_out(nullptr);  // ranks other than 0 print nothing
  std::ostream& out = lead ? console : null_out;
  check_fresh_or_resumed(cfg);
  if (lead) remove_stale_temporaries(checkpoint_dir(cfg));  // of an interrupted save or prune
  check_host_memory(plan);  // before anything large is allocated
  std::ostringstream data_lines;  // printed after the header
  DataSources data = open_data(cfg, data_lines);  // checks every source before step 1, a line each
  DataLoader loader(data.train_sources, plan.seq_len, plan.global_batch, plan.micro_batch, cfg.train.seed, topo.dp_rank,
                    plan.sizes.dp);
  std::optional<DataLoader> eval;
  if (data.eval) eval.emplace(*data.eval, plan.seq_len, plan.micro_batch, plan.micro_batch, cfg.train.seed, 0, 1);

  // On the GPU a fresh run initialises on the device: the host mirror waits for a checkpoint.
  // The GPU step initialises a fresh run on the device; a GPU pipeline stage starts from the host's
  // values (each stage's tensors as the whole model's).
  HostState state(cfg, plan, topo, /*init=*/plan.device == "cpu" || plan.sizes.pp > 1);
  TrainSummary summary;
  summary.run_dir = cfg.run.dir;
  summary.start_step = summary.steps_done = resume_run(cfg, state, loader, out);
  const int64_t start = summary.start_step;
  MOE_CHECK(start <= cfg.train.steps, "checkpoint step ", start, " is beyond train.steps = ", cfg.train.steps,
            "; raise train.steps to at least ", start, " to continue this run");
  if (start == cfg.train.steps) {  // a finished run: nothing to train, nothing rewritten
    out << "already at step " << start << " of " << cfg.train.steps << ": nothing to train (raise train.steps to "
        << "continue this run)\n";
    return summary;
  }
  // The run has started: its resolved config, and metrics.jsonl kept up to the resumed step.
  std::optional<MetricsWriter> metrics;  // rank 0 writes metrics.jsonl
  if (lead) {
    fs::create_directories(cfg.run.dir);
    write_file_atomic((fs::path(cfg.run.dir) / "config.toml").string(), config_to_toml(cfg));
    metrics.emplace((fs::path(cfg.run.dir) / "metrics.jsonl").string(), /*keep_through_step=*/start);
  }
  print_header(cfg, plan, world, out);
  out << data_lines.str() << std::flush;
  const std::unique_ptr<Step> step = make_step(cfg, plan, topo, &state, out);
  // Open MPI hands ranks a pty even when mpirun's output goes to a file: no live line there.
  const bool tty = isatty(fileno(stdout)) && &out == &std::cout && world.size() == 1;
  RunLog log(cfg, plan.tokens_per_step, plan.sizes.ep, out, metrics ? &*metrics : nullptr, tty, start,
             metrics ? metrics->kept_wall_s() : 0.0);
  TrainLoop(cfg, plan, topo, state, loader, eval ? &*eval : nullptr, *step, log, metrics ? &*metrics : nullptr, summary,
            out)
      .run();
  return summary;
}

}  // namespace moe
