// Topology checks and communicator splits. ep groups: color r / ep (consecutive ranks);
// ep-dp groups: color r % ep (one rank of every ep group, same expert slice).
#include "parallel/topology.h"

#include <string>
#include <vector>

#include "core/error.h"

namespace moe {

ParallelSizes resolve_parallel(const Config& cfg, int64_t world_size) {
  const ParallelConfig& p = cfg.parallel;
  std::vector<std::string> problems;
  auto need = [&](bool ok, auto&&... parts) {
    if (!ok) problems.push_back(detail::concat(parts...));
  };
  MOE_CHECK(world_size >= 1, "world size must be >= 1, got ", world_size);
  ParallelSizes s;
  s.world = world_size;
  s.pp = p.pp;
  s.ep = p.ep;
  need(p.pp == 1, "parallel.pp = ", p.pp, ": pipeline parallelism is not available yet; set parallel.pp = 1");
  if (p.dp > 0) {
    s.dp = p.dp;
  } else {
    need(p.pp >= 1 && world_size % std::max<int64_t>(1, p.pp) == 0, "the number of ranks (", world_size,
         ") must be divisible by parallel.pp (", p.pp, "): ", world_size, " % ", p.pp, " = ",
         world_size % std::max<int64_t>(1, p.pp));
    s.dp = std::max<int64_t>(1, world_size / std::max<int64_t>(1, p.pp));
  }
  need(s.dp * s.pp == world_size, "parallel.dp x parallel.pp must equal the number of ranks: ", s.dp, " x ", s.pp,
       " = ", s.dp * s.pp, ", but the job has ", world_size, " ranks; set parallel.dp = ", world_size / std::max<int64_t>(1, s.pp),
       " (or 0) or launch ", s.dp * s.pp, " ranks");
  need(s.ep >= 1 && s.dp % std::max<int64_t>(1, s.ep) == 0, "parallel.ep (", s.ep, ") must divide dp (", s.dp, "): ",
       s.dp, " % ", s.ep, " = ", s.dp % std::max<int64_t>(1, s.ep));
  need(s.ep >= 1 && cfg.moe.num_experts % std::max<int64_t>(1, s.ep) == 0, "moe.num_experts (", cfg.moe.num_experts,
       ") must be divisible by parallel.ep (", s.ep, "): ", cfg.moe.num_experts, " % ", s.ep, " = ",
       cfg.moe.num_experts % std::max<int64_t>(1, s.ep));
  const int64_t per_step = s.dp * cfg.train.micro_batch;
  need(per_step > 0 && cfg.train.global_batch % per_step == 0,
       "train.global_batch (", cfg.train.global_batch, ") must be divisible by dp x train.micro_batch = ", s.dp,
       " x ", cfg.train.micro_batch, " = ", per_step, ": ", cfg.train.global_batch, " % ", per_step, " = ",
       per_step > 0 ? cfg.train.global_batch % per_step : 0);
  if (!problems.empty()) {
    std::string msg = "invalid parallel layout for " + std::to_string(world_size) + " rank(s):";
    for (const auto& q : problems) msg += "\n  " + q;
    MOE_FAIL(msg);
  }
  return s;
}

ExpertParallelGroups split_expert_parallel(Comm& dp_world, int64_t ep) {
  const int size = dp_world.size(), rank = dp_world.rank();
  MOE_CHECK(ep >= 1 && size % ep == 0, "parallel.ep = ", ep, " must be >= 1 and divide the ", size,
            " data-parallel ranks");
  ExpertParallelGroups g;
  g.ep = dp_world.split(int(rank / ep), rank);
  g.ep_dp = dp_world.split(int(rank % ep), rank);
  return g;
}

Topology make_topology(const Config& cfg, Comm& world) {
  Topology t;
  t.sizes = resolve_parallel(cfg, world.size());
  t.rank = world.rank();
  t.world = &world;
  const int ep = int(t.sizes.ep);
  t.dp_rank = t.rank;  // pp == 1: every rank is a data-parallel rank
  t.ep_rank = t.rank % ep;
  t.ep_dp_rank = t.rank / ep;
  t.ep_dp_size = t.sizes.dp / ep;
  t.dp_comm = world.split(0, t.rank);
  ExpertParallelGroups g = split_expert_parallel(*t.dp_comm, ep);
  t.ep_comm = std::move(g.ep);
  t.ep_dp_comm = std::move(g.ep_dp);
  MOE_CHECK(t.ep_comm->size() == ep && t.ep_comm->rank() == t.ep_rank, "expert-parallel group of rank ", t.rank,
            ": expected size ", ep, " and rank ", t.ep_rank, ", got ", t.ep_comm->size(), " and ", t.ep_comm->rank());
  MOE_CHECK(t.ep_dp_comm->size() == t.ep_dp_size && t.ep_dp_comm->rank() == t.ep_dp_rank, "expert-data-parallel ",
            "group of rank ", t.rank, ": expected size ", t.ep_dp_size, " and rank ", t.ep_dp_rank, ", got ",
            t.ep_dp_comm->size(), " and ", t.ep_dp_comm->rank());
  return t;
}

GlobalPlacement global_placement(const ParamEntry& e, int64_t ep, int64_t ep_rank) {
  GlobalPlacement g;
  g.global_shape = e.shape;
  if (e.expert && ep > 1) {
    MOE_CHECK(!e.shape.empty(), "expert tensor '", e.name, "' has no dimensions");
    g.global_shape[0] = e.shape[0] * ep;
    g.offset = ep_rank * e.numel;
  }
  return g;
}

}  // namespace moe
