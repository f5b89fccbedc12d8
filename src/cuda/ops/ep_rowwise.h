// The rowwise expert exchange's data movement on the GPU (parallel.ep_backend = "rowwise"): every
// routed row written straight into its expert rank's receive buffer at the row the placement gave
// it (cuda::ep_rowwise_placement), and read back from there, by plain loads and stores through the
// peers' addresses of symmetric buffers (NvshmemWorld::peer: NVLink / PCIe peer mappings of the
// NVSHMEM heap; one PE: this GPU's own). No host reads, no layout passes: capturable. The
// caller orders them with NvshmemWorld::barrier (a row written by scatter is read after the next
// barrier). No CUDA headers.
// Legend: ep ranks, E experts, L = E / ep local experts, R rows of this rank (sorted by global
// expert: expert e's at [offsets_E1[e], offsets_E1[e + 1])), D row width (BF16).
#pragma once

#include <cstdint>

#include "cuda/device.h"

namespace moe::cuda {

// counts_E [E] int32 (this rank's rows per global expert) -> row `rank` of every PE's counts_all
// [ep, E]: peer_counts [ep] is a device array of those buffers' addresses as this GPU sees them.
void ep_rowwise_share_counts(const int32_t* counts_E, int64_t num_experts, int64_t rank, int32_t* const* peer_counts,
                             int64_t ep, Stream stream);

// Row r < offsets_E1[E] with dest_row[r] >= 0 (-1: dropped) goes to rank e(r) / L, row dest_row[r]
// of its receive buffer: peer_bufs [ep] (device array of addresses) [*, D]. rows: R, the bound of
// dest_row. Row r is rows_RD[r], or with sorted_route (the dispatch map's [R]: the route of each
// sorted row) token row rows_RD[sorted_route[r] / top_k] of the [T, D] token rows: the dispatch
// permute fused into the store. D a multiple of 8, every row buffer 16-byte aligned.
void ep_rowwise_scatter(const uint16_t* rows_RD, const int32_t* offsets_E1, const int32_t* dest_row, int64_t rows,
                        int64_t num_experts, int64_t local_experts, int64_t d, uint16_t* const* peer_bufs, int64_t ep,
                        Stream stream, const int32_t* sorted_route = nullptr, int64_t top_k = 1);

// The reverse of the permute fused into the load: dx_TD[t] += sum over j < top_k of the row of route
// (t, j) (r = route_to_row[t * top_k + j], at rank e(r) / L, row dest_row[r]), in slot order, FP32,
// one BF16 rounding (cuda::permute_backward on the loaded rows, bit for bit); routes outside
// [0, offsets_E1[E]) or dropped add nothing.
void ep_rowwise_gather_add(const uint16_t* const* peer_bufs, const int32_t* route_to_row, const int32_t* offsets_E1,
                           const int32_t* dest_row, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                           int64_t local_experts, int64_t d, int64_t ep, uint16_t* dx_TD, Stream stream);

// The reverse: out_RD[r] = row dest_row[r] of rank e(r) / L's buffer peer_bufs[e(r) / L], zeros
// for a dropped row and for r >= offsets_E1[E] (every one of the R rows written).
void ep_rowwise_gather(const uint16_t* const* peer_bufs, const int32_t* offsets_E1, const int32_t* dest_row,
                       int64_t rows, int64_t num_experts, int64_t local_experts, int64_t d, int64_t ep,
                       uint16_t* out_RD, Stream stream);

// Traffic of the exchange for the bench (never read inside a step): with kept [ep, E] from the
// placement, slot_2 = {this rank's kept rows stored to other ranks' experts, the rows other ranks
// stored to this rank's experts}, then total_2 += slot_2 (int64). With kept null only
// total_2 += slot_2 (backward, the forward's slot).
void ep_rowwise_count_rows(const int32_t* kept, int64_t ep, int64_t rank, int64_t num_experts, int64_t* slot_2,
                           int64_t* total_2, Stream stream);

}  // namespace moe::cuda
