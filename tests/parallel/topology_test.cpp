// Layout checks with their arithmetic (pure: any world size), the group splits on the world the
// suite runs on, and the ZeRO-1 optimizer against the replicated AdamW on the same gradients.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/arena.h"
#include "optim/adamw.h"
#include "optim/zero1.h"
#include "parallel/mpi_test_util.h"
#include "parallel/topology.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

Config layout_config(int64_t dp, int64_t ep) {
  Config c;
  c.parallel.dp = dp;
  c.parallel.ep = ep;
  return c;
}

TEST(Topology, ResolvesDpFromWorldSize) {
  Config c = layout_config(0, 1);
  c.train.global_batch = 32;
  c.train.micro_batch = 2;
  const ParallelSizes s = resolve_parallel(c, 4);
  EXPECT_EQ(s.dp, 4);
  EXPECT_EQ(s.ep, 1);
  EXPECT_EQ(s.world, 4);
}

TEST(Topology, MessagesShowTheArithmetic) {
  EXPECT_CONTAINS(error_of([] { resolve_parallel(layout_config(4, 1), 2); }),
                  "parallel.dp x parallel.pp must equal the number of ranks: 4 x 1 = 4, but the job has 2 ranks");
  Config c = layout_config(0, 3);
  c.moe.num_experts = 6;
  c.train.global_batch = 32;
  c.train.micro_batch = 2;
  EXPECT_CONTAINS(error_of([&] { resolve_parallel(c, 4); }), "parallel.ep (3) must divide dp (4): 4 % 3 = 1");
  c = layout_config(0, 4);
  c.moe.num_experts = 6;
  c.train.global_batch = 32;
  c.train.micro_batch = 2;
  EXPECT_CONTAINS(error_of([&] { resolve_parallel(c, 4); }), "moe.num_experts (6) must be divisible by parallel.ep (4): 6 % 4 = 2");
  c = layout_config(0, 1);
  c.train.global_batch = 16;
  c.train.micro_batch = 8;
  EXPECT_CONTAINS(error_of([&] { resolve_parallel(c, 4); }),
                  "train.global_batch (16) must be divisible by dp x train.micro_batch = 4 x 8 = 32: 16 % 32 = 16");
  c = layout_config(0, 1);
  c.parallel.pp = 2;
  EXPECT_CONTAINS(error_of([&] { resolve_parallel(c, 3); }),
                  "the number of ranks (3) must be divisible by parallel.pp (2): 3 % 2 = 1");
  c.parallel.virtual_stages = 2;
  c.train.global_batch = 6;
  c.train.micro_batch = 2;
  EXPECT_CONTAINS(error_of([&] { resolve_parallel(c, 2); }),
                  "parallel.virtual_stages = 2 (interleaved 1F1B) needs the micro-batches per step, train.global_batch "
                  "/ (dp x train.micro_batch) = 3, to be a multiple of parallel.pp = 2: 3 % 2 = 1");
}

// pp = 2: stage-major ranks (stage r / dp), dp groups inside a stage, one rank per stage in each
// pipeline group; layers split evenly or by parallel.pp_layers.
TEST(Topology, PipelineGroupsOnTheWorld) {
  Comm& w = world_comm();
  const int n = w.size();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  Config c = layout_config(0, 1);
  c.model.n_layers = 5;
  c.parallel.pp = 2;
  c.train.global_batch = 4 * n;
  c.train.micro_batch = 2;
  const Topology t = make_topology(c, w);
  const int dp = n / 2;
  EXPECT_EQ(t.sizes.dp, dp);
  EXPECT_EQ(t.pp_rank, w.rank() / dp);
  EXPECT_EQ(t.dp_rank, w.rank() % dp);
  EXPECT_EQ(t.pp_comm->size(), 2);
  EXPECT_EQ(t.pp_comm->rank(), t.pp_rank);
  EXPECT_EQ(t.dp_comm->size(), dp);
  EXPECT_EQ(stage_bounds(c), (std::vector<int64_t>{0, 3, 5}));
  EXPECT_EQ(t.stage.first, (std::vector<int64_t>{t.pp_rank == 0 ? 0 : 3}));
  EXPECT_EQ(t.stage.embed, t.pp_rank == 0);
  EXPECT_EQ(t.stage.head, t.pp_rank == 1);
  c.parallel.pp_layers = {1, 4};
  EXPECT_EQ(stage_bounds(c), (std::vector<int64_t>{0, 1, 5}));
  c.parallel.pp_layers = {};
  c.parallel.virtual_stages = 2;
  c.model.n_layers = 8;
  EXPECT_EQ(stage_bounds(c), (std::vector<int64_t>{0, 2, 4, 6, 8}));
  const PipelineStage s1 = pipeline_stage(c, 1);  // model stages 1 and 3
  EXPECT_EQ(s1.first, (std::vector<int64_t>{2, 6}));
  EXPECT_EQ(s1.last, (std::vector<int64_t>{4, 8}));
  EXPECT_FALSE(s1.embed);
  EXPECT_TRUE(s1.head);
  EXPECT_TRUE(s1.holds_layer(7));
  EXPECT_FALSE(s1.holds_layer(4));
}

// ep groups are consecutive ranks; ep-dp groups take one rank of each (same expert slice).
TEST(Topology, GroupsOnTheWorld) {
  Comm& w = world_comm();
  const int n = w.size();
  for (int64_t ep : {int64_t(1), int64_t(2)}) {
    if (n % ep != 0) continue;
    Config c = layout_config(0, ep);
    c.train.global_batch = 4 * n;
    c.train.micro_batch = 2;
    const Topology t = make_topology(c, w);
    EXPECT_EQ(t.sizes.dp, n);
    EXPECT_EQ(t.ep_rank, w.rank() % ep);
    std::vector<int64_t> ep_members(static_cast<size_t>(ep)), ep_dp_members(static_cast<size_t>(n / ep));
    int64_t me = w.rank();
    t.ep_comm->all_gather(&me, ep_members.data(), 1);
    t.ep_dp_comm->all_gather(&me, ep_dp_members.data(), 1);
    for (int64_t k = 0; k < ep; ++k) EXPECT_EQ(ep_members[size_t(k)], w.rank() / ep * ep + k);
    for (int64_t k = 0; k < n / ep; ++k) EXPECT_EQ(ep_dp_members[size_t(k)], w.rank() % ep + k * ep);
    EXPECT_EQ(t.dp_comm->size(), n);
  }
}

ParamLayout test_layout() {
  ParamLayout l;
  l.add("a", {7, 5});
  l.add("norm", {5}, /*decay=*/false);
  l.add("experts", {4, 3, 5}, true, /*expert=*/true);
  l.add("b", {13});
  return l;
}

TEST(ShardPlan, PiecesTileThePackedGroup) {
  const ParamLayout l = test_layout();
  for (int size : {1, 2, 3, 4, 7}) {
    ShardPlan plan(l, {0, 1, 2, 3}, size, 0);
    EXPECT_EQ(plan.numel(), 35 + 5 + 60 + 13);
    EXPECT_EQ(plan.padded_numel() % size, 0);
    int64_t covered = 0;
    for (int r = 0; r < size; ++r)
      for (const ShardPiece& p : plan.pieces(r)) {
        EXPECT_LE(p.shard_offset + p.numel, plan.shard_numel());
        covered += p.numel;
      }
    EXPECT_EQ(covered, plan.numel()) << size;
    std::vector<float> flat(size_t(l.total_numel()), 0.f), packed(size_t(plan.padded_numel())), back(flat.size(), 0.f);
    for (const ParamEntry& e : l.entries())
      for (int64_t i = 0; i < e.numel; ++i) flat[size_t(e.offset + i)] = float(e.offset + i + 1);
    plan.pack(flat.data(), packed.data());
    plan.unpack(packed.data(), back.data());
    EXPECT_EQ(back, flat);
  }
}

// Gradients of rank r are a seeded function of r, so every rank can form the summed gradient
// and run the replicated AdamW as the reference. Expert gradients sum only over the ep-dp group.
TEST(DistOptimizer, MatchesReplicatedAdamW) {
  Comm& w = world_comm();
  const int n = w.size();
  const ParamLayout l = test_layout();
  for (int64_t ep : {int64_t(1), int64_t(2)}) {
    if (n % ep != 0) continue;
    std::unique_ptr<Comm> ep_dp = ep > 1 ? w.split(w.rank() % int(ep), w.rank()) : nullptr;
    OptimConfig oc;
    oc.grad_clip = 0.5;  // the norm of these gradients is larger: clipping runs
    auto grads_of = [&](int r, int step) {
      std::mt19937 rng(1000 * r + step);
      std::normal_distribution<float> nd(0.f, 1.f);
      std::vector<float> g(size_t(l.total_numel()), 0.f);
      for (const ParamEntry& e : l.entries())
        for (int64_t i = 0; i < e.numel; ++i) g[size_t(e.offset + i)] = nd(rng);
      return g;
    };
    std::vector<float> p_ref(size_t(l.total_numel()), 0.f);
    for (const ParamEntry& e : l.entries())
      for (int64_t i = 0; i < e.numel; ++i) p_ref[size_t(e.offset + i)] = 0.01f * float(i % 11) - 0.03f;
    std::vector<float> p_dist = p_ref;
    AdamW ref(l, oc);
    DistOptimizer dist(l, oc, w, ep_dp.get());
    for (int step = 0; step < 3; ++step) {
      // Reference: dense gradients summed over all ranks, expert ones over ranks with my ep_rank.
      std::vector<float> sum(size_t(l.total_numel()), 0.f);
      for (int r = 0; r < n; ++r) {
        const std::vector<float> g = grads_of(r, step);
        for (const ParamEntry& e : l.entries())
          if (!e.expert || r % ep == w.rank() % ep)
            for (int64_t i = 0; i < e.numel; ++i) sum[size_t(e.offset + i)] += g[size_t(e.offset + i)];
      }
      // Every element counted once: dense ones, and the expert ones of each ep slice.
      double sq = 0;
      for (const ParamEntry& e : l.entries())
        for (int64_t i = 0; i < e.numel; ++i) sq += double(sum[size_t(e.offset + i)]) * sum[size_t(e.offset + i)];
      if (ep > 1) {
        double dense_sq = 0, expert_sq = 0;
        for (const ParamEntry& e : l.entries())
          for (int64_t i = 0; i < e.numel; ++i)
            (e.expert ? expert_sq : dense_sq) += double(sum[size_t(e.offset + i)]) * sum[size_t(e.offset + i)];
        std::vector<double> per_slice(size_t(n), 0.0);
        per_slice[size_t(w.rank())] = w.rank() < ep ? expert_sq : 0.0;  // one rank per ep slice reports it
        w.all_reduce(per_slice.data(), n, ReduceOp::kSum);
        sq = dense_sq;
        for (double x : per_slice) sq += x;
      }
      const double norm_ref = std::sqrt(sq);
      clip_grads(sum.data(), l.total_numel(), norm_ref, oc.grad_clip);
      ref.step(p_ref.data(), sum.data(), 1e-2);

      const std::vector<float> mine = grads_of(w.rank(), step);
      dist.reduce_gradients(mine.data());
      double dsq = dist.local_sum_squares();
      w.all_reduce(&dsq, 1, ReduceOp::kSum);
      // FP32 sums over more than 2 ranks may run in another order than the reference's: rounding.
      EXPECT_NEAR(std::sqrt(dsq), norm_ref, 1e-6 * norm_ref) << "step " << step << " ep " << ep;
      dist.step(p_dist.data(), 1e-2, std::sqrt(dsq));
      double worst = 0;
      for (size_t i = 0; i < p_ref.size(); ++i) worst = std::max(worst, double(std::abs(p_ref[i] - p_dist[i])));
      EXPECT_LT(worst, 1e-6) << "step " << step << " ep " << ep;
    }
    EXPECT_EQ(dist.steps_taken(), 3);
  }
}

}  // namespace
}  // namespace moe::testing
