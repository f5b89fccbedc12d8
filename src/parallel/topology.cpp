// Topology checks and communicator splits. dp groups: color pp_rank (the stage's consecutive
// ranks); inside a stage, ep groups: color dp_rank / ep (consecutive ranks); ep-dp groups: color
// dp_rank % ep (one rank of every ep group, same expert slice); pp groups: color dp_rank.
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
  need(p.pp >= 1, "parallel.pp must be >= 1, got ", p.pp);
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
  if (p.virtual_stages > 1 && per_step > 0 && cfg.train.global_batch % per_step == 0) {
    const int64_t micro = cfg.train.global_batch / per_step;
    need(micro % std::max<int64_t>(1, p.pp) == 0, "parallel.virtual_stages = ", p.virtual_stages,
         " (interleaved 1F1B) needs the micro-batches per step, train.global_batch / (dp x train.micro_batch) = ", micro,
         ", to be a multiple of parallel.pp = ", p.pp, ": ", micro, " % ", p.pp, " = ", micro % std::max<int64_t>(1, p.pp));
  }
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
  const int dp = int(t.sizes.dp);
  t.pp_rank = t.rank / dp;
  t.dp_rank = t.rank % dp;
  t.ep_rank = t.dp_rank % ep;
  t.ep_dp_rank = t.dp_rank / ep;
  t.ep_dp_size = t.sizes.dp / ep;
  t.stage = pipeline_stage(cfg, t.pp_rank);
  t.dp_comm = world.split(t.pp_rank, t.rank);
  t.pp_comm = world.split(t.dp_rank, t.pp_rank);
  MOE_CHECK(t.dp_comm->size() == dp && t.dp_comm->rank() == t.dp_rank && t.pp_comm->size() == t.sizes.pp &&
                t.pp_comm->rank() == t.pp_rank,
            "data-parallel / pipeline groups of rank ", t.rank, ": expected sizes ", dp, " / ", t.sizes.pp,
            " and ranks ", t.dp_rank, " / ", t.pp_rank, ", got ", t.dp_comm->size(), " / ", t.pp_comm->size(), " and ",
            t.dp_comm->rank(), " / ", t.pp_comm->rank());
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

std::vector<int64_t> stage_bounds(const Config& cfg) {
  const int64_t stages = cfg.parallel.pp * cfg.parallel.virtual_stages, layers = cfg.model.n_layers;
  MOE_CHECK(stages >= 1 && stages <= layers, "parallel.pp x parallel.virtual_stages = ", cfg.parallel.pp, " x ",
            cfg.parallel.virtual_stages, " = ", stages, " model stages must be in [1, model.n_layers = ", layers, "]");
  std::vector<int64_t> b = {0};
  if (!cfg.parallel.pp_layers.empty()) {
    MOE_CHECK(int64_t(cfg.parallel.pp_layers.size()) == stages, "parallel.pp_layers lists ",
              cfg.parallel.pp_layers.size(), " stages, expected parallel.pp x parallel.virtual_stages = ", stages);
    for (int64_t n : cfg.parallel.pp_layers) {
      MOE_CHECK(n >= 1, "parallel.pp_layers: every stage needs >= 1 layer, got ", n);
      b.push_back(b.back() + n);
    }
    MOE_CHECK(b.back() == layers, "parallel.pp_layers must sum to model.n_layers = ", layers, ", got ", b.back());
    return b;
  }
  for (int64_t k = 0; k < stages; ++k) b.push_back(b.back() + layers / stages + (k < layers % stages ? 1 : 0));
  return b;
}

bool PipelineStage::holds_layer(int64_t l) const {
  for (size_t v = 0; v < first.size(); ++v)
    if (l >= first[v] && l < last[v]) return true;
  return false;
}

PipelineStage pipeline_stage(const Config& cfg, int64_t pp_rank) {
  PipelineStage s;
  s.pp = cfg.parallel.pp;
  s.virtual_stages = cfg.parallel.virtual_stages;
  s.pp_rank = pp_rank;
  MOE_CHECK(pp_rank >= 0 && pp_rank < s.pp, "pipeline rank ", pp_rank, " is not in [0, parallel.pp = ", s.pp, ")");
  const std::vector<int64_t> b = stage_bounds(cfg);
  for (int64_t v = 0; v < s.virtual_stages; ++v) {
    const int64_t k = s.model_stage(v);
    s.first.push_back(b[size_t(k)]);
    s.last.push_back(b[size_t(k) + 1]);
  }
  s.embed = pp_rank == 0;
  s.head = s.model_stage(s.virtual_stages - 1) == s.pp * s.virtual_stages - 1;
  return s;
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
