// RoPE in place on x[B, S, H, hd], HF rotate_half pairs (i, i + hd/2), angle (pos0 + s) * theta^(-2i/hd)
// (pos0: the position of row s = 0; 0 in training, the KV cache's length in decoding).
// Forward (a, b) -> (a cos - b sin, b cos + a sin); backward the transpose (a cos + b sin,
// b cos - a sin). A block per (position s, batch slice) fills a shared (cos, sin) table for s
// (angle formed and reduced to [-pi, pi] in double, then sincosf: |error| < 3e-7), then rotates
// every head of its rows. BF16 storage, FP32 math.
#pragma once

#include "cuda/kernels/vec.cuh"

namespace moe::cuda::kernels {

constexpr int kRopeThreads = 128;

// (cos, sin) of pair i at position pos: the angle formed and reduced to [-pi, pi] in double, then
// sincosf.
__device__ __forceinline__ float2 rope_cos_sin(int64_t pos, int i, int head_dim, double log2_theta) {
  constexpr double kTwoPi = 6.283185307179586476925;
  const double inv_freq = exp2(-(2.0 * i / head_dim) * log2_theta);
  const double angle = static_cast<double>(pos) * inv_freq;
  const double reduced = fma(-rint(angle * (1.0 / kTwoPi)), kTwoPi, angle);
  float sn, cs;
  sincosf(static_cast<float>(reduced), &sn, &cs);
  return make_float2(cs, sn);
}

// One pair (a, b) rotated by t = (cos, sin) (forward) or by its transpose (backward); each
// product rounded, one FMA, in a fixed form so that every kernel rotating pairs gets the same bits.
template <bool kBackward>
__device__ __forceinline__ void rope_rotate(float a, float b, float2 t, float& lo, float& hi) {
  if constexpr (kBackward) {
    lo = __fmaf_rn(a, t.x, __fmul_rn(b, t.y));
    hi = __fmaf_rn(b, t.x, -__fmul_rn(a, t.y));
  } else {
    lo = __fmaf_rn(a, t.x, -__fmul_rn(b, t.y));
    hi = __fmaf_rn(b, t.x, __fmul_rn(a, t.y));
  }
}

template <int V, bool kBackward>
__global__ void __launch_bounds__(kRopeThreads)
    rope_rotate_pairs(uint16_t* __restrict__ x, int64_t batch, int64_t seq, int64_t pos0, int heads,
                      int head_dim, double log2_theta) {
  extern __shared__ float2 s_cos_sin[];  // [head_dim / 2]
  const int half = head_dim / 2;
  const int64_t s = blockIdx.x;
  for (int i = threadIdx.x; i < half; i += blockDim.x) s_cos_sin[i] = rope_cos_sin(s + pos0, i, head_dim, log2_theta);
  __syncthreads();

  const int groups = half / V;
  const int items = heads * groups;  // (head, group of V pairs) per token
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    uint16_t* token = x + (b * seq + s) * heads * head_dim;
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
      const int h = it / groups;
      const int i0 = (it - h * groups) * V;
      uint16_t* lo = token + int64_t{h} * head_dim + i0;
      uint16_t* hi = lo + half;
      float a[V], bv[V], out_lo[V], out_hi[V];
      load_bf16<V>(lo, a);
      load_bf16<V>(hi, bv);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        rope_rotate<kBackward>(a[k], bv[k], s_cos_sin[i0 + k], out_lo[k], out_hi[k]);
      }
      store_bf16<V>(lo, out_lo);
      store_bf16<V>(hi, out_hi);
    }
  }
}

}  // namespace moe::cuda::kernels
