// RMSNorm kernels. Forward, a warp per row: rstd = 1 / sqrt(mean_j x_j^2 + eps) (saved FP32),
// y = (x * rstd) * w. Backward with xhat = x * rstd, g = dy * w, m = mean_j(g_j * xhat_j):
// dx = rstd * (g - xhat * m); dw += sum_rows dy * xhat, deterministically: each block owns a
// fixed chunk of kRmsChunkRows rows and writes that chunk's FP32 partial dw row, then
// rmsnorm_dw_reduce_chunks adds the partials to dw in chunk order (no float atomics).
#pragma once

#include "cuda/kernels/cp_async.cuh"
#include "cuda/kernels/fp8_codes.cuh"
#include "cuda/kernels/rms_row.cuh"
#include "cuda/kernels/rope.cuh"
#include "cuda/kernels/vec.cuh"

namespace moe::cuda::kernels {

constexpr int kRmsChunkRows = 32;     // rows per backward block (fixed: partition depends on n only)
constexpr int kRmsSubRows = 4;        // rows of a chunk whose m is computed before their dx (see below)
constexpr int kRmsStageRows = 2;      // the same for the staged kernel (two buffers of them in shared memory)
constexpr int kRmsBackwardThreads = 256;
constexpr int kRmsReduceWarps = 8;    // warps splitting the chunk sum in rmsnorm_dw_reduce_chunks
// The staged backward's (rmsnorm_backward_row_chunks<.., kStaged>) rows of x and dy, two buffers
// of kRmsStageRows rows each, and under RoPE one more set of kRmsStageRows rows (dy rotated back):
// the widest d it takes is 6144 (96 KiB of shared memory; 120 KiB under RoPE), with or without RoPE
// the same widths, so that QK-norm's fused backward and the separate ops run the same sums.
constexpr int64_t kRmsMaxStagedWidth = 6144;
__host__ __device__ constexpr int64_t rmsnorm_backward_stage_bytes(int64_t d, bool rope = false) {
  return (2 * 2 + (rope ? 1 : 0)) * kRmsStageRows * d * 2;
}

// y[c .. c + V) of a row with rstd r from the row's values v there: (v * r) * w, stored as BF16;
// out keeps the FP32 values.
template <int V>
__device__ __forceinline__ void rmsnorm_piece_of(const float (&v)[V], const uint16_t* __restrict__ w,
                                                 uint16_t* __restrict__ y_row, int64_t c, float r, float (&out)[V]) {
  float wv[V];
  load_bf16<V>(w + c, wv);
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = (v[i] * r) * wv[i];
  store_bf16<V>(y_row + c, out);
}

// rmsnorm_piece_of with the values read from x_row.
template <int V>
__device__ __forceinline__ void rmsnorm_piece(const uint16_t* __restrict__ x_row, const uint16_t* __restrict__ w,
                                              uint16_t* __restrict__ y_row, int64_t c, float r, float (&out)[V]) {
  float v[V];
  load_bf16<V>(x_row + c, v);
  rmsnorm_piece_of(v, w, y_row, c, r, out);
}

// The forwards' rows: a warp per row (grid-stride), its rstd computed and stored (lane 0), then
// body(row, r, lane) for the row's columns.
template <int V, typename Body>
__device__ __forceinline__ void rmsnorm_forward_rows(const uint16_t* __restrict__ x, float* __restrict__ rstd,
                                                     int64_t n, int64_t d, float eps, Body&& body) {
  const int lane = threadIdx.x % kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  for (int64_t row = int64_t{blockIdx.x} * warps + threadIdx.x / kWarpSize; row < n;
       row += int64_t{gridDim.x} * warps) {
    const float r = rms_row_rstd<V>(x + row * d, d, eps, lane);
    if (lane == 0) rstd[row] = r;
    body(row, r, lane);
  }
}

template <int V>
__global__ void rmsnorm_forward_warp_per_row(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                                             uint16_t* __restrict__ y, float* __restrict__ rstd, int64_t n,
                                             int64_t d, float eps) {
  rmsnorm_forward_rows<V>(x, rstd, n, d, eps, [&](int64_t row, float r, int lane) {
#pragma unroll 4
    for (int64_t c = int64_t{lane} * V; c < d; c += kWarpSize * V) {
      float out[V];
      rmsnorm_piece<V>(x + row * d, w, y + row * d, c, r, out);
    }
  });
}

// rmsnorm_forward_warp_per_row<kVecBf16> for d <= 32 * 8 * kPieces: lane l keeps its pieces
// l, l + 32, .. of the row in registers between the row's statistic and its output, so x is read
// once, with all of a lane's loads in flight together. The same operations in the same order as
// rms_row_rstd and rmsnorm_piece (rms_add_squares, rmsnorm_piece_of): the same bits.
template <int kPieces>
__global__ void rmsnorm_forward_warp_per_row_held(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                                                  uint16_t* __restrict__ y, float* __restrict__ rstd, int64_t n,
                                                  int64_t d, float eps) {
  constexpr int V = kVecBf16;
  const int lane = threadIdx.x % kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  for (int64_t row = int64_t{blockIdx.x} * warps + threadIdx.x / kWarpSize; row < n;
       row += int64_t{gridDim.x} * warps) {
    const uint16_t* x_row = x + row * d;
    uint4 raw[kPieces];
#pragma unroll
    for (int p = 0; p < kPieces; ++p) {
      const int64_t c = (int64_t{p} * kWarpSize + lane) * V;
      if (c < d) raw[p] = *reinterpret_cast<const uint4*>(x_row + c);
    }
    float sum_sq = 0.0f;
#pragma unroll
    for (int p = 0; p < kPieces; ++p) {
      if ((int64_t{p} * kWarpSize + lane) * V < d) {
        float v[V];
        bf16x8_to_f32(raw[p], v);
        rms_add_squares(v, sum_sq);
      }
    }
    const float r = rms_rstd_of_lane_sums(sum_sq, d, eps);
    if (lane == 0) rstd[row] = r;
    uint16_t* y_row = y + row * d;
#pragma unroll
    for (int p = 0; p < kPieces; ++p) {
      const int64_t c = (int64_t{p} * kWarpSize + lane) * V;
      if (c < d) {
        float v[V], out[V];
        bf16x8_to_f32(raw[p], v);
        rmsnorm_piece_of(v, w, y_row, c, r, out);
      }
    }
  }
}

// rmsnorm_forward_warp_per_row<kVecBf16> and the 1 x 128 FP8 quantisation of the stored y in the
// same pass (d a multiple of 128): each 256-column step of a row is two 1 x 128 blocks, one per
// half-warp, lane l of a half holding its block's elements 8 l .. 8 l + 7, as the quantiser's
// half-warp path holds them: the codes q [n, d] (E4M3) and scales s [n, d / 128] of
// fp8_quantize_blocks on y by the rule, bit for bit, from the BF16-rounded values it stores.
template <bool kMx>  // compiled for the MX rules, or for the block recipe (rule ignored)
__global__ void rmsnorm_forward_fp8_warp_per_row(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                                                 uint16_t* __restrict__ y, float* __restrict__ rstd,
                                                 uint8_t* __restrict__ q, float* __restrict__ s, int64_t n,
                                                 int64_t d, float eps, Fp8Rule rule) {
  if constexpr (!kMx) rule = Fp8Rule::kBlocks;
  constexpr int V = kVecBf16;
  rmsnorm_forward_rows<V>(x, rstd, n, d, eps, [&](int64_t row, float r, int lane) {
    const uint16_t* x_row = x + row * d;
    uint16_t* y_row = y + row * d;
    for (int64_t base = 0; base < d; base += kWarpSize * V) {  // the same steps on every lane (shuffles)
      const int64_t c = base + int64_t{lane} * V;
      const bool valid = c < d;  // d % 128 == 0: a half-warp's block is whole or absent
      float out[V];
      if (valid) {
        rmsnorm_piece<V>(x_row, w, y_row, c, r, out);
        round_to_bf16<V>(out);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) out[i] = 0.0f;
      }
      fp8_quantize_half_warp_block(out, valid, Fp8Format::kE4M3, rule, q + row * d + (valid ? c : 0),
                                   s + row * (d / 128) + (valid ? c / 128 : 0), nullptr);
    }
  });
}

// One block per chunk of kRmsChunkRows rows; blockDim.x == kRmsBackwardThreads. The chunk is
// walked in sub-chunks of kRmsSubRows rows: a warp per row computes m, then every thread takes
// its V columns down those rows, so that the second read of a row's x and dy comes from L2 (a
// whole chunk's rows, 256 KiB at d 2048 in each of the 512 blocks of 16384 rows, would not stay
// there: 2.61 -> 2.17 ms over one olmoe-8l step's 33 backwards; 8-row sub-chunks 2.32, 2 rows
// 2.65). partial_dw[chunk, d] receives the chunk's sum of dy * xhat, added over the rows in
// order (carried in partial_dw from one sub-chunk to the next, so the order is one pass's).
//
// kAddResidual (rmsnorm_backward_add): instead of storing dx, each row's dx, rounded to BF16 as the
// store would, is added to the FP32 residual gradient res, and res_bf16 (when not null) gets
// bf16(res): residual_add's operations on dx in the same pass, so the same bits without writing
// and reading dx.
//
// kRope (rope_rmsnorm_backward, QK-norm's backward after RoPE's): dy is the gradient before RoPE's
// backward; every piece of it is read rotated back as rope_backward would have stored it (its
// pair partner half a head away, the (cos, sin) of the row's position from rope_table [seq,
// head_dim / 2], rope_rotate<true>, rounded to BF16), so the same bits without the rotation's
// pass over dy. V = kVecBf16 and (head_dim / 2) % V == 0: a piece never straddles a head's halves.
//
// kStaged (V = kVecBf16; dynamic shared memory of rmsnorm_backward_stage_bytes(d)): the rows of x
// and dy (as stored: BF16 bits, dy not rotated) come into shared memory by asynchronous copies, in
// sub-chunks of kRmsStageRows rows and two buffers: the block's threads start the copy of the next
// sub-chunk, then run both phases of this one from shared memory, so the reads of HBM overlap the
// arithmetic instead of stalling phase 1, whose row sums are split over all the block's warps
// (kRmsBackwardThreads / 32 / kRmsStageRows a row, their sums added in warp order): m in that order,
// so dx (and dw through it) can differ from the unstaged kernel's in the last bits; deterministic
// all the same. Under kRope phase 1 also stores the rows of dy rotated back (BF16 values already:
// exactly) after the buffers, and phase 2 reads them there.
template <int V, bool kAddResidual = false, bool kRope = false, bool kStaged = false>
__global__ void __launch_bounds__(kRmsBackwardThreads)
    rmsnorm_backward_row_chunks(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                                const float* __restrict__ rstd, const uint16_t* __restrict__ dy,
                                uint16_t* __restrict__ dx, float* __restrict__ partial_dw, int64_t n, int64_t d,
                                float* __restrict__ res = nullptr, uint16_t* __restrict__ res_bf16 = nullptr,
                                const float2* __restrict__ rope_table = nullptr, int64_t seq = 0,
                                int head_dim = 0) {
  static_assert(!kRope || V == kVecBf16, "the rotated loads take 16-byte pieces");
  static_assert(!kStaged || V == kVecBf16, "the staged rows are 16-byte pieces");
  // kStaged: two buffers, each kRmsStageRows rows of x then kRmsStageRows rows of dy, BF16 bits;
  // under kRope then kRmsStageRows rows of dy rotated back.
  extern __shared__ __align__(16) uint16_t s_stage[];
  // kRope: the (cos, sin) row of a row's position, found once a row (a 64-bit modulo).
  const auto position_table = [&](int64_t row) -> const float2* {
    if constexpr (kRope) {
      return rope_table + (row % seq) * (head_dim / 2);
    } else {
      return nullptr;
    }
  };
  // dy_row[c .. c + V) (a row of dy, in global or shared memory), rotated back when kRope with the
  // (cos, sin) of the row's position (tab, position_table(row)); c < d < 2^31 (checked on the host),
  // so the column's place in its head is a 32-bit remainder.
  const auto load_dy = [&](const uint16_t* dy_row, int64_t c, const float2* tab, float (&out)[V]) {
    if constexpr (kRope) {
      const int half = head_dim / 2;
      const int hc = static_cast<int>(static_cast<uint32_t>(c) % static_cast<uint32_t>(head_dim));
      const bool lo = hc < half;
      const int i0 = lo ? hc : hc - half;
      float a[V], b[V];
      load_bf16<V>(dy_row + (lo ? c : c - half), a);
      load_bf16<V>(dy_row + (lo ? c + half : c), b);
      // The V (cos, sin) pairs as V / 2 16-byte loads (i0 a multiple of V, the table 16-byte aligned).
      const float4* t4 = reinterpret_cast<const float4*>(tab + i0);
#pragma unroll
      for (int k = 0; k < V; k += 2) {
        const float4 cs = t4[k / 2];
        float out_lo, out_hi;
        rope_rotate<true>(a[k], b[k], make_float2(cs.x, cs.y), out_lo, out_hi);
        out[k] = lo ? out_lo : out_hi;
        rope_rotate<true>(a[k + 1], b[k + 1], make_float2(cs.z, cs.w), out_lo, out_hi);
        out[k + 1] = lo ? out_lo : out_hi;
      }
      round_to_bf16<V>(out);  // as rope_backward stores it
    } else {
      load_bf16<V>(dy_row + c, out);
    }
  };
  constexpr int kSubRows = kStaged ? kRmsStageRows : kRmsSubRows;
  static_assert(kSubRows <= kRmsBackwardThreads / kWarpSize && kRmsChunkRows % kSubRows == 0,
                "a sub-chunk is at most one row per warp");
  // Warps on one row's m in phase 1: staged, every warp of the block (its rows are in shared
  // memory); else one.
  constexpr int kWarpsPerRow = kStaged ? kRmsBackwardThreads / kWarpSize / kSubRows : 1;
  __shared__ float s_dot[kStaged ? kRmsBackwardThreads / kWarpSize : 1];  // the warps' sums (kWarpsPerRow > 1)
  __shared__ float s_rstd[kRmsChunkRows];
  __shared__ float s_mean[kRmsChunkRows];  // m = mean_j(g_j * xhat_j) per row
  const int64_t row0 = int64_t{blockIdx.x} * kRmsChunkRows;
  const int rows = static_cast<int>(n - row0 < kRmsChunkRows ? n - row0 : kRmsChunkRows);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  float* partial = partial_dw + int64_t{blockIdx.x} * d;

  // Row r of the chunk (its sub-chunk starting at g0, in buffer buf when staged) of x and of dy.
  const auto x_row_of = [&](int r, int g0, int buf) -> const uint16_t* {
    if constexpr (kStaged) {
      return s_stage + (int64_t{buf} * 2 * kSubRows + (r - g0)) * d;
    } else {
      return x + (row0 + r) * d;
    }
  };
  const auto dy_row_of = [&](int r, int g0, int buf) -> const uint16_t* {
    if constexpr (kStaged) {
      return s_stage + (int64_t{buf} * 2 * kSubRows + kSubRows + (r - g0)) * d;
    } else {
      return dy + (row0 + r) * d;
    }
  };
  // kStaged and kRope: row r's dy rotated back (phase 1 writes it, phase 2 reads it).
  [[maybe_unused]] const auto rotated_row_of = [&](int r, int g0) -> uint16_t* {
    return s_stage + (int64_t{2} * 2 * kSubRows + (r - g0)) * d;
  };
  // kStaged: the copies of the sub-chunk starting at g0 into buffer buf, one commit group.
  [[maybe_unused]] const auto stage = [&](int g0, int buf) {
    const int64_t per_row = d / V;
    const int64_t pieces = int64_t{(g0 + kSubRows < rows ? g0 + kSubRows : rows) - g0} * per_row;
    for (int64_t p = threadIdx.x; p < 2 * pieces; p += kRmsBackwardThreads) {
      const bool of_dy = p >= pieces;
      const int64_t q = of_dy ? p - pieces : p;
      const int r = static_cast<int>(q / per_row);
      const int64_t c = (q - r * per_row) * V;
      uint16_t* dst = s_stage + (int64_t{buf} * 2 * kSubRows + (of_dy ? kSubRows : 0) + r) * d + c;
      cp_async_16(dst, (of_dy ? dy : x) + (row0 + g0 + r) * d + c);
    }
    cp_async_commit();
  };
  if constexpr (kStaged) stage(0, 0);

  for (int g0 = 0, buf = 0; g0 < rows; g0 += kSubRows, buf ^= 1) {
    const int g1 = g0 + kSubRows < rows ? g0 + kSubRows : rows;
    if constexpr (kStaged) {
      // The next sub-chunk's copies go into the other buffer (read by the previous sub-chunk, whose
      // end every thread has passed); then this one's are waited for and seen by every thread.
      if (g1 < rows) {
        stage(g1, buf ^ 1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
    }
    // Phase 1: the kWarpsPerRow warps of row g0 + warp / kWarpsPerRow compute its m (warp q of them
    // columns (32 q + lane) V + 32 kWarpsPerRow V j; their sums added in warp order).
    const int r = g0 + warp / kWarpsPerRow;
    if (warp < kSubRows * kWarpsPerRow && r < g1) {
      const uint16_t* x_row = x_row_of(r, g0, buf);
      const uint16_t* dy_row = dy_row_of(r, g0, buf);
      const float2* tab = position_table(row0 + r);
      float dot = 0.0f;
#pragma unroll 2
      for (int64_t c = (int64_t{warp % kWarpsPerRow} * kWarpSize + lane) * V; c < d;
           c += kWarpsPerRow * kWarpSize * V) {
        float xv[V], dv[V], wv[V];
        load_bf16<V>(x_row + c, xv);
        load_dy(dy_row, c, tab, dv);
        if constexpr (kStaged && kRope) store_bf16<V>(rotated_row_of(r, g0) + c, dv);
        load_bf16<V>(w + c, wv);
#pragma unroll
        for (int i = 0; i < V; ++i) dot += (dv[i] * wv[i]) * xv[i];
      }
      dot = warp_sum(dot);
      if constexpr (kWarpsPerRow > 1) {
        if (lane == 0) s_dot[warp] = dot;
      } else if (lane == 0) {
        const float rs = rstd[row0 + r];
        s_rstd[r] = rs;
        s_mean[r] = dot * rs / static_cast<float>(d);
      }
    }
    if constexpr (kWarpsPerRow > 1) {
      __syncthreads();
      const int rt = g0 + static_cast<int>(threadIdx.x);
      if (static_cast<int>(threadIdx.x) < kSubRows && rt < g1) {
        float dot = s_dot[threadIdx.x * kWarpsPerRow];
#pragma unroll
        for (int q = 1; q < kWarpsPerRow; ++q) dot += s_dot[threadIdx.x * kWarpsPerRow + q];
        const float rs = rstd[row0 + rt];
        s_rstd[rt] = rs;
        s_mean[rt] = dot * rs / static_cast<float>(d);
      }
    }
    __syncthreads();

    // Phase 2: each thread owns V columns at a time and walks the sub-chunk's rows in order.
    for (int64_t c = int64_t{threadIdx.x} * V; c < d; c += int64_t{blockDim.x} * V) {
      float wv[V], acc[V];
      load_bf16<V>(w + c, wv);
      if (g0 == 0) {
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = 0.0f;
      } else if constexpr (V == kVecBf16) {
        const float4 a = reinterpret_cast<const float4*>(partial + c)[0];
        const float4 b = reinterpret_cast<const float4*>(partial + c)[1];
        acc[0] = a.x, acc[1] = a.y, acc[2] = a.z, acc[3] = a.w, acc[4] = b.x, acc[5] = b.y, acc[6] = b.z,
        acc[7] = b.w;
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = partial[c + i];
      }
#pragma unroll 2
      for (int rr = g0; rr < g1; ++rr) {
        const int64_t off = (row0 + rr) * d + c;
        float xv[V], dv[V], out[V];
        load_bf16<V>(x_row_of(rr, g0, buf) + c, xv);
        if constexpr (kStaged && kRope) {
          load_bf16<V>(rotated_row_of(rr, g0) + c, dv);
        } else {
          load_dy(dy_row_of(rr, g0, buf), c, position_table(row0 + rr), dv);
        }
        const float rs = s_rstd[rr];
        const float m = s_mean[rr];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float xhat = xv[i] * rs;
          out[i] = rs * (dv[i] * wv[i] - xhat * m);
          acc[i] += dv[i] * xhat;
        }
        if constexpr (kAddResidual) {
          round_to_bf16<V>(out);
          residual_add_pack<V>(res + off, out, res_bf16 != nullptr ? res_bf16 + off : nullptr);
        } else {
          store_bf16<V>(dx + off, out);
        }
      }
      if constexpr (V == kVecBf16) {
        reinterpret_cast<float4*>(partial + c)[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        reinterpret_cast<float4*>(partial + c)[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) partial[c + i] = acc[i];
      }
    }
    if constexpr (kStaged) __syncthreads();  // the staged rows are read before the next sub-chunk's
  }
}

// table[s, i] = rope_cos_sin(s, i, head_dim, log2_theta) for s < seq, i < head_dim / 2: the
// (cos, sin) that rope_rotate_pairs builds in shared memory for each position, here in global
// memory for the rotated loads of rmsnorm_backward_row_chunks<.., kRope>.
__global__ void rope_cos_sin_table(float2* __restrict__ table, int64_t seq, int head_dim, double log2_theta) {
  const int half = head_dim / 2;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < seq * half;
       e += int64_t{gridDim.x} * blockDim.x) {
    table[e] = rope_cos_sin(e / half, static_cast<int>(e % half), head_dim, log2_theta);
  }
}

// dw[c] += sum over chunks of partial_dw[chunk, c]. Block (32, kRmsReduceWarps): lane -> column,
// warp k sums chunks k, k + 8, ... in order; the 8 warp sums are added in warp order. The order
// depends only on (n, d), so results are bitwise reproducible on any GPU.
__global__ void __launch_bounds__(kWarpSize * kRmsReduceWarps)
    rmsnorm_dw_reduce_chunks(const float* __restrict__ partial_dw, float* __restrict__ dw, int64_t num_chunks,
                             int64_t d) {
  __shared__ float s_sum[kRmsReduceWarps][kWarpSize];
  const int64_t c = int64_t{blockIdx.x} * kWarpSize + threadIdx.x;
  float sum = 0.0f;
  if (c < d) {
    for (int64_t k = threadIdx.y; k < num_chunks; k += kRmsReduceWarps) sum += partial_dw[k * d + c];
  }
  s_sum[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < d) {
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < kRmsReduceWarps; ++k) total += s_sum[k][threadIdx.x];
    dw[c] += total;
  }
}

}  // namespace moe::cuda::kernels
