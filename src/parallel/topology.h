// The parallel layout of a run: world size W = dp * pp (pp = 1 for now), dp ranks split into
// dp / ep groups of ep consecutive ranks for expert parallelism. Rank r: dp_rank = r,
// ep_rank = r % ep (which slice of the experts it holds), ep_dp_rank = r / ep (its replica of
// that slice). Communicators: dp (all ranks), ep (the ep consecutive ranks), ep-dp (the dp / ep
// ranks with the same ep_rank). Checks that need W live here; config_io cannot know W.
#pragma once

#include <cstdint>
#include <memory>

#include "core/arena.h"
#include "core/config.h"
#include "parallel/comm.h"

namespace moe {

struct ParallelSizes {
  int64_t world = 1, dp = 1, ep = 1, pp = 1;
};

// Resolves parallel.dp (0: W / pp) and checks, with the arithmetic in every message: pp == 1,
// dp * pp == W, ep divides dp, ep divides moe.num_experts, and global_batch divisible by
// dp * micro_batch. Throws moe::Error listing every problem.
ParallelSizes resolve_parallel(const Config& cfg, int64_t world_size);

struct Topology {
  ParallelSizes sizes;
  int rank = 0;
  int dp_rank = 0, ep_rank = 0, ep_dp_rank = 0;
  int64_t ep_dp_size = 1;  // dp / ep
  Comm* world = nullptr;   // not owned
  std::unique_ptr<Comm> dp_comm, ep_comm, ep_dp_comm;
};

// The two expert-parallel groups of a data-parallel world of W ranks (rank r): `ep` holds the ep
// consecutive ranks [g*ep, (g+1)*ep), g = r / ep, EP rank r % ep (one full copy of every
// expert); `ep_dp` holds the W / ep ranks with the same r % ep, which hold the same experts
// (expert gradients are summed over it). Collective over `dp_world`; checks that ep >= 1 divides
// W. make_topology splits its groups with it.
struct ExpertParallelGroups {
  std::unique_ptr<Comm> ep;
  std::unique_ptr<Comm> ep_dp;
};
ExpertParallelGroups split_expert_parallel(Comm& dp_world, int64_t ep);

// Checks the layout (resolve_parallel) and splits `world` into the three groups. Collective.
Topology make_topology(const Config& cfg, Comm& world);

// Where a parameter tensor of this rank sits in its global tensor (the one function for it: the
// model's initialisation, checkpoint slices and resume all use it). Expert entries
// (ParamEntry::expert) hold the rank's num_experts / ep experts: dim 0 of the entry is the local
// expert count, and the local tensor is the contiguous range starting at flat offset
// ep_rank * numel of the global tensor [ep * local_experts, ...], i.e. the rows of experts
// [ep_rank * local_experts, (ep_rank + 1) * local_experts). Other entries are global (offset 0).
struct GlobalPlacement {
  Shape global_shape;
  int64_t offset = 0;  // flat element offset of this rank's data in the global tensor
};
GlobalPlacement global_placement(const ParamEntry& e, int64_t ep, int64_t ep_rank);

}  // namespace moe
