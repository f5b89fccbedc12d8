// The step interface the training loop and the bench drive on every backend: submit a step's
// micro-batches, collect its statistics. The CPU step runs synchronously inside submit (its
// statistics are ready at once); the GPU step only enqueues work and its statistics arrive one
// step later, so the loop keeps up to in_flight() steps submitted before it collects. Both hold
// the run's FP32 state in a HostState (train/checkpointing.h): the CPU step trains it in place,
// the GPU step keeps it as the checkpoint mirror and fills it on sync_host_state().
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/phase_timer.h"
#include "data/dataset.h"
#include "model/model.h"

namespace moe {

struct HostState;
struct RunPlan;
struct Topology;

// With data parallelism every figure is global: summed (or averaged) over the micro-batches of
// every rank, identical on every rank.
struct StepStats {
  int64_t step = 0;          // 1-based number of the step these statistics belong to
  double ce_sum = 0;         // summed over micro-batches
  int64_t num_targets = 0;   // targets of the global batch
  double lb_loss = 0, z_loss = 0;  // mean over micro-batches (each a mean over MoE layers)
  std::vector<std::vector<int64_t>> tokens_per_expert;  // [MoE layer][expert], summed over micro-batches
  int64_t num_routes = 0;
  int64_t num_dropped = 0;   // routes dropped by expert capacity
  // Per MoE layer, in layer order: the router's losses (mean over micro-batches; lb_loss and
  // z_loss are their mean over layers) and the routes dropped by capacity (summed).
  std::vector<double> layer_lb_loss, layer_z_loss;
  std::vector<int64_t> layer_dropped;
  // The aux-loss-free expert bias [MoE layer x expert] after this step's update (zeros when
  // moe.bias_update_rate is 0; empty when the step did not record it).
  std::vector<float> expert_bias;
  double grad_norm = 0;      // before clipping
  bool skipped = false;      // non-finite grad norm or loss: no update, no bias change
  int64_t optimizer_steps = 0;  // AdamW steps taken after this step (skipped steps do not count)
  // This rank's phase times (Step::set_phase_recording): milliseconds per phase (kNumPhases
  // entries, or empty when the step was not timed), and the phase intervals (when asked).
  std::vector<double> phase_ms;
  std::vector<PhaseInterval> phase_intervals;
  double loss() const;       // ce_sum / max(1, num_targets)
};

// Sums a step's statistics over `comm` (CE sum, router losses and per-layer figures, routes, drops,
// expert counts; no-op on one rank): global figures on every rank, so every rank decides alike.
class Comm;
void sum_step_stats(StepStats& st, Comm& comm);

// One step's inputs: this rank's micro-batches (plan.micro_steps of them, one shape), the
// targets of the whole step over every rank (the CE scale is 1 / global_targets), the learning
// rate. Micro-batch m of dp rank r routes with routing_seed(train.seed, step - 1,
// r x micro_steps + m) (train/routing_seed.h), its index in the global batch.
struct StepInput {
  int64_t step = 0;  // 1-based, larger than every step submitted before
  const std::vector<Batch>* micro = nullptr;
  int64_t global_targets = 0;
  double lr = 0;
};

// Device figures of a logged interval (GPU steps; the CPU step has none).
struct DeviceFigures {
  double tflops_per_gpu = 0;
  double mem_peak_gib = 0;
  double mem_used_gib = 0;
  int64_t num_gpus = 1;
};

class Step {
 public:
  virtual ~Step() = default;
  virtual void submit(const StepInput& in) = 0;
  // Statistics of the oldest submitted step not yet collected (waits for it).
  virtual StepStats collect() = 0;
  virtual int64_t pending() const = 0;
  // Steps the loop keeps submitted before collecting the oldest (1: synchronous).
  virtual int64_t in_flight() const = 0;
  // One evaluation forward of `b` on this rank (waits); the caller sums over ranks. When
  // eval_is_collective(), every rank of the group must call it the same number of times.
  virtual ForwardStats evaluate(const Batch& b, uint64_t routing_seed) = 0;
  virtual bool eval_is_collective() const = 0;
  // Makes the HostState's parameters, moments, optimizer step count and expert bias those of
  // the last step (every submitted step must have been collected). `all_ranks` false: only rank
  // 0 needs them.
  virtual void sync_host_state(bool all_ranks) = 0;
  // Figures of `steps` steps that took `seconds` (GPU steps), or none.
  virtual bool has_device_figures() const { return false; }
  virtual DeviceFigures device_figures(int64_t steps, double seconds) const { return {}; }

  // Phase recording of the steps submitted from now on: times fills StepStats::phase_ms,
  // intervals also StepStats::phase_intervals. The CPU step times with its PhaseTimer (cheap); the
  // GPU step runs such a step eagerly with CUDA events (no CUDA graph) and waits for it in submit.
  // Every rank of a job must make the same calls.
  virtual void set_phase_recording(bool times, bool intervals) = 0;
  // True when timing a step costs next to nothing (the CPU step): the loop then times every step.
  virtual bool cheap_phase_times() const = 0;

  // Bench: phase profiling of the steps submitted while on (eager steps on the GPU), the phase
  // times of the last profiled step in milliseconds, and backend figures for the bench record
  // (device, graph, collectives, exchange traffic) measured after the timed steps.
  virtual void set_profiling(bool on) = 0;
  virtual std::vector<std::pair<std::string, double>> profiled_phases_ms() = 0;
  virtual nlohmann::json bench_details() = 0;
};

// The step of `plan.device` over `state` (a HostState of the same plan and topology that must
// outlive the step). The GPU step binds this rank's GPU and makes its NCCL groups (printing the
// binding and the groups to `out`), uploads the state, and runs every step after the first as one
// CUDA graph when the config allows it. state == nullptr (GPU only, the bench): parameters are
// initialised on the device from train.seed and there is no host mirror (sync_host_state throws).
std::unique_ptr<Step> make_step(const Config& cfg, const RunPlan& plan, const Topology& topo, HostState* state,
                                std::ostream& out);
// The GPU step alone (train/gpu_step.cpp); builds without CUDA throw.
std::unique_ptr<Step> make_gpu_step(const Config& cfg, const RunPlan& plan, const Topology& topo, HostState* state,
                                    std::ostream& out);
// Why `plan` does not fit this rank's GPU now (its estimate against the device's free memory, the
// message the GPU step refuses with), or "" when it fits. Builds without CUDA: why it cannot run.
std::string gpu_fit_problem(const RunPlan& plan);

}  // namespace moe
