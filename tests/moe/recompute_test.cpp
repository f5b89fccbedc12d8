// Activation recomputation on the CPU model (core/recompute.h, Model::set_recompute). (1) For
// selective and full, two micro-batches of different shapes (so the pooled buffers are resized)
// give bitwise the losses, stats, per-expert counts, logits and accumulated gradients of mode
// none: Model<float> (BLAS) and Model<double>, dense and MoE layers, shared experts, QK-norm on
// and off, capacity drops, random routing and a selection-steering expert bias. (2) Routing is
// not decided again: an expert bias changed between forward and backward (it would re-route every
// token) leaves the gradients those of none. (3) Memory: each block keeps exactly what the
// contract says, the pool holds one block of each kind, and the saved bytes after forward fall
// from none to selective to full and do not grow over steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/recompute.h"
#include "model/model.h"
#include "support/block_cases.h"
#include "support/parity.h"

namespace moe::testing {
namespace {

using Case = BlockCase;
using Batch = CaseBatch;

// The shared cases (a second overflowing expert in the capacity case) and one more: expert bias,
// top-1 and two shared experts, all MoE layers.
std::vector<Case> cases() {
  std::vector<Case> out = block_cases(31, "shared_expert_qk_norm", "capacity_drops", "random_sigmoid_no_qk_norm");
  out[1].bias[4 + 2] = 0.5f;
  Case bias{"expert_bias_two_shared_top1", block_case_model(31), block_case_moe(), {}};
  bias.m.dense_layers = {};
  bias.e.top_k = 1;
  bias.e.shared_experts = 2;
  bias.bias.assign(4 * 4, 0.f);
  for (int64_t l = 0; l < 4; ++l) bias.bias[l * 4 + (l % 4)] = 0.05f;
  out.push_back(bias);
  return out;
}

Batch make_batch(int64_t batch, int64_t seq, uint64_t seed, int64_t vocab) {
  return make_case_batch(batch, seq, seed, vocab);
}
std::vector<Batch> batches(int64_t vocab) { return {make_batch(2, 6, 3, vocab), make_batch(1, 9, 8, vocab)}; }

const LossScales kScales{1.0 / 19, 0.1, 0.01};

// What one model did over the micro-batches: stats and logits per micro-batch, the accumulated
// gradients, and the saved bytes after each forward.
template <typename T>
struct ModelRun {
  std::vector<ForwardStats> stats;
  std::vector<std::vector<T>> logits;
  std::vector<T> grads;
  std::vector<int64_t> bytes_after_forward;
};

// between(model) runs after each forward, before its backward.
template <typename T, typename F>
ModelRun<T> run(const Case& c, Recompute mode, F&& between, bool fp8 = false, const char* fp8_scaling = "blocks") {
  Model<T> model(c.m, c.e);
  model.init_params(17);
  model.set_recompute(mode);
  if (fp8) model.set_matmul_precision("fp8", fp8_scaling);
  EXPECT_EQ(model.recompute(), mode);
  model.zero_grads();
  ModelRun<T> r;
  for (const Batch& b : batches(c.m.vocab_size)) {
    if (c.bias.empty()) {
      std::fill(model.expert_bias().begin(), model.expert_bias().end(), 0.f);
    } else {
      model.expert_bias() = c.bias;
    }
    r.stats.push_back(model.forward(b.inputs.data(), b.targets.data(), b.batch, b.seq, b.seed));
    r.logits.push_back(model.logits());
    r.bytes_after_forward.push_back(model.saved_activation_bytes());
    between(model);
    model.backward(kScales);
  }
  r.grads.assign(model.grads(), model.grads() + model.layout().total_numel());
  return r;
}

template <typename T>
ModelRun<T> run(const Case& c, Recompute mode) {
  return run<T>(c, mode, [](Model<T>&) {});
}

template <typename T>
void check_bitwise(const Case& c) {
  const ModelRun<T> ref = run<T>(c, Recompute::kNone);
  if (c.e.capacity_factor > 0) {
    EXPECT_GT(ref.stats[0].num_dropped, 0) << c.name << ": the case must drop routes";
  }
  for (Recompute mode : {Recompute::kSelective, Recompute::kFull}) {
    const std::string tag = c.name + " " + recompute_name(mode);
    const ModelRun<T> r = run<T>(c, mode);
    for (size_t i = 0; i < ref.stats.size(); ++i) {
      expect_same_stats(r.stats[i], ref.stats[i], tag + " micro-batch " + std::to_string(i));
      EXPECT_TRUE(same_bits(r.logits[i], ref.logits[i])) << tag << ": logits of micro-batch " << i;
      EXPECT_LT(r.bytes_after_forward[i], ref.bytes_after_forward[i]) << tag << ": saved bytes after forward " << i;
    }
    EXPECT_TRUE(same_bits(r.grads, ref.grads)) << tag << ": gradients";
  }
}

TEST(Recompute, GradientsBitwiseEqualToNoneFloat) {
  for (const Case& c : cases()) check_bitwise<float>(c);
}

// train.precision = "fp8" on the CPU (the recipe emulated): recomputation stays bitwise (the same
// quantised GEMMs on the same inputs), and the model stays near its FP32 self, yet not equal (the
// quantisation is there). Each FP8 GEMM is within a few percent of its FP32 product
// (Fp8.EmulatedLinearPassesEqualTheRecipe checks the passes); through four layers, and with tokens
// that change experts when the router's input moves (capacity drops, random routing on close
// scores), these small models' logits move by 5-31% normwise and their gradients more, so the
// bounds here only catch a broken emulation (a wrong scale is off by orders of magnitude).
TEST(Recompute, Fp8EmulationRecomputesBitwiseAndStaysNearFp32) {
  for (const Case& c : cases()) {
    const auto none = [](Model<float>&) {};
    const ModelRun<float> ref = run<float>(c, Recompute::kNone, none, /*fp8=*/true);
    for (Recompute mode : {Recompute::kSelective, Recompute::kFull}) {
      const ModelRun<float> r = run<float>(c, mode, none, true);
      for (size_t i = 0; i < ref.stats.size(); ++i) {
        EXPECT_TRUE(same_bits(r.logits[i], ref.logits[i])) << c.name << " " << recompute_name(mode);
      }
      EXPECT_TRUE(same_bits(r.grads, ref.grads)) << c.name << " " << recompute_name(mode) << ": gradients";
    }
    const ModelRun<float> fp32 = run<float>(c, Recompute::kNone);
    EXPECT_FALSE(same_bits(ref.grads, fp32.grads)) << c.name << ": the FP8 recipe changed nothing";
    const double dl = normwise_difference(ref.logits[0], fp32.logits[0]);
    const double dg = normwise_difference(ref.grads, fp32.grads);
    std::printf("%s: fp8 vs fp32 logits %.3e, gradients %.3e normwise\n", c.name.c_str(), dl, dg);
    EXPECT_LT(dl, 0.5) << c.name;
    EXPECT_LT(dg, 2.0) << c.name;
  }
  // MX scaling (train.fp8_scaling = "mx"): recomputation bitwise too, and another quantisation.
  const std::vector<Case> all = cases();
  const Case& c = all[0];
  const auto none = [](Model<float>&) {};
  const ModelRun<float> mx = run<float>(c, Recompute::kNone, none, true, "mx");
  EXPECT_TRUE(same_bits(run<float>(c, Recompute::kFull, none, true, "mx").grads, mx.grads)) << c.name << ": MX";
  EXPECT_FALSE(same_bits(mx.grads, run<float>(c, Recompute::kNone, none, true).grads)) << c.name << ": MX = blocks";
  EXPECT_LT(normwise_difference(mx.logits[0], run<float>(c, Recompute::kNone, none).logits[0]), 0.5) << c.name;
  Model<double> d(cases()[0].m, cases()[0].e);
  EXPECT_THROW(d.set_matmul_precision("fp8"), Error);
}

TEST(Recompute, GradientsBitwiseEqualToNoneDouble) {
  for (const Case& c : cases()) check_bitwise<double>(c);
}

// A large bias on expert 3 after forward would send every token there if the router selected
// again; the recomputed backward must keep the forward's routing, as mode none does.
TEST(Recompute, BackwardKeepsTheForwardsRouting) {
  Case c = cases()[0];
  auto steer = [](Model<float>& model) {
    for (int64_t m = 0; m < model.num_moe_layers(); ++m) model.expert_bias()[m * 4 + 3] = 100.f;
  };
  const ModelRun<float> ref = run<float>(c, Recompute::kNone, steer);
  // The steering bias does change routing (so this test can fail): a forward under it routes
  // every token's first slot to expert 3.
  Model<float> steered(c.m, c.e);
  steered.init_params(17);
  steer(steered);
  const Batch b = batches(c.m.vocab_size)[0];
  const ForwardStats st = steered.forward(b.inputs.data(), b.targets.data(), b.batch, b.seq, b.seed);
  EXPECT_NE(st.tokens_per_expert, ref.stats[0].tokens_per_expert) << "the bias must change the routing";
  for (Recompute mode : {Recompute::kSelective, Recompute::kFull}) {
    const ModelRun<float> r = run<float>(c, mode, steer);
    EXPECT_TRUE(same_bits(r.grads, ref.grads)) << recompute_name(mode) << ": gradients with the bias changed";
  }
}

template <typename T>
int64_t cap(const std::vector<T>& v) {
  return static_cast<int64_t>(v.capacity());
}

// Per block, what the contract keeps is there and what it recomputes holds no memory.
template <typename T>
void expect_kept(const Model<T>& model, Recompute mode, const std::string& tag) {
  const bool full = mode == Recompute::kFull;
  for (int64_t l = 0; l < model.model_config().n_layers; ++l) {
    const BlockSaved<T>& s = model.block_saved(l);
    const std::string at = tag + " block " + std::to_string(l) + ": ";
    EXPECT_GT(cap(s.attn.x_in_ND), 0) << at << "attention input";
    for (int64_t c : {cap(s.attn.norm_ND), cap(s.attn.q_raw_NQ), cap(s.attn.k_raw_NC), cap(s.attn.q_NQ),
                      cap(s.attn.k_NC), cap(s.attn.v_NC)})
      EXPECT_EQ(c, 0) << at << "attention norm output or q/k/v kept";
    EXPECT_EQ(cap(s.attn.rstd_N) > 0, !full) << at << "attention rstd";
    EXPECT_EQ(cap(s.attn.q_rstd_N) > 0, !full && model.model_config().qk_norm) << at << "QK-norm rstd";
    EXPECT_EQ(cap(s.attn.attn_NQ) > 0, !full) << at << "attention output";
    EXPECT_EQ(cap(s.attn.lse_BHS) > 0, !full) << at << "log-sum-exp";
    if (s.moe.topk_idx_NK.empty()) {  // dense
      EXPECT_EQ(cap(s.mlp.x_in_ND) > 0, !full) << at << "MLP input";
      EXPECT_EQ(cap(s.mlp.rstd_N) > 0, !full) << at << "MLP rstd";
      EXPECT_EQ(cap(s.mlp.mlp.gate_up_N2F) > 0, !full) << at << "MLP gate/up";
      EXPECT_EQ(cap(s.mlp.norm_ND) + cap(s.mlp.mlp.h_NF), 0) << at << "MLP norm output or SwiGLU output kept";
      continue;
    }
    const MoeLayerSaved<T>& m = s.moe;
    EXPECT_EQ(cap(m.x_in_ND) > 0, !full) << at << "MoE input";
    EXPECT_EQ(cap(m.rstd_N) > 0, !full) << at << "MoE rstd";
    EXPECT_EQ(cap(m.experts.gate_up_G2I) > 0, !full) << at << "experts' gate/up";
    EXPECT_EQ(cap(m.shared.gate_up_N2F) > 0, !full && model.moe_config().shared_experts > 0) << at << "shared gate/up";
    EXPECT_EQ(cap(m.norm_ND) + cap(m.experts.x_GD) + cap(m.experts.h_GI) + cap(m.y_sorted_RD) + cap(m.shared.h_NF), 0)
        << at << "MoE norm output, dispatched rows, SwiGLU or down outputs kept";
    // The routing decision, in every mode.
    for (int64_t c : {cap(m.logits_NE), cap(m.scores_NE), cap(m.topk_w_NK), cap(m.topk_idx_NK),
                      cap(m.dispatch.sorted_route_R), cap(m.dispatch.route_to_row_R), cap(m.experts.offsets_L1)})
      EXPECT_GT(c, 0) << at << "routing or dispatch map not kept";
  }
}

TEST(Recompute, SavedMemoryFallsAndTheRecomputedTensorsArePooled) {
  Case c = cases()[0];
  c.m.n_layers = 6;
  c.m.dense_layers = {1, 4};
  const Batch b = make_batch(2, 8, 3, c.m.vocab_size);
  int64_t none_bytes = 0, none_block_max = 0, selective_bytes = 0;
  for (Recompute mode : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
    const std::string tag = recompute_name(mode);
    Model<float> model(c.m, c.e);
    model.init_params(17);
    model.set_recompute(mode);
    std::vector<int64_t> after_forward;
    for (int step = 0; step < 3; ++step) {
      model.zero_grads();
      model.forward(b.inputs.data(), b.targets.data(), b.batch, b.seq, b.seed);
      after_forward.push_back(model.saved_activation_bytes());
      if (mode != Recompute::kNone) expect_kept(model, mode, tag + " step " + std::to_string(step));
      model.backward(kScales);
    }
    EXPECT_EQ(after_forward[1], after_forward[0]) << tag << ": saved bytes grow over steps";
    EXPECT_EQ(after_forward[2], after_forward[0]) << tag << ": saved bytes grow over steps";
    int64_t blocks = 0, block_max_dense = 0, block_max_moe = 0;
    for (int64_t l = 0; l < c.m.n_layers; ++l) {
      const int64_t bytes = saved_bytes(model.block_saved(l));
      blocks += bytes;
      int64_t& max = model.block_saved(l).moe.topk_idx_NK.empty() ? block_max_dense : block_max_moe;
      max = std::max(max, bytes);
    }
    const int64_t pool = after_forward[0] - blocks;
    std::printf("recompute %s: saved_activation_bytes after forward %lld (blocks %lld, pool %lld)\n", tag.c_str(),
                static_cast<long long>(after_forward[0]), static_cast<long long>(blocks), static_cast<long long>(pool));
    if (mode == Recompute::kNone) {
      none_bytes = after_forward[0];
      none_block_max = block_max_dense + block_max_moe;
      EXPECT_EQ(pool, 0) << tag << ": nothing pooled";
      continue;
    }
    // One dense and one MoE block's worth at most, whatever the number of layers.
    EXPECT_GT(pool, 0) << tag;
    EXPECT_LE(pool, none_block_max) << tag << ": the pool holds more than one block of each kind";
    if (mode == Recompute::kSelective) {
      EXPECT_LT(after_forward[0], none_bytes) << tag;
      selective_bytes = after_forward[0];
    } else {
      EXPECT_LT(after_forward[0], selective_bytes) << tag;
    }
  }
}

// Switching the mode between steps releases what the new mode does not keep; recompute_block
// leaves a block whole, and backward then uses it as it is.
TEST(Recompute, ModeChangesAndRecomputeBlock) {
  const Case c = cases()[0];
  const Batch b = make_batch(2, 5, 4, c.m.vocab_size);
  Model<double> ref(c.m, c.e), model(c.m, c.e);
  ref.init_params(17);
  model.init_params(17);
  for (Recompute mode : {Recompute::kNone, Recompute::kFull, Recompute::kSelective, Recompute::kNone}) {
    ref.zero_grads();
    ref.forward(b.inputs.data(), b.targets.data(), b.batch, b.seq, b.seed);
    ref.backward(kScales);
    model.set_recompute(mode);
    model.zero_grads();
    model.forward(b.inputs.data(), b.targets.data(), b.batch, b.seq, b.seed);
    if (mode != Recompute::kNone) expect_kept(model, mode, std::string("after switching to ") + recompute_name(mode));
    if (mode == Recompute::kSelective) {
      model.recompute_block(2);
      EXPECT_GT(cap(model.block_saved(2).attn.norm_ND), 0) << "recompute_block leaves the block whole";
    }
    EXPECT_EQ(model.saved_activation_bytes() < ref.saved_activation_bytes(), mode != Recompute::kNone)
        << recompute_name(mode);
    model.backward(kScales);
    const int64_t total = ref.layout().total_numel();
    EXPECT_TRUE(same_bits(std::vector<double>(model.grads(), model.grads() + total),
                          std::vector<double>(ref.grads(), ref.grads() + total)))
        << recompute_name(mode) << ": gradients";
  }
}

TEST(Recompute, ModeNamesParseAndBadOnesNameTheKey) {
  for (Recompute mode : {Recompute::kNone, Recompute::kSelective, Recompute::kFull})
    EXPECT_EQ(parse_recompute(recompute_name(mode)), mode);
  try {
    parse_recompute("partial");
    ADD_FAILURE() << "parse_recompute accepted \"partial\"";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("train.recompute"), std::string::npos) << msg;
    EXPECT_NE(msg.find("partial"), std::string::npos) << msg;
    EXPECT_NE(msg.find("selective"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace moe::testing
