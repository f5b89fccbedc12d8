// The rowwise placement kernel (contract in cuda/ops/ep_placement.h): one CTA. Threads take the
// experts: each walks its expert's source ranks in order (kept counts and the start of each
// source's block in the expert's region), then one thread scans the local experts of every rank
// into region starts and this rank's receive offsets, then threads take this rank's rows.
#include "cuda/ops/ep_placement.h"

#include <cuda_runtime.h>

#include "core/error.h"
#include "cuda/common.h"
#include "cuda/ops/launch.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

// Shared: start [ep * E] (int32: the row of (p, e)'s first kept row within expert e's region, then
// within the rank's buffer), region [E] (each expert's kept total), my_first [E + 1] (this rank's
// row offsets per expert).
__global__ void __launch_bounds__(kThreads)
    ep_rowwise_placement_kernel(const int32_t* __restrict__ counts, int ep, int rank, int experts, int local,
                                int64_t capacity, int64_t max_rows, int32_t* __restrict__ kept,
                                int32_t* __restrict__ dest_row, int32_t* __restrict__ local_offsets,
                                int32_t* __restrict__ num_dropped) {
  extern __shared__ int32_t smem[];
  int32_t* start = smem;                  // [ep * E]
  int32_t* region = start + ep * experts;  // [E]
  int32_t* my_first = region + experts;    // [E + 1]
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    int64_t taken = 0;
    for (int p = 0; p < ep; ++p) {
      const int64_t c = counts[p * experts + e] > 0 ? counts[p * experts + e] : 0;
      const int64_t room = capacity - taken > 0 ? capacity - taken : 0;
      const int64_t k = capacity > 0 && room < c ? room : c;
      kept[p * experts + e] = static_cast<int32_t>(k);
      start[p * experts + e] = static_cast<int32_t>(taken);
      taken += k;
    }
    region[e] = static_cast<int32_t>(taken);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // Region starts within each rank's buffer (local experts in order), this rank's offsets, and
    // this rank's row offsets per expert and dropped rows.
    int32_t dropped = 0, row = 0;
    for (int q = 0; q < ep; ++q) {
      int32_t base = 0;
      for (int j = 0; j < local; ++j) {
        const int e = q * local + j;
        for (int p = 0; p < ep; ++p) start[p * experts + e] += base;
        if (q == rank) local_offsets[j] = base;
        base += region[e];
      }
      if (q == rank) local_offsets[local] = base;
    }
    for (int e = 0; e < experts; ++e) {
      const int32_t c = counts[rank * experts + e] > 0 ? counts[rank * experts + e] : 0;
      my_first[e] = row;
      row += c;
      dropped += c - kept[rank * experts + e];
    }
    my_first[experts] = row;
    *num_dropped = dropped;
  }
  __syncthreads();
  const int64_t rows = int64_t(my_first[experts]) < max_rows ? int64_t(my_first[experts]) : max_rows;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    int lo = 0, hi = experts - 1;  // the expert whose rows hold r: my_first[e] <= r < my_first[e + 1]
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (my_first[mid] <= r) lo = mid;
      else hi = mid - 1;
    }
    const int64_t i = r - my_first[lo];
    dest_row[r] = i < kept[rank * experts + lo] ? static_cast<int32_t>(start[rank * experts + lo] + i) : -1;
  }
}

}  // namespace

void ep_rowwise_placement(const int32_t* counts_all, int64_t ep, int64_t rank, int64_t num_experts,
                          int64_t capacity, int64_t max_rows, int32_t* kept, int32_t* dest_row,
                          int32_t* local_offsets, int32_t* num_dropped, Stream stream) {
  const char* op = "cuda::ep_rowwise_placement";
  MOE_CHECK(ep >= 1 && ep <= 1024, op, ": ep must be in [1, 1024], got ", ep);
  MOE_CHECK(num_experts >= 1 && num_experts <= 4096 && num_experts % ep == 0, op, ": num_experts = ", num_experts,
            " must be in [1, 4096] and divisible by ep = ", ep);
  MOE_CHECK(rank >= 0 && rank < ep, op, ": rank ", rank, " outside the group of ", ep);
  MOE_CHECK(max_rows >= 0, op, ": max_rows must be >= 0, got ", max_rows);
  detail::check_ptrs(op, {{"counts_all", counts_all}, {"kept", kept}, {"local_offsets", local_offsets},
                          {"num_dropped", num_dropped}}, sizeof(int32_t));
  if (max_rows > 0) detail::check_ptrs(op, {{"dest_row", dest_row}}, sizeof(int32_t));
  const size_t smem = size_t(ep * num_experts + num_experts + num_experts + 1) * sizeof(int32_t);
  MOE_CHECK(smem <= 48 * 1024, op, ": ep x num_experts = ", ep * num_experts, " counts exceed one CTA's 48 KiB of "
            "shared memory");
  ep_rowwise_placement_kernel<<<1, kThreads, smem, stream>>>(
      counts_all, static_cast<int>(ep), static_cast<int>(rank), static_cast<int>(num_experts),
      static_cast<int>(num_experts / ep), capacity, max_rows, kept, dest_row, local_offsets, num_dropped);
  check_launch("ep_rowwise_placement_kernel");
}

}  // namespace moe::cuda
