// Grouped BF16 GEMMs of the MoE experts on Hopper (sm_90a): the contracts of grouped_gemm.cuh
// (forward Y = X W[e]^T and dgrad dX = dY W[e] M-grouped, wgrad dW[e] (+)= dY_e^T X_e K-grouped)
// through TMA tile loads (cp.async.bulk.tensor, 128-byte swizzle) into an mbarrier ring of 3-4
// stages and wgmma.mma_async m64n256k16 (BF16 x BF16 -> FP32 registers) from shared memory.
// CTA = 1 producer warpgroup (one thread issues the copies) + 2 consumer warpgroups (64 rows each
// of a 128 x 256 tile); persistent CTAs walk the tile list; epilogues stage 64-row chunks in
// shared memory for TMA stores. Operand tiles are [rows][64 elements] boxes of 128-byte rows.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/kernels/sm90_sync.cuh"
#include "cuda/kernels/vec.cuh"

namespace moe::cuda::kernels::sm90 {

// CTA tile kBM x kBN x kBK; every operand tile is made of 64 x 64 BF16 boxes of 8 KiB (64 rows of
// 128 bytes, the TMA's 128-byte swizzle span), except that K-major tiles come as one box of
// 128 or 256 rows (the same bytes as 2 or 4 such boxes stacked).
constexpr int kBM = 128;
constexpr int kBN = 256;
constexpr int kBK = 64;
constexpr int kThreads = 384;                       // warpgroup 0 produces, 1 and 2 consume
constexpr int kConsumerThreads = 256;
constexpr int kBoxBytes = 64 * 64 * 2;              // 8 KiB
constexpr int kABytes = kBM * kBK * 2;              // 16 KiB: 2 boxes
constexpr int kBBytes = kBN * kBK * 2;              // 32 KiB: 4 boxes
constexpr int kStageBytes = kABytes + kBBytes;      // 48 KiB, the bytes each stage's TMA delivers
constexpr int kStagingBytes = 2 * 2 * kBoxBytes;    // epilogue: 2 buffers of 64 rows x 128 B per consumer
constexpr int kSmemAlign = 1024;                    // 128-byte swizzle atoms are 8 rows = 1 KiB
constexpr int kProducerRegs = 40;                   // setmaxnreg budgets: 128 x 40 + 256 x 232 <= 64 Ki
constexpr int kConsumerRegs = 232;
constexpr int kConsumerWarps = kConsumerThreads / kWarpSize;

// Dynamic shared memory for kStages ring stages: alignment slack, the ring, the epilogue staging,
// the full/empty barriers and, for the M-grouped kernels (schedule), the per-expert row starts
// and M-tile prefix sums (E + 1 ints each).
// stage_bytes: the ring stage's size (kStageBytes for the BF16 kernels).
__host__ __device__ constexpr int64_t smem_bytes(int stages, int64_t num_experts, bool schedule,
                                                 int64_t stage_bytes = kStageBytes) {
  return kSmemAlign + int64_t{stages} * stage_bytes + kStagingBytes + 16 * stages +
         (schedule ? 2 * (num_experts + 1) * 4 : 0);
}

// ---- PTX wrappers --------------------------------------------------------------------------

// TMA tile loads global -> shared completing on `bar` (coordinates innermost first, in elements;
// out-of-bounds elements land as zeros and still count towards the transaction bytes).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Generic-proxy shared-memory writes made visible to the async proxy (TMA, wgmma).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Barrier 1 over the two consumer warpgroups (barrier 0 is __syncthreads).
__device__ __forceinline__ void consumer_barrier() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerThreads) : "memory");
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// The producer warpgroup's entry (threads 0 .. 127): its registers handed to the consumers, and
// one thread kept to issue the loads, which prefetches the two tensor maps. False for the threads
// that leave (the caller returns for them).
__device__ __forceinline__ bool producer_thread(const CUtensorMap* map_a, const CUtensorMap* map_b) {
  setmaxnreg_dec<kProducerRegs>();
  if (threadIdx.x != 0) return false;
  prefetch_tensor_map(map_a);
  prefetch_tensor_map(map_b);
  return true;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading- and stride-dimension
// byte offsets (each >> 4 in its 14-bit field). K-major tiles ([rows][64 k] boxes): the stride is
// 1 KiB between 8-row groups, the leading offset unused (1); a k16 step moves the start by 32 B.
// MN-major tiles ([64 k rows][64 m or n] boxes): the leading offset is the 8 KiB between boxes
// along M/N, the stride 1 KiB between groups of 8 k rows; a k16 step moves the start by 2 KiB.
// Every box starts on a 1 KiB boundary, so the base-offset field stays 0.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(lbo_bytes >> 4) << 16) |
         (static_cast<uint64_t>(sbo_bytes >> 4) << 32) | (uint64_t{1} << 62);
}

// d (64 x 256 FP32, this warpgroup's fragment) = A (64 x 16) * B (16 x 256) + (scale_d ? d : 0).
// kTransA / kTransB: 0 for K-major, 1 for MN-major operands in shared memory.
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, "
      "%40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, "
      "%72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, "
      "%88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, "
      "%104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, "
      "%120, %121, %122, %123, %124, %125, %126, %127},"
      " %128, %129, p, 1, 1, %131, %132;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
      "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
      "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
      "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
      "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
      "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
      "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
      "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
}

// TMA stores shared -> global (out-of-bounds elements are not written), grouped per thread:
// commit closes a group; wait_read<N> returns once at most N groups still read shared memory.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

// dst (global, through the tensor map) += the box at src, element by element in L2 (FP32 add,
// round to nearest), asynchronous like tma_store_3d and completed by the same bulk-group waits.
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2) {
  asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Asks the TMA unit to bring a box of the tensor into L2 (a hint; nothing waits for it).
__device__ __forceinline__ void tma_prefetch_3d(const CUtensorMap* map, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ void st_shared_v2_f32(uint32_t addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
}

// Barrier 2 + wg over the 128 threads of consumer warpgroup wg.
__device__ __forceinline__ void warpgroup_barrier(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across a wgmma wait.
template <int kN>
__device__ __forceinline__ void fence_accumulators(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// ---- Schedule ------------------------------------------------------------------------------

// s_start[e] = clamp(offsets[e], 0, max_rows) for e in [0, E]; expert e owns the rows
// [s_start[e], expert_end(s_start, e)), the clamped ranges of grouped_gemm.cuh's expert_rows().
// With m_tiles, warp 0 then fills s_tile[0..E] with the exclusive prefix sum of the experts'
// M-tile counts ceil(rows_e / kBM). Ends with a block barrier.
__device__ __forceinline__ int expert_end(const int* s_start, int e) { return max(s_start[e + 1], s_start[e]); }

__device__ __forceinline__ void build_schedule(const int32_t* __restrict__ offsets, int num_experts, int max_rows,
                                               int* s_start, int* s_tile, bool m_tiles) {
  for (int e = static_cast<int>(threadIdx.x); e <= num_experts; e += static_cast<int>(blockDim.x)) {
    s_start[e] = min(max(offsets[e], 0), max_rows);
  }
  __syncthreads();
  if (m_tiles && threadIdx.x < kWarpSize) {
    const int lane = static_cast<int>(threadIdx.x);
    const int per_lane = (num_experts + kWarpSize - 1) / kWarpSize;
    const int lo = min(lane * per_lane, num_experts);
    const int hi = min(lo + per_lane, num_experts);
    int sum = 0;  // this lane's experts, in order
    for (int e = lo; e < hi; ++e) {
      sum += (expert_end(s_start, e) - s_start[e] + kBM - 1) / kBM;
      s_tile[e + 1] = sum;
    }
    int inclusive = sum;
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

// One output tile of the M-grouped GEMM: expert, first row, end of the expert's rows, first column.
struct MTile {
  int expert, row0, row_end, col0;
};

// Tile t of the M-grouped list: M-tile t / n_tiles (found by binary search over the prefix sums:
// the largest e with s_tile[e] <= mt, an expert with rows), N-tile t % n_tiles of bn columns.
__device__ __forceinline__ MTile m_tile(int64_t t, int n_tiles, const int* s_start, const int* s_tile,
                                        int num_experts, int bn = kBN) {
  const int mt = static_cast<int>(t / n_tiles);
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (s_tile[mid] <= mt) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return {lo, s_start[lo] + (mt - s_tile[lo]) * kBM, expert_end(s_start, lo), static_cast<int>(t % n_tiles) * bn};
}

// Shared-memory layout of both kernels: the 1 KiB-aligned ring (stage s: A at s * kStageBytes,
// B kABytes later), the epilogue staging (consumer warpgroup w, buffer b: 8 KiB at (2 w + b) *
// kBoxBytes), full[s] and empty[s] barriers, then the M-grouped schedule. kStage: the bytes of a
// ring stage (kStageBytes for the BF16 kernels).
template <int kStages, int kStage = kStageBytes>
struct Smem {
  static constexpr int kRingBytes = kStages * kStage;
  unsigned char* ring;  // generic pointer to the aligned ring
  uint32_t ring_u32;    // its shared-window address
  int* s_start;
  int* s_tile;
  __device__ __forceinline__ uint32_t stage(int s) const { return ring_u32 + s * kStage; }
  __device__ __forceinline__ uint32_t staging(int wg, int b) const {
    return ring_u32 + kRingBytes + (2 * wg + b) * kBoxBytes;
  }
  __device__ __forceinline__ uint32_t full(int s) const { return ring_u32 + kRingBytes + kStagingBytes + 8 * s; }
  __device__ __forceinline__ uint32_t empty(int s) const {
    return ring_u32 + kRingBytes + kStagingBytes + 8 * (kStages + s);
  }
  // Pipeline position of the it-th k-step a CTA handles (producer and consumers count alike).
  static __device__ __forceinline__ int ring_stage(uint32_t it) { return static_cast<int>(it % kStages); }
  static __device__ __forceinline__ uint32_t ring_phase(uint32_t it) { return (it / kStages) & 1u; }
};

// Aligns the dynamic shared memory, initialises the barriers (full: one arrival, the producer's,
// plus the TMA bytes; empty: one arrival per consumer warp) and, with `schedule`, builds the
// M-grouped schedule. Ends with a block barrier.
template <int kStages, int kStage = kStageBytes>
__device__ __forceinline__ Smem<kStages, kStage> setup_smem(unsigned char* raw, const int32_t* __restrict__ offsets,
                                                            int num_experts, int max_rows, bool schedule) {
  const uint32_t raw_u32 = smem_u32(raw);
  const uint32_t aligned = (raw_u32 + kSmemAlign - 1) & ~static_cast<uint32_t>(kSmemAlign - 1);
  Smem<kStages, kStage> s;
  s.ring = raw + (aligned - raw_u32);
  s.ring_u32 = aligned;
  s.s_start = reinterpret_cast<int*>(s.ring + Smem<kStages, kStage>::kRingBytes + kStagingBytes + 16 * kStages);
  s.s_tile = s.s_start + num_experts + 1;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      mbar_init(s.full(i), 1);
      mbar_init(s.empty(i), kConsumerWarps);
    }
    fence_barrier_init();
  }
  if (schedule) {
    build_schedule(offsets, num_experts, max_rows, s.s_start, s.s_tile, true);
  } else {
    __syncthreads();
  }
  return s;
}

// One k-step (kBK = 4 x k16) of a consumer warpgroup: acc (+)= A[64 rows of this warpgroup] * B.
// a, b: shared addresses of this warpgroup's A box and of the B tile in the stage.
template <int kTransA, int kTransB>
__device__ __forceinline__ void mma_k_step(float (&acc)[128], uint32_t a, uint32_t b, bool accumulate) {
#pragma unroll
  for (int kk = 0; kk < kBK / 16; ++kk) {
    const uint64_t da = kTransA ? smem_desc(a + kk * 2048, kBoxBytes, 1024) : smem_desc(a + kk * 32, 16, 1024);
    const uint64_t db = kTransB ? smem_desc(b + kk * 2048, kBoxBytes, 1024) : smem_desc(b + kk * 32, 16, 1024);
    wgmma_m64n256k16<kTransA, kTransB>(acc, da, db, (accumulate || kk > 0) ? 1 : 0);
  }
}

// ---- Kernels -------------------------------------------------------------------------------

// Fragment of the 64 x 256 accumulator of a consumer warpgroup: thread (warp w4, lane) holds
// rows 16 w4 + lane / 4 (+ 8 for h = 1) and columns 8 j + 2 (lane % 4) + {0, 1}, j in [0, 32),
// as acc[4 j + 2 h + {0, 1}].

// Staged epilogue chunks: 64 rows x 128 bytes in a 128-byte-swizzled 8 KiB buffer (16-byte unit
// u of row r at unit u ^ (r % 8)), the layout the output tensor map's TMA store reads; the
// stores of a warp then hit 32 different banks. BF16 chunk c = columns [64 c, 64 c + 64) of the
// warpgroup's 64 x 256 fragment, FP32 chunk c = columns [32 c, 32 c + 32).
template <int kN>
__device__ __forceinline__ void stage_bf16_chunk(uint32_t buf, const float (&acc)[kN], int c, int warp, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp * 16 + lane / 4 + 8 * h;  // r % 8 == lane / 4
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const int j = 8 * c + jj;
      const uint32_t packed = static_cast<uint32_t>(f32_to_bf16_bits(acc[4 * j + 2 * h])) |
                              (static_cast<uint32_t>(f32_to_bf16_bits(acc[4 * j + 2 * h + 1])) << 16);
      st_shared_b32(buf + r * 128 + ((jj ^ (lane / 4)) << 4) + 4 * (lane % 4), packed);
    }
  }
}

__device__ __forceinline__ void stage_f32_chunk(uint32_t buf, const float (&acc)[128], int c, int warp, int lane,
                                                bool zero) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp * 16 + lane / 4 + 8 * h;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int j = 4 * c + jj;
      const int unit = 2 * jj + (lane % 4) / 2;
      st_shared_v2_f32(buf + r * 128 + ((unit ^ (lane / 4)) << 4) + 8 * (lane % 2), zero ? 0.0f : acc[4 * j + 2 * h],
                       zero ? 0.0f : acc[4 * j + 2 * h + 1]);
    }
  }
}

// A consumer warpgroup's fragment (kN accumulators: 64 rows x 2 kN columns) stored from registers
// as BF16 pairs: this thread's rows row_lo and row_lo + 8 (those below row_end), columns col_lo +
// 8 j + {0, 1} (those below n_out; n_out is a multiple of 8 and columns come in even pairs). The
// store of an expert's last, partial M tile.
template <int kN>
__device__ __forceinline__ void store_fragment_rows_bf16(const float (&acc)[kN], uint16_t* __restrict__ out,
                                                         int row_lo, int row_end, int col_lo, int n_out) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row_lo + 8 * h;
    if (row >= row_end) continue;
    uint16_t* orow = out + int64_t{row} * n_out;
#pragma unroll
    for (int j = 0; j < kN / 4; ++j) {
      const int col = col_lo + 8 * j;
      if (col >= n_out) continue;
      const uint32_t packed = static_cast<uint32_t>(f32_to_bf16_bits(acc[4 * j + 2 * h])) |
                              (static_cast<uint32_t>(f32_to_bf16_bits(acc[4 * j + 2 * h + 1])) << 16);
      *reinterpret_cast<uint32_t*>(orow + col) = packed;
    }
  }
}

// Hands chunk `c` of a consumer warpgroup's fragment to the TMA: waits until the store that last
// used buffer c % 2 has read it, fills it (stage(buf)), makes it visible to the async proxy and
// lets the leader issue store(buf). Two buffers: filling one overlaps the other's store.
template <typename Stage, typename Store>
__device__ __forceinline__ void staged_store(uint32_t buf, int wg, bool leader, Stage&& stage, Store&& store) {
  if (leader) bulk_wait_read<1>();
  warpgroup_barrier(wg);
  stage(buf);
  fence_proxy_async_shared();
  warpgroup_barrier(wg);
  if (leader) {
    store(buf);
    bulk_commit();
  }
}

// M-grouped contiguous GEMM (same contract as grouped_gemm_m_contiguous): for the rows r of expert e,
//   out[r, :] = a[r, :] @ B_e;  kBMn = false (forward): map_b over w [E, n_out, k_red] (B K-major);
//   kBMn = true (dgrad): map_b over w [E, k_red, n_out] (B MN-major).
// map_a: a [max_rows, k_red], box 64 x kBM; map_b: box 64 x kBN x 1 (forward), 64 x 64 x 1 (dgrad);
// map_out: out [max_rows, n_out], box 64 x 64. A tile reads rows past its expert's end (another
// expert's, the unused tail, or zeros past max_rows): they only feed output rows that are not
// stored. Columns past k_red read as zeros. Tiles whose 128 rows all belong to the expert leave
// through TMA stores (which clip columns past n_out); an expert's last, partial tile is stored
// from registers with the rows past its end skipped. Persistent: CTA b takes tiles b,
// b + gridDim.x, ... (N-tile fastest). Dynamic smem: smem_bytes(kStages, E, true).
template <bool kBMn, int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_m_contiguous_sm90(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                                   const __grid_constant__ CUtensorMap map_out,
                                   const int32_t* __restrict__ expert_offsets, uint16_t* __restrict__ out,
                                   int max_rows, int num_experts, int n_out, int k_red) {
  using Ring = Smem<kStages>;
  extern __shared__ __align__(1024) unsigned char sm90_smem[];
  const Ring sm = setup_smem<kStages>(sm90_smem, expert_offsets, num_experts, max_rows, true);
  const int n_tiles = (n_out + kBN - 1) / kBN;
  const int64_t num_tiles = int64_t{sm.s_tile[num_experts]} * n_tiles;
  const int num_k = (k_red + kBK - 1) / kBK;

  if (threadIdx.x < 128) {
    if (!producer_thread(&map_a, &map_b)) return;
    uint32_t it = 0;
    for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const MTile tile = m_tile(t, n_tiles, sm.s_start, sm.s_tile, num_experts);
      for (int kt = 0; kt < num_k; ++kt, ++it) {
        const int s = Ring::ring_stage(it);
        mbar_wait(sm.empty(s), Ring::ring_phase(it) ^ 1u);
        const uint32_t a = sm.stage(s), b = a + kABytes, full = sm.full(s);
        mbar_arrive_expect_tx(full, kStageBytes);
        tma_load_2d(a, &map_a, full, kt * kBK, tile.row0);
        if constexpr (!kBMn) {
          tma_load_3d(b, &map_b, full, kt * kBK, tile.col0, tile.expert);
        } else {
#pragma unroll
          for (int j = 0; j < kBN / 64; ++j) {
            tma_load_3d(b + j * kBoxBytes, &map_b, full, tile.col0 + 64 * j, kt * kBK, tile.expert);
          }
        }
      }
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int wg = static_cast<int>(threadIdx.x) / 128 - 1;  // rows 64 wg .. 64 wg + 63 of the tile
  const int warp = static_cast<int>(threadIdx.x) % 128 / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const bool leader = threadIdx.x % 128 == 0;
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
  uint32_t it = 0;
  for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const MTile tile = m_tile(t, n_tiles, sm.s_start, sm.s_tile, num_experts);
    for (int kt = 0; kt < num_k; ++kt, ++it) {
      const int s = Ring::ring_stage(it);
      mbar_wait(sm.full(s), Ring::ring_phase(it));
      const uint32_t a = sm.stage(s) + wg * kBoxBytes, b = sm.stage(s) + kABytes;
      wgmma_fence();
      mma_k_step<0, kBMn ? 1 : 0>(acc, a, b, kt > 0);
      wgmma_commit();
      wgmma_wait<1>();  // the previous k-step's MMAs are done: release its stage
      if (kt > 0 && lane == 0) mbar_arrive(sm.empty(Ring::ring_stage(it - 1)));
    }
    wgmma_wait<0>();
    fence_accumulators(acc);
    if (lane == 0) mbar_arrive(sm.empty(Ring::ring_stage(it - 1)));

    if (tile.row0 + kBM <= tile.row_end) {
      // Whole tile inside the expert: 4 staged chunks of 64 columns, TMA stores (clipped at n_out).
#pragma unroll
      for (int c = 0; c < kBN / 64; ++c) {
        if (tile.col0 + 64 * c >= n_out) break;
        staged_store(
            sm.staging(wg, c % 2), wg, leader, [&](uint32_t buf) { stage_bf16_chunk(buf, acc, c, warp, lane); },
            [&](uint32_t buf) { tma_store_2d(&map_out, buf, tile.col0 + 64 * c, tile.row0 + 64 * wg); });
      }
    } else {
      // The expert's last tile: BF16 pairs straight from registers, rows past its end skipped.
      store_fragment_rows_bf16(acc, out, tile.row0 + wg * 64 + warp * 16 + lane / 4, tile.row_end,
                               tile.col0 + 2 * (lane % 4), n_out);
    }
  }
  if (leader) bulk_wait_all();
}

// Zeroes rows [valid, kBK) of the 6 boxes of a stage (A: 2, B: 4; MN-major, one k row = 128 B),
// so that the rows past the expert's end add nothing; then makes the writes visible to wgmma and
// waits for both consumer warpgroups. ctid: the thread's index among the consumers.
__device__ __forceinline__ void zero_stage_tail(unsigned char* stage, int valid, int ctid) {
  constexpr int kBoxes = kStageBytes / kBoxBytes;
  constexpr int kChunks = kStageBytes / 16;  // every 16-byte chunk of the stage, kChunks / 256 per thread
  const int chunks_per_box = (kBK - valid) * 8;
#pragma unroll
  for (int i = 0; i < kChunks / kConsumerThreads; ++i) {
    const int c = i * kConsumerThreads + ctid;
    const int box = c / chunks_per_box, rem = c % chunks_per_box;
    if (box < kBoxes) {
      *reinterpret_cast<uint4*>(stage + box * kBoxBytes + (valid + rem / 8) * 128 + (rem % 8) * 16) =
          make_uint4(0u, 0u, 0u, 0u);
    }
  }
  fence_proxy_async_shared();
  consumer_barrier();
}

// The rows [start, end) of expert e, clamped as expert_rows() in grouped_gemm.cuh.
__device__ __forceinline__ int2 expert_range(const int32_t* __restrict__ offsets, int e, int max_rows) {
  const int start = min(max(offsets[e], 0), max_rows);
  return make_int2(start, min(max(offsets[e + 1], start), max_rows));
}

// The sums of the squares of a 128 x 256 wgrad tile's two 128-column halves, in FP64 (a float's
// square is exact there): each consumer thread its fragment in register order (columns 8 j + ...,
// j < 16 the first half), each warp by a butterfly, then the 8 consumer warps in order through
// s_warp[8][2]; consumer thread 0 writes the halves inside k to squares[slot], squares[slot + 1].
// The accumulators of rows past n and columns past k are zeros (their operand boxes were filled
// with zeros past n and k), so the sums are those of the stored elements without a mask. Every
// consumer thread calls it (one consumer barrier); s_warp alternates between two buffers from tile
// to tile, so a warpgroup that runs ahead into the next tile's sums never overwrites what thread 0
// still reads.
__device__ __forceinline__ void tile_square_sums(const float (&acc)[128], int warp, int lane, int wg, int ctid,
                                                 int col0, int k, double* s_warp, double* __restrict__ squares,
                                                 int64_t slot) {
  double sum[2] = {0.0, 0.0};
#pragma unroll
  for (int j = 0; j < 32; ++j) {
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const double x = static_cast<double>(acc[4 * j + v]);
      sum[j / 16] = __fma_rn(x, x, sum[j / 16]);
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset >>= 1)
      sum[half] += __shfl_xor_sync(0xffffffffu, sum[half], offset);
  }
  if (lane == 0) {
    s_warp[2 * (4 * wg + warp)] = sum[0];
    s_warp[2 * (4 * wg + warp) + 1] = sum[1];
  }
  consumer_barrier();
  if (ctid == 0) {
    double total[2] = {0.0, 0.0};
    for (int w = 0; w < kConsumerWarps; ++w) {
      total[0] += s_warp[2 * w];
      total[1] += s_warp[2 * w + 1];
    }
    squares[slot] = total[0];
    if (col0 + 128 < k) squares[slot + 1] = total[1];
  }
}

// Shared-memory bytes the wgrad's square sums take after the barriers: two buffers of
// s_warp[kConsumerWarps][2] doubles.
constexpr int kSquareSumBytes = 2 * kConsumerWarps * 2 * 8;

// K-grouped GEMM (weight gradient, same contract as grouped_gemm_k_contiguous): for every expert e
// and tile (kBM rows of n, kBN columns of k) of dw[e],
//   dw[e] (+)= dy[rows of e, :]^T @ x[rows of e, :],  both operands MN-major in shared memory.
// map_a: dy [max_rows, n], map_b: x [max_rows, k], both with 64 x 64 boxes; map_dw: dw as
// [E, n, k] FP32, box 32 x 64 x 1. The k loop walks the expert's rows from its (unaligned) first
// row in steps of kBK; rows of the last step past the expert's end are zeroed in shared memory.
// The FP32 accumulators start from zero and sum dy_e^T x_e over the rows in 16-row steps; the tile
// leaves through staged TMA transfers clipped at n and k: stores (overwrite) or reduce-adds into
// dw (accumulate: dw[e] + tile, one FP32 add per element done by L2, so no consumer waits for the
// old dw). Experts with no rows: dw[e] untouched (accumulate) or zeroed. Each dw element is
// written once, by one CTA: deterministic, no atomics between CTAs. Tiles t = (e, M-tile, N-tile), N fastest; CTA b takes b,
// b + gridDim.x, ... kSquares (overwrite only): also the sum of squares of each 128 x 128 block of
// dw[e] (tile_square_sums) into squares[(e * ceil(n / 128) + M-tile) * ceil(k / 128) + column
// block], the blocks of core/square_blocks.h. Dynamic smem: smem_bytes(4, E, false), plus
// kSquareSumBytes with kSquares.
template <bool kSquares>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_k_contiguous_sm90(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                                   const __grid_constant__ CUtensorMap map_dw,
                                   const int32_t* __restrict__ expert_offsets, float* __restrict__ dw, int max_rows,
                                   int num_experts, int n, int k, bool accumulate, double* __restrict__ squares) {
  static_assert(kBM == 128 && kBN == 256, "a tile holds two 128 x 128 square-sum blocks");
  constexpr int kStages = 4;
  using Ring = Smem<kStages>;
  extern __shared__ __align__(1024) unsigned char sm90_smem[];
  const Ring sm = setup_smem<kStages>(sm90_smem, expert_offsets, num_experts, max_rows, false);
  const int n_tiles = (k + kBN - 1) / kBN;
  const int tiles_per_expert = (n + kBM - 1) / kBM * n_tiles;
  const int64_t num_tiles = int64_t{num_experts} * tiles_per_expert;

  if (threadIdx.x < 128) {
    if (!producer_thread(&map_a, &map_b)) return;
    uint32_t it = 0;
    for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const int e = static_cast<int>(t / tiles_per_expert), r = static_cast<int>(t % tiles_per_expert);
      const int row0 = r / n_tiles * kBM, col0 = r % n_tiles * kBN;
      const int2 rows = expert_range(expert_offsets, e, max_rows);
      const int num_k = (rows.y - rows.x + kBK - 1) / kBK;
      for (int kt = 0; kt < num_k; ++kt, ++it) {
        const int s = Ring::ring_stage(it);
        mbar_wait(sm.empty(s), Ring::ring_phase(it) ^ 1u);
        const uint32_t a = sm.stage(s), b = a + kABytes, full = sm.full(s);
        const int k_row = rows.x + kt * kBK;
        mbar_arrive_expect_tx(full, kStageBytes);
#pragma unroll
        for (int j = 0; j < kBM / 64; ++j) tma_load_2d(a + j * kBoxBytes, &map_a, full, row0 + 64 * j, k_row);
#pragma unroll
        for (int j = 0; j < kBN / 64; ++j) tma_load_2d(b + j * kBoxBytes, &map_b, full, col0 + 64 * j, k_row);
      }
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int ctid = static_cast<int>(threadIdx.x) - 128;
  const int wg = ctid / 128;
  const int warp = ctid % 128 / kWarpSize;
  const int lane = ctid % kWarpSize;
  const bool leader = ctid % 128 == 0;
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
  uint32_t it = 0;
  int64_t t = blockIdx.x;
  int2 rows = t < num_tiles ? expert_range(expert_offsets, static_cast<int>(t / tiles_per_expert), max_rows)
                            : make_int2(0, 0);
  [[maybe_unused]] int parity = 0;  // kSquares: the s_warp buffer of this tile
  for (; t < num_tiles; t += gridDim.x) {
    const int e = static_cast<int>(t / tiles_per_expert), r = static_cast<int>(t % tiles_per_expert);
    const int row0 = r / n_tiles * kBM, col0 = r % n_tiles * kBN;
    const int start = rows.x, end = rows.y;
    // The next tile's expert rows, loaded now so that the load latency hides behind this tile.
    const int64_t t_next = t + gridDim.x;
    if (t_next < num_tiles) rows = expert_range(expert_offsets, static_cast<int>(t_next / tiles_per_expert), max_rows);
    const int num_k = (end - start + kBK - 1) / kBK;
    if (num_k == 0 && accumulate) continue;  // dw[e] stays as it is; overwrite stores zeros
    {
      // acc = 0, then acc += dy^T x in k order. The wait (nothing is in flight here) keeps ptxas
      // from serialising the wgmmas (C7515).
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
      fence_accumulators(acc);
      wgmma_fence();
    }
    for (int kt = 0; kt < num_k; ++kt, ++it) {
      const int s = Ring::ring_stage(it);
      mbar_wait(sm.full(s), Ring::ring_phase(it));
      const int valid = end - (start + kt * kBK);
      if (valid < kBK) zero_stage_tail(sm.ring + s * kStageBytes, valid, ctid);
      const uint32_t a = sm.stage(s) + wg * kBoxBytes, b = sm.stage(s) + kABytes;
      wgmma_fence();
      mma_k_step<1, 1>(acc, a, b, true);
      wgmma_commit();
      wgmma_wait<1>();
      if (kt > 0 && lane == 0) mbar_arrive(sm.empty(Ring::ring_stage(it - 1)));
    }
    wgmma_wait<0>();
    fence_accumulators(acc);
    if (num_k > 0 && lane == 0) mbar_arrive(sm.empty(Ring::ring_stage(it - 1)));
    const bool empty_expert = num_k == 0;  // overwrite: its tile is +0.0

    // 8 staged chunks of 32 columns, TMA stores clipped at n and k.
#pragma unroll
    for (int c = 0; c < kBN / 32; ++c) {
      if (col0 + 32 * c >= k) break;
      staged_store(
          sm.staging(wg, c % 2), wg, leader,
          [&](uint32_t buf) { stage_f32_chunk(buf, acc, c, warp, lane, empty_expert); },
          [&](uint32_t buf) {
            if (accumulate) {
              tma_reduce_add_3d(&map_dw, buf, col0 + 32 * c, row0 + 64 * wg, e);
            } else {
              tma_store_3d(&map_dw, buf, col0 + 32 * c, row0 + 64 * wg, e);
            }
          });
    }
    if constexpr (kSquares) {
      // After the stores are issued, so that the TMA writes the tile while the sums run.
      double* s_warp = reinterpret_cast<double*>(sm.s_start) + parity * 2 * kConsumerWarps;
      const int row_blocks = (n + kBM - 1) / kBM, col_blocks = (k + 127) / 128;
      const int64_t slot = (int64_t{e} * row_blocks + row0 / kBM) * col_blocks + col0 / 128;
      tile_square_sums(acc, warp, lane, wg, ctid, col0, k, s_warp, squares, slot);
      parity ^= 1;
    }
  }
  if (leader) bulk_wait_all();
}

}  // namespace moe::cuda::kernels::sm90
