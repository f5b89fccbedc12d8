// MoE router on CPU: gate linear -> softmax/sigmoid scores -> top-k selection (learned, random or
// uniform) -> selected weights, plus the Switch load-balancing loss and the router z-loss, and
// the backward of all of it. Row-major raw pointers: x[T,D], w_gate[E,D] (linear weight layout
// [out, in]), logits/scores[T,E], topk_idx/topk_w[T,k]. Templated on float/double.
#pragma once

#include <cstdint>

#include "core/moe_types.h"

namespace moe::cpu {

using moe::RoutingMode;
using moe::ScoreFunc;

struct RouterParams {
  int64_t num_tokens = 0, d_model = 0, num_experts = 0, top_k = 0;
  ScoreFunc score = ScoreFunc::kSoftmax;
  bool norm_topk = false;
  RoutingMode mode = RoutingMode::kLearned;
  uint64_t seed = 0;  // random routing: selection depends only on (seed, token index, k)
};

struct RouterStats {
  double lb_loss = 0;
  double z_loss = 0;
};

// Semantics (T = num_tokens, D = d_model, E = num_experts, k = top_k):
// - logits = x @ w_gate^T. scores = softmax(logits) over each token's E logits (max-subtracted),
//   or sigmoid(logits) elementwise.
// - Selection, by mode:
//   * kLearned: the k largest keys key[t,e] = scores[t,e] + expert_bias[e] (bias 0 when
//     expert_bias is null; the key is formed in T precision). The bias only steers selection.
//     Slots are filled in decreasing key order; equal keys go to the lowest expert index, so
//     selection is deterministic (equal logits -> experts 0..k-1).
//   * kRandom: k distinct experts from the first k steps of a Fisher-Yates shuffle of 0..E-1
//     whose step j swaps slot j with j + h(seed, t, j) mod (E - j), h a splitmix64-style hash.
//     Token t's experts depend only on (seed, t, k) (not on T, x or the weights).
//   * kUniform: token t takes experts (t*k + j) mod E for j = 0..k-1 (distinct as k <= E;
//     counts differ by at most one, and are equal when E divides T*k).
//   expert_bias is ignored in kRandom and kUniform.
// - topk_w[t,j] = scores[t, topk_idx[t,j]] (never the bias), divided by sum_j of those when
//   norm_topk. num_tokens_per_expert[e] = number of (token, slot) routes to e (sums to T*k).
// - lb_loss (Switch) = E * sum_e f_e * P_e, f_e = num_tokens_per_expert[e] / (T*k) (a constant,
//   no gradient), P_e = mean over tokens of scores[t,e]. z_loss = mean over tokens of
//   (logsumexp_e logits[t,e])^2. Both are 0 when T = 0. Returned in double.
// - Gradients flow through topk_w (and through P_e for lb_loss, through the logits for
//   z_loss) in every routing mode; the selected indices are piecewise constant and carry none.
// Checks (moe::Error naming the value): T >= 0, D > 0, E > 0, top_k in [1, E].
template <typename T>
RouterStats router_forward(const RouterParams& p, const T* x /*[T,D]*/, const T* w_gate /*[E,D]*/,
                           const float* expert_bias /*[E] or nullptr*/, T* logits /*[T,E]*/,
                           T* scores /*[T,E]*/, int32_t* topk_idx /*[T,k]*/, T* topk_w /*[T,k]*/,
                           int32_t* num_tokens_per_expert /*[E]*/);

// Backward of router_forward for the loss terms dL/dtopk_w, dlb * lb_loss and dz * z_loss:
// dx (+=) and dw_gate (+=). Takes the saved logits, scores, topk_idx and counts; allocates
// its own [T,E] scratch.
template <typename T>
void router_backward(const RouterParams& p, const T* x, const T* w_gate, const T* logits,
                     const T* scores, const int32_t* topk_idx, const int32_t* num_tokens_per_expert,
                     const T* dtopk_w /*[T,k]*/, T dlb /*dL/d lb_loss*/, T dz /*dL/d z_loss*/,
                     T* dx /*[T,D], += */, T* dw_gate /*[E,D], += */);

}  // namespace moe::cpu
