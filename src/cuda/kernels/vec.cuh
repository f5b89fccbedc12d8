// Device helpers shared by the elementwise and row kernels: BF16 <-> FP32 conversion of V
// consecutive elements (V = 8: one 16-byte access; V = 1: the scalar fallback for odd widths
// or unaligned pointers), and warp sums. BF16 is carried as its uint16_t bit pattern; stores
// round to nearest even (NaN stays NaN), the same rule as moe::f32_to_bf16 on the host.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace moe::cuda::kernels {

constexpr int kWarpSize = 32;
constexpr int kVecBf16 = 8;  // BF16 elements in one 16-byte access

__device__ __forceinline__ float bf16_bits_to_f32(uint32_t bits) { return __uint_as_float(bits << 16); }

__device__ __forceinline__ uint16_t f32_to_bf16_bits(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// out[0..8) = float of the 8 BF16 elements in raw (the first in raw.x's low half).
__device__ __forceinline__ void bf16x8_to_f32(const uint4 raw, float (&out)[kVecBf16]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);
    out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

// out[0..V) = float(p[0..V)); p must be 2*V-byte aligned.
template <int V>
__device__ __forceinline__ void load_bf16(const uint16_t* __restrict__ p, float (&out)[V]) {
  static_assert(V == 1 || V == kVecBf16, "BF16 vectors are 1 or 8 elements");
  if constexpr (V == 1) {
    out[0] = bf16_bits_to_f32(*p);
  } else {
    bf16x8_to_f32(*reinterpret_cast<const uint4*>(p), out);
  }
}

// p[0..V) = bf16(in[0..V)), round to nearest even; p must be 2*V-byte aligned.
template <int V>
__device__ __forceinline__ void store_bf16(uint16_t* __restrict__ p, const float (&in)[V]) {
  if constexpr (V == 1) {
    *p = f32_to_bf16_bits(in[0]);
  } else {
    uint32_t words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      words[i] = static_cast<uint32_t>(f32_to_bf16_bits(in[2 * i])) |
                 (static_cast<uint32_t>(f32_to_bf16_bits(in[2 * i + 1])) << 16);
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

// The residual stream's add of one pack: acc[0..V) (FP32) += add[0..V), then acc_bf16[0..V) =
// bf16(acc) when acc_bf16 is not null (V = 8: acc 16-byte aligned, two 16-byte accesses). add holds
// the BF16-rounded values of the branch the add stands for (round_to_bf16), so the bits are those of
// a BF16 branch stored and then added.
template <int V>
__device__ __forceinline__ void residual_add_pack(float* __restrict__ acc, const float (&add)[V],
                                                  uint16_t* __restrict__ acc_bf16) {
  float sum[V];
  if constexpr (V == 1) {
    sum[0] = acc[0] + add[0];
    acc[0] = sum[0];
  } else {
    static_assert(V == kVecBf16, "FP32 packs of 8 are two 16-byte accesses");
    float4* a4 = reinterpret_cast<float4*>(acc);
    const float4 lo = a4[0], hi = a4[1];
    sum[0] = lo.x + add[0], sum[1] = lo.y + add[1], sum[2] = lo.z + add[2], sum[3] = lo.w + add[3];
    sum[4] = hi.x + add[4], sum[5] = hi.y + add[5], sum[6] = hi.z + add[6], sum[7] = hi.w + add[7];
    a4[0] = make_float4(sum[0], sum[1], sum[2], sum[3]);
    a4[1] = make_float4(sum[4], sum[5], sum[6], sum[7]);
  }
  if (acc_bf16 != nullptr) store_bf16<V>(acc_bf16, sum);
}

// Raw copy of V BF16 elements (no conversion).
template <int V>
__device__ __forceinline__ void copy_bf16(const uint16_t* __restrict__ src, uint16_t* __restrict__ dst) {
  if constexpr (V == 1) {
    *dst = *src;
  } else {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  }
}

template <int V>
__device__ __forceinline__ void store_zero_bf16(uint16_t* __restrict__ dst) {
  if constexpr (V == 1) {
    *dst = 0;
  } else {
    *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
}

// Rounds v to BF16 values in place (what store_bf16 writes): the values a quantiser of the
// stored BF16 tensor reads.
template <int V>
__device__ __forceinline__ void round_to_bf16(float (&v)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) v[j] = bf16_bits_to_f32(f32_to_bf16_bits(v[j]));
}

// Sum over the 32 lanes of a warp (butterfly: every lane gets the same total, in a fixed order).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

}  // namespace moe::cuda::kernels
