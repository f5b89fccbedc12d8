// The whole MoE layer chained on CPU (router -> dispatch -> experts -> combine), forward and
// backward, checked by finite differences in x, w_gate, w_gate_up and w_down for the loss
// L = sum(out * R) + a * lb_loss + b * z_loss, across routing extremes (all tokens to one
// expert, empty experts, top_k = 1 and top_k = E, random and uniform routing), plus float/double.
#include <cmath>
#include <string>

#include "moe_test_util.h"

namespace moe::testing {
namespace {

using cpu::RoutingMode;
using cpu::ScoreFunc;

struct LayerCase {
  std::string name;
  MoeLayerShape shape;
  int64_t const_feature = -1;  // >= 0: x[:, f] = 1 and w_gate[0, f] = big_gate
  double big_gate = 0.0;
  int32_t all_to = -1;         // >= 0: every token must route to this expert
  bool expect_empty_expert = false;
};

MoeLayerShape shape(int64_t n, int64_t d, int64_t ne, int64_t k, int64_t inner, ScoreFunc score,
                    bool norm, RoutingMode mode = RoutingMode::kLearned, uint64_t seed = 0,
                    std::vector<float> bias = {}) {
  MoeLayerShape s;
  s.p.num_tokens = n;
  s.p.d_model = d;
  s.p.num_experts = ne;
  s.p.top_k = k;
  s.p.score = score;
  s.p.norm_topk = norm;
  s.p.mode = mode;
  s.p.seed = seed;
  s.inner = inner;
  s.bias = std::move(bias);
  return s;
}

std::vector<float> bias_on(int64_t ne, int64_t e, float v) {
  std::vector<float> b(ne, 0.f);
  b[e] = v;
  return b;
}

std::vector<LayerCase> layer_cases() {
  return {
      {"generic.softmax.k2", shape(12, 6, 6, 2, 5, ScoreFunc::kSoftmax, false), -1, 0, -1, false},
      {"generic.sigmoid.norm.k3", shape(10, 5, 7, 3, 4, ScoreFunc::kSigmoid, true), -1, 0, -1, false},
      // top_k = 1; a bias of 10 sends every token to expert 3, so experts 0, 1, 2, 4 are empty.
      {"bias_all_to_one.k1", shape(10, 5, 5, 1, 4, ScoreFunc::kSigmoid, false, RoutingMode::kLearned, 0,
                                   bias_on(5, 3, 10.f)), -1, 0, 3, true},
      // A gate weight of 8 on a constant feature sends every token's first slot to expert 0.
      {"const_feature_all_to_one.k2", shape(9, 5, 6, 2, 3, ScoreFunc::kSoftmax, true), 4, 8.0, 0, false},
      {"const_feature_all_to_one.k1", shape(9, 5, 6, 1, 3, ScoreFunc::kSigmoid, true), 4, 8.0, 0, true},
      // top_k = E: every expert sees every token; norm_topk renormalises over all of them.
      {"topk_eq_E.softmax.norm", shape(7, 4, 4, 4, 3, ScoreFunc::kSoftmax, true), -1, 0, -1, false},
      {"topk_eq_E.sigmoid", shape(5, 4, 3, 3, 3, ScoreFunc::kSigmoid, false), -1, 0, -1, false},
      // Few tokens over many experts: several experts receive nothing.
      {"sparse.empty_experts.k1", shape(4, 5, 12, 1, 3, ScoreFunc::kSoftmax, false), -1, 0, -1, true},
      {"random.k3", shape(6, 5, 9, 3, 4, ScoreFunc::kSoftmax, false, RoutingMode::kRandom, 42), -1, 0, -1, true},
      {"uniform.k2", shape(8, 4, 4, 2, 3, ScoreFunc::kSigmoid, true, RoutingMode::kUniform), -1, 0, -1, false},
  };
}

struct LayerInputs {
  std::vector<double> x, w_gate, w_gate_up, w_down, r;
};

LayerInputs make_inputs(const LayerCase& c, uint64_t seed) {
  const auto& p = c.shape.p;
  LayerInputs in;
  in.w_gate = random_vector(p.num_experts * p.d_model, seed, 0.7);
  if (c.const_feature >= 0) in.w_gate[0 * p.d_model + c.const_feature] = c.big_gate;
  in.x = draw_router_input(p, in.w_gate, c.shape.bias, seed + 1, c.const_feature);
  in.w_gate_up = random_vector(p.num_experts * 2 * c.shape.inner * p.d_model, seed + 2, 0.5);
  in.w_down = random_vector(p.num_experts * p.d_model * c.shape.inner, seed + 3, 0.5);
  in.r = random_vector(p.num_tokens * p.d_model, seed + 4);
  return in;
}

TEST(MoeLayer, GradCheck) {
  const double a = 0.4, b = 0.25;
  uint64_t seed = 1000;
  for (const auto& c : layer_cases()) {
    SCOPED_TRACE(c.name);
    seed += 10;
    auto in = make_inputs(c, seed);
    const auto& s = c.shape;
    const auto base = moe_layer_forward(s, in.x, in.w_gate, in.w_gate_up, in.w_down);
    ASSERT_GE(selection_margin(s.p, base.scores, s.bias), kMinMargin);
    EXPECT_EQ(base.dispatch_counts, base.counts);
    if (c.all_to >= 0) {
      ASSERT_EQ(base.counts[c.all_to], s.p.num_tokens) << "every token must route to " << c.all_to;
    }
    if (c.expect_empty_expert) {
      ASSERT_NE(std::find(base.counts.begin(), base.counts.end(), 0), base.counts.end())
          << "case is meant to leave an expert empty";
    }
    auto loss = [&] {
      const auto st = moe_layer_forward(s, in.x, in.w_gate, in.w_gate_up, in.w_down);
      EXPECT_EQ(st.topk_idx, base.topk_idx) << "a finite-difference step flipped a selection";
      return dot(st.out, in.r) + a * st.stats.lb_loss + b * st.stats.z_loss;
    };
    const auto g = moe_layer_backward(s, base, in.x, in.w_gate, in.w_gate_up, in.w_down, in.r, a, b);
    const std::string n = "moe_layer." + c.name;
    expect_grad_close(n + ".dx", in.x, g.dx, loss);
    expect_grad_close(n + ".dw_gate", in.w_gate, g.dw_gate, loss);
    expect_grad_close(n + ".dw_gate_up", in.w_gate_up, g.dw_gate_up, loss);
    expect_grad_close(n + ".dw_down", in.w_down, g.dw_down, loss);
  }
}

TEST(MoeLayer, FloatMatchesDouble) {
  // Awkward sizes: 37 tokens, d = 19, 9 experts, top-3, inner 11.
  LayerCase c{"float_double", shape(37, 19, 9, 3, 11, ScoreFunc::kSoftmax, true), -1, 0, -1, false};
  const auto in = make_inputs(c, 5000);
  const auto& s = c.shape;
  const auto d = moe_layer_forward(s, in.x, in.w_gate, in.w_gate_up, in.w_down);
  const auto xf = cast<float>(in.x), wgf = cast<float>(in.w_gate), wguf = cast<float>(in.w_gate_up),
             wdf = cast<float>(in.w_down), rf = cast<float>(in.r);
  const auto f = moe_layer_forward(s, xf, wgf, wguf, wdf);
  ASSERT_EQ(f.topk_idx, d.topk_idx);
  EXPECT_EQ(f.sorted_route, d.sorted_route);
  EXPECT_NEAR(f.stats.lb_loss, d.stats.lb_loss, 1e-6);
  EXPECT_NEAR(f.stats.z_loss, d.stats.z_loss, 1e-5);
  auto expect_close = [](const auto& got, const std::vector<double>& ref, const char* what) {
    double worst = 0, scale = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(got[i]) - ref[i]));
      scale = std::max(scale, std::abs(ref[i]));
    }
    EXPECT_LE(worst, 1e-5 * std::max(scale, 1.0)) << what;
  };
  expect_close(f.out, d.out, "out");
  const auto gd = moe_layer_backward(s, d, in.x, in.w_gate, in.w_gate_up, in.w_down, in.r, 0.4, 0.25);
  const auto gf = moe_layer_backward(s, f, xf, wgf, wguf, wdf, rf, 0.4f, 0.25f);
  expect_close(gf.dx, gd.dx, "dx");
  expect_close(gf.dw_gate, gd.dw_gate, "dw_gate");
  expect_close(gf.dw_gate_up, gd.dw_gate_up, "dw_gate_up");
  expect_close(gf.dw_down, gd.dw_down, "dw_down");
}

}  // namespace
}  // namespace moe::testing
