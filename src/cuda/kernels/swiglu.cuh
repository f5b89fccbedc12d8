// SwiGLU kernels on a fused gate/up row layout: gate_up[N, 2I] (gate columns [0, I), up
// [I, 2I)), h[N, I] = silu(g) * u with silu(g) = g * s, s = 1 / (1 + exp(-g)); backward
// dg = dh * u * s * (1 + g * (1 - s)), du = dh * g * s. BF16 in/out, FP32 math. Rows x vectors
// layout: threadIdx.y picks the row, threadIdx.x walks V-element vectors of it.
#pragma once

#include "cuda/kernels/vec.cuh"

namespace moe::cuda::kernels {

__device__ __forceinline__ float sigmoid_f32(float g) { return 1.0f / (1.0f + expf(-g)); }

// The element math every SwiGLU kernel shares (the fused FP8 kernels' values are these, bitwise).
__device__ __forceinline__ float swiglu_value(float g, float u) { return g * sigmoid_f32(g) * u; }
__device__ __forceinline__ void swiglu_grads(float g, float u, float d, float& dg, float& du) {
  const float s = sigmoid_f32(g);
  dg = d * u * s * (1.0f + g * (1.0f - s));
  du = d * (g * s);
}

template <int V>
__global__ void swiglu_forward_rows(const uint16_t* __restrict__ gate_up, uint16_t* __restrict__ h,
                                    int64_t n, int64_t inner) {
  const int64_t vecs = inner / V;
  for (int64_t row = int64_t{blockIdx.x} * blockDim.y + threadIdx.y; row < n;
       row += int64_t{gridDim.x} * blockDim.y) {
    const uint16_t* g_row = gate_up + row * 2 * inner;
    const uint16_t* u_row = g_row + inner;
    uint16_t* h_row = h + row * inner;
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      float g[V], u[V], out[V];
      load_bf16<V>(g_row + v * V, g);
      load_bf16<V>(u_row + v * V, u);
#pragma unroll
      for (int i = 0; i < V; ++i) out[i] = swiglu_value(g[i], u[i]);
      store_bf16<V>(h_row + v * V, out);
    }
  }
}

template <int V>
__global__ void swiglu_backward_rows(const uint16_t* __restrict__ gate_up, const uint16_t* __restrict__ dh,
                                     uint16_t* __restrict__ dgate_up, int64_t n, int64_t inner) {
  const int64_t vecs = inner / V;
  for (int64_t row = int64_t{blockIdx.x} * blockDim.y + threadIdx.y; row < n;
       row += int64_t{gridDim.x} * blockDim.y) {
    const uint16_t* g_row = gate_up + row * 2 * inner;
    const uint16_t* u_row = g_row + inner;
    const uint16_t* dh_row = dh + row * inner;
    uint16_t* dg_row = dgate_up + row * 2 * inner;
    uint16_t* du_row = dg_row + inner;
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      float g[V], u[V], d[V], dg[V], du[V];
      load_bf16<V>(g_row + v * V, g);
      load_bf16<V>(u_row + v * V, u);
      load_bf16<V>(dh_row + v * V, d);
#pragma unroll
      for (int i = 0; i < V; ++i) swiglu_grads(g[i], u[i], d[i], dg[i], du[i]);
      store_bf16<V>(dg_row + v * V, dg);
      store_bf16<V>(du_row + v * V, du);
    }
  }
}

}  // namespace moe::cuda::kernels
