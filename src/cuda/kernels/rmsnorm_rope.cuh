// QK-norm and RoPE in one pass (cuda::rmsnorm_rope_forward): each row of x[batch, seq, heads *
// head_dim] normalised over its whole width (rms_row_rstd, rstd saved), then its pairs rotated
// (rope_cos_sin, rope_rotate) from the normalised values rounded to BF16, as rmsnorm_forward then
// rope_forward would store and reload them: the same bits with one read and one write of the row
// instead of two of each. A block per (position s, slice of the batch): the (cos, sin) table of s
// in shared memory, then a warp per row of that position (the launcher gives each block as many
// rows as it has warps).
#pragma once

#include "cuda/kernels/rms_row.cuh"
#include "cuda/kernels/rope.cuh"

namespace moe::cuda::kernels {

constexpr int kRmsRopeThreads = 128;

// 16-byte pieces (kVecBf16) only: head_dim / 2 and so the width a multiple of 8, x, w, y 16-byte
// aligned (checked on the host). Dynamic shared memory: head_dim / 2 float2.
__global__ void __launch_bounds__(kRmsRopeThreads)
    rmsnorm_rope_forward_rows(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                              uint16_t* __restrict__ y, float* __restrict__ rstd, int64_t batch, int64_t seq,
                              int64_t pos0, int heads, int head_dim, float eps, double log2_theta) {
  constexpr int V = kVecBf16;
  extern __shared__ float2 s_cos_sin[];  // [head_dim / 2]
  const int half = head_dim / 2;
  const int64_t s = blockIdx.x;
  for (int i = threadIdx.x; i < half; i += blockDim.x) s_cos_sin[i] = rope_cos_sin(s + pos0, i, head_dim, log2_theta);
  __syncthreads();

  const int lane = threadIdx.x % kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  const int64_t d = int64_t{heads} * head_dim;
  const int groups = half / V;
  const int items = heads * groups;  // (head, group of V pairs) per row
  for (int64_t b = blockIdx.y + int64_t{gridDim.y} * (threadIdx.x / kWarpSize); b < batch;
       b += int64_t{gridDim.y} * warps) {
    const int64_t row = b * seq + s;
    const uint16_t* x_row = x + row * d;
    const float r = rms_row_rstd<V>(x_row, d, eps, lane);
    if (lane == 0) rstd[row] = r;
    uint16_t* y_row = y + row * d;
    for (int it = lane; it < items; it += kWarpSize) {
      const int h = it / groups;
      const int i0 = (it - h * groups) * V;
      const int64_t lo = int64_t{h} * head_dim + i0, hi = lo + half;
      float a[V], bv[V], wa[V], wb[V], out_lo[V], out_hi[V];
      load_bf16<V>(x_row + lo, a);
      load_bf16<V>(x_row + hi, bv);
      load_bf16<V>(w + lo, wa);
      load_bf16<V>(w + hi, wb);
#pragma unroll
      for (int k = 0; k < V; ++k) a[k] = (a[k] * r) * wa[k], bv[k] = (bv[k] * r) * wb[k];
      round_to_bf16<V>(a);  // the normalised row as rmsnorm_forward stores it
      round_to_bf16<V>(bv);
#pragma unroll
      for (int k = 0; k < V; ++k) rope_rotate<false>(a[k], bv[k], s_cos_sin[i0 + k], out_lo[k], out_hi[k]);
      store_bf16<V>(y_row + lo, out_lo);
      store_bf16<V>(y_row + hi, out_hi);
    }
  }
}

}  // namespace moe::cuda::kernels
