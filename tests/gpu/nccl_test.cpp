// Data parallelism over two GPUs with NCCL, run as `mpirun -np 2 test_nccl` (CTest entry
// gpu.nccl.np2, label gpu). NCCL sums exactly and identically on both ranks, also replayed from a
// CUDA graph; CudaStepRunner with dp = 2 follows the one-GPU runner on the same global batch
// (first step almost exactly, expert counts of step 1 exactly, every loss within the BF16 rel 2e-2),
// the two replicas stay bitwise identical, graph on and off agree bitwise, random routing seeds by
// the micro-batch's global index; the trainer on 2 GPUs follows 1 GPU, and its rank-0 checkpoint
// resumes on 1 GPU (same next loss) and on 2 GPUs (bitwise the same run) — with ZeRO-1, the
// default for dp = 2, so the checkpoint holds the gathered moment shards; ZeRO-1 against the
// replicated optimizer (step 1 within 1e-6, losses, whole-state download and reload, BF16
// reduction); pipeline stages (pp = 2, 1F1B over NCCL send/recv) against one GPU and their
// checkpoint resumed on one GPU; expert parallelism is tests/gpu/ep_gpu_test.cpp. Every test is skipped,
// never passed, unless the job has 2 ranks and 2 GPUs are visible. With 2 ranks an FP32 sum a + b
// is the same in any order, so the NCCL algorithm cannot change results between graph and eager.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "cuda/common.h"
#include "cuda/ops/memory.h"
#include "cuda/ops/nccl.h"
#include "gpu/dp_test_util.h"
#include "gpu/two_gpu_main.h"
#include "model/layout.h"
#include "parallel/comm.h"
#include "parallel/mpi_test_util.h"
#include "parallel/nccl_comm.h"
#include "support/test_util.h"
#include "train/trainer.h"

namespace moe::testing {
namespace {

std::unique_ptr<cuda::NcclComm> g_nccl;  // over the world, made in main when the job can run
std::string g_skip_reason;

// Rank 0's vector on every rank (MPI), to compare replicas.
std::vector<float> rank0_copy(Comm& world, const std::vector<float>& mine) {
  std::vector<float> v = mine;
  world.broadcast(v.data(), int64_t(v.size()), 0);
  return v;
}

class NcclDataParallel : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!g_nccl) GTEST_SKIP() << g_skip_reason;
  }
  static Comm& world() { return world_comm(); }
  static cuda::NcclComm& nccl() { return *g_nccl; }
};

template <typename T>
void expect_all_reduce_exact(cuda::NcclComm& comm, cuda::NcclDType type, const std::vector<T>& mine,
                             const std::vector<T>& expected, const char* what) {
  T* d = static_cast<T*>(cuda::device_alloc(mine.size() * sizeof(T)));
  cuda::Stream st = cuda::stream_create();
  cuda::Event done = cuda::event_create();
  cuda::copy_h2d(d, mine.data(), mine.size() * sizeof(T), st);
  comm.all_reduce_sum(d, int64_t(mine.size()), type, st);
  cuda::event_record(done, st);
  comm.wait(done, what);
  std::vector<T> got(mine.size());
  cuda::copy_d2h(got.data(), d, got.size() * sizeof(T), st);
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) bad += got[i] != expected[i];
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements differ from the exact sum";
  cuda::event_destroy(done);
  cuda::stream_destroy(st);
  cuda::device_free(d);
}

// Integer-valued inputs: every sum is exact, so the result must equal it on both ranks.
TEST_F(NcclDataParallel, AllReduceSumsExactlyInEveryTypeAndInAGraph) {
  const int r = world().rank();
  const int64_t n = 1'000'003;  // not a multiple of any NCCL chunk
  std::vector<float> f(n), f_sum(n);
  std::vector<double> d(n), d_sum(n);
  std::vector<int64_t> l(n), l_sum(n);
  std::vector<uint32_t> u(4099), u_sum(4099);
  auto fv = [](int64_t i, int rank) { return float((i * 7 + rank * 3) % 2048) - 1024.0f; };
  auto dv = [](int64_t i, int rank) { return double(i % 97) * 0.25 + rank; };
  auto lv = [](int64_t i, int rank) { return (int64_t(1) << 40) * (rank + 1) + i; };
  for (int64_t i = 0; i < n; ++i) {
    f[i] = fv(i, r), f_sum[i] = fv(i, 0) + fv(i, 1);
    d[i] = dv(i, r), d_sum[i] = dv(i, 0) + dv(i, 1);
    l[i] = lv(i, r), l_sum[i] = lv(i, 0) + lv(i, 1);
  }
  for (size_t i = 0; i < u.size(); ++i) u[i] = uint32_t(i + 1000 * r), u_sum[i] = uint32_t(2 * i + 1000);
  expect_all_reduce_exact(nccl(), cuda::NcclDType::kF32, f, f_sum, "f32");
  expect_all_reduce_exact(nccl(), cuda::NcclDType::kF64, d, d_sum, "f64");
  expect_all_reduce_exact(nccl(), cuda::NcclDType::kI64, l, l_sum, "i64");
  expect_all_reduce_exact(nccl(), cuda::NcclDType::kU32, u, u_sum, "u32");

  // Captured once, replayed on fresh inputs (staged outside the graph) twice.
  float* buf = static_cast<float*>(cuda::device_alloc(size_t(n) * sizeof(float)));
  cuda::Stream st = cuda::stream_create();
  cuda::Event done = cuda::event_create();
  cuda::StreamGraph graph;
  cuda::copy_h2d(buf, f.data(), size_t(n) * sizeof(float), st);
  cuda::stream_sync(st);
  graph.begin_capture(st);
  nccl().all_reduce_sum(buf, n, cuda::NcclDType::kF32, st);
  graph.end_capture(st);
  for (int replay = 1; replay <= 2; ++replay) {
    std::vector<float> in(n), expected(n);
    for (int64_t i = 0; i < n; ++i) in[i] = fv(i + replay, r), expected[i] = fv(i + replay, 0) + fv(i + replay, 1);
    cuda::copy_h2d(buf, in.data(), size_t(n) * sizeof(float), st);
    graph.launch(st);
    cuda::event_record(done, st);
    nccl().wait(done, "graph replay");
    std::vector<float> got(n);
    cuda::copy_d2h(got.data(), buf, size_t(n) * sizeof(float), st);
    EXPECT_TRUE(same_bits(got, expected)) << "graph replay " << replay;
    EXPECT_TRUE(same_bits(rank0_copy(world(), got), got)) << "graph replay " << replay << ": ranks differ";
  }
  graph.reset();
  cuda::event_destroy(done);
  cuda::stream_destroy(st);
  cuda::device_free(buf);
}

// dp = 2 against one GPU on the same global batch (each rank runs the one-GPU reference on its GPU).
TEST_F(NcclDataParallel, StepFollowsOneGpuAndReplicasStayIdentical) {
  const Config c = dp_step_config();
  const int64_t steps = 6;
  DpRun one, two;
  {
    CudaStepRunner runner(c);
    one = dp_run(c, runner, /*graph=*/true, steps);
  }
  {
    CudaStepRunner runner(c, &nccl());
    EXPECT_EQ(runner.dp_size(), 2);
    EXPECT_EQ(runner.dp_rank(), world().rank());
    two = dp_run(c, runner, /*graph=*/true, steps);
  }
  ASSERT_EQ(one.steps.size(), size_t(steps));
  ASSERT_EQ(two.steps.size(), size_t(steps));
  EXPECT_EQ(two.graph_launches, steps - 1);  // captured at step 2, NCCL calls included

  // Step 1 starts from the same weights: the same forwards, so CE and the counts agree up to the
  // order of the FP64 sums, and the grad norm up to the order of the FP32 gradient sums.
  const StepStats &a1 = one.steps[0], &b1 = two.steps[0];
  EXPECT_EQ(a1.num_targets, b1.num_targets);
  EXPECT_NEAR(dp_loss(b1), dp_loss(a1), 1e-12 * dp_loss(a1));
  EXPECT_NEAR(b1.lb_loss, a1.lb_loss, 1e-12 * std::abs(a1.lb_loss));
  EXPECT_NEAR(b1.z_loss, a1.z_loss, 1e-12 * std::abs(a1.z_loss));
  EXPECT_NEAR(b1.grad_norm, a1.grad_norm, 1e-5 * a1.grad_norm);
  EXPECT_EQ(b1.tokens_per_expert, a1.tokens_per_expert);  // global counts
  EXPECT_EQ(b1.num_routes, a1.num_routes);
  EXPECT_TRUE(same_bits(two.bias_after_step1, one.bias_after_step1)) << "expert bias after step 1";

  double worst_loss = 0, worst_norm = 0;
  for (int64_t i = 0; i < steps; ++i) {
    const StepStats &a = one.steps[size_t(i)], &b = two.steps[size_t(i)];
    const double rel = std::abs(dp_loss(b) - dp_loss(a)) / dp_loss(a);
    const double rel_norm = std::abs(b.grad_norm - a.grad_norm) / a.grad_norm;
    worst_loss = std::max(worst_loss, rel);
    worst_norm = std::max(worst_norm, rel_norm);
    if (world().rank() == 0)
      std::printf("step %lld loss 1 GPU %.6f 2 GPUs %.6f (rel %.1e) | grad norm %.5f %.5f (rel %.1e)\n",
                  (long long)(i + 1), dp_loss(a), dp_loss(b), rel, a.grad_norm, b.grad_norm, rel_norm);
    EXPECT_LE(rel, 2e-2) << "step " << i + 1;
    EXPECT_LE(rel_norm, 5e-2) << "step " << i + 1;
    EXPECT_FALSE(b.skipped) << "step " << i + 1;
    EXPECT_EQ(b.optimizer_steps, a.optimizer_steps);
  }
  if (world().rank() == 0)
    std::printf("worst relative difference over %lld steps: loss %.2e, grad norm %.2e\n", (long long)steps, worst_loss,
                worst_norm);
  EXPECT_LT(dp_loss(two.steps.back()), dp_loss(two.steps.front()));  // it trains

  // Replicas: bitwise equal state on both ranks, and equal statistics.
  EXPECT_TRUE(same_bits(rank0_copy(world(), two.params), two.params)) << "parameters differ between ranks";
  EXPECT_TRUE(same_bits(rank0_copy(world(), two.exp_avg), two.exp_avg)) << "exp_avg differs between ranks";
  EXPECT_TRUE(same_bits(rank0_copy(world(), two.exp_avg_sq), two.exp_avg_sq)) << "exp_avg_sq differs between ranks";
  EXPECT_TRUE(same_bits(rank0_copy(world(), two.bias), two.bias)) << "expert bias differs between ranks";
  std::vector<double> figures;
  for (const StepStats& s : two.steps) figures.insert(figures.end(), {s.ce_sum, s.grad_norm, s.lb_loss, s.z_loss});
  std::vector<double> max = figures, min = figures;
  world().all_reduce(max.data(), int64_t(max.size()), ReduceOp::kMax);
  for (double& x : min) x = -x;
  world().all_reduce(min.data(), int64_t(min.size()), ReduceOp::kMax);
  for (size_t i = 0; i < figures.size(); ++i) EXPECT_EQ(max[i], -min[i]) << "statistic " << i << " differs between ranks";
}

TEST_F(NcclDataParallel, GraphOnAndOffAgreeBitwise) {
  const Config c = dp_step_config();
  DpRun on, off;
  {
    CudaStepRunner runner(c, &nccl());
    on = dp_run(c, runner, true, 4);
  }
  {
    CudaStepRunner runner(c, &nccl());
    off = dp_run(c, runner, false, 4);
  }
  EXPECT_EQ(on.graph_launches, 3);
  EXPECT_EQ(off.graph_launches, 0);
  expect_same_steps(on, off, "dp 2, graph on vs off");
}

// The gradients summed block by block on the second stream during the last backward (the default)
// or all after backward: the same sums, so the same steps bit for bit, with and without the graph.
TEST_F(NcclDataParallel, OverlappedGradReduceMatchesReduceAfterBackwardBitwise) {
  const Config c = dp_step_config();
  ASSERT_TRUE(c.parallel.overlap_grad_reduce) << "overlap is the default";
  Config off_cfg = c;
  off_cfg.parallel.overlap_grad_reduce = false;
  for (const bool graph : {true, false}) {
    DpRun on, off;
    {
      CudaStepRunner runner(c, &nccl());
      on = dp_run(c, runner, graph, 4);
    }
    {
      CudaStepRunner runner(off_cfg, &nccl());
      off = dp_run(off_cfg, runner, graph, 4);
    }
    expect_same_steps(on, off, graph ? "dp 2, graph on: overlap vs none" : "dp 2, graph off: overlap vs none");
  }
}

// Random routing draws per micro-batch from its index in the global batch: the counts of step 1
// (same weights, same tokens, same draws) equal the one-GPU counts exactly.
TEST_F(NcclDataParallel, RandomRoutingSeedsByGlobalMicroBatchIndex) {
  const Config c = dp_step_config("random");
  DpRun one, two;
  {
    CudaStepRunner runner(c);
    one = dp_run(c, runner, true, 2);
  }
  {
    CudaStepRunner runner(c, &nccl());
    EXPECT_FALSE(runner.uses_graph());  // random routing runs eagerly
    two = dp_run(c, runner, true, 2);
  }
  ASSERT_EQ(two.steps.size(), 2u);
  EXPECT_EQ(two.steps[0].tokens_per_expert, one.steps[0].tokens_per_expert);
  EXPECT_NEAR(dp_loss(two.steps[0]), dp_loss(one.steps[0]), 1e-12 * dp_loss(one.steps[0]));
  EXPECT_NEAR(dp_loss(two.steps[1]), dp_loss(one.steps[1]), 2e-2 * dp_loss(one.steps[1]));
}

// Largest |a - b| / (|b| + floor) over two vectors of one size.
double worst_rel(const std::vector<float>& a, const std::vector<float>& b, double floor) {
  double w = 0;
  for (size_t i = 0; i < a.size(); ++i) w = std::max(w, std::abs(double(a[i]) - double(b[i])) / (std::abs(double(b[i])) + floor));
  return w;
}

// ZeRO-1 on 2 GPUs (the default with dp = 2) against the replicated optimizer (parallel.zero =
// false). With two ranks an FP32 (or BF16) sum a + b is the same in either order, so the
// reduce-scattered chunks, the all-reduced tails and the all-reduced buffer hold the same
// gradients bit for bit; the global norm then differs only in the order of its FP64 sums (rel
// ~1e-16), which can move the FP32 clip factor by one ulp when clipping is active. So after step 1
// the parameters and moments (downloaded whole: gathered from both ranks) agree within 1e-6
// relative (bitwise when the norm is below grad_clip); over 6 steps BF16 forwards on those
// nearly equal weights keep the losses within the 1-vs-2-GPU tolerance. The ZeRO replicas stay
// bitwise identical across ranks, and the downloaded state loaded into a fresh ZeRO runner (each
// rank keeping its shard) downloads again bit for bit. BF16 reduction runs, sharded and not, with
// losses near FP32's.
TEST_F(NcclDataParallel, ZeroFollowsReplicatedAdamWAndDownloadsWholeState) {
  const Config z = dp_step_config();
  ASSERT_TRUE(z.parallel.zero) << "ZeRO-1 is the default";
  Config r = z;
  r.parallel.zero = false;
  {
    // The shards of this config: buckets per gradient group, tails where a group is not a multiple of 2 x 64.
    const ParamLayout layout = build_param_layout(z.model, z.moe);
    int64_t tails = 0;
    const std::vector<int64_t> starts = grad_group_starts(layout, z.model.n_layers);
    for (size_t g = 0; g < starts.size(); ++g) {
      const int64_t end = g + 1 < starts.size() ? starts[g + 1] : layout.total_numel();
      tails += (end - starts[g]) % (2 * ParamLayout::kAlign) != 0;
    }
    if (world().rank() == 0)
      std::printf("ZeRO-1 plan: %zu gradient groups, %lld with a replicated tail\n", starts.size(), (long long)tails);
  }
  // Step 1 alone: the same gradients, one update.
  DpRun z1, r1;
  {
    CudaStepRunner runner(z, &nccl());
    EXPECT_TRUE(runner.zero());
    z1 = dp_run(z, runner, /*graph=*/true, 1);
  }
  {
    CudaStepRunner runner(r, &nccl());
    EXPECT_FALSE(runner.zero());
    r1 = dp_run(r, runner, /*graph=*/true, 1);
  }
  ASSERT_EQ(z1.steps.size(), 1u);
  ASSERT_EQ(r1.steps.size(), 1u);
  EXPECT_NEAR(z1.steps[0].grad_norm, r1.steps[0].grad_norm, 1e-12 * r1.steps[0].grad_norm);
  EXPECT_EQ(z1.steps[0].ce_sum, r1.steps[0].ce_sum);
  EXPECT_EQ(z1.optimizer_steps, 1);
  const double wp = worst_rel(z1.params, r1.params, 1e-3), wm = worst_rel(z1.exp_avg, r1.exp_avg, 1e-12),
               wv = worst_rel(z1.exp_avg_sq, r1.exp_avg_sq, 1e-20);
  if (world().rank() == 0)
    std::printf("ZeRO-1 vs replicated after step 1 (grad norm %.6g, clip %.3g): worst rel params %.2e, exp_avg %.2e, "
                "exp_avg_sq %.2e\n", r1.steps[0].grad_norm, z.optim.grad_clip, wp, wm, wv);
  EXPECT_LE(wp, 1e-6);
  EXPECT_LE(wm, 1e-6);
  EXPECT_LE(wv, 1e-6);
  if (r1.steps[0].grad_norm < z.optim.grad_clip) {
    EXPECT_TRUE(same_bits(z1.params, r1.params)) << "no clipping: the update is the same FP32 arithmetic";
    EXPECT_TRUE(same_bits(z1.exp_avg, r1.exp_avg));
    EXPECT_TRUE(same_bits(z1.exp_avg_sq, r1.exp_avg_sq));
  }
  EXPECT_TRUE(same_bits(rank0_copy(world(), z1.params), z1.params)) << "ZeRO-1 parameters differ between ranks";
  EXPECT_TRUE(same_bits(rank0_copy(world(), z1.exp_avg), z1.exp_avg)) << "gathered exp_avg differs between ranks";

  // Round trip of the whole state through a fresh ZeRO runner: each rank keeps its shard of it.
  {
    CudaStepRunner runner(z, &nccl());
    runner.load_state(z1.params.data(), z1.exp_avg.data(), z1.exp_avg_sq.data(), z1.optimizer_steps, z1.bias);
    const size_t n = z1.params.size();
    std::vector<float> p(n), m(n), v(n);
    int64_t t = 0;
    runner.download_state(p.data(), m.data(), v.data(), &t, nullptr);
    EXPECT_TRUE(same_bits(p, z1.params));
    EXPECT_TRUE(same_bits(m, z1.exp_avg)) << "exp_avg scattered and gathered back";
    EXPECT_TRUE(same_bits(v, z1.exp_avg_sq)) << "exp_avg_sq scattered and gathered back";
    EXPECT_EQ(t, 1);
  }

  // Six steps, FP32 and BF16 reduction, sharded and replicated.
  const int64_t steps = 6;
  std::map<std::string, DpRun> runs;
  for (const std::string dtype : {"fp32", "bf16"}) {
    for (const bool sharded : {true, false}) {
      Config c = sharded ? z : r;
      c.parallel.grad_reduce_dtype = dtype;
      CudaStepRunner runner(c, &nccl());
      runs[dtype + (sharded ? "/zero" : "/replicated")] = dp_run(c, runner, /*graph=*/true, steps);
    }
  }
  const DpRun& ref = runs["fp32/replicated"];
  for (const auto& [name, run] : runs) {
    ASSERT_EQ(run.steps.size(), size_t(steps)) << name;
    EXPECT_EQ(run.graph_launches, steps - 1) << name;
    double worst = 0;
    for (int64_t i = 0; i < steps; ++i) {
      const double a = dp_loss(ref.steps[size_t(i)]), b = dp_loss(run.steps[size_t(i)]);
      worst = std::max(worst, std::abs(b - a) / a);
      EXPECT_FALSE(run.steps[size_t(i)].skipped) << name << ", step " << i + 1;
    }
    if (world().rank() == 0) std::printf("%s: worst relative loss difference to fp32/replicated %.2e\n", name.c_str(), worst);
    EXPECT_LE(worst, 2e-2) << name;
    EXPECT_LT(dp_loss(run.steps.back()), dp_loss(run.steps.front())) << name << ": it trains";
    EXPECT_TRUE(same_bits(rank0_copy(world(), run.params), run.params)) << name << ": parameters differ between ranks";
    EXPECT_TRUE(same_bits(rank0_copy(world(), run.exp_avg_sq), run.exp_avg_sq)) << name << ": moments differ between ranks";
  }
  EXPECT_FALSE(same_bits(runs["bf16/zero"].params, runs["fp32/zero"].params)) << "BF16 reduction changed nothing";
}

// BF16 moments (optim.moment_dtype = "bf16") under ZeRO-1 on 2 GPUs: each rank's shard holds BF16
// bits, the download gathers them (a BF16 all-gather) into whole FP32 moments that are BF16 values,
// identical on both ranks; loaded into a fresh ZeRO runner (each rank rounding its shard) they
// download again bit for bit; over 6 steps the losses follow the replicated BF16-moment run.
TEST_F(NcclDataParallel, ZeroKeepsBf16MomentsAndDownloadsThemWhole) {
  Config z = dp_step_config();
  z.optim.moment_dtype = "bf16";
  Config r = z;
  r.parallel.zero = false;
  const int64_t steps = 6;
  DpRun a, b;
  {
    CudaStepRunner runner(z, &nccl());
    EXPECT_TRUE(runner.zero());
    a = dp_run(z, runner, /*graph=*/true, steps);
  }
  {
    CudaStepRunner runner(r, &nccl());
    b = dp_run(r, runner, /*graph=*/true, steps);
  }
  ASSERT_EQ(a.steps.size(), size_t(steps));
  ASSERT_EQ(b.steps.size(), size_t(steps));
  for (int64_t i = 0; i < steps; ++i)
    EXPECT_NEAR(dp_loss(a.steps[size_t(i)]), dp_loss(b.steps[size_t(i)]), 2e-2 * dp_loss(b.steps[size_t(i)]))
        << "step " << i + 1;
  size_t not_bf16 = 0;
  for (const std::vector<float>* m : {&a.exp_avg, &a.exp_avg_sq})
    for (const float x : *m) not_bf16 += moe::bf16_to_f32(moe::f32_to_bf16(x)) != x;
  EXPECT_EQ(not_bf16, 0u) << "downloaded moments that are not BF16 values";
  EXPECT_TRUE(same_bits(rank0_copy(world(), a.exp_avg), a.exp_avg)) << "gathered exp_avg differs between ranks";
  EXPECT_TRUE(same_bits(rank0_copy(world(), a.params), a.params)) << "parameters differ between ranks";
  CudaStepRunner runner(z, &nccl());
  runner.load_state(a.params.data(), a.exp_avg.data(), a.exp_avg_sq.data(), a.optimizer_steps, a.bias);
  const size_t n = a.params.size();
  std::vector<float> p(n), m(n), v(n);
  runner.download_state(p.data(), m.data(), v.data(), nullptr, nullptr);
  EXPECT_TRUE(same_bits(m, a.exp_avg)) << "BF16 exp_avg scattered and gathered back";
  EXPECT_TRUE(same_bits(v, a.exp_avg_sq)) << "BF16 exp_avg_sq scattered and gathered back";
}

Config trainer_config(const std::filesystem::path& run) {
  Config c = small_gpu_train_config(run, /*micro_batch=*/2, /*steps=*/6);
  c.moe.bias_update_rate = 1e-3;
  c.train.eval_interval = 3;
  c.train.eval_batches = 4;
  c.optim.warmup_steps = 2;
  c.checkpoint.interval = 3;
  c.checkpoint.keep_last = 0;
  c.parallel.timeout_s = 120;
  return c;
}

TEST_F(NcclDataParallel, TrainerFollowsOneGpuAndResumesOnOneAndTwoGpus) {
  SharedDir dir(world(), "nccl_train");
  const int r = world().rank();
  auto self = make_self_comm();
  std::ostringstream log;
  // One GPU per rank (each on its own), then both ranks together.
  const TrainSummary one = train(trainer_config(dir / ("one_r" + std::to_string(r))), log, *self);
  const TrainSummary two = train(trainer_config(dir / "two"), log, world());
  // No ASSERT before a collective: a rank that returned early would leave the other waiting.
  const bool complete = one.losses.size() == 6u && two.losses.size() == 6u;
  EXPECT_TRUE(complete) << one.losses.size() << " and " << two.losses.size() << " losses";
  if (complete) {
    EXPECT_NEAR(two.losses[0], one.losses[0], 1e-9 * one.losses[0]);  // same weights, same tokens
    EXPECT_LE(worst_relative_difference(two.losses, one.losses), 2e-2);
  }
  EXPECT_NEAR(two.initial_eval_loss, one.initial_eval_loss, 1e-9 * one.initial_eval_loss);  // eval dealt over ranks
  EXPECT_NEAR(two.final_eval_loss, one.final_eval_loss, 2e-2 * one.final_eval_loss);
  std::vector<double> losses0 = two.losses;
  losses0.resize(6);
  world().broadcast(reinterpret_cast<int64_t*>(losses0.data()), int64_t(losses0.size()), 0);  // the bits
  if (complete) {
    EXPECT_EQ(losses0, two.losses) << "the ranks logged different losses";
  }
  if (r == 0) {
    EXPECT_EQ(train_losses(dir / "two"), two.losses) << "metrics.jsonl of rank 0";
    int64_t step_records = 0;
    for (const auto& rec : read_metrics(dir / "two")) {
      if (!rec.contains("loss")) continue;
      ++step_records;
      EXPECT_EQ(rec.value("num_gpus", int64_t(0)), 2) << rec.dump();
      EXPECT_NEAR(rec.value("tokens_per_s_per_gpu", 0.0), rec.value("tokens_per_s", 0.0) / 2, 1e-6 * rec.value("tokens_per_s", 0.0));
    }
    EXPECT_EQ(step_records, 6);
  }
  const std::filesystem::path step3 = dir / "two" / "checkpoints" / "step_3";
  EXPECT_TRUE(std::filesystem::exists(step3 / "train_state.json")) << step3;

  // Resume the 2-GPU checkpoint of step 3 on one GPU: the same weights and bias give the same
  // step-4 loss; the moments carry on, so the rest follows within BF16 tolerance.
  Config resume1 = trainer_config(dir / ("resume1_r" + std::to_string(r)));
  resume1.checkpoint.resume = step3.string();
  const TrainSummary r1 = train(resume1, log, *self);
  EXPECT_EQ(r1.start_step, 3);
  if (complete && r1.losses.size() == 3u) {
    EXPECT_NEAR(r1.losses[0], two.losses[3], 1e-9 * two.losses[3]);
    EXPECT_LE(worst_relative_difference(r1.losses, {two.losses.begin() + 3, two.losses.end()}), 2e-2);
  } else {
    ADD_FAILURE() << "resumed on one GPU: " << r1.losses.size() << " losses, expected 3";
  }

  // And on two GPUs: the very same run.
  Config resume2 = trainer_config(dir / "resume2");
  resume2.checkpoint.resume = step3.string();
  const TrainSummary r2 = train(resume2, log, world());
  if (complete) {
    EXPECT_EQ(r2.losses, std::vector<double>(two.losses.begin() + 3, two.losses.end()));
  }
  if (HasFailure()) std::fprintf(stderr, "[rank %d] trainer output:\n%s\n", r, log.str().c_str());
}

// Pipeline stages over the two GPUs (parallel.pp = 2, 1F1B over NCCL send/recv) against one GPU:
// the same step-1 loss (the stages compute the whole model's values bit for bit), the rest within
// 1e-4 (the grad norm sums the stages' squares in another order), the same first eval; the pp = 2
// checkpoint resumed on one GPU gives the next loss.
TEST_F(NcclDataParallel, PipelineStagesFollowOneGpuAndResumeOnOneGpu) {
  SharedDir dir(world(), "nccl_pipeline");
  const int r = world().rank();
  auto self = make_self_comm();
  std::ostringstream log;
  const TrainSummary one = train(trainer_config(dir / ("one_r" + std::to_string(r))), log, *self);
  Config cp = trainer_config(dir / "pp2");
  cp.parallel.pp = 2;
  const TrainSummary two = train(cp, log, world());
  const bool complete = one.losses.size() == 6u && two.losses.size() == 6u;
  EXPECT_TRUE(complete) << one.losses.size() << " and " << two.losses.size() << " losses";
  if (complete) {
    EXPECT_NEAR(two.losses[0], one.losses[0], 1e-9 * one.losses[0]);
    EXPECT_LE(worst_relative_difference(two.losses, one.losses), 1e-4);
    for (size_t i = 0; i < 6; ++i)
      std::printf("[rank %d] step %zu loss one GPU %.7f pp=2 %.7f\n", r, i + 1, one.losses[i], two.losses[i]);
  }
  EXPECT_NEAR(two.initial_eval_loss, one.initial_eval_loss, 1e-9 * one.initial_eval_loss);
  const std::filesystem::path step3 = dir / "pp2" / "checkpoints" / "step_3";
  EXPECT_TRUE(std::filesystem::exists(step3 / "train_state.json")) << step3;
  Config resume1 = trainer_config(dir / ("pp_resume1_r" + std::to_string(r)));
  resume1.checkpoint.resume = step3.string();
  const TrainSummary r1 = train(resume1, log, *self);
  EXPECT_EQ(r1.start_step, 3);
  if (complete && r1.losses.size() == 3u) {
    EXPECT_NEAR(r1.losses[0], two.losses[3], 1e-9 * two.losses[3]);
  } else {
    ADD_FAILURE() << "resumed on one GPU: " << r1.losses.size() << " losses, expected 3";
  }
  if (HasFailure()) std::fprintf(stderr, "[rank %d] trainer output:\n%s\n", r, log.str().c_str());
}

}  // namespace
}  // namespace moe::testing

// The NCCL groups are made once, after each rank bound its GPU (tests/gpu/two_gpu_main.h).
int main(int argc, char** argv) {
  using namespace moe::testing;
  return run_two_gpu_tests(
      argc, argv, "test_nccl", &g_skip_reason,
      [](moe::Comm& world) { g_nccl = moe::make_nccl_comm(world); },
      [] { g_nccl.reset(); });
}
