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
};

// Collective (all_to_all of L counts per peer). counts_E: this rank's rows per global expert
// (rows ordered by global expert, as build_dispatch_map sorts them).
EpHandle ep_exchange_counts(const ExpertParallel& ep, const int32_t* counts_E);

// Collective. x_sorted [num_rows, d] ordered by global expert -> x_grouped [num_recv_rows, d]
// in the grouped layout of the handle.
void ep_dispatch(const ExpertParallel& ep, const EpHandle& h, const float* x_sorted, int64_t d, float* x_grouped);

// Collective, the inverse of ep_dispatch: y_grouped [num_recv_rows, d] -> y_sorted [num_rows, d]
// back in the sender's order.
void ep_combine(const ExpertParallel& ep, const EpHandle& h, const float* y_grouped, int64_t d, float* y_sorted);

}  // namespace moe
