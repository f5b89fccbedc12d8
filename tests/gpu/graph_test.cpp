// CUDA graphs. Ops: one step of embedding -> RMSNorm -> RoPE and SwiGLU, forward and backward,
// captured once and replayed twice, reproduces an eager run bitwise, and the bad-id counter
// advances on every replay (bad ids are flagged, never trapped). Whole training steps
// (CudaStepRunner): graph on and graph off give the same losses, grad norms, parameters, moments
// and expert bias; the graph is captured once and replayed; a reallocation drops and recaptures
// it; the device expert-bias update is Model<float>::update_expert_bias bitwise; statistics come
// back in order; random routing runs eagerly and reproduces itself; bad token ids throw.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>

#include "cuda/ops/device_info.h"
#include "cuda/ops/embedding.h"
#include "cuda/ops/memory.h"
#include "cuda/ops/rmsnorm.h"
#include "cuda/ops/rope.h"
#include "cuda/ops/swiglu.h"
#include "cuda/sm_reserve.h"
#include "gpu/dp_test_util.h"
#include "gpu/gpu_test_util.h"
#include "model/model.h"
#include "support/test_util.h"
#include "train/cuda_step.h"
#include "train/run_plan.h"

namespace moe::testing {
namespace {

struct StepBuffers {
  static constexpr int64_t kBatch = 2, kSeq = 96, kHeads = 4, kHeadDim = 64, kVocab = 500, kInner = 384;
  static constexpr int64_t kN = kBatch * kSeq, kD = kHeads * kHeadDim;

  std::vector<int32_t> ids_host = [] {
    std::vector<int32_t> v(kN);
    for (int64_t i = 0; i < kN; ++i) v[i] = static_cast<int32_t>((i * 37) % kVocab);
    v[5] = -3;      // two bad ids
    v[77] = 100000;
    return v;
  }();
  std::vector<float> dw_emb0 = random_f32(kVocab * kD, 91);
  std::vector<float> dw_norm0 = random_f32(kD, 92);

  GuardedBuffer<int32_t> ids{ids_host};
  GuardedBuffer<uint16_t> w_emb{random_bf16(kVocab * kD, 93)}, w_norm{random_bf16(kD, 94, 0.1f, 1.0f)};
  GuardedBuffer<uint16_t> x{kN * kD}, y{kN * kD}, dy{random_bf16(kN * kD, 95)}, dx{kN * kD};
  GuardedBuffer<uint16_t> gate_up{random_bf16(kN * 2 * kInner, 96)}, h{kN * kInner}, dh{random_bf16(kN * kInner, 97)},
      dgate_up{kN * 2 * kInner};
  GuardedBuffer<float> rstd{kN}, dw_emb{dw_emb0}, dw_norm{dw_norm0}, dw_emb_start{dw_emb0}, dw_norm_start{dw_norm0};
  GuardedBuffer<uint32_t> num_bad{std::vector<uint32_t>{0}};
  size_t ws_emb_bytes = cuda::embedding_backward_workspace_bytes(kN, kVocab);
  size_t ws_norm_bytes = cuda::rmsnorm_backward_workspace_bytes(kN, kD);
  GuardedBuffer<uint8_t> ws_emb{static_cast<int64_t>(ws_emb_bytes)}, ws_norm{static_cast<int64_t>(ws_norm_bytes)};

  // One training-step-shaped sequence of every op, on `s`.
  void run(cudaStream_t s) {
    MOE_CUDA_CHECK(cudaMemcpyAsync(dw_emb.data(), dw_emb_start.data(), dw_emb.bytes(), cudaMemcpyDeviceToDevice, s));
    MOE_CUDA_CHECK(cudaMemcpyAsync(dw_norm.data(), dw_norm_start.data(), dw_norm.bytes(), cudaMemcpyDeviceToDevice, s));
    cuda::embedding_forward(ids.data(), w_emb.data(), x.data(), kN, kVocab, kD, num_bad.data(), s);
    cuda::rmsnorm_forward(x.data(), w_norm.data(), y.data(), rstd.data(), kN, kD, 1e-6, s);
    cuda::rope_forward(y.data(), kBatch, kSeq, kHeads, kHeadDim, 1e4, s);
    cuda::swiglu_forward(gate_up.data(), h.data(), kN, kInner, s);
    cuda::swiglu_backward(gate_up.data(), dh.data(), dgate_up.data(), kN, kInner, s);
    cuda::rope_backward(dy.data(), kBatch, kSeq, kHeads, kHeadDim, 1e4, s);
    cuda::rmsnorm_backward(x.data(), w_norm.data(), rstd.data(), dy.data(), dx.data(), dw_norm.data(), kN, kD,
                           ws_norm.data(), ws_norm_bytes, s);
    cuda::embedding_backward(ids.data(), dx.data(), dw_emb.data(), kN, kVocab, kD, num_bad.data(), ws_emb.data(),
                             ws_emb_bytes, s);
  }
};

struct Snapshot {
  std::vector<uint16_t> y, h, dgate_up, dx;
  std::vector<float> dw_emb, dw_norm;
  bool operator==(const Snapshot& o) const {
    auto same = [](const auto& a, const auto& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
    };
    return same(y, o.y) && same(h, o.h) && same(dgate_up, o.dgate_up) && same(dx, o.dx) &&
           same(dw_emb, o.dw_emb) && same(dw_norm, o.dw_norm);
  }
};

Snapshot snapshot(const StepBuffers& b) {
  return {b.y.download(), b.h.download(), b.dgate_up.download(), b.dx.download(), b.dw_emb.download(),
          b.dw_norm.download()};
}

TEST(CudaGraph, CapturedStepReplaysBitwiseAndCountsBadIds) {
  MOE_SKIP_WITHOUT_GPU();
  StepBuffers b;
  TestStream stream;
  const std::vector<uint16_t> dy0 = b.dy.download();

  b.run(stream.get());  // eager
  stream.sync();
  const Snapshot eager = snapshot(b);
  EXPECT_EQ(b.num_bad.download()[0], 4u);  // 2 bad ids, seen by forward and by backward

  b.dy.upload(dy0);  // rope_backward worked in place on dy
  cudaGraph_t graph = nullptr;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  b.run(stream.get());
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (int replay = 1; replay <= 2; ++replay) {
    b.dy.upload(dy0);
    MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    stream.sync();
    EXPECT_TRUE(snapshot(b) == eager) << "graph replay " << replay << " differs from the eager run";
    EXPECT_EQ(b.num_bad.download()[0], 4u + 4u * replay) << "after replay " << replay;
  }
  MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOE_CUDA_CHECK(cudaGraphDestroy(graph));
}

// ---------------------------------------------------------------------------------------------
// Whole training steps through CudaStepRunner.

// The GPU tests' tiny model (dp_step_config: head_dim 64, QK-norm, a dense layer, 8 experts
// top-2, a shared expert), learned routing, 2 micro-batches of 2 x 64 tokens per step,
// expert-bias updates on.
Config step_config(const std::string& routing = "learned") {
  Config c = dp_step_config(routing);
  c.train.global_batch = 4;
  return c;
}

// Micro-batch m of step `step` (dp_global_micro_batch: ids from the first 32 of the vocabulary,
// so the loss can fall from ln 256 towards ln 32 in a few steps; two targets ignored).
Batch step_batch(const Config& c, int64_t step, int64_t m, int64_t sequences = -1) {
  return dp_global_micro_batch(c, step, m, sequences);
}

std::vector<Batch> step_batches(const Config& c, int64_t step) {
  std::vector<Batch> micro;
  for (int64_t m = 0; m < c.train.global_batch / c.train.micro_batch; ++m) micro.push_back(step_batch(c, step, m));
  return micro;
}

struct RunResult {
  std::vector<StepStats> steps;
  std::vector<float> params, exp_avg, exp_avg_sq, bias;
  int64_t optimizer_steps = 0, graph_launches = 0;
  bool uses_graph = false;
};

// `steps` steps from Model<float>::init_params(7), each submitted before the previous one is
// collected (the trainer's pattern); `after_submit(runner, step)` runs after each submit.
RunResult run_steps(const Config& c, bool graph, int64_t steps,
                    const std::function<void(CudaStepRunner&, int64_t)>& after_submit = {}) {
  Model<float> init(c.model, c.moe);
  init.init_params(7);
  CudaStepRunner runner(c);
  runner.set_use_graph(graph);
  runner.load_state(init.params(), nullptr, nullptr, 0, init.expert_bias());
  RunResult r;
  for (int64_t step = 1; step <= steps; ++step) {
    const std::vector<Batch> micro = step_batches(c, step);
    runner.submit(step, micro, dp_count_targets(micro), c.optim.lr * (step <= 2 ? 0.5 : 1.0), 99);
    if (after_submit) after_submit(runner, step);
    if (runner.pending() > 1) r.steps.push_back(runner.collect());
  }
  while (runner.pending() > 0) r.steps.push_back(runner.collect());
  const size_t total = static_cast<size_t>(init.layout().total_numel());
  r.params.resize(total);
  r.exp_avg.resize(total);
  r.exp_avg_sq.resize(total);
  runner.download_state(r.params.data(), r.exp_avg.data(), r.exp_avg_sq.data(), &r.optimizer_steps, &r.bias);
  r.graph_launches = runner.graph_launches();
  r.uses_graph = runner.uses_graph();
  return r;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) worst = std::max(worst, std::abs(double(a[i]) - double(b[i])));
  return worst;
}

double rel_diff(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

// Losses, grad norms, counts and final state of two runs. Both run the same kernels in the same
// order on the same data: results are expected bitwise equal (the only atomics are integer
// counters); the bounds allow 1e-6 relative on losses and norms and 1e-6 absolute on weights
// and moments (weights are ~0.02-1), expert bias exactly.
void expect_same_runs(const RunResult& a, const RunResult& b, const char* what) {
  ASSERT_EQ(a.steps.size(), b.steps.size()) << what;
  for (size_t i = 0; i < a.steps.size(); ++i) {
    const StepStats& x = a.steps[i];
    const StepStats& y = b.steps[i];
    const double lx = x.ce_sum / double(x.num_targets), ly = y.ce_sum / double(y.num_targets);
    std::printf("%s step %lld: loss %.9f / %.9f, grad norm %.9f / %.9f\n", what, (long long)x.step, lx, ly,
                x.grad_norm, y.grad_norm);
    EXPECT_EQ(x.step, y.step);
    EXPECT_EQ(x.num_targets, y.num_targets);
    EXPECT_LE(rel_diff(lx, ly), 1e-6) << what << " step " << x.step;
    EXPECT_LE(rel_diff(x.grad_norm, y.grad_norm), 1e-6) << what << " step " << x.step;
    EXPECT_LE(rel_diff(x.lb_loss, y.lb_loss), 1e-6) << what << " step " << x.step;
    EXPECT_LE(rel_diff(x.z_loss, y.z_loss), 1e-6) << what << " step " << x.step;
    EXPECT_EQ(x.tokens_per_expert, y.tokens_per_expert) << what << " step " << x.step;
    EXPECT_EQ(x.skipped, y.skipped) << what << " step " << x.step;
  }
  const double dp = max_abs_diff(a.params, b.params), dm = max_abs_diff(a.exp_avg, b.exp_avg),
               dv = max_abs_diff(a.exp_avg_sq, b.exp_avg_sq);
  std::printf("%s: final max |diff| params %.3e, exp_avg %.3e, exp_avg_sq %.3e\n", what, dp, dm, dv);
  EXPECT_LE(dp, 1e-6) << what;
  EXPECT_LE(dm, 1e-6) << what;
  EXPECT_LE(dv, 1e-6) << what;
  EXPECT_EQ(a.bias, b.bias) << what;
  EXPECT_EQ(a.optimizer_steps, b.optimizer_steps) << what;
}

TEST(CudaStep, GraphMatchesEagerAndReplays) {
  MOE_SKIP_WITHOUT_GPU();
  const Config c = step_config();
  constexpr int64_t kSteps = 6;
  const RunResult eager = run_steps(c, false, kSteps);
  const RunResult graph = run_steps(c, true, kSteps);
  EXPECT_FALSE(eager.uses_graph);
  EXPECT_EQ(eager.graph_launches, 0);
  EXPECT_TRUE(graph.uses_graph);
  EXPECT_EQ(graph.graph_launches, kSteps - 1);  // step 1 eager, step 2 captured, then replays
  expect_same_runs(graph, eager, "graph vs eager");
  EXPECT_EQ(graph.optimizer_steps, kSteps);
  // It trained, the bias moved, every route was counted.
  const double first = graph.steps.front().ce_sum / double(graph.steps.front().num_targets);
  const double last = graph.steps.back().ce_sum / double(graph.steps.back().num_targets);
  EXPECT_LT(last, first);
  EXPECT_TRUE(std::any_of(graph.bias.begin(), graph.bias.end(), [](float b) { return b != 0.0f; }));
  for (const StepStats& s : graph.steps) {
    EXPECT_FALSE(s.skipped);
    EXPECT_EQ(s.num_routes, 2 * 2 * 128 * 2);  // micro-batches x MoE layers x tokens x top_k
    for (const auto& layer : s.tokens_per_expert) {
      int64_t sum = 0;
      for (int64_t v : layer) sum += v;
      EXPECT_EQ(sum, 2 * 128 * 2) << "step " << s.step;
    }
  }
}

// Training steps with activation recomputation, captured in the CUDA graph like any step: losses,
// grad norms, counts, parameters, moments and expert bias bitwise those without recomputation.
TEST(CudaStep, RecomputeInTheGraphMatchesNoRecomputeBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  Config c = step_config();
  constexpr int64_t kSteps = 4;
  const RunResult none = run_steps(c, true, kSteps);
  for (const char* mode : {"selective", "full"}) {
    c.train.recompute = mode;
    const RunResult r = run_steps(c, true, kSteps);
    EXPECT_TRUE(r.uses_graph) << mode;
    EXPECT_EQ(r.graph_launches, none.graph_launches) << mode;
    expect_same_runs(r, none, mode);
    EXPECT_EQ(r.params, none.params) << mode << ": parameters not bitwise equal";
    EXPECT_EQ(r.exp_avg, none.exp_avg) << mode;
    EXPECT_EQ(r.exp_avg_sq, none.exp_avg_sq) << mode;
    for (size_t i = 0; i < r.steps.size(); ++i) {
      EXPECT_EQ(r.steps[i].ce_sum, none.steps[i].ce_sum) << mode << " step " << i + 1;
      EXPECT_EQ(r.steps[i].grad_norm, none.steps[i].grad_norm) << mode << " step " << i + 1;
    }
  }
}

// Evaluation between steps (same shape) keeps the graph; an evaluation of a larger batch
// reallocates buffers, so the next step runs eagerly and the one after is captured again.
TEST(CudaStep, EvaluationBetweenStepsAndReallocation) {
  MOE_SKIP_WITHOUT_GPU();
  const Config c = step_config();
  constexpr int64_t kSteps = 6;
  const RunResult eager = run_steps(c, false, kSteps);
  double eval_same = 0;
  const RunResult same_shape = run_steps(c, true, kSteps, [&](CudaStepRunner& r, int64_t step) {
    if (step == 3) eval_same = r.evaluate(step_batch(c, 100, 0), 5).ce_sum;
  });
  EXPECT_GT(eval_same, 0.0);
  EXPECT_EQ(same_shape.graph_launches, kSteps - 1);
  expect_same_runs(same_shape, eager, "eval between steps");
  const RunResult grown = run_steps(c, true, kSteps, [&](CudaStepRunner& r, int64_t step) {
    if (step == 3) {
      const ForwardStats s = r.evaluate(step_batch(c, 100, 0, 8), 5);  // 8 x 64 tokens: buffers grow
      EXPECT_EQ(s.num_targets, 8 * 64 - 2);
    }
  });
  EXPECT_EQ(grown.graph_launches, kSteps - 2);  // steps 2, 3 (graph), 4 eager, 5 captured again, 6
  expect_same_runs(grown, eager, "after reallocation");
}

// optim.deferred_update: each step's update applied block by block in the next step on a second
// stream, flushed before an evaluation and before the state is downloaded: losses, grad norms,
// parameters, moments and bias bitwise those of the update at the end of each step, in the graph
// and eagerly, with an evaluation between steps and with full recomputation.
TEST(CudaStep, DeferredUpdateMatchesTheUpdateAtTheEndBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  Config c = step_config();
  c.moe.bias_update_rate = 0.01;
  constexpr int64_t kSteps = 5;
  auto eval_at_3 = [&](double* out) {
    return [&c, out](CudaStepRunner& r, int64_t step) {
      if (step == 3) *out = r.evaluate(step_batch(c, 100, 0), 5).ce_sum;
    };
  };
  for (const char* recompute : {"none", "full"}) {
    c.train.recompute = recompute;
    for (bool graph : {true, false}) {
      c.optim.deferred_update = false;
      double eval_end = 0, eval_deferred = 0;
      const RunResult at_end = run_steps(c, graph, kSteps, eval_at_3(&eval_end));
      c.optim.deferred_update = true;
      const RunResult deferred = run_steps(c, graph, kSteps, eval_at_3(&eval_deferred));
      const std::string what = std::string(recompute) + (graph ? ", graph" : ", eager");
      expect_same_runs(deferred, at_end, what.c_str());
      EXPECT_EQ(deferred.graph_launches, at_end.graph_launches) << what;
      EXPECT_EQ(deferred.params, at_end.params) << what << ": parameters not bitwise equal";
      EXPECT_EQ(deferred.exp_avg, at_end.exp_avg) << what;
      EXPECT_EQ(deferred.exp_avg_sq, at_end.exp_avg_sq) << what;
      EXPECT_EQ(eval_deferred, eval_end) << what << ": the evaluation saw other weights";
      for (size_t i = 0; i < deferred.steps.size(); ++i) {
        EXPECT_EQ(deferred.steps[i].ce_sum, at_end.steps[i].ce_sum) << what << " step " << i + 1;
        EXPECT_EQ(deferred.steps[i].grad_norm, at_end.steps[i].grad_norm) << what << " step " << i + 1;
      }
    }
  }
}

// optim.deferred_update_sms: the blocks' update on a few multiprocessors (one resident block on
// each) while the forward's GEMMs leave them free (grouped GEMMs on fewer CTAs, cuBLASLt with an SM
// count target). The update is the same elementwise; the GEMMs are the same (grouped: any grid
// gives the same bits) or another cuBLASLt algorithm: the runs agree within the graph/eager
// limits of expect_same_runs, in the graph and eagerly, with the step's graph still one launch.
// The reserve ends with the forward: a GEMM enqueued after the step uses the whole GPU again.
TEST(CudaStep, DeferredUpdateOnReservedMultiprocessorsMatchesTheUpdateAtTheEnd) {
  MOE_SKIP_WITHOUT_GPU();
  Config c = step_config();
  c.moe.bias_update_rate = 0.01;
  constexpr int64_t kSteps = 5;
  for (bool graph : {true, false}) {
    c.optim.deferred_update = false;
    c.optim.deferred_update_sms = 0;
    const RunResult at_end = run_steps(c, graph, kSteps);
    c.optim.deferred_update = true;
    c.optim.deferred_update_sms = 8;
    const RunResult reserved = run_steps(c, graph, kSteps);
    EXPECT_EQ(cuda::reserved_sms(), 0) << "the reserve outlived the forward";
    const std::string what = std::string("deferred on 8 multiprocessors") + (graph ? ", graph" : ", eager");
    expect_same_runs(reserved, at_end, what.c_str());
    EXPECT_EQ(reserved.graph_launches, at_end.graph_launches) << what;
    std::printf("%s: parameters %s those of the update at the end\n", what.c_str(),
                reserved.params == at_end.params ? "bitwise" : "within the limits of, not bitwise,");
  }
  c.optim.deferred_update_sms = cuda::device_info().sm_count;
  try {
    CudaStepRunner runner(c);
    FAIL() << "a reserve of every multiprocessor was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("optim.deferred_update_sms"), std::string::npos) << e.what();
  }
}

// train.precision = "fp8" (the FP8 experts) through whole steps: the weight codes are rebuilt in
// each step's first forward and before an evaluation after an update, so the graph replays give
// the eager steps' results bit for bit (an evaluation between steps included), and the deferred
// update and selective recomputation change nothing; the losses stay within 3% of BF16's.
TEST(CudaStep, Fp8StepsReplayDeferAndRecomputeBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  Config c = step_config();
  c.moe.bias_update_rate = 0.01;
  constexpr int64_t kSteps = 5;
  const RunResult bf16 = run_steps(c, true, kSteps);
  c.train.precision = "fp8";
  auto eval_at_3 = [&](double* out) {
    return [&c, out](CudaStepRunner& r, int64_t step) {
      if (step == 3) *out = r.evaluate(step_batch(c, 100, 0), 5).ce_sum;
    };
  };
  double eval_eager = 0, eval_graph = 0, eval_deferred = 0;
  const RunResult eager = run_steps(c, false, kSteps, eval_at_3(&eval_eager));
  const RunResult graph = run_steps(c, true, kSteps, eval_at_3(&eval_graph));
  EXPECT_EQ(graph.graph_launches, kSteps - 1);
  expect_same_runs(graph, eager, "fp8 graph vs eager");
  EXPECT_EQ(graph.params, eager.params) << "fp8: parameters not bitwise equal";
  EXPECT_EQ(eval_graph, eval_eager) << "fp8: the evaluation after replays saw other weights";
  c.optim.deferred_update = true;
  const RunResult deferred = run_steps(c, true, kSteps, eval_at_3(&eval_deferred));
  expect_same_runs(deferred, graph, "fp8 deferred update");
  EXPECT_EQ(deferred.params, graph.params) << "fp8 deferred update: parameters not bitwise equal";
  EXPECT_EQ(eval_deferred, eval_graph) << "fp8 deferred update: the evaluation saw other weights";
  c.optim.deferred_update = false;
  c.train.recompute = "selective";
  const RunResult selective = run_steps(c, true, kSteps);
  expect_same_runs(selective, graph, "fp8 selective recompute");
  EXPECT_EQ(selective.params, graph.params) << "fp8 selective recompute: parameters not bitwise equal";
  bool differs = false;
  for (size_t i = 0; i < graph.steps.size(); ++i) {
    const double a = graph.steps[i].ce_sum / double(graph.steps[i].num_targets);
    const double b = bf16.steps[i].ce_sum / double(bf16.steps[i].num_targets);
    std::printf("step %zu loss bf16 %.6f fp8 %.6f\n", i + 1, b, a);
    EXPECT_LE(rel_diff(a, b), 3e-2) << "step " << i + 1;
    differs = differs || a != b;
  }
  EXPECT_TRUE(differs) << "the FP8 steps gave the BF16 losses bit for bit";
  EXPECT_LT(graph.steps.back().ce_sum / double(graph.steps.back().num_targets),
            graph.steps.front().ce_sum / double(graph.steps.front().num_targets));
}

// Under FP8 the update at the end of a step writes the experts' weight codes itself
// (cuda::adamw_apply_fp8_weights), so a captured step holds no quantisation of them. A state loaded
// between replays changes the weights without that update: the next step quantises them before the
// replay. Graph, eager and the deferred update (which quantises in each step's first forward) give
// the same steps bit for bit, before and after the load.
TEST(CudaStep, Fp8CodesFollowTheUpdateAndALoadedState) {
  MOE_SKIP_WITHOUT_GPU();
  Config c = step_config();
  c.train.precision = "fp8";
  constexpr int64_t kSteps = 6;
  Model<float> other(c.model, c.moe);
  other.init_params(8);
  auto load_at_3 = [&](CudaStepRunner& r, int64_t step) {
    if (step == 3) r.load_state(other.params(), nullptr, nullptr, 0, other.expert_bias());
  };
  const RunResult graph = run_steps(c, true, kSteps, load_at_3);
  const RunResult eager = run_steps(c, false, kSteps, load_at_3);
  EXPECT_EQ(graph.graph_launches, kSteps - 1);
  expect_same_runs(graph, eager, "fp8 load: graph vs eager");
  EXPECT_EQ(graph.params, eager.params) << "fp8 load: parameters not bitwise equal";
  c.optim.deferred_update = true;
  const RunResult deferred = run_steps(c, true, kSteps, load_at_3);
  expect_same_runs(deferred, graph, "fp8 load: deferred vs at the end");
  EXPECT_EQ(deferred.params, graph.params) << "fp8 load, deferred: parameters not bitwise equal";
  // The load took effect: step 4 starts again from other weights, so its loss is not step 3's trend.
  const RunResult plain = run_steps(c, true, kSteps);
  EXPECT_NE(plain.steps[3].ce_sum, graph.steps[3].ce_sum);
}

// With the update at the end of the step the experts' codes take the place of their BF16 copy
// (RunPlan::fp8_codes_in_bf16_copy; the steps are the deferred update's bit for bit, above): the
// model holds 2 bytes per expert parameter fewer than with the deferred update, which keeps both.
TEST(CudaStep, Fp8ExpertCodesTakeTheirBf16CopysPlace) {
  MOE_SKIP_WITHOUT_GPU();
  Config c = step_config();
  c.train.precision = "fp8";
  CudaStepRunner at_end(c);
  ASSERT_TRUE(at_end.model().fp8_codes_in_bf16_copy());
  c.optim.deferred_update = true;
  CudaStepRunner deferred(c);
  EXPECT_FALSE(deferred.model().fp8_codes_in_bf16_copy());
  const int64_t experts = make_run_plan(c, 1, "cuda").memory.expert_params;
  ASSERT_GT(experts, 0);
  EXPECT_EQ(deferred.model().device_bytes() - at_end.model().device_bytes(), 2 * experts);
}

// Experts whose weights are not whole 128 x 128 blocks (expert hidden 192) keep the quantisation in
// the forward (the fused update takes whole blocks): steps run, graph as eager as deferred.
TEST(CudaStep, Fp8ExpertsOffTheBlockGridQuantiseInTheForward) {
  MOE_SKIP_WITHOUT_GPU();
  Config c = step_config();
  c.train.precision = "fp8";
  c.moe.expert_hidden = 192;
  constexpr int64_t kSteps = 4;
  const RunResult graph = run_steps(c, true, kSteps);
  const RunResult eager = run_steps(c, false, kSteps);
  expect_same_runs(graph, eager, "fp8, expert hidden 192: graph vs eager");
  c.optim.deferred_update = true;
  const RunResult deferred = run_steps(c, true, kSteps);
  expect_same_runs(deferred, graph, "fp8, expert hidden 192: deferred vs at the end");
  EXPECT_EQ(deferred.params, graph.params);
}

// The gradient norm from the experts' block square sums (one micro-batch a step: the grouped
// wgrad writes them with the gradients) against MOECORE_GRAD_NORM=separate (every gradient read by
// the norm's own pass): the same norm up to the order of its FP64 sum (relative 1e-12), so the same
// FP32 clip factor and bitwise the same parameters and moments; in the graph and eagerly, with the
// update at the end and deferred, BF16 and FP8. Two micro-batches a step fall back to the norm's
// own pass (bitwise the separate run's norm).
TEST(CudaStep, GradNormFromTheExpertSquareSumsIsTheNormsOwnPass) {
  MOE_SKIP_WITHOUT_GPU();
  const auto run_separate = [](const Config& c, bool graph, int64_t steps) {
    const ScopedEnv env("MOECORE_GRAD_NORM", "separate");
    return run_steps(c, graph, steps);
  };
  Config c = step_config();
  c.train.global_batch = c.train.micro_batch;
  constexpr int64_t kSteps = 4;
  for (const char* precision : {"bf16", "fp8"}) {
    c.train.precision = precision;
    for (bool deferred : {false, true}) {
      c.optim.deferred_update = deferred;
      for (bool graph : {true, false}) {
        const std::string what = std::string(precision) + (deferred ? ", deferred" : ", at the end") +
                                 (graph ? ", graph" : ", eager");
        const RunResult fused = run_steps(c, graph, kSteps);
        const RunResult separate = run_separate(c, graph, kSteps);
        ASSERT_EQ(fused.steps.size(), separate.steps.size()) << what;
        for (size_t i = 0; i < fused.steps.size(); ++i) {
          EXPECT_GT(fused.steps[i].grad_norm, 0.0) << what;
          EXPECT_LE(rel_diff(fused.steps[i].grad_norm, separate.steps[i].grad_norm), 1e-12)
              << what << " step " << i + 1;
          EXPECT_EQ(fused.steps[i].ce_sum, separate.steps[i].ce_sum) << what << " step " << i + 1;
        }
        EXPECT_EQ(fused.params, separate.params) << what << ": parameters not bitwise equal";
        EXPECT_EQ(fused.exp_avg, separate.exp_avg) << what;
        EXPECT_EQ(fused.exp_avg_sq, separate.exp_avg_sq) << what;
      }
    }
  }
  c = step_config();  // two micro-batches a step
  const RunResult two = run_steps(c, true, 3);
  const RunResult two_separate = run_separate(c, true, 3);
  ASSERT_EQ(two.steps.size(), two_separate.steps.size());
  for (size_t i = 0; i < two.steps.size(); ++i)
    EXPECT_EQ(two.steps[i].grad_norm, two_separate.steps[i].grad_norm) << "two micro-batches, step " << i + 1;
  EXPECT_EQ(two.params, two_separate.params);
}

TEST(CudaStep, DeferredUpdateRefusesZeroOne) {
  MOE_SKIP_WITHOUT_GPU();
  Config c = step_config();
  c.optim.deferred_update = true;
  RunPlan plan = make_run_plan(c, 1, "cuda");
  plan.zero = true;
  try {
    CudaStepRunner runner(c, plan, nullptr, nullptr, nullptr);
    FAIL() << "a deferred update with ZeRO-1 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("optim.deferred_update"), std::string::npos) << e.what();
  }
}

TEST(CudaStep, ExpertBiasUpdateIsTheHostFormula) {
  MOE_SKIP_WITHOUT_GPU();
  Config c = step_config();
  c.moe.bias_update_rate = 0.01;
  Model<float> host(c.model, c.moe);
  host.init_params(7);
  host.expert_bias()[3] = 0.25f;  // start from a non-zero bias
  CudaStepRunner runner(c);
  runner.load_state(host.params(), nullptr, nullptr, 0, host.expert_bias());
  for (int64_t step = 1; step <= 4; ++step) {
    const std::vector<Batch> micro = step_batches(c, step);
    runner.submit(step, micro, dp_count_targets(micro), c.optim.lr, 3);
    const StepStats s = runner.collect();
    ASSERT_FALSE(s.skipped);
    host.update_expert_bias(s.tokens_per_expert, c.moe.bias_update_rate);
    std::vector<float> bias;
    runner.download_state(nullptr, nullptr, nullptr, nullptr, &bias);
    EXPECT_EQ(bias, host.expert_bias()) << "step " << step;
  }
  EXPECT_EQ(runner.graph_launches(), 3);
}

// A non-finite loss skips the whole step on the device: parameters, moments, step count and
// expert bias unchanged; the next step trains again.
TEST(CudaStep, NonFiniteLossSkipsTheStep) {
  MOE_SKIP_WITHOUT_GPU();
  for (bool deferred : {false, true}) {
  SCOPED_TRACE(deferred ? "deferred update" : "update at the end of the step");
  Config c = step_config();
  c.optim.deferred_update = deferred;
  Model<float> host(c.model, c.moe);
  host.init_params(7);
  CudaStepRunner runner(c);
  runner.load_state(host.params(), nullptr, nullptr, 0, host.expert_bias());
  std::vector<Batch> micro = step_batches(c, 1);
  runner.submit(1, micro, dp_count_targets(micro), c.optim.lr, 3);
  const StepStats s1 = runner.collect();
  EXPECT_FALSE(s1.skipped);
  const size_t total = static_cast<size_t>(host.layout().total_numel());
  std::vector<float> p1(total), m1(total), b1;
  int64_t steps1 = 0;
  runner.download_state(p1.data(), m1.data(), nullptr, &steps1, &b1);
  EXPECT_EQ(steps1, 1);
  // An Inf weight in the LM head makes the logits, hence the loss, non-finite.
  std::vector<float> poisoned = p1;
  const ParamEntry& head = host.layout().find("lm_head.weight");
  poisoned[static_cast<size_t>(head.offset)] = INFINITY;
  runner.load_state(poisoned.data(), m1.data(), nullptr, steps1, b1);
  micro = step_batches(c, 2);
  runner.submit(2, micro, dp_count_targets(micro), c.optim.lr, 3);
  const StepStats s2 = runner.collect();
  EXPECT_TRUE(s2.skipped);
  EXPECT_FALSE(std::isfinite(s2.ce_sum));
  EXPECT_EQ(s2.optimizer_steps, 1);
  std::vector<float> p2(total), b2;
  int64_t steps2 = 0;
  runner.download_state(p2.data(), nullptr, nullptr, &steps2, &b2);
  EXPECT_EQ(steps2, 1);
  EXPECT_EQ(b2, b1);
  EXPECT_EQ(std::memcmp(p2.data(), poisoned.data(), total * sizeof(float)), 0);
  }
}

TEST(CudaStep, CollectReturnsStepsInOrder) {
  MOE_SKIP_WITHOUT_GPU();
  const Config c = step_config();
  Model<float> init(c.model, c.moe);
  init.init_params(7);
  CudaStepRunner runner(c);
  runner.load_state(init.params(), nullptr, nullptr, 0, init.expert_bias());
  EXPECT_EQ(runner.pending(), 0);
  EXPECT_NE(error_of([&] { runner.collect(); }).find("no submitted step"), std::string::npos);
  std::vector<int64_t> targets;
  for (int64_t step = 1; step <= CudaStepRunner::kMaxPending; ++step) {
    const std::vector<Batch> micro = step_batches(c, step);
    targets.push_back(dp_count_targets(micro));
    runner.submit(step, micro, targets.back(), c.optim.lr, 3);
    EXPECT_EQ(runner.pending(), step);
  }
  const std::vector<Batch> more = step_batches(c, 9);
  EXPECT_NE(error_of([&] { runner.submit(9, more, 100, c.optim.lr, 3); }).find("collect()"), std::string::npos);
  for (int64_t step = 1; step <= CudaStepRunner::kMaxPending; ++step) {
    const StepStats s = runner.collect();
    EXPECT_EQ(s.step, step);
    EXPECT_EQ(s.num_targets, targets[step - 1]);
    EXPECT_EQ(s.optimizer_steps, step);
    EXPECT_EQ(runner.pending(), CudaStepRunner::kMaxPending - step);
  }
  EXPECT_NE(error_of([&] { runner.submit(2, more, 100, c.optim.lr, 3); }).find("increasing order"), std::string::npos);
  runner.submit(9, more, dp_count_targets(more), c.optim.lr, 3);
  EXPECT_EQ(runner.collect().step, 9);
}

// Random routing draws per-step seeds: no graph; two runs agree; steps route differently.
// Random routing inside the graph: the seed of each micro-batch is read on the device, so the
// replays route anew (consecutive steps differ) and equal an eager run of the same steps.
TEST(CudaStep, RandomRoutingCapturesAndMatchesEager) {
  MOE_SKIP_WITHOUT_GPU();
  for (const char* routing : {"random", "uniform"}) {
    const Config c = step_config(routing);
    const RunResult graph = run_steps(c, true, 5);
    const RunResult eager = run_steps(c, false, 5);
    EXPECT_TRUE(graph.uses_graph) << routing;
    EXPECT_EQ(graph.graph_launches, 4) << routing;  // step 1 eager, step 2 captured and launched, 3..5 replays
    EXPECT_EQ(eager.graph_launches, 0) << routing;
    expect_same_runs(graph, eager, routing);
    if (std::string(routing) == "random") {
      EXPECT_NE(graph.steps[2].tokens_per_expert, graph.steps[3].tokens_per_expert) << "replays route anew";
    }
  }
}

// Capacity inside the graph: the dropped routes of every step are counted on the device
// (StepStats::num_dropped), and the replayed steps equal an eager run.
TEST(CudaStep, CapacityDropsInTheGraphAsEager) {
  MOE_SKIP_WITHOUT_GPU();
  Config c = step_config("random");
  c.moe.capacity_factor = 1.0;
  const RunResult graph = run_steps(c, true, 4);
  const RunResult eager = run_steps(c, false, 4);
  EXPECT_TRUE(graph.uses_graph);
  EXPECT_EQ(graph.graph_launches, 3);
  expect_same_runs(graph, eager, "capacity graph vs eager");
  for (size_t i = 0; i < graph.steps.size(); ++i) {
    EXPECT_GT(graph.steps[i].num_dropped, 0) << "step " << graph.steps[i].step;
    EXPECT_LT(graph.steps[i].num_dropped, graph.steps[i].num_routes) << "step " << graph.steps[i].step;
    EXPECT_EQ(graph.steps[i].num_dropped, eager.steps[i].num_dropped) << "step " << graph.steps[i].step;
  }
}

TEST(CudaStep, BadTokenIdsThrowAtCollect) {
  MOE_SKIP_WITHOUT_GPU();
  const Config c = step_config();
  CudaStepRunner runner(c);
  std::vector<Batch> micro = step_batches(c, 1);
  micro[1].inputs[10] = 300;  // vocab_size is 256
  runner.submit(1, micro, dp_count_targets(micro), c.optim.lr, 3);
  const std::string msg = error_of([&] { runner.collect(); });
  EXPECT_NE(msg.find("vocab_size = 256"), std::string::npos) << msg;
  EXPECT_NE(msg.find("step 1"), std::string::npos) << msg;
  EXPECT_EQ(runner.pending(), 0);
}

}  // namespace
}  // namespace moe::testing
