// Optimizer kernels. Gradient norm: each block sums FP64 squares over a fixed grid-stride
// partition of 4-element groups (by flat index, so alignment does not change the order) into one
// partial; one block adds the partials in order and takes the square root. AdamW: a one-thread
// kernel turns the step's device scalars into FP32 coefficients (or a skip), then one launch walks
// fixed chunks of the flat buffers and updates the parts of the segments inside each chunk (each
// segment's moments at its state offset: the flat layout, or a ZeRO-1 shard's compact buffers).
#pragma once

#include <cmath>

#include "cuda/kernels/vec.cuh"
#include "cuda/optim_types.h"

namespace moe::cuda::kernels {

constexpr int kNormThreads = 256;
constexpr int kNormMaxBlocks = 1024;
constexpr int64_t kNormBlockElems = 16384;  // elements per block below kNormMaxBlocks blocks
constexpr int kNormGroup = 4;               // elements per group (one 16-byte load when aligned)

constexpr int kAdamWThreads = 256;
constexpr int kAdamWResidentThreads = 1024;  // the plain-load update kept to a few multiprocessors: a block on each
constexpr int64_t kAdamWChunk = 4096;  // elements of the flat buffers per block (and per step of a block's loop)

// Sum over the block in a fixed order: butterfly within each warp, then warp sums in warp order.
// Every thread must call it; thread 0 gets the total.
__device__ __forceinline__ double block_sum_f64(double v, double* s_warp) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / kWarpSize;
  if (threadIdx.x % kWarpSize == 0) s_warp[warp] = v;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < static_cast<int>(blockDim.x) / kWarpSize; ++w) total += s_warp[w];
  }
  return total;
}

// partials[blockIdx.x] = sum of g^2 over the block's groups. Thread t of the grid takes groups t,
// t + threads, ...; the n % 4 trailing elements go to the first threads. Aligned: one float4 load
// per group; else four scalar loads, same order. Squares of floats are exact in FP64.
template <bool kAligned>
__global__ void __launch_bounds__(kNormThreads)
    grad_sum_squares_block_partials(const float* __restrict__ g, int64_t n, double* __restrict__ partials) {
  __shared__ double s_warp[kNormThreads / kWarpSize];
  const int64_t num_groups = n / kNormGroup;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t t = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  double acc = 0.0;
#pragma unroll 4
  for (int64_t i = t; i < num_groups; i += stride) {
    float x[kNormGroup];
    if constexpr (kAligned) {
      const float4 q = reinterpret_cast<const float4*>(g)[i];
      x[0] = q.x, x[1] = q.y, x[2] = q.z, x[3] = q.w;
    } else {
#pragma unroll
      for (int j = 0; j < kNormGroup; ++j) x[j] = g[i * kNormGroup + j];
    }
#pragma unroll
    for (int j = 0; j < kNormGroup; ++j) acc += static_cast<double>(x[j]) * static_cast<double>(x[j]);
  }
  const int64_t tail = num_groups * kNormGroup + t;
  if (tail < n) acc += static_cast<double>(g[tail]) * static_cast<double>(g[tail]);
  const double total = block_sum_f64(acc, s_warp);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// partials[blockIdx.x] = sum of v over the block's elements: thread t of the grid takes t, t +
// threads, ... (the order of grad_sum_squares_block_partials' groups, one value a group).
__global__ void __launch_bounds__(kNormThreads)
    f64_sum_block_partials(const double* __restrict__ v, int64_t n, double* __restrict__ partials) {
  __shared__ double s_warp[kNormThreads / kWarpSize];
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  double acc = 0.0;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) acc += v[i];
  const double total = block_sum_f64(acc, s_warp);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// One block: *norm = sqrt(sum of partials[0..num_partials)), in a fixed order.
__global__ void __launch_bounds__(kNormThreads)
    grad_norm_from_partials(const double* __restrict__ partials, int num_partials, double* __restrict__ norm) {
  __shared__ double s_warp[kNormThreads / kWarpSize];
  double acc = 0.0;
  for (int i = threadIdx.x; i < num_partials; i += blockDim.x) acc += partials[i];
  const double total = block_sum_f64(acc, s_warp);
  if (threadIdx.x == 0) *norm = sqrt(total);
}

// One block: *sum = sum of partials[0..num_partials), in grad_norm_from_partials' order.
__global__ void __launch_bounds__(kNormThreads)
    grad_sum_from_partials(const double* __restrict__ partials, int num_partials, double* __restrict__ sum) {
  __shared__ double s_warp[kNormThreads / kWarpSize];
  double acc = 0.0;
  for (int i = threadIdx.x; i < num_partials; i += blockDim.x) acc += partials[i];
  const double total = block_sum_f64(acc, s_warp);
  if (threadIdx.x == 0) *sum = total;
}

// One thread: the deferred update is applied (or dropped).
__global__ void adamw_clear_pending_kernel(OptimStepScalars* __restrict__ s) { s->pending = 0; }

// Constants of the run, as AdamW::step rounds them.
struct AdamWConstants {
  double beta1, beta2, weight_decay, grad_clip;  // the config's values (for the bias corrections, decay, clip)
  float b1, one_minus_b1, b2, one_minus_b2, eps;  // FP32 as the update uses them
};

// One thread. Mirrors the trainer and AdamW::step in double, without contracting a * b + c (the
// host code rounds each operation): skip on a non-finite norm, else the clip factor, t += 1, and
// the FP32 coefficients of this step.
__global__ void adamw_prepare_step(OptimStepScalars* __restrict__ s, AdamWConstants c) {
  const double norm = s->grad_norm;
  if (!isfinite(norm)) {
    s->skipped = 1;
    s->pending = 0;
    s->num_skipped += 1;
    s->clip_factor = 1.0;
    return;
  }
  const double factor = (c.grad_clip > 0.0 && norm > c.grad_clip) ? c.grad_clip / __dadd_rn(norm, 1e-6) : 1.0;
  const int64_t t = s->step + 1;
  const double lr = s->lr;
  const double bc1 = __dadd_rn(1.0, -pow(c.beta1, static_cast<double>(t)));
  const double bc2 = __dadd_rn(1.0, -pow(c.beta2, static_cast<double>(t)));
  s->step = t;
  s->skipped = 0;
  s->pending = 1;
  s->clip_factor = factor;
  s->step_size = static_cast<float>(lr / bc1);
  s->inv_sqrt_bc2 = static_cast<float>(1.0 / sqrt(bc2));
  s->decay = static_cast<float>(__dadd_rn(1.0, -__dmul_rn(lr, c.weight_decay)));
  s->grad_scale = static_cast<float>(factor);
}

struct AdamWCoefficients {
  float step_size, inv_sqrt_bc2, decay, grad_scale;
};

// AdamW::step's element update, each operation rounded on its own (no FMA contraction), in its order.
__device__ __forceinline__ void adamw_element(float& p, float g, float& m, float& v, float decay,
                                              const AdamWCoefficients& k, const AdamWConstants& c) {
  const float gs = __fmul_rn(g, k.grad_scale);
  m = __fadd_rn(__fmul_rn(c.b1, m), __fmul_rn(c.one_minus_b1, gs));
  v = __fadd_rn(__fmul_rn(c.b2, v), __fmul_rn(__fmul_rn(c.one_minus_b2, gs), gs));
  const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), k.inv_sqrt_bc2), c.eps);
  p = __fsub_rn(__fmul_rn(p, decay), __fdiv_rn(__fmul_rn(k.step_size, m), denom));
}

// Correctly rounded square roots and quotients of four values without a branch for each: the
// sequences the compiler emits for sqrt.rn and div.rn when the operands are in range (an
// approximate reciprocal square root or reciprocal, then Newton and remainder corrections by
// FMA), which round correctly there, so they are __fsqrt_rn's and __fdiv_rn's bits. The compiler
// guards each element's sequence by its own branch to a slow path; here one range check covers
// the four and the four take the intrinsics when any operand is out of range. That lets the
// four chains interleave, which matters where the update is bound by its instructions (on a few
// multiprocessors, optim_resident.cuh). Tested through the update: the float4 path against the
// scalar path (the intrinsics) on values drawn from every binade, zeros, subnormals, infinities
// and NaNs included (AdamW.Float4PathIsTheScalarPathOverEveryExponent).
__device__ __forceinline__ bool sqrt_in_fast_range(float v) {
  // Positive normal floats from 2^-101 to the largest finite: the compiler's own check.
  return __float_as_uint(v) + 0xf3000000u <= 0x727fffffu;
}

__device__ __forceinline__ float sqrt_rn_fast(float v) {
  float r;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  const float s = __fmul_rn(v, r), h = __fmul_rn(r, 0.5f);
  return __fmaf_rn(__fmaf_rn(-s, s, v), h, s);
}

__device__ __forceinline__ bool div_in_fast_range(float x) {
  // Normal, magnitude in [2^-60, 2^61): the quotient of two such values, its reciprocal and the
  // remainders stay normal and finite.
  const uint32_t e = (__float_as_uint(x) >> 23) & 0xffu;
  return e - 67u <= 120u;
}

__device__ __forceinline__ float div_rn_fast(float a, float b) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  const float r2 = __fmaf_rn(r, __fmaf_rn(-b, r, 1.0f), r);
  const float q = __fmul_rn(a, r2);
  return __fmaf_rn(r2, __fmaf_rn(-b, q, a), q);
}

// out[i] = __fsqrt_rn(x[i]), bitwise.
__device__ __forceinline__ void sqrt_rn4(const float (&x)[4], float (&out)[4]) {
  if (sqrt_in_fast_range(x[0]) & sqrt_in_fast_range(x[1]) & sqrt_in_fast_range(x[2]) & sqrt_in_fast_range(x[3])) {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = sqrt_rn_fast(x[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = __fsqrt_rn(x[i]);
  }
}

// out[i] = __fdiv_rn(a[i], b[i]), bitwise.
__device__ __forceinline__ void div_rn4(const float (&a)[4], const float (&b)[4], float (&out)[4]) {
  bool fast = true;
#pragma unroll
  for (int i = 0; i < 4; ++i) fast &= div_in_fast_range(a[i]) & div_in_fast_range(b[i]);
  if (fast) {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = div_rn_fast(a[i], b[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = __fdiv_rn(a[i], b[i]);
  }
}

// adamw_element on four elements: the same operations in the same order, so the same bits.
__device__ __forceinline__ void adamw_element4(float4& pv, float4 gv, float4& mv, float4& vv, float decay,
                                               const AdamWCoefficients& k, const AdamWConstants& c) {
  float p[4] = {pv.x, pv.y, pv.z, pv.w}, g[4] = {gv.x, gv.y, gv.z, gv.w};
  float m[4] = {mv.x, mv.y, mv.z, mv.w}, v[4] = {vv.x, vv.y, vv.z, vv.w};
  float root[4], num[4], den[4], quot[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float gs = __fmul_rn(g[i], k.grad_scale);
    m[i] = __fadd_rn(__fmul_rn(c.b1, m[i]), __fmul_rn(c.one_minus_b1, gs));
    v[i] = __fadd_rn(__fmul_rn(c.b2, v[i]), __fmul_rn(__fmul_rn(c.one_minus_b2, gs), gs));
  }
  sqrt_rn4(v, root);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    den[i] = __fadd_rn(__fmul_rn(root[i], k.inv_sqrt_bc2), c.eps);
    num[i] = __fmul_rn(k.step_size, m[i]);
  }
  div_rn4(num, den, quot);
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = __fsub_rn(__fmul_rn(p[i], decay), quot[i]);
  pv = make_float4(p[0], p[1], p[2], p[3]);
  mv = make_float4(m[0], m[1], m[2], m[3]);
  vv = make_float4(v[0], v[1], v[2], v[3]);
}

// The moments in memory: FP32, or BF16 bits (optim.moment_dtype = "bf16": read widened, stored
// rounded to nearest even; the update itself computes in FP32). Element j, or [4j, 4j + 4) as one
// float4 (16-byte aligned FP32) or one uint2 (8-byte aligned BF16).
__device__ __forceinline__ float load_moment(const float* __restrict__ m, int64_t j) { return m[j]; }
__device__ __forceinline__ float load_moment(const uint16_t* __restrict__ m, int64_t j) {
  return bf16_bits_to_f32(m[j]);
}
__device__ __forceinline__ void store_moment(float* __restrict__ m, int64_t j, float x) { m[j] = x; }
__device__ __forceinline__ void store_moment(uint16_t* __restrict__ m, int64_t j, float x) {
  m[j] = f32_to_bf16_bits(x);
}
__device__ __forceinline__ uint2 pack_bf16x4(float4 x) {
  return make_uint2(uint32_t(f32_to_bf16_bits(x.x)) | (uint32_t(f32_to_bf16_bits(x.y)) << 16),
                    uint32_t(f32_to_bf16_bits(x.z)) | (uint32_t(f32_to_bf16_bits(x.w)) << 16));
}
__device__ __forceinline__ float4 unpack_bf16x4(uint2 u) {
  return make_float4(bf16_bits_to_f32(uint16_t(u.x & 0xffffu)), bf16_bits_to_f32(uint16_t(u.x >> 16)),
                     bf16_bits_to_f32(uint16_t(u.y & 0xffffu)), bf16_bits_to_f32(uint16_t(u.y >> 16)));
}
__device__ __forceinline__ float4 load_moment4(const float* __restrict__ m, int64_t j) {
  return reinterpret_cast<const float4*>(m)[j];
}
__device__ __forceinline__ float4 load_moment4(const uint16_t* __restrict__ m, int64_t j) {
  return unpack_bf16x4(reinterpret_cast<const uint2*>(m)[j]);
}
__device__ __forceinline__ void store_moment4(float* __restrict__ m, int64_t j, float4 x) {
  reinterpret_cast<float4*>(m)[j] = x;
}
__device__ __forceinline__ void store_moment4(uint16_t* __restrict__ m, int64_t j, float4 x) {
  reinterpret_cast<uint2*>(m)[j] = pack_bf16x4(x);
}

// Updates element i of the flat buffers (its moments at element j) from the loaded values pi, gi,
// mi, vi and stores the results (the BF16 copy too, when there is one). M: float or uint16_t (BF16 moments).
template <typename M>
__device__ __forceinline__ void adamw_store_scalar(int64_t i, int64_t j, float pi, float gi, float mi, float vi,
                                                   float* __restrict__ p, M* __restrict__ m, M* __restrict__ v,
                                                   uint16_t* __restrict__ p_bf16, float decay,
                                                   const AdamWCoefficients& k, const AdamWConstants& c) {
  adamw_element(pi, gi, mi, vi, decay, k, c);
  p[i] = pi;
  store_moment(m, j, mi);
  store_moment(v, j, vi);
  if (p_bf16 != nullptr) p_bf16[i] = f32_to_bf16_bits(pi);
}

// Element i of the flat buffers, its moments at element j.
template <typename M>
__device__ __forceinline__ void adamw_scalar(int64_t i, int64_t j, float* __restrict__ p, const float* __restrict__ g,
                                             M* __restrict__ m, M* __restrict__ v, uint16_t* __restrict__ p_bf16,
                                             float decay, const AdamWCoefficients& k, const AdamWConstants& c) {
  adamw_store_scalar(i, j, p[i], g[i], load_moment(m, j), load_moment(v, j), p, m, v, p_bf16, decay, k, c);
}

// adamw_store_scalar for elements [4i, 4i + 4), moments [4j, 4j + 4): float4 stores (16-byte aligned
// FP32 buffers, 8-byte aligned BF16 copy and BF16 moments). Returns the updated parameters.
template <typename M>
__device__ __forceinline__ float4 adamw_store_vec4(int64_t i, int64_t j, float4 pv, float4 gv, float4 mv, float4 vv,
                                                   float* __restrict__ p, M* __restrict__ m, M* __restrict__ v,
                                                   uint16_t* __restrict__ p_bf16, float decay,
                                                   const AdamWCoefficients& k, const AdamWConstants& c) {
  adamw_element4(pv, gv, mv, vv, decay, k, c);
  reinterpret_cast<float4*>(p)[i] = pv;
  store_moment4(m, j, mv);
  store_moment4(v, j, vv);
  if (p_bf16 != nullptr) reinterpret_cast<uint2*>(p_bf16)[i] = pack_bf16x4(pv);
  return pv;
}

// Elements [4i, 4i + 4), moments [4j, 4j + 4), loaded as vectors. Returns the updated parameters.
template <typename M>
__device__ __forceinline__ float4 adamw_vec4(int64_t i, int64_t j, float* __restrict__ p, const float* __restrict__ g,
                                           M* __restrict__ m, M* __restrict__ v, uint16_t* __restrict__ p_bf16,
                                           float decay, const AdamWCoefficients& k, const AdamWConstants& c) {
  return adamw_store_vec4(i, j, reinterpret_cast<const float4*>(p)[i], reinterpret_cast<const float4*>(g)[i],
                          load_moment4(m, j), load_moment4(v, j), p, m, v, p_bf16, decay, k, c);
}

// Index of the first segment ending after `pos` (segments sorted, non-overlapping: ends non-decreasing).
__device__ __forceinline__ int first_segment_ending_after(const ParamSegment* __restrict__ segs, int num_segs,
                                                          int64_t pos) {
  int lo = 0, hi = num_segs;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (segs[mid].offset + segs[mid].numel > pos) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// The part [lo, hi) of a segment inside a chunk: its float4 body [vb, ve) (multiples of 4, empty
// when the part is shorter) between a scalar head [lo, vb) and tail [ve, hi); the segment's decay
// factor (1 without weight decay) and moment shift (moment index - flat index).
struct ChunkPiece {
  int64_t lo, vb, ve, hi, shift;
  float decay;
};

// piece(ChunkPiece) for every segment overlapping the chunk [c0, c1), in segment order, from the
// segment `first` (first_segment_ending_after(segs, num_segs, c0), or the same found earlier).
template <typename Fn>
__device__ __forceinline__ void for_each_chunk_piece_from(const ParamSegment* __restrict__ segs, int num_segs,
                                                          int first, int64_t c0, int64_t c1, float decay, Fn&& piece) {
  for (int si = first; si < num_segs; ++si) {
    const ParamSegment seg = segs[si];
    if (seg.offset >= c1) break;
    ChunkPiece x;
    x.lo = seg.offset > c0 ? seg.offset : c0;
    const int64_t end = seg.offset + seg.numel;
    x.hi = end < c1 ? end : c1;
    x.vb = ((x.lo + 3) / 4) * 4 < x.hi ? ((x.lo + 3) / 4) * 4 : x.hi;
    x.ve = (x.hi / 4) * 4 > x.vb ? (x.hi / 4) * 4 : x.vb;
    x.shift = seg.state_offset - seg.offset;
    x.decay = seg.decay ? decay : 1.0f;
    piece(x);
  }
}

template <typename Fn>
__device__ __forceinline__ void for_each_chunk_piece(const ParamSegment* __restrict__ segs, int num_segs, int64_t c0,
                                                     int64_t c1, float decay, Fn&& piece) {
  for_each_chunk_piece_from(segs, num_segs, first_segment_ending_after(segs, num_segs, c0), c0, c1, decay,
                            static_cast<Fn&&>(piece));
}

// Chunk number i (of num_chunks) of the runs: the chunk index in the flat buffers.
__device__ __forceinline__ int64_t chunk_of_runs(const ChunkRun* __restrict__ runs, int num_runs, int64_t i) {
  int lo = 0, hi = num_runs - 1;  // the last run with before <= i
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (runs[mid].before <= i) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return runs[lo].first + (i - runs[lo].before);
}

// Block b handles the runs' chunks b, b + grid, ... (below num_chunks) of kAdamWChunk elements
// (each element's update is its own, so any grid and block size gives the same bits);
// within a chunk, each segment's overlap [lo, hi) is updated by the block's threads (kVec4: scalar
// head up to a multiple of 4, float4 body, scalar tail). Does nothing when the prepare kernel
// marked the step skipped, or (deferred) when no update is pending.
template <bool kVec4, typename M, int kThreads = kAdamWThreads>
__global__ void __launch_bounds__(kThreads)
    adamw_update_segments(const ParamSegment* __restrict__ segs, int num_segs, const ChunkRun* __restrict__ runs,
                          int num_runs, int64_t num_chunks, int64_t total_numel, float* __restrict__ p,
                          const float* __restrict__ g, M* __restrict__ m, M* __restrict__ v,
                          uint16_t* __restrict__ p_bf16,
                          const OptimStepScalars* __restrict__ s, AdamWConstants c, bool deferred) {
  if (s->skipped != 0 || (deferred && s->pending == 0)) return;
  const AdamWCoefficients k{s->step_size, s->inv_sqrt_bc2, s->decay, s->grad_scale};
  for (int64_t i = blockIdx.x; i < num_chunks; i += gridDim.x) {
    const int64_t c0 = chunk_of_runs(runs, num_runs, i) * kAdamWChunk;
    const int64_t c1 = c0 + kAdamWChunk < total_numel ? c0 + kAdamWChunk : total_numel;
    for_each_chunk_piece(segs, num_segs, c0, c1, k.decay, [&](const ChunkPiece& x) {
      if constexpr (kVec4) {
        if (x.lo + threadIdx.x < x.vb)
          adamw_scalar(x.lo + threadIdx.x, x.lo + threadIdx.x + x.shift, p, g, m, v, p_bf16, x.decay, k, c);
        for (int64_t i = x.vb / 4 + threadIdx.x; i < x.ve / 4; i += blockDim.x)
          adamw_vec4(i, i + x.shift / 4, p, g, m, v, p_bf16, x.decay, k, c);
        if (x.ve + threadIdx.x < x.hi)
          adamw_scalar(x.ve + threadIdx.x, x.ve + threadIdx.x + x.shift, p, g, m, v, p_bf16, x.decay, k, c);
      } else {
        for (int64_t i = x.lo + threadIdx.x; i < x.hi; i += blockDim.x)
          adamw_scalar(i, i + x.shift, p, g, m, v, p_bf16, x.decay, k, c);
      }
    });
  }
}

}  // namespace moe::cuda::kernels
