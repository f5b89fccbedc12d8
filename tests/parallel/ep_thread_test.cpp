// Expert parallelism with ranks as threads of this process (tests/parallel/ep_thread_comm.h):
// every case of ep_cases.h on 2 and 4 ranks against the single-process reference, plus the
// ThreadComm itself (so that a broken test communicator cannot hide an EP bug) and the refusals.
// Skipped when this binary runs under mpirun with more than one rank (ep_mpi_test.cpp covers it).
#include "ep_cases.h"
#include "ep_thread_comm.h"
#include "parallel/comm.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

#define EP_SKIP_UNDER_MPI()                                                                    \
  do {                                                                                         \
    if (world_comm().size() > 1) GTEST_SKIP() << "thread-rank variant; the MPI variant runs"; \
  } while (0)

TEST(EpThreadComm, CollectivesMoveTheRightBlocks) {
  EP_SKIP_UNDER_MPI();
  // Rows filled with (sender, receiver, index): any misplaced block shows.
  run_thread_ranks(3, [](Comm& c) {
    const int n = c.size(), me = c.rank();
    std::vector<int64_t> send_counts(n), recv_counts(n);
    for (int p = 0; p < n; ++p) {
      send_counts[p] = (me + 2 * p) % 3;  // some zero
      recv_counts[p] = (p + 2 * me) % 3;
    }
    std::vector<float> send, recv(recv_counts[0] + recv_counts[1] + recv_counts[2]);
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < send_counts[p]; ++i) send.push_back(float(100 * me + 10 * p + i));
    c.all_to_all_v(send.data(), send_counts.data(), recv.data(), recv_counts.data());
    size_t at = 0;
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < recv_counts[p]; ++i) EXPECT_EQ(recv[at++], float(100 * p + 10 * me + i));
    std::vector<int64_t> s(2 * n), r(2 * n);
    for (int p = 0; p < n; ++p) s[2 * p] = 10 * me + p, s[2 * p + 1] = -(10 * me + p);
    c.all_to_all(s.data(), r.data(), 2);
    for (int p = 0; p < n; ++p) {
      EXPECT_EQ(r[2 * p], 10 * p + me);
      EXPECT_EQ(r[2 * p + 1], -(10 * p + me));
    }
    float v[2] = {float(me + 1), float(-me)};
    c.all_reduce(v, 2, ReduceOp::kSum);
    EXPECT_EQ(v[0], 6.f);
    EXPECT_EQ(v[1], -3.f);
    auto sub = c.split(me % 2, -me);  // reversed order by key
    EXPECT_EQ(sub->size(), me % 2 == 0 ? 2 : 1);
    if (me % 2 == 0) {
      EXPECT_EQ(sub->rank(), me == 0 ? 1 : 0);
    }
    int64_t x = me;
    sub->all_reduce(&x, 1, ReduceOp::kSum);
    EXPECT_EQ(x, me % 2 == 0 ? 2 : 1);
  });
}

TEST(EpThreadComm, FailingRankReleasesTheOthers) {
  EP_SKIP_UNDER_MPI();
  const std::string msg = error_of([] {
    run_thread_ranks(2, [](Comm& c) {
      MOE_CHECK(c.rank() != 1, "rank 1 fails on purpose");
      c.barrier();
    });
  });
  EXPECT_NE(msg.find("on purpose"), std::string::npos) << msg;
}

class EpThreads : public ::testing::TestWithParam<std::pair<int, int64_t>> {};  // (world, ep)

TEST_P(EpThreads, LayerMatchesSingleProcess) {
  EP_SKIP_UNDER_MPI();
  const auto [world, ep] = GetParam();
  for (const LayerCase& c : layer_cases(ep)) {
    run_thread_ranks(world, [&](Comm& comm) {
      const EpHandle h = check_layer_case(comm, c);
      expect_layer_scenario(c, h, comm.rank());
    });
  }
}

TEST_P(EpThreads, ModelMatchesSingleProcess) {
  EP_SKIP_UNDER_MPI();
  const auto [world, ep] = GetParam();
  for (const ModelCase& c : model_cases(ep)) {
    run_thread_ranks(world, [&](Comm& comm) {
      const ModelCheck r = check_model_case(comm, c);
      expect_model_scenario(comm, c, r);
    });
  }
}

TEST_P(EpThreads, RecomputeGradientsBitwiseEqualToNone) {
  EP_SKIP_UNDER_MPI();
  const auto [world, ep] = GetParam();
  for (const ModelCase& c : model_cases(ep))
    run_thread_ranks(world, [&](Comm& comm) { check_model_recompute_case(comm, c); });
}

// The FP8 recipe under expert parallelism (block and MX scaling): x_sorted and dy travel as FP8
// payloads; layer, model and recomputation as above, the experts' weight gradients within FP8
// rounding where the reference's blocks of an expert's rows differ (ep_check.h).
TEST_P(EpThreads, Fp8RecipeMatchesSingleProcess) {
  EP_SKIP_UNDER_MPI();
  const auto [world, ep] = GetParam();
  for (const char* scaling : {"blocks", "mx"}) {
    const cpu::Fp8Recipe r = cpu::fp8_recipe_named(scaling);
    for (const LayerCase& c : layer_cases(ep)) {
      run_thread_ranks(world, [&](Comm& comm) { check_layer_case(comm, c, &r); });
    }
    for (const ModelCase& c : model_cases(ep)) {
      run_thread_ranks(world, [&](Comm& comm) {
        check_model_case(comm, c, &r);
        check_model_recompute_case(comm, c, &r);
      });
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldEp, EpThreads,
                         ::testing::Values(std::make_pair(2, int64_t{2}), std::make_pair(4, int64_t{2}),
                                           std::make_pair(4, int64_t{4})),
                         [](const auto& info) {
                           return "world" + std::to_string(info.param.first) + "_ep" +
                                  std::to_string(info.param.second);
                         });

TEST(EpThreads, Refusals) {
  EP_SKIP_UNDER_MPI();
  run_thread_ranks(2, [](Comm& comm) {
    const ExpertParallel ep = make_expert_parallel(comm, 4);
    MoeConfig e = ep_tiny_moe(4, 2);
    e.capacity_factor = 1.25;
    std::string msg = error_of([&] { Model<float> m(ep_tiny_model(), e, &ep); });
    EXPECT_NE(msg.find("dropless"), std::string::npos) << msg;
    msg = error_of([&] { Model<double> m(ep_tiny_model(), ep_tiny_moe(4, 2), &ep); });
    EXPECT_NE(msg.find("Model<float> only"), std::string::npos) << msg;
    msg = error_of([&] { make_expert_parallel(comm, 3); });
    EXPECT_NE(msg.find("must divide moe.num_experts = 3"), std::string::npos) << msg;
    msg = error_of([&] { Model<float> m(ep_tiny_model(), ep_tiny_moe(8, 2), &ep); });
    EXPECT_NE(msg.find("moe.num_experts is 8"), std::string::npos) << msg;
    msg = error_of([&] { split_expert_parallel(comm, 3); });
    EXPECT_NE(msg.find("parallel.ep = 3"), std::string::npos) << msg;
  });
}

TEST(EpThreads, PlacementsAndFlatRanges) {
  EP_SKIP_UNDER_MPI();
  run_thread_ranks(4, [](Comm& comm) {
    const ExpertParallel ep = make_expert_parallel(comm, 8);
    const Model<float> model(ep_tiny_model(), ep_tiny_moe(8, 2), &ep);
    const ParamLayout& p = model.layout();
    const int r = comm.rank();
    EXPECT_EQ(p.find("model.layers.2.mlp.experts.gate_up_proj").shape, (Shape{2, 12, 8}));
    EXPECT_EQ(p.find("model.layers.2.mlp.experts.down_proj").shape, (Shape{2, 8, 6}));
    EXPECT_EQ(p.find("model.layers.2.mlp.gate.weight").shape, (Shape{8, 8}));
    for (size_t i = 0; i < p.entries().size(); ++i) {
      const ParamEntry& e = p.entries()[i];
      const GlobalPlacement& g = model.placements()[i];
      if (e.expert) {
        // Rank r holds experts [2r, 2r + 2) of 8: rows 2r.. of the global tensor.
        EXPECT_EQ(g.offset, 2 * r * (e.numel / 2)) << e.name;
        EXPECT_EQ(g.global_shape[0], 8) << e.name;
        EXPECT_EQ(Shape(g.global_shape.begin() + 1, g.global_shape.end()), Shape(e.shape.begin() + 1, e.shape.end()))
            << e.name;
      } else {
        EXPECT_EQ(g.offset, 0) << e.name;
        EXPECT_EQ(g.global_shape, e.shape) << e.name;
      }
    }
    // Expert and dense ranges tile the flat buffer without overlap, each holding its kind only.
    std::vector<int> kind(p.total_numel(), -1);
    for (int expert = 0; expert < 2; ++expert)
      for (const FlatRange& fr : flat_ranges(p, expert == 1))
        for (int64_t i = fr.begin; i < fr.end; ++i) {
          EXPECT_EQ(kind[i], -1) << "overlap at " << i;
          kind[i] = expert;
        }
    for (int64_t i = 0; i < p.total_numel(); ++i) EXPECT_NE(kind[i], -1) << "uncovered at " << i;
    for (const ParamEntry& e : p.entries())
      for (int64_t i = e.offset; i < e.offset + e.numel; ++i) EXPECT_EQ(kind[i], e.expert ? 1 : 0) << e.name;
  });
}

}  // namespace
}  // namespace moe::testing
