// Expert parallelism over two GPUs with NCCL, run as `mpirun -np 2 test_ep_gpu` (CTest entry
// gpu.ep.np2, label gpu): ep = 2 with dp = 2 (each GPU holds 4 of the 8 experts of every MoE layer,
// ep-dp groups of one) against the one-GPU runner on the same global batch. The first step's
// forward is the one-GPU forward (loss within 1e-5 relative, expert counts and the updated expert
// bias exactly), its gradients equal the one-GPU gradients (dense tensors, and each rank's
// experts against the matching rows; normwise 1e-3), and every loss of 6 steps follows within the
// BF16 tolerance (rel 2e-2); experts without tokens (all routes forced onto rank 0's experts, so
// rank 1 receives no rows); the trainer with ep = 2 against one GPU and its sliced checkpoint
// resumed on one GPU; the rowwise exchange (NVSHMEM) bitwise against the all-to-all one, in the CUDA
// graph, and with a capacity. Every test is skipped, never passed, unless the job has 2 ranks and 2 GPUs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cuda/common.h"
#include "cuda/ops/nccl.h"
#include "cuda/ops/nvshmem_world.h"
#include "gpu/dp_test_util.h"
#include "gpu/two_gpu_main.h"
#include "parallel/comm.h"
#include "parallel/mpi_test_util.h"
#include "parallel/nccl_comm.h"
#include "support/test_util.h"
#include "train/trainer.h"

namespace moe::testing {
namespace {

std::unique_ptr<cuda::NcclComm> g_dp, g_ep;  // both over the world of 2 ranks
std::unique_ptr<cuda::NvshmemWorld> g_nvshmem;  // PE = world rank (builds with NVSHMEM)
std::string g_skip_reason;

class ExpertParallelGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!g_dp) GTEST_SKIP() << g_skip_reason;
  }
  static Comm& world() { return world_comm(); }
};

// This rank's tensors (the runner's local layout) cut out of a global flat buffer of `global`.
std::vector<float> local_slice(const ParamLayout& global, const std::vector<float>& values, const CudaModel& m) {
  std::vector<float> out(size_t(m.layout().total_numel()), 0.0f);
  for (size_t i = 0; i < m.layout().entries().size(); ++i) {
    const ParamEntry& e = m.layout().entries()[i];
    const ParamEntry& g = global.find(e.name);
    const int64_t at = g.offset + m.placements()[i].offset;
    std::copy(values.begin() + at, values.begin() + at + e.numel, out.begin() + e.offset);
  }
  return out;
}

double norm_rel_error(const float* a, const float* ref, int64_t n) {
  double diff = 0, base = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    base += double(ref[i]) * ref[i];
  }
  return base > 0 ? std::sqrt(diff / base) : std::sqrt(diff);
}

struct EpRun {
  std::vector<StepStats> steps;
  std::vector<float> grads_step1, bias_step1, bias;  // local layout
};

// `steps` steps of the runner from Model<float>::init_params(7), `bias` as the initial expert bias;
// the rank's micro-batches are its share of the global batch (as dp_run). Step 1 is collected
// before step 2 is submitted, and its (reduced) gradients and updated bias are read back.
EpRun ep_run(const Config& c, CudaStepRunner& runner, int64_t steps, const std::vector<float>& bias) {
  Model<float> init(c.model, c.moe);
  init.init_params(7);
  const std::vector<float> global(init.params(), init.params() + init.layout().total_numel());
  const std::vector<float> local = local_slice(init.layout(), global, runner.model());
  runner.set_use_graph(false);
  runner.load_state(local.data(), nullptr, nullptr, 0, bias);
  const int64_t global_micro = c.train.global_batch / c.train.micro_batch;
  const int64_t per_rank = global_micro / runner.dp_size(), first = runner.dp_rank() * per_rank;
  EpRun r;
  for (int64_t step = 1; step <= steps; ++step) {
    std::vector<Batch> all, mine;
    for (int64_t g = 0; g < global_micro; ++g) all.push_back(dp_global_micro_batch(c, step, g));
    for (int64_t m = 0; m < per_rank; ++m) mine.push_back(all[size_t(first + m)]);
    runner.submit(step, mine, dp_count_targets(all), c.optim.lr * (step <= 2 ? 0.5 : 1.0), 99);
    if (step == 1) {
      r.steps.push_back(runner.collect());
      r.grads_step1 = runner.model().download_grads();
      runner.download_state(nullptr, nullptr, nullptr, nullptr, &r.bias_step1);
    } else if (runner.pending() > 1) {
      r.steps.push_back(runner.collect());
    }
  }
  while (runner.pending() > 0) r.steps.push_back(runner.collect());
  runner.download_state(nullptr, nullptr, nullptr, nullptr, &r.bias);
  return r;
}

// The one-GPU run and the ep = 2 run of the same config and bias, compared.
void expect_follows_one_gpu(const Config& c, const std::vector<float>& bias, const std::string& what) {
  CudaStepRunner one(c);
  const EpRun ref = ep_run(c, one, 6, bias);
  Config ce = c;
  ce.parallel.ep = 2;
  CudaStepRunner two(ce, g_dp.get(), g_ep.get(), nullptr);
  EXPECT_FALSE(two.uses_graph()) << what;
  EXPECT_EQ(two.model().ep_size(), 2) << what;
  EXPECT_EQ(two.model().expert_slice().first, 4 * int64_t(world_comm().rank())) << what;
  EXPECT_EQ(two.model().expert_slice().count, 4) << what;
  const EpRun got = ep_run(ce, two, 6, bias);
  ASSERT_EQ(ref.steps.size(), 6u) << what;
  ASSERT_EQ(got.steps.size(), 6u) << what;

  // Step 1: same weights and tokens, so the same forward; gradients up to FP32 summation order.
  const StepStats &r1 = ref.steps[0], &g1 = got.steps[0];
  EXPECT_NEAR(dp_loss(g1), dp_loss(r1), 1e-5 * dp_loss(r1)) << what;
  EXPECT_EQ(g1.num_targets, r1.num_targets) << what;
  EXPECT_EQ(g1.tokens_per_expert, r1.tokens_per_expert) << what << ": expert counts of step 1";
  EXPECT_NEAR(g1.grad_norm, r1.grad_norm, 1e-3 * r1.grad_norm) << what;
  EXPECT_NEAR(g1.lb_loss, r1.lb_loss, 1e-5 * std::abs(r1.lb_loss) + 1e-9) << what;
  EXPECT_TRUE(same_bits(got.bias_step1, ref.bias_step1)) << what << ": expert bias after step 1";
  // Gradients: the runner's (dense tensors summed over the ranks, local experts holding every
  // token of the group) against the one-GPU gradients, tensor by tensor (experts: this rank's rows).
  Model<float> shape(c.model, c.moe);
  const std::vector<float> ref_local = local_slice(shape.layout(), ref.grads_step1, two.model());
  for (const ParamEntry& e : two.model().layout().entries()) {
    const double err = norm_rel_error(got.grads_step1.data() + e.offset, ref_local.data() + e.offset, e.numel);
    EXPECT_LE(err, 1e-3) << what << ": gradient of " << e.name << (e.expert ? " (local experts)" : "");
  }
  // Every step: BF16 tolerance.
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_NEAR(dp_loss(got.steps[i]), dp_loss(ref.steps[i]), 2e-2 * dp_loss(ref.steps[i])) << what << ", step " << i + 1;
    EXPECT_NEAR(got.steps[i].grad_norm, ref.steps[i].grad_norm, 5e-2 * ref.steps[i].grad_norm)
        << what << ", step " << i + 1;
    EXPECT_EQ(got.steps[i].skipped, ref.steps[i].skipped) << what << ", step " << i + 1;
    EXPECT_EQ(got.steps[i].num_routes, ref.steps[i].num_routes) << what << ", step " << i + 1;
  }
  // The replicated bias stays equal on both ranks.
  std::vector<float> bias0 = got.bias;
  world_comm().broadcast(bias0.data(), int64_t(bias0.size()), 0);
  EXPECT_TRUE(same_bits(bias0, got.bias)) << what << ": the ranks' expert biases differ";
}

TEST_F(ExpertParallelGpu, StepsFollowOneGpu) {
  const Config c = dp_step_config();
  Model<float> m(c.model, c.moe);
  expect_follows_one_gpu(c, std::vector<float>(m.expert_bias().size(), 0.0f), "learned routing");
}

// train.precision = "fp8" with ep = 2: the rows travel as FP8 payload and enter the experts as the
// same codes the one-GPU run's producers write, so the first forward is the one-GPU forward (each
// expert output row depends on its row alone); the experts' weight gradients (BF16) read the
// rows' dequantised values (the CPU reference's FP8 exchange) where the one-GPU run reads the BF16
// rows, so they follow within FP8's error, the dense gradients and the losses within tolerances
// of that size.
TEST_F(ExpertParallelGpu, Fp8StepsFollowOneGpu) {
  Config c = dp_step_config();
  c.train.precision = "fp8";
  Model<float> m(c.model, c.moe);
  const std::vector<float> bias(m.expert_bias().size(), 0.0f);
  CudaStepRunner one(c);
  const EpRun ref = ep_run(c, one, 6, bias);
  Config ce = c;
  ce.parallel.ep = 2;
  CudaStepRunner two(ce, g_dp.get(), g_ep.get(), nullptr);
  const EpRun got = ep_run(ce, two, 6, bias);
  ASSERT_EQ(ref.steps.size(), 6u);
  ASSERT_EQ(got.steps.size(), 6u);
  EXPECT_NEAR(dp_loss(got.steps[0]), dp_loss(ref.steps[0]), 1e-4 * dp_loss(ref.steps[0]));
  EXPECT_EQ(got.steps[0].tokens_per_expert, ref.steps[0].tokens_per_expert) << "expert counts of step 1";
  Model<float> shape(c.model, c.moe);
  const std::vector<float> ref_local = local_slice(shape.layout(), ref.grads_step1, two.model());
  for (const ParamEntry& e : two.model().layout().entries()) {
    const double err = norm_rel_error(got.grads_step1.data() + e.offset, ref_local.data() + e.offset, e.numel);
    EXPECT_LE(err, e.expert ? 0.1 : 2e-2) << "gradient of " << e.name << (e.expert ? " (local experts)" : "");
  }
  for (size_t i = 0; i < 6; ++i)
    EXPECT_NEAR(dp_loss(got.steps[i]), dp_loss(ref.steps[i]), 3e-2 * dp_loss(ref.steps[i])) << "step " << i + 1;
  // A row goes out as D + D / 32 bytes (dispatch) and comes back as 2 D (combine): every row of
  // the traffic counts 264 + 512 bytes, sent and received together.
  const EpTraffic t = two.model().ep_traffic();
  ASSERT_GT(t.rows_sent, 0);
  EXPECT_EQ(t.bytes_sent + t.bytes_received, t.rows_sent * (264 + 512));
}

// Expert parallelism with activation recomputation: selective (the experts' h recomputed on the
// expert side, their outputs kept) and full (the layer's forward again, exchanges included)
// give bitwise the ep = 2 run without recomputation.
TEST_F(ExpertParallelGpu, RecomputeMatchesNoRecomputeBitwise) {
  Config c = dp_step_config();
  c.parallel.ep = 2;
  Model<float> m(c.model, c.moe);
  const std::vector<float> bias(m.expert_bias().size(), 0.0f);
  CudaStepRunner base(c, g_dp.get(), g_ep.get(), nullptr);
  const EpRun ref = ep_run(c, base, 3, bias);
  for (const char* mode : {"selective", "full"}) {
    Config cr = c;
    cr.train.recompute = mode;
    CudaStepRunner runner(cr, g_dp.get(), g_ep.get(), nullptr);
    const EpRun got = ep_run(cr, runner, 3, bias);
    ASSERT_EQ(got.steps.size(), ref.steps.size()) << mode;
    EXPECT_TRUE(same_bits(got.grads_step1, ref.grads_step1)) << mode << ": gradients of step 1";
    EXPECT_TRUE(same_bits(got.bias, ref.bias)) << mode;
    for (size_t i = 0; i < ref.steps.size(); ++i) {
      EXPECT_EQ(got.steps[i].ce_sum, ref.steps[i].ce_sum) << mode << ", step " << i + 1;
      EXPECT_EQ(got.steps[i].grad_norm, ref.steps[i].grad_norm) << mode << ", step " << i + 1;
      EXPECT_EQ(got.steps[i].tokens_per_expert, ref.steps[i].tokens_per_expert) << mode << ", step " << i + 1;
    }
  }
}

// Biases push every route onto experts 0-3 (rank 0's): rank 1 receives no rows in any layer, and
// experts 4-7 have no tokens; nothing else changes.
TEST_F(ExpertParallelGpu, ExpertsWithoutTokens) {
  Config c = dp_step_config();
  c.moe.bias_update_rate = 0;
  Model<float> m(c.model, c.moe);
  std::vector<float> bias(m.expert_bias().size(), 0.0f);
  for (size_t i = 0; i < bias.size(); ++i)
    if (i % size_t(c.moe.num_experts) >= 4) bias[i] = -100.0f;
  expect_follows_one_gpu(c, bias, "routes only to rank 0's experts");
  // The counts themselves: nothing for experts 4-7 (checked on a fresh forward of the ep model).
  Config ce = c;
  ce.parallel.ep = 2;
  CudaStepRunner two(ce, g_dp.get(), g_ep.get(), nullptr);
  const EpRun got = ep_run(ce, two, 1, bias);
  ASSERT_EQ(got.steps.size(), 1u);
  for (const auto& layer : got.steps[0].tokens_per_expert)
    for (size_t e = 0; e < layer.size(); ++e) {
      if (e >= 4) {
        EXPECT_EQ(layer[e], 0) << "expert " << e;
      }
    }
  // Rank 1's experts got no rows: their gradients are exactly zero.
  if (world().rank() == 1)
    for (const ParamEntry& e : two.model().layout().entries())
      if (e.expert)
        for (int64_t i = 0; i < e.numel; ++i)
          if (got.grads_step1[size_t(e.offset + i)] != 0.0f) {
            ADD_FAILURE() << e.name << " has a non-zero gradient at " << i;
            break;
          }
}

// `c` at ep = 2 through the all-to-all exchange and through the rowwise one (NVSHMEM symmetric
// buffers), 4 steps each from the same bias: the runs bitwise equal (the first step's gradients,
// every step's CE sum and grad norm), and the rowwise run in the step's CUDA graph bitwise its
// eager run. Returns {all-to-all, rowwise}.
std::pair<EpRun, EpRun> rowwise_against_all_to_all(const Config& c, const std::vector<float>& bias,
                                                   const std::string& what) {
  CudaStepRunner a2a(c, g_dp.get(), g_ep.get(), nullptr);
  EpRun ref = ep_run(c, a2a, 4, bias);
  Config cr = c;
  cr.parallel.ep_backend = "rowwise";
  CudaStepRunner rw(cr, make_run_plan(cr, 2, "cuda"), g_dp.get(), g_ep.get(), nullptr, g_nvshmem.get());
  EXPECT_TRUE(rw.model().rowwise());
  EpRun got = ep_run(cr, rw, 4, bias);
  EXPECT_EQ(got.steps.size(), ref.steps.size());
  EXPECT_TRUE(same_bits(got.grads_step1, ref.grads_step1)) << what << ": gradients of step 1";
  for (size_t i = 0; i < std::min(ref.steps.size(), got.steps.size()); ++i) {
    EXPECT_EQ(got.steps[i].ce_sum, ref.steps[i].ce_sum) << what << ", step " << i + 1;
    EXPECT_EQ(got.steps[i].grad_norm, ref.steps[i].grad_norm) << what << ", step " << i + 1;
  }
  // In the graph: the same losses again (ep_run turns the graph off; this loop keeps it on).
  CudaStepRunner graph(cr, make_run_plan(cr, 2, "cuda"), g_dp.get(), g_ep.get(), nullptr, g_nvshmem.get());
  EXPECT_TRUE(graph.uses_graph());
  const DpRun on = dp_run(cr, graph, true, 4);
  CudaStepRunner eager(cr, make_run_plan(cr, 2, "cuda"), g_dp.get(), g_ep.get(), nullptr, g_nvshmem.get());
  const DpRun off = dp_run(cr, eager, false, 4);
  expect_same_steps(on, off, what + " rowwise ep = 2, graph on against off");
  EXPECT_EQ(on.graph_launches, 3) << what;
  return {std::move(ref), std::move(got)};
}

// The rowwise exchange over the two GPUs against the all-to-all one: dropless, both place every
// row in the same grouped layout, so the experts see the same rows in the same order and the runs
// are bitwise equal (losses, counts, gradients, bias), the rowwise one captured in the step's CUDA
// graph; with parallel.ep_capacity_factor = 1 rows are dropped, counted (dropped_frac) and the run
// goes on.
TEST_F(ExpertParallelGpu, RowwiseEqualsAllToAllAndRunsInTheGraph) {
  if (!g_nvshmem) GTEST_SKIP() << "this build has no NVSHMEM: the rowwise case did not run";
  Config c = dp_step_config();
  c.parallel.ep = 2;
  Model<float> m(c.model, c.moe);
  const std::vector<float> bias(m.expert_bias().size(), 0.0f);
  const auto [ref, got] = rowwise_against_all_to_all(c, bias, "bf16");
  EXPECT_TRUE(same_bits(got.bias, ref.bias));
  for (size_t i = 0; i < std::min(ref.steps.size(), got.steps.size()); ++i) {
    EXPECT_EQ(got.steps[i].tokens_per_expert, ref.steps[i].tokens_per_expert) << "step " << i + 1;
    EXPECT_EQ(got.steps[i].num_dropped, 0) << "step " << i + 1;
  }
  // A capacity: rows dropped and counted on every rank's statistics.
  Config cc = c;
  cc.parallel.ep_backend = "rowwise";
  cc.parallel.ep_capacity_factor = 1.0;
  CudaStepRunner capped(cc, make_run_plan(cc, 2, "cuda"), g_dp.get(), g_ep.get(), nullptr, g_nvshmem.get());
  const EpRun cap = ep_run(cc, capped, 2, bias);
  ASSERT_EQ(cap.steps.size(), 2u);
  EXPECT_GT(cap.steps[0].num_dropped, 0);
  EXPECT_TRUE(std::isfinite(dp_loss(cap.steps[1])));
}

Config trainer_config(const std::filesystem::path& run) {
  Config c = dp_step_config();
  c.train.steps = 6;
  c.train.eval_interval = 3;
  c.train.eval_batches = 3;  // not a multiple of 2 ranks: a rank repeats one eval forward
  c.train.device = "cuda";
  c.train.precision = "bf16";
  c.optim.warmup_steps = 2;
  c.checkpoint.interval = 3;
  c.checkpoint.keep_last = 0;
  c.log.interval = 1;
  c.parallel.timeout_s = 120;
  c.run.dir = run.string();
  return c;
}

// train.precision = "fp8" over the rowwise exchange: the FP8 payload rows (padded to 16-byte
// words) land in the same grouped layout as the all-to-all exchange's and unpack to the same codes
// and values, and the step's update writes the same weight codes the all-to-all run quantises in
// its forward, so the runs are bitwise equal; in the CUDA graph too.
TEST_F(ExpertParallelGpu, Fp8RowwiseEqualsAllToAllAndRunsInTheGraph) {
  if (!g_nvshmem) GTEST_SKIP() << "this build has no NVSHMEM: the rowwise case did not run";
  Config c = dp_step_config();
  c.parallel.ep = 2;
  c.train.precision = "fp8";
  Model<float> m(c.model, c.moe);
  rowwise_against_all_to_all(c, std::vector<float>(m.expert_bias().size(), 0.0f), "fp8");
}

TEST_F(ExpertParallelGpu, TrainerFollowsOneGpuAndItsCheckpointResumesOnOneGpu) {
  SharedDir dir(world(), "ep_gpu_train");
  const int r = world().rank();
  auto self = make_self_comm();
  std::ostringstream log;
  const TrainSummary one = train(trainer_config(dir / ("one_r" + std::to_string(r))), log, *self);
  Config ce = trainer_config(dir / "ep2");
  ce.parallel.ep = 2;
  const TrainSummary two = train(ce, log, world());
  const bool complete = one.losses.size() == 6u && two.losses.size() == 6u;
  EXPECT_TRUE(complete) << one.losses.size() << " and " << two.losses.size() << " losses";
  if (complete) {
    EXPECT_NEAR(two.losses[0], one.losses[0], 1e-5 * one.losses[0]);
    EXPECT_LE(worst_relative_difference(two.losses, one.losses), 2e-2);
  }
  EXPECT_NEAR(two.initial_eval_loss, one.initial_eval_loss, 1e-5 * one.initial_eval_loss);
  EXPECT_NEAR(two.final_eval_loss, one.final_eval_loss, 2e-2 * one.final_eval_loss);
  const std::filesystem::path step3 = dir / "ep2" / "checkpoints" / "step_3";
  EXPECT_TRUE(std::filesystem::exists(step3 / "train_state.json")) << step3;

  // The sliced 2-GPU checkpoint (each rank wrote its experts) on one GPU: the same weights and
  // bias give the step-4 loss of the ep run up to the forward's rounding.
  Config resume1 = trainer_config(dir / ("resume1_r" + std::to_string(r)));
  resume1.checkpoint.resume = step3.string();
  const TrainSummary r1 = train(resume1, log, *self);
  EXPECT_EQ(r1.start_step, 3);
  if (complete && r1.losses.size() == 3u) {
    EXPECT_NEAR(r1.losses[0], two.losses[3], 1e-5 * two.losses[3]);
    EXPECT_LE(worst_relative_difference(r1.losses, {two.losses.begin() + 3, two.losses.end()}), 2e-2);
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
      argc, argv, "test_ep_gpu", &g_skip_reason,
      [](moe::Comm& world) {
        g_dp = moe::make_nccl_comm(world);
        g_ep = moe::make_nccl_comm(world);
        if (moe::cuda::nvshmem_available()) {  // rank 0's unique id, broadcast as int64 words
          std::vector<uint8_t> id = world.rank() == 0 ? moe::cuda::nvshmem_unique_id() : std::vector<uint8_t>();
          int64_t n = int64_t(id.size());
          world.broadcast(&n, 1, 0);
          std::vector<int64_t> words(size_t((n + 7) / 8), 0);
          if (world.rank() == 0) std::memcpy(words.data(), id.data(), id.size());
          world.broadcast(words.data(), int64_t(words.size()), 0);
          id.resize(size_t(n));
          std::memcpy(id.data(), words.data(), id.size());
          g_nvshmem = std::make_unique<moe::cuda::NvshmemWorld>(world.rank(), world.size(), id, size_t(512) << 20);
        }
      },
      [] {
        g_nvshmem.reset();
        g_ep.reset();
        g_dp.reset();
      });
}
