// A training step's statistics kept on the device, and the step's small device-side updates:
// router losses and expert counts summed over micro-batches, the loss guard before AdamW, the
// aux-loss-free expert-bias update (Model<float>::update_expert_bias on the step's summed counts,
// skipped with the step) and the record's final optimizer fields. Every entry point only enqueues
// work (no host read of a device value): all are capturable in a CUDA graph.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/device.h"
#include "cuda/step_stats_types.h"

namespace moe::cuda {

struct OptimStepScalars;

// Bytes of the record plus its per-layer arrays (step_stats_types.h).
size_t step_stats_bytes(int64_t num_moe_layers, int64_t num_experts);
// The arrays that follow the record (pointer arithmetic only, valid on device and host copies):
// counts [M, E] int64, then dropped routes per layer [M] int64 (so counts and drops are one int64
// run of M x (E + 1) for a reduction), then the per-layer (lb, z) sums [M, 2] FP64.
int64_t* step_stats_counts(StepStatsRecord* rec);
const int64_t* step_stats_counts(const StepStatsRecord* rec);
int64_t* step_stats_layer_dropped(StepStatsRecord* rec, int64_t num_moe_layers, int64_t num_experts);
const int64_t* step_stats_layer_dropped(const StepStatsRecord* rec, int64_t num_moe_layers, int64_t num_experts);
double* step_stats_layer_losses(StepStatsRecord* rec, int64_t num_moe_layers, int64_t num_experts);
const double* step_stats_layer_losses(const StepStatsRecord* rec, int64_t num_moe_layers, int64_t num_experts);

// One forward's router outputs into the step sums: rec->lb_sum += sum_l losses[2l],
// rec->z_sum += sum_l losses[2l + 1] (FP64, in layer order), the per-layer sums
// layer_losses[2l + j] += losses[2l + j], counts_sum[i] += counts[i] for
// i < num_moe_layers * num_experts. losses [M, 2] FP32 and counts [M, E] int32 are what
// router_forward / build_dispatch_map wrote per layer. One block, no atomics: deterministic.
// dropped [M] int32 (or nullptr: dropless): each layer's dropped routes (build_dispatch_map's
// num_dropped), added to rec->num_dropped and to layer_dropped[l].
void step_stats_accumulate_router(const float* losses, const int32_t* counts, const int32_t* dropped,
                                  int64_t num_moe_layers, int64_t num_experts, StepStatsRecord* rec, Stream stream);

// rec->grad_norm = scalars->grad_norm (after global_grad_norm); then, when rec->ce_sum is not
// finite, scalars->grad_norm = NaN so that adamw_step skips the step, as the CPU trainer skips a
// step whose loss is not finite. One thread.
void step_guard_nonfinite_loss(StepStatsRecord* rec, OptimStepScalars* scalars, Stream stream);

// Unless scalars->skipped (read on the device, after adamw_step): for each MoE layer l,
// mean_l = (sum_i counts_sum[l, i]) / E in FP64 and bias[l, i] += float(rate * sign(mean_l -
// counts_sum[l, i])): bitwise Model<float>::update_expert_bias (integer sums below 2^53 are exact
// in FP64 in any order). bias [M, E] FP32. One block per layer; E <= 4096.
void expert_bias_update(const int64_t* counts_sum, int64_t num_moe_layers, int64_t num_experts, double rate,
                        const OptimStepScalars* scalars, float* bias, Stream stream);

// rec->skipped, rec->optimizer_steps and rec->num_skipped from scalars (after adamw_step). One thread.
void step_stats_finish(const OptimStepScalars* scalars, StepStatsRecord* rec, Stream stream);

}  // namespace moe::cuda
