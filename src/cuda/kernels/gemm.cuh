// Device code beside the cuBLASLt GEMM: the k = 0 case, where the product is empty and
// C = beta * C, as cpu::gemm defines it (beta == 0 writes zeros without reading C, so NaN in an
// unwritten C does not survive). C is `batch` row-major [m, n] matrices, leading dim ldc,
// stride_c elements apart; FP32 math, BF16 stores round to nearest even.
#pragma once

#include "cuda/kernels/vec.cuh"

namespace moe::cuda::kernels {

template <typename T>
__device__ __forceinline__ float load_as_f32(const T* p) {
  if constexpr (sizeof(T) == 2) {
    return bf16_bits_to_f32(*p);
  } else {
    return *p;
  }
}

template <typename T>
__device__ __forceinline__ void store_from_f32(T* p, float v) {
  if constexpr (sizeof(T) == 2) {
    *p = f32_to_bf16_bits(v);
  } else {
    *p = v;
  }
}

// T = uint16_t (BF16 bits) or float. Grid-stride over the batch * m * n elements.
template <typename T>
__global__ void gemm_scale_c_elements(T* __restrict__ c, int64_t m, int64_t n, int64_t ldc, int64_t stride_c,
                                      int64_t batch, float beta) {
  const int64_t per_matrix = m * n;
  const int64_t total = per_matrix * batch;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t b = i / per_matrix;
    const int64_t r = (i % per_matrix) / n;
    const int64_t col = i % n;
    T* p = c + b * stride_c + r * ldc + col;
    store_from_f32(p, beta == 0.0f ? 0.0f : beta * load_as_f32(p));
  }
}

}  // namespace moe::cuda::kernels
