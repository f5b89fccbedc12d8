// One whole training step on one GPU without host synchronisation (CUDA builds only). A step
// is every micro-batch's forward and backward (FP32 gradients accumulated), the global grad
// norm, clipping, AdamW on the FP32 master weights, the BF16 refresh and the aux-loss-free
// expert-bias update, all enqueued on the model's stream. The host never reads a device value
// inside a step: the step's statistics are copied asynchronously into pinned host memory and
// collected one step later. When the config allows it (learned routing; no phase timer), the
// step after the first is captured once in a CUDA graph and replayed.
#pragma once

#ifdef MOECORE_HAS_CUDA

#include <cstdint>
#include <memory>
#include <vector>

#include "core/config.h"
#include "data/dataset.h"
#include "model/cuda_model.h"

namespace moe {
namespace cuda {
class EventTimer;
}

struct StepStats {
  int64_t step = 0;          // 1-based number of the step these statistics belong to
  double ce_sum = 0;         // summed over micro-batches
  int64_t num_targets = 0;
  double lb_loss = 0, z_loss = 0;  // mean over micro-batches (each a mean over MoE layers)
  std::vector<std::vector<int64_t>> tokens_per_expert;  // [MoE layer][expert], summed over micro-batches
  int64_t num_routes = 0;
  double grad_norm = 0;      // before clipping
  bool skipped = false;      // non-finite grad norm: no update, no bias change
};

class CudaStepRunner {
 public:
  // Allocates the model (parameters zero), gradients, moments (zero) and the step buffers for
  // micro-batches of cfg.train.micro_batch x cfg.train.seq_len tokens on the current device.
  explicit CudaStepRunner(const Config& cfg);
  ~CudaStepRunner();
  CudaStepRunner(const CudaStepRunner&) = delete;
  CudaStepRunner& operator=(const CudaStepRunner&) = delete;

  CudaModel& model();
  // Host state in: FP32 params and moments [layout().total_numel()] (moments may be null: zero),
  // optimizer steps taken, expert bias [MoE layers x E]. Waits for the copies.
  void load_state(const float* params, const float* exp_avg, const float* exp_avg_sq, int64_t optimizer_steps,
                  const std::vector<float>& expert_bias);
  // Host state out (waits for every submitted step): the same buffers.
  void download_state(float* params, float* exp_avg, float* exp_avg_sq, int64_t* optimizer_steps,
                      std::vector<float>* expert_bias);

  // Enqueues step `step` (1-based). micro: this rank's micro-batches; global_targets: targets of
  // the whole step (sets the CE scale); lr from the schedule; routing seeds as the CPU trainer.
  // Returns without waiting for the GPU.
  void submit(int64_t step, const std::vector<Batch>& micro, int64_t global_targets, double lr, uint64_t train_seed);
  // Statistics of the oldest submitted step not yet collected; waits only for that step.
  // Throws when nothing is pending, or when the device counted bad token ids or targets.
  StepStats collect();
  int64_t pending() const;

  // Eager forward of one batch for evaluation (waits; returns CE sum and target count).
  ForwardStats evaluate(const Batch& b, uint64_t routing_seed);

  // While set, steps run eagerly and mark phases on the timer (bench profiling); nullptr: off.
  void set_phase_timer(cuda::EventTimer* timer);
  // True when the config allows graph capture (learned routing) and capture is on.
  bool uses_graph() const;
  void set_use_graph(bool on);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe

#endif  // MOECORE_HAS_CUDA
