// The small CPU models the block-level tests share (tests/e2e/model_blocks_test.cpp,
// tests/moe/recompute_test.cpp): a 4-layer model (d_model 16, 4 heads over 2 KV heads, QK-norm,
// layer 1 dense, 4 experts top-2, one shared expert) and its variants (capacity drops forced by
// the expert bias, random sigmoid routing without QK-norm); deterministic micro-batches; bitwise
// comparisons of vectors and forward statistics.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/config.h"
#include "model/model.h"

namespace moe::testing {

struct BlockCase {
  std::string name;
  ModelConfig m;
  MoeConfig e;
  std::vector<float> bias;  // [num_moe_layers * E]; empty: zeros
};

inline ModelConfig block_case_model(int64_t vocab) {
  ModelConfig m;
  m.vocab_size = vocab;
  m.d_model = 16;
  m.n_layers = 4;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.qk_norm = true;
  m.dense_layers = {1};
  m.dense_hidden = 20;
  m.init_std = 0.3;
  return m;
}

inline MoeConfig block_case_moe() {
  MoeConfig e;
  e.num_experts = 4;
  e.top_k = 2;
  e.expert_hidden = 12;
  e.shared_experts = 1;
  return e;
}

// The base model, a capacity-factor-1 variant whose bias makes expert 1 overflow in the first
// MoE layer (no shared expert), and random sigmoid routing without QK-norm (dense layers 0, 3).
inline std::vector<BlockCase> block_cases(int64_t vocab, const std::string& base_name, const std::string& cap_name,
                                          const std::string& random_name) {
  std::vector<BlockCase> out;
  out.push_back({base_name, block_case_model(vocab), block_case_moe(), {}});
  BlockCase cap{cap_name, block_case_model(vocab), block_case_moe(), {}};
  cap.e.capacity_factor = 1.0;
  cap.e.shared_experts = 0;
  cap.bias.assign(3 * 4, 0.f);
  cap.bias[1] = 0.5f;  // expert 1 overflows in the first MoE layer
  out.push_back(cap);
  BlockCase rnd{random_name, block_case_model(vocab), block_case_moe(), {}};
  rnd.m.qk_norm = false;
  rnd.m.n_kv_heads = 1;
  rnd.m.dense_layers = {0, 3};
  rnd.e.router = "sigmoid";
  rnd.e.norm_topk_prob = true;
  rnd.e.routing = "random";
  out.push_back(rnd);
  return out;
}

// One micro-batch: shape, tokens, routing seed (every sixth target ignored).
struct CaseBatch {
  int64_t batch, seq;
  uint64_t seed;
  std::vector<int32_t> inputs, targets;
};

inline CaseBatch make_case_batch(int64_t batch, int64_t seq, uint64_t seed, int64_t vocab) {
  CaseBatch b{batch, seq, seed, {}, {}};
  for (int64_t i = 0; i < batch * seq; ++i) {
    b.inputs.push_back(static_cast<int32_t>((i * 7 + 3 + seed + i / 4) % vocab));
    b.targets.push_back(i % 6 == 2 ? -1 : static_cast<int32_t>((i * 5 + 1 + seed) % vocab));
  }
  return b;
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

inline void expect_same_stats(const ForwardStats& a, const ForwardStats& b, const std::string& what) {
  EXPECT_EQ(std::memcmp(&a.ce_sum, &b.ce_sum, sizeof(double)), 0) << what << ": ce_sum " << a.ce_sum << " vs " << b.ce_sum;
  EXPECT_EQ(std::memcmp(&a.lb_loss, &b.lb_loss, sizeof(double)), 0) << what << ": lb_loss";
  EXPECT_EQ(std::memcmp(&a.z_loss, &b.z_loss, sizeof(double)), 0) << what << ": z_loss";
  EXPECT_EQ(a.num_targets, b.num_targets) << what;
  EXPECT_EQ(a.num_routes, b.num_routes) << what;
  EXPECT_EQ(a.num_dropped, b.num_dropped) << what;
  EXPECT_EQ(a.tokens_per_expert, b.tokens_per_expert) << what;
}

}  // namespace moe::testing
