// Expert parallelism (EP) over host all-to-all: the E experts of every MoE layer are split over
// the `ep` ranks of an EP group, rank i holding experts [i*E/ep, (i+1)*E/ep). Token rows travel
// to their experts' ranks and back (dropless): rows sorted by global expert leave as contiguous
// per-peer blocks, arrive peer-major and are regrouped local-expert-major (peer-minor) for the
// grouped experts; combine is the exact inverse. Backward of dispatch is combine and vice versa.
// The experts that run between dispatch and combine are model code (model/ep_experts.h).
#pragma once

#include <cstdint>
#include <vector>

#include "core/moe_types.h"
#include "parallel/comm.h"

namespace moe {

// This rank's place in its EP group (Topology::ep_comm, or split_expert_parallel's `ep`).
// `group` is not owned and must outlive every user.
struct ExpertParallel {
  Comm* group = nullptr;
  int64_t num_experts = 0;
  bool rowwise = false;          // parallel.ep_backend = "rowwise": ep_rowwise_handle instead of ep_exchange_counts
  double capacity_factor = 0.0;  // rowwise: parallel.ep_capacity_factor (0: dropless)

  int size() const { return group->size(); }
  int rank() const { return group->rank(); }
  int64_t local_experts() const { return num_experts / group->size(); }
  int64_t first_expert() const { return rank() * local_experts(); }
  // The EP rank that holds global expert `e`.
  int owner(int64_t e) const { return static_cast<int>(e / local_experts()); }
  ExpertSlice slice() const { return {first_expert(), local_experts()}; }
};

// Checks that group.size() divides num_experts.
ExpertParallel make_expert_parallel(Comm& group, int64_t num_experts);

// Routing metadata of one exchange, built from this rank's per-expert row counts; forward
// dispatch, forward combine and their backward reuse it.
struct EpHandle {
  int64_t num_rows = 0;                    // rows this rank sends (sum of its counts over all E)
  int64_t num_recv_rows = 0;               // rows this rank's experts receive
  std::vector<int64_t> num_rows_per_rank;  // [ep] rows sent to each peer
  std::vector<int64_t> num_recv_rows_per_rank;  // [ep] rows received from each peer
  // [ep * L] rows peer p sends to local expert j, at p * L + j (L = E/ep).
  std::vector<int64_t> num_recv_tokens_per_expert;
  // [L + 1] prefix sums of the grouped layout: local expert j owns grouped rows
  // [local_offsets[j], local_offsets[j+1]), peer 0's rows first, each peer's in its send order.
  std::vector<int32_t> local_offsets;
  // [num_recv_rows] for each grouped row, its row in the peer-major receive buffer.
  std::vector<int32_t> grouped_to_recv;
  // The rowwise exchange when it dropped rows (num_dropped > 0): the rows of x_sorted that are
  // sent, in order; the others are dropped (their output and input gradient are 0).
  std::vector<int32_t> send_rows;
  int64_t num_dropped = 0;  // rows of this rank dropped at their expert's rank
};

// The rowwise placement (parallel.ep_backend = "rowwise"), a pure function every rank of the
// group computes alike from the group's per-expert counts: counts_all [ep, E], row p the rows
// rank p routes to each global expert (its rows sorted by global expert, in route order). Expert
// e (on rank q = e / L, local expert j = e % L) takes its rows source rank by source rank, each
// rank's in route order, up to `capacity` rows (capacity <= 0: all: dropless); the rest are
// dropped. The receive buffer of rank q holds its kept rows grouped by local expert (j major,
// source rank minor, route order within): the grouped layout of the all-to-all backend, so with
// nothing dropped the two backends place every row alike.
struct EpPlacement {
  std::vector<int64_t> kept;           // [ep, E] rows of rank p kept by expert e
  std::vector<int32_t> dest_row;       // [rows of `rank`] each row's row in its expert rank's receive buffer; -1: dropped
  std::vector<int32_t> local_offsets;  // [L + 1] `rank`'s receive buffer: local expert j owns [off[j], off[j+1])
  int64_t num_dropped = 0;             // rows of `rank` dropped
};
EpPlacement ep_rowwise_placement(const std::vector<int64_t>& counts_all, int64_t ep, int64_t rank,
                                 int64_t num_experts, int64_t capacity);

// Collective (all-gather of the E counts of every rank), then ep_rowwise_placement: the handle of
// the rowwise backend for ep_dispatch / ep_combine; capacity as there.
EpHandle ep_rowwise_handle(const ExpertParallel& ep, const int32_t* counts_E, int64_t capacity);

// Collective (all_to_all of L counts per peer). counts_E: this rank's rows per global expert
// (rows ordered by global expert, as build_dispatch_map sorts them).
EpHandle ep_exchange_counts(const ExpertParallel& ep, const int32_t* counts_E);

// Collective. x_sorted [num_rows, d] ordered by global expert -> x_grouped [num_recv_rows, d]
// in the grouped layout of the handle (with h.send_rows: only those rows travel).
void ep_dispatch(const ExpertParallel& ep, const EpHandle& h, const float* x_sorted, int64_t d, float* x_grouped);

// Collective, the inverse of ep_dispatch: y_grouped [num_recv_rows, d] -> y_sorted [num_rows, d]
// back in the sender's order (with h.send_rows: the dropped rows of y_sorted are 0).
void ep_combine(const ExpertParallel& ep, const EpHandle& h, const float* y_grouped, int64_t d, float* y_sorted);

}  // namespace moe
