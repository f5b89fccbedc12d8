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
//
// kCluster = 2: CTA pairs (a 2 x 1 thread-block cluster) take the two N tiles of one M tile side by
// side, so both need the same 128 rows of A: each CTA's producer loads 64 of them and multicasts
// them into the same stage of both CTAs, and loads its own B. A CTA then reads 24 KiB of a stage's
// 32 KiB from L2 instead of 32. A stage is released to both producers: each consumer warp arrives
// on its own CTA's empty barrier and on the peer's (16 arrivals a phase); a producer leaves only
// once its stages' last uses are released, so no arrival reaches a CTA that has gone.
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
// Each consumer thread's scales of a K block (the weight block's, its two rows'), copied
// asynchronously one block ahead into two 16-byte slots: [slot][consumer thread].
constexpr int kFp8ScaleSlotBytes = 2 * kConsumerThreads * 16;

// Dynamic shared memory of the FP8 kernel: the BF16 kernels' layout with its stages, then the
// scale slots (16-byte aligned).
__host__ __device__ constexpr int64_t fp8_smem_bytes(int stages, int64_t num_experts) {
  return smem_bytes(stages, num_experts, true, kFp8StageBytes) + 16 + kFp8ScaleSlotBytes;
}

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

// ---- Thread-block clusters ----------------------------------------------------------------

__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// Every thread of the cluster that has not exited arrives and waits (shared-memory writes before
// it, barrier initialisations included, are visible to the cluster after it).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// One arrival on the barrier at the same shared-memory offset in CTA `cta` of the cluster, with the
// default (CTA-scope) release: the arriving warp's shared-memory reads (its finished wgmmas) are
// all that the peer's refill must follow. A cluster-scope release here (.release.cluster) halved
// the kernel's rate (docs/benchmarks.md).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(cta));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}

// tma_load_2d into the same offset of every CTA in cta_mask, each completing on its own barrier at
// bar's offset.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0,
                                                      int c1, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, "
      "{%3, %4}], [%2], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

// 4 bytes global -> shared without holding a register: bytes past src_bytes (0 or 4) land as zeros.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// One K block of a consumer warpgroup: part = A[its 64 rows] * B over the block's 128 K elements,
// both operands K-major in 128-byte swizzled boxes; a k32 step moves the start by 32 bytes.
__device__ __forceinline__ void fp8_mma_k_block(float (&part)[64], uint32_t a, uint32_t b) {
#pragma unroll
  for (int kk = 0; kk < kFp8BK / 32; ++kk) {
    wgmma_m64n128k32_e4m3(part, smem_desc(a + kk * 32, 16, 1024), smem_desc(b + kk * 32, 16, 1024), kk > 0 ? 1 : 0);
  }
}

// map_a: qa [max_rows, k_red] (uint8, box 128 x kBM, or 128 x kBM / 2 with kCluster = 2); map_b: qb
// [E, n_out, k_red] (box 128 x 128 x 1); map_out: out [max_rows, n_out] BF16 (box 64 x 64). Rows
// past an expert's end or past max_rows feed only output rows that are not stored (their scales
// read as 0 past max_rows); codes past k_red load as zeros. Persistent CTAs over the M-grouped tile
// list, N-tile fastest (with kCluster = 2: clusters over the list of N-tile pairs, n_out / 128
// even, gridDim.x even). kVariant (Fp8KernelVariant): 0 the scales loaded in each K block and the
// tile staged for TMA stores; 1 the scales copied into shared memory one K block ahead (cp.async);
// 2 that, and the tile stored straight from registers (BF16 pairs, rows past the expert's end
// skipped). Dynamic smem: fp8_smem_bytes(kStages, E).
template <int kStages, int kCluster, int kVariant>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_fp8_m_contiguous_sm90(const __grid_constant__ CUtensorMap map_a,
                                       const __grid_constant__ CUtensorMap map_b,
                                       const __grid_constant__ CUtensorMap map_out,
                                       const int32_t* __restrict__ expert_offsets, const float* __restrict__ sa,
                                       const float* __restrict__ sb, uint16_t* __restrict__ out, int max_rows,
                                       int num_experts, int n_out, int k_red) {
  static_assert(kCluster == 1 || kCluster == 2, "CTA pairs at most");
  static_assert(kVariant >= 0 && kVariant <= 2, "kernel variants 0, 1, 2");
  constexpr bool kAsyncScales = kVariant >= 1, kDirectStore = kVariant == 2;
  using Ring = Smem<kStages, kFp8StageBytes>;
  extern __shared__ __align__(1024) unsigned char sm90_smem[];
  const Ring sm = setup_smem<kStages, kFp8StageBytes>(sm90_smem, expert_offsets, num_experts, max_rows, true,
                                                      kCluster * kConsumerWarps);
  const int n_tiles = (n_out + kFp8BN - 1) / kFp8BN;
  const int64_t num_tiles = int64_t{sm.s_tile[num_experts]} * n_tiles;
  const int num_k = (k_red + kFp8BK - 1) / kFp8BK;
  // This CTA's tiles: t = first, first + step, ... below num_tiles. A pair's CTA `rank` takes
  // N-tile 2 q + rank of its cluster's pair q (the pairs' list: M-tile major).
  const uint32_t rank = kCluster == 2 ? cluster_cta_rank() : 0u;
  const int64_t num_units = num_tiles / kCluster, unit_step = gridDim.x / kCluster;
  const int64_t first_unit = blockIdx.x / kCluster;
  const auto tile_of = [&](int64_t u) { return u * kCluster + rank; };  // n_tiles even: pairs stay in an M-tile
  if constexpr (kCluster == 2) cluster_sync();  // the peer's barriers are initialised before any multicast

  if (threadIdx.x < 128) {
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x != 0) return;
    prefetch_tensor_map(&map_a);
    prefetch_tensor_map(&map_b);
    uint32_t it = 0;
    for (int64_t u = first_unit; u < num_units; u += unit_step) {
      const MTile tile = m_tile(tile_of(u), n_tiles, sm.s_start, sm.s_tile, num_experts, kFp8BN);
      for (int kt = 0; kt < num_k; ++kt, ++it) {
        const int s = Ring::ring_stage(it);
        mbar_wait(sm.empty(s), Ring::ring_phase(it) ^ 1u);  // with kCluster = 2: free in both CTAs
        const uint32_t a = sm.stage(s), full = sm.full(s);
        mbar_arrive_expect_tx(full, kFp8StageBytes);  // the peer's half of A counts here too
        if constexpr (kCluster == 2) {
          tma_load_2d_multicast(a + rank * (kFp8ABytes / 2), &map_a, full, kt * kFp8BK,
                                tile.row0 + static_cast<int>(rank) * (kBM / 2), 0b11);
        } else {
          tma_load_2d(a, &map_a, full, kt * kFp8BK, tile.row0);
        }
        tma_load_3d(a + kFp8ABytes, &map_b, full, kt * kFp8BK, tile.col0, tile.expert);
      }
    }
    if constexpr (kCluster == 2) {
      // The peer's consumers arrive on this CTA's empty barriers until they are done: the CTA stays
      // until every stage's last use has been released (by both CTAs), as a refill would wait.
      for (uint32_t i = it; i < it + kStages; ++i) mbar_wait(sm.empty(Ring::ring_stage(i)), Ring::ring_phase(i) ^ 1u);
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int wg = static_cast<int>(threadIdx.x) / 128 - 1;  // rows 64 wg .. 64 wg + 63 of the tile
  const int warp = static_cast<int>(threadIdx.x) % 128 / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const bool leader = threadIdx.x % 128 == 0;
  const int scale_cols = num_k, weight_rows = n_tiles;
  const int ctid = static_cast<int>(threadIdx.x) - 128;
  // kAsyncScales: the scales of K block kt reach this thread's slot it % 2 by an asynchronous copy
  // issued during block kt - 1 (or the tile before). Otherwise they are read from global memory in
  // the block itself, where the product stalls the warp on their latency before its MMAs issue.
  const uint32_t scale_slots = (smem_u32(sm.s_tile + num_experts + 1) + 15u) & ~15u;
  const auto issue_scales = [&](const MTile& t, int kt, uint32_t slot) {
    const int r = t.row0 + wg * 64 + warp * 16 + lane / 4;  // this thread's rows r and r + 8
    const uint32_t dst = scale_slots + slot * (kConsumerThreads * 16) + ctid * 16;
    cp_async_4(dst, sb + (int64_t{t.expert} * weight_rows + t.col0 / kFp8BN) * scale_cols + kt, 4u);
    cp_async_4(dst + 4, sa + int64_t{min(r, max_rows - 1)} * scale_cols + kt, r < max_rows ? 4u : 0u);
    cp_async_4(dst + 8, sa + int64_t{min(r + 8, max_rows - 1)} * scale_cols + kt, r + 8 < max_rows ? 4u : 0u);
    cp_async_commit();
  };
  const auto* slots = reinterpret_cast<const float4*>(sm.ring + (scale_slots - sm.ring_u32));
  float acc[64], part[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) part[i] = 0.0f;
  uint32_t it = 0;
  if constexpr (kAsyncScales) {
    if (first_unit < num_units && num_k > 0) {
      issue_scales(m_tile(tile_of(first_unit), n_tiles, sm.s_start, sm.s_tile, num_experts, kFp8BN), 0, 0u);
    }
  }
  for (int64_t u = first_unit; u < num_units; u += unit_step) {
    const MTile tile = m_tile(tile_of(u), n_tiles, sm.s_start, sm.s_tile, num_experts, kFp8BN);
    // This thread's two rows of the fragment (16 warp + lane / 4, + 8) and their scale rows.
    const int row_lo = tile.row0 + wg * 64 + warp * 16 + lane / 4;
    const float* sa0 = row_lo < max_rows ? sa + int64_t{row_lo} * scale_cols : nullptr;
    const float* sa1 = row_lo + 8 < max_rows ? sa + int64_t{row_lo + 8} * scale_cols : nullptr;
    const float* sbt = sb + (int64_t{tile.expert} * weight_rows + tile.col0 / kFp8BN) * scale_cols;
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    for (int kt = 0; kt < num_k; ++kt, ++it) {
      float s0, s1;  // the promotion's factors of this thread's two rows
      if constexpr (kAsyncScales) {
        cp_async_wait_all();
        const float4 sc = slots[(it & 1u) * kConsumerThreads + ctid];  // (weight, row r, row r + 8, -)
        if (kt + 1 < num_k) {
          issue_scales(tile, kt + 1, (it + 1) & 1u);
        } else if (u + unit_step < num_units) {
          issue_scales(m_tile(tile_of(u + unit_step), n_tiles, sm.s_start, sm.s_tile, num_experts, kFp8BN), 0,
                       (it + 1) & 1u);
        }
        s0 = sc.y * sc.x;
        s1 = sc.z * sc.x;
      } else {
        const float wb = __ldg(sbt + kt);
        s0 = sa0 != nullptr ? __ldg(sa0 + kt) * wb : 0.0f;
        s1 = sa1 != nullptr ? __ldg(sa1 + kt) * wb : 0.0f;
      }
      const int s = Ring::ring_stage(it);
      mbar_wait(sm.full(s), Ring::ring_phase(it));
      const uint32_t a = sm.stage(s) + wg * (kFp8ABytes / 2), b = sm.stage(s) + kFp8ABytes;
      wgmma_fence();
      fp8_mma_k_block(part, a, b);
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulators(part);
      if (lane == 0) {
        mbar_arrive(sm.empty(s));
        if constexpr (kCluster == 2) mbar_arrive_cluster(sm.empty(s), rank ^ 1u);
      }
      // Promotion: the fragment's acc[4 j + 2 h + c] is row row_lo + 8 h.
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        acc[4 * j + 0] = fmaf(part[4 * j + 0], s0, acc[4 * j + 0]);
        acc[4 * j + 1] = fmaf(part[4 * j + 1], s0, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(part[4 * j + 2], s1, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(part[4 * j + 3], s1, acc[4 * j + 3]);
      }
    }

    if (!kDirectStore && tile.row0 + kBM <= tile.row_end) {
      // Whole tile inside the expert: 2 staged chunks of 64 columns, TMA stores (clipped at n_out).
#pragma unroll
      for (int c = 0; c < kFp8BN / 64; ++c) {
        if (tile.col0 + 64 * c >= n_out) break;
        staged_store(
            sm.staging(wg, c % 2), wg, leader, [&](uint32_t buf) { stage_bf16_chunk(buf, acc, c, warp, lane); },
            [&](uint32_t buf) { tma_store_2d(&map_out, buf, tile.col0 + 64 * c, tile.row0 + 64 * wg); });
      }
    } else {
      // The expert's last tile (or every tile with kDirectStore): BF16 pairs from registers, rows
      // past the expert's end skipped.
      store_fragment_rows_bf16(acc, out, row_lo, tile.row_end, tile.col0 + 2 * (lane % 4), n_out);
    }
  }
  if (leader) bulk_wait_all();
}

}  // namespace moe::cuda::kernels::sm90
