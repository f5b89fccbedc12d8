// Whole-model checks: finite-difference gradients of every parameter in double for small
// configs that cover GQA, QK-norm, dense and MoE layers, shared experts and the routing
// extremes; bitwise determinism of the float model.
#include <cblas.h>

#include <cstring>

#include "model/layout.h"
#include "model/model.h"
#include "support/gradcheck.h"

namespace moe::testing {
namespace {

struct Case {
  std::string name;
  ModelConfig m;
  MoeConfig e;
  std::vector<float> bias;  // per MoE layer * E, selection only
};

ModelConfig tiny_model() {
  ModelConfig m;
  m.vocab_size = 11;
  m.d_model = 8;
  m.n_layers = 3;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.qk_norm = true;
  m.dense_layers = {1};
  m.dense_hidden = 10;
  m.init_std = 0.5;
  return m;
}

MoeConfig tiny_moe() {
  MoeConfig e;
  e.num_experts = 4;
  e.top_k = 2;
  e.expert_hidden = 6;
  e.shared_experts = 1;
  e.lb_loss_weight = 0.1;
  e.z_loss_weight = 0.01;
  return e;
}

void check_model(const Case& c, int64_t batch = 2, int64_t seq = 5) {
  Model<double> model(c.m, c.e);
  model.init_params(7);
  if (!c.bias.empty()) model.expert_bias() = c.bias;
  std::vector<int32_t> inputs(batch * seq), targets(batch * seq);
  for (int64_t i = 0; i < batch * seq; ++i) {
    inputs[i] = static_cast<int32_t>((i * 7 + 3) % c.m.vocab_size);
    targets[i] = static_cast<int32_t>((i * 5 + 1) % c.m.vocab_size);
  }
  targets[3] = -1;  // an ignored position
  LossScales scales{1.0 / double(batch * seq - 1), c.e.lb_loss_weight, c.e.z_loss_weight};

  model.zero_grads();
  const ForwardStats stats = model.forward(inputs.data(), targets.data(), batch, seq, 99);
  model.backward(scales);
  EXPECT_EQ(stats.num_targets, batch * seq - 1);
  for (const auto& counts : stats.tokens_per_expert) {
    int64_t total = 0;
    for (int32_t n : counts) total += n;
    EXPECT_EQ(total, batch * seq * c.e.top_k);
  }

  const int64_t total = model.layout().total_numel();
  std::vector<double> x(model.params(), model.params() + total);
  std::vector<double> g(model.grads(), model.grads() + total);
  auto loss = [&] {
    std::copy(x.begin(), x.end(), model.params());
    return scales.objective(model.forward(inputs.data(), targets.data(), batch, seq, 99));
  };
  for (const ParamEntry& p : model.layout().entries()) {
    std::vector<int64_t> idx(p.numel);
    for (int64_t i = 0; i < p.numel; ++i) idx[i] = p.offset + i;
    expect_grad_close(c.name + ":" + p.name, x, g, loss, kGradTol, 1e-6, idx);
  }
}

TEST(ModelGrad, GqaQkNormDenseSharedExpert) {
  check_model({"base", tiny_model(), tiny_moe(), {}});
}

TEST(ModelGrad, SigmoidRouterNormTopKNoQkNorm) {
  Case c{"sigmoid", tiny_model(), tiny_moe(), {}};
  c.m.qk_norm = false;
  c.m.n_kv_heads = 1;
  c.e.router = "sigmoid";
  c.e.norm_topk_prob = true;
  c.e.shared_experts = 0;
  check_model(c);
}

TEST(ModelGrad, AllTokensToOneExpertTopK1) {
  // A large selection bias on expert 2 sends every token there; the others get none.
  Case c{"one-expert", tiny_model(), tiny_moe(), {}};
  c.e.top_k = 1;
  c.bias.assign(2 * 4, 0.f);
  c.bias[2] = 100.f;
  c.bias[4 + 2] = 100.f;
  check_model(c);
}

TEST(ModelGrad, TopKEqualsNumExperts) {
  Case c{"topk-all", tiny_model(), tiny_moe(), {}};
  c.e.top_k = 4;
  c.e.norm_topk_prob = true;
  check_model(c);
}

TEST(ModelGrad, RandomAndUniformRouting) {
  Case r{"random", tiny_model(), tiny_moe(), {}};
  r.e.routing = "random";
  check_model(r);
  Case u{"uniform", tiny_model(), tiny_moe(), {}};
  u.e.routing = "uniform";
  u.e.top_k = 3;
  check_model(u, 1, 7);
}

TEST(ModelGrad, CapacityDropsRoutes) {
  // Capacity factor 1 with a bias towards expert 1: its overflow is dropped.
  Case c{"capacity", tiny_model(), tiny_moe(), {}};
  c.e.capacity_factor = 1.0;
  c.bias.assign(2 * 4, 0.f);
  c.bias[1] = 100.f;
  c.bias[4 + 1] = 100.f;
  check_model(c);
  Model<double> model(c.m, c.e);
  model.init_params(7);
  model.expert_bias() = c.bias;
  std::vector<int32_t> ids(10, 1);
  const ForwardStats s = model.forward(ids.data(), ids.data(), 2, 5);
  // Identical tokens choose the same two experts: 20 routes per layer, 10 per chosen expert,
  // capacity ceil(20 / 4) = 5, so each MoE layer drops 10 and the two layers 20 of 40.
  EXPECT_EQ(s.num_routes, 40);
  EXPECT_EQ(s.num_dropped, 20);
}

TEST(Model, DeterministicBitwise) {
  ModelConfig m = tiny_model();
  m.vocab_size = 64;
  m.d_model = 32;
  m.init_std = 0.02;
  MoeConfig e = tiny_moe();
  std::vector<int32_t> inputs(3 * 16), targets(3 * 16);
  for (size_t i = 0; i < inputs.size(); ++i) {
    inputs[i] = static_cast<int32_t>((i * 13 + 5) % 64);
    targets[i] = static_cast<int32_t>((i * 11 + 2) % 64);
  }
  auto run = [&](std::vector<float>& grads) {
    Model<float> model(m, e);
    model.init_params(42);
    model.zero_grads();
    ForwardStats s = model.forward(inputs.data(), targets.data(), 3, 16);
    model.backward({1.0 / 48, 0.01, 0.001});
    grads.assign(model.grads(), model.grads() + model.layout().total_numel());
    return s;
  };
  std::vector<float> g1, g2;
  const ForwardStats a = run(g1), b = run(g2);
  EXPECT_EQ(a.ce_sum, b.ce_sum);
  EXPECT_EQ(a.lb_loss, b.lb_loss);
  EXPECT_EQ(a.z_loss, b.z_loss);
  EXPECT_EQ(std::memcmp(g1.data(), g2.data(), g1.size() * sizeof(float)), 0);
  EXPECT_EQ(a.tokens_per_expert, b.tokens_per_expert);
}

TEST(Model, BlasThreadCountChangesOnlyRounding) {
  // OpenBLAS may split a GEMM's reduction differently with another thread count, so results
  // are bitwise reproducible for a fixed BLAS thread count only (docs/numerics.md).
  ModelConfig m = tiny_model();
  m.vocab_size = 256;
  m.d_model = 128;
  m.init_std = 0.02;
  MoeConfig e = tiny_moe();
  e.expert_hidden = 128;
  std::vector<int32_t> inputs(4 * 64), targets(4 * 64);
  for (size_t i = 0; i < inputs.size(); ++i) {
    inputs[i] = static_cast<int32_t>((i * 37 + 5) % 256);
    targets[i] = static_cast<int32_t>((i * 11 + 2) % 256);
  }
  auto run = [&](int threads, std::vector<float>& grads) {
    openblas_set_num_threads(threads);
    Model<float> model(m, e);
    model.init_params(3);
    model.zero_grads();
    ForwardStats s = model.forward(inputs.data(), targets.data(), 4, 64);
    model.backward({1.0 / 256, 0.01, 0.001});
    grads.assign(model.grads(), model.grads() + model.layout().total_numel());
    return s.ce_sum;
  };
  const int saved = openblas_get_num_threads();
  std::vector<float> g1, g1b, g2;
  const double l1 = run(1, g1), l1b = run(1, g1b), l2 = run(2, g2);
  openblas_set_num_threads(saved);
  EXPECT_EQ(l1, l1b);
  EXPECT_EQ(std::memcmp(g1.data(), g1b.data(), g1.size() * sizeof(float)), 0);
  EXPECT_NEAR(l1, l2, 1e-5 * std::abs(l1));
  double max_g = 0, max_diff = 0;
  for (size_t i = 0; i < g1.size(); ++i) {
    max_g = std::max(max_g, double(std::abs(g1[i])));
    max_diff = std::max(max_diff, double(std::abs(g1[i] - g2[i])));
  }
  EXPECT_LE(max_diff, 1e-4 * max_g);
}

TEST(Model, LayoutNamesAndCounts) {
  ModelConfig m = tiny_model();
  MoeConfig e = tiny_moe();
  const ParamLayout p = build_param_layout(m, e);
  EXPECT_TRUE(p.contains("model.layers.0.mlp.experts.gate_up_proj"));
  EXPECT_TRUE(p.contains("model.layers.1.mlp.gate_proj.weight"));
  EXPECT_FALSE(p.contains("model.layers.1.mlp.gate.weight"));
  EXPECT_EQ(p.find("model.layers.2.mlp.experts.down_proj").shape, (Shape{4, 8, 6}));
  EXPECT_FALSE(p.find("model.norm.weight").decay);
  const ModelCounts c = count_model(m, e, 5);
  EXPECT_EQ(c.total_params, p.param_count());
  EXPECT_EQ(c.total_params - c.active_params, 2 * (4 - 2) * 3 * 8 * 6);
}

// Gradient groups for the data-parallel overlap: embedding at 0, block l where its first tensor
// sits, the final norm and LM head last; every tensor of a group lies inside [start[g], start[g+1]).
TEST(Model, GradGroupStartsFollowTheLayout) {
  ModelConfig m = tiny_model();
  MoeConfig e = tiny_moe();
  const ParamLayout p = build_param_layout(m, e);
  const std::vector<int64_t> start = grad_group_starts(p, m.n_layers);
  ASSERT_EQ(start.size(), size_t(m.n_layers + 2));
  EXPECT_EQ(start[0], 0);
  for (int64_t l = 0; l < m.n_layers; ++l)
    EXPECT_EQ(start[size_t(l + 1)], p.find("model.layers." + std::to_string(l) + ".input_layernorm.weight").offset);
  EXPECT_EQ(start[size_t(m.n_layers + 1)], p.find("model.norm.weight").offset);
  for (const ParamEntry& t : p.entries()) {
    size_t g = 0;
    while (g + 1 < start.size() && start[g + 1] <= t.offset) ++g;
    const int64_t end = g + 1 < start.size() ? start[g + 1] : p.total_numel();
    EXPECT_LE(t.offset + t.numel, end) << t.name << " crosses into the next gradient group";
  }
  // A layout missing a group is refused, naming the group.
  ParamLayout partial;
  partial.add("model.embed_tokens.weight", {4, 2});
  partial.add("lm_head.weight", {4, 2});
  try {
    grad_group_starts(partial, 1);
    ADD_FAILURE() << "a layout without block 0 was accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("group 1"), std::string::npos) << err.what();
  }
}

}  // namespace
}  // namespace moe::testing
