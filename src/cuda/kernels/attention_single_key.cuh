// Causal attention backward for seq = 1, where every query sees exactly one key (its own): P = 1,
// so dV[b, kvh] = sum over the group's query heads h of dO[b, h] (FP32, heads in increasing order,
// one BF16 rounding), and dS = P * (dP - rowsum(dO * O)) = dP - dP = 0, so dQ = dK = 0 exactly.
// Layout [B, 1, H, D] BF16; one thread per output element, grid-stride.
#pragma once

#include <cstdint>

#include "cuda/kernels/vec.cuh"

namespace moe::cuda::kernels {

__global__ void attention_backward_single_key(const uint16_t* __restrict__ dout, uint16_t* __restrict__ dq,
                                              uint16_t* __restrict__ dk, uint16_t* __restrict__ dv, int64_t batch,
                                              int q_heads, int kv_heads, int head_dim) {
  const int group = q_heads / kv_heads;
  const int64_t n_q = batch * q_heads * head_dim, n_kv = batch * kv_heads * head_dim;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_q; i += stride) {
    dq[i] = 0;
    if (i >= n_kv) continue;
    // i = (b * kv_heads + kvh) * head_dim + d; query head h = kvh * group + g reads row b, head h.
    const int64_t d = i % head_dim, bk = i / head_dim;
    const int64_t b = bk / kv_heads, kvh = bk % kv_heads;
    const uint16_t* src = dout + (b * q_heads + kvh * group) * head_dim + d;
    float sum = 0.f;
    for (int g = 0; g < group; ++g) sum += bf16_bits_to_f32(src[static_cast<int64_t>(g) * head_dim]);
    dk[i] = 0;
    dv[i] = f32_to_bf16_bits(sum);
  }
}

}  // namespace moe::cuda::kernels
