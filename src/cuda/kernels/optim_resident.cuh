// The AdamW update kept to a few multiprocessors (cuda::adamw_apply with sms > 0: the deferred
// update beside the forward's GEMMs). One block on each, walking its chunks b, b + grid, ... of
// the segment table's chunk runs. Alone on a few multiprocessors the update is bound by its
// instructions (the correctly rounded square root and division take about 20 of its ~50 an
// element), not by the bytes one multiprocessor can keep in flight, so the block is built to
// spend its issue slots on the update: a producer warp (one lane) brings the parameters,
// gradients and moments of whole chunks into shared memory by bulk copies (cp.async.bulk on an
// mbarrier) through a ring of kAdamWResidentStages stages, and records each chunk's flat offset
// and first segment beside it; kAdamWResidentConsumers warps update the chunk in hand from shared
// memory (two float4 a thread per full chunk), store the results, and each releases the stage on
// an "empty" mbarrier, so no warp waits for the slowest before moving on to the next chunk. The
// same element update as adamw_update_segments, so the same bits.
#pragma once

#include <cstdint>

#include "cuda/kernels/sm90_sync.cuh"
#include "cuda/kernels/optim.cuh"

namespace moe::cuda::kernels {

constexpr int kAdamWResidentStages = 3;
// Warps that update (8 or 31 streamed slower on 16 and 32 multiprocessors, alone and beside the
// GEMMs; docs/benchmarks.md), and one producer warp.
constexpr int kAdamWResidentConsumers = 16;
constexpr int kAdamWRingThreads = (kAdamWResidentConsumers + 1) * kWarpSize;
constexpr int64_t kAdamWStageFloats = 4 * kAdamWChunk;  // p, g, m, v of one chunk (FP32 moments; BF16 take 3/4)
// Dynamic shared memory of adamw_update_resident: the ring (192 KiB, so one block a multiprocessor).
constexpr int64_t kAdamWResidentSmemBytes = kAdamWResidentStages * kAdamWStageFloats * 4;

// adamw_update_segments' contract for tables whose moments sit at the flat offsets, total_numel a
// multiple of 4 (8 with BF16 moments, M = uint16_t: the bulk copies move 16-byte units), p, g, m
// and v 16-byte aligned, p_bf16 8-byte (checked on the host). Block: kAdamWRingThreads; dynamic
// shared memory: kAdamWResidentSmemBytes. A stage holds p and g of a chunk as FP32, then m and v as M.
template <typename M>
__global__ void __launch_bounds__(kAdamWRingThreads, 1)
    adamw_update_resident(const ParamSegment* __restrict__ segs, int num_segs, const ChunkRun* __restrict__ runs,
                          int num_runs, int64_t num_chunks, int64_t total_numel, float* __restrict__ p,
                          const float* __restrict__ g, M* __restrict__ m, M* __restrict__ v,
                          uint16_t* __restrict__ p_bf16, const OptimStepScalars* __restrict__ s, AdamWConstants c,
                          bool deferred) {
  if (s->skipped != 0 || (deferred && s->pending == 0)) return;
  extern __shared__ __align__(128) float ring[];
  __shared__ __align__(8) uint64_t full[kAdamWResidentStages];
  __shared__ __align__(8) uint64_t empty[kAdamWResidentStages];
  __shared__ int64_t stage_c0[kAdamWResidentStages];  // the chunk's first flat element
  __shared__ int stage_seg[kAdamWResidentStages];     // the first segment ending after it
  const int64_t mine = blockIdx.x < num_chunks ? (num_chunks - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < kAdamWResidentStages; ++st) {
      sm90::mbar_init(sm90::smem_u32(&full[st]), 1);
      sm90::mbar_init(sm90::smem_u32(&empty[st]), kAdamWResidentConsumers);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();

  if (warp == kAdamWResidentConsumers) {  // the producer
    if (threadIdx.x % kWarpSize != 0) return;
    constexpr uint32_t kArrayBytes = static_cast<uint32_t>(kAdamWChunk * 4);
    constexpr uint32_t kMomentBytes = static_cast<uint32_t>(kAdamWChunk * sizeof(M));
    for (int64_t j = 0; j < mine; ++j) {
      const int st = static_cast<int>(j % kAdamWResidentStages);
      if (j >= kAdamWResidentStages)  // the consumers are done with the chunk this stage held
        sm90::mbar_wait(sm90::smem_u32(&empty[st]), static_cast<uint32_t>((j / kAdamWResidentStages - 1) & 1));
      const int64_t c0 = chunk_of_runs(runs, num_runs, blockIdx.x + j * gridDim.x) * kAdamWChunk;
      stage_c0[st] = c0;
      stage_seg[st] = first_segment_ending_after(segs, num_segs, c0);
      const int64_t elems = min(kAdamWChunk, total_numel - c0);  // whole 16-byte units of each array
      const uint32_t bytes = static_cast<uint32_t>(elems * 4), mbytes = static_cast<uint32_t>(elems * sizeof(M));
      const uint32_t bar = sm90::smem_u32(&full[st]);
      const uint32_t dst = sm90::smem_u32(ring + st * kAdamWStageFloats);
      sm90::mbar_arrive_expect_tx(bar, 2 * bytes + 2 * mbytes);  // releases the two records above with it
      sm90::bulk_load_1d(dst, p + c0, bytes, bar);
      sm90::bulk_load_1d(dst + kArrayBytes, g + c0, bytes, bar);
      sm90::bulk_load_1d(dst + 2 * kArrayBytes, m + c0, mbytes, bar);
      sm90::bulk_load_1d(dst + 2 * kArrayBytes + kMomentBytes, v + c0, mbytes, bar);
    }
    return;
  }

  const AdamWCoefficients k{s->step_size, s->inv_sqrt_bc2, s->decay, s->grad_scale};
  constexpr int kThreads = kAdamWResidentConsumers * kWarpSize;
  constexpr int kArray = static_cast<int>(kAdamWChunk / 4);  // float4 of one array in a stage
  const int tid = static_cast<int>(threadIdx.x);
  for (int64_t j = 0; j < mine; ++j) {
    const int st = static_cast<int>(j % kAdamWResidentStages);
    sm90::mbar_wait(sm90::smem_u32(&full[st]), static_cast<uint32_t>((j / kAdamWResidentStages) & 1));
    const float* sp = ring + st * kAdamWStageFloats;
    const float4* s4 = reinterpret_cast<const float4*>(sp);
    const M* sm = reinterpret_cast<const M*>(sp + 2 * kAdamWChunk);  // m, then v at sm + kAdamWChunk
    const int64_t c0 = stage_c0[st];
    const int64_t c1 = c0 + kAdamWChunk < total_numel ? c0 + kAdamWChunk : total_numel;
    // The stage holds p, g, m, v of the chunk as four arrays of kAdamWChunk; element i at i - c0.
    // The moments sit at the flat offsets: a piece's shift is 0.
    for_each_chunk_piece_from(segs, num_segs, stage_seg[st], c0, c1, k.decay, [&](const ChunkPiece& x) {
      auto scalar = [&](int64_t i) {
        const int t = static_cast<int>(i - c0);
        adamw_store_scalar(i, i, sp[t], sp[kAdamWChunk + t], load_moment(sm, t), load_moment(sm + kAdamWChunk, t), p,
                           m, v, p_bf16, x.decay, k, c);
      };
      if (x.lo + tid < x.vb) scalar(x.lo + tid);
      // The float4 body, in chunk-relative 32-bit indices.
      const int qb = static_cast<int>((x.vb - c0) / 4), qe = static_cast<int>((x.ve - c0) / 4);
      const int64_t q0 = c0 / 4;
      for (int u = qb + tid; u < qe; u += kThreads) {
        adamw_store_vec4(q0 + u, q0 + u, s4[u], s4[kArray + u], load_moment4(sm, u), load_moment4(sm + kAdamWChunk, u),
                         p, m, v, p_bf16, x.decay, k, c);
      }
      if (x.ve + tid < x.hi) scalar(x.ve + tid);
    });
    __syncwarp();  // every lane of this warp is done reading stage st
    if (tid % kWarpSize == 0) sm90::mbar_arrive(sm90::smem_u32(&empty[st]));
  }
}

}  // namespace moe::cuda::kernels
