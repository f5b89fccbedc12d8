// The GPU side of expert parallelism over NCCL (the all-to-all path, dropless): the handle of one
// MoE layer's exchange (the CPU's moe::EpHandle, parallel/expert_parallel.h), built on the host
// from the per-expert counts (which the host reads: this path is not sync-free and not
// capturable), the row gather that regroups received rows, and the row dispatch and combine.
// Legend: ep ranks in the group, L = E / ep local experts per rank, rows of d BF16 values. Sent
// rows are sorted by global expert (the dispatch map), so the rows for peer p (experts
// [p L, (p+1) L)) are one block; received rows arrive peer-major and are regrouped
// local-expert-major, peer-minor (expert j: peer 0's rows for j, then peer 1's, ...), the order of
// the CPU exchange (parallel/expert_parallel.h). No CUDA headers.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda/device.h"

namespace moe::cuda {

class NcclComm;

// Routing metadata of one exchange: the forward dispatch and combine and their backward reuse it.
struct EpHandle {
  int ep = 1, rank = 0;
  int64_t local_experts = 0;
  // Rows this rank sends to / receives from each peer, and where each block starts (rows).
  std::vector<int64_t> send_rows, send_offsets, recv_rows, recv_offsets;
  int64_t total_send = 0, total_recv = 0;  // T * k and G
  // Received rows of local expert j: [local_offsets[j], local_offsets[j+1]) of the regrouped
  // buffer (L + 1 entries).
  std::vector<int32_t> local_offsets;
  // regroup[i]: peer-major row of regrouped row i; ungroup[q]: regrouped row of peer-major row q (G each).
  std::vector<int32_t> regroup, ungroup;
};

// send_counts [ep * L]: this rank's routes to every global expert (the router's counts);
// recv_counts [ep * L]: entry p * L + j = routes of peer p to local expert j (the exchanged
// counts). Checks sizes, signs and int32 row indices.
EpHandle make_ep_handle(int ep, int rank, int64_t local_experts, const int32_t* send_counts,
                        const int32_t* recv_counts);

// dst[i] = src[idx[i]] (d BF16 values per row) for i < rows; idx is device int32 [rows]; an index
// outside [0, src_rows) zeroes the row. Enqueued on `stream`.
void ep_gather_rows(const uint16_t* src, const int32_t* idx, int64_t rows, int64_t src_rows, int64_t d,
                    uint16_t* dst, Stream stream);

// Dispatch: rows [total_send, d] of this rank, peer blocks at send_offsets, to `recv`
// [total_recv, d] peer-major. One grouped NCCL exchange on `stream` over `comm` (the ep group,
// size ep). The backward of a combine is a dispatch of the gradient rows.
void ep_dispatch_rows(NcclComm& comm, const EpHandle& handle, const uint16_t* send, uint16_t* recv, int64_t d,
                      Stream stream);

// Combine, the inverse of ep_dispatch_rows: `send` [total_recv, d] peer-major back to `recv`
// [total_send, d] at send_offsets. The backward of a dispatch is a combine.
void ep_combine_rows(NcclComm& comm, const EpHandle& handle, const uint16_t* send, uint16_t* recv, int64_t d,
                     Stream stream);

// Grad norm pieces under expert parallelism (one thread, fixed order, so every rank gets the same
// bits from the same inputs): out[0] = sum_i values[i]^2 (values: norms of gradient ranges), and
// out[0] = sqrt(sum_i values[i]) (values: squared norms). Device FP64 pointers.
void sum_of_squares(const double* values, int64_t n, double* out, Stream stream);
void sqrt_of_sum(const double* values, int64_t n, double* out, Stream stream);

}  // namespace moe::cuda
