// Block-scaled FP8 grouped GEMM of the MoE experts on Hopper (sm_90a), M-grouped contiguous: for
// the rows r of expert e (the device offsets of grouped_gemm.h),
//   out[r, j] = sum over K blocks kb of ( sum_{p in kb} A[r, p] B_e[j, p] ) * sa[r, kb] * sb[e, j / 128, kb]
// with A [max_rows, K] E4M3 codes in 1 x 128 blocks (sa [max_rows, ceil(K / 128)], the quantiser's
// row-major scales), B_e [N, K] E4M3 codes in 128 x 128 blocks (sb [E, ceil(N / 128), ceil(K / 128)])
// and out [max_rows, N] BF16: the forward y = x W_e^T (B = W) and the data gradient dx = dy W_e (B =
// the transposed copy of W's codes and scales). The machinery of grouped_gemm_sm90.cuh (TMA loads
// into an mbarrier ring, one producer and two consumer warpgroups, the M-tile schedule in shared
// memory, staged TMA stores) with a 128 x 128 x 128 tile: a stage's A and B are 128 rows of 128
// one-byte codes, the same 128-byte swizzled boxes as the BF16 kernels' 64 elements. Each K block
// runs 4 wgmma.m64n128k32 (E4M3 x E4M3 -> FP32) into a partial accumulator that is then promoted:
// acc += partial * (sa * sb), per row and block, in FP32 (Hopper's FP8 tensor cores keep about 14
// mantissa bits while they add inside an instruction sequence; promoting every 128 K elements bounds
// that error, the DeepSeek-V3 recipe). Two accumulators of 64 registers each: N = 128 per warpgroup.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/kernels/grouped_gemm_sm90.cuh"

namespace moe::cuda::kernels::sm90 {

constexpr int kFp8BN = 128;                       // output columns of a tile (= the weight block)
constexpr int kFp8BK = 128;                       // K elements of a stage (= the scaling block)
constexpr int kFp8ABytes = kBM * kFp8BK;          // 16 KiB of codes
constexpr int kFp8BBytes = kFp8BN * kFp8BK;       // 16 KiB
constexpr int kFp8StageBytes = kFp8ABytes + kFp8BBytes;

// d (64 x 128 FP32) = A (64 x 32 E4M3, K-major) * B (32 x 128 E4M3, K-major) + (scale_d ? d : 0).
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, "
      "%40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// One K block of a consumer warpgroup, ring iteration `it`: waits for its stage, then issues
// part = A[rows 64 wg ..] * B over the block's 128 K elements (both operands K-major in 128-byte
// swizzled boxes; a k32 step moves the start by 32 bytes) and commits them. Returns the stage.
template <typename Ring>
__device__ __forceinline__ int fp8_issue_k_block(const Ring& sm, uint32_t it, int wg, float (&part)[64]) {
  const int s = Ring::ring_stage(it);
  mbar_wait(sm.full(s), Ring::ring_phase(it));
  const uint32_t a = sm.stage(s) + wg * (kFp8ABytes / 2), b = sm.stage(s) + kFp8ABytes;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kFp8BK / 32; ++kk) {
    wgmma_m64n128k32_e4m3(part, smem_desc(a + kk * 32, 16, 1024), smem_desc(b + kk * 32, 16, 1024), kk > 0 ? 1 : 0);
  }
  wgmma_commit();
  return s;
}

// map_a: qa [max_rows, k_red] (uint8, box 128 x kBM); map_b: qb [E, n_out, k_red] (box 128 x 128 x 1);
// map_out: out [max_rows, n_out] BF16 (box 64 x 64). Rows past an expert's end or past max_rows
// feed only output rows that are not stored (their scales read as 0 past max_rows); codes past
// k_red load as zeros. Persistent CTAs over the M-grouped tile list, N-tile fastest. Dynamic smem:
// smem_bytes(kStages, E, true, kFp8StageBytes).
template <int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_fp8_m_contiguous_sm90(const __grid_constant__ CUtensorMap map_a,
                                       const __grid_constant__ CUtensorMap map_b,
                                       const __grid_constant__ CUtensorMap map_out,
                                       const int32_t* __restrict__ expert_offsets, const float* __restrict__ sa,
                                       const float* __restrict__ sb, uint16_t* __restrict__ out, int max_rows,
                                       int num_experts, int n_out, int k_red) {
  using Ring = Smem<kStages, kFp8StageBytes>;
  extern __shared__ __align__(1024) unsigned char sm90_smem[];
  const Ring sm = setup_smem<kStages, kFp8StageBytes>(sm90_smem, expert_offsets, num_experts, max_rows, true);
  const int n_tiles = (n_out + kFp8BN - 1) / kFp8BN;
  const int64_t num_tiles = int64_t{sm.s_tile[num_experts]} * n_tiles;
  const int num_k = (k_red + kFp8BK - 1) / kFp8BK;

  if (threadIdx.x < 128) {
    if (!producer_thread(&map_a, &map_b)) return;
    uint32_t it = 0;
    for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const MTile tile = m_tile(t, n_tiles, sm.s_start, sm.s_tile, num_experts, kFp8BN);
      for (int kt = 0; kt < num_k; ++kt, ++it) {
        const int s = Ring::ring_stage(it);
        mbar_wait(sm.empty(s), Ring::ring_phase(it) ^ 1u);
        const uint32_t a = sm.stage(s), full = sm.full(s);
        mbar_arrive_expect_tx(full, kFp8StageBytes);
        tma_load_2d(a, &map_a, full, kt * kFp8BK, tile.row0);
        tma_load_3d(a + kFp8ABytes, &map_b, full, kt * kFp8BK, tile.col0, tile.expert);
      }
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int wg = static_cast<int>(threadIdx.x) / 128 - 1;  // rows 64 wg .. 64 wg + 63 of the tile
  const int warp = static_cast<int>(threadIdx.x) % 128 / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const bool leader = threadIdx.x % 128 == 0;
  const int scale_cols = num_k, weight_rows = n_tiles;
  float acc[64], part[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) part[i] = 0.0f;
  uint32_t it = 0;
  for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const MTile tile = m_tile(t, n_tiles, sm.s_start, sm.s_tile, num_experts, kFp8BN);
    // This thread's two rows of the fragment (16 warp + lane / 4, + 8) and their scale rows.
    const int row_lo = tile.row0 + wg * 64 + warp * 16 + lane / 4;
    const float* sa0 = row_lo < max_rows ? sa + int64_t{row_lo} * scale_cols : nullptr;
    const float* sa1 = row_lo + 8 < max_rows ? sa + int64_t{row_lo + 8} * scale_cols : nullptr;
    const float* sbt = sb + (int64_t{tile.expert} * weight_rows + tile.col0 / kFp8BN) * scale_cols;
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    for (int kt = 0; kt < num_k; ++kt, ++it) {
      const int s = fp8_issue_k_block(sm, it, wg, part);
      // The block's scales, loaded once its MMAs are issued (the loads cannot move above the commit):
      // their latency hides behind the MMAs instead of delaying their issue.
      const float wb = __ldg(sbt + kt);
      const float s0 = sa0 != nullptr ? __ldg(sa0 + kt) * wb : 0.0f;
      const float s1 = sa1 != nullptr ? __ldg(sa1 + kt) * wb : 0.0f;
      wgmma_wait<0>();
      fence_accumulators(part);
      if (lane == 0) mbar_arrive(sm.empty(s));
      // Promotion: the fragment's acc[4 j + 2 h + c] is row row_lo + 8 h.
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        acc[4 * j + 0] = fmaf(part[4 * j + 0], s0, acc[4 * j + 0]);
        acc[4 * j + 1] = fmaf(part[4 * j + 1], s0, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(part[4 * j + 2], s1, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(part[4 * j + 3], s1, acc[4 * j + 3]);
      }
    }

    if (tile.row0 + kBM <= tile.row_end) {
      // Whole tile inside the expert: both 64-column chunks staged at once, one buffer each (the
      // stores that last read them were issued a main loop ago), then two TMA stores clipped at
      // n_out: two warpgroup barriers a tile instead of two a chunk.
      if (leader) bulk_wait_read<0>();
      warpgroup_barrier(wg);
#pragma unroll
      for (int c = 0; c < kFp8BN / 64; ++c) stage_bf16_chunk(sm.staging(wg, c), acc, c, warp, lane);
      fence_proxy_async_shared();
      warpgroup_barrier(wg);
      if (leader) {
#pragma unroll
        for (int c = 0; c < kFp8BN / 64; ++c) {
          if (tile.col0 + 64 * c < n_out) {
            tma_store_2d(&map_out, sm.staging(wg, c), tile.col0 + 64 * c, tile.row0 + 64 * wg);
          }
        }
        bulk_commit();
      }
    } else {
      // The expert's last tile: BF16 pairs from registers, rows past its end skipped.
      store_fragment_rows_bf16(acc, out, row_lo, tile.row_end, tile.col0 + 2 * (lane % 4), n_out);
    }
  }
  if (leader) bulk_wait_all();
}

// ---- The weight gradient: K-grouped over each expert's rows ------------------------------

// A stage of the weight-gradient kernel: A and B codes (128 x 128 each, as above), then the K
// block's 128 scales of A's rows and 128 of B's (512 bytes each, by bulk copies).
constexpr int kFp8WgradScaleBytes = 128 * 4;
constexpr int kFp8WgradStageBytes = kFp8StageBytes + 2 * kFp8WgradScaleBytes;  // 33 KiB, 1 KiB aligned
static_assert(kFp8WgradStageBytes % 1024 == 0, "stages keep the 1 KiB alignment of the swizzled boxes");

// dw[e] (+)= A_e B_e^T for every expert e, both operands quantised down the expert's rows: qa_t
// [n, capacity] and qb_t [k, capacity] hold the codes of dy^T and x^T (cuda::fp8_quantize_expert_columns),
// expert e's rows in columns padded_offsets[e] .. padded_offsets[e + 1] (multiples of 128, zeros
// past its last row), sa_t [capacity / 128, n] and sb_t [capacity / 128, k] their 1 x 128 scales,
// K-block-major. For each K block kb of the expert and element (i, j):
//   dw[e][i, j] += (sum_{p in kb} qa_t[i, p] qb_t[j, p]) * (sa_t[kb, i] * sb_t[kb, j])
// promoted in FP32 per block, like the forward kernel but with a scale per output column too. Tiles
// (e, 128 rows of n, 128 columns of k), columns fastest; each consumer warpgroup 64 rows. The tile
// leaves from registers as FP32 pairs: stored (overwrite: zeros for an expert with no rows) or
// added to dw (accumulate; one add per element, each element written by one CTA). n and k multiples
// of 128. map_a: qa_t (box 128 x 128), map_b: qb_t (box 128 x 128). Dynamic smem:
// smem_bytes(kStages, 0, false, kFp8WgradStageBytes).
template <int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_fp8_wgrad_sm90(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                                const float* __restrict__ sa_t, const float* __restrict__ sb_t,
                                const int32_t* __restrict__ padded_offsets, float* __restrict__ dw, int num_experts,
                                int n, int k, bool accumulate) {
  using Ring = Smem<kStages, kFp8WgradStageBytes>;
  extern __shared__ __align__(1024) unsigned char sm90_smem[];
  const Ring sm = setup_smem<kStages, kFp8WgradStageBytes>(sm90_smem, padded_offsets, num_experts, 0, false);
  const int n_tiles = n / 128, k_tiles = k / 128;
  const int64_t num_tiles = int64_t{num_experts} * n_tiles * k_tiles;
  // The K blocks [kb0, kb1) of tile t's expert, and the tile's first row and column.
  const auto tile_of = [&](int64_t t, int& e, int& i0, int& j0, int& kb0, int& kb1) {
    e = static_cast<int>(t / (int64_t{n_tiles} * k_tiles));
    const int rest = static_cast<int>(t % (int64_t{n_tiles} * k_tiles));
    i0 = rest / k_tiles * 128;
    j0 = rest % k_tiles * 128;
    kb0 = __ldg(padded_offsets + e) / 128;
    kb1 = __ldg(padded_offsets + e + 1) / 128;
  };

  if (threadIdx.x < 128) {
    if (!producer_thread(&map_a, &map_b)) return;
    uint32_t it = 0;
    for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      int e, i0, j0, kb0, kb1;
      tile_of(t, e, i0, j0, kb0, kb1);
      for (int kb = kb0; kb < kb1; ++kb, ++it) {
        const int s = Ring::ring_stage(it);
        mbar_wait(sm.empty(s), Ring::ring_phase(it) ^ 1u);
        const uint32_t a = sm.stage(s), full = sm.full(s);
        mbar_arrive_expect_tx(full, kFp8WgradStageBytes);
        tma_load_2d(a, &map_a, full, kb * kFp8BK, i0);
        tma_load_2d(a + kFp8ABytes, &map_b, full, kb * kFp8BK, j0);
        bulk_load_1d(a + kFp8StageBytes, sa_t + int64_t{kb} * n + i0, kFp8WgradScaleBytes, full);
        bulk_load_1d(a + kFp8StageBytes + kFp8WgradScaleBytes, sb_t + int64_t{kb} * k + j0, kFp8WgradScaleBytes,
                     full);
      }
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int wg = static_cast<int>(threadIdx.x) / 128 - 1;  // rows 64 wg .. 64 wg + 63 of the tile
  const int warp = static_cast<int>(threadIdx.x) % 128 / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int row_in_tile = wg * 64 + warp * 16 + lane / 4;  // this thread's rows: it and it + 8
  const int col_in_tile = 2 * (lane % 4);                   // its columns: 8 jj + col_in_tile + {0, 1}
  float acc[64], part[64];
  uint32_t it = 0;
  for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    int e, i0, j0, kb0, kb1;
    tile_of(t, e, i0, j0, kb0, kb1);
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    for (int kb = kb0; kb < kb1; ++kb, ++it) {
      const int s = fp8_issue_k_block(sm, it, wg, part);
      const float* scales = reinterpret_cast<const float*>(sm.ring + s * kFp8WgradStageBytes + kFp8StageBytes);
      const float s0 = scales[row_in_tile], s1 = scales[row_in_tile + 8];
      const float2* sb = reinterpret_cast<const float2*>(scales + 128 + col_in_tile);
      wgmma_wait<0>();
      fence_accumulators(part);
      // Promotion: acc[4 jj + 2 h + c] is row row_in_tile + 8 h, column 8 jj + col_in_tile + c.
#pragma unroll
      for (int jj = 0; jj < 16; ++jj) {
        const float2 w = sb[4 * jj];  // columns 8 jj + col_in_tile, + 1
        acc[4 * jj + 0] = fmaf(part[4 * jj + 0], s0 * w.x, acc[4 * jj + 0]);
        acc[4 * jj + 1] = fmaf(part[4 * jj + 1], s0 * w.y, acc[4 * jj + 1]);
        acc[4 * jj + 2] = fmaf(part[4 * jj + 2], s1 * w.x, acc[4 * jj + 2]);
        acc[4 * jj + 3] = fmaf(part[4 * jj + 3], s1 * w.y, acc[4 * jj + 3]);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(sm.empty(s));  // the stage's scales are read too
    }
    if (accumulate && kb1 == kb0) continue;  // an expert with no rows adds nothing
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* row = dw + (int64_t{e} * n + i0 + row_in_tile + 8 * h) * k + j0 + col_in_tile;
#pragma unroll
      for (int jj = 0; jj < 16; ++jj) {
        float2 v = make_float2(acc[4 * jj + 2 * h], acc[4 * jj + 2 * h + 1]);
        if (accumulate) {
          const float2 old = *reinterpret_cast<const float2*>(row + 8 * jj);
          v = make_float2(old.x + v.x, old.y + v.y);
        }
        *reinterpret_cast<float2*>(row + 8 * jj) = v;
      }
    }
  }
}

}  // namespace moe::cuda::kernels::sm90
