// The parallel layout of a run: world size W = pp * dp, pipeline outermost. Rank r sits in
// pipeline stage pp_rank = r / dp with dp_rank = r % dp; the dp ranks of a stage split into
// dp / ep groups of ep consecutive ranks for expert parallelism: ep_rank = dp_rank % ep (which
// slice of the experts it holds), ep_dp_rank = dp_rank / ep (its replica of that slice).
// Communicators: dp (the dp ranks of this stage), ep (the ep consecutive ranks), ep-dp (the
// dp / ep ranks of the stage with the same ep_rank), pp (the pp ranks with this dp_rank, one per
// stage, ordered by stage). Checks that need W live here; config_io cannot know W.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/arena.h"
#include "core/config.h"
#include "parallel/comm.h"

namespace moe {

struct ParallelSizes {
  int64_t world = 1, dp = 1, ep = 1, pp = 1;
};

// Resolves parallel.dp (0: W / pp) and checks, with the arithmetic in every message:
// dp * pp == W, ep divides dp, ep divides moe.num_experts, and global_batch divisible by
// dp * micro_batch. Throws moe::Error listing every problem.
ParallelSizes resolve_parallel(const Config& cfg, int64_t world_size);

// Layer boundaries of the pp x virtual_stages model stages: stage k holds layers
// [bounds[k], bounds[k + 1]) (bounds[0] = 0, the last = model.n_layers). parallel.pp_layers when
// set (config_io checked it), else an even split with the remainder on the first stages.
std::vector<int64_t> stage_bounds(const Config& cfg);

// What one pipeline rank runs: its virtual stages (model stage v * pp + pp_rank for v < V), their
// layers, and whether it holds the embedding (model stage 0) and the final norm + LM head (the
// last model stage).
struct PipelineStage {
  int64_t pp = 1, virtual_stages = 1, pp_rank = 0;
  std::vector<int64_t> first, last;  // per virtual stage: layers [first[v], last[v])
  bool embed = true, head = true;
  // Model stage of virtual stage v, and whether layer l belongs to this rank.
  int64_t model_stage(int64_t v) const { return v * pp + pp_rank; }
  bool holds_layer(int64_t l) const;
};
PipelineStage pipeline_stage(const Config& cfg, int64_t pp_rank);

struct Topology {
  ParallelSizes sizes;
  int rank = 0;
  int pp_rank = 0, dp_rank = 0, ep_rank = 0, ep_dp_rank = 0;
  int64_t ep_dp_size = 1;  // dp / ep
  Comm* world = nullptr;   // not owned
  std::unique_ptr<Comm> dp_comm, ep_comm, ep_dp_comm, pp_comm;
  PipelineStage stage;
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
