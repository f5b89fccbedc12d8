// The planner (train/planner.h) and the per-mode activation memory (train/memory_plan.h): exact
// bytes of a small model against hand-computed sums, the mode ordering, ZeRO-1 shards and
// communication volumes, the layout enumeration, the H200 figures against the committed
// measurements, and `moecore plan` on the command line.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include <nlohmann/json.hpp>

#include "core/config_io.h"
#include "e2e/cli_util.h"
#include "model/layout.h"
#include "support/test_util.h"
#include "train/memory_plan.h"
#include "train/phase_ceilings.h"
#include "train/planner.h"
#include "train/run_plan.h"

namespace moe {
namespace {

using testing::error_of;
using testing::ScopedEnv;
using testing::run_cli;

const std::string kOlmoe8l = std::string(MOECORE_SOURCE_DIR) + "/configs/olmoe-8l.toml";
constexpr double kGiB = double(1ull << 30);

// d 8, 2 heads of 4 (q 8), 1 kv head (c 4), QK-norm; layer 0 dense (F 12), layer 1 MoE: 4 experts,
// top-2, hidden 6, one shared expert (F 6); vocab 16; micro-batch 2 x 4 tokens: N 8, R 16.
Config small() {
  Config c;
  c.model.vocab_size = 16;
  c.model.d_model = 8;
  c.model.n_layers = 2;
  c.model.n_heads = 2;
  c.model.n_kv_heads = 1;
  c.model.qk_norm = true;
  c.model.dense_layers = {0};
  c.model.dense_hidden = 12;
  c.moe.num_experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 6;
  c.moe.shared_experts = 1;
  c.train.seq_len = 4;
  c.train.micro_batch = 2;
  c.train.global_batch = 2;
  return c;
}

double item(const std::vector<MemoryItem>& items, const std::string& name) {
  for (const MemoryItem& i : items)
    if (i.name == name) return i.bytes;
  ADD_FAILURE() << "no item '" << name << "'";
  return -1;
}

// Per layer (GPU, bytes): attention 992 = x 128 + norm 128 + rstd 32 + q_raw 128 + k_raw 64 +
// q_rstd 32 + k_rstd 32 + q 128 + k 64 + v 64 + attn 128 + lse 64; dense MLP block 864 = x 128 +
// norm 128 + rstd 32 + gate_up 384 + h 192; MoE layer 2196 = x 128 + norm 128 + rstd 32 + logits
// 128 + scores 128 + topk_idx 64 + topk_w 64 + offsets 20 + sorted_route 64 + route_to_row 64 +
// x_sorted 256 + y_sorted 256 + experts gate_up 384 + h 192 + shared gate_up 192 + h 96.
TEST(ActivationMemory, SmallModelExactBytesPerMode) {
  const Config c = small();
  const auto modes = activation_memory_all_modes(c.model, c.moe, 2, 4, 1, true);
  const ActivationMemory &none = modes[0], &sel = modes[1], &full = modes[2];
  EXPECT_DOUBLE_EQ(none.kept_bytes(), 2 * 992 + 864 + 2196);
  EXPECT_DOUBLE_EQ(none.pool_bytes(), 0);
  EXPECT_DOUBLE_EQ(item(none.kept, "attention.q"), 2 * 128);
  EXPECT_DOUBLE_EQ(item(none.kept, "moe.x_sorted"), 256);
  // selective keeps attention {x, rstd, q_rstd, k_rstd, attn, lse} 416 per layer, dense {x, rstd,
  // gate_up} 544, MoE {x, rstd, router outputs, dispatch map, experts and shared gate_up} 1268;
  // one pool per block kind: attention norm, q_raw, k_raw, q, k, v 576; dense norm, h 320; MoE
  // norm, x_sorted, y_sorted, experts h, shared h 928.
  EXPECT_DOUBLE_EQ(sel.kept_bytes(), 2 * 416 + 544 + 1268);
  EXPECT_DOUBLE_EQ(sel.pool_bytes(), 576 + 320 + 928);
  // Under expert parallelism the experts do not recompute their outputs: y_sorted stays per layer.
  const ActivationMemory sel_ep = activation_memory(c.model, c.moe, 2, 4, 1, true, Recompute::kSelective, 2);
  EXPECT_DOUBLE_EQ(sel_ep.kept_bytes(), sel.kept_bytes() + 256);
  EXPECT_DOUBLE_EQ(sel_ep.pool_bytes(), sel.pool_bytes() - 256);
  EXPECT_DOUBLE_EQ(item(sel.pool, "moe.y_sorted"), 256);
  // full keeps the FP32 residual at each attention block (256) and the MoE routing 532; one pool
  // per block kind: a whole attention block 992, the dense block 864, the MoE layer without its
  // routing 2196 - 532.
  EXPECT_DOUBLE_EQ(full.kept_bytes(), 2 * 256 + 532);
  EXPECT_DOUBLE_EQ(full.pool_bytes(), 992 + 864 + 2196 - 532);
  // Scratch: the same in every mode.
  EXPECT_DOUBLE_EQ(none.scratch_bytes(), full.scratch_bytes());
  EXPECT_DOUBLE_EQ(item(none.scratch, "experts backward workspace"), 16 * 3 * 6 * 2);
  EXPECT_DOUBLE_EQ(item(none.scratch, "lm_head.logits chunk [4096, V]"), 8 * 16 * 2);
  EXPECT_DOUBLE_EQ(item(none.scratch, "cuDNN attention backward plan workspace"), 2 * 2 * 4 * (2 * 4 + 4) + 256);
  EXPECT_DOUBLE_EQ(item(none.scratch, "residual.x32"), 8 * 8 * 4);
  // The norm backward's partial rows (1 chunk of 32 rows, widest 8) or, with QK-norm, its rows of
  // q width rounded to 256 bytes and the (cos, sin) table of 4 positions x 2 pairs: the larger.
  EXPECT_DOUBLE_EQ(item(none.scratch, "rmsnorm backward workspace"), 256 + 4 * 2 * 8);
  EXPECT_DOUBLE_EQ(item(none.scratch, "moe backward dy_sorted"), 16 * 8 * 2);
  // dattn, dq (256-byte aligned: 128 -> 256 each), dk, dv (64 -> 256), dq_raw, dk_raw, workspace
  // 64 -> 256: 1792 bytes, more than dy_sorted's 256, so a buffer of their own.
  EXPECT_DOUBLE_EQ(item(none.scratch, "attention backward scratch and workspace"), 7 * 256);
  EXPECT_DOUBLE_EQ(item(none.scratch, "token ids (step and micro-batch)"), 4 * 8 * 4);
  // The CPU model: every tensor at 4 bytes, no FP32 residual copy under full.
  const auto cpu = activation_memory_all_modes(c.model, c.moe, 2, 4, 1, false);
  EXPECT_DOUBLE_EQ(item(cpu[0].kept, "attention.q"), 2 * 256);
  EXPECT_DOUBLE_EQ(cpu[2].kept_bytes(), 2 * 256 + 532);  // attention.x at 4 bytes, the routing
}

TEST(ActivationMemory, FullBelowSelectiveBelowNone) {
  for (const std::string& path : {kOlmoe8l, std::string(MOECORE_SOURCE_DIR) + "/configs/tiny.toml"}) {
    const Config c = load_config(path, {});
    for (const bool gpu : {true, false}) {
      const auto m = activation_memory_all_modes(c.model, c.moe, c.train.micro_batch, c.train.seq_len, 1, gpu);
      EXPECT_LT(m[2].total(), m[1].total()) << path << " gpu " << gpu;
      EXPECT_LT(m[1].total(), m[0].total()) << path << " gpu " << gpu;
      EXPECT_LT(m[2].kept_bytes(), m[1].kept_bytes());
      EXPECT_GT(m[1].pool_bytes(), 0.0);
    }
  }
}

// The run plan's configured mode is activation_memory's, and every mode is planned.
TEST(RunPlan, ActivationsFollowTrainRecompute) {
  Config c = small();
  for (const char* mode : {"none", "selective", "full"}) {
    c.train.recompute = mode;
    const RunPlan p = make_run_plan(c, 1, "cuda");
    const ActivationMemory a = activation_memory(c.model, c.moe, 2, 4, 1, true, parse_recompute(mode));
    EXPECT_DOUBLE_EQ(p.memory.activations_kept, a.kept_bytes()) << mode;
    EXPECT_DOUBLE_EQ(p.memory.activations_pool, a.pool_bytes()) << mode;
    EXPECT_DOUBLE_EQ(p.memory.scratch, a.scratch_bytes()) << mode;
    EXPECT_NE(describe_run_plan(p).find(std::string("train.recompute = \"") + mode + "\""), std::string::npos);
  }
}

// Committed measurements (bench/results/memory-check-20261201T2315Z): device_alloc peaks of
// olmoe-8l on one H200 with cuDNN attention, per recompute mode.
TEST(RunPlan, Olmoe8lGpuEstimateMatchesMeasuredPeaks) {
  Config c = load_config(kOlmoe8l, {});
  struct Case {
    const char* mode;
    double peak_gib;
  };
  for (const Case& k : {Case{"none", 83.14}, Case{"selective", 71.33}, Case{"full", 67.51}}) {
    c.train.recompute = k.mode;
    const RunPlan p = make_run_plan(c, 1, "cuda");
    EXPECT_NEAR(p.memory.total() / kGiB, k.peak_gib, 0.01) << k.mode;
  }
}

// train.precision = "fp8" on cuda: each expert parameter's two FP8 code copies and their scales
// on top of the BF16 plan (with the update at the end of the step the codes take the place of the
// experts' BF16 copy: their scales only), and the FP8 activation workspace in the scratch; on cpu
// nothing changes (the emulation keeps FP32 tensors). The figures of the layout that keeps both
// (the deferred update's) are the measured device_alloc peaks of
// bench/results/fp8-attention-20261203/olmoe-8l-fp8.log (one H200), where every FP8 step kept both.
TEST(RunPlan, Fp8AddsTheExpertCodesAndTheirWorkspace) {
  Config c = load_config(kOlmoe8l, {});
  c.optim.deferred_update = true;
  const RunPlan bf16 = make_run_plan(c, 1, "cuda");
  c.train.precision = "fp8";
  const RunPlan fp8 = make_run_plan(c, 1, "cuda");
  EXPECT_FALSE(fp8.fp8_codes_in_bf16_copy);
  const double experts = double(fp8.memory.expert_params);
  EXPECT_GT(experts, 0.0);
  // The attention projections (Wq, Wk, Wv, Wo: D, Q and C are 2048) have codes too.
  const double d = double(c.model.d_model), q = double(c.model.n_heads * c.model.head_dim()),
               kv = double(c.model.n_kv_heads * c.model.head_dim());
  const double attention = double(c.model.n_layers) * (2.0 * q + 2.0 * kv) * d;
  EXPECT_DOUBLE_EQ(fp8.memory.params - bf16.memory.params, (experts + attention) * (2.0 + 8.0 / (128.0 * 128.0)));
  const double rows = double(fp8.tokens_per_micro_batch) * double(c.moe.top_k);
  const double widest = double(std::max(c.model.d_model, 2 * c.moe.expert_hidden));
  const double tokens = double(fp8.tokens_per_micro_batch), qkv = q + 2.0 * kv;
  EXPECT_DOUBLE_EQ(fp8.memory.scratch - bf16.memory.scratch,
                   rows * widest + rows * std::ceil(widest / 128.0) * 4.0 +  // expert rows
                       tokens * qkv + 2.0 * tokens * (qkv / 128.0) * 4.0 + 3.0 * qkv * d / (128.0 * 128.0) * 4.0);
  EXPECT_NEAR(fp8.memory.total() / kGiB, 89.75, 0.01);
  c.optim.deferred_update = false;
  const RunPlan at_end = make_run_plan(c, 1, "cuda");
  EXPECT_TRUE(at_end.fp8_codes_in_bf16_copy);
  EXPECT_DOUBLE_EQ(fp8.memory.total() - at_end.memory.total(), 2.0 * experts);
  // scaling-e8 (a dense MLP of 20480 and a shared expert per MoE layer, all in FP8): measured
  // peaks 99.20 GiB (bf16) and 106.85 GiB (fp8) in one call (bench/results/fp8-attention-20261203/),
  // the estimates 0.13 and 0.12 GiB below them.
  Config e8 = load_config(std::string(MOECORE_SOURCE_DIR) + "/configs/scaling-e8.toml", {});
  e8.moe.capacity_factor = 0;
  e8.optim.deferred_update = true;
  const double e8_bf16 = make_run_plan(e8, 1, "cuda").memory.total() / kGiB;
  e8.train.precision = "fp8";
  const RunPlan e8_fp8 = make_run_plan(e8, 1, "cuda");
  EXPECT_NEAR(e8_bf16, 99.07, 0.01);
  EXPECT_NEAR(e8_fp8.memory.total() / kGiB, 106.73, 0.01);
  c.train.device = "cpu";
  EXPECT_DOUBLE_EQ(make_run_plan(c, 1, "cpu").memory.total(), [&] {
    Config f = c;
    f.train.precision = "fp32";
    return make_run_plan(f, 1, "cpu").memory.total();
  }());
}

// The GPU's FP8 recipe is refused by the run plan (before anything is allocated) with expert
// parallelism or the rowwise exchange where the exchanged rows are not whole 1 x 128 blocks, and with
// expert rows that are not whole 16-code chunks, naming the key (with d_model 128 both are taken,
// the plan counting the FP8 rows sent), and MX scaling where d_model or the expert hidden size is
// not whole 128-wide blocks; the cpu run plan takes them.
TEST(RunPlan, Fp8OnCudaRefusesWhatItCannotRunNamingTheKey) {
  Config c = small();
  c.model.d_model = 16;
  c.model.n_heads = 2;
  c.moe.expert_hidden = 16;
  c.train.precision = "fp8";
  EXPECT_NO_THROW(make_run_plan(c, 1, "cuda"));
  Config ep = c;
  ep.parallel.dp = 2;
  ep.parallel.ep = 2;
  ep.train.global_batch = 4;
  // Under expert parallelism the rows travel as FP8 payload in whole 1 x 128 blocks.
  EXPECT_NE(error_of([&] { make_run_plan(ep, 2, "cuda"); }).find("model.d_model (16) must be a multiple of 128"),
            std::string::npos);
  Config ep128 = ep;
  ep128.model.d_model = 128;
  const RunPlan fp8_ep = make_run_plan(ep128, 2, "cuda");
  Config ep128_bf16 = ep128;
  ep128_bf16.train.precision = "bf16";
  const double rows = double(fp8_ep.tokens_per_micro_batch) * double(ep128.moe.top_k);
  EXPECT_DOUBLE_EQ(fp8_ep.memory.exchange - make_run_plan(ep128_bf16, 2, "cuda").memory.exchange,
                   rows * (128.0 + 4.0)) << "the FP8 rows this rank sends";
  Config rowwise = c;
  rowwise.parallel.ep_backend = "rowwise";
  EXPECT_NE(error_of([&] { make_run_plan(rowwise, 1, "cuda"); }).find("model.d_model (16) must be a multiple of 128"),
            std::string::npos);
  rowwise.model.d_model = 128;
  EXPECT_NO_THROW(make_run_plan(rowwise, 1, "cuda"));
  Config odd = c;
  odd.moe.expert_hidden = 24;
  EXPECT_NE(error_of([&] { make_run_plan(odd, 1, "cuda"); }).find("moe.expert_hidden (24)"), std::string::npos);
  EXPECT_NO_THROW(make_run_plan(ep, 2, "cpu"));
  EXPECT_NO_THROW(make_run_plan(odd, 1, "cpu"));
  Config mx = c;
  mx.train.fp8_scaling = "mx";
  EXPECT_NE(error_of([&] { make_run_plan(mx, 1, "cuda"); }).find("train.fp8_scaling = \"mx\""), std::string::npos)
      << "MX on the GPU re-blocks whole 128-wide blocks: d_model 16 is refused";
  EXPECT_NO_THROW(make_run_plan(mx, 1, "cpu"));
  mx.model.d_model = 128;
  EXPECT_NE(error_of([&] { make_run_plan(mx, 1, "cuda"); }).find("moe.expert_hidden (" +
                                                                    std::to_string(mx.moe.expert_hidden) + ")"),
            std::string::npos);
  mx.moe.expert_hidden = 256;
  EXPECT_NO_THROW(make_run_plan(mx, 1, "cuda"));
}

// Measured olmoe-8l steps on one H200: 178.02 ms (the reference the phases come from), and two
// shapes the model was not fitted to: 107.84 ms (B 2) and 104.77 ms (S 2048).
TEST(Planner, Olmoe8lStepTimeNearMeasured) {
  // The reference step itself (bench/results/h200-main-20261207: 167.99 and 169.34 ms).
  const LayoutPlan p = plan_layout(load_config(kOlmoe8l, {}), LayoutRequest{}, 139.8);
  const double ms = p.modes[0].time.step_ms();
  EXPECT_NEAR(ms, 168.67, 0.01 * 168.67);
  EXPECT_GT(p.modes[1].time.step_ms(), ms);
  EXPECT_GT(p.modes[2].time.step_ms(), p.modes[1].time.step_ms());
}

// The H100 80GB's model: its reference, olmoe-8l on 6 layers (138.45 ms measured, the phases the
// model scales from), comes back from its own rates; all 8 layers do not fit its memory in BF16
// (83.1 GiB); `--gpu` names h200 or h100 only.
TEST(Planner, H100ReferenceStepAndMemory) {
  Config c = load_config(kOlmoe8l, {});
  const GpuCeilings& h100 = planner_gpu("h100");
  EXPECT_EQ(&h100, &h100_ceilings());
  EXPECT_EQ(&planner_gpu("h200"), &h200_ceilings());
  const LayoutPlan whole = plan_layout(c, LayoutRequest{}, h100.memory_gib, h100);
  EXPECT_FALSE(whole.modes[0].fits);
  c.model.n_layers = 6;
  const LayoutPlan p = plan_layout(c, LayoutRequest{}, h100.memory_gib, h100);
  EXPECT_TRUE(p.modes[0].fits);
  EXPECT_DOUBLE_EQ(double(p.run.memory.local_params), h100.ref_params);
  EXPECT_NEAR(p.modes[0].time.step_ms(), 138.45, 0.01 * 138.45);
  // The same shape on the H200's figures is faster (its rates and bandwidth are higher).
  EXPECT_LT(plan_layout(c, LayoutRequest{}, 139.8).modes[0].time.step_ms(), p.modes[0].time.step_ms());
  EXPECT_NE(describe_layout_plan(p, h100).find("NVIDIA H100 80GB HBM3"), std::string::npos);
  EXPECT_NE(error_of([] { planner_gpu("a100"); }).find("expected h200 or h100"), std::string::npos);
}

// The one-GPU expert-scaling sweeps on one H200 (bench/results/experiments-20261202T045008Z):
// one micro-batch of 8192 tokens per step (sweep-scaling1.json), and 64 sequences per step in
// micro-batches of 4 with selective recomputation (sweep-scaling1-gb64.json). The experts phase
// grows with the expert parameters, the optimizer with all parameters; the estimates stay within
// 7% of every measured step.
TEST(Planner, ExpertScalingSweepNearMeasured) {
  struct Sweep {
    const char* overrides;
    std::pair<int, double> measured[5];
  };
  const Sweep sweeps[] = {
      {"", {{8, 74.06}, {16, 79.98}, {32, 85.46}, {64, 99.08}, {128, 127.66}}},
      {"--train.micro_batch=4 --train.global_batch=64 --train.recompute=selective",
       {{8, 4613.71}, {16, 4632.98}, {32, 4652.77}, {64, 4720.43}, {128, 4852.70}}},
  };
  for (const Sweep& sw : sweeps) {
    double last_experts = 0, first_experts = 0;
    for (const auto& [e, step_ms] : sw.measured) {
      std::vector<std::string> args;
      for (std::string rest = sw.overrides; !rest.empty();) {
        const size_t sp = rest.find(' ');
        args.push_back(rest.substr(0, sp));
        rest = sp == std::string::npos ? "" : rest.substr(sp + 1);
      }
      const Config c =
          load_config(std::string(MOECORE_SOURCE_DIR) + "/configs/scaling1-e" + std::to_string(e) + ".toml", args);
      const LayoutPlan p = plan_layout(c, LayoutRequest{}, 139.8);
      const Recompute mode = parse_recompute(c.train.recompute);
      const StepTime& t = p.modes[size_t(mode)].time;
      EXPECT_NEAR(t.step_ms(), step_ms, 0.07 * step_ms) << "e" << e << " " << sw.overrides;
      EXPECT_GE(t.experts, last_experts) << "e" << e;
      if (first_experts == 0) first_experts = t.experts;
      last_experts = t.experts;
    }
    // e128's experts phase: 1.76 x e8's measured at one micro-step (23.8 / 13.5 ms), 1.20 x at 16.
    EXPECT_GT(last_experts, 1.15 * first_experts) << sw.overrides;
  }
}

// The bench's per-phase ceilings: the phases' GEMM FLOPs add up to the model's FLOPs per step
// (docs/architecture.md) less the router's gate GEMM, with the attention core counted as the cuDNN
// rates are (backward 2.5 x forward, where the formula counts 2 x); the optimizer at 34 bytes per
// parameter (4 with the update deferred), less the norm's 4 bytes of each expert parameter where
// the norm comes from the experts' block square sums (one GPU, one micro-batch); the experts bound
// by their weight traffic once each expert sees few rows.
TEST(PhaseCeilings, WorkAddsUpToTheModelFlops) {
  const Config c = load_config(kOlmoe8l, {});
  const RunPlan plan = make_run_plan(c, 1, "cuda");
  const std::vector<PhaseCeiling> ph = phase_ceilings(c, plan);
  double flops = 0, optimizer_ms = 0;
  std::string experts_ceiling;
  for (const PhaseCeiling& p : ph) {
    flops += p.flops;
    EXPECT_GT(p.ideal_ms, 0.0) << p.phase;
    if (p.phase == "optimizer") optimizer_ms = p.ideal_ms;
    if (p.phase == "experts") experts_ceiling = p.ceiling;
  }
  const double n = double(plan.tokens_per_step), d = double(c.model.d_model), layers = double(c.model.n_layers);
  const double router = 6.0 * n * d * double(c.moe.num_experts) * layers;  // no dense layers in olmoe-8l
  const double core_formula = 6.0 * double(c.model.n_heads * c.model.head_dim()) * double(plan.seq_len) * n * layers;
  const double want = plan.flops_per_step - router + core_formula / 6.0;  // 7 x instead of 6 x
  EXPECT_NEAR(flops, want, 1e-9 * want);
  // olmoe-8l on one GPU, one micro-batch a step: the norm reads the non-expert gradients only.
  ASSERT_TRUE(plan.norm_from_expert_squares);
  const double params = double(plan.memory.local_params), experts = double(plan.memory.expert_params);
  EXPECT_NEAR(optimizer_ms, 1e3 * (34.0 * params - 4.0 * experts) / 4.3e12, 1e-9);
  EXPECT_GT(optimizer_ms, 24.0);  // 3.56B parameters, 3.22B of them in experts: about 25 ms
  EXPECT_NE(experts_ceiling.find("TFLOP/s"), std::string::npos) << experts_ceiling;
  const auto optimizer_of = [](const Config& cfg, const RunPlan& pl) {
    for (const PhaseCeiling& p : phase_ceilings(cfg, pl))
      if (p.phase == "optimizer") return p;
    return PhaseCeiling{};
  };
  // The update deferred into the next forward: the phase keeps the norm's read.
  Config deferred = c;
  deferred.optim.deferred_update = true;
  const PhaseCeiling opt_deferred = optimizer_of(deferred, plan);
  EXPECT_NEAR(opt_deferred.ideal_ms, 1e3 * 4.0 * (params - experts) / 4.3e12, 1e-9);
  EXPECT_NE(opt_deferred.ceiling.find("deferred"), std::string::npos) << opt_deferred.ceiling;
  // Two micro-batches a step, or MOECORE_GRAD_NORM=separate: the norm reads every gradient.
  Config two = c;
  two.train.global_batch = 2 * c.train.micro_batch;
  const RunPlan plan_two = make_run_plan(two, 1, "cuda");
  EXPECT_FALSE(plan_two.norm_from_expert_squares);
  EXPECT_NEAR(optimizer_of(two, plan_two).ideal_ms, 1e3 * 34.0 * params / 4.3e12, 1e-9);
  {
    const ScopedEnv env("MOECORE_GRAD_NORM", "separate");
    const RunPlan separate = make_run_plan(c, 1, "cuda");
    EXPECT_FALSE(separate.norm_from_expert_squares);
    EXPECT_NEAR(optimizer_of(c, separate).ideal_ms, 1e3 * 34.0 * params / 4.3e12, 1e-9);
  }
  {
    const ScopedEnv env("MOECORE_GRAD_NORM", "sometimes");
    const std::string error = error_of([&] { make_run_plan(c, 1, "cuda"); });
    EXPECT_NE(error.find("MOECORE_GRAD_NORM must be 'fused' or 'separate'"), std::string::npos) << error;
    EXPECT_NE(error.find("got 'sometimes'"), std::string::npos) << error;
  }
  EXPECT_FALSE(make_run_plan(c, 1, "cpu").norm_from_expert_squares);

  // scaling1-e128, one micro-batch of 8192 tokens: 256 rows per expert; 12 bytes per expert
  // parameter outweigh the GEMMs' FLOPs.
  const Config e128 = load_config(std::string(MOECORE_SOURCE_DIR) + "/configs/scaling1-e128.toml", {});
  for (const PhaseCeiling& p : phase_ceilings(e128, make_run_plan(e128, 1, "cuda"))) {
    if (p.phase == "experts") {
      EXPECT_NE(p.ceiling.find("weight traffic"), std::string::npos) << p.ceiling;
    }
  }
}

// The bench holds each GPU to its own measured rates: the H200's and the H100's (80GB HBM3) by
// the device's name, none for another GPU; on the H100 the same work takes the rates' ratio longer.
// Under the FP8 recipe the FP8 GEMMs' forward and data gradient (4 of their 6 FLOPs per MAC pair)
// are held to the dense FP8 GEMM's rate, their weight gradient to the BF16 one; the same FLOPs.
TEST(PhaseCeilings, Fp8GemmsAtTheFp8Rate) {
  Config c = load_config(kOlmoe8l, {});
  const RunPlan plan = make_run_plan(c, 1, "cuda");
  Config f = c;
  f.train.precision = "fp8";
  const Fp8Parts parts = fp8_parts(f);
  EXPECT_TRUE(parts.any && parts.experts && parts.projections);
  EXPECT_FALSE(fp8_parts(c).any);
  const RunPlan plan8 = make_run_plan(f, 1, "cuda");
  const GpuRates& g = h200_ceilings();
  const std::vector<PhaseCeiling> a = phase_ceilings(c, plan, g), b = phase_ceilings(f, plan8, g);
  ASSERT_EQ(a.size(), b.size());
  const double share = (4.0 / 6.0) / g.dense_fp8_gemm_tflops + (2.0 / 6.0) / g.dense_gemm_tflops;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].flops, b[i].flops) << a[i].phase;
    if (a[i].phase == "experts") {
      EXPECT_NEAR(b[i].ideal_ms / a[i].ideal_ms, share * g.dense_gemm_tflops, 1e-12);
      EXPECT_NE(b[i].ceiling.find("dense FP8 GEMM (forward, dgrad)"), std::string::npos) << b[i].ceiling;
    }
    if (a[i].phase == "attention") {
      EXPECT_LT(b[i].ideal_ms, a[i].ideal_ms);
    }
    if (a[i].phase == "lm_head") {
      EXPECT_EQ(b[i].ideal_ms, a[i].ideal_ms);  // BF16 under the recipe
    }
  }
}

// The dispatch and combine on one GPU at the streaming rate: olmoe-8l (one micro-batch of n 16384
// tokens, top-8, d 2048, 8 MoE layers, no shared expert: the combine adds into the FP32 residual
// stream) moves 12 R + 6 n d + 4 R d bytes a layer in the dispatch and 6 R d + 12 n d
// in the combine (R = n k); a shared expert's branch is written instead (6 R d + 4 n d); FP8 experts
// add their codes and scales to both; none with the rowwise exchange or expert parallelism.
TEST(PhaseCeilings, DispatchAndCombineAtTheStreamingRate) {
  const Config c = load_config(kOlmoe8l, {});
  const RunPlan plan = make_run_plan(c, 1, "cuda");
  const auto of = [](const Config& cfg, const RunPlan& pl, const std::string& phase,
                     const GpuRates& g = h200_ceilings()) {
    for (const PhaseCeiling& p : phase_ceilings(cfg, pl, g))
      if (p.phase == phase) return p;
    return PhaseCeiling{};
  };
  const double n = double(plan.tokens_per_micro_batch), d = double(c.model.d_model), r = n * double(c.moe.top_k);
  const double layers = double(c.model.n_layers);
  ASSERT_EQ(n, 16384.0);
  const PhaseCeiling dispatch = of(c, plan, "dispatch"), combine = of(c, plan, "combine");
  EXPECT_DOUBLE_EQ(dispatch.bytes, layers * (12.0 * r + 6.0 * n * d + 4.0 * r * d));
  EXPECT_DOUBLE_EQ(combine.bytes, layers * (6.0 * r * d + 12.0 * n * d));
  EXPECT_NEAR(dispatch.ideal_ms, 1e3 * dispatch.bytes / 4.14e12, 1e-12);
  EXPECT_NEAR(combine.ideal_ms, 1e3 * combine.bytes / 4.14e12, 1e-12);
  EXPECT_GT(combine.ideal_ms, 3.5);  // 16.1 GB: about 3.9 ms on an H200
  EXPECT_LT(combine.ideal_ms, 4.5);
  EXPECT_NE(combine.ceiling.find("TB/s (streaming)"), std::string::npos) << combine.ceiling;
  EXPECT_NEAR(of(c, plan, "combine", h100_ceilings()).ideal_ms / combine.ideal_ms, 4.14 / 3.07, 1e-12);

  Config shared = c;
  shared.moe.shared_experts = 1;
  EXPECT_DOUBLE_EQ(of(shared, make_run_plan(shared, 1, "cuda"), "combine").bytes,
                   layers * (6.0 * r * d + 4.0 * n * d));
  Config f = c;
  f.train.precision = "fp8";
  const double codes = layers * r * d * (1.0 + 4.0 / 128.0);
  const RunPlan plan8 = make_run_plan(f, 1, "cuda");
  EXPECT_DOUBLE_EQ(of(f, plan8, "dispatch").bytes, dispatch.bytes + codes);
  EXPECT_DOUBLE_EQ(of(f, plan8, "combine").bytes, combine.bytes + codes);
  Config rowwise = c;
  rowwise.parallel.ep_backend = "rowwise";
  EXPECT_TRUE(of(rowwise, make_run_plan(rowwise, 1, "cuda"), "dispatch").phase.empty());
  EXPECT_TRUE(of(rowwise, make_run_plan(rowwise, 1, "cuda"), "combine").phase.empty());
}

TEST(PhaseCeilings, EachGpuItsOwnMeasuredRates) {
  EXPECT_EQ(measured_rates("NVIDIA H200"), &h200_ceilings());
  EXPECT_EQ(measured_rates("NVIDIA H100 80GB HBM3"), &h100_ceilings());
  EXPECT_EQ(measured_rates("NVIDIA H100 PCIe"), nullptr);  // another memory, another rate
  EXPECT_EQ(measured_rates("NVIDIA A100-SXM4-80GB"), nullptr);
  const GpuRates& h100 = h100_ceilings();
  EXPECT_STREQ(h100.name, "NVIDIA H100 80GB HBM3");
  for (const double r : {h100.gate_up_fwd_tflops, h100.gate_up_dgrad_tflops, h100.gate_up_wgrad_tflops,
                         h100.down_fwd_tflops, h100.down_dgrad_tflops, h100.down_wgrad_tflops,
                         h100.attention_fwd_tflops, h100.attention_bwd_tflops, h100.dense_gemm_tflops}) {
    EXPECT_GT(r, 300.0);
    EXPECT_LT(r, 989.0);  // below the dense BF16 peak
  }
  const Config c = load_config(kOlmoe8l, {});
  const RunPlan plan = make_run_plan(c, 1, "cuda");
  const std::vector<PhaseCeiling> a = phase_ceilings(c, plan, h200_ceilings()), b = phase_ceilings(c, plan, h100);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].phase, b[i].phase);
    EXPECT_EQ(a[i].flops, b[i].flops) << a[i].phase;  // the same work
    if (a[i].phase == "optimizer") {
      EXPECT_NEAR(b[i].ideal_ms / a[i].ideal_ms, 4.3e12 / 2.959e12, 1e-12);
      EXPECT_NE(b[i].ceiling.find("3.0 TB/s"), std::string::npos) << b[i].ceiling;
    }
    if (a[i].phase == "lm_head") {
      EXPECT_NEAR(b[i].ideal_ms / a[i].ideal_ms, 784.0 / 745.3, 1e-12);
    }
  }
}

// ZeRO-1: dense moments over dp, expert moments over ep-dp; the collectives' bytes follow.
TEST(Planner, ZeroShardsAndCommunication) {
  Config c = small();
  c.train.global_batch = 8;
  c.parallel.zero = true;
  const LayoutPlan p = plan_layout(c, LayoutRequest{4, 2, 1}, 139.8);
  const ParamLayout local = build_param_layout(c.model, c.moe, ExpertSlice{0, 2});
  int64_t dense = 0, expert = 0;
  for (const FlatRange& r : flat_ranges(local, false)) dense += r.end - r.begin;
  for (const FlatRange& r : flat_ranges(local, true)) expert += r.end - r.begin;
  EXPECT_EQ(p.run.memory.dense_params, dense);
  EXPECT_EQ(p.run.memory.expert_params, expert);
  EXPECT_TRUE(p.zero);
  EXPECT_DOUBLE_EQ(p.moments, 8.0 * (double(dense) / 4 + double(expert) / 2));
  EXPECT_DOUBLE_EQ(p.run.memory.moments, p.moments);  // the GPU step shards them too
  EXPECT_DOUBLE_EQ(p.comm.zero_reduce_scatter_sent, 0.75 * 4 * double(dense) + 0.5 * 4 * double(expert));
  EXPECT_DOUBLE_EQ(p.comm.zero_all_gather_sent, p.comm.zero_reduce_scatter_sent);
  EXPECT_DOUBLE_EQ(p.comm.dp_allreduce_sent, 0.0);
  // One MoE layer, R = 16 rows of d 8 in BF16, half of them to the other rank, four exchanges.
  EXPECT_DOUBLE_EQ(p.comm.ep_dispatch_fwd_micro, 16 * 8 * 2 * 0.5);
  EXPECT_DOUBLE_EQ(p.comm.ep_per_step, 4 * 16 * 8 * 2 * 0.5);
  // Without ZeRO: one ring all-reduce of the dense gradients over dp and the experts' over ep-dp.
  c.parallel.zero = false;
  const LayoutPlan q = plan_layout(c, LayoutRequest{4, 2, 1}, 139.8);
  EXPECT_FALSE(q.zero);
  EXPECT_DOUBLE_EQ(q.moments, 8.0 * double(dense + expert));
  EXPECT_DOUBLE_EQ(q.comm.dp_allreduce_sent, 2 * 0.75 * 4 * double(dense) + 2 * 0.5 * 4 * double(expert));
  EXPECT_LT(p.modes[0].memory_total, q.modes[0].memory_total);
}

// optim.moment_dtype = "bf16": the GPU keeps 2 bytes a moment (olmoe-8l: 3.56B parameters, 13.3 GiB
// less), ZeRO-1 shards them the same way, the CPU backend keeps FP32 buffers (8 bytes a parameter);
// the optimizer's ceiling and the planner's optimizer time move 22 bytes a parameter instead of 30.
TEST(Planner, Bf16MomentsHalveTheMomentsOnTheGpu) {
  Config c = load_config(kOlmoe8l, {});
  c.train.device = "cuda";
  const RunPlan fp32 = make_run_plan(c, 1, "cuda");
  c.optim.moment_dtype = "bf16";
  const RunPlan bf16 = make_run_plan(c, 1, "cuda");
  const double n = double(bf16.memory.local_params);
  EXPECT_DOUBLE_EQ(fp32.memory.moments, 8.0 * n);
  EXPECT_DOUBLE_EQ(bf16.memory.moments, 4.0 * n);
  EXPECT_DOUBLE_EQ(bf16.memory.moment_bytes, 2.0);
  EXPECT_NEAR((fp32.memory.total() - bf16.memory.total()) / kGiB, 4.0 * n / kGiB, 1e-9);
  EXPECT_NE(describe_run_plan(bf16).find("AdamW moments (BF16)"), std::string::npos) << describe_run_plan(bf16);
  EXPECT_EQ(describe_run_plan(fp32).find("(BF16)"), std::string::npos);
  // The plan's text: on 80 GB the FP32 moments' step does not fit, and the table says BF16 moments would.
  Config c80 = c;
  c80.optim.moment_dtype = "fp32";
  const std::string text = describe_layout_plan(plan_layout(c80, LayoutRequest{}, 79.2));
  EXPECT_NE(text.find("total, optim.moment_dtype = \"bf16\"          69.876"), std::string::npos) << text;
  EXPECT_NE(text.find("fits, optim.moment_dtype = \"bf16\"              yes"), std::string::npos) << text;
  EXPECT_NE(describe_layout_plan(plan_layout(c, LayoutRequest{}, 79.2)).find("AdamW moments (replicated), BF16"),
            std::string::npos);
  // The layouts of one 80 GB GPU: recompute none does not fit, and would with BF16 moments.
  const std::string layouts = describe_enumeration(enumerate_layouts(c80, 1, 79.2), 1, 79.2);
  EXPECT_NE(layouts.find("# fit with optim.moment_dtype = \"bf16\" (AdamW moments in BF16): dp 1 ep 1 pp 1 none "
                         "69.88 GiB"),
            std::string::npos)
      << layouts;
  EXPECT_EQ(describe_enumeration(enumerate_layouts(c, 1, 79.2), 1, 79.2).find("# fit with"), std::string::npos);
  // The optimizer phase's ceiling: the update's bytes 30 -> 22 a parameter (the norm's read beside it).
  auto optimizer = [&](const Config& cfg, const RunPlan& plan) {
    for (const PhaseCeiling& pc : phase_ceilings(cfg, plan, h200_ceilings()))
      if (pc.phase == "optimizer") return pc.bytes;
    return 0.0;
  };
  Config c32 = c;
  c32.optim.moment_dtype = "fp32";
  EXPECT_NEAR(optimizer(c32, fp32) - optimizer(c, bf16), 8.0 * n, 1e-3 * n);
  // The planner prices the update's bytes: its optimizer time falls by 8 of 30 + 4 bytes.
  const LayoutPlan p32 = plan_layout(c32, LayoutRequest{}, 139.8), p16 = plan_layout(c, LayoutRequest{}, 139.8);
  EXPECT_LT(p16.modes[0].memory_total, p32.modes[0].memory_total - 13.0 * kGiB);
  EXPECT_LT(p16.modes[0].time.optimizer, p32.modes[0].time.optimizer * 0.8);
  EXPECT_GT(p16.modes[0].time.optimizer, p32.modes[0].time.optimizer * 0.6);
  // ZeRO-1 shards of BF16 moments: 4 bytes a parameter of the shard.
  Config z = small();
  z.train.global_batch = 8;
  z.parallel.zero = true;
  z.optim.moment_dtype = "bf16";
  const LayoutPlan zp = plan_layout(z, LayoutRequest{4, 2, 1}, 139.8);
  z.optim.moment_dtype = "fp32";
  const LayoutPlan zq = plan_layout(z, LayoutRequest{4, 2, 1}, 139.8);
  EXPECT_DOUBLE_EQ(zp.moments, zq.moments / 2);
  // The CPU backend keeps the BF16 values in FP32 buffers.
  Config cpu = small();
  cpu.optim.moment_dtype = "bf16";
  const RunPlan on_cpu = make_run_plan(cpu, 1, "cpu");
  EXPECT_DOUBLE_EQ(on_cpu.memory.moments, 8.0 * double(on_cpu.memory.local_params));
}

// train.precision = "fp8": the plan's memory is the FP8 run plan's (the weights' codes and the FP8
// workspaces; olmoe-8l's 83.76 GiB with the experts' codes in their BF16 copy's place, 89.75 GiB
// with the deferred update, which keeps both; 6 of its layers fit an 80 GB GPU), the table shows
// the codes, and the step time says it is from BF16 rates. A CPU config's fp32 is planned as BF16.
TEST(Planner, Fp8PlansItsMemory) {
  Config c = load_config(kOlmoe8l, {});
  const LayoutPlan bf16 = plan_layout(c, LayoutRequest{}, 139.8);
  c.train.precision = "fp8";
  const LayoutPlan fp8 = plan_layout(c, LayoutRequest{}, 79.6);
  Config run = c;
  run.train.device = "cuda";
  const RunPlan run_plan = make_run_plan(run, 1, "cuda");
  EXPECT_TRUE(run_plan.fp8_codes_in_bf16_copy);
  EXPECT_DOUBLE_EQ(fp8.modes[0].memory_total, run_plan.memory.total());
  EXPECT_NEAR(fp8.modes[0].memory_total / kGiB, 83.76, 0.01);
  run.optim.deferred_update = true;
  const RunPlan deferred = make_run_plan(run, 1, "cuda");
  EXPECT_FALSE(deferred.fp8_codes_in_bf16_copy);
  EXPECT_NEAR(deferred.memory.total() / kGiB, 89.75, 0.01);
  // The codes' two bytes per expert parameter, which the BF16 copy's place holds otherwise.
  EXPECT_DOUBLE_EQ(deferred.memory.fp8_codes - run_plan.memory.fp8_codes, 2.0 * double(run_plan.memory.expert_params));
  run.optim.deferred_update = false;
  run.moe.expert_hidden = 1040;  // not whole 128 x 128 blocks: the forward quantises from the BF16 copy
  EXPECT_FALSE(make_run_plan(run, 1, "cuda").fp8_codes_in_bf16_copy);
  EXPECT_GT(fp8.modes[0].memory_total, bf16.modes[0].memory_total);
  EXPECT_FALSE(fp8.modes[0].fits);
  const std::string text = describe_layout_plan(fp8);
  EXPECT_NE(text.find("the cuda backend (FP8)"), std::string::npos) << text.substr(0, 200);
  EXPECT_NE(text.find("FP8 weight codes"), std::string::npos);
  EXPECT_NE(text.find("FP8: the FP8 GEMMs at their measured rates"), std::string::npos);
  EXPECT_EQ(layout_plan_json(fp8).at("precision"), "fp8");
  EXPECT_EQ(describe_layout_plan(bf16).find("FP8 weight codes"), std::string::npos);
  c.model.n_layers = 6;
  EXPECT_TRUE(plan_layout(c, LayoutRequest{}, 79.6).modes[0].fits);
  Config cpu = load_config(kOlmoe8l, {});
  cpu.train.precision = "fp32";
  EXPECT_EQ(plan_layout(cpu, LayoutRequest{}, 139.8).modes[0].memory_total, bf16.modes[0].memory_total);
}

// The FP8 recipe's step: its GEMMs at the FP8 kernels' rates, the rest scaled from the measured FP8
// step of the reference shape. On the reference it gives that step back; on scaling-e8 (d_model
// and expert hidden 4096, a dense layer and shared experts: other GEMM-to-glue ratios) it is checked
// against the FP8 step measured beside the BF16 one (bench/results/h200-main-20261207/steps/:
// e8-fp8-base.json 271.45 ms, e8-bf16.json 303.29 ms), and an H100's against its own reference.
TEST(Planner, Fp8StepNearMeasured) {
  auto step = [](const std::string& config, const char* precision, const GpuCeilings& g, int64_t layers = 0) {
    Config c = load_config(std::string(MOECORE_SOURCE_DIR) + "/configs/" + config,
                           {"--moe.capacity_factor=0", std::string("--train.precision=") + precision});
    if (layers > 0) c.model.n_layers = layers;
    return plan_layout(c, LayoutRequest{}, g.memory_gib, g).modes[0].time.step_ms();
  };
  EXPECT_NEAR(step("olmoe-8l.toml", "fp8", h200_ceilings()), h200_ceilings().ref_fp8.step,
              0.01 * h200_ceilings().ref_fp8.step);
  EXPECT_NEAR(step("olmoe-8l.toml", "fp8", h100_ceilings(), 6), h100_ceilings().ref_fp8.step,
              0.01 * h100_ceilings().ref_fp8.step);
  const double e8_fp8 = step("scaling-e8.toml", "fp8", h200_ceilings());
  const double e8_bf16 = step("scaling-e8.toml", "bf16", h200_ceilings());
  EXPECT_NEAR(e8_fp8, 271.45, 0.07 * 271.45);  // within the 7% of the BF16 sweeps above
  EXPECT_NEAR(e8_bf16, 303.29, 0.07 * 303.29);
  EXPECT_NEAR(e8_bf16 / e8_fp8, 303.29 / 271.45, 0.05);  // 1.117x measured
  // The FP8 GEMMs are what the plan prices differently: no FP8 rate, no gain on the projections.
  GpuCeilings slow = h200_ceilings();
  slow.dense_fp8_gemm_tflops = slow.dense_gemm_tflops;
  EXPECT_GT(step("scaling-e8.toml", "fp8", slow), e8_fp8);
}

TEST(Planner, BatchRaisedToTheLeastMultiple) {
  Config c = small();  // global 2, micro 2
  const LayoutPlan p = plan_layout(c, LayoutRequest{4, 1, 1}, 139.8);
  EXPECT_EQ(p.run.global_batch, 8);
  EXPECT_EQ(p.run.micro_steps, 1);
  EXPECT_NE(p.batch_note.find("2 -> 8"), std::string::npos) << p.batch_note;
  c.train.global_batch = 12;  // dp 4 x micro 2 = 8 does not divide 12: lcm 24
  EXPECT_EQ(plan_layout(c, LayoutRequest{4, 1, 1}, 139.8).run.global_batch, 24);
}

TEST(Planner, EnumeratesOnlyValidLayoutsBestFirst) {
  Config c = load_config(kOlmoe8l, {});
  c.moe.num_experts = 12;  // ep 8 does not divide 12; ep 3 does not divide dp 8
  const Enumeration e = enumerate_layouts(c, 8, 139.8);
  std::vector<int64_t> eps, pps;
  for (const LayoutChoice& l : e.fitting) {
    const ParallelSizes& z = l.plan.run.sizes;
    EXPECT_EQ(z.dp * z.pp, 8);
    EXPECT_EQ(z.dp % z.ep, 0);
    EXPECT_EQ(12 % z.ep, 0);
    if (z.pp > 1) {  // the GPU pipeline step: ep 1, recompute none
      EXPECT_EQ(z.ep, 1);
      EXPECT_EQ(l.mode, Recompute::kNone);
    }
    EXPECT_TRUE(l.mode_plan().refused.empty());
    EXPECT_LE(l.mode_plan().memory_total, 139.8 * kGiB);
    if (z.pp == 1) eps.push_back(z.ep);
    pps.push_back(z.pp);
  }
  // pp 1: ep 1, 2, 4 x three modes; pp 2, 4, 8 (olmoe-8l's 8 layers): ep 1, recompute none.
  EXPECT_EQ(e.fitting.size() + e.not_fitting.size(), 3u * 3u + 3u);
  for (std::vector<int64_t>* v : {&eps, &pps}) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
  EXPECT_EQ(eps, (std::vector<int64_t>{1, 2, 4}));
  EXPECT_EQ(pps, (std::vector<int64_t>{1, 2, 4, 8}));
  for (size_t i = 1; i < e.fitting.size(); ++i)
    EXPECT_GE(e.fitting[i - 1].mode_plan().tokens_per_s_per_gpu, e.fitting[i].mode_plan().tokens_per_s_per_gpu);
  // A smaller GPU: what does not fit moves out of the ranking.
  const Enumeration tight = enumerate_layouts(load_config(kOlmoe8l, {}), 1, 80.0);
  ASSERT_EQ(tight.fitting.size() + tight.not_fitting.size(), 3u);
  EXPECT_EQ(tight.not_fitting.size(), 1u);  // recompute none needs 83 GiB
  EXPECT_EQ(tight.not_fitting[0].mode, Recompute::kNone);
  EXPECT_EQ(tight.fitting[0].mode, Recompute::kSelective);
}

TEST(Planner, LayoutParsing) {
  const LayoutRequest l = parse_layout("ep=4,dp=8", 0);
  EXPECT_EQ(l.dp, 8);
  EXPECT_EQ(l.ep, 4);
  EXPECT_EQ(l.pp, 1);
  EXPECT_EQ(parse_layout("ep=2", 8).dp, 8);
  EXPECT_NE(error_of([] { parse_layout("dp=8,xp=2", 0); }).find("unknown key 'xp'"), std::string::npos);
  EXPECT_NE(error_of([] { parse_layout("dp=two", 0); }).find("got 'two'"), std::string::npos);
  EXPECT_EQ(parse_layout("dp=2,pp=2", 0).pp, 2);
  EXPECT_EQ(parse_layout("pp=2", 8).dp, 4);
  EXPECT_NE(error_of([] { parse_layout("dp=2,pp=2", 8); }).find("dp x pp = 2 x 2 = 4 GPUs, but --gpus is 8"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_layout("dp=4", 8); }).find("--gpus is 8"), std::string::npos);
  EXPECT_NE(error_of([] { parse_layout("dp=2,dp=2", 0); }).find("given twice"), std::string::npos);
}

TEST(PlanCli, PrintsAllThreeModes) {
  const auto r = run_cli("plan " + kOlmoe8l);
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* s : {"none*", "selective", "full", "activations kept by the layers", "recompute pools (one layer per kind)",
                        "scratch and workspaces", "tokens/s/GPU", "# memory estimate   per rank on the GPU: 83.14"})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
  // The dry run prints the same figures from the same code.
  const auto dry = run_cli("train " + kOlmoe8l + " --dry-run --train.precision=fp32");
  ASSERT_EQ(dry.status, 0) << dry.output;
  EXPECT_NE(dry.output.find("# memory estimate   per rank on the GPU: 83.14"), std::string::npos) << dry.output;
}

TEST(PlanCli, EnumeratesEightGpus) {
  const auto r = run_cli("plan " + kOlmoe8l + " --gpus 8");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("rank dp"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("train.global_batch 4 -> 32"), std::string::npos) << r.output;
  const auto j = run_cli("plan " + kOlmoe8l + " --gpus 8 --json");
  ASSERT_EQ(j.status, 0) << j.output;
  const nlohmann::json doc = nlohmann::json::parse(j.output);
  ASSERT_FALSE(doc.at("fitting").empty());
  EXPECT_EQ(doc.at("fitting")[0].at("dp"), 8);
}

TEST(PlanCli, JsonParsesAndBadValuesAreNamed) {
  const auto j = run_cli("plan " + kOlmoe8l + " --layout dp=2,ep=2 --json");
  ASSERT_EQ(j.status, 0) << j.output;
  const nlohmann::json doc = nlohmann::json::parse(j.output);
  EXPECT_EQ(doc.at("layout").at("ep"), 2);
  EXPECT_GT(doc.at("comm_bytes_per_step").at("ep_per_step").get<double>(), 0.0);
  for (const char* mode : {"none", "selective", "full"})
    EXPECT_GT(doc.at("modes").at(mode).at("time_ms").at("step").get<double>(), 0.0) << mode;
  const auto bad = run_cli("plan " + kOlmoe8l + " --layout dp=2,ep=x");
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.output.find("--layout 'dp=2,ep=x'"), std::string::npos) << bad.output;
  const auto pp = run_cli("plan " + kOlmoe8l + " --layout dp=2,ep=2,pp=2");
  EXPECT_EQ(pp.status, 1);
  EXPECT_NE(pp.output.find("the GPU pipeline step runs no expert parallelism inside a stage"), std::string::npos)
      << pp.output;
  const auto mem = run_cli("plan " + kOlmoe8l + " --gpu-memory lots");
  EXPECT_EQ(mem.status, 1);
  EXPECT_NE(mem.output.find("--gpu-memory: expected a positive number of GiB, got 'lots'"), std::string::npos)
      << mem.output;
}

// pp > 1 as the GPU pipeline step runs it: 1F1B simulated with each stage's costs. Two stages and
// one micro-batch: F0, send, F1 (with the LM head), B1, send, B0 one after another.
TEST(Planner, PipelineStagesFollowTheSchedule) {
  Config c = load_config(kOlmoe8l, {});
  c.train.recompute = "full";
  c.train.global_batch = 4;
  const LayoutPlan one = plan_layout(c, LayoutRequest{1, 1, 2}, 139.8);
  ASSERT_EQ(one.stages.size(), 2u);
  EXPECT_EQ(one.run.micro_steps, 1);
  EXPECT_EQ(one.stages[0].first_layer, 0);
  EXPECT_EQ(one.stages[0].end_layer, 4);
  EXPECT_EQ(one.stages[1].end_layer, 8);
  const double send = one.comm.pp_send_per_micro / h200_ceilings().allreduce_bus_bytes_per_s * 1e3;
  EXPECT_DOUBLE_EQ(one.comm.pp_send_per_micro, 4.0 * 16384 * 2048);
  const StagePlan &s0 = one.stages[0], &s1 = one.stages[1];
  EXPECT_EQ(s0.forwards_again + s1.forwards_again, 0);
  EXPECT_NEAR(one.makespan_ms, s0.forward_ms + s1.forward_ms + s1.backward_ms + s0.backward_ms + 2.0 * send, 1e-9);
  EXPECT_GT(s1.forward_ms, s0.forward_ms);  // the LM head, its backward inside
  EXPECT_NEAR(layout_plan_json(one).at("pipeline").at("bubble_formula").get<double>(), 0.5, 1e-12);
  // Recompute none only (the configured full is noted), its step the makespan plus the optimizer.
  ASSERT_EQ(one.notes.size(), 1u);
  EXPECT_NE(one.notes[0].find("train.recompute \"full\" -> \"none\""), std::string::npos) << one.notes[0];
  EXPECT_TRUE(one.modes[0].refused.empty());
  for (size_t i = 1; i < 3; ++i) {
    EXPECT_FALSE(one.modes[i].fits);
    EXPECT_NE(one.modes[i].refused.find("runs train.recompute = \"none\" only"), std::string::npos);
  }
  const StepTime& t = one.modes[0].time;
  EXPECT_NEAR(t.step_ms(), one.makespan_ms + t.optimizer + t.grad_reduce, 1e-6);
  EXPECT_GT(t.pipeline_wait, 0.0);
  // The stage's memory is the run plan's (one micro-batch of its layers, the FP32 stage inputs).
  EXPECT_DOUBLE_EQ(one.modes[0].activations.total(), one.run.memory.activation.total());
  // Eight micro-batches: every backward of stage 0 but none of stage 1 runs its forward again
  // (stage 0 runs one forward ahead), and the bubble shrinks.
  c.train.global_batch = 16;
  c.train.micro_batch = 2;
  const LayoutPlan eight = plan_layout(c, LayoutRequest{1, 1, 2}, 139.8);
  EXPECT_EQ(eight.run.micro_steps, 8);
  EXPECT_EQ(eight.stages[0].forwards_again, 8);
  EXPECT_EQ(eight.stages[1].forwards_again, 0);
  EXPECT_EQ(eight.busiest_stage, 0);
  EXPECT_NEAR(eight.modes[0].time.recompute, 8.0 * eight.stages[0].forward_ms, 1e-9);
  EXPECT_EQ(eight.comm.pp_per_step, 8.0 * eight.comm.pp_send_per_micro);
  for (const StagePlan& st : eight.stages) EXPECT_LE(st.busy_ms + st.sends_ms, eight.makespan_ms + 1e-9);
  const double idle = 1.0 - (eight.stages[1].busy_ms + eight.stages[1].sends_ms) / eight.makespan_ms;
  EXPECT_LT(idle, 0.5);
  EXPECT_GT(eight.modes[0].tokens_per_s_per_gpu, one.modes[0].tokens_per_s_per_gpu);
  // ep with pp is refused, naming both.
  EXPECT_NE(error_of([&] { plan_layout(c, LayoutRequest{2, 2, 2}, 139.8); })
                .find("the GPU pipeline step runs no expert parallelism inside a stage"),
            std::string::npos);
}

TEST(PlanCli, PlansPipelineStages) {
  const auto r = run_cli("plan " + kOlmoe8l + " --layout pp=2 --gpus 2 --train.global_batch=16 --train.micro_batch=2");
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* s : {"pipeline, recompute none: 1F1B over 8 micro-batches, simulated", "pipeline wait (bubble)",
                        "selective: refused", "pipeline send (FP32 [N, D]), per micro-batch", "  0*      0..3"})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
  const auto j = run_cli("plan " + kOlmoe8l + " --layout pp=2 --gpus 2 --json");
  ASSERT_EQ(j.status, 0) << j.output;
  const nlohmann::json doc = nlohmann::json::parse(j.output);
  EXPECT_EQ(doc.at("layout").at("pp"), 2);
  EXPECT_EQ(doc.at("pipeline").at("stages").size(), 2u);
  EXPECT_GT(doc.at("modes").at("none").at("time_ms").at("pipeline_wait").get<double>(), 0.0);
  EXPECT_FALSE(doc.at("modes").at("full").at("refused").get<std::string>().empty());
}

// Pipeline parallelism: planned on cpu (the grid in the description, the largest stage's
// parameters), refused on cuda naming the key.
TEST(RunPlan, PipelineOnCpuAndCuda) {
  Config c;
  c.model.n_layers = 4;
  c.parallel.pp = 2;
  c.train.global_batch = 8;
  c.train.micro_batch = 2;
  const RunPlan p = make_run_plan(c, 4, "cpu");
  EXPECT_EQ(p.sizes.dp, 2);
  EXPECT_EQ(p.micro_steps, 2);
  EXPECT_EQ(p.stage_bounds, (std::vector<int64_t>{0, 2, 4}));
  EXPECT_LT(p.memory.local_params, build_param_layout(c.model, c.moe).total_numel());
  const std::string d = describe_run_plan(p);
  EXPECT_NE(d.find("#   stage 1        ranks 2..3 (dp group), layers 2..3 + final norm, LM head"), std::string::npos) << d;
  EXPECT_NE(d.find("#   pipeline groups [0 2] [1 3]"), std::string::npos) << d;
  // The GPU pipeline step holds one micro-batch of its stage's layers (a forward runs again
  // before a backward that does not follow it) and every micro-batch's FP32 stage input.
  const RunPlan g = make_run_plan(c, 4, "cuda");
  EXPECT_EQ(g.stage_bounds, p.stage_bounds);
  EXPECT_EQ(g.pipeline_held_layers, 2);
  EXPECT_GE(g.memory.scratch, 4.0 * double(g.micro_steps * g.tokens_per_micro_batch * c.model.d_model));
}

// A stage keeps the activations of the chunks it ran forward and not yet backward: 1F1B's stage 0
// holds pp micro-batches of L / pp layers (L layer activations, as pp = 1 holds one micro-batch
// of L layers), one micro-batch per step holds only a stage's layers, and interleaving holds more.
TEST(RunPlan, PipelineActivationsFollowTheScheduleInFlight) {
  auto plan = [](int64_t pp, int64_t v, int64_t micro_steps) {
    Config c;
    c.model.n_layers = 8;
    c.model.dense_layers = {};
    c.parallel.pp = pp;
    c.parallel.virtual_stages = v;
    c.train.micro_batch = 1;
    c.train.global_batch = micro_steps;
    return make_run_plan(c, pp, "cpu");
  };
  const RunPlan one = plan(1, 1, 4);
  struct Case {
    int64_t pp, v, micro, held;
  };
  for (const Case k : {Case{2, 1, 4, 8}, Case{4, 1, 8, 8}, Case{2, 1, 1, 4}, Case{2, 2, 4, 10}}) {
    const RunPlan p = plan(k.pp, k.v, k.micro);
    EXPECT_EQ(p.pipeline_held_layers, k.held) << "pp " << k.pp << " v " << k.v << " m " << k.micro;
    EXPECT_NEAR(p.memory.activations_kept, one.memory.activations_kept * double(k.held) / 8.0,
                1e-6 * one.memory.activations_kept)
        << "pp " << k.pp << " v " << k.v << " m " << k.micro;
  }
  EXPECT_EQ(one.pipeline_held_layers, 0);
}

}  // namespace
}  // namespace moe
