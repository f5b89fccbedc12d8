// The plain record of a training step's statistics on the device, shared by the entry header
// (ops/step_stats.h) and the device code (kernels/step_stats.cuh). No CUDA headers: the host
// copies the record back and reads the same 64-byte layout (8-byte aligned) that kernels write.
#pragma once

#include <cstdint>

namespace moe::cuda {

// One step's statistics in device memory: this 64-byte record, followed in the same allocation by
// the routed (token, slot) pairs per expert summed over the step's forwards, int64
// [num_moe_layers, num_experts], then each MoE layer's dropped routes, int64 [num_moe_layers], then
// each layer's (lb, z) router losses summed over the forwards, FP64 [num_moe_layers, 2]
// (ops/step_stats.h: step_stats_counts, step_stats_layer_dropped, step_stats_layer_losses).
// Zeroed at the start of a step (memset), filled by the forwards and the optimizer, copied to the
// host in one piece of step_stats_bytes(...) bytes.
struct StepStatsRecord {
  double ce_sum = 0;            // sum of the forwards' per-token cross-entropy (targets >= 0)
  double lb_sum = 0;            // sum over forwards and MoE layers of the load-balancing loss
  double z_sum = 0;             // the same for the router z-loss
  double grad_norm = 0;         // global grad norm before clipping (step_guard_nonfinite_loss)
  int64_t optimizer_steps = 0;  // AdamW steps taken after this step (step_stats_finish)
  int64_t num_skipped = 0;      // skipped steps so far (step_stats_finish)
  uint32_t bad_ids = 0;         // input ids outside [0, vocab) seen by the forwards
  uint32_t bad_targets = 0;     // targets >= vocab seen by the forwards
  uint32_t num_dropped = 0;     // routes dropped by expert capacity, over the forwards and MoE layers
  int32_t skipped = 0;          // 1: the step changed nothing (non-finite grad norm or loss)
};
static_assert(sizeof(StepStatsRecord) == 64 && alignof(StepStatsRecord) == 8,
              "StepStatsRecord is a 64-byte device record followed by int64 counts");

}  // namespace moe::cuda
