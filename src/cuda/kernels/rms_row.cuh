// The forward RMSNorm's row statistic, shared by the kernels that normalise rows forward
// (rmsnorm.cuh, rmsnorm_rope.cuh) so that they agree bitwise.
#pragma once

#include "cuda/kernels/vec.cuh"

namespace moe::cuda::kernels {

// sum_sq += the squares of v, in order.
template <int V>
__device__ __forceinline__ void rms_add_squares(const float (&v)[V], float& sum_sq) {
#pragma unroll
  for (int i = 0; i < V; ++i) sum_sq += v[i] * v[i];
}

// The row's rstd from each lane's sum of the squares of its pieces (every lane returns it).
__device__ __forceinline__ float rms_rstd_of_lane_sums(float sum_sq, int64_t d, float eps) {
  sum_sq = warp_sum(sum_sq);
  return 1.0f / sqrtf(sum_sq / static_cast<float>(d) + eps);
}

// 1 / sqrt(mean(x_row^2) + eps) of a row of d, a warp per row (every lane returns it): lane l
// sums the squares of its V-element pieces l, l + 32, ... in order, then the warp's butterfly.
template <int V>
__device__ __forceinline__ float rms_row_rstd(const uint16_t* __restrict__ x_row, int64_t d, float eps, int lane) {
  float sum_sq = 0.0f;
#pragma unroll 4
  for (int64_t c = int64_t{lane} * V; c < d; c += kWarpSize * V) {
    float v[V];
    load_bf16<V>(x_row + c, v);
    rms_add_squares(v, sum_sq);
  }
  return rms_rstd_of_lane_sums(sum_sq, d, eps);
}

}  // namespace moe::cuda::kernels
