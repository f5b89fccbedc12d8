// Dispatch-map kernels: a stable counting sort of the R = T*k routes by expert in three
// deterministic passes. (1) Each tile of routes histograms its experts -> counts[e, tile].
// (2) One block scans counts over tiles per expert (-> each tile's first position inside each
// expert), totals per expert, capacity-clamped expert offsets and the dropped count. (3) Each
// tile re-reads its routes; warp w owns a contiguous run of them, so a scan over warps plus a
// per-32-route __match_any_sync rank gives every route its position in increasing route id.
#pragma once

#include <cstdint>

#include "cuda/kernels/moe_common.cuh"

namespace moe::cuda::kernels {

constexpr int kMapWarps = 16;
constexpr int kMapThreads = kMapWarps * 32;
constexpr int64_t kMaxMapTiles = 256;  // the scan holds 8 tiles per lane
constexpr int kTilesPerLane = static_cast<int>(kMaxMapTiles / 32);
constexpr int kScanThreads = 1024;
constexpr int kMapMaxExperts = 256;  // the final scan holds 8 experts per lane

__global__ void __launch_bounds__(kMapThreads)
    dispatch_count_per_tile(const int32_t* topk_idx, int64_t routes, int num_experts,
                            int64_t routes_per_tile, int num_tiles,
                            int32_t* tile_counts /*[E, tiles]*/) {
  __shared__ int32_t s_hist[kMapMaxExperts];
  for (int e = threadIdx.x; e < num_experts; e += kMapThreads) s_hist[e] = 0;
  __syncthreads();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * routes_per_tile;
  const int64_t end = begin + routes_per_tile < routes ? begin + routes_per_tile : routes;
  for (int64_t r = begin + threadIdx.x; r < end; r += kMapThreads) {
    const int32_t e = topk_idx[r];
    if (e >= 0 && e < num_experts) atomicAdd(&s_hist[e], 1);  // integer: order-free
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += kMapThreads)
    tile_counts[static_cast<int64_t>(e) * num_tiles + blockIdx.x] = s_hist[e];
}

// One block. Turns counts[e, tile] into positions[e, tile] in place (exclusive scan over tiles
// per expert), writes totals, kept-row offsets and the count of routes left without a row.
__global__ void __launch_bounds__(kScanThreads)
    dispatch_scan_tiles(int32_t* tile_counts_to_pos /*[E, tiles]*/, int num_experts,
                        int num_tiles, int64_t routes, int64_t capacity,
                        int32_t* num_tokens_per_expert, int32_t* expert_offsets,
                        int32_t* num_dropped) {
  __shared__ int32_t s_count[kMapMaxExperts];
  __shared__ int32_t s_kept[kMapMaxExperts];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int E = num_experts;
  for (int e = warp; e < E; e += kScanThreads / 32) {
    int32_t* row = tile_counts_to_pos + static_cast<int64_t>(e) * num_tiles;
    int32_t v[kTilesPerLane];
#pragma unroll
    for (int c = 0; c < kTilesPerLane; ++c) {
      const int b = c * 32 + lane;
      v[c] = b < num_tiles ? row[b] : 0;
    }
    int32_t carry = 0;
#pragma unroll
    for (int c = 0; c < kTilesPerLane; ++c) {
      const int32_t incl = warp_inclusive_scan(v[c]);
      const int b = c * 32 + lane;
      if (b < num_tiles) row[b] = carry + incl - v[c];
      carry += __shfl_sync(kFullMask, incl, 31);
    }
    if (lane == 0) {
      s_count[e] = carry;
      s_kept[e] = capacity > 0 && carry > capacity ? static_cast<int32_t>(capacity) : carry;
    }
  }
  __syncthreads();
  if (warp == 0) {
    constexpr int kPerLane = kMapMaxExperts / 32;  // lane owns experts lane*8 .. lane*8+7
    int32_t kept[kPerLane];
    int32_t sum = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane * kPerLane + i;
      kept[i] = e < E ? s_kept[e] : 0;
      sum += kept[i];
      if (e < E) num_tokens_per_expert[e] = s_count[e];
    }
    const int32_t incl = warp_inclusive_scan(sum);
    int32_t run = incl - sum;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane * kPerLane + i;
      if (e < E) expert_offsets[e] = run;
      run += kept[i];
    }
    if (lane == 31) {
      expert_offsets[E] = incl;
      // Routes without a row: dropped by the capacity or holding a bad expert index.
      if (num_dropped) *num_dropped = static_cast<int32_t>(routes - incl);
    }
  }
}

__global__ void __launch_bounds__(kMapThreads)
    dispatch_scatter_stable(const int32_t* topk_idx, int64_t routes, int num_experts,
                            int64_t chunks_per_warp, int64_t routes_per_tile, int num_tiles,
                            const int32_t* tile_pos /*[E, tiles]*/, const int32_t* expert_offsets,
                            int64_t capacity, int32_t* sorted_route, int32_t* route_to_row) {
  __shared__ int32_t s_warp[kMapWarps][kMapMaxExperts];  // per-warp counts, then running positions
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int E = num_experts;
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int i = threadIdx.x; i < kMapWarps * kMapMaxExperts; i += kMapThreads)
    (&s_warp[0][0])[i] = 0;
  __syncthreads();
  const int64_t tile_begin = static_cast<int64_t>(blockIdx.x) * routes_per_tile;
  const int64_t warp_begin = tile_begin + warp * chunks_per_warp * 32;
  auto expert_of = [&](int64_t r) {
    const int32_t e = r < routes ? topk_idx[r] : -1;
    return e >= 0 && e < E ? e : -1;  // -1: no route, or an index outside [0, E) (dropped)
  };
  for (int64_t c = 0; c < chunks_per_warp; ++c) {
    const int32_t e = expert_of(warp_begin + c * 32 + lane);
    const unsigned peers = __match_any_sync(kFullMask, e);
    if (e >= 0 && (peers & lanes_below) == 0) s_warp[warp][e] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kMapThreads) {
    int32_t base = tile_pos[static_cast<int64_t>(e) * num_tiles + blockIdx.x];
    for (int w = 0; w < kMapWarps; ++w) {
      const int32_t n = s_warp[w][e];
      s_warp[w][e] = base;
      base += n;
    }
  }
  __syncthreads();
  for (int64_t c = 0; c < chunks_per_warp; ++c) {
    const int64_t r = warp_begin + c * 32 + lane;
    const int32_t e = expert_of(r);
    const unsigned peers = __match_any_sync(kFullMask, e);
    const int32_t pos = e >= 0 ? s_warp[warp][e] + __popc(peers & lanes_below) : 0;
    __syncwarp();
    if (e >= 0 && (peers & lanes_below) == 0) s_warp[warp][e] += __popc(peers);
    __syncwarp();
    if (r < routes) {
      if (e < 0 || (capacity > 0 && pos >= capacity)) {
        route_to_row[r] = -1;
      } else {
        const int32_t row = expert_offsets[e] + pos;
        sorted_route[row] = static_cast<int32_t>(r);
        route_to_row[r] = row;
      }
    }
  }
  // Rows past the kept total (dropped by the capacity) hold no route.
  const int32_t kept_total = expert_offsets[E];
  const int64_t tile_end =
      tile_begin + routes_per_tile < routes ? tile_begin + routes_per_tile : routes;
  for (int64_t row = tile_begin + threadIdx.x; row < tile_end; row += kMapThreads)
    if (row >= kept_total) sorted_route[row] = -1;
}

}  // namespace moe::cuda::kernels
