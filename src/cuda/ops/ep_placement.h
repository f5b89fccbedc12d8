// The rowwise expert exchange's placement on the GPU: the CUDA twin of ep_rowwise_placement
// (parallel/expert_parallel.h), from the group's per-expert counts in device memory (after a
// device-side count exchange), so that no host reads them: every rank computes the same kept
// counts, each of its rows' row in its expert rank's receive buffer (-1: dropped) and its own
// receive layout. One CTA; no host synchronisation (capturable). No CUDA headers.
// Legend: ep ranks, E experts, L = E / ep local experts, R rows of `rank` (the sum of its counts,
// sorted by global expert as the dispatch map sorts them).
#pragma once

#include <cstdint>

#include "cuda/device.h"

namespace moe::cuda {

// counts_all [ep, E] int32 (row p: rank p's rows per global expert) -> kept [ep, E] int32,
// dest_row [R] int32 (R = the sum of row `rank` of counts_all, at most max_rows: rows beyond
// max_rows are not written), local_offsets [L + 1] int32, num_dropped [1] int32 (this rank's
// dropped rows). capacity <= 0: dropless. Checks: ep in [1, 1024], E in [1, 4096] divisible by ep,
// rank in [0, ep), non-null buffers. A negative count is taken as 0.
void ep_rowwise_placement(const int32_t* counts_all, int64_t ep, int64_t rank, int64_t num_experts,
                          int64_t capacity, int64_t max_rows, int32_t* kept, int32_t* dest_row,
                          int32_t* local_offsets, int32_t* num_dropped, Stream stream);

}  // namespace moe::cuda
