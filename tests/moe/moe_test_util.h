// Shared helpers for the MoE tests: router inputs drawn with a clear selection margin, the
// margin itself, and the whole MoE layer (router -> dispatch -> experts -> combine) chained
// forward and backward on the CPU reference ops, templated on the scalar type.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "cpu/dispatch.h"
#include "cpu/experts.h"
#include "cpu/router.h"
#include "support/gradcheck.h"

namespace moe::testing {

// Smallest gap, over tokens, between the k-th selected key and the best unselected key
// (key = score + bias). Infinity when k == E or routing ignores the scores.
inline double selection_margin(const cpu::RouterParams& p, const std::vector<double>& scores,
                               const std::vector<float>& bias) {
  if (p.mode != cpu::RoutingMode::kLearned || p.top_k == p.num_experts)
    return std::numeric_limits<double>::infinity();
  double margin = std::numeric_limits<double>::infinity();
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    std::vector<double> key(p.num_experts);
    for (int64_t e = 0; e < p.num_experts; ++e)
      key[e] = scores[t * p.num_experts + e] + (bias.empty() ? 0.0 : bias[e]);
    std::sort(key.begin(), key.end(), std::greater<double>());
    margin = std::min(margin, key[p.top_k - 1] - key[p.top_k]);
  }
  return margin;
}

// Margin policy for every finite-difference check: a step h = 1e-6 on x or w_gate moves a
// logit by at most h * max(|w_gate|, |x|) < 1e-5 with these inputs, and a softmax or sigmoid
// score by less than that, so keys kept at least kMinMargin = 1e-3 apart cannot swap order
// (a 100x safety factor). Each loss evaluation also re-checks that the selection is unchanged.
constexpr double kMinMargin = 1e-3;

// Draws x [T,D] row by row from `seed`, redrawing any token whose selection margin under
// (w_gate, bias) is below kMinMargin. When const_feature >= 0, column const_feature of x is 1
// for every token (used with a large gate weight to route all tokens to one expert).
inline std::vector<double> draw_router_input(const cpu::RouterParams& p,
                                             const std::vector<double>& w_gate,
                                             const std::vector<float>& bias, uint64_t seed,
                                             int64_t const_feature = -1) {
  std::vector<double> x(p.num_tokens * p.d_model);
  cpu::RouterParams one = p;
  one.num_tokens = 1;
  std::vector<double> logits(p.num_experts), scores(p.num_experts), w(p.top_k);
  std::vector<int32_t> idx(p.top_k), counts(p.num_experts);
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    for (uint64_t attempt = 0;; ++attempt) {
      auto row = random_vector(p.d_model, seed * 1000003 + t * 997 + attempt);
      if (const_feature >= 0) row[const_feature] = 1.0;
      cpu::router_forward(one, row.data(), w_gate.data(), bias.empty() ? nullptr : bias.data(),
                          logits.data(), scores.data(), idx.data(), w.data(), counts.data());
      if (selection_margin(one, scores, bias) >= kMinMargin || attempt > 1000) {
        std::copy(row.begin(), row.end(), x.begin() + t * p.d_model);
        break;
      }
    }
  }
  return x;
}

// The message of the moe::Error that f throws ("" when it does not throw).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const moe::Error& e) {
    return e.what();
  }
  return "";
}

template <typename T>
std::vector<T> cast(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

// Everything one MoE layer forward saves.
template <typename T>
struct MoeLayerState {
  std::vector<T> logits, scores, topk_w, x_sorted, gate_up, h, y, out;
  std::vector<int32_t> topk_idx, counts, dispatch_counts, offsets, sorted_route, route_to_row;
  cpu::RouterStats stats;
};

struct MoeLayerShape {
  cpu::RouterParams p;
  int64_t inner = 0;
  std::vector<float> bias;  // empty: no expert bias
};

template <typename T>
MoeLayerState<T> moe_layer_forward(const MoeLayerShape& s, const std::vector<T>& x,
                                   const std::vector<T>& w_gate, const std::vector<T>& w_gate_up,
                                   const std::vector<T>& w_down) {
  const auto& p = s.p;
  const int64_t n = p.num_tokens, d = p.d_model, ne = p.num_experts, k = p.top_k, rows = n * k;
  MoeLayerState<T> st;
  st.logits.resize(n * ne);
  st.scores.resize(n * ne);
  st.topk_w.resize(n * k);
  st.topk_idx.resize(n * k);
  st.counts.resize(ne);
  st.stats = cpu::router_forward(p, x.data(), w_gate.data(), s.bias.empty() ? nullptr : s.bias.data(),
                                 st.logits.data(), st.scores.data(), st.topk_idx.data(),
                                 st.topk_w.data(), st.counts.data());
  st.dispatch_counts.resize(ne);
  st.offsets.resize(ne + 1);
  st.sorted_route.resize(rows);
  st.route_to_row.resize(rows);
  cpu::build_dispatch_map(st.topk_idx.data(), n, k, ne, st.dispatch_counts.data(), st.offsets.data(),
                          st.sorted_route.data(), st.route_to_row.data());
  st.x_sorted.resize(rows * d);
  cpu::permute_forward(x.data(), st.sorted_route.data(), rows, k, d, st.x_sorted.data());
  st.gate_up.resize(rows * 2 * s.inner);
  st.h.resize(rows * s.inner);
  st.y.resize(rows * d);
  cpu::experts_forward(st.x_sorted.data(), st.offsets.data(), w_gate_up.data(), w_down.data(), ne, d,
                       s.inner, st.gate_up.data(), st.h.data(), st.y.data());
  st.out.resize(n * d);
  cpu::unpermute_forward(st.y.data(), st.route_to_row.data(), st.topk_w.data(), n, k, d,
                         st.out.data());
  return st;
}

template <typename T>
struct MoeLayerGrads {
  std::vector<T> dx, dw_gate, dw_gate_up, dw_down;
};

// Backward of L = sum(out * dout) + a * lb_loss + b * z_loss.
template <typename T>
MoeLayerGrads<T> moe_layer_backward(const MoeLayerShape& s, const MoeLayerState<T>& st,
                                    const std::vector<T>& x, const std::vector<T>& w_gate,
                                    const std::vector<T>& w_gate_up, const std::vector<T>& w_down,
                                    const std::vector<T>& dout, T a, T b) {
  const auto& p = s.p;
  const int64_t n = p.num_tokens, d = p.d_model, ne = p.num_experts, k = p.top_k, rows = n * k;
  MoeLayerGrads<T> g;
  g.dx.assign(n * d, T(0));
  g.dw_gate.assign(ne * d, T(0));
  g.dw_gate_up.assign(w_gate_up.size(), T(0));
  g.dw_down.assign(w_down.size(), T(0));
  std::vector<T> dy(rows * d), dtopk_w(n * k), dx_sorted(rows * d), scratch(rows * 3 * s.inner);
  cpu::unpermute_backward(dout.data(), st.y.data(), st.route_to_row.data(), st.topk_w.data(), n, k,
                          d, rows, dy.data(), dtopk_w.data());
  cpu::experts_backward(st.x_sorted.data(), st.offsets.data(), w_gate_up.data(), w_down.data(),
                        st.gate_up.data(), st.h.data(), dy.data(), ne, d, s.inner, dx_sorted.data(),
                        g.dw_gate_up.data(), g.dw_down.data(), scratch.data());
  cpu::permute_backward(dx_sorted.data(), st.sorted_route.data(), rows, k, d, g.dx.data());
  cpu::router_backward(p, x.data(), w_gate.data(), st.logits.data(), st.scores.data(),
                       st.topk_idx.data(), st.counts.data(), dtopk_w.data(), a, b, g.dx.data(),
                       g.dw_gate.data());
  return g;
}

}  // namespace moe::testing
