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

}  // namespace moe::cuda::kernels
