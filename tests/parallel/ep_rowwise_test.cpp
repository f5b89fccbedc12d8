// The rowwise expert exchange (parallel.ep_backend = "rowwise") on the CPU: its placement as a
// pure function (a hand-worked case and the layout's invariants on random counts), and the
// exchange on thread ranks against the all-to-all backend (bitwise, dropless) and, with a
// capacity, against one process that runs the EP group's tokens concatenated in rank order with
// cpu::apply_capacity at the same capacity: the same rows dropped, the same outputs and gradients.
// Under mpirun with more than one rank the thread variants skip (the placement tests still run).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "cpu/capacity.h"
#include "ep_cases.h"
#include "cpu/dispatch.h"
#include "cpu/experts.h"
#include "ep_check.h"
#include "ep_thread_comm.h"
#include "model/ep_experts.h"
#include "parallel/expert_parallel.h"
#include "parallel/topology.h"

namespace moe::testing {
namespace {

// ep 2, E 4 (L 2): rank 0 routes [3, 1, 0, 2] rows to experts 0..3, rank 1 [1, 2, 4, 0].
const std::vector<int64_t> kCounts = {3, 1, 0, 2, 1, 2, 4, 0};

TEST(EpRowwisePlacement, HandWorkedCaseDropless) {
  const EpPlacement r0 = ep_rowwise_placement(kCounts, 2, 0, 4, 0);
  // Rank 0's buffer: expert 0 from rank 0 (rows 0-2) then rank 1 (3); expert 1 from rank 0 (4),
  // rank 1 (5, 6). Rank 1's buffer: expert 2 from rank 1 (0-3); expert 3 from rank 0 (4, 5).
  EXPECT_EQ(r0.dest_row, (std::vector<int32_t>{0, 1, 2, 4, 4, 5}));
  EXPECT_EQ(r0.local_offsets, (std::vector<int32_t>{0, 4, 7}));
  EXPECT_EQ(r0.num_dropped, 0);
  const EpPlacement r1 = ep_rowwise_placement(kCounts, 2, 1, 4, 0);
  EXPECT_EQ(r1.dest_row, (std::vector<int32_t>{3, 5, 6, 0, 1, 2, 3}));
  EXPECT_EQ(r1.local_offsets, (std::vector<int32_t>{0, 4, 6}));
  EXPECT_EQ(r1.kept, kCounts);
}

TEST(EpRowwisePlacement, HandWorkedCaseWithCapacity) {
  // Capacity 2 per expert, taken source rank by source rank: expert 0 keeps rank 0's first two,
  // expert 1 one of each, expert 2 rank 1's first two, expert 3 rank 0's two.
  const EpPlacement r0 = ep_rowwise_placement(kCounts, 2, 0, 4, 2);
  EXPECT_EQ(r0.kept, (std::vector<int64_t>{2, 1, 0, 2, 0, 1, 2, 0}));
  EXPECT_EQ(r0.dest_row, (std::vector<int32_t>{0, 1, -1, 2, 2, 3}));
  EXPECT_EQ(r0.local_offsets, (std::vector<int32_t>{0, 2, 4}));
  EXPECT_EQ(r0.num_dropped, 1);
  const EpPlacement r1 = ep_rowwise_placement(kCounts, 2, 1, 4, 2);
  EXPECT_EQ(r1.dest_row, (std::vector<int32_t>{-1, 3, -1, 0, 1, -1, -1}));
  EXPECT_EQ(r1.local_offsets, (std::vector<int32_t>{0, 2, 4}));
  EXPECT_EQ(r1.num_dropped, 4);
  EXPECT_THROW(ep_rowwise_placement(kCounts, 3, 0, 4, 0), Error);  // 3 does not divide 4
  EXPECT_THROW(ep_rowwise_placement({1, 2}, 2, 0, 4, 0), Error);   // too few counts
}

// On random counts: each destination's buffer is exactly tiled by the kept rows of every source
// (no row twice, none outside its expert's range), no expert keeps more than the capacity, and
// every row beyond it is dropped.
TEST(EpRowwisePlacement, BuffersAreTiledAndCapacityHolds) {
  std::mt19937_64 gen(3);
  for (const int64_t ep : {1, 2, 4}) {
    for (const int64_t capacity : {0, 1, 5, 40}) {
      const int64_t E = 8, L = E / ep;
      std::vector<int64_t> counts(ep * E);
      for (int64_t& c : counts) c = int64_t(gen() % 13);
      std::vector<std::set<int32_t>> used(ep);
      std::vector<EpPlacement> pl;
      for (int64_t r = 0; r < ep; ++r) pl.push_back(ep_rowwise_placement(counts, ep, r, E, capacity));
      for (int64_t r = 0; r < ep; ++r) {
        int64_t row = 0, dropped = 0;
        for (int64_t e = 0; e < E; ++e) {
          const int64_t q = e / L, j = e % L;
          for (int64_t i = 0; i < counts[r * E + e]; ++i, ++row) {
            const int32_t dst = pl[r].dest_row[row];
            if (dst < 0) {
              ++dropped;
              continue;
            }
            EXPECT_GE(dst, pl[q].local_offsets[j]) << "ep " << ep << " cap " << capacity;
            EXPECT_LT(dst, pl[q].local_offsets[j + 1]) << "ep " << ep << " cap " << capacity;
            EXPECT_TRUE(used[q].insert(dst).second) << "row " << dst << " of rank " << q << " placed twice";
          }
        }
        EXPECT_EQ(dropped, pl[r].num_dropped);
        if (capacity == 0) {
          EXPECT_EQ(dropped, 0);
        }
      }
      for (int64_t e = 0; e < E; ++e) {
        int64_t kept = 0, routed = 0;
        for (int64_t p = 0; p < ep; ++p) kept += pl[0].kept[p * E + e], routed += counts[p * E + e];
        EXPECT_EQ(kept, capacity > 0 ? std::min(routed, capacity) : routed) << "expert " << e;
      }
      for (int64_t q = 0; q < ep; ++q)
        EXPECT_EQ(int64_t(used[q].size()), int64_t(pl[q].local_offsets[L])) << "rank " << q << " tiled";
    }
  }
}

// One MoE expert path on thread ranks: this rank's tokens through ep_experts_forward/backward,
// with `backend` (rowwise or all-to-all) and capacity factor `cf`; returns this rank's combine
// output, input gradient and the handle.
struct PathResult {
  std::vector<float> out, dx;
  int64_t dropped = 0;
};

constexpr int64_t kE = 8, kK = 2, kD = 8, kI = 6, kTokens = 24;

// Rank `rank`'s routing (skewed towards the low experts, so a capacity drops; distinct slots per
// token) into idx [kTokens * kK], and its input rows and output gradients into x, dout.
void rank_problem(int64_t rank, int32_t* idx, float* x, float* dout) {
  std::mt19937_64 gen(100 + uint64_t(rank));
  for (int64_t t = 0; t < kTokens; ++t) {
    idx[t * kK] = int32_t(gen() % 3);
    idx[t * kK + 1] = int32_t(3 + gen() % (kE - 3));
  }
  const std::vector<float> xv = normal_values(kTokens * kD, "x" + std::to_string(rank), 1.0);
  const std::vector<float> dv = normal_values(kTokens * kD, "dout" + std::to_string(rank), 1.0);
  std::copy(xv.begin(), xv.end(), x);
  std::copy(dv.begin(), dv.end(), dout);
}

PathResult run_path(Comm& world, int64_t ep_size, bool rowwise, double cf) {
  ExpertParallelGroups groups = split_expert_parallel(world, ep_size);
  ExpertParallel ep = make_expert_parallel(*groups.ep, kE);
  ep.rowwise = rowwise;
  ep.capacity_factor = cf;
  std::vector<int32_t> idx(kTokens * kK);
  std::vector<float> x(kTokens * kD), dout(kTokens * kD);
  rank_problem(world.rank(), idx.data(), x.data(), dout.data());
  std::vector<float> topk_w(kTokens * kK, 0.5f);
  const std::vector<float> wgu = normal_values(kE * 2 * kI * kD, "w_gate_up", 0.3);
  const std::vector<float> wdn = normal_values(kE * kD * kI, "w_down", 0.3);
  const int64_t L = ep.local_experts(), first = ep.first_expert(), R = kTokens * kK;
  std::vector<int32_t> cnt(kE), off(kE + 1), sorted(R), to_row(R);
  cpu::build_dispatch_map(idx.data(), kTokens, kK, kE, cnt.data(), off.data(), sorted.data(), to_row.data());
  std::vector<float> xs(R * kD), ys(R * kD);
  cpu::permute_forward(x.data(), sorted.data(), R, kK, kD, xs.data());
  const std::vector<float> lwgu(wgu.begin() + first * 2 * kI * kD, wgu.begin() + (first + L) * 2 * kI * kD);
  const std::vector<float> lwdn(wdn.begin() + first * kD * kI, wdn.begin() + (first + L) * kD * kI);
  EpExpertsSaved saved;
  ep_experts_forward(ep, xs.data(), cnt.data(), lwgu.data(), lwdn.data(), kD, kI, saved, ys.data());
  PathResult r;
  r.out.assign(kTokens * kD, 0.f);
  cpu::unpermute_forward(ys.data(), to_row.data(), topk_w.data(), kTokens, kK, kD, r.out.data());
  std::vector<float> dys(R * kD), dtw(kTokens * kK), dxs(R * kD), dwgu(lwgu.size(), 0.f), dwdn(lwdn.size(), 0.f);
  cpu::unpermute_backward(dout.data(), ys.data(), to_row.data(), topk_w.data(), kTokens, kK, kD, R, dys.data(),
                          dtw.data());
  ep_experts_backward(ep, saved, lwgu.data(), lwdn.data(), dys.data(), kD, kI, dxs.data(), dwgu.data(), dwdn.data());
  r.dx.assign(kTokens * kD, 0.f);
  cpu::permute_backward(dxs.data(), sorted.data(), R, kK, kD, r.dx.data());
  r.dropped = saved.handle.num_dropped;
  return r;
}

// The same tokens of the whole EP group in one process, rank by rank, with cpu::apply_capacity at
// the rowwise capacity ceil(cf x group rows / E): this rank's slice of the output and dx.
PathResult run_reference(int me, int64_t ep_size, double cf) {
  const int64_t g0 = (me / ep_size) * ep_size, n = ep_size * kTokens, R = n * kK;
  std::vector<int32_t> idx(R);
  std::vector<float> x(n * kD), dout(n * kD);
  for (int64_t p = 0; p < ep_size; ++p)
    rank_problem(g0 + p, idx.data() + p * kTokens * kK, x.data() + p * kTokens * kD, dout.data() + p * kTokens * kD);
  std::vector<float> topk_w(R, 0.5f);
  const std::vector<float> wgu = normal_values(kE * 2 * kI * kD, "w_gate_up", 0.3);
  const std::vector<float> wdn = normal_values(kE * kD * kI, "w_down", 0.3);
  std::vector<int32_t> cnt(kE), off(kE + 1), sorted(R), to_row(R), kept(kE);
  cpu::build_dispatch_map(idx.data(), n, kK, kE, cnt.data(), off.data(), sorted.data(), to_row.data());
  PathResult ref;
  int64_t rows = R;
  if (cf > 0) {
    const int64_t cap = static_cast<int64_t>(std::ceil(cf * double(R) / double(kE)));
    cpu::apply_capacity(cap, n, kK, kE, off.data(), sorted.data(), to_row.data(), kept.data());
    rows = off[kE];
  }
  std::vector<float> xs(rows * kD), gu(rows * 2 * kI), h(rows * kI), ys(rows * kD), out(n * kD);
  cpu::permute_forward(x.data(), sorted.data(), rows, kK, kD, xs.data());
  cpu::experts_forward(xs.data(), off.data(), wgu.data(), wdn.data(), kE, kD, kI, gu.data(), h.data(), ys.data());
  cpu::unpermute_forward(ys.data(), to_row.data(), topk_w.data(), n, kK, kD, out.data());
  std::vector<float> dys(rows * kD), dtw(R), dxs(rows * kD), scratch(rows * 3 * kI), dx(n * kD, 0.f);
  std::vector<float> dwgu(wgu.size(), 0.f), dwdn(wdn.size(), 0.f);
  cpu::unpermute_backward(dout.data(), ys.data(), to_row.data(), topk_w.data(), n, kK, kD, rows, dys.data(), dtw.data());
  cpu::experts_backward(xs.data(), off.data(), wgu.data(), wdn.data(), gu.data(), h.data(), dys.data(), kE, kD, kI,
                        dxs.data(), dwgu.data(), dwdn.data(), scratch.data());
  cpu::permute_backward(dxs.data(), sorted.data(), rows, kK, kD, dx.data());
  const int64_t p = me - g0;
  ref.out.assign(out.begin() + p * kTokens * kD, out.begin() + (p + 1) * kTokens * kD);
  ref.dx.assign(dx.begin() + p * kTokens * kD, dx.begin() + (p + 1) * kTokens * kD);
  for (int64_t r = p * kTokens * kK; r < (p + 1) * kTokens * kK; ++r) ref.dropped += to_row[r] < 0 ? 1 : 0;
  return ref;
}

TEST(EpRowwise, MatchesAllToAllAndFollowsTheCapacityRule) {
  if (world_comm().size() > 1) GTEST_SKIP() << "thread-rank test";
  for (const auto& [world, ep] : {std::pair<int, int64_t>{2, 2}, {4, 2}, {4, 4}}) {
    run_thread_ranks(world, [&, ep = ep](Comm& comm) {
      const std::string tag = rank_tag(comm) + "world " + std::to_string(comm.size()) + " ep " + std::to_string(ep);
      const PathResult a2a = run_path(comm, ep, false, 0.0), row = run_path(comm, ep, true, 0.0);
      EXPECT_EQ(row.out, a2a.out) << tag << ": dropless rowwise output equals all-to-all bitwise";
      EXPECT_EQ(row.dx, a2a.dx) << tag;
      EXPECT_EQ(row.dropped, 0) << tag;
      for (const double cf : {1.0, 1.5}) {
        const PathResult cap = run_path(comm, ep, true, cf);
        const PathResult ref = run_reference(comm.rank(), ep, cf);
        EXPECT_EQ(cap.dropped, ref.dropped) << tag << " cf " << cf;
        expect_parity(tag + " capacity output", cap.out, ref.out, kEpTol);
        expect_parity(tag + " capacity dx", cap.dx, ref.dx, kEpTol);
      }
      // The skewed routing must make capacity 1.0 drop somewhere in the group.
      int64_t dropped = run_path(comm, ep, true, 1.0).dropped;
      comm.all_reduce(&dropped, 1, ReduceOp::kSum);
      EXPECT_GT(dropped, 0) << tag;
    });
  }
}

// Activation recomputation under the rowwise exchange with a capacity: selective and full give
// bitwise the statistics (dropped routes included), logits and gradients of none; and the case
// does drop routes.
TEST(EpRowwise, RecomputeWithDropsBitwiseEqualToNone) {
  if (world_comm().size() > 1) GTEST_SKIP() << "thread-rank test";
  for (const auto& [world, ep] : {std::pair<int, int64_t>{2, 2}, {4, 2}}) {
    ModelCase c = model_softmax_shared(ep);
    c.name += ", rowwise capacity 1.0";
    c.rowwise = true;
    c.ep_capacity_factor = 1.0;
    c.batch_per_rank = 4;
    run_thread_ranks(world, [&, ep = ep](Comm& comm) {
      check_model_recompute_case(comm, c);
      ExpertParallelGroups groups = split_expert_parallel(comm, ep);
      ExpertParallel xp = make_expert_parallel(*groups.ep, c.e.num_experts);
      xp.rowwise = true;
      xp.capacity_factor = 1.0;
      Model<float> model(c.m, c.e, &xp);
      model.init_params(c.seed);
      const int64_t n = c.batch_per_rank * c.seq;
      std::vector<int32_t> inputs(n), targets(n);
      for (int64_t i = 0; i < n; ++i) inputs[i] = targets[i] = static_cast<int32_t>((i * 7 + comm.rank()) % c.m.vocab_size);
      int64_t dropped = model.forward(inputs.data(), targets.data(), c.batch_per_rank, c.seq, 3).num_dropped;
      comm.all_reduce(&dropped, 1, ReduceOp::kSum);
      EXPECT_GT(dropped, 0) << rank_tag(comm) << "capacity 1.0 drops routes of this case";
    });
  }
}

}  // namespace
}  // namespace moe::testing
