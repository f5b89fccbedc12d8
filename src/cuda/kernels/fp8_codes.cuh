// FP8 codes on the device: the hardware's round-to-nearest-even, saturating conversion
// (cuda_fp8.h) and its decoding, for every kernel that writes or reads FP8 codes (no kernels here,
// so any number of translation units may include it).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "core/fp8_types.h"

namespace moe::cuda::kernels {

__device__ __forceinline__ uint8_t fp8_encode_dev(float v, Fp8Format f) {
  return static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(v, __NV_SATFINITE, f == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2));
}

__device__ __forceinline__ float fp8_decode_dev(uint8_t q, Fp8Format f) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(q),
                                               f == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2);
  return __half2float(__half(h));
}

// One 1 x 128 block held by a half-warp, lane l of the half its elements 8l .. 8l + 7 in v: the
// block's max |x| by shuffles within the half (order-free, so the scale is the CPU's bit for bit),
// the scale amax / fp8_max (1 for an all-zero block) into *scale by the half's first lane, the
// eight codes fp8(x / scale) stored as one 8-byte word at q, the non-finite elements added to
// *num_nonfinite (when not null). Every lane of the warp calls it (the shuffles); a lane whose
// half holds no block passes valid = false and stores nothing.
__device__ __forceinline__ void fp8_quantize_half_warp_block(const float (&v)[8], bool valid, Fp8Format f,
                                                             uint8_t* q, float* scale, uint32_t* num_nonfinite) {
  float local = 0.0f;
  uint32_t bad = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    bad += isfinite(v[j]) ? 0u : 1u;
    local = fmaxf(local, fabsf(v[j]));
  }
  for (int o = 8; o > 0; o >>= 1) {  // within the half-warp
    local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, o));
    bad += __shfl_xor_sync(0xffffffffu, bad, o);
  }
  if (!valid) return;
  const bool first = threadIdx.x % 16 == 0;
  if (first && bad != 0 && num_nonfinite != nullptr) atomicAdd(num_nonfinite, bad);
  float s = __fdiv_rn(local, fp8_max_of(f));
  if (!(s > 0.0f)) s = 1.0f;
  if (first) *scale = s;
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    lo |= uint32_t{fp8_encode_dev(__fdiv_rn(v[j], s), f)} << (8 * j);
    hi |= uint32_t{fp8_encode_dev(__fdiv_rn(v[j + 4], s), f)} << (8 * j);
  }
  *reinterpret_cast<uint2*>(q) = make_uint2(lo, hi);
}

}  // namespace moe::cuda::kernels
