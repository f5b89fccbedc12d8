// The rowwise expert exchange on one GPU. The data movement across several ranks with virtual
// ranks (each rank's buffers ordinary device memory on this GPU, the peer tables naming them):
// cuda::ep_rowwise_share_counts fills every rank's counts table, cuda::ep_rowwise_scatter puts
// every kept row where the CPU placement (ep_rowwise_placement) says, and ep_rowwise_gather brings
// each row back (zeros for dropped rows), dropless and under a capacity. Then the whole path with
// one NVSHMEM PE (the exchange local): CudaModel with CudaRowwiseExperts equals the local experts
// bitwise (statistics and every gradient, recompute none and selective), and the training step
// over it runs in one CUDA graph and reproduces the local step bitwise.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cuda/ops/ep_placement.h"
#include "cuda/ops/ep_rowwise.h"
#include "cuda/ops/memory.h"
#include "cuda/ops/moe_routing.h"
#include "cuda/ops/nvshmem_world.h"
#include "gpu/dp_test_util.h"
#include "gpu/gpu_test_util.h"
#include "gpu/small_model.h"
#include "model/cuda_model.h"
#include "model/model.h"
#include "parallel/expert_parallel.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

#define MOE_SKIP_WITHOUT_NVSHMEM()                                                                  \
  do {                                                                                              \
    MOE_SKIP_WITHOUT_GPU();                                                                         \
    if (!cuda::nvshmem_available())                                                                 \
      GTEST_SKIP() << "this build has no NVSHMEM (scripts/setup.sh fetches it): the case did not run"; \
  } while (0)

// Device array of pointers.
template <typename T>
struct PtrTable {
  GuardedBuffer<uint64_t> buf;
  explicit PtrTable(const std::vector<T*>& ptrs) : buf(to_words(ptrs)) {}
  static std::vector<uint64_t> to_words(const std::vector<T*>& ptrs) {
    std::vector<uint64_t> w;
    for (T* p : ptrs) w.push_back(reinterpret_cast<uint64_t>(p));
    return w;
  }
  T* const* get() { return reinterpret_cast<T* const*>(buf.data()); }
};

struct RowwiseCase {
  int64_t ep, experts, d, capacity;
};

void check_virtual_ranks(const RowwiseCase& k, uint64_t seed) {
  const int64_t ep = k.ep, E = k.experts, L = E / ep, D = k.d;
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> count(0, 9);
  std::vector<int64_t> counts_all(static_cast<size_t>(ep * E));
  for (auto& c : counts_all) c = count(gen);
  counts_all[0] = 0;  // an empty expert of rank 0
  TestStream stream;
  // Per rank: its rows (sorted by expert), offsets, counts; its counts table and receive buffer.
  std::vector<int64_t> rows(static_cast<size_t>(ep));
  std::vector<std::vector<uint16_t>> x(static_cast<size_t>(ep));
  std::vector<std::unique_ptr<GuardedBuffer<uint16_t>>> d_x, d_recv, d_back;
  std::vector<std::unique_ptr<GuardedBuffer<int32_t>>> d_off, d_counts, d_table, d_dest, d_kept, d_local, d_drop;
  int64_t g_max = 0;
  for (int64_t p = 0; p < ep; ++p) {
    std::vector<int32_t> off(static_cast<size_t>(E + 1), 0), cnt(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      cnt[size_t(e)] = int32_t(counts_all[size_t(p * E + e)]);
      off[size_t(e + 1)] = off[size_t(e)] + cnt[size_t(e)];
    }
    rows[size_t(p)] = off[size_t(E)];
    g_max += rows[size_t(p)];
    x[size_t(p)] = random_bf16(std::max<int64_t>(rows[size_t(p)], 1) * D, seed + 10 + uint64_t(p));
    d_x.push_back(std::make_unique<GuardedBuffer<uint16_t>>(x[size_t(p)]));
    d_off.push_back(std::make_unique<GuardedBuffer<int32_t>>(off));
    d_counts.push_back(std::make_unique<GuardedBuffer<int32_t>>(cnt));
    d_table.push_back(std::make_unique<GuardedBuffer<int32_t>>(std::vector<int32_t>(size_t(ep * E), -7)));
  }
  for (int64_t p = 0; p < ep; ++p)
    d_recv.push_back(std::make_unique<GuardedBuffer<uint16_t>>(std::vector<uint16_t>(size_t(g_max * D), 0xFFFF)));
  std::vector<int32_t*> tables;
  std::vector<uint16_t*> recvs;
  for (int64_t p = 0; p < ep; ++p) {
    tables.push_back(d_table[size_t(p)]->data());
    recvs.push_back(d_recv[size_t(p)]->data());
  }
  PtrTable<int32_t> table_ptrs(tables);
  PtrTable<uint16_t> recv_ptrs(recvs);
  // Counts into every table, then each rank's placement from its own table, then the scatter.
  for (int64_t p = 0; p < ep; ++p)
    cuda::ep_rowwise_share_counts(d_counts[size_t(p)]->data(), E, p, table_ptrs.get(), ep, stream.get());
  stream.sync();
  for (int64_t p = 0; p < ep; ++p) {
    const std::vector<int32_t> t = d_table[size_t(p)]->download();
    for (int64_t i = 0; i < ep * E; ++i) ASSERT_EQ(t[size_t(i)], counts_all[size_t(i)]) << "table of rank " << p;
  }
  for (int64_t p = 0; p < ep; ++p) {
    const int64_t r = std::max<int64_t>(rows[size_t(p)], 1);
    d_dest.push_back(std::make_unique<GuardedBuffer<int32_t>>(r));
    d_kept.push_back(std::make_unique<GuardedBuffer<int32_t>>(ep * E));
    d_local.push_back(std::make_unique<GuardedBuffer<int32_t>>(L + 1));
    d_drop.push_back(std::make_unique<GuardedBuffer<int32_t>>(1));
    cuda::ep_rowwise_placement(d_table[size_t(p)]->data(), ep, p, E, k.capacity, rows[size_t(p)],
                               d_kept[size_t(p)]->data(), d_dest[size_t(p)]->data(), d_local[size_t(p)]->data(),
                               d_drop[size_t(p)]->data(), stream.get());
    cuda::ep_rowwise_scatter(d_x[size_t(p)]->data(), d_off[size_t(p)]->data(), d_dest[size_t(p)]->data(),
                             rows[size_t(p)], E, L, D, recv_ptrs.get(), ep, stream.get());
  }
  stream.sync();
  // Every kept row in its place, as the CPU placement says; dropped rows nowhere.
  int64_t dropped_total = 0;
  for (int64_t p = 0; p < ep; ++p) {
    const EpPlacement want = ep_rowwise_placement(counts_all, ep, p, E, k.capacity);
    dropped_total += want.num_dropped;
    ASSERT_EQ(d_drop[size_t(p)]->download()[0], want.num_dropped) << "rank " << p;
    const std::vector<int32_t> dest = d_dest[size_t(p)]->download();
    for (int64_t r = 0; r < rows[size_t(p)]; ++r) {
      ASSERT_EQ(dest[size_t(r)], want.dest_row[size_t(r)]) << "rank " << p << " row " << r;
      if (want.dest_row[size_t(r)] < 0) continue;
      int64_t e = 0;
      while (d_off[size_t(p)]->download()[size_t(e + 1)] <= r) ++e;
      const int64_t q = e / L;
      const std::vector<uint16_t> recv = d_recv[size_t(q)]->download();
      ASSERT_TRUE(std::equal(x[size_t(p)].begin() + r * D, x[size_t(p)].begin() + (r + 1) * D,
                             recv.begin() + int64_t(want.dest_row[size_t(r)]) * D))
          << "rank " << p << " row " << r << " at rank " << q << " row " << want.dest_row[size_t(r)];
    }
  }
  if (k.capacity > 0) {
    EXPECT_GT(dropped_total, 0) << "the capacity case must drop rows";
  }
  // Back: each rank's rows again, zeros where dropped.
  for (int64_t p = 0; p < ep; ++p) {
    d_back.push_back(std::make_unique<GuardedBuffer<uint16_t>>(std::max<int64_t>(rows[size_t(p)], 1) * D));
    cuda::ep_rowwise_gather(recv_ptrs.get(), d_off[size_t(p)]->data(), d_dest[size_t(p)]->data(), rows[size_t(p)], E,
                            L, D, ep, d_back[size_t(p)]->data(), stream.get());
  }
  stream.sync();
  for (int64_t p = 0; p < ep; ++p) {
    const std::vector<uint16_t> back = d_back[size_t(p)]->download();
    const std::vector<int32_t> dest = d_dest[size_t(p)]->download();
    for (int64_t r = 0; r < rows[size_t(p)]; ++r) {
      const bool kept = dest[size_t(r)] >= 0;
      for (int64_t i = 0; i < D; ++i)
        ASSERT_EQ(back[size_t(r * D + i)], kept ? x[size_t(p)][size_t(r * D + i)] : uint16_t(0))
            << "rank " << p << " row " << r;
    }
    d_back[size_t(p)]->expect_guards_intact("gathered rows");
    d_recv[size_t(p)]->expect_guards_intact("receive buffer");
  }
}

TEST(EpRowwiseGpu, ScatterAndGatherFollowTheCpuPlacementOverVirtualRanks) {
  MOE_SKIP_WITHOUT_GPU();
  const std::vector<RowwiseCase> cases = {{1, 8, 64, 0}, {2, 8, 64, 0}, {4, 16, 136, 0}, {2, 8, 64, 6}, {4, 8, 72, 5}};
  uint64_t seed = 1;
  for (const RowwiseCase& k : cases) {
    SCOPED_TRACE(param_name("ep", k.ep, "_E", k.experts, "_d", k.d, "_cap", k.capacity));
    check_virtual_ranks(k, seed++);
  }
}

// The permute fused into the store and its backward into the load, for rank 0 of groups of 1, 2
// and 4 (the other ranks only give counts): the rows stored from the token rows through the
// dispatch map land bitwise where the stored sorted rows land, and ep_rowwise_gather_add equals
// cuda::permute_backward on the gathered rows bit for bit.
TEST(EpRowwiseGpu, TokenRowsFusePermuteAndItsBackwardBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  for (const int64_t ep : {1, 2, 4}) {
    SCOPED_TRACE(param_name("ep", ep));
    const int64_t E = 8, L = E / ep, k = 2, T = 57, D = 72, R = T * k;
    std::mt19937_64 gen(uint64_t(100 + ep));
    // Each token picks k distinct experts; routes sorted by expert (stable: token-major within).
    std::vector<int32_t> expert_of_route(static_cast<size_t>(R));
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> all(static_cast<size_t>(E));
      for (int32_t e = 0; e < E; ++e) all[size_t(e)] = e;
      std::shuffle(all.begin(), all.end(), gen);
      for (int64_t j = 0; j < k; ++j) expert_of_route[size_t(t * k + j)] = all[size_t(j)];
    }
    std::vector<int32_t> sorted_route, route_to_row(static_cast<size_t>(R)), off(static_cast<size_t>(E + 1), 0);
    for (int32_t e = 0; e < E; ++e) {
      for (int64_t i = 0; i < R; ++i)
        if (expert_of_route[size_t(i)] == e) {
          route_to_row[size_t(i)] = int32_t(sorted_route.size());
          sorted_route.push_back(int32_t(i));
        }
      off[size_t(e + 1)] = int32_t(sorted_route.size());
    }
    std::vector<int64_t> counts_all(static_cast<size_t>(ep * E));
    std::uniform_int_distribution<int> other(0, 20);
    for (int64_t q = 0; q < ep; ++q)
      for (int64_t e = 0; e < E; ++e)
        counts_all[size_t(q * E + e)] = q == 0 ? off[size_t(e + 1)] - off[size_t(e)] : other(gen);
    const EpPlacement pl = ep_rowwise_placement(counts_all, ep, 0, E, 0);
    const std::vector<uint16_t> tokens = random_bf16(T * D, 7);
    std::vector<uint16_t> x_sorted(static_cast<size_t>(R * D));
    for (int64_t r = 0; r < R; ++r)
      std::copy(tokens.begin() + (sorted_route[size_t(r)] / k) * D, tokens.begin() + (sorted_route[size_t(r)] / k + 1) * D,
                x_sorted.begin() + r * D);
    int64_t g = 0;
    for (int64_t i = 0; i < ep * E; ++i) g += counts_all[size_t(i)];
    TestStream stream;
    GuardedBuffer<uint16_t> d_tokens(tokens), d_sorted(x_sorted);
    GuardedBuffer<int32_t> d_route(sorted_route), d_r2r(route_to_row), d_off(off), d_dest(pl.dest_row);
    std::vector<std::unique_ptr<GuardedBuffer<uint16_t>>> a, b;
    std::vector<uint16_t*> pa, pb;
    for (int64_t q = 0; q < ep; ++q) {
      a.push_back(std::make_unique<GuardedBuffer<uint16_t>>(std::vector<uint16_t>(size_t(g * D), 0x7F7F)));
      b.push_back(std::make_unique<GuardedBuffer<uint16_t>>(std::vector<uint16_t>(size_t(g * D), 0x7F7F)));
      pa.push_back(a.back()->data());
      pb.push_back(b.back()->data());
    }
    PtrTable<uint16_t> ta(pa), tb(pb);
    cuda::ep_rowwise_scatter(d_sorted.data(), d_off.data(), d_dest.data(), R, E, L, D, ta.get(), ep, stream.get());
    cuda::ep_rowwise_scatter(d_tokens.data(), d_off.data(), d_dest.data(), R, E, L, D, tb.get(), ep, stream.get(),
                             d_route.data(), k);
    stream.sync();
    for (int64_t q = 0; q < ep; ++q) EXPECT_EQ(a[size_t(q)]->download(), b[size_t(q)]->download()) << "rank " << q;
    // Backward: the rows in the receive buffers stand for input gradients.
    const std::vector<uint16_t> dx0 = random_bf16(T * D, 8);
    GuardedBuffer<uint16_t> fused(dx0), plain(dx0), gathered(R * D);
    cuda::ep_rowwise_gather_add(ta.get(), d_r2r.data(), d_off.data(), d_dest.data(), T, k, E, L, D, ep, fused.data(),
                                stream.get());
    cuda::ep_rowwise_gather(ta.get(), d_off.data(), d_dest.data(), R, E, L, D, ep, gathered.data(), stream.get());
    cuda::permute_backward(gathered.data(), d_r2r.data(), T, k, D, plain.data(), stream.get());
    stream.sync();
    EXPECT_EQ(fused.download(), plain.download());
    EXPECT_NE(fused.download(), dx0);
    fused.expect_guards_intact("gather_add");
  }
}

TEST(EpRowwiseGpu, RefusesBadShapes) {
  MOE_SKIP_WITHOUT_GPU();
  GuardedBuffer<uint16_t> b(64);
  GuardedBuffer<int32_t> i(64);
  TestStream stream;
  PtrTable<uint16_t> peers({b.data()});
  const std::string width = error_of([&] {
    cuda::ep_rowwise_scatter(b.data(), i.data(), i.data(), 2, 4, 4, 12, peers.get(), 1, stream.get());
  });
  EXPECT_NE(width.find("multiple of 8, got 12"), std::string::npos) << width;
  const std::string split = error_of([&] {
    cuda::ep_rowwise_gather(peers.get(), i.data(), i.data(), 2, 6, 4, 8, 1, b.data(), stream.get());
  });
  EXPECT_NE(split.find("= L x ep"), std::string::npos) << split;
}

// ---------------------------------------------------------------------------------------------
// One PE: the whole path against the local experts.



cuda::NvshmemWorld& test_world() { return cuda::NvshmemWorld::one_pe(size_t(256) << 20); }

TEST(CudaRowwise, OnePeModelEqualsLocalExpertsBitwise) {
  MOE_SKIP_WITHOUT_NVSHMEM();
  const ModelConfig mc = small_gpu_model_config();
  const MoeConfig ec = small_gpu_moe_config();
  Model<float> cpu(mc, ec);
  cpu.init_params(31);
  const int64_t batch = 2, seq = 64;
  std::mt19937_64 gen(4);
  std::uniform_int_distribution<int32_t> tok(0, 255);
  std::vector<int32_t> in(static_cast<size_t>(batch * seq)), tg(size_t(batch * seq));
  for (auto& t : in) t = tok(gen);
  for (auto& t : tg) t = tok(gen);
  for (const Recompute mode : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
    SCOPED_TRACE(recompute_name(mode));
    CudaExpertParallel rw;
    rw.rowwise = &test_world();
    CudaModel local(mc, ec), rowwise(mc, ec, &rw);
    ASSERT_TRUE(rowwise.rowwise());
    ASSERT_EQ(rowwise.layout().total_numel(), local.layout().total_numel());
    for (CudaModel* m : {&local, &rowwise}) {
      m->set_recompute(mode);
      m->load_params(cpu.params());
      m->zero_grads();
    }
    const LossScales scales{1.0 / double(batch * seq), ec.lb_loss_weight, ec.z_loss_weight};
    for (int rep = 0; rep < 2; ++rep) {  // the second forward and backward accumulate
      local.forward(in.data(), tg.data(), batch, seq, 3);
      rowwise.forward(in.data(), tg.data(), batch, seq, 3);
      local.backward(scales);
      rowwise.backward(scales);
    }
    const ForwardStats a = local.read_stats(), b = rowwise.read_stats();
    EXPECT_EQ(a.ce_sum, b.ce_sum);
    EXPECT_EQ(a.lb_loss, b.lb_loss);
    EXPECT_EQ(a.z_loss, b.z_loss);
    EXPECT_EQ(a.tokens_per_expert, b.tokens_per_expert);
    EXPECT_EQ(b.num_dropped, 0);
    EXPECT_TRUE(same_bits(local.download_grads(), rowwise.download_grads()));
    // One PE: every exchange stays on this GPU; each MoE layer's forward and backward count two each.
    const EpTraffic t = rowwise.ep_traffic();
    EXPECT_GE(t.exchanges, 2 * 2 * 2 * 2) << "2 MoE layers x 2 passes x (forward + backward) x 2 exchanges";
    EXPECT_EQ(t.rows_sent, 0);
    EXPECT_EQ(t.bytes_sent, 0);
  }
}

// The training step with parallel.ep_backend = "rowwise" at ep = 1: captured in a CUDA graph from
// step 2 (the exchange's barriers included) and bitwise the local step, graph on and off.
TEST(CudaRowwise, StepRunsInOneCudaGraphAndMatchesTheLocalStep) {
  MOE_SKIP_WITHOUT_NVSHMEM();
  const Config c = dp_step_config();
  Config cr = c;
  cr.parallel.ep_backend = "rowwise";
  for (const bool graph : {true, false}) {
    CudaStepRunner plain(c), rowwise(cr);
    EXPECT_TRUE(rowwise.model().rowwise());
    const DpRun a = dp_run(c, plain, graph, 4), b = dp_run(cr, rowwise, graph, 4);
    expect_same_steps(a, b, graph ? "graph on" : "graph off");
    EXPECT_EQ(b.graph_launches, graph ? 3 : 0);
  }
}

// train.precision = "fp8" through the rowwise exchange at ep = 1: the FP8 payload rows (codes and
// scales padded to 16-byte words) round-trip through the symmetric buffers into the experts' FP8
// input rows, and the step's update writes the weight codes, so the step is captured in a CUDA
// graph from step 2 and bitwise the same eager. The payload carries the rows' codes, not their BF16
// values: the experts' weight gradients read the dequantised rows, so the losses follow the local
// FP8 step closely rather than bit for bit.
TEST(CudaRowwise, Fp8StepRunsInOneCudaGraphAndFollowsTheLocalStep) {
  MOE_SKIP_WITHOUT_NVSHMEM();
  Config c = dp_step_config();
  c.train.precision = "fp8";
  Config cr = c;
  cr.parallel.ep_backend = "rowwise";
  DpRun local, on, off;
  {
    CudaStepRunner plain(c);
    local = dp_run(c, plain, true, 4);
  }
  {
    CudaStepRunner graph(cr);
    EXPECT_TRUE(graph.model().rowwise());
    on = dp_run(cr, graph, true, 4);
  }
  {
    CudaStepRunner eager(cr);
    off = dp_run(cr, eager, false, 4);
  }
  expect_same_steps(on, off, "fp8 rowwise ep = 1, graph on against off");
  EXPECT_EQ(on.graph_launches, 3);
  ASSERT_EQ(on.steps.size(), local.steps.size());
  for (size_t i = 0; i < local.steps.size(); ++i) {
    const double rel = std::abs(on.steps[i].ce_sum - local.steps[i].ce_sum) / local.steps[i].ce_sum;
    EXPECT_LT(rel, 2e-3) << "step " << i + 1 << ": rowwise " << on.steps[i].ce_sum << ", local "
                         << local.steps[i].ce_sum;
  }
}

}  // namespace
}  // namespace moe::testing
