// The AdamW update kept to a few multiprocessors (cuda::adamw_apply with sms > 0: the deferred
// update beside the forward's GEMMs). One block of kAdamWResidentThreads on each, walking its
// chunks b, b + grid, ... of the segment table's chunk runs. A multiprocessor's loads must keep
// many bytes in flight to stream at a useful rate alone (one float4 of p, g, m and v per thread is
// 64 KiB a multiprocessor, about 35 GB/s measured beside the GEMMs), so the parameters, gradients
// and moments of a whole chunk come into shared memory by bulk copies (cp.async.bulk, one thread
// issuing them) through a ring of kAdamWResidentStages stages: up to that many chunks in flight
// while the threads update the chunk in hand from shared memory and store the results. The same
// element update in the same order as adamw_update_segments, so the same bits.
#pragma once

#include <cstdint>

#include "cuda/kernels/sm90_sync.cuh"
#include "cuda/kernels/optim.cuh"

namespace moe::cuda::kernels {

constexpr int kAdamWResidentStages = 3;
constexpr int64_t kAdamWStageFloats = 4 * kAdamWChunk;  // p, g, m, v of one chunk
// Dynamic shared memory of adamw_update_resident: the ring (192 KiB, so one block a multiprocessor).
constexpr int64_t kAdamWResidentSmemBytes = kAdamWResidentStages * kAdamWStageFloats * 4;

// adamw_update_segments' contract for tables whose moments sit at the flat offsets, total_numel a
// multiple of 4, p, g, m, v 16-byte aligned and p_bf16 8-byte (checked on the host). Dynamic
// shared memory: kAdamWResidentSmemBytes.
__global__ void __launch_bounds__(kAdamWResidentThreads, 1)
    adamw_update_resident(const ParamSegment* __restrict__ segs, int num_segs, const ChunkRun* __restrict__ runs,
                          int num_runs, int64_t num_chunks, int64_t total_numel, float* __restrict__ p,
                          const float* __restrict__ g, float* __restrict__ m, float* __restrict__ v,
                          uint16_t* __restrict__ p_bf16, const OptimStepScalars* __restrict__ s, AdamWConstants c,
                          bool deferred) {
  if (s->skipped != 0 || (deferred && s->pending == 0)) return;
  extern __shared__ __align__(128) float ring[];
  __shared__ __align__(8) uint64_t full[kAdamWResidentStages];
  const AdamWCoefficients k{s->step_size, s->inv_sqrt_bc2, s->decay, s->grad_scale};
  const int64_t mine = blockIdx.x < num_chunks ? (num_chunks - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < kAdamWResidentStages; ++st) sm90::mbar_init(sm90::smem_u32(&full[st]), 1);
    sm90::fence_barrier_init();
  }
  __syncthreads();
  // Thread 0: the bulk copies of this block's j-th chunk into stage j % stages.
  auto issue = [&](int64_t j) {
    const int st = static_cast<int>(j % kAdamWResidentStages);
    const int64_t c0 = chunk_of_runs(runs, num_runs, blockIdx.x + j * gridDim.x) * kAdamWChunk;
    const uint32_t bytes = static_cast<uint32_t>(min(kAdamWChunk, total_numel - c0) * 4);
    const uint32_t bar = sm90::smem_u32(&full[st]);
    const uint32_t dst = sm90::smem_u32(ring + st * kAdamWStageFloats);
    constexpr uint32_t kArrayBytes = static_cast<uint32_t>(kAdamWChunk * 4);
    sm90::mbar_arrive_expect_tx(bar, 4 * bytes);
    sm90::bulk_load_1d(dst, p + c0, bytes, bar);
    sm90::bulk_load_1d(dst + kArrayBytes, g + c0, bytes, bar);
    sm90::bulk_load_1d(dst + 2 * kArrayBytes, m + c0, bytes, bar);
    sm90::bulk_load_1d(dst + 3 * kArrayBytes, v + c0, bytes, bar);
  };
  if (threadIdx.x == 0) {
    for (int64_t j = 0; j < mine && j < kAdamWResidentStages; ++j) issue(j);
  }
  for (int64_t j = 0; j < mine; ++j) {
    const int st = static_cast<int>(j % kAdamWResidentStages);
    sm90::mbar_wait(sm90::smem_u32(&full[st]), static_cast<uint32_t>((j / kAdamWResidentStages) & 1));
    const float* sp = ring + st * kAdamWStageFloats;
    const int64_t c0 = chunk_of_runs(runs, num_runs, blockIdx.x + j * gridDim.x) * kAdamWChunk;
    const int64_t c1 = c0 + kAdamWChunk < total_numel ? c0 + kAdamWChunk : total_numel;
    // The stage holds p, g, m, v of the chunk as four arrays of kAdamWChunk; element i at i - c0.
    const float4* s4 = reinterpret_cast<const float4*>(sp);
    constexpr int kArray = static_cast<int>(kAdamWChunk / 4);
    for_each_chunk_piece(segs, num_segs, c0, c1, k.decay, [&](const ChunkPiece& x) {
      auto scalar = [&](int64_t i) {
        const int t = static_cast<int>(i - c0);
        adamw_store_scalar(i, i, sp[t], sp[kAdamWChunk + t], sp[2 * kAdamWChunk + t], sp[3 * kAdamWChunk + t], p, m,
                           v, p_bf16, x.decay, k, c);
      };
      if (x.lo + threadIdx.x < x.vb) scalar(x.lo + threadIdx.x);
      for (int64_t q = x.vb / 4 + threadIdx.x; q < x.ve / 4; q += blockDim.x) {
        const int u = static_cast<int>(q - c0 / 4);
        adamw_store_vec4(q, q, s4[u], s4[kArray + u], s4[2 * kArray + u], s4[3 * kArray + u], p, m, v, p_bf16,
                         x.decay, k, c);
      }
      if (x.ve + threadIdx.x < x.hi) scalar(x.ve + threadIdx.x);
    });
    __syncthreads();  // every thread is done reading stage st before it is refilled
    if (threadIdx.x == 0 && j + kAdamWResidentStages < mine) issue(j + kAdamWResidentStages);
  }
}

}  // namespace moe::cuda::kernels
