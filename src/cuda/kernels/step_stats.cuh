// Device code of the step statistics (ops/step_stats.h; the record in step_stats_types.h): a
// one-block accumulation of the router's per-layer losses and counts into the step record, the
// one-thread loss guard and finish, and the expert-bias update (one block per MoE layer, an
// integer block sum for the layer's mean count).
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/optim_types.h"
#include "cuda/step_stats_types.h"

namespace moe::cuda::kernels {

constexpr int kStepStatsThreads = 256;

__global__ void __launch_bounds__(kStepStatsThreads)
    step_stats_accumulate_router_block(const float* __restrict__ losses, const int32_t* __restrict__ counts,
                                       const int32_t* __restrict__ dropped, int num_layers, int64_t num_counts,
                                       StepStatsRecord* __restrict__ rec, int64_t* __restrict__ counts_sum,
                                       int64_t* __restrict__ layer_dropped, double* __restrict__ layer_losses) {
  if (threadIdx.x == 0) {
    double lb = 0.0, z = 0.0;
    uint32_t drops = 0;
    for (int l = 0; l < num_layers; ++l) {
      lb += static_cast<double>(losses[2 * l]);
      z += static_cast<double>(losses[2 * l + 1]);
      if (dropped != nullptr) drops += static_cast<uint32_t>(dropped[l]);
    }
    rec->lb_sum += lb;
    rec->z_sum += z;
    rec->num_dropped += drops;
  }
  for (int64_t i = threadIdx.x; i < num_counts; i += blockDim.x) counts_sum[i] += counts[i];
  for (int l = threadIdx.x; l < num_layers; l += blockDim.x) {
    layer_losses[2 * l] += static_cast<double>(losses[2 * l]);
    layer_losses[2 * l + 1] += static_cast<double>(losses[2 * l + 1]);
    if (dropped != nullptr) layer_dropped[l] += dropped[l];
  }
}

__global__ void step_guard_nonfinite_loss_thread(StepStatsRecord* __restrict__ rec, OptimStepScalars* __restrict__ s) {
  rec->grad_norm = s->grad_norm;
  if (!isfinite(rec->ce_sum)) s->grad_norm = __longlong_as_double(0x7ff8000000000000ll);  // quiet NaN
}

__global__ void step_stats_finish_thread(const OptimStepScalars* __restrict__ s, StepStatsRecord* __restrict__ rec) {
  rec->skipped = s->skipped;
  rec->optimizer_steps = s->step;
  rec->num_skipped = s->num_skipped;
}

// Block l updates layer l. Every thread must take part in the block sum.
__global__ void __launch_bounds__(kStepStatsThreads)
    expert_bias_update_per_layer(const int64_t* __restrict__ counts_sum, int num_experts, double rate,
                                 const OptimStepScalars* __restrict__ s, float* __restrict__ bias) {
  if (s->skipped != 0) return;  // uniform over the grid: no block reaches the barrier
  __shared__ long long s_part[kStepStatsThreads];
  const int64_t* c = counts_sum + static_cast<int64_t>(blockIdx.x) * num_experts;
  float* b = bias + static_cast<int64_t>(blockIdx.x) * num_experts;
  long long part = 0;
  for (int i = threadIdx.x; i < num_experts; i += blockDim.x) part += c[i];
  s_part[threadIdx.x] = part;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (static_cast<int>(threadIdx.x) < stride) s_part[threadIdx.x] += s_part[threadIdx.x + stride];
    __syncthreads();
  }
  const double mean = static_cast<double>(s_part[0]) / static_cast<double>(num_experts);
  for (int i = threadIdx.x; i < num_experts; i += blockDim.x) {
    const double diff = mean - static_cast<double>(c[i]);
    const double sign = diff > 0.0 ? 1.0 : (diff < 0.0 ? -1.0 : 0.0);
    b[i] += static_cast<float>(rate * sign);
  }
}

}  // namespace moe::cuda::kernels
