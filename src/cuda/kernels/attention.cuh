// Causal grouped-query flash attention on tensor cores (mma.sync m16n8k16 BF16, FP32 accumulate).
// q, out, dout, dq: [B, S, Hq, D]; k, v, dk, dv: [B, S, Hkv, D]; lse, delta: [B, Hq, S] FP32. Scores
// are kept in the log2 domain, x = (q . k) * scale * log2(e), so softmax uses exp2f. Each warp owns
// 16 rows of its block's tile; shared-memory rows are padded to D + 8 elements (ldmatrix without
// bank conflicts). Backward is deterministic: dK/dV per (batch, kv head, key block), summed in
// registers over the group's query heads and query tiles; dQ per (batch, head, query block).
#pragma once

#include <cmath>

#include "cuda/kernels/mma_bf16.cuh"
#include "cuda/kernels/vec.cuh"

namespace moe::cuda::kernels {

constexpr float kAttnLog2e = 1.4426950408889634f;
constexpr float kAttnLn2 = 0.6931471805599453f;
constexpr unsigned kFullMask = 0xffffffffu;

// Shared-memory row stride in elements: 16 bytes of padding put 8 consecutive rows in 8
// different 16-byte bank groups.
template <int D>
constexpr int kAttnSmemStride = D + 8;

// Block tile shapes and their dynamic shared memory (bytes).
template <int D, int WARPS>
struct AttnForwardTile {
  static constexpr int kWarps = WARPS, kThreads = WARPS * kWarpSize;
  static constexpr int kBlockQ = 16 * WARPS, kBlockK = 64, kStride = kAttnSmemStride<D>;
  // Q tile, then K and V tiles twice (double buffer).
  static constexpr size_t kSmemBytes = size_t{kBlockQ + 4 * kBlockK} * kStride * sizeof(uint16_t);
};

template <int D, int BQ>
struct AttnBackwardKvTile {
  static constexpr int kWarps = 4, kThreads = kWarps * kWarpSize;
  static constexpr int kBlockK = 16 * kWarps, kBlockQ = BQ, kStride = kAttnSmemStride<D>;
  // K, V tiles; Q and dO tiles twice; lse and delta rows twice.
  static constexpr size_t kSmemBytes =
      size_t{2 * kBlockK + 4 * kBlockQ} * kStride * sizeof(uint16_t) + size_t{4 * kBlockQ} * sizeof(float);
};

template <int D>
struct AttnBackwardQTile {
  static constexpr int kWarps = 4, kThreads = kWarps * kWarpSize;
  static constexpr int kBlockQ = 16 * kWarps, kBlockK = 64, kStride = kAttnSmemStride<D>;
  // Q, dO tiles; K and V tiles twice.
  static constexpr size_t kSmemBytes = size_t{2 * kBlockQ + 4 * kBlockK} * kStride * sizeof(uint16_t);
};

// ROWS x D tile, row r read from src + r * ld, into shared memory with row stride D + 8; rows
// >= valid_rows become zeros (nothing read). Every thread of the block calls it; asynchronous
// (cp.async), the caller commits and waits.
template <int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_tile_async(uint16_t* dst, const uint16_t* src, int64_t ld, int valid_rows,
                                                const uint16_t* safe) {
  constexpr int kChunks = D / 8;
  constexpr int kStride = kAttnSmemStride<D>;
#pragma unroll
  for (int c = threadIdx.x; c < ROWS * kChunks; c += THREADS) {
    const int r = c / kChunks, ch = c % kChunks;
    const bool ok = r < valid_rows;
    cp_async_16(dst + r * kStride + ch * 8, ok ? src + r * ld + ch * 8 : safe, ok);
  }
}

// K and V rows of key block `blk` (BLOCK_K rows from blk * BLOCK_K) into the double buffer half
// blk & 1 of s_k / s_v; rows past seq become zeros. Asynchronous like load_tile_async.
template <int BLOCK_K, int D, int THREADS>
__device__ __forceinline__ void load_kv_block_async(uint16_t* s_k, uint16_t* s_v, const uint16_t* k_bh,
                                                    const uint16_t* v_bh, int64_t kv_ld, int seq, int blk,
                                                    const uint16_t* safe_k, const uint16_t* safe_v) {
  constexpr int kStride = kAttnSmemStride<D>;
  const int k0 = blk * BLOCK_K;
  const int buf = blk & 1;
  load_tile_async<BLOCK_K, D, THREADS>(s_k + buf * BLOCK_K * kStride, k_bh + int64_t{k0} * kv_ld, kv_ld, seq - k0,
                                       safe_k);
  load_tile_async<BLOCK_K, D, THREADS>(s_v + buf * BLOCK_K * kStride, v_bh + int64_t{k0} * kv_ld, kv_ld, seq - k0,
                                       safe_v);
}

// A fragment (16 rows x 16 columns at column k0) of a row-major shared tile, rows row0..row0+15.
template <int D>
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], const uint16_t* tile, int row0, int k0, int lane) {
  constexpr int kStride = kAttnSmemStride<D>;
  ldmatrix_x4(a, tile + (row0 + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + k0 + (lane >> 4) * 8);
}

// B fragments for two n-blocks (n0..n0+7 and n0+8..n0+15) where B[k][n] = tile[n][k] (tile rows
// are the n index): b[0..1] for the first n-block, b[2..3] for the second.
template <int D>
__device__ __forceinline__ void load_b_frag_rows(uint32_t (&b)[4], const uint16_t* tile, int n0, int k0, int lane) {
  constexpr int kStride = kAttnSmemStride<D>;
  ldmatrix_x4(b, tile + (n0 + (lane & 7) + (lane >> 4) * 8) * kStride + k0 + ((lane >> 3) & 1) * 8);
}

// B fragments for two n-blocks where B[k][n] = tile[k][n] (tile rows are the k index).
template <int D>
__device__ __forceinline__ void load_b_frag_cols(uint32_t (&b)[4], const uint16_t* tile, int k0, int n0, int lane) {
  constexpr int kStride = kAttnSmemStride<D>;
  ldmatrix_x4_trans(b, tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + n0 + (lane >> 4) * 8);
}

// acc[16 x 8N] += A (16 x 16K, from a_tile rows a_row0) * B^T where B rows come from b_tile (rows
// b_row0.., N*8 of them): the "scores" product X Y^T with K = D / 16.
template <int D, int N>
__device__ __forceinline__ void mma_rows_by_rows(float (&acc)[N][4], const uint16_t* a_tile, int a_row0,
                                                 const uint16_t* b_tile, int b_row0, int lane) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    load_a_frag<D>(a, a_tile, a_row0, kk * 16, lane);
#pragma unroll
    for (int n2 = 0; n2 < N / 2; ++n2) {
      uint32_t b[4];
      load_b_frag_rows<D>(b, b_tile, b_row0 + n2 * 16, kk * 16, lane);
      mma_bf16_16x8x16(acc[2 * n2], a, b[0], b[1]);
      mma_bf16_16x8x16(acc[2 * n2 + 1], a, b[2], b[3]);
    }
  }
}

// acc[16 x D] += P (16 x 16*KC, FP32 accumulator fragments rounded to BF16) * tile rows 0..16*KC
// (tile [k][D], rows are the k index).
template <int D, int KC>
__device__ __forceinline__ void mma_probs_by_tile(float (&acc)[D / 8][4], const float (&p)[2 * KC][4],
                                                  const uint16_t* tile, int lane) {
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
    const uint32_t a[4] = {pack_bf16x2(p[2 * kc][0], p[2 * kc][1]), pack_bf16x2(p[2 * kc][2], p[2 * kc][3]),
                           pack_bf16x2(p[2 * kc + 1][0], p[2 * kc + 1][1]),
                           pack_bf16x2(p[2 * kc + 1][2], p[2 * kc + 1][3])};
#pragma unroll
    for (int n2 = 0; n2 < D / 16; ++n2) {
      uint32_t b[4];
      load_b_frag_cols<D>(b, tile, kc * 16, n2 * 16, lane);
      mma_bf16_16x8x16(acc[2 * n2], a, b[0], b[1]);
      mma_bf16_16x8x16(acc[2 * n2 + 1], a, b[2], b[3]);
    }
  }
}

// A warp's 16 x D FP32 accumulator, times `scale`, to BF16 rows of global memory: staged through
// the warp's own 16 shared rows `stage` (row stride D + 8), then 16-byte stores of rows
// first_row + r < num_rows at dst + (first_row + r) * ld.
template <int D>
__device__ __forceinline__ void store_warp_rows(const float (&acc)[D / 8][4], float scale0, float scale1,
                                                uint16_t* stage, uint16_t* dst, int64_t ld, int first_row,
                                                int num_rows, int lane) {
  constexpr int kStride = kAttnSmemStride<D>;
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) {
    *reinterpret_cast<uint32_t*>(stage + g * kStride + nd * 8 + t4 * 2) =
        pack_bf16x2(acc[nd][0] * scale0, acc[nd][1] * scale0);
    *reinterpret_cast<uint32_t*>(stage + (g + 8) * kStride + nd * 8 + t4 * 2) =
        pack_bf16x2(acc[nd][2] * scale1, acc[nd][3] * scale1);
  }
  __syncwarp();
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int c = lane; c < 16 * kChunks; c += kWarpSize) {
    const int r = c / kChunks, ch = c % kChunks;
    if (first_row + r < num_rows) {
      *reinterpret_cast<uint4*>(dst + int64_t{first_row + r} * ld + ch * 8) =
          *reinterpret_cast<const uint4*>(stage + r * kStride + ch * 8);
    }
  }
}

// Forward. Grid (ceil(S / kBlockQ), Hq, B); the longest causal rows first. Block: WARPS warps,
// warp w owns query rows q0 + 16w .. +15; key tiles of 64 stream through a double buffer.
template <int D, int WARPS>
__global__ void __launch_bounds__(WARPS * kWarpSize)
    attention_forward_flash(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                            const uint16_t* __restrict__ v, uint16_t* __restrict__ out, float* __restrict__ lse,
                            int seq, int q_heads, int kv_heads, float scale_log2) {
  using Tile = AttnForwardTile<D, WARPS>;
  constexpr int kBlockQ = Tile::kBlockQ, kBlockK = Tile::kBlockK, kStride = Tile::kStride;
  constexpr int kThreads = Tile::kThreads;
  extern __shared__ __align__(16) uint16_t attn_smem[];
  uint16_t* s_q = attn_smem;
  uint16_t* s_k = s_q + kBlockQ * kStride;
  uint16_t* s_v = s_k + 2 * kBlockK * kStride;

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane >> 2, t4 = lane & 3;
  const int num_q_blocks = (seq + kBlockQ - 1) / kBlockQ;
  const int q0 = (num_q_blocks - 1 - static_cast<int>(blockIdx.x)) * kBlockQ;
  const int h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / (q_heads / kv_heads);
  const int64_t q_ld = int64_t{q_heads} * D, kv_ld = int64_t{kv_heads} * D;
  const uint16_t* q_bh = q + int64_t{b} * seq * q_ld + int64_t{h} * D;
  const uint16_t* k_bh = k + int64_t{b} * seq * kv_ld + int64_t{kvh} * D;
  const uint16_t* v_bh = v + int64_t{b} * seq * kv_ld + int64_t{kvh} * D;
  const int key_end = min(seq, q0 + kBlockQ);
  const int num_k_blocks = (key_end + kBlockK - 1) / kBlockK;

  load_tile_async<kBlockQ, D, kThreads>(s_q, q_bh + int64_t{q0} * q_ld, q_ld, seq - q0, q);
  load_kv_block_async<kBlockK, D, kThreads>(s_k, s_v, k_bh, v_bh, kv_ld, seq, 0, k, v);
  cp_async_commit();

  const int row_base = q0 + warp * 16;  // this warp's first query row
  const bool warp_active = row_base < seq;
  uint32_t q_frag[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY};  // running row max (log2 domain), rows g and g + 8
  float l_run[2] = {0.0f, 0.0f};            // this thread's part of the running row sum

  for (int j = 0; j < num_k_blocks; ++j) {
    if (j + 1 < num_k_blocks) {
      load_kv_block_async<kBlockK, D, kThreads>(s_k, s_v, k_bh, v_bh, kv_ld, seq, j + 1, k, v);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int k0 = j * kBlockK;
    const uint16_t* s_kb = s_k + (j & 1) * kBlockK * kStride;
    const uint16_t* s_vb = s_v + (j & 1) * kBlockK * kStride;
    if (warp_active && j == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) load_a_frag<D>(q_frag[kk], s_q, warp * 16, kk * 16, lane);
    }
    if (warp_active && k0 <= row_base + 15) {
      float s[kBlockK / 8][4];
#pragma unroll
      for (int nb = 0; nb < kBlockK / 8; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int n2 = 0; n2 < kBlockK / 16; ++n2) {
          uint32_t bk[4];
          load_b_frag_rows<D>(bk, s_kb, n2 * 16, kk * 16, lane);
          mma_bf16_16x8x16(s[2 * n2], q_frag[kk], bk[0], bk[1]);
          mma_bf16_16x8x16(s[2 * n2 + 1], q_frag[kk], bk[2], bk[3]);
        }
      }
      // Scale to the log2 domain; causal mask (key > query) where the tile crosses the diagonal.
      // Keys >= seq only meet rows >= seq or are masked by key > query.
      const bool need_mask = k0 + kBlockK - 1 > row_base;
      float mx[2] = {m_run[0], m_run[1]};
#pragma unroll
      for (int nb = 0; nb < kBlockK / 8; ++nb) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float x = s[nb][c] * scale_log2;
          if (need_mask) {
            const int row = row_base + g + (c >> 1) * 8;
            const int col = k0 + nb * 8 + t4 * 2 + (c & 1);
            if (col > row) x = -INFINITY;
          }
          s[nb][c] = x;
          mx[c >> 1] = fmaxf(mx[c >> 1], x);
        }
      }
      float shift[2], alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 2));
        shift[r] = mx[r] == -INFINITY ? 0.0f : mx[r];  // a row with nothing visible yet stays at zero
        alpha[r] = exp2f(m_run[r] - shift[r]);
        m_run[r] = mx[r];
      }
      float row_sum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int nb = 0; nb < kBlockK / 8; ++nb) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          s[nb][c] = exp2f(s[nb][c] - shift[c >> 1]);
          row_sum[c >> 1] += s[nb][c];
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + row_sum[r];
#pragma unroll
      for (int nd = 0; nd < D / 8; ++nd) {
        o[nd][0] *= alpha[0];
        o[nd][1] *= alpha[0];
        o[nd][2] *= alpha[1];
        o[nd][3] *= alpha[1];
      }
      mma_probs_by_tile<D, kBlockK / 16>(o, s, s_vb, lane);
    }
    __syncthreads();  // every warp is done with buffer j & 1 before it is refilled
  }
  cp_async_wait<0>();

  if (!warp_active) return;
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(kFullMask, l, 1);
    l += __shfl_xor_sync(kFullMask, l, 2);
    inv[r] = 1.0f / l;
    const int row = row_base + g + r * 8;
    if (t4 == 0 && row < seq) {
      lse[(int64_t{b} * q_heads + h) * seq + row] = (m_run[r] + log2f(l)) * kAttnLn2;
    }
  }
  // The warp's own Q rows are no longer read (fragments live in registers): stage there.
  store_warp_rows<D>(o, inv[0], inv[1], s_q + warp * 16 * kStride, out + int64_t{b} * seq * q_ld + int64_t{h} * D,
                     q_ld, row_base, seq, lane);
}

// delta[b, h, s] = dot(dout[b, s, h, :], out[b, s, h, :]) in FP32; D / 8 threads per row, one
// 16-byte vector each. rows = B * S * Hq in memory order; blockDim.x a multiple of 32.
template <int D>
__global__ void attention_backward_dot_rows(const uint16_t* __restrict__ out, const uint16_t* __restrict__ dout,
                                            float* __restrict__ delta, int64_t rows, int seq, int q_heads) {
  constexpr int kLanes = D / 8;
  const int64_t rows_per_block = blockDim.x / kLanes;
  for (int64_t base = int64_t{blockIdx.x} * rows_per_block; base < rows; base += int64_t{gridDim.x} * rows_per_block) {
    const int64_t r = base + threadIdx.x / kLanes;
    const int c = (threadIdx.x % kLanes) * 8;
    float acc = 0.0f;
    if (r < rows) {
      float o[8], d[8];
      load_bf16<8>(out + r * D + c, o);
      load_bf16<8>(dout + r * D + c, d);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc += o[i] * d[i];
    }
#pragma unroll
    for (int off = kLanes / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(kFullMask, acc, off);
    if (r < rows && threadIdx.x % kLanes == 0) {
      const int64_t h = r % q_heads, bs = r / q_heads;
      delta[(bs / seq * q_heads + h) * seq + bs % seq] = acc;
    }
  }
}

// Backward for dK and dV. Grid (ceil(S / 64), Hkv, B): a block owns 64 keys of one (batch, kv
// head), warp w keys k0 + 16w .. +15, and walks every query tile that can see them, for each query
// head of the group in order, accumulating in FP32 registers (no atomics, fixed order):
// S^T = K Q^T, P^T = exp2(S^T * scale log2 e - lse log2 e), dP^T = V dO^T,
// dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q; dK is scaled by `scale` at the end.
template <int D, int BQ>
__global__ void __launch_bounds__(AttnBackwardKvTile<D, BQ>::kThreads)
    attention_backward_dkdv_flash(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                                  const uint16_t* __restrict__ v, const float* __restrict__ lse,
                                  const float* __restrict__ delta, const uint16_t* __restrict__ dout,
                                  uint16_t* __restrict__ dk, uint16_t* __restrict__ dv, int seq, int q_heads,
                                  int kv_heads, float scale, float scale_log2) {
  using Tile = AttnBackwardKvTile<D, BQ>;
  constexpr int kBlockQ = Tile::kBlockQ, kBlockK = Tile::kBlockK, kStride = Tile::kStride;
  constexpr int kThreads = Tile::kThreads;
  extern __shared__ __align__(16) uint16_t attn_smem[];
  uint16_t* s_k = attn_smem;
  uint16_t* s_v = s_k + kBlockK * kStride;
  uint16_t* s_q = s_v + kBlockK * kStride;        // [2][kBlockQ][kStride]
  uint16_t* s_do = s_q + 2 * kBlockQ * kStride;   // [2][kBlockQ][kStride]
  float* s_lse = reinterpret_cast<float*>(s_do + 2 * kBlockQ * kStride);  // [2][kBlockQ]
  float* s_delta = s_lse + 2 * kBlockQ;                                   // [2][kBlockQ]

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane >> 2, t4 = lane & 3;
  const int k0 = blockIdx.x * kBlockK;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int group = q_heads / kv_heads;
  const int64_t q_ld = int64_t{q_heads} * D, kv_ld = int64_t{kv_heads} * D;
  const int64_t kv_off = int64_t{b} * seq * kv_ld + int64_t{kvh} * D;

  load_tile_async<kBlockK, D, kThreads>(s_k, k + kv_off + int64_t{k0} * kv_ld, kv_ld, seq - k0, k);
  load_tile_async<kBlockK, D, kThreads>(s_v, v + kv_off + int64_t{k0} * kv_ld, kv_ld, seq - k0, v);

  const int num_q_tiles = (seq + kBlockQ - 1) / kBlockQ;
  const int first_q_tile = k0 / kBlockQ;  // earlier tiles see none of these keys
  const int tiles_per_head = num_q_tiles - first_q_tile;
  const int num_tiles = group * tiles_per_head;

  auto load_q_tile = [&](int t, int buf) {
    const int h = kvh * group + t / tiles_per_head;
    const int qs0 = (first_q_tile + t % tiles_per_head) * kBlockQ;
    const int64_t q_off = int64_t{b} * seq * q_ld + int64_t{h} * D + int64_t{qs0} * q_ld;
    load_tile_async<kBlockQ, D, kThreads>(s_q + buf * kBlockQ * kStride, q + q_off, q_ld, seq - qs0, q);
    load_tile_async<kBlockQ, D, kThreads>(s_do + buf * kBlockQ * kStride, dout + q_off, q_ld, seq - qs0, dout);
    const int64_t row_off = (int64_t{b} * q_heads + h) * seq + qs0;
    for (int i = threadIdx.x; i < kBlockQ; i += kThreads) {
      const bool ok = qs0 + i < seq;
      cp_async_4(s_lse + buf * kBlockQ + i, ok ? lse + row_off + i : lse, ok);
      cp_async_4(s_delta + buf * kBlockQ + i, ok ? delta + row_off + i : delta, ok);
    }
  };
  load_q_tile(0, 0);
  cp_async_commit();

  const int key_base = k0 + warp * 16;  // this warp's first key
  float dk_acc[D / 8][4], dv_acc[D / 8][4];
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) {
#pragma unroll
    for (int c = 0; c < 4; ++c) dk_acc[nd][c] = dv_acc[nd][c] = 0.0f;
  }

  for (int t = 0; t < num_tiles; ++t) {
    if (t + 1 < num_tiles) load_q_tile(t + 1, (t + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int buf = t & 1;
    const int qs0 = (first_q_tile + t % tiles_per_head) * kBlockQ;
    const int q_last = min(seq, qs0 + kBlockQ) - 1;
    if (key_base < seq && key_base <= q_last) {
      const uint16_t* s_qb = s_q + buf * kBlockQ * kStride;
      const uint16_t* s_dob = s_do + buf * kBlockQ * kStride;
      const float* s_lseb = s_lse + buf * kBlockQ;
      const float* s_deltab = s_delta + buf * kBlockQ;
      float st[kBlockQ / 8][4], dpt[kBlockQ / 8][4];
#pragma unroll
      for (int nb = 0; nb < kBlockQ / 8; ++nb) {
#pragma unroll
        for (int c = 0; c < 4; ++c) st[nb][c] = dpt[nb][c] = 0.0f;
      }
      mma_rows_by_rows<D, kBlockQ / 8>(st, s_k, warp * 16, s_qb, 0, lane);
      mma_rows_by_rows<D, kBlockQ / 8>(dpt, s_v, warp * 16, s_dob, 0, lane);
      // Masked: key > query (causal) or query >= seq (padding rows of the last tile).
      const bool need_mask = key_base + 15 > qs0 || qs0 + kBlockQ > seq;
#pragma unroll
      for (int nb = 0; nb < kBlockQ / 8; ++nb) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int qc = nb * 8 + t4 * 2 + (c & 1);  // query column within the tile
          float p = exp2f(fmaf(st[nb][c], scale_log2, -s_lseb[qc] * kAttnLog2e));
          if (need_mask) {
            const int key = key_base + g + (c >> 1) * 8;
            const int query = qs0 + qc;
            if (key > query || query >= seq) p = 0.0f;
          }
          st[nb][c] = p;
          dpt[nb][c] = p * (dpt[nb][c] - s_deltab[qc]);
        }
      }
      mma_probs_by_tile<D, kBlockQ / 16>(dv_acc, st, s_dob, lane);
      mma_probs_by_tile<D, kBlockQ / 16>(dk_acc, dpt, s_qb, lane);
    }
    __syncthreads();  // every warp is done with buffer t & 1 before it is refilled
  }
  cp_async_wait<0>();

  if (key_base >= seq) return;
  // Each warp read only its own 16 rows of s_k and s_v: stage its results there.
  uint16_t* dk_bh = dk + kv_off;
  uint16_t* dv_bh = dv + kv_off;
  store_warp_rows<D>(dk_acc, scale, scale, s_k + warp * 16 * kStride, dk_bh, kv_ld, key_base, seq, lane);
  store_warp_rows<D>(dv_acc, 1.0f, 1.0f, s_v + warp * 16 * kStride, dv_bh, kv_ld, key_base, seq, lane);
}

// Backward for dQ. Grid (ceil(S / 64), Hq, B), longest rows first: a block owns 64 query rows of
// one (batch, head), warp w rows q0 + 16w .. +15, and streams the visible key tiles:
// S = Q K^T, P = exp2(S * scale log2 e - lse log2 e), dP = dO V^T, dS = P (dP - delta),
// dQ += dS K; dQ is scaled by `scale` at the end.
template <int D>
__global__ void __launch_bounds__(AttnBackwardQTile<D>::kThreads)
    attention_backward_dq_flash(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                                const uint16_t* __restrict__ v, const float* __restrict__ lse,
                                const float* __restrict__ delta, const uint16_t* __restrict__ dout,
                                uint16_t* __restrict__ dq, int seq, int q_heads, int kv_heads, float scale,
                                float scale_log2) {
  using Tile = AttnBackwardQTile<D>;
  constexpr int kBlockQ = Tile::kBlockQ, kBlockK = Tile::kBlockK, kStride = Tile::kStride;
  constexpr int kThreads = Tile::kThreads;
  extern __shared__ __align__(16) uint16_t attn_smem[];
  uint16_t* s_q = attn_smem;
  uint16_t* s_do = s_q + kBlockQ * kStride;
  uint16_t* s_k = s_do + kBlockQ * kStride;  // [2][kBlockK][kStride]
  uint16_t* s_v = s_k + 2 * kBlockK * kStride;

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane >> 2, t4 = lane & 3;
  const int num_q_blocks = (seq + kBlockQ - 1) / kBlockQ;
  const int q0 = (num_q_blocks - 1 - static_cast<int>(blockIdx.x)) * kBlockQ;
  const int h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / (q_heads / kv_heads);
  const int64_t q_ld = int64_t{q_heads} * D, kv_ld = int64_t{kv_heads} * D;
  const int64_t q_off = int64_t{b} * seq * q_ld + int64_t{h} * D;
  const uint16_t* k_bh = k + int64_t{b} * seq * kv_ld + int64_t{kvh} * D;
  const uint16_t* v_bh = v + int64_t{b} * seq * kv_ld + int64_t{kvh} * D;
  const int key_end = min(seq, q0 + kBlockQ);
  const int num_k_blocks = (key_end + kBlockK - 1) / kBlockK;

  load_tile_async<kBlockQ, D, kThreads>(s_q, q + q_off + int64_t{q0} * q_ld, q_ld, seq - q0, q);
  load_tile_async<kBlockQ, D, kThreads>(s_do, dout + q_off + int64_t{q0} * q_ld, q_ld, seq - q0, dout);
  load_kv_block_async<kBlockK, D, kThreads>(s_k, s_v, k_bh, v_bh, kv_ld, seq, 0, k, v);
  cp_async_commit();

  const int row_base = q0 + warp * 16;
  const bool warp_active = row_base < seq;
  float lse2[2], row_delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_base + g + r * 8;
    const int64_t idx = (int64_t{b} * q_heads + h) * seq + row;
    lse2[r] = row < seq ? lse[idx] * kAttnLog2e : 0.0f;
    row_delta[r] = row < seq ? delta[idx] : 0.0f;
  }
  float dq_acc[D / 8][4];
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) dq_acc[nd][0] = dq_acc[nd][1] = dq_acc[nd][2] = dq_acc[nd][3] = 0.0f;

  for (int j = 0; j < num_k_blocks; ++j) {
    if (j + 1 < num_k_blocks) {
      load_kv_block_async<kBlockK, D, kThreads>(s_k, s_v, k_bh, v_bh, kv_ld, seq, j + 1, k, v);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int k0 = j * kBlockK;
    if (warp_active && k0 <= row_base + 15) {
      const uint16_t* s_kb = s_k + (j & 1) * kBlockK * kStride;
      const uint16_t* s_vb = s_v + (j & 1) * kBlockK * kStride;
      float s[kBlockK / 8][4], dp[kBlockK / 8][4];
#pragma unroll
      for (int nb = 0; nb < kBlockK / 8; ++nb) {
#pragma unroll
        for (int c = 0; c < 4; ++c) s[nb][c] = dp[nb][c] = 0.0f;
      }
      mma_rows_by_rows<D, kBlockK / 8>(s, s_q, warp * 16, s_kb, 0, lane);
      mma_rows_by_rows<D, kBlockK / 8>(dp, s_do, warp * 16, s_vb, 0, lane);
      const bool need_mask = k0 + kBlockK - 1 > row_base;
#pragma unroll
      for (int nb = 0; nb < kBlockK / 8; ++nb) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float p = exp2f(fmaf(s[nb][c], scale_log2, -lse2[c >> 1]));
          if (need_mask) {
            const int row = row_base + g + (c >> 1) * 8;
            const int col = k0 + nb * 8 + t4 * 2 + (c & 1);
            if (col > row) p = 0.0f;
          }
          s[nb][c] = p * (dp[nb][c] - row_delta[c >> 1]);  // dS
        }
      }
      mma_probs_by_tile<D, kBlockK / 16>(dq_acc, s, s_kb, lane);
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  if (!warp_active) return;
  // Each warp read only its own 16 rows of s_q: stage its dQ there.
  store_warp_rows<D>(dq_acc, scale, scale, s_q + warp * 16 * kStride, dq + q_off, q_ld, row_base, seq, lane);
}

}  // namespace moe::cuda::kernels
