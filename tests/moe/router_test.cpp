// Router tests: top-k against a brute-force sort, deterministic ties, expert bias, norm_topk,
// random and uniform routing, counts, the lb/z losses on hand-computed cases, finite-difference
// gradients (softmax/sigmoid x norm_topk, with lb and z terms) and argument errors.
#include <cmath>
#include <numeric>
#include <string>

#include "moe_test_util.h"

namespace moe::testing {
namespace {

using cpu::RouterParams;
using cpu::RoutingMode;
using cpu::ScoreFunc;

template <typename T>
struct RouterOut {
  std::vector<T> logits, scores, topk_w;
  std::vector<int32_t> idx, counts;
  cpu::RouterStats stats;
};

template <typename T>
RouterOut<T> run_router(const RouterParams& p, const std::vector<T>& x, const std::vector<T>& w,
                        const std::vector<float>& bias = {}) {
  RouterOut<T> o;
  o.logits.resize(p.num_tokens * p.num_experts);
  o.scores.resize(p.num_tokens * p.num_experts);
  o.topk_w.resize(p.num_tokens * p.top_k);
  o.idx.resize(p.num_tokens * p.top_k);
  o.counts.assign(p.num_experts, -1);
  o.stats = cpu::router_forward(p, x.data(), w.data(), bias.empty() ? nullptr : bias.data(),
                                o.logits.data(), o.scores.data(), o.idx.data(), o.topk_w.data(),
                                o.counts.data());
  return o;
}

RouterParams make_params(int64_t n, int64_t d, int64_t ne, int64_t k,
                         ScoreFunc score = ScoreFunc::kSoftmax, bool norm = false,
                         RoutingMode mode = RoutingMode::kLearned, uint64_t seed = 0) {
  RouterParams p;
  p.num_tokens = n;
  p.d_model = d;
  p.num_experts = ne;
  p.top_k = k;
  p.score = score;
  p.norm_topk = norm;
  p.mode = mode;
  p.seed = seed;
  return p;
}

void expect_counts_match(const RouterParams& p, const std::vector<int32_t>& idx,
                         const std::vector<int32_t>& counts) {
  std::vector<int32_t> ref(p.num_experts, 0);
  for (int32_t e : idx) ++ref[e];
  EXPECT_EQ(counts, ref);
  EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), int64_t{0}), p.num_tokens * p.top_k);
}

void expect_distinct_per_token(const RouterParams& p, const std::vector<int32_t>& idx) {
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    std::vector<int32_t> row(idx.begin() + t * p.top_k, idx.begin() + (t + 1) * p.top_k);
    std::sort(row.begin(), row.end());
    EXPECT_EQ(std::adjacent_find(row.begin(), row.end()), row.end()) << "token " << t;
    for (int32_t e : row) EXPECT_TRUE(e >= 0 && e < p.num_experts) << "token " << t << " got " << e;
  }
}

TEST(Router, TopKMatchesBruteForceSort) {
  for (ScoreFunc score : {ScoreFunc::kSoftmax, ScoreFunc::kSigmoid}) {
    for (bool with_bias : {false, true}) {
      const auto p = make_params(40, 12, 16, 5, score);
      const auto x = random_vector(p.num_tokens * p.d_model, 11);
      const auto w = random_vector(p.num_experts * p.d_model, 12, 0.5);
      std::vector<float> bias;
      if (with_bias)
        for (auto b : random_vector(p.num_experts, 13, 0.1)) bias.push_back(static_cast<float>(b));
      const auto o = run_router(p, x, w, bias);
      for (int64_t t = 0; t < p.num_tokens; ++t) {
        std::vector<int32_t> order(p.num_experts);
        std::iota(order.begin(), order.end(), 0);
        auto key = [&](int32_t e) { return o.scores[t * p.num_experts + e] + (bias.empty() ? 0.0 : bias[e]); };
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return key(a) > key(b); });
        for (int64_t j = 0; j < p.top_k; ++j) {
          EXPECT_EQ(o.idx[t * p.top_k + j], order[j]) << "token " << t << " slot " << j;
          EXPECT_EQ(o.topk_w[t * p.top_k + j], o.scores[t * p.num_experts + order[j]]);
        }
        if (score == ScoreFunc::kSoftmax) {
          double sum = 0;
          for (int64_t e = 0; e < p.num_experts; ++e) sum += o.scores[t * p.num_experts + e];
          EXPECT_NEAR(sum, 1.0, 1e-12);
        }
      }
      expect_counts_match(p, o.idx, o.counts);
    }
  }
}

template <typename T>
void check_ties() {
  // All logits equal (zero gate): every token takes experts 0..k-1 in order.
  {
    const auto p = make_params(5, 3, 6, 4);
    const auto o = run_router<T>(p, cast<T>(random_vector(15, 21)), std::vector<T>(18, T(0)));
    for (int64_t t = 0; t < p.num_tokens; ++t)
      for (int64_t j = 0; j < p.top_k; ++j) EXPECT_EQ(o.idx[t * p.top_k + j], j);
  }
  // Partial ties: logits = x (identity gate) = [1, 3, 0, 3, 3] -> top-3 = 1, 3, 4.
  {
    const auto p = make_params(1, 5, 5, 3);
    std::vector<T> w(25, T(0));
    for (int e = 0; e < 5; ++e) w[e * 5 + e] = T(1);
    const auto o = run_router<T>(p, std::vector<T>{1, 3, 0, 3, 3}, w);
    EXPECT_EQ(o.idx, (std::vector<int32_t>{1, 3, 4}));
    // A bias tie-breaker in favour of the higher index: bias is a selection key only.
    const auto ob = run_router<T>(p, std::vector<T>{1, 3, 0, 3, 3}, w, {0, 0, 0, 0, 0.5f});
    EXPECT_EQ(ob.idx, (std::vector<int32_t>{4, 1, 3}));
  }
}

TEST(Router, TiesGoToLowestIndex) {
  check_ties<double>();
  check_ties<float>();
}

TEST(Router, BiasChangesSelectionNotWeights) {
  const auto p = make_params(20, 8, 6, 2, ScoreFunc::kSigmoid);
  const auto x = random_vector(160, 31), w = random_vector(48, 32);
  const auto plain = run_router(p, x, w);
  std::vector<float> bias(6, 0.f);
  bias[4] = 10.f;  // expert 4 always wins slot 0
  const auto biased = run_router(p, x, w, bias);
  EXPECT_EQ(plain.scores, biased.scores);
  EXPECT_EQ(plain.logits, biased.logits);
  int64_t changed = 0;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    EXPECT_EQ(biased.idx[t * 2], 4);
    for (int64_t j = 0; j < 2; ++j) {
      const int32_t e = biased.idx[t * 2 + j];
      EXPECT_EQ(biased.topk_w[t * 2 + j], biased.scores[t * 6 + e]) << "weight must be the score, not score+bias";
      changed += (plain.idx[t * 2 + j] != e);
    }
  }
  EXPECT_GT(changed, 0);
  EXPECT_EQ(biased.counts[4], p.num_tokens);
}

TEST(Router, NormTopkSumsToOne) {
  for (ScoreFunc score : {ScoreFunc::kSoftmax, ScoreFunc::kSigmoid}) {
    const auto p = make_params(17, 6, 8, 3, score, /*norm=*/true);
    const auto o = run_router(p, random_vector(102, 41), random_vector(48, 42));
    const auto raw = run_router(make_params(17, 6, 8, 3, score, false), random_vector(102, 41),
                                random_vector(48, 42));
    for (int64_t t = 0; t < p.num_tokens; ++t) {
      double sum = 0, raw_sum = 0;
      for (int64_t j = 0; j < 3; ++j) sum += o.topk_w[t * 3 + j], raw_sum += raw.topk_w[t * 3 + j];
      EXPECT_NEAR(sum, 1.0, 1e-14);
      for (int64_t j = 0; j < 3; ++j) EXPECT_NEAR(o.topk_w[t * 3 + j], raw.topk_w[t * 3 + j] / raw_sum, 1e-15);
    }
  }
}

TEST(Router, RandomModeDeterministicDistinctUniform) {
  const int64_t d = 4, ne = 8, k = 2;
  const auto w = random_vector(ne * d, 51);
  const auto p = make_params(40000, d, ne, k, ScoreFunc::kSoftmax, false, RoutingMode::kRandom, 77);
  const auto x = random_vector(p.num_tokens * d, 52);
  const auto a = run_router(p, x, w);
  const auto b = run_router(p, x, w);
  EXPECT_EQ(a.idx, b.idx);
  expect_distinct_per_token(p, a.idx);
  expect_counts_match(p, a.idx, a.counts);
  // Roughly uniform: each expert gets T*k/E = 10000 routes, +-3% (about 3 standard deviations).
  for (int64_t e = 0; e < ne; ++e) EXPECT_NEAR(a.counts[e], 10000, 300) << "expert " << e;
  // Each slot on its own is roughly uniform too.
  for (int64_t j = 0; j < k; ++j) {
    std::vector<int64_t> c(ne, 0);
    for (int64_t t = 0; t < p.num_tokens; ++t) ++c[a.idx[t * k + j]];
    for (int64_t e = 0; e < ne; ++e) EXPECT_NEAR(c[e], 5000, 250) << "slot " << j << " expert " << e;
  }
  // Depends only on (seed, token, k): other x, other w, fewer tokens, a bias -> same experts.
  auto p_small = p;
  p_small.num_tokens = 100;
  std::vector<float> bias(ne, 0.f);
  bias[0] = 100.f;
  const auto c = run_router(p_small, random_vector(100 * d, 53), random_vector(ne * d, 54), bias);
  EXPECT_TRUE(std::equal(c.idx.begin(), c.idx.end(), a.idx.begin()));
  // Weights are the scores at the drawn experts.
  for (int64_t t = 0; t < 100; ++t)
    for (int64_t j = 0; j < k; ++j)
      EXPECT_EQ(c.topk_w[t * k + j], c.scores[t * ne + c.idx[t * k + j]]);
  // Another seed routes differently.
  auto p_other = p_small;
  p_other.seed = 78;
  const auto o = run_router(p_other, random_vector(100 * d, 53), random_vector(ne * d, 54));
  EXPECT_FALSE(std::equal(o.idx.begin(), o.idx.end(), c.idx.begin()));
  // k == E: every token is a permutation of all experts.
  const auto pe = make_params(50, d, ne, ne, ScoreFunc::kSigmoid, false, RoutingMode::kRandom, 5);
  const auto all = run_router(pe, random_vector(50 * d, 55), w);
  expect_distinct_per_token(pe, all.idx);
  for (int64_t e = 0; e < ne; ++e) EXPECT_EQ(all.counts[e], 50);
}

TEST(Router, UniformModeBalanced) {
  const auto p = make_params(12, 4, 9, 3, ScoreFunc::kSoftmax, false, RoutingMode::kUniform);
  const auto o = run_router(p, random_vector(48, 61), random_vector(36, 62));
  expect_distinct_per_token(p, o.idx);
  expect_counts_match(p, o.idx, o.counts);
  for (int64_t e = 0; e < 9; ++e) EXPECT_EQ(o.counts[e], 4);
  for (int64_t t = 0; t < 12; ++t)
    for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(o.idx[t * 3 + j], (t * 3 + j) % 9);
  // T*k not a multiple of E: counts differ by at most one.
  const auto q = make_params(7, 4, 5, 2, ScoreFunc::kSigmoid, false, RoutingMode::kUniform);
  const auto oq = run_router(q, random_vector(28, 63), random_vector(20, 64));
  expect_distinct_per_token(q, oq.idx);
  expect_counts_match(q, oq.idx, oq.counts);
  const auto [mn, mx] = std::minmax_element(oq.counts.begin(), oq.counts.end());
  EXPECT_LE(*mx - *mn, 1);
}

TEST(Router, LbLossIsOneWhenUniformAndBalanced) {
  // Zero gate: softmax scores are exactly 1/E; uniform routing with E | T*k: f_e = 1/E.
  const auto p = make_params(8, 3, 4, 2, ScoreFunc::kSoftmax, false, RoutingMode::kUniform);
  const auto o = run_router(p, random_vector(24, 71), std::vector<double>(12, 0.0));
  EXPECT_EQ(o.stats.lb_loss, 1.0);
  EXPECT_NEAR(o.stats.z_loss, std::log(4.0) * std::log(4.0), 1e-14);
}

TEST(Router, LossesHandComputed) {
  // Identity gate so logits = x. T=2, E=2, k=1.
  const double l3 = std::log(3.0);
  const std::vector<double> eye = {1, 0, 0, 1};
  const auto p = make_params(2, 2, 2, 1);
  // Both tokens logits [0, ln3]: scores [1/4, 3/4], both pick expert 1.
  // f = [0, 1], P = [1/4, 3/4] -> lb = 2 * (0*1/4 + 1*3/4) = 1.5; lse = ln 4 -> z = (ln 4)^2.
  const auto a = run_router(p, std::vector<double>{0, l3, 0, l3}, eye);
  EXPECT_EQ(a.idx, (std::vector<int32_t>{1, 1}));
  EXPECT_NEAR(a.stats.lb_loss, 1.5, 1e-14);
  EXPECT_NEAR(a.stats.z_loss, std::log(4.0) * std::log(4.0), 1e-14);
  // Mirrored tokens: f = [1/2, 1/2], P = [1/2, 1/2] -> lb = 1.
  const auto b = run_router(p, std::vector<double>{0, l3, l3, 0}, eye);
  EXPECT_EQ(b.idx, (std::vector<int32_t>{1, 0}));
  EXPECT_NEAR(b.stats.lb_loss, 1.0, 1e-14);
  // Sigmoid, logits [0, 0] and [2, 0] (k=1): scores [.5,.5] -> expert 0 (tie), [s(2), .5] -> 0.
  // f = [1, 0], P_0 = (0.5 + s(2)) / 2 -> lb = 2 * P_0 = 0.5 + s(2). lse: ln 2, ln(e^2 + 1).
  const auto ps = make_params(2, 2, 2, 1, ScoreFunc::kSigmoid);
  const auto c = run_router(ps, std::vector<double>{0, 0, 2, 0}, eye);
  const double s2 = 1.0 / (1.0 + std::exp(-2.0));
  EXPECT_EQ(c.idx, (std::vector<int32_t>{0, 0}));
  EXPECT_NEAR(c.stats.lb_loss, 0.5 + s2, 1e-14);
  const double lse1 = std::log(std::exp(2.0) + 1.0);
  EXPECT_NEAR(c.stats.z_loss, (std::log(2.0) * std::log(2.0) + lse1 * lse1) / 2, 1e-14);
}

TEST(Router, EmptyBatch) {
  const auto p = make_params(0, 4, 3, 2);
  const std::vector<double> w = random_vector(12, 81);
  std::vector<double> none;
  std::vector<int32_t> counts(3, 7), no_idx;
  const auto st = cpu::router_forward(p, none.data(), w.data(), nullptr, none.data(), none.data(),
                                      no_idx.data(), none.data(), counts.data());
  EXPECT_EQ(st.lb_loss, 0.0);
  EXPECT_EQ(st.z_loss, 0.0);
  EXPECT_EQ(counts, (std::vector<int32_t>{0, 0, 0}));
  std::vector<double> dw(12, 0.0);
  cpu::router_backward(p, none.data(), w.data(), none.data(), none.data(), no_idx.data(),
                       counts.data(), none.data(), 1.0, 1.0, none.data(), dw.data());
  EXPECT_EQ(dw, std::vector<double>(12, 0.0));
}

// L = sum(topk_w * R) + a * lb + b * z, checked against finite differences in x and w_gate.
void router_gradcheck(const std::string& name, const RouterParams& p, const std::vector<float>& bias,
                      uint64_t seed, int64_t const_feature = -1, double big_gate = 0.0,
                      int32_t all_to = -1) {
  auto w = random_vector(p.num_experts * p.d_model, seed, 0.7);
  if (const_feature >= 0) w[0 * p.d_model + const_feature] = big_gate;  // expert 0 dominates
  auto x = draw_router_input(p, w, bias, seed + 1, const_feature);
  const auto r = random_vector(p.num_tokens * p.top_k, seed + 2);
  const double a = 0.7, b = 0.3;
  const auto base = run_router(p, x, w, bias);
  ASSERT_GE(selection_margin(p, base.scores, bias), kMinMargin) << name;
  if (all_to >= 0) {
    ASSERT_EQ(base.counts[all_to], p.num_tokens) << name << ": every token must route to " << all_to;
  }
  auto loss = [&] {
    const auto o = run_router(p, x, w, bias);
    EXPECT_EQ(o.idx, base.idx) << name << ": a finite-difference step flipped a selection";
    return dot(o.topk_w, r) + a * o.stats.lb_loss + b * o.stats.z_loss;
  };
  std::vector<double> dx(x.size(), 0.0), dw(w.size(), 0.0);
  cpu::router_backward(p, x.data(), w.data(), base.logits.data(), base.scores.data(), base.idx.data(),
                       base.counts.data(), r.data(), a, b, dx.data(), dw.data());
  expect_grad_close(name + ".dx", x, dx, loss);
  expect_grad_close(name + ".dw_gate", w, dw, loss);
}

TEST(Router, GradCheck) {
  for (ScoreFunc score : {ScoreFunc::kSoftmax, ScoreFunc::kSigmoid}) {
    for (bool norm : {false, true}) {
      const std::string name = std::string("router.") +
                               (score == ScoreFunc::kSoftmax ? "softmax" : "sigmoid") +
                               (norm ? ".norm" : ".raw");
      router_gradcheck(name, make_params(9, 5, 6, 2, score, norm), {}, 100);
      router_gradcheck(name + ".k1", make_params(7, 4, 5, 1, score, norm), {}, 110);
      router_gradcheck(name + ".kE", make_params(6, 4, 4, 4, score, norm), {}, 120);
    }
  }
}

TEST(Router, GradCheckRoutingExtremes) {
  // All tokens to expert 3 through the bias (others get none); scores still carry gradient.
  std::vector<float> bias(5, 0.f);
  bias[3] = 5.f;
  router_gradcheck("router.bias_all_to_one.k1", make_params(8, 4, 5, 1, ScoreFunc::kSigmoid, false), bias, 200, -1, 0.0, 3);
  router_gradcheck("router.bias_all_to_one.k2", make_params(8, 4, 5, 2, ScoreFunc::kSoftmax, true), bias, 210, -1, 0.0, 3);
  // All tokens to expert 0 through a big gate weight on a constant feature.
  router_gradcheck("router.const_feature.k1", make_params(8, 4, 5, 1, ScoreFunc::kSoftmax, false), {}, 220, 2, 6.0, 0);
  // Random and uniform modes: gradients through the scores at the drawn experts.
  router_gradcheck("router.random", make_params(8, 4, 6, 3, ScoreFunc::kSoftmax, true, RoutingMode::kRandom, 9), {}, 230);
  router_gradcheck("router.uniform", make_params(8, 4, 6, 2, ScoreFunc::kSigmoid, false, RoutingMode::kUniform), {}, 240);
}

TEST(Router, FloatMatchesDouble) {
  const auto p = make_params(33, 16, 8, 3, ScoreFunc::kSoftmax, true);
  const auto w = random_vector(p.num_experts * p.d_model, 301, 0.3);
  const auto x = draw_router_input(p, w, {}, 302);
  const auto r = random_vector(p.num_tokens * p.top_k, 303);
  const auto od = run_router(p, x, w);
  const auto of = run_router(p, cast<float>(x), cast<float>(w));
  EXPECT_EQ(of.idx, od.idx);
  EXPECT_EQ(of.counts, od.counts);
  for (size_t i = 0; i < od.topk_w.size(); ++i) EXPECT_NEAR(of.topk_w[i], od.topk_w[i], 1e-6);
  EXPECT_NEAR(of.stats.lb_loss, od.stats.lb_loss, 1e-6);
  EXPECT_NEAR(of.stats.z_loss, od.stats.z_loss, 1e-5);
  std::vector<double> dxd(x.size(), 0.0), dwd(w.size(), 0.0);
  std::vector<float> dxf(x.size(), 0.f), dwf(w.size(), 0.f);
  cpu::router_backward(p, x.data(), w.data(), od.logits.data(), od.scores.data(), od.idx.data(),
                       od.counts.data(), r.data(), 0.5, 0.2, dxd.data(), dwd.data());
  const auto xf = cast<float>(x), wf = cast<float>(w), rf = cast<float>(r);
  cpu::router_backward(p, xf.data(), wf.data(), of.logits.data(), of.scores.data(), of.idx.data(),
                       of.counts.data(), rf.data(), 0.5f, 0.2f, dxf.data(), dwf.data());
  for (size_t i = 0; i < dxd.size(); ++i) EXPECT_NEAR(dxf[i], dxd[i], 1e-5 * (1 + std::abs(dxd[i])));
  for (size_t i = 0; i < dwd.size(); ++i) EXPECT_NEAR(dwf[i], dwd[i], 1e-5 * (1 + std::abs(dwd[i])));
}

TEST(Router, ErrorsNameTheValue) {
  const std::vector<double> x(8, 0.0), w(16, 0.0);
  std::vector<double> logits(8), scores(8), tw(10);
  std::vector<int32_t> idx(10), counts(4);
  auto call = [&](int64_t k, int64_t ne) {
    return error_of([&] {
      cpu::router_forward(make_params(2, 4, ne, k), x.data(), w.data(), nullptr, logits.data(),
                          scores.data(), idx.data(), tw.data(), counts.data());
    });
  };
  const std::string too_big = call(5, 4);
  EXPECT_NE(too_big.find("top_k=5"), std::string::npos) << too_big;
  EXPECT_NE(too_big.find("num_experts=4"), std::string::npos) << too_big;
  const std::string zero = call(0, 4);
  EXPECT_NE(zero.find("top_k=0"), std::string::npos) << zero;
  const std::string no_experts = call(1, 0);
  EXPECT_NE(no_experts.find("num_experts must be > 0, got 0"), std::string::npos) << no_experts;
  // Uniform mode needs k <= E as well.
  auto pu = make_params(2, 4, 4, 5, ScoreFunc::kSoftmax, false, RoutingMode::kUniform);
  EXPECT_THROW(cpu::router_forward(pu, x.data(), w.data(), nullptr, logits.data(), scores.data(),
                                   idx.data(), tw.data(), counts.data()),
               moe::Error);
}

}  // namespace
}  // namespace moe::testing
