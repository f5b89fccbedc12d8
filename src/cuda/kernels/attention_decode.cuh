// Attention of new query rows over a KV cache (decoding): row i (position pos0 + i) of head h sees
// keys 0 .. pos0 + i of kv head h / (Hq / Hkv), scores scaled by 1/sqrt(hd). One block of
// kDecodeWarps warps per (row, head): warp w takes keys w, w + W, ... with an online softmax (its
// running max, sum and the hd accumulators, lane l holding elements l, l + 32, ...), then the warps
// merge through shared memory in warp order (deterministic). BF16 storage, FP32 math.
#pragma once

#include <cmath>

#include "cuda/kernels/vec.cuh"

namespace moe::cuda::kernels {

constexpr int kDecodeWarps = 8;
constexpr int kDecodeMaxHeadDim = 256;

template <int kPerLane>  // ceil(hd / 32) elements per lane
__global__ void __launch_bounds__(kDecodeWarps * kWarpSize)
    attention_decode_rows(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                          const uint16_t* __restrict__ v, uint16_t* __restrict__ out, int64_t pos0, int hq,
                          int hkv, int hd, float scale) {
  __shared__ float s_m[kDecodeWarps], s_l[kDecodeWarps];
  __shared__ float s_acc[kDecodeWarps][kPerLane * kWarpSize];
  const int64_t i = blockIdx.x;
  const int h = static_cast<int>(blockIdx.y);
  const int g = h / (hq / hkv);
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t q_stride = int64_t{hq} * hd, kv_stride = int64_t{hkv} * hd;
  const uint16_t* qr = q + i * q_stride + int64_t{h} * hd;
  float qv[kPerLane], acc[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int d = lane + e * kWarpSize;
    qv[e] = d < hd ? bf16_bits_to_f32(qr[d]) * scale : 0.f;
    acc[e] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  const int64_t visible = pos0 + i + 1;
  for (int64_t j = warp; j < visible; j += kDecodeWarps) {
    const uint16_t* kr = k + j * kv_stride + int64_t{g} * hd;
    const uint16_t* vr = v + j * kv_stride + int64_t{g} * hd;
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const int d = lane + e * kWarpSize;
      if (d < hd) dot += qv[e] * bf16_bits_to_f32(kr[d]);
    }
    dot = warp_sum(dot);
    const float m_new = fmaxf(m, dot);
    const float correction = __expf(m - m_new), p = __expf(dot - m_new);
    l = l * correction + p;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const int d = lane + e * kWarpSize;
      acc[e] = acc[e] * correction + (d < hd ? p * bf16_bits_to_f32(vr[d]) : 0.f);
    }
    m = m_new;
  }
  if (lane == 0) {
    s_m[warp] = m;
    s_l[warp] = l;
  }
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) s_acc[warp][lane + e * kWarpSize] = acc[e];
  __syncthreads();
  float m_all = -INFINITY;
#pragma unroll
  for (int w = 0; w < kDecodeWarps; ++w) m_all = fmaxf(m_all, s_m[w]);
  float weight[kDecodeWarps], l_all = 0.f;
#pragma unroll
  for (int w = 0; w < kDecodeWarps; ++w) {
    weight[w] = s_l[w] > 0.f ? __expf(s_m[w] - m_all) : 0.f;  // a warp that saw no key has l = 0
    l_all += s_l[w] * weight[w];
  }
  const float inv = 1.f / l_all;
  uint16_t* o = out + i * q_stride + int64_t{h} * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) sum += s_acc[w][d] * weight[w];
    o[d] = f32_to_bf16_bits(sum * inv);
  }
}

}  // namespace moe::cuda::kernels
