// The expert-parallel test cases, shared by the thread-rank and the MPI binaries. Each case
// names its EP size; it runs on any world whose size that EP size divides (world / ep EP groups,
// expert gradients summed over the ranks that hold the same experts). Cases cover top_k = 1,
// top_k = E/ep, top_k = E, all rows to one expert, ranks that send nothing to some peers, ranks
// with no tokens at all and experts that receive no tokens.
#pragma once

#include <gtest/gtest.h>

#include <numeric>

#include "ep_check.h"

namespace moe::testing {

// Small deterministic hash for hand-made routing.
inline uint64_t ep_hash(uint64_t a, uint64_t b) {
  uint64_t z = a * 0x9E3779B97F4A7C15ull + b + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Picks slot j's expert for token t from `allowed` (distinct over j: a shuffled prefix).
inline int32_t pick_distinct(const std::vector<int32_t>& allowed, int64_t t, int64_t j) {
  std::vector<int32_t> a = allowed;
  for (int64_t i = 0; i <= j; ++i) {
    const int64_t span = static_cast<int64_t>(a.size()) - i;
    std::swap(a[i], a[i + static_cast<int64_t>(ep_hash(t, i) % span)]);
  }
  return a[j];
}

// All rows to the last expert (top_k 1): every rank sends to one peer only; the other ranks'
// experts receive nothing.
inline LayerCase layer_all_to_one_expert(int64_t ep) {
  LayerCase c;
  c.name = "layer all rows to one expert, ep=" + std::to_string(ep);
  c.ep = ep;
  c.num_experts = 2 * ep;
  c.top_k = 1;
  c.tokens_of = [](int r) { return 5 + r; };
  const int32_t last = static_cast<int32_t>(c.num_experts - 1);
  c.route = [last](int, int64_t, int64_t) { return last; };
  return c;
}

// top_k = E/ep: every token of dp rank r goes to all experts of EP peer (r+1) % ep.
inline LayerCase layer_k_equals_local(int64_t ep) {
  LayerCase c;
  c.name = "layer top_k = E/ep to the next peer, ep=" + std::to_string(ep);
  c.ep = ep;
  c.num_experts = 2 * ep;
  c.top_k = 2;
  c.tokens_of = [](int r) { return 4 + 2 * r; };
  c.route = [ep](int r, int64_t t, int64_t j) {
    const int64_t peer = (r % ep + 1) % ep;
    return static_cast<int32_t>(2 * peer + ((t + j) % 2));
  };
  return c;
}

// top_k = E: every token visits every expert.
inline LayerCase layer_k_equals_experts(int64_t ep) {
  LayerCase c;
  c.name = "layer top_k = E, ep=" + std::to_string(ep);
  c.ep = ep;
  c.num_experts = ep == 4 ? 4 : 2 * ep;
  c.top_k = c.num_experts;
  c.tokens_of = [](int r) { return 3 + r; };
  const int64_t E = c.num_experts;
  c.route = [E](int, int64_t t, int64_t j) { return static_cast<int32_t>((t + j) % E); };
  return c;
}

// Uneven: 8 experts, top_k 2; dp rank 1 has no tokens; the first rank of each EP group sends only
// to its own experts 0 and 1; experts 2 and 5 get no tokens; token counts differ per rank.
inline LayerCase layer_uneven(int64_t ep) {
  LayerCase c;
  c.name = "layer uneven routing, ep=" + std::to_string(ep);
  c.ep = ep;
  c.num_experts = 8;
  c.top_k = 2;
  c.tokens_of = [](int r) { return r == 1 ? int64_t{0} : int64_t{3 + 2 * r}; };
  c.route = [ep](int r, int64_t t, int64_t j) {
    if (r % ep == 0) return pick_distinct({0, 1}, t, j);
    return pick_distinct({0, 1, 3, 4, 6, 7}, t, j);
  };
  return c;
}

inline std::vector<LayerCase> layer_cases(int64_t ep) {
  return {layer_all_to_one_expert(ep), layer_k_equals_local(ep), layer_k_equals_experts(ep), layer_uneven(ep)};
}

// Checks that the uneven case really is uneven on this rank (so the test covers what it claims).
inline void expect_layer_scenario(const LayerCase& c, const EpHandle& h, int world_rank) {
  if (c.name.rfind("layer uneven", 0) != 0) return;
  const int64_t L = c.num_experts / c.ep, local_rank = world_rank % c.ep;
  if (local_rank == 0) {
    for (int64_t p = 1; p < c.ep; ++p) EXPECT_EQ(h.num_rows_per_rank[p], 0) << "first EP rank sends to peer " << p;
  }
  for (int64_t p = 0; p < c.ep; ++p)
    for (int64_t j = 0; j < L; ++j) {
      const int64_t e = local_rank * L + j;
      if (e == 2 || e == 5) {
        EXPECT_EQ(h.num_recv_tokens_per_expert[p * L + j], 0) << "expert " << e;
      }
    }
}

inline ModelCase model_softmax_shared(int64_t ep) {
  ModelCase c;
  c.name = "model softmax, shared expert, E=4 top_k=2, ep=" + std::to_string(ep);
  c.m = ep_tiny_model();
  c.e = ep_tiny_moe(4, 2);
  c.e.shared_experts = 1;
  c.ep = ep;
  return c;
}

// top_k = E/ep with a sigmoid router and renormalised weights.
inline ModelCase model_sigmoid_k_local(int64_t ep) {
  ModelCase c;
  c.name = "model sigmoid, top_k = E/ep, ep=" + std::to_string(ep);
  c.m = ep_tiny_model();
  c.m.qk_norm = false;
  c.m.dense_layers = {};
  c.e = ep_tiny_moe(8, 8 / ep);
  c.e.router = "sigmoid";
  c.e.norm_topk_prob = true;
  c.ep = ep;
  c.batch_per_rank = 3;
  c.seq = 4;
  return c;
}

inline ModelCase model_top1(int64_t ep) {
  ModelCase c;
  c.name = "model top_k = 1, ep=" + std::to_string(ep);
  c.m = ep_tiny_model();
  c.e = ep_tiny_moe(2 * ep, 1);
  c.ep = ep;
  return c;
}

inline ModelCase model_random_routing(int64_t ep) {
  ModelCase c;
  c.name = "model random routing, E=8 top_k=3, ep=" + std::to_string(ep);
  c.m = ep_tiny_model();
  c.e = ep_tiny_moe(8, 3);
  c.e.routing = "random";
  c.ep = ep;
  c.routing_seed = 77;
  return c;
}

// Per-rank expert biases (selection only) that force uneven routing with 8 experts, top_k 2:
// dp rank r % 4 == 0 picks experts {0,1}, 1 picks {0,7}, 2 picks {1,6}, 3 avoids {4,5}; so
// experts 4 and 5 receive no tokens and the first rank of each EP group sends only to itself.
inline ModelCase model_biased_uneven(int64_t ep) {
  ModelCase c;
  c.name = "model uneven routing by expert bias, E=8 top_k=2, ep=" + std::to_string(ep);
  c.m = ep_tiny_model();
  c.e = ep_tiny_moe(8, 2);
  c.ep = ep;
  c.bias_of = [](int r, int64_t layers) {
    std::vector<float> b(8, 0.f);
    switch (r % 4) {
      case 0: b[0] = b[1] = 10.f; break;
      case 1: b[0] = b[7] = 10.f; break;
      case 2: b[1] = b[6] = 10.f; break;
      default: b[4] = b[5] = -10.f; break;
    }
    std::vector<float> all;
    for (int64_t l = 0; l < layers; ++l) all.insert(all.end(), b.begin(), b.end());
    return all;
  };
  return c;
}

inline std::vector<ModelCase> model_cases(int64_t ep) {
  return {model_softmax_shared(ep), model_sigmoid_k_local(ep), model_top1(ep), model_random_routing(ep),
          model_biased_uneven(ep)};
}

// For the biased case: experts 4 and 5 got no token of any rank; the first dp rank only used
// experts 0 and 1. Collective over world.
inline void expect_model_scenario(Comm& world, const ModelCase& c, const ModelCheck& r) {
  if (c.name.rfind("model uneven", 0) != 0) return;
  for (const auto& counts : r.tokens_per_expert) {
    std::vector<int64_t> total(counts.begin(), counts.end());
    world.all_reduce(total.data(), static_cast<int64_t>(total.size()), ReduceOp::kSum);
    EXPECT_EQ(total[4], 0);
    EXPECT_EQ(total[5], 0);
    if (world.rank() % 4 == 0) {
      EXPECT_EQ(counts[0] + counts[1], std::accumulate(counts.begin(), counts.end(), 0));
    }
  }
}

}  // namespace moe::testing
