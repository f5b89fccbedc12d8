// Grouped BF16 GEMMs for MoE experts whose row groups [offsets[e], offsets[e+1]) live on the device.
// M-grouped contiguous (forward Y = X W[e]^T, dgrad dX = dY W[e]): a persistent grid walks
// (M-tile, N-tile) pairs of a schedule each CTA builds in shared memory from the offsets. K-grouped
// (wgrad dW[e] (+)= dY_e^T X_e): a CTA per (tile of dW[e], e) reduces over the expert's rows.
// Tensor cores through mma.sync m16n8k16 (FP32 accumulation), ldmatrix, cp.async 3-stage pipeline.
#pragma once

#include <cstdint>

#include "cuda/kernels/cp_async.cuh"
#include "cuda/kernels/vec.cuh"

namespace moe::cuda::kernels {

// CTA tile kGemmBM x kGemmBN x kGemmBK; 8 warps as 2 (M) x 4 (N), each owning a 64 x 32 sub-tile.
constexpr int kGemmBM = 128;
constexpr int kGemmBN = 128;
constexpr int kGemmBK = 64;
constexpr int kGemmStages = 3;
constexpr int kGemmThreads = 256;
constexpr int kGemmWarpTileM = 64;
constexpr int kGemmWarpTileN = 32;
constexpr int kGemmWarpsM = kGemmBM / kGemmWarpTileM;  // 2
constexpr int kGemmFragsM = kGemmWarpTileM / 16;         // m16 fragments per warp
constexpr int kGemmFragsN = kGemmWarpTileN / 8;          // n8 fragments per warp
static_assert(kGemmWarpsM * (kGemmBN / kGemmWarpTileN) * kWarpSize == kGemmThreads, "8 warps tile the CTA");

// Elements of one operand tile (128 x 64 either way round) and of one pipeline stage (A then B).
constexpr int kGemmTileElems = kGemmBM * kGemmBK;
static_assert(kGemmBN * kGemmBK == kGemmTileElems, "A and B tiles have the same size");
constexpr int kGemmStageElems = 2 * kGemmTileElems;
constexpr int kGemmPipelineBytes = kGemmStages * kGemmStageElems * 2;  // 96 KiB

// How an operand tile sits in global and shared memory.
//   kK:  rows are the M (or N) index, the reduction index k is contiguous: tile [128 rows][64 k].
//   kMN: rows are the reduction index k, M (or N) is contiguous:              tile [64 k][128 cols].
// Forward: A = X (kK), B = W[e] (kK). Dgrad: A = dY (kK), B = W[e] (kMN). Wgrad: both kMN.
enum class Major { kK, kMN };

// A tile of shared memory is rows of 16-byte chunks (8 BF16); chunk c of row r is stored at
// chunk position c ^ (r & 7). ldmatrix reads 8 consecutive rows (a multiple of 8 apart from
// the tile start) at one logical chunk, and these land in 8 different 16-byte bank groups.
__device__ __forceinline__ int swizzled(int row, int chunk, int chunks_per_row) {
  return (row * chunks_per_row + (chunk ^ (row & 7))) * 8;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p))
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p))
               : "memory");
}

// d (16x8, FP32) += a (16x16 BF16, row) * b (16x8 BF16, col).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One operand of a CTA tile in global memory: row-major with leading dimension `ld` (a multiple
// of 8 elements, base 16-byte aligned). Rows >= row_limit and columns >= col_limit read as zero.
// kK operands advance along columns with the k-tile (col_base + kt * kGemmBK), kMN operands
// along rows (row_base + kt * kGemmBK).
struct GemmOperand {
  const uint16_t* ptr;
  int ld;
  int row_base;
  int row_limit;
  int col_base;
  int col_limit;
};

// Issues the cp.async copies of a kRows x (kChunks * 8) tile starting at (row0, col0).
// Thread tid copies chunk tid % kChunks of rows tid / kChunks + i * (kGemmThreads / kChunks).
// Indices stay below 2^31 (the entry points keep sizes <= 2^30); only the address is 64-bit.
template <int kRows, int kChunks>
__device__ __forceinline__ void load_tile_async(uint16_t* smem, const GemmOperand& op, int row0, int col0, int tid) {
  constexpr int kRowsPerPass = kGemmThreads / kChunks;
  static_assert(kRowsPerPass * kChunks == kGemmThreads && kRows % kRowsPerPass == 0,
                "tile chunks divide evenly over the threads");
  const int c = tid % kChunks;
  const int gcol = col0 + c * 8;
  const bool col_ok = gcol < op.col_limit;
#pragma unroll
  for (int i = 0; i < kRows / kRowsPerPass; ++i) {
    const int r = tid / kChunks + i * kRowsPerPass;
    const int grow = row0 + r;
    const bool valid = col_ok && grow < op.row_limit;
    const uint16_t* src = valid ? op.ptr + (static_cast<int64_t>(grow) * op.ld + gcol) : op.ptr;
    cp_async_16(smem + swizzled(r, c, kChunks), src, valid);
  }
}

template <Major kMajor>
__device__ __forceinline__ void load_operand_async(uint16_t* smem, const GemmOperand& op, int kt, int tid) {
  if constexpr (kMajor == Major::kK) {
    load_tile_async<kGemmBM, kGemmBK / 8>(smem, op, op.row_base, op.col_base + kt * kGemmBK, tid);
  } else {
    load_tile_async<kGemmBK, kGemmBM / 8>(smem, op, op.row_base + kt * kGemmBK, op.col_base, tid);
  }
}

// A fragment (16 x 16, m0.. m0+15 by k16 step kk) for mma.sync: registers a0..a3 hold
// (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15).
template <Major kMajor>
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], const uint16_t* s, int m0, int kk, int lane) {
  if constexpr (kMajor == Major::kK) {
    // Lanes 0-15 address rows m0 + 0..15 at k chunk 2kk, lanes 16-31 the same rows at chunk 2kk + 1.
    ldmatrix_x4(a, s + swizzled(m0 + (lane & 15), kk * 2 + (lane >> 4), kGemmBK / 8));
  } else {
    // Matrix j = lane / 8: k half j / 2, m half j % 2; the transposing load gives the row-major fragment.
    const int j = lane >> 3;
    ldmatrix_x4_trans(a, s + swizzled(kk * 16 + (j >> 1) * 8 + (lane & 7), m0 / 8 + (j & 1), kGemmBM / 8));
  }
}

// B fragments of two n8 blocks (n0..n0+7 and n0+8..n0+15) for k16 step kk: b[0], b[1] are block 0's
// (k 0-7), (k 8-15) registers, b[2], b[3] block 1's.
template <Major kMajor>
__device__ __forceinline__ void load_b_frags(uint32_t (&b)[4], const uint16_t* s, int n0, int kk, int lane) {
  const int j = lane >> 3;
  if constexpr (kMajor == Major::kK) {
    // Matrix j: n block j / 2, k half j % 2.
    ldmatrix_x4(b, s + swizzled(n0 + (j >> 1) * 8 + (lane & 7), kk * 2 + (j & 1), kGemmBK / 8));
  } else {
    ldmatrix_x4_trans(b, s + swizzled(kk * 16 + (j & 1) * 8 + (lane & 7), n0 / 8 + (j >> 1), kGemmBN / 8));
  }
}

struct WarpPos {
  int tid, lane, m0, n0;  // n0, m0: the warp's sub-tile origin inside the CTA tile
};

__device__ __forceinline__ WarpPos warp_pos() {
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / kWarpSize;
  return {tid, tid % kWarpSize, (warp % kGemmWarpsM) * kGemmWarpTileM, (warp / kGemmWarpsM) * kGemmWarpTileN};
}

using GemmAcc = float[kGemmFragsM][kGemmFragsN][4];

// acc = A_tile @ B_tile over num_k_tiles k-tiles of kGemmBK, through a kGemmStages-deep cp.async
// pipeline in `smem` (kGemmPipelineBytes). Ends with every copy landed and a block barrier, so the
// caller may start another tile at once.
template <Major kAMajor, Major kBMajor>
__device__ __forceinline__ void gemm_tile_mainloop(uint16_t* smem, const GemmOperand& a, const GemmOperand& b,
                                                   int num_k_tiles, const WarpPos& w, GemmAcc& acc) {
#pragma unroll
  for (int i = 0; i < kGemmFragsM; ++i)
#pragma unroll
    for (int j = 0; j < kGemmFragsN; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.0f;

  // Group g of cp.async copies holds k-tile g: the prologue commits groups 0..S-2 (empty past the end).
#pragma unroll
  for (int s = 0; s < kGemmStages - 1; ++s) {
    if (s < num_k_tiles) {
      load_operand_async<kAMajor>(smem + s * kGemmStageElems, a, s, w.tid);
      load_operand_async<kBMajor>(smem + s * kGemmStageElems + kGemmTileElems, b, s, w.tid);
    }
    cp_async_commit();
  }

  for (int kt = 0; kt < num_k_tiles; ++kt) {
    cp_async_wait<kGemmStages - 2>();  // this thread's copies of k-tile kt have landed
    __syncthreads();                   // everyone's have; and stage (kt - 1) % S is no longer read
    const int next = kt + kGemmStages - 1;
    if (next < num_k_tiles) {
      uint16_t* st = smem + (next % kGemmStages) * kGemmStageElems;
      load_operand_async<kAMajor>(st, a, next, w.tid);
      load_operand_async<kBMajor>(st + kGemmTileElems, b, next, w.tid);
    }
    cp_async_commit();

    const uint16_t* sa = smem + (kt % kGemmStages) * kGemmStageElems;
    const uint16_t* sb = sa + kGemmTileElems;
#pragma unroll
    for (int kk = 0; kk < kGemmBK / 16; ++kk) {
      uint32_t af[kGemmFragsM][4];
      uint32_t bf[kGemmFragsN / 2][4];
#pragma unroll
      for (int i = 0; i < kGemmFragsM; ++i) load_a_frag<kAMajor>(af[i], sa, w.m0 + i * 16, kk, w.lane);
#pragma unroll
      for (int jj = 0; jj < kGemmFragsN / 2; ++jj) load_b_frags<kBMajor>(bf[jj], sb, w.n0 + jj * 16, kk, w.lane);
#pragma unroll
      for (int i = 0; i < kGemmFragsM; ++i)
#pragma unroll
        for (int j = 0; j < kGemmFragsN; ++j)
          mma_bf16_16816(acc[i][j], af[i], bf[j / 2][(j % 2) * 2], bf[j / 2][(j % 2) * 2 + 1]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();
}

// Accumulator element (i, j, v) of a lane sits at row m0 + 16 i + lane / 4 + 8 (v / 2) and columns
// n0 + 8 j + 2 (lane % 4) + {0, 1} (v % 2) of the CTA tile.

// out[row, col..col+1] = bf16(acc) for rows in [row0, row_end) and columns < n_out.
__device__ __forceinline__ void store_tile_bf16(const GemmAcc& acc, const WarpPos& w, uint16_t* out, int n_out,
                                                int row0, int row_end, int col0) {
#pragma unroll
  for (int i = 0; i < kGemmFragsM; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + w.m0 + i * 16 + w.lane / 4 + h * 8;
      if (row >= row_end) continue;
#pragma unroll
      for (int j = 0; j < kGemmFragsN; ++j) {
        const int col = col0 + w.n0 + j * 8 + (w.lane % 4) * 2;
        if (col >= n_out) continue;  // n_out is even, so col + 1 < n_out too
        const uint32_t packed = static_cast<uint32_t>(f32_to_bf16_bits(acc[i][j][2 * h])) |
                                (static_cast<uint32_t>(f32_to_bf16_bits(acc[i][j][2 * h + 1])) << 16);
        *reinterpret_cast<uint32_t*>(out + (static_cast<int64_t>(row) * n_out + col)) = packed;
      }
    }
  }
}

// out[row, col..col+1] = acc (+ out when accumulate) for rows < rows and columns < cols (FP32).
__device__ __forceinline__ void store_tile_f32(const GemmAcc& acc, const WarpPos& w, float* out, int rows, int cols,
                                               int row0, int col0, bool accumulate) {
#pragma unroll
  for (int i = 0; i < kGemmFragsM; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + w.m0 + i * 16 + w.lane / 4 + h * 8;
      if (row >= rows) continue;
#pragma unroll
      for (int j = 0; j < kGemmFragsN; ++j) {
        const int col = col0 + w.n0 + j * 8 + (w.lane % 4) * 2;
        if (col >= cols) continue;
        float2* p = reinterpret_cast<float2*>(out + (static_cast<int64_t>(row) * cols + col));
        float2 v = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
        if (accumulate) {
          const float2 old = *p;
          v.x = old.x + v.x;
          v.y = old.y + v.y;
        }
        *p = v;
      }
    }
  }
}

// The rows of expert e, clamped so that a bad offset never addresses memory outside [0, max_rows):
// start = clamp(offsets[e], 0, max_rows), end = clamp(offsets[e + 1], start, max_rows). For valid
// offsets (0 = offsets[0] <= ... <= offsets[E] <= max_rows) these are the offsets themselves.
__device__ __forceinline__ void expert_rows(const int32_t* __restrict__ offsets, int e, int max_rows, int& start,
                                            int& end) {
  start = min(max(offsets[e], 0), max_rows);
  end = min(max(offsets[e + 1], start), max_rows);
}

// Bytes of shared memory the M-grouped schedule needs after the pipeline buffers.
__host__ __device__ constexpr int64_t m_grouped_schedule_bytes(int64_t num_experts) {
  return (3 * num_experts + 1) * 4;
}

// Warp 0 fills s_start[e], s_end[e] (expert_rows) and s_tile[0..E] = exclusive prefix sum of the
// experts' M-tile counts ceil((end - start) / kGemmBM); then a block barrier.
__device__ __forceinline__ void build_m_grouped_schedule(const int32_t* __restrict__ offsets, int num_experts,
                                                         int max_rows, int* s_start, int* s_end, int* s_tile) {
  if (threadIdx.x < kWarpSize) {
    const int lane = static_cast<int>(threadIdx.x);
    const int per_lane = (num_experts + kWarpSize - 1) / kWarpSize;
    const int lo = min(lane * per_lane, num_experts);
    const int hi = min(lo + per_lane, num_experts);
    int sum = 0;  // this lane's experts, in order
    for (int e = lo; e < hi; ++e) {
      int start, end;
      expert_rows(offsets, e, max_rows, start, end);
      s_start[e] = start;
      s_end[e] = end;
      sum += (end - start + kGemmBM - 1) / kGemmBM;
      s_tile[e + 1] = sum;
    }
    int inclusive = sum;  // scan of the lanes' sums
#pragma unroll
    for (int d = 1; d < kWarpSize; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += v;
    }
    const int before = inclusive - sum;
    for (int e = lo; e < hi; ++e) s_tile[e + 1] += before;
    if (lane == 0) s_tile[0] = 0;
  }
  __syncthreads();
}

// The expert owning M-tile mt: the largest e with s_tile[e] <= mt (then s_tile[e + 1] > mt, so
// the expert has rows), for 0 <= mt < s_tile[num_experts].
__device__ __forceinline__ int find_tile_expert(const int* s_tile, int num_experts, int mt) {
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (s_tile[mid] <= mt) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// M-grouped contiguous GEMM: for every expert e and row r in its group,
//   out[r, :] = a[r, :] @ B_e,  B_e from w + e * n_out * k_red,
// kBMajor == kK (forward):  w[e] is [n_out, k_red] and B_e = w[e]^T  (Y = X W^T);
// kBMajor == kMN (dgrad):   w[e] is [k_red, n_out] and B_e = w[e]    (dX = dY W).
// a: [max_rows, k_red], out: [max_rows, n_out], BF16; rows outside every group are not written.
// Persistent: CTA b takes tiles b, b + gridDim.x, ... of (M-tile, N-tile) with the N-tile fastest.
// Dynamic shared memory: kGemmPipelineBytes + m_grouped_schedule_bytes(num_experts).
template <Major kBMajor>
__global__ void __launch_bounds__(kGemmThreads, 2)
    grouped_gemm_m_contiguous(const uint16_t* __restrict__ a, const uint16_t* __restrict__ w,
                              const int32_t* __restrict__ expert_offsets, uint16_t* __restrict__ out, int max_rows,
                              int num_experts, int n_out, int k_red) {
  extern __shared__ __align__(128) unsigned char gemm_smem[];
  uint16_t* pipeline = reinterpret_cast<uint16_t*>(gemm_smem);
  int* s_start = reinterpret_cast<int*>(gemm_smem + kGemmPipelineBytes);
  int* s_end = s_start + num_experts;
  int* s_tile = s_end + num_experts;
  build_m_grouped_schedule(expert_offsets, num_experts, max_rows, s_start, s_end, s_tile);

  const WarpPos wp = warp_pos();
  const int n_tiles = (n_out + kGemmBN - 1) / kGemmBN;
  const int64_t num_tiles = int64_t{s_tile[num_experts]} * n_tiles;
  const int num_k_tiles = (k_red + kGemmBK - 1) / kGemmBK;
  const int64_t expert_elems = int64_t{n_out} * k_red;
  for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const int mt = static_cast<int>(t / n_tiles);
    const int col0 = static_cast<int>(t % n_tiles) * kGemmBN;
    const int e = find_tile_expert(s_tile, num_experts, mt);
    const int row0 = s_start[e] + (mt - s_tile[e]) * kGemmBM;
    const int row_end = s_end[e];
    const GemmOperand op_a{a, k_red, row0, row_end, 0, k_red};
    const uint16_t* w_e = w + e * expert_elems;
    GemmOperand op_b;
    if constexpr (kBMajor == Major::kK) {
      op_b = GemmOperand{w_e, k_red, col0, n_out, 0, k_red};
    } else {
      op_b = GemmOperand{w_e, n_out, 0, k_red, col0, n_out};
    }
    GemmAcc acc;
    gemm_tile_mainloop<Major::kK, kBMajor>(pipeline, op_a, op_b, num_k_tiles, wp, acc);
    store_tile_bf16(acc, wp, out, n_out, row0, row_end, col0);
  }
}

// The sum of the squares of a tile's stored elements (rows below `rows`, columns below `cols`),
// in FP64 (a float's square is exact there): each thread its fragment in register order, each
// warp by a butterfly, then the 8 warps in order through s_warp. Every thread calls it; thread 0
// gets the total. Ends with a block barrier.
__device__ __forceinline__ double tile_square_sum(const GemmAcc& acc, const WarpPos& w, int rows, int cols, int row0,
                                                  int col0, double* s_warp) {
  double sum = 0.0;
#pragma unroll
  for (int i = 0; i < kGemmFragsM; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool row_in = row0 + w.m0 + i * 16 + w.lane / 4 + h * 8 < rows;
#pragma unroll
      for (int j = 0; j < kGemmFragsN; ++j) {
        const bool in = row_in && col0 + w.n0 + j * 8 + (w.lane % 4) * 2 < cols;  // cols is even
#pragma unroll
        for (int v = 0; v < 2; ++v) {
          const double x = in ? static_cast<double>(acc[i][j][2 * h + v]) : 0.0;
          sum = __fma_rn(x, x, sum);
        }
      }
    }
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (w.lane == 0) s_warp[w.tid / kWarpSize] = sum;
  __syncthreads();
  double total = 0.0;
  if (w.tid == 0)
    for (int i = 0; i < kGemmThreads / kWarpSize; ++i) total += s_warp[i];
  return total;
}

// K-grouped GEMM (weight gradient): for expert e = blockIdx.y and the dw tile blockIdx.x
// (M-tile of n, N-tile of k, the latter fastest),
//   dw[e] (+)= dy[rows of e, :]^T @ x[rows of e, :],   dy: [max_rows, n], x: [max_rows, k] BF16,
// dw: [E, n, k] FP32. An expert with no rows leaves dw[e] alone (accumulate) or zeroes it.
// kSquares (overwrite only): squares[(e * ceil(n / 128) + M-tile) * ceil(k / 128) + N-tile] = the
// sum of the tile's squares (tile_square_sum; the tiles are the 128 x 128 blocks of
// core/square_blocks.h). Dynamic shared memory: kGemmPipelineBytes.
template <bool kSquares>
__global__ void __launch_bounds__(kGemmThreads, 2)
    grouped_gemm_k_contiguous(const uint16_t* __restrict__ dy, const uint16_t* __restrict__ x,
                              const int32_t* __restrict__ expert_offsets, float* __restrict__ dw, int max_rows,
                              int n, int k, bool accumulate, double* __restrict__ squares) {
  static_assert(kGemmBM == 128 && kGemmBN == 128, "square sums are kept per 128 x 128 block");
  extern __shared__ __align__(128) unsigned char gemm_smem[];
  const int e = static_cast<int>(blockIdx.y);
  int start, end;
  expert_rows(expert_offsets, e, max_rows, start, end);
  if (end == start && accumulate) return;

  const WarpPos wp = warp_pos();
  const int n_tiles = (k + kGemmBN - 1) / kGemmBN;
  const int row0 = static_cast<int>(blockIdx.x) / n_tiles * kGemmBM;  // in n
  const int col0 = static_cast<int>(blockIdx.x) % n_tiles * kGemmBN;  // in k
  const GemmOperand op_a{dy, n, start, end, row0, n};
  const GemmOperand op_b{x, k, start, end, col0, k};
  const int num_k_tiles = (end - start + kGemmBK - 1) / kGemmBK;
  GemmAcc acc;
  gemm_tile_mainloop<Major::kMN, Major::kMN>(reinterpret_cast<uint16_t*>(gemm_smem), op_a, op_b, num_k_tiles, wp,
                                             acc);
  store_tile_f32(acc, wp, dw + int64_t{e} * n * k, n, k, row0, col0, accumulate);
  if constexpr (kSquares) {
    __shared__ double s_warp[kGemmThreads / kWarpSize];
    const double total = tile_square_sum(acc, wp, n, k, row0, col0, s_warp);
    if (wp.tid == 0) squares[int64_t{e} * gridDim.x + blockIdx.x] = total;
  }
}

}  // namespace moe::cuda::kernels
