// Router forward/backward on CPU. Backward: dscores collects dtopk_w (through the optional
// renormalisation w_j = s_j / S: ds_i = (g_i - sum_j g_j w_j) / S) and the lb term
// dlb * E * f_e / T; softmax maps it to dlogits = s * (ds - <ds, s>), sigmoid to ds * s(1-s);
// the z term adds dz * 2/T * lse_t * softmax(logits)_t; the gate linear then gives dx, dw_gate.
#include "cpu/router.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "cpu/linear.h"

namespace moe::cpu {
namespace {

void check_params(const RouterParams& p) {
  MOE_CHECK(p.num_tokens >= 0, "router: num_tokens must be >= 0, got ", p.num_tokens);
  MOE_CHECK(p.d_model > 0, "router: d_model must be > 0, got ", p.d_model);
  MOE_CHECK(p.num_experts > 0, "router: num_experts must be > 0, got ", p.num_experts);
  MOE_CHECK(p.top_k >= 1 && p.top_k <= p.num_experts, "router: top_k must be in [1, num_experts=",
            p.num_experts, "], got top_k=", p.top_k);
}

uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Counter-based hash of (seed, token, slot): no state, so any token can be routed alone.
uint64_t route_hash(uint64_t seed, uint64_t token, uint64_t slot) {
  return splitmix64(splitmix64(splitmix64(seed) ^ token) ^ slot);
}

// logsumexp of one row, max-subtracted.
template <typename T>
T row_logsumexp(const T* l, int64_t n) {
  const T m = *std::max_element(l, l + n);
  T s = 0;
  for (int64_t e = 0; e < n; ++e) s += std::exp(l[e] - m);
  return m + std::log(s);
}

}  // namespace

template <typename T>
RouterStats router_forward(const RouterParams& p, const T* x, const T* w_gate,
                           const float* expert_bias, T* logits, T* scores, int32_t* topk_idx,
                           T* topk_w, int32_t* num_tokens_per_expert) {
  check_params(p);
  const int64_t n = p.num_tokens, d = p.d_model, ne = p.num_experts, k = p.top_k;
  std::fill(num_tokens_per_expert, num_tokens_per_expert + ne, 0);
  RouterStats stats;
  if (n == 0) return stats;

  linear_forward(x, w_gate, logits, n, d, ne);

  for (int64_t t = 0; t < n; ++t) {
    const T* l = logits + t * ne;
    T* s = scores + t * ne;
    if (p.score == ScoreFunc::kSoftmax) {
      const T m = *std::max_element(l, l + ne);
      T sum = 0;
      for (int64_t e = 0; e < ne; ++e) sum += (s[e] = std::exp(l[e] - m));
      for (int64_t e = 0; e < ne; ++e) s[e] /= sum;
    } else {
      for (int64_t e = 0; e < ne; ++e) s[e] = T(1) / (T(1) + std::exp(-l[e]));
    }
  }

  std::vector<T> key(static_cast<size_t>(ne));
  std::vector<char> taken(static_cast<size_t>(ne));
  std::vector<int32_t> perm(static_cast<size_t>(ne));
  for (int64_t t = 0; t < n; ++t) {
    const T* s = scores + t * ne;
    int32_t* idx = topk_idx + t * k;
    switch (p.mode) {
      case RoutingMode::kLearned: {
        for (int64_t e = 0; e < ne; ++e) key[e] = s[e] + (expert_bias ? T(expert_bias[e]) : T(0));
        std::fill(taken.begin(), taken.end(), 0);
        for (int64_t j = 0; j < k; ++j) {
          int64_t best = -1;
          for (int64_t e = 0; e < ne; ++e)  // strict '>' in ascending e: ties keep the lowest index
            if (!taken[e] && (best < 0 || key[e] > key[best])) best = e;
          taken[best] = 1;
          idx[j] = static_cast<int32_t>(best);
        }
        break;
      }
      case RoutingMode::kRandom: {
        std::iota(perm.begin(), perm.end(), 0);
        for (int64_t j = 0; j < k; ++j) {
          const uint64_t span = static_cast<uint64_t>(ne - j);
          const int64_t r = j + static_cast<int64_t>(route_hash(p.seed, t, j) % span);
          std::swap(perm[j], perm[r]);
          idx[j] = perm[j];
        }
        break;
      }
      case RoutingMode::kUniform:
        for (int64_t j = 0; j < k; ++j) idx[j] = static_cast<int32_t>((t * k + j) % ne);
        break;
    }
    T* w = topk_w + t * k;
    T sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      w[j] = s[idx[j]];
      sum += w[j];
      ++num_tokens_per_expert[idx[j]];
    }
    if (p.norm_topk)
      for (int64_t j = 0; j < k; ++j) w[j] /= sum;
  }

  // Losses in double whatever T is.
  double lb = 0;
  for (int64_t e = 0; e < ne; ++e) {
    double pe = 0;
    for (int64_t t = 0; t < n; ++t) pe += static_cast<double>(scores[t * ne + e]);
    pe /= static_cast<double>(n);
    const double fe = static_cast<double>(num_tokens_per_expert[e]) / static_cast<double>(n * k);
    lb += fe * pe;
  }
  stats.lb_loss = static_cast<double>(ne) * lb;
  double z = 0;
  for (int64_t t = 0; t < n; ++t) {
    const double lse = static_cast<double>(row_logsumexp(logits + t * ne, ne));
    z += lse * lse;
  }
  stats.z_loss = z / static_cast<double>(n);
  return stats;
}

template <typename T>
void router_backward(const RouterParams& p, const T* x, const T* w_gate, const T* logits,
                     const T* scores, const int32_t* topk_idx, const int32_t* num_tokens_per_expert,
                     const T* dtopk_w, T dlb, T dz, T* dx, T* dw_gate) {
  check_params(p);
  const int64_t n = p.num_tokens, d = p.d_model, ne = p.num_experts, k = p.top_k;
  if (n == 0) return;

  std::vector<T> dlogits(static_cast<size_t>(n * ne));
  std::vector<T> lb_grad(static_cast<size_t>(ne));  // dlb * d lb / d scores[t,e], same for all t
  for (int64_t e = 0; e < ne; ++e)
    lb_grad[e] = dlb * T(ne) * (T(num_tokens_per_expert[e]) / T(n * k)) / T(n);

  for (int64_t t = 0; t < n; ++t) {
    const T* l = logits + t * ne;
    const T* s = scores + t * ne;
    const int32_t* idx = topk_idx + t * k;
    const T* g = dtopk_w + t * k;
    T* ds = dlogits.data() + t * ne;  // holds dscores first, then becomes dlogits in place
    for (int64_t e = 0; e < ne; ++e) ds[e] = lb_grad[e];
    if (p.norm_topk) {
      T sum = 0;
      for (int64_t j = 0; j < k; ++j) sum += s[idx[j]];
      T gw = 0;  // sum_j g_j * w_j with w_j = s_j / sum
      for (int64_t j = 0; j < k; ++j) gw += g[j] * s[idx[j]] / sum;
      for (int64_t j = 0; j < k; ++j) ds[idx[j]] += (g[j] - gw) / sum;
    } else {
      for (int64_t j = 0; j < k; ++j) ds[idx[j]] += g[j];
    }
    if (p.score == ScoreFunc::kSoftmax) {
      T dot = 0;
      for (int64_t e = 0; e < ne; ++e) dot += ds[e] * s[e];
      for (int64_t e = 0; e < ne; ++e) ds[e] = s[e] * (ds[e] - dot);
    } else {
      for (int64_t e = 0; e < ne; ++e) ds[e] = ds[e] * s[e] * (T(1) - s[e]);
    }
    if (dz != T(0)) {
      const T lse = row_logsumexp(l, ne);
      const T c = dz * T(2) / T(n) * lse;
      for (int64_t e = 0; e < ne; ++e) ds[e] += c * std::exp(l[e] - lse);
    }
  }
  linear_backward(x, w_gate, dlogits.data(), dx, dw_gate, n, d, ne, /*accumulate_dx=*/true);
}

template RouterStats router_forward<float>(const RouterParams&, const float*, const float*,
                                           const float*, float*, float*, int32_t*, float*, int32_t*);
template RouterStats router_forward<double>(const RouterParams&, const double*, const double*,
                                            const float*, double*, double*, int32_t*, double*,
                                            int32_t*);
template void router_backward<float>(const RouterParams&, const float*, const float*, const float*,
                                     const float*, const int32_t*, const int32_t*, const float*,
                                     float, float, float*, float*);
template void router_backward<double>(const RouterParams&, const double*, const double*,
                                      const double*, const double*, const int32_t*, const int32_t*,
                                      const double*, double, double, double*, double*);

}  // namespace moe::cpu
