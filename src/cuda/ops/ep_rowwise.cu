// Rowwise exchange kernels (contract in cuda/ops/ep_rowwise.h): a warp per row (grid-stride), its
// expert found by binary search in the offsets held in shared memory, 16-byte vectors per lane.
#include "cuda/ops/ep_rowwise.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "core/error.h"
#include "cuda/common.h"
#include "cuda/kernels/vec.cuh"
#include "cuda/ops/launch.h"

namespace moe::cuda {
namespace {

using kernels::load_bf16;
using kernels::store_bf16;

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kMaxExperts = 4096;

__global__ void __launch_bounds__(256)
    share_counts_kernel(const int32_t* __restrict__ counts, int experts, int rank, int32_t* const* peers, int ep) {
  for (int i = threadIdx.x; i < ep * experts; i += blockDim.x) {
    const int p = i / experts, e = i - p * experts;
    peers[p][rank * experts + e] = counts[e];
  }
}

// Loads offsets_E1 into shared memory; returns the row count offsets_E1[E].
__device__ int load_offsets(const int32_t* __restrict__ offsets, int experts, int32_t* s_off) {
  for (int i = threadIdx.x; i <= experts; i += blockDim.x) s_off[i] = offsets[i];
  __syncthreads();
  return s_off[experts];
}

// The expert of row r: the last e with s_off[e] <= r.
__device__ __forceinline__ int expert_of(const int32_t* s_off, int experts, int r) {
  int lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (s_off[mid] <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <bool kScatter>
__global__ void __launch_bounds__(kThreads)
    rowwise_move_kernel(const uint16_t* __restrict__ src_rows, uint16_t* __restrict__ dst_rows,
                        const uint16_t* const* peer_src, uint16_t* const* peer_dst, const int32_t* __restrict__ offsets,
                        const int32_t* __restrict__ dest_row, int64_t rows, int experts, int local, int64_t d,
                        const int32_t* __restrict__ sorted_route, int top_k) {
  extern __shared__ int32_t s_off[];
  const int used = load_offsets(offsets, experts, s_off);
  const int lane = threadIdx.x % 32;
  const int64_t vecs = d / 8;
  for (int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; r < rows; r += int64_t(gridDim.x) * kWarps) {
    const int32_t at = r < used ? dest_row[r] : -1;
    if constexpr (kScatter) {
      if (at < 0) continue;
      const int q = expert_of(s_off, experts, static_cast<int>(r)) / local;
      const int64_t src = sorted_route ? int64_t(sorted_route[r] / top_k) : r;
      const uint4* from = reinterpret_cast<const uint4*>(src_rows + src * d);
      uint4* to = reinterpret_cast<uint4*>(peer_dst[q] + int64_t(at) * d);
      for (int64_t v = lane; v < vecs; v += 32) to[v] = from[v];
    } else {
      uint4* to = reinterpret_cast<uint4*>(dst_rows + r * d);
      if (at < 0) {
        for (int64_t v = lane; v < vecs; v += 32) to[v] = make_uint4(0, 0, 0, 0);
        continue;
      }
      const int q = expert_of(s_off, experts, static_cast<int>(r)) / local;
      const uint4* from = reinterpret_cast<const uint4*>(peer_src[q] + int64_t(at) * d);
      for (int64_t v = lane; v < vecs; v += 32) to[v] = from[v];
    }
  }
}

// A warp per token: lane j < top_k finds route j's rank and row, then the lanes walk the row's
// 8-element packs, adding the routes' rows in slot order onto the token's row (FP32).
__global__ void __launch_bounds__(kThreads)
    gather_add_kernel(const uint16_t* const* peer_src, const int32_t* __restrict__ route_to_row,
                      const int32_t* __restrict__ offsets, const int32_t* __restrict__ dest_row, int64_t tokens,
                      int top_k, int experts, int local, int64_t d, uint16_t* __restrict__ dx) {
  extern __shared__ int32_t s_off[];
  const int used = load_offsets(offsets, experts, s_off);
  const int lane = threadIdx.x % 32;
  const int64_t packs = d / 8;
  for (int64_t t = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; t < tokens; t += int64_t(gridDim.x) * kWarps) {
    int q = -1, at = -1;
    if (lane < top_k) {
      const int32_t r = route_to_row[t * top_k + lane];
      if (r >= 0 && r < used) {
        at = dest_row[r];
        if (at >= 0) q = expert_of(s_off, experts, r) / local;
      }
    }
    int qs[32], ats[32];  // every lane's copy of the routes' ranks and rows (all lanes shuffle)
    for (int j = 0; j < top_k; ++j) {
      qs[j] = __shfl_sync(0xffffffffu, q, j);
      ats[j] = __shfl_sync(0xffffffffu, at, j);
    }
    for (int64_t v = lane; v < packs; v += 32) {
      float acc[8];
      load_bf16<8>(dx + t * d + v * 8, acc);
      for (int j = 0; j < top_k; ++j) {
        const int qj = qs[j], aj = ats[j];
        if (qj < 0) continue;
        float y[8];
        load_bf16<8>(peer_src[qj] + int64_t(aj) * d + v * 8, y);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += y[i];
      }
      store_bf16<8>(dx + t * d + v * 8, acc);
    }
  }
}

__global__ void count_rows_kernel(const int32_t* __restrict__ kept, int ep, int rank, int experts, int64_t* slot,
                                  int64_t* total) {
  if (kept != nullptr) {
    const int local = experts / ep;
    int64_t out = 0, in = 0;
    for (int e = 0; e < experts; ++e)
      if (e / local != rank) out += kept[rank * experts + e];
    for (int p = 0; p < ep; ++p)
      if (p != rank)
        for (int j = 0; j < local; ++j) in += kept[p * experts + rank * local + j];
    slot[0] = out;
    slot[1] = in;
  }
  total[0] += slot[0];
  total[1] += slot[1];
}

void check_shape(const char* op, int64_t rows, int64_t experts, int64_t local, int64_t d, int64_t ep) {
  MOE_CHECK(rows >= 0 && rows < (int64_t{1} << 31), op, ": rows ", rows, " outside [0, 2^31)");
  MOE_CHECK(experts >= 1 && experts <= kMaxExperts && ep >= 1 && local >= 1 && local * ep == experts, op,
            ": expected E in [1, ", kMaxExperts, "] = L x ep, got E=", experts, " L=", local, " ep=", ep);
  MOE_CHECK(d > 0 && d % 8 == 0, op, ": the row width must be a positive multiple of 8, got ", d);
}

unsigned grid_for(int64_t rows) {
  return static_cast<unsigned>(std::clamp<int64_t>((rows + kWarps - 1) / kWarps, 1, 132 * 16));
}

}  // namespace

void ep_rowwise_share_counts(const int32_t* counts_E, int64_t num_experts, int64_t rank, int32_t* const* peer_counts,
                             int64_t ep, Stream stream) {
  constexpr const char* op = "cuda::ep_rowwise_share_counts";
  MOE_CHECK(ep >= 1 && rank >= 0 && rank < ep && num_experts >= 1 && ep * num_experts <= (int64_t{1} << 24), op,
            ": rank ", rank, " of ", ep, " with ", num_experts, " experts");
  detail::check_ptrs(op, {{"counts_E", counts_E}}, 4);
  detail::check_ptrs(op, {{"peer_counts", peer_counts}}, 8);
  share_counts_kernel<<<1, 256, 0, stream>>>(counts_E, int(num_experts), int(rank), peer_counts, int(ep));
  check_launch("ep_rowwise_share_counts");
}

void ep_rowwise_scatter(const uint16_t* rows_RD, const int32_t* offsets_E1, const int32_t* dest_row, int64_t rows,
                        int64_t num_experts, int64_t local_experts, int64_t d, uint16_t* const* peer_bufs, int64_t ep,
                        Stream stream, const int32_t* sorted_route, int64_t top_k) {
  constexpr const char* op = "cuda::ep_rowwise_scatter";
  MOE_CHECK(top_k >= 1 && top_k <= 32, op, ": top_k must be in [1, 32], got ", top_k);
  check_shape(op, rows, num_experts, local_experts, d, ep);
  if (rows == 0) return;
  detail::check_ptrs(op, {{"rows_RD", rows_RD}}, 16);
  detail::check_ptrs(op, {{"peer_bufs", peer_bufs}}, 8);
  detail::check_ptrs(op, {{"offsets_E1", offsets_E1}, {"dest_row", dest_row}}, 4);
  const size_t smem = size_t(num_experts + 1) * sizeof(int32_t);
  rowwise_move_kernel<true><<<grid_for(rows), kThreads, smem, stream>>>(rows_RD, nullptr, nullptr, peer_bufs,
                                                                        offsets_E1, dest_row, rows, int(num_experts),
                                                                        int(local_experts), d, sorted_route, int(top_k));
  check_launch("rowwise_move_kernel<scatter>");
}

void ep_rowwise_gather(const uint16_t* const* peer_bufs, const int32_t* offsets_E1, const int32_t* dest_row,
                       int64_t rows, int64_t num_experts, int64_t local_experts, int64_t d, int64_t ep,
                       uint16_t* out_RD, Stream stream) {
  constexpr const char* op = "cuda::ep_rowwise_gather";
  check_shape(op, rows, num_experts, local_experts, d, ep);
  if (rows == 0) return;
  detail::check_ptrs(op, {{"out_RD", out_RD}}, 16);
  detail::check_ptrs(op, {{"peer_bufs", peer_bufs}}, 8);
  detail::check_ptrs(op, {{"offsets_E1", offsets_E1}, {"dest_row", dest_row}}, 4);
  const size_t smem = size_t(num_experts + 1) * sizeof(int32_t);
  rowwise_move_kernel<false><<<grid_for(rows), kThreads, smem, stream>>>(nullptr, out_RD, peer_bufs, nullptr,
                                                                         offsets_E1, dest_row, rows, int(num_experts),
                                                                         int(local_experts), d, nullptr, 1);
  check_launch("rowwise_move_kernel<gather>");
}

void ep_rowwise_gather_add(const uint16_t* const* peer_bufs, const int32_t* route_to_row, const int32_t* offsets_E1,
                           const int32_t* dest_row, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                           int64_t local_experts, int64_t d, int64_t ep, uint16_t* dx_TD, Stream stream) {
  constexpr const char* op = "cuda::ep_rowwise_gather_add";
  check_shape(op, num_tokens * top_k, num_experts, local_experts, d, ep);
  MOE_CHECK(top_k >= 1 && top_k <= 32, op, ": top_k must be in [1, 32], got ", top_k);
  if (num_tokens == 0) return;
  detail::check_ptrs(op, {{"dx_TD", dx_TD}}, 16);
  detail::check_ptrs(op, {{"peer_bufs", peer_bufs}}, 8);
  detail::check_ptrs(op, {{"route_to_row", route_to_row}, {"offsets_E1", offsets_E1}, {"dest_row", dest_row}}, 4);
  const size_t smem = size_t(num_experts + 1) * sizeof(int32_t);
  gather_add_kernel<<<grid_for(num_tokens), kThreads, smem, stream>>>(peer_bufs, route_to_row, offsets_E1, dest_row,
                                                                       num_tokens, int(top_k), int(num_experts),
                                                                       int(local_experts), d, dx_TD);
  check_launch("ep_rowwise_gather_add");
}

void ep_rowwise_count_rows(const int32_t* kept, int64_t ep, int64_t rank, int64_t num_experts, int64_t* slot_2,
                           int64_t* total_2, Stream stream) {
  constexpr const char* op = "cuda::ep_rowwise_count_rows";
  MOE_CHECK(ep >= 1 && rank >= 0 && rank < ep && num_experts >= ep && num_experts % ep == 0, op, ": rank ", rank,
            " of ", ep, " with ", num_experts, " experts");
  detail::check_ptrs(op, {{"slot_2", slot_2}, {"total_2", total_2}}, 8);
  count_rows_kernel<<<1, 1, 0, stream>>>(kept, int(ep), int(rank), int(num_experts), slot_2, total_2);
  check_launch("ep_rowwise_count_rows");
}

}  // namespace moe::cuda
