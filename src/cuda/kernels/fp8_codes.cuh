// FP8 codes on the device: the hardware's round-to-nearest-even, saturating conversion
// (cuda_fp8.h) and its decoding, for every kernel that writes or reads FP8 codes, and the block
// steps the quantisers share (no kernels here, so any number of translation units may include it).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

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

// The E8M0 exponent of cpu::mx_scale_exponent.
__device__ __forceinline__ int mx_scale_exponent_dev(float amax, Fp8Format f, MxScale rule) {
  if (amax == 0.0f) return -127;
  int e = ilogbf(amax) - fp8_emax_of(f);  // floor(log2 amax), subnormals included
  if (rule == MxScale::kNoSaturation && ldexpf(amax, -e) > fp8_max_of(f)) e += 1;
  return max(-127, min(127, e));
}

// The exponent the rule gives a sub-block of largest magnitude amax (0 for a non-finite one: the
// step that counted it is skipped).
__device__ __forceinline__ int mx_exponent_of(float amax, Fp8Format f, Fp8Rule rule) {
  return mx_scale_exponent_dev(isfinite(amax) ? amax : 0.0f, f, mx_rule_of(rule));
}

// 2^k in FP32, exactly, for k <= 127 (a subnormal from -127 to -149; 0 below): a product with it is
// ldexpf's, one correctly rounded multiplication instead of a library call.
__device__ __forceinline__ float exp2_exact(int k) {
  return k >= -126 ? __int_as_float((k + 127) << 23) : k >= -149 ? __int_as_float(1 << (k + 149)) : 0.0f;
}

// The factors that re-block one MX sub-block of scale 2^e_sub at its block's scale 2^e_max
// (e_max >= e_sub), computed once per sub-block: 2^-e_sub and 2^(e_sub - e_max).
struct MxReblock {
  float to_sub, to_block;
  bool same;  // e_sub == e_max: the MX code is the block's
};
__device__ __forceinline__ MxReblock mx_reblock(int e_sub, int e_max) {
  return {exp2_exact(-e_sub), exp2_exact(e_sub - e_max), e_sub == e_max};
}

// x's MX code in its sub-block, re-encoded at its block's scale: cpu::mx_to_blocks of
// cpu::mx_quantize, bit for bit. x / 2^e_sub is exact in FP32 (up to underflow below its
// subnormals); so is the decoded code (at most 448 or 57344) times 2^(e_sub - e_max) wherever the
// result can be a nonzero code (a factor below 2^-149, taken as 0, gives the signed zero code that
// the exact product encodes to).
__device__ __forceinline__ uint8_t mx_reblocked_code(float x, const MxReblock& r, Fp8Format f) {
  const uint8_t code = fp8_encode_dev(x * r.to_sub, f);
  if (r.same) return code;
  return fp8_encode_dev(fp8_decode_dev(code, f) * r.to_block, f);
}

// max |x| (local) and the count of non-finite elements (bad) over the N values of each of kLanes
// consecutive lanes (16: a half-warp, 32: the warp), every one of those lanes getting both: per
// lane, then by shuffles (a max and an integer sum, order-free). Every lane of the warp calls it.
template <int kLanes, int N>
__device__ __forceinline__ void fp8_lanes_amax(const float (&v)[N], float& local, uint32_t& bad) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    bad += isfinite(v[j]) ? 0u : 1u;
    local = fmaxf(local, fabsf(v[j]));
  }
  for (int o = kLanes / 2; o > 0; o >>= 1) {
    local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, o));
    bad += __shfl_xor_sync(0xffffffffu, bad, o);
  }
}

// One 1 x 128 block held by a half-warp, lane l of the half its elements 8l .. 8l + 7 in v: the
// block's max |x| by shuffles within the half (order-free, so the scale is the CPU's bit for bit),
// its scale into s and this lane's eight codes returned as two words (byte j of the pair: element
// j); the non-finite elements added to *num_nonfinite (when not null and valid) by the half's first
// lane. Under Fp8Rule::kBlocks the scale is amax / fp8_max (1 for an all-zero block) and the codes
// fp8(x / s); under the MX rules every four lanes' 32 elements are an MX sub-block, the scale the
// largest sub-block's 2^e_max and the codes mx_reblocked_code (cpu::fp8_quantize_blocks with the
// rule, bit for bit). Every lane of the warp calls it (the shuffles); a lane whose half holds no
// block passes valid = false and gets zeros.
__device__ __forceinline__ uint2 fp8_half_warp_block_codes(const float (&v)[8], bool valid, Fp8Format f, Fp8Rule rule,
                                                           float& s, uint32_t* num_nonfinite) {
  float local = 0.0f;
  uint32_t bad = 0;
  int e_sub = 0;
  if (rule == Fp8Rule::kBlocks) {
    fp8_lanes_amax<16>(v, local, bad);  // within the half-warp
  } else {
    fp8_lanes_amax<4>(v, local, bad);  // the lane's MX sub-block, then on to the half-warp
    e_sub = mx_exponent_of(local, f, rule);
    for (int o = 4; o < 16; o <<= 1) {
      local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, o));
      bad += __shfl_xor_sync(0xffffffffu, bad, o);
    }
  }
  s = 1.0f;
  if (!valid) return make_uint2(0u, 0u);
  if (threadIdx.x % 16 == 0 && bad != 0 && num_nonfinite != nullptr) atomicAdd(num_nonfinite, bad);
  uint32_t lo = 0, hi = 0;
  if (rule == Fp8Rule::kBlocks) {
    s = __fdiv_rn(local, fp8_max_of(f));
    if (!(s > 0.0f)) s = 1.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      lo |= uint32_t{fp8_encode_dev(__fdiv_rn(v[j], s), f)} << (8 * j);
      hi |= uint32_t{fp8_encode_dev(__fdiv_rn(v[j + 4], s), f)} << (8 * j);
    }
  } else {
    const int e_max = mx_exponent_of(local, f, rule);  // the largest sub-block's: the rule is monotone
    s = ldexpf(1.0f, e_max);
    const MxReblock rb = mx_reblock(e_sub, e_max);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      lo |= uint32_t{mx_reblocked_code(v[j], rb, f)} << (8 * j);
      hi |= uint32_t{mx_reblocked_code(v[j + 4], rb, f)} << (8 * j);
    }
  }
  return make_uint2(lo, hi);
}

// fp8_half_warp_block_codes with the scale stored into *scale by the half's first lane and the
// codes as one 8-byte word at q (nothing stored when not valid).
__device__ __forceinline__ void fp8_quantize_half_warp_block(const float (&v)[8], bool valid, Fp8Format f,
                                                             Fp8Rule rule, uint8_t* q, float* scale,
                                                             uint32_t* num_nonfinite) {
  float s;
  const uint2 codes = fp8_half_warp_block_codes(v, valid, f, rule, s, num_nonfinite);
  if (!valid) return;
  if (threadIdx.x % 16 == 0) *scale = s;
  *reinterpret_cast<uint2*>(q) = codes;
}

constexpr int kFp8WeightThreads = 256;  // threads of a 128 x 128 weight block

// Sixteen bytes byte_at(0) .. byte_at(15) as one 16-byte word, byte 0 lowest.
template <typename F>
__device__ __forceinline__ uint4 pack16(F&& byte_at) {
  uint32_t word[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    word[j] = 0;
#pragma unroll
    for (int x = 0; x < 4; ++x) word[j] |= uint32_t{static_cast<uint8_t>(byte_at(4 * j + x))} << (8 * x);
  }
  return make_uint4(word[0], word[1], word[2], word[3]);
}

// The max |w| and non-finite count of a whole 128 x 128 weight block, through shared memory
// (fp8_weight_block_amax).
struct Fp8BlockReduceSmem {
  float max[kFp8WeightThreads / 32];
  uint32_t bad[kFp8WeightThreads / 32];
};

// The block's max |w| (returned to every thread) and its count of non-finite elements (bad_all)
// over thread t's 64 values v, by shuffles within each warp and the warps' results through
// shared memory (order-free, so the scale is the generic kernel's bit for bit). Every thread of
// the block calls it; it synchronises the block.
__device__ __forceinline__ float fp8_weight_block_amax(const float (&v)[64], Fp8BlockReduceSmem& sm,
                                                       uint32_t& bad_all) {
  const int t = threadIdx.x;
  float local = 0.0f;
  uint32_t bad = 0;
  fp8_lanes_amax<32>(v, local, bad);
  if (t % 32 == 0) sm.max[t / 32] = local, sm.bad[t / 32] = bad;
  __syncthreads();
  float amax = 0.0f;
  bad_all = 0;
#pragma unroll
  for (int i = 0; i < kFp8WeightThreads / 32; ++i) amax = fmaxf(amax, sm.max[i]), bad_all += sm.bad[i];
  return amax;
}

// Shared memory of one whole 128 x 128 weight block's quantisation (fp8_weight_block_codes).
struct Fp8WeightBlockSmem {
  uint8_t tile[128][128 + 16];
  Fp8BlockReduceSmem reduce;
};

// The codes of one whole 128 x 128 block (e, bi, bj) of weights [E, n, k] (n, k multiples of 128)
// whose values thread t of the block's 256 holds: row t / 2 of the block, elements 64 (t % 2) ..
// + 63, in v. The block's max |w| by shuffles and shared memory (order-free: the generic kernel's
// scale bit for bit), its 64 codes stored as four 16-byte words into q and into a shared tile,
// then column t / 2 of the tile, rows 64 (t % 2) .. + 63, stored the same way into qt (when not
// null). Every thread of the block calls it once.
__device__ __forceinline__ void fp8_weight_block_codes(const float (&v)[64], int64_t e, int64_t bi, int64_t bj,
                                                       int64_t n, int64_t k, Fp8Format f, uint8_t* __restrict__ q,
                                                       float* __restrict__ s, uint8_t* __restrict__ qt,
                                                       float* __restrict__ st, uint32_t* num_nonfinite,
                                                       Fp8WeightBlockSmem& sm) {
  const int64_t nb = n / 128, kb = k / 128;
  const int t = threadIdx.x, r = t / 2, c0 = 64 * (t % 2);
  const int64_t at = e * n * k + (bi * 128 + r) * k + bj * 128 + c0;
  uint32_t bad_all = 0;
  const float amax = fp8_weight_block_amax(v, sm.reduce, bad_all);
  float sc = __fdiv_rn(amax, fp8_max_of(f));
  if (!(sc > 0.0f)) sc = 1.0f;
  if (t == 0) {
    s[(e * nb + bi) * kb + bj] = sc;
    if (st != nullptr) st[(e * kb + bj) * nb + bi] = sc;
    if (bad_all != 0 && num_nonfinite != nullptr) atomicAdd(num_nonfinite, bad_all);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 packed = pack16([&](int x) { return fp8_encode_dev(__fdiv_rn(v[16 * i + x], sc), f); });
    *reinterpret_cast<uint4*>(q + at + 16 * i) = packed;
    *reinterpret_cast<uint4*>(&sm.tile[r][c0 + 16 * i]) = packed;
  }
  if (qt == nullptr) return;
  __syncthreads();
  // Column r of the block (row bj * 128 + r of qt[e]), its rows c0 .. c0 + 63 (columns of qt).
  const int64_t at_t = e * n * k + (bj * 128 + r) * n + bi * 128 + c0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    *reinterpret_cast<uint4*>(qt + at_t + 16 * i) = pack16([&](int x) { return sm.tile[c0 + 16 * i + x][r]; });
  }
}

// The MX rules' codes of one whole 128 x 128 block (e, bi, bj) of weights [E, n, k] (n, k
// multiples of 128): each copy quantised along its own rows, as MXFP8 quantises a weight for the
// forward and for the data gradient. Thread t of the block's 256 holds row t / 2 of the block,
// elements 64 (t % 2) .. + 63, in v: its two 1 x 32 sub-blocks' codes re-blocked into q at the
// block's scale 2^e_max (the largest sub-block's, that of the block's max |w| by shuffles and
// shared memory, order-free), which goes to s and, transposed, st. For the transposed copy qt [E,
// k, n] (when not null) the same thread takes column t / 2 of the block, rows 64 (t % 2) .. + 63,
// read through column_value(row, col) (the block's values, e.g. from a shared tile the caller has
// filled and synchronised): that column's two 32-row sub-blocks re-blocked at the same scale, 64
// codes stored as four 16-byte words into row bj * 128 + t / 2 of qt[e]. cpu::fp8_quantize_weights
// with the rule, bit for bit. Every thread of the block calls it once.
template <typename ColumnValue>
__device__ __forceinline__ void mx_weight_block_codes(const float (&v)[64], int64_t e, int64_t bi, int64_t bj,
                                                      int64_t n, int64_t k, Fp8Format f, Fp8Rule rule,
                                                      uint8_t* __restrict__ q, float* __restrict__ s,
                                                      uint8_t* __restrict__ qt, float* __restrict__ st,
                                                      uint32_t* num_nonfinite, Fp8BlockReduceSmem& sm,
                                                      ColumnValue&& column_value) {
  const int64_t nb = n / 128, kb = k / 128;
  const int t = threadIdx.x, r = t / 2, c0 = 64 * (t % 2);
  uint32_t bad_all = 0;
  const float amax = fp8_weight_block_amax(v, sm, bad_all);
  const int e_max = mx_exponent_of(amax, f, rule);  // the largest sub-block's: the rule is monotone
  if (t == 0) {
    const float sc = ldexpf(1.0f, e_max);
    s[(e * nb + bi) * kb + bj] = sc;
    if (st != nullptr) st[(e * kb + bj) * nb + bi] = sc;
    if (bad_all != 0 && num_nonfinite != nullptr) atomicAdd(num_nonfinite, bad_all);
  }
  // The codes of 64 values x (two sub-blocks of 32) as four 16-byte words at out.
  const auto store = [&](const float (&x)[64], uint8_t* out) {
    float m0 = 0.0f, m1 = 0.0f;
#pragma unroll
    for (int j = 0; j < 32; ++j) m0 = fmaxf(m0, fabsf(x[j])), m1 = fmaxf(m1, fabsf(x[32 + j]));
    const MxReblock r0 = mx_reblock(mx_exponent_of(m0, f, rule), e_max);
    const MxReblock r1 = mx_reblock(mx_exponent_of(m1, f, rule), e_max);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      *reinterpret_cast<uint4*>(out + 16 * i) =
          pack16([&](int j) { return mx_reblocked_code(x[16 * i + j], i < 2 ? r0 : r1, f); });
    }
  };
  store(v, q + e * n * k + (bi * 128 + r) * k + bj * 128 + c0);
  if (qt == nullptr) return;
  float col[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) col[i] = column_value(c0 + i, r);
  store(col, qt + e * n * k + (bj * 128 + r) * n + bi * 128 + c0);
}

}  // namespace moe::cuda::kernels
