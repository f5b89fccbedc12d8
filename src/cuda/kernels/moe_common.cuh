// Warp helpers for the MoE routing kernels: max, double and int32 sums in a fixed butterfly
// order and an inclusive scan by shuffle-up, so every reduction is deterministic.
#pragma once

#include <cstdint>

#include "cuda/kernels/vec.cuh"

namespace moe::cuda::kernels {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ int32_t warp_sum(int32_t v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

// Lane i gets v_0 + ... + v_i.
__device__ __forceinline__ int32_t warp_inclusive_scan(int32_t v) {
  const int lane = threadIdx.x & (kWarpSize - 1);
#pragma unroll
  for (int o = 1; o < kWarpSize; o <<= 1) {
    const int32_t u = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

}  // namespace moe::cuda::kernels
