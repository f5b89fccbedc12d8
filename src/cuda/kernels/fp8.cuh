// Kernels of cuda/ops/fp8.h: one CTA per scaling block (threads walk the block's elements), a
// CTA-wide max of |x| (order-free, so the scale is the CPU twin's bit for bit), then the codes,
// converted by the hardware's round-to-nearest-even, saturating FP8 conversion (cuda_fp8.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/fp8_types.h"
#include "cuda/kernels/fp8_codes.cuh"
#include "cuda/kernels/vec.cuh"

namespace moe::cuda::kernels {

constexpr int kFp8MaxThreads = 256;

// An FP32 value read as its BF16 rounding (round_to_bf16: round-to-nearest-even, as
// cast_f32_to_bf16 and the optimizer's BF16 copy round): the quantisers on FP32 memory give the
// codes of the BF16 copy.
struct Bf16OfF32 {
  float v;
};

template <typename T>
__device__ __forceinline__ float fp8_load(const T* x, int64_t i);
template <>
__device__ __forceinline__ float fp8_load<float>(const float* x, int64_t i) {
  return x[i];
}
template <>
__device__ __forceinline__ float fp8_load<uint16_t>(const uint16_t* x, int64_t i) {
  return __uint_as_float(static_cast<uint32_t>(x[i]) << 16);
}
template <>
__device__ __forceinline__ float fp8_load<Bf16OfF32>(const Bf16OfF32* x, int64_t i) {
  return bf16_bits_to_f32(f32_to_bf16_bits(x[i].v));
}


// max |x| over the CTA's elements (all threads get it); adds the threads' non-finite counts to
// *num_nonfinite.
__device__ __forceinline__ float fp8_block_amax(float local, uint32_t bad, uint32_t* num_nonfinite) {
  __shared__ float s_max[kFp8MaxThreads / 32];
  __shared__ uint32_t s_bad;
  if (threadIdx.x == 0) s_bad = 0;
  __syncthreads();
  if (bad != 0) atomicAdd(&s_bad, bad);
  for (int o = 16; o > 0; o >>= 1) local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = (blockDim.x + 31) / 32;
  if (lane == 0) s_max[warp] = local;
  __syncthreads();
  float m = 0.0f;
  for (int w = 0; w < warps; ++w) m = fmaxf(m, s_max[w]);
  if (threadIdx.x == 0 && s_bad != 0 && num_nonfinite != nullptr) atomicAdd(num_nonfinite, s_bad);
  return m;
}

struct Fp8BlockArgs {
  int64_t rows, cols, block_rows, block_cols, scale_cols;
};

// blockIdx.x: the scaling block (row-major over the scale grid).
template <typename T>
__global__ void __launch_bounds__(kFp8MaxThreads)
    fp8_quantize_blocks_kernel(const T* __restrict__ x, Fp8BlockArgs a, Fp8Format f, uint8_t* __restrict__ q,
                               float* __restrict__ scales, uint32_t* num_nonfinite) {
  const int64_t b = blockIdx.x, br = b / a.scale_cols, bc = b % a.scale_cols;
  const int64_t r0 = br * a.block_rows, c0 = bc * a.block_cols;
  const int64_t nr = min(a.rows - r0, a.block_rows), nc = min(a.cols - c0, a.block_cols), n = nr * nc;
  float local = 0.0f;
  uint32_t bad = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = fp8_load(x, (r0 + i / nc) * a.cols + c0 + i % nc);
    bad += isfinite(v) ? 0u : 1u;
    local = fmaxf(local, fabsf(v));
  }
  const float amax = fp8_block_amax(local, bad, num_nonfinite);
  float s = __fdiv_rn(amax, fp8_max_of(f));
  if (!(s > 0.0f)) s = 1.0f;  // an all-zero block (or one below FP32's range once divided)
  if (threadIdx.x == 0) scales[b] = s;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t at = (r0 + i / nc) * a.cols + c0 + i % nc;
    q[at] = fp8_encode_dev(__fdiv_rn(fp8_load(x, at), s), f);
  }
}

__global__ void fp8_dequantize_blocks_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scales,
                                             Fp8BlockArgs a, Fp8Format f, float* __restrict__ x) {
  const int64_t n = a.rows * a.cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / a.cols, c = i % a.cols;
    x[i] = fp8_decode_dev(q[i], f) * scales[(r / a.block_rows) * a.scale_cols + c / a.block_cols];
  }
}

// One CTA of 32 threads per row block of 32 elements (blockIdx.x over rows x scale_cols).
template <typename T>
__global__ void __launch_bounds__(32)
    mx_quantize_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t scale_cols, Fp8Format f,
                       MxScale rule, uint8_t* __restrict__ q, uint8_t* __restrict__ scales, uint32_t* num_nonfinite) {
  const int64_t b = blockIdx.x, r = b / scale_cols, c = (b % scale_cols) * kMxBlock + threadIdx.x;
  const bool in = c < cols;
  const float v = in ? fp8_load(x, r * cols + c) : 0.0f;
  const float amax = fp8_block_amax(fabsf(v), in && !isfinite(v) ? 1u : 0u, num_nonfinite);
  const int e = mx_scale_exponent_dev(isfinite(amax) ? amax : 0.0f, f, rule);
  if (threadIdx.x == 0) scales[b] = static_cast<uint8_t>(e + 127);
  // x / 2^e is exact in FP32 (a power of two), up to underflow below FP32's subnormals.
  if (in) q[r * cols + c] = fp8_encode_dev(ldexpf(v, -e), f);
}

// MX codes re-blocked into 1 x 128 blocks (cpu::mx_to_blocks128): one warp per output block (row r,
// block b), lane l re-encoding the block's codes 4 l .. 4 l + 3 (those below cols) at the block's
// largest E8M0 scale, in FP64 as the CPU does (exact), then rounded to FP32 and to the format. The
// codes whose value changed are added to *changed, E8M0 NaN scales (0xFF) to *nan_scales (each
// when not null; the block's output is then unspecified).
__global__ void __launch_bounds__(32)
    mx_to_blocks128_kernel(const uint8_t* __restrict__ q, const uint8_t* __restrict__ scales_e8m0, int64_t cols,
                           int64_t mx_cols, int64_t out_cols, Fp8Format f, uint8_t* __restrict__ q_out,
                           float* __restrict__ scales_out, unsigned long long* changed, uint32_t* nan_scales) {
  const int64_t r = blockIdx.x / out_cols, b = blockIdx.x % out_cols;
  const int lane = static_cast<int>(threadIdx.x);
  const int64_t c = b * 128 + 4 * lane;  // this lane's first column
  const bool in = c < cols;
  const unsigned code = in ? scales_e8m0[r * mx_cols + c / kMxBlock] : 0u;  // its sub-block's scale
  const unsigned top = __reduce_max_sync(0xffffffffu, code);
  const unsigned nan_lanes = __popc(__ballot_sync(0xffffffffu, in && code == 0xFFu && (lane % 8) == 0));
  if (lane == 0) {
    scales_out[r * out_cols + b] = ldexpf(1.0f, static_cast<int>(top) - 127);
    if (nan_scales != nullptr && nan_lanes > 0) atomicAdd(nan_scales, nan_lanes);
  }
  unsigned n_changed = 0;
  if (in) {
    const int shift = static_cast<int>(code) - static_cast<int>(top);  // <= 0
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (c + i >= cols) break;
      const int64_t at = r * cols + c + i;
      const double v = ldexp(static_cast<double>(fp8_decode_dev(q[at], f)), shift);  // exact in FP64
      const uint8_t out = fp8_encode_dev(static_cast<float>(v), f);
      q_out[at] = out;
      n_changed += static_cast<double>(fp8_decode_dev(out, f)) != v;
    }
  }
  if (changed != nullptr) {
    const unsigned total = __reduce_add_sync(0xffffffffu, n_changed);
    if (lane == 0 && total > 0) atomicAdd(changed, static_cast<unsigned long long>(total));
  }
}

__global__ void mx_dequantize_kernel(const uint8_t* __restrict__ q, const uint8_t* __restrict__ scales, int64_t rows,
                                     int64_t cols, int64_t scale_cols, Fp8Format f, float* __restrict__ x) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    const uint8_t code = scales[r * scale_cols + c / kMxBlock];
    x[i] = code == 0xFF ? __int_as_float(0x7fc00000) : ldexpf(fp8_decode_dev(q[i], f), int(code) - 127);
  }
}

// The 1 x 128 blocks of a tensor whose rows are whole blocks (cols a multiple of 128, so block b
// is the 128 elements at b * 128; its codes go to row b / per_row, column 128 (b % per_row) of a code
// matrix with rows ldq apart, ldq == cols for a dense one): a half-warp per block, lane l of the half loading elements
// 8l..8l+7 (one 16-byte access for BF16, two for FP32); each warp takes 2 x kFp8RowUnroll blocks,
// all loads issued before any reduction so that enough bytes are in flight to reach the memory
// bandwidth. The half-warp's max of |x| by shuffles (order-free: the generic kernel's scale bit for
// bit), the same division and conversion, eight codes stored as one 8-byte word. x 16-byte and q
// 8-byte aligned (the launcher checks).
constexpr int kFp8RowWarps = 8;
constexpr int kFp8RowUnroll = 4;
constexpr int64_t kFp8RowBlocksPerCta = int64_t{kFp8RowWarps} * 2 * kFp8RowUnroll;

template <typename T>
__device__ __forceinline__ void fp8_load8(const T* x, int64_t at, float (&v)[8]);
template <>
__device__ __forceinline__ void fp8_load8<float>(const float* x, int64_t at, float (&v)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(x + at), b = *reinterpret_cast<const float4*>(x + at + 4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
template <>
__device__ __forceinline__ void fp8_load8<Bf16OfF32>(const Bf16OfF32* x, int64_t at, float (&v)[8]) {
  fp8_load8(reinterpret_cast<const float*>(x), at, v);
  round_to_bf16(v);
}
template <>
__device__ __forceinline__ void fp8_load8<uint16_t>(const uint16_t* x, int64_t at, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(x + at);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// kMx: compiled for the MX rules (rule one of them), else for the block recipe (rule ignored), so
// that the block recipe's machine code carries none of the MX path. So for every kernel that writes
// codes through fp8_quantize_half_warp_block.
template <typename T, bool kMx>
__global__ void __launch_bounds__(32 * kFp8RowWarps)
    fp8_quantize_rows128_kernel(const T* __restrict__ x, int64_t blocks, int64_t per_row, int64_t ldq, Fp8Format f,
                                Fp8Rule rule, uint8_t* __restrict__ q, float* __restrict__ scales,
                                uint32_t* num_nonfinite) {
  if constexpr (!kMx) rule = Fp8Rule::kBlocks;
  const int lane = threadIdx.x % 32, half = lane / 16, sub = lane % 16;
  const int64_t first = int64_t{blockIdx.x} * kFp8RowBlocksPerCta + (threadIdx.x / 32) * 2 * kFp8RowUnroll + half;
  float v[kFp8RowUnroll][8];
#pragma unroll
  for (int u = 0; u < kFp8RowUnroll; ++u) {
    const int64_t b = first + 2 * u;
    if (b < blocks) {
      fp8_load8(x, b * 128 + 8 * sub, v[u]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[u][j] = 0.0f;
    }
  }
#pragma unroll
  for (int u = 0; u < kFp8RowUnroll; ++u) {
    const int64_t b = first + 2 * u;
    const bool valid = b < blocks;
    const int64_t at = valid ? b / per_row * ldq + b % per_row * 128 : 0;
    fp8_quantize_half_warp_block(v[u], valid, f, rule, q + at + 8 * sub, scales + (valid ? b : 0), num_nonfinite);
  }
}

// The experts' weights w [E, n, k] in 128 x 128 blocks, one CTA of 256 threads per block (blockIdx.x
// over E x nb x kb, kb fastest): the block's max |w| (the generic kernel's reduction), its scale
// into s and (transposed) st, the codes into q, and through a shared-memory tile into qt [E, k, n]
// (qt[e][c][r] = q[e][r][c]) when qt is not null: one pass over the FP32 master weights makes both
// operands of the experts' FP8 GEMMs (forward and data gradient).

template <typename T>
__global__ void __launch_bounds__(kFp8WeightThreads)
    fp8_quantize_weights_kernel(const T* __restrict__ w, int64_t n, int64_t k, int64_t nb, int64_t kb, Fp8Format f,
                                uint8_t* __restrict__ q, float* __restrict__ s, uint8_t* __restrict__ qt,
                                float* __restrict__ st, uint32_t* num_nonfinite) {
  __shared__ uint8_t tile[128][129];
  const int64_t b = blockIdx.x, e = b / (nb * kb), bi = b / kb % nb, bj = b % kb;
  const int64_t r0 = bi * 128, c0 = bj * 128;
  const int nr = static_cast<int>(min(n - r0, int64_t{128})), nc = static_cast<int>(min(k - c0, int64_t{128}));
  const T* we = w + e * n * k;
  float local = 0.0f;
  uint32_t bad = 0;
  for (int i = threadIdx.x; i < nr * nc; i += blockDim.x) {
    const float v = fp8_load(we, (r0 + i / nc) * k + c0 + i % nc);
    bad += isfinite(v) ? 0u : 1u;
    local = fmaxf(local, fabsf(v));
  }
  const float amax = fp8_block_amax(local, bad, num_nonfinite);
  float sc = __fdiv_rn(amax, fp8_max_of(f));
  if (!(sc > 0.0f)) sc = 1.0f;
  if (threadIdx.x == 0) {
    s[(e * nb + bi) * kb + bj] = sc;
    if (st != nullptr) st[(e * kb + bj) * nb + bi] = sc;
  }
  uint8_t* qe = q + e * n * k;
  for (int i = threadIdx.x; i < nr * nc; i += blockDim.x) {
    const int r = i / nc, c = i % nc;
    const int64_t at = (r0 + r) * k + c0 + c;
    const uint8_t code = fp8_encode_dev(__fdiv_rn(fp8_load(we, at), sc), f);
    qe[at] = code;
    tile[r][c] = code;
  }
  if (qt == nullptr) return;
  __syncthreads();
  uint8_t* qte = qt + e * n * k;
  for (int i = threadIdx.x; i < nr * nc; i += blockDim.x) {
    const int c = i / nr, r = i % nr;  // consecutive threads: consecutive rows of w, one row of qt
    qte[(c0 + c) * n + r0 + r] = tile[r][c];
  }
}

// The experts' weights when n and k are multiples of 128 (whole blocks; w 16-byte, q and qt
// 16-byte aligned): a block per 128 x 128 block, each thread's row half loaded in registers
// (vector loads), then fp8_weight_block_codes, or under an MX rule (kMx) mx_weight_block_codes,
// whose column copy reads a BF16 block from a shared tile of the loaded values and an FP32 one
// from w again (a block just read, from L2).
struct MxWeightWholeSmem {
  uint16_t w[128][128 + 8];
  Fp8BlockReduceSmem reduce;
};

template <typename T, bool kMx>
__global__ void __launch_bounds__(kFp8WeightThreads)
    fp8_quantize_weights_whole_kernel(const T* __restrict__ w, int64_t n, int64_t k, Fp8Format f, Fp8Rule rule,
                                      uint8_t* __restrict__ q, float* __restrict__ s, uint8_t* __restrict__ qt,
                                      float* __restrict__ st, uint32_t* num_nonfinite) {
  using Smem = std::conditional_t<kMx, MxWeightWholeSmem, Fp8WeightBlockSmem>;
  __shared__ __align__(16) Smem sm;
  const int64_t nb = n / 128, kb = k / 128;
  const int64_t b = blockIdx.x, e = b / (nb * kb), bi = b / kb % nb, bj = b % kb;
  const int t = threadIdx.x, r = t / 2, c0 = 64 * (t % 2);
  const int64_t at = e * n * k + (bi * 128 + r) * k + bj * 128 + c0;
  float v[64];
#pragma unroll
  for (int i = 0; i < 8; ++i) fp8_load8(w, at + 8 * i, *reinterpret_cast<float(*)[8]>(v + 8 * i));
  if constexpr (!kMx) {
    fp8_weight_block_codes(v, e, bi, bj, n, k, f, q, s, qt, st, num_nonfinite, sm);
  } else if constexpr (std::is_same_v<T, uint16_t>) {
#pragma unroll
    for (int j = 0; j < 64; ++j) sm.w[r][c0 + j] = static_cast<uint16_t>(__float_as_uint(v[j]) >> 16);  // exact
    // mx_weight_block_codes synchronises the block before any thread reads the tile.
    mx_weight_block_codes(v, e, bi, bj, n, k, f, rule, q, s, qt, st, num_nonfinite, sm.reduce,
                          [&](int row, int col) { return __uint_as_float(uint32_t{sm.w[row][col]} << 16); });
  } else {
    const T* block = w + e * n * k + bi * 128 * k + bj * 128;
    mx_weight_block_codes(v, e, bi, bj, n, k, f, rule, q, s, qt, st, num_nonfinite, sm.reduce,
                          [&](int row, int col) { return fp8_load(block, int64_t{row} * k + col); });
  }
}

// out[b * ld + r] = s[r * kb + b] for r < rows, 0 for rows <= r < ld (grid-stride over kb * ld).
__global__ void fp8_scales_k_major_kernel(const float* __restrict__ s, int64_t rows, int64_t kb, int64_t ld,
                                          float* __restrict__ out) {
  const int64_t total = kb * ld;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t b = i / ld, r = i % ld;
    out[i] = r < rows ? s[r * kb + b] : 0.0f;
  }
}

// padded[e] = sum over e' < e of ceil(rows of e' / 128) * 128, e = 0 .. E (rows of e: offsets
// clamped to [0, max_rows] as the grouped GEMMs read them). One thread: E is at most a few thousand.
__global__ void fp8_expert_padded_offsets_kernel(const int32_t* __restrict__ offsets, int num_experts, int max_rows,
                                                 int32_t* __restrict__ padded) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int32_t at = 0;
  for (int e = 0; e < num_experts; ++e) {
    padded[e] = at;
    const int start = min(max(offsets[e], 0), max_rows), end = min(max(offsets[e + 1], start), max_rows);
    at += (end - start + 127) / 128 * 128;
  }
  padded[num_experts] = at;
}

constexpr int kFp8ColumnThreads = 256;  // 64 columns x 4 quarters of the block's 128 rows

// The expert rows of x [max_rows, width] (BF16) quantised down the rows: blockIdx.x is padded
// block b (rows padded[e] + 128 i of expert e, found by binary search; blocks past padded[E] do
// nothing), blockIdx.y 64 columns. The block's 128 rows x 64 columns go through shared memory
// (rows past the expert's end read as zeros); thread t takes column t % 64, rows 32 (t / 64) ..
// + 31; each column's max |x| over the 128 rows (order-free), its scale amax / fp8_max (1 for an
// all-zero column) into scales_t[b, column], and the codes fp8(x / scale) of its 32 rows into
// q_t[column, 128 b + 32 (t / 64) ..] as two 16-byte words.
__global__ void __launch_bounds__(kFp8ColumnThreads)
    fp8_quantize_expert_columns_kernel(const uint16_t* __restrict__ x, const int32_t* __restrict__ offsets,
                                       const int32_t* __restrict__ padded, int num_experts, int max_rows, int width,
                                       int64_t capacity, Fp8Format f, uint8_t* __restrict__ q_t,
                                       float* __restrict__ scales_t, uint32_t* num_nonfinite) {
  __shared__ uint16_t tile[128][64 + 2];
  __shared__ float s_max[4][64];
  __shared__ uint32_t s_bad[4][64];
  const int b = static_cast<int>(blockIdx.x), col0 = static_cast<int>(blockIdx.y) * 64;
  if (128 * b >= padded[num_experts]) return;
  int lo = 0, hi = num_experts - 1;  // the expert e with padded[e] <= 128 b < padded[e + 1]
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (padded[mid] <= 128 * b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int start = min(max(offsets[lo], 0), max_rows), end = min(max(offsets[lo + 1], start), max_rows);
  const int row0 = start + 128 * b - padded[lo];
  const int t = static_cast<int>(threadIdx.x);
  // Load: 128 rows x 64 columns, 8 columns (16 bytes) a thread and step.
  for (int i = t; i < 128 * 8; i += kFp8ColumnThreads) {
    const int r = i / 8, c = 8 * (i % 8);
    const int row = row0 + r;
    uint4 u = make_uint4(0u, 0u, 0u, 0u);
    if (row < end) {
      if (col0 + c + 8 <= width) {
        u = *reinterpret_cast<const uint4*>(x + int64_t{row} * width + col0 + c);
      } else {
        uint16_t e8[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int j = 0; j < 8 && col0 + c + j < width; ++j) e8[j] = x[int64_t{row} * width + col0 + c + j];
        u = make_uint4(e8[0] | uint32_t(e8[1]) << 16, e8[2] | uint32_t(e8[3]) << 16, e8[4] | uint32_t(e8[5]) << 16,
                       e8[6] | uint32_t(e8[7]) << 16);
      }
    }
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      tile[r][c + 2 * j] = static_cast<uint16_t>(w[j] & 0xffffu);
      tile[r][c + 2 * j + 1] = static_cast<uint16_t>(w[j] >> 16);
    }
  }
  __syncthreads();
  const int c = t % 64, quarter = t / 64;
  float v[32];
  float local = 0.0f;
  uint32_t bad = 0;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    v[i] = __uint_as_float(static_cast<uint32_t>(tile[32 * quarter + i][c]) << 16);
    bad += isfinite(v[i]) ? 0u : 1u;
    local = fmaxf(local, fabsf(v[i]));
  }
  s_max[quarter][c] = local;
  s_bad[quarter][c] = bad;
  __syncthreads();
  const float amax = fmaxf(fmaxf(s_max[0][c], s_max[1][c]), fmaxf(s_max[2][c], s_max[3][c]));
  float sc = __fdiv_rn(amax, fp8_max_of(f));
  if (!(sc > 0.0f)) sc = 1.0f;
  const int col = col0 + c;
  if (col >= width) return;
  if (quarter == 0) {
    scales_t[int64_t{b} * width + col] = sc;
    const uint32_t bad_all = s_bad[0][c] + s_bad[1][c] + s_bad[2][c] + s_bad[3][c];
    if (bad_all != 0 && num_nonfinite != nullptr) atomicAdd(num_nonfinite, bad_all);
  }
  uint8_t* out = q_t + int64_t{col} * capacity + 128 * int64_t{b} + 32 * quarter;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    *reinterpret_cast<uint4*>(out + 16 * h) =
        pack16([&](int i) { return fp8_encode_dev(__fdiv_rn(v[16 * h + i], sc), f); });
  }
}

// The expert exchange's FP8 row payload (1 x 128 blocks by the rule): row i of x [rows, cols] (BF16, cols a
// multiple of 128) as payload row i of `per` bytes: its cols codes, then its cols / 128 FP32
// scales (cpu::fp8_pack_rows). A half-warp per 1 x 128 block (fp8_half_warp_block_codes, the row
// quantiser's codes and scales bit for bit); codes stored as two 4-byte words (a payload row is
// 4-byte aligned). Grid-stride over the blocks, kFp8RowUnroll a half-warp per step.
template <bool kMx>
__global__ void __launch_bounds__(32 * kFp8RowWarps)
    fp8_pack_rows_kernel(const uint16_t* __restrict__ x, int64_t blocks, int64_t per_row, int64_t cols, int64_t per,
                         Fp8Format f, Fp8Rule rule, uint8_t* __restrict__ payload, uint32_t* num_nonfinite) {
  if constexpr (!kMx) rule = Fp8Rule::kBlocks;
  const int lane = threadIdx.x % 32, half = lane / 16, sub = lane % 16;
  const int64_t first = int64_t{blockIdx.x} * kFp8RowBlocksPerCta + (threadIdx.x / 32) * 2 * kFp8RowUnroll + half;
#pragma unroll
  for (int u = 0; u < kFp8RowUnroll; ++u) {
    const int64_t b = first + 2 * u;
    const bool valid = b < blocks;
    float v[8];
    if (valid) {
      fp8_load8(x, b * 128 + 8 * sub, v);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = 0.0f;
    }
    float s;
    const uint2 codes = fp8_half_warp_block_codes(v, valid, f, rule, s, num_nonfinite);
    if (!valid) continue;
    const int64_t row = b / per_row, blk = b % per_row;
    uint8_t* out = payload + row * per;
    uint32_t* words = reinterpret_cast<uint32_t*>(out + blk * 128 + 8 * sub);
    words[0] = codes.x;
    words[1] = codes.y;
    if (sub == 0) reinterpret_cast<float*>(out + cols)[blk] = s;
  }
}

// The payload rows back: thread t of the grid takes 8 codes of a row (cols / 8 a row), decodes them
// with their block's scale (FP32 products, rounded to BF16 into out when out is not null), and
// copies the codes into codes_out [rows, cols] and the scales into scales_out [rows, cols / 128]
// (each when not null).
__global__ void fp8_unpack_rows_kernel(const uint8_t* __restrict__ payload, int64_t rows, int64_t cols, int64_t per,
                                       Fp8Format f, uint8_t* __restrict__ codes_out, float* __restrict__ scales_out,
                                       uint16_t* __restrict__ out) {
  const int64_t chunks = cols / 8, total = rows * chunks;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / chunks, c = i % chunks, blk = c / 16;
    const uint8_t* in = payload + row * per;
    const uint32_t w0 = reinterpret_cast<const uint32_t*>(in + 8 * c)[0];
    const uint32_t w1 = reinterpret_cast<const uint32_t*>(in + 8 * c)[1];
    const float s = reinterpret_cast<const float*>(in + cols)[blk];
    if (codes_out != nullptr) *reinterpret_cast<uint2*>(codes_out + row * cols + 8 * c) = make_uint2(w0, w1);
    if (scales_out != nullptr && c % 16 == 0) scales_out[row * (cols / 128) + blk] = s;
    if (out != nullptr) {
      uint32_t packed[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t w = j < 2 ? w0 : w1;
        const int sh = 16 * (j % 2);
        const float a = fp8_decode_dev(static_cast<uint8_t>(w >> sh), f) * s;
        const float b = fp8_decode_dev(static_cast<uint8_t>(w >> (sh + 8)), f) * s;
        packed[j] = uint32_t{f32_to_bf16_bits(a)} | (uint32_t{f32_to_bf16_bits(b)} << 16);
      }
      *reinterpret_cast<uint4*>(out + row * cols + 8 * c) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
  }
}

// MX scales [rows, cols] in Blackwell's 128 x 4 tiles (cpu::mx_scales_tiled's layout): a thread per
// byte of the tiled output [tiles * 512], padding (rows past rows, columns past cols) 127.
__global__ void mx_scales_tiled_kernel(const uint8_t* __restrict__ s, int64_t rows, int64_t cols,
                                       uint8_t* __restrict__ out, int64_t bytes) {
  const int64_t col_tiles = (cols + 3) / 4;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < bytes; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t tile = i / 512, in = i % 512;
    const int64_t r = tile / col_tiles * 128 + in / 16 % 32 + in % 16 / 4 * 32, c = tile % col_tiles * 4 + in % 4;
    out[i] = r < rows && c < cols ? s[r * cols + c] : uint8_t{127};
  }
}

}  // namespace moe::cuda::kernels
