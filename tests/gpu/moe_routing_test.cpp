// cuda MoE routing against the CPU reference ops on the same inputs: router forward (indices and
// counts exact; scores, weights, score sums and losses within FP32 tolerance) and backward
// (dlogits), the dispatch map (exact, dropless and with capacity), permute / unpermute forward
// and backward (bit-exact on integer-valued BF16, within BF16 rounding on real values), guard
// bytes around every output, and a CUDA-graph capture of the routing forward and backward
// replayed with new inputs (no host synchronisation inside).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu/capacity.h"
#include "cpu/dispatch.h"
#include "cpu/router.h"
#include "cuda/ops/fp8.h"
#include "cuda/ops/memory.h"
#include "cuda/ops/moe_routing.h"
#include "gpu/gpu_test_util.h"
#include "support/parity.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

using cpu::RoutingMode;
using cpu::ScoreFunc;

constexpr uint64_t kRandomRoutingSeed = 77;

// ---------------------------------------------------------------------------------------------
// Comparison and buffer helpers

template <typename T>
std::string value_str(T v) {
  std::ostringstream os;
  if constexpr (std::is_same_v<T, uint16_t>) {
    os << moe::bf16_to_f32(v) << " (bf16 0x" << std::hex << v << ")";
  } else {
    os << v;
  }
  return os.str();
}

// Bitwise equality of every element; the failure names the first mismatch (as row/column when
// row_len > 0) and how many elements differ.
template <typename T>
void expect_identical(const std::string& what, const std::vector<T>& got, const std::vector<T>& ref,
                      int64_t row_len = 0) {
  ASSERT_EQ(got.size(), ref.size()) << what << ": result and reference sizes differ";
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &ref[i], sizeof(T)) != 0) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  }
  std::printf("exact %s: n=%zu bad=%lld\n", what.c_str(), got.size(), static_cast<long long>(bad));
  if (bad == 0) return;
  std::ostringstream os;
  os << what << ": " << bad << " of " << got.size() << " elements differ; first at index " << first;
  if (row_len > 0) os << " (row " << first / row_len << ", column " << first % row_len << ")";
  os << ": got " << value_str(got[first]) << ", reference " << value_str(ref[first]);
  ADD_FAILURE() << os.str();
}

// Fills an output's data region with 0x5A bytes, a pattern no op writes (-1, the "dropped"
// marker, is what the default 0xFF fill would read as in int32).
template <typename T>
void poison(GuardedBuffer<T>& b) {
  if (b.bytes() > 0) MOE_CUDA_CHECK(cudaMemset(b.data(), 0x5A, b.bytes()));
}

std::vector<float> widen(const std::vector<uint16_t>& b) { return bf16_to_f32(b); }

std::vector<uint16_t> narrow(const std::vector<float>& f) {
  std::vector<uint16_t> b(f.size());
  for (size_t i = 0; i < f.size(); ++i) b[i] = f32_to_bf16(f[i]);
  return b;
}

// Integers in [lo, hi]: every copy and every small sum of products is exact in BF16 and FP32.
std::vector<float> integer_values(int64_t n, int lo, int hi, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(lo + static_cast<int>(gen() % static_cast<uint64_t>(hi - lo + 1)));
  return v;
}

// ---------------------------------------------------------------------------------------------
// Router inputs. Logits lie on a grid of 1/8 in [-4, 4] (and every 97th token is a row of equal
// logits), so equal logits are frequent and distinct ones give clearly distinct scores; a token
// is redrawn until every adjacent pair of its top k+1 keys is either an exact tie (same logit and
// same bias: the same bits on both backends) or more than 1e-5 apart relative to their size, so
// FP32 rounding cannot reorder the selection.

enum class BiasKind { kNone, kGrid, kSkewed };

struct RouterCase {
  int64_t T, E, k;
  ScoreFunc score;
  bool norm;
  RoutingMode mode;
  BiasKind bias;
};

std::string router_case_name(const RouterCase& c) {
  std::string n = "T" + std::to_string(c.T) + "_E" + std::to_string(c.E) + "_k" + std::to_string(c.k) + "_";
  n += c.score == ScoreFunc::kSoftmax ? "softmax" : "sigmoid";
  if (c.norm) n += "_norm";
  n += c.mode == RoutingMode::kLearned ? "" : c.mode == RoutingMode::kRandom ? "_random" : "_uniform";
  n += c.bias == BiasKind::kNone ? "" : c.bias == BiasKind::kGrid ? "_gridbias" : "_skewbias";
  return n;
}

// kGrid: multiples of 1/16 in [-1/4, 1/4]. kSkewed adds +10 on expert 3 (every token's slot 0:
// with k = 1 all tokens go to it) and -10 on the last two experts (no tokens while k <= E - 2).
std::vector<float> make_bias(const RouterCase& c, uint64_t seed) {
  if (c.bias == BiasKind::kNone) return {};
  std::mt19937_64 gen(seed);
  std::vector<float> b(static_cast<size_t>(c.E));
  for (auto& v : b) v = static_cast<float>(static_cast<int>(gen() % 9) - 4) / 16.f;
  if (c.bias == BiasKind::kSkewed) {
    b[3 % c.E] = 10.f;
    if (c.E > 4) b[c.E - 1] = b[c.E - 2] = -10.f;
  }
  return b;
}

bool selection_is_robust(const float* l, const std::vector<float>& bias, int64_t E, int64_t k, ScoreFunc score) {
  std::vector<double> s(E), key(E);
  const double m = *std::max_element(l, l + E);
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(l[e]) - m);
  for (int64_t e = 0; e < E; ++e) {
    s[e] = score == ScoreFunc::kSoftmax ? std::exp(static_cast<double>(l[e]) - m) / sum
                                        : 1.0 / (1.0 + std::exp(-static_cast<double>(l[e])));
    key[e] = s[e] + (bias.empty() ? 0.0 : static_cast<double>(bias[e]));
  }
  std::vector<int64_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return key[a] > key[b]; });
  for (int64_t p = 0; p < std::min(k, E - 1); ++p) {
    const int64_t a = order[p], b = order[p + 1];
    const bool same = l[a] == l[b] && (bias.empty() || bias[a] == bias[b]);
    if (same) continue;
    const double scale = std::max({std::abs(key[a]), std::abs(key[b]), s[a], s[b]});
    if (key[a] - key[b] <= 1e-5 * scale) return false;
  }
  return true;
}

std::vector<float> draw_logits(const RouterCase& c, const std::vector<float>& bias, uint64_t seed) {
  std::vector<float> logits(static_cast<size_t>(c.T * c.E));
  for (int64_t t = 0; t < c.T; ++t) {
    float* row = logits.data() + t * c.E;
    for (uint64_t attempt = 0;; ++attempt) {
      std::mt19937_64 gen(seed * 1000003 + static_cast<uint64_t>(t) * 7919 + attempt);
      if (t % 97 == 5) {
        std::fill(row, row + c.E, static_cast<float>(static_cast<int>(gen() % 9) - 4) / 8.f);
      } else {
        for (int64_t e = 0; e < c.E; ++e) row[e] = static_cast<float>(static_cast<int>(gen() % 65) - 32) / 8.f;
      }
      if (c.mode != RoutingMode::kLearned || selection_is_robust(row, bias, c.E, c.k, c.score)) break;
      if (attempt > 500) {
        ADD_FAILURE() << "could not draw a robust selection for token " << t;
        break;
      }
    }
  }
  return logits;
}

cpu::RouterParams cpu_params(const RouterCase& c) {
  cpu::RouterParams p;
  p.num_tokens = c.T;
  p.d_model = c.E;  // identity gate: logits = x @ I^T = x, exactly
  p.num_experts = c.E;
  p.top_k = c.k;
  p.score = c.score;
  p.norm_topk = c.norm;
  p.mode = c.mode;
  p.seed = kRandomRoutingSeed;
  return p;
}

cuda::RouterParams gpu_params(const RouterCase& c) {
  cuda::RouterParams p;
  p.num_tokens = c.T;
  p.num_experts = c.E;
  p.top_k = c.k;
  p.score = c.score;
  p.norm_topk = c.norm;
  p.mode = c.mode;
  p.seed = kRandomRoutingSeed;
  return p;
}

std::vector<float> identity(int64_t n) {
  std::vector<float> eye(static_cast<size_t>(n * n), 0.f);
  for (int64_t i = 0; i < n; ++i) eye[i * n + i] = 1.f;
  return eye;
}

struct RouterRef {
  std::vector<float> scores, topk_w, score_sum, losses;
  std::vector<int32_t> idx, counts;
};

// cpu::router_forward<float> on these exact logits (x = logits, w_gate = identity).
RouterRef cpu_router(const RouterCase& c, const std::vector<float>& logits, const std::vector<float>& bias) {
  const auto p = cpu_params(c);
  RouterRef r;
  std::vector<float> logits_out(logits.size());
  r.scores.resize(c.T * c.E);
  r.topk_w.resize(c.T * c.k);
  r.idx.resize(c.T * c.k);
  r.counts.resize(c.E);
  const auto eye = identity(c.E);
  const cpu::RouterStats st =
      cpu::router_forward<float>(p, logits.data(), eye.data(), bias.empty() ? nullptr : bias.data(),
                                 logits_out.data(), r.scores.data(), r.idx.data(), r.topk_w.data(), r.counts.data());
  EXPECT_EQ(std::memcmp(logits_out.data(), logits.data(), logits.size() * sizeof(float)), 0)
      << "the identity gate must reproduce the logits bit for bit";
  std::vector<double> sum(c.E, 0.0);
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t e = 0; e < c.E; ++e) sum[e] += r.scores[t * c.E + e];
  r.score_sum.assign(sum.begin(), sum.end());
  r.losses = {static_cast<float>(st.lb_loss), static_cast<float>(st.z_loss)};
  return r;
}

// Everything router_forward writes, poisoned so an element it forgets is caught.
struct GpuRouter {
  cuda::RouterParams p;
  GuardedBuffer<float> scores, topk_w, score_sum, losses;
  GuardedBuffer<int32_t> idx, counts;
  GuardedBuffer<uint8_t> workspace;

  explicit GpuRouter(const cuda::RouterParams& params)
      : p(params),
        scores(p.num_tokens * p.num_experts),
        topk_w(p.num_tokens * p.top_k),
        score_sum(p.num_experts),
        losses(2),
        idx(p.num_tokens * p.top_k),
        counts(p.num_experts),
        workspace(static_cast<int64_t>(cuda::router_workspace_bytes(params))) {
    poison(idx);
    poison(counts);
  }
  void run(const float* logits, const float* bias, cudaStream_t stream) {
    cuda::router_forward(p, logits, bias, scores.data(), idx.data(), topk_w.data(), counts.data(),
                         score_sum.data(), losses.data(), workspace.data(), workspace.bytes(), stream);
  }
  void expect_guards_intact() const {
    scores.expect_guards_intact("scores");
    topk_w.expect_guards_intact("topk_w");
    score_sum.expect_guards_intact("score_sum");
    losses.expect_guards_intact("losses");
    idx.expect_guards_intact("topk_idx");
    counts.expect_guards_intact("num_tokens_per_expert");
    workspace.expect_guards_intact("router workspace");
  }
};

class MoeRouterGpu : public ::testing::TestWithParam<RouterCase> {};

TEST_P(MoeRouterGpu, ForwardMatchesCpu) {
  MOE_SKIP_WITHOUT_GPU();
  const RouterCase c = GetParam();
  const auto bias = make_bias(c, 17);
  const auto logits = draw_logits(c, bias, 23);
  const RouterRef ref = cpu_router(c, logits, bias);

  GuardedBuffer<float> d_logits(logits), d_bias(bias);
  GpuRouter out(gpu_params(c));
  TestStream stream;
  out.run(d_logits.data(), bias.empty() ? nullptr : d_bias.data(), stream.get());
  stream.sync();

  expect_identical("router.topk_idx", out.idx.download(), ref.idx, c.k);
  expect_identical("router.num_tokens_per_expert", out.counts.download(), ref.counts);
  // Scores and weights: a softmax row sum in another order and the GPU's expf (<= 2 ulp).
  expect_parity("router.scores", out.scores.download(), ref.scores, kFP32Reduction);
  expect_parity("router.topk_w", out.topk_w.download(), ref.topk_w, kFP32Reduction);
  expect_parity("router.score_sum", out.score_sum.download(), ref.score_sum, kFP32Reduction);
  expect_parity("router.losses", out.losses.download(), ref.losses, kFP32Reduction);
  out.expect_guards_intact();
  d_logits.expect_guards_intact("logits");
}

TEST_P(MoeRouterGpu, BackwardMatchesCpu) {
  MOE_SKIP_WITHOUT_GPU();
  const RouterCase c = GetParam();
  const auto bias = make_bias(c, 31);
  const auto logits = draw_logits(c, bias, 37);
  const RouterRef fwd = cpu_router(c, logits, bias);
  const auto dtopk_w = random_f32(c.T * c.k, 41);
  const float dlb = 0.7f, dz = 0.3f;
  // CPU: with the identity gate, dx = dlogits @ I = dlogits exactly (dw_gate skipped).
  auto cpu_dlogits = [&](float a, float b) {
    std::vector<float> dx(static_cast<size_t>(c.T * c.E), 0.f);
    const auto eye = identity(c.E);
    cpu::router_backward<float>(cpu_params(c), logits.data(), eye.data(), logits.data(), fwd.scores.data(),
                                fwd.idx.data(), fwd.counts.data(), dtopk_w.data(), a, b, dx.data(), nullptr);
    return dx;
  };
  GuardedBuffer<float> d_logits(logits), d_scores(fwd.scores), d_dtopk(dtopk_w), d_dlb(std::vector<float>{dlb}),
      d_dz(std::vector<float>{dz}), d_dlogits(c.T * c.E);
  GuardedBuffer<int32_t> d_idx(fwd.idx), d_counts(fwd.counts);
  TestStream stream;
  const auto p = gpu_params(c);
  cuda::router_backward(p, d_logits.data(), d_scores.data(), d_idx.data(), d_counts.data(), d_dtopk.data(),
                        d_dlb.data(), d_dz.data(), d_dlogits.data(), stream.get());
  stream.sync();
  expect_parity("router.dlogits", d_dlogits.download(), cpu_dlogits(dlb, dz), kFP32Reduction);
  // Null loss scalars mean 0: only the dtopk_w term remains.
  cuda::router_backward(p, d_logits.data(), d_scores.data(), d_idx.data(), d_counts.data(), d_dtopk.data(),
                        nullptr, nullptr, d_dlogits.data(), stream.get());
  stream.sync();
  expect_parity("router.dlogits.no_loss_terms", d_dlogits.download(), cpu_dlogits(0.f, 0.f), kFP32Reduction);
  d_dlogits.expect_guards_intact("dlogits");
}

constexpr auto kSoftmax = ScoreFunc::kSoftmax;
constexpr auto kSigmoid = ScoreFunc::kSigmoid;
constexpr auto kLearned = RoutingMode::kLearned;
constexpr auto kRandom = RoutingMode::kRandom;
constexpr auto kUniform = RoutingMode::kUniform;

INSTANTIATE_TEST_SUITE_P(
    Shapes, MoeRouterGpu,
    ::testing::Values(RouterCase{1, 8, 1, kSoftmax, false, kLearned, BiasKind::kNone},
                      RouterCase{1, 8, 8, kSigmoid, true, kLearned, BiasKind::kGrid},
                      RouterCase{3, 1, 1, kSoftmax, false, kLearned, BiasKind::kNone},
                      RouterCase{4097, 8, 2, kSoftmax, false, kLearned, BiasKind::kNone},
                      RouterCase{4097, 64, 8, kSoftmax, true, kLearned, BiasKind::kGrid},
                      RouterCase{4097, 128, 4, kSigmoid, false, kLearned, BiasKind::kGrid},
                      RouterCase{1000, 16, 16, kSoftmax, true, kLearned, BiasKind::kNone},
                      RouterCase{257, 256, 16, kSoftmax, false, kLearned, BiasKind::kNone},
                      RouterCase{300, 256, 16, kSigmoid, true, kLearned, BiasKind::kGrid},
                      RouterCase{4097, 64, 1, kSigmoid, false, kLearned, BiasKind::kSkewed},
                      RouterCase{1025, 64, 6, kSoftmax, true, kLearned, BiasKind::kSkewed},
                      RouterCase{65536, 128, 8, kSoftmax, false, kLearned, BiasKind::kNone},
                      RouterCase{4097, 64, 8, kSoftmax, false, kRandom, BiasKind::kGrid},
                      RouterCase{333, 256, 16, kSigmoid, true, kRandom, BiasKind::kNone},
                      RouterCase{5, 8, 8, kSoftmax, false, kRandom, BiasKind::kNone},
                      RouterCase{4097, 64, 8, kSigmoid, true, kUniform, BiasKind::kNone},
                      RouterCase{7, 5, 2, kSoftmax, false, kUniform, BiasKind::kNone}),
    [](const auto& info) { return router_case_name(info.param); });

// Random routing from a seed in device memory (the CUDA-graph path): the same experts as the host
// seed layer_routing_seed(value, layer), and the same experts as the CPU router with that seed.
TEST(MoeRouterGpuEdge, DeviceSeedRoutesAsItsHostValue) {
  MOE_SKIP_WITHOUT_GPU();
  const RouterCase c{1000, 64, 8, ScoreFunc::kSoftmax, false, RoutingMode::kRandom, BiasKind::kNone};
  const auto logits = draw_logits(c, {}, 5);
  GuardedBuffer<float> d_logits(logits);
  TestStream stream;
  for (const uint64_t value : {uint64_t(0), uint64_t(12345), ~uint64_t(0)}) {
    for (const uint64_t layer : {uint64_t(0), uint64_t(3)}) {
      GuardedBuffer<uint64_t> d_seed(std::vector<uint64_t>{value});
      cuda::RouterParams dev = gpu_params(c);
      dev.seed = 999;  // not used when seed_device is set
      dev.seed_device = d_seed.data();
      dev.seed_layer = layer;
      cuda::RouterParams host = gpu_params(c);
      host.seed = layer_routing_seed(value, layer);
      GpuRouter a(dev), b(host);
      a.run(d_logits.data(), nullptr, stream.get());
      b.run(d_logits.data(), nullptr, stream.get());
      stream.sync();
      const std::string what = "seed " + std::to_string(value) + " layer " + std::to_string(layer);
      EXPECT_EQ(a.idx.download(), b.idx.download()) << what;
      EXPECT_EQ(a.counts.download(), b.counts.download()) << what;
      cpu::RouterParams cp = cpu_params(c);
      cp.seed = host.seed;
      std::vector<float> lo(logits.size()), sc(logits.size()), w(size_t(c.T * c.k));
      std::vector<int32_t> idx(size_t(c.T * c.k)), counts(size_t(c.E));
      const auto eye = identity(c.E);
      cpu::router_forward<float>(cp, logits.data(), eye.data(), nullptr, lo.data(), sc.data(), idx.data(), w.data(),
                                 counts.data());
      EXPECT_EQ(a.idx.download(), idx) << what << " vs the CPU router";
    }
  }
}

TEST(MoeRouterGpuEdge, EmptyBatchWritesZeros) {
  MOE_SKIP_WITHOUT_GPU();
  cuda::RouterParams p;
  p.num_tokens = 0;
  p.num_experts = 8;
  p.top_k = 2;
  GpuRouter out(p);
  TestStream stream;
  out.run(nullptr, nullptr, stream.get());
  EXPECT_NO_THROW(cuda::router_backward(p, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                        stream.get()));
  stream.sync();
  expect_identical("router.empty.counts", out.counts.download(), std::vector<int32_t>(8, 0));
  expect_identical("router.empty.score_sum", out.score_sum.download(), std::vector<float>(8, 0.f));
  expect_identical("router.empty.losses", out.losses.download(), std::vector<float>(2, 0.f));
  out.expect_guards_intact();
}

// Host-side argument checks: no device needed, nothing is launched.
TEST(MoeRouterGpuEdge, RejectsUnsupportedShapes) {
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const moe::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  auto params = [](int64_t t, int64_t e, int64_t k) {
    cuda::RouterParams p;
    p.num_tokens = t;
    p.num_experts = e;
    p.top_k = k;
    return p;
  };
  const std::string many = message([&] { cuda::router_workspace_bytes(params(4, 257, 2)); });
  EXPECT_NE(many.find("num_experts must be in [1, 256]"), std::string::npos) << many;
  EXPECT_NE(many.find("got 257"), std::string::npos) << many;
  const std::string big_k = message([&] { cuda::router_workspace_bytes(params(4, 64, 17)); });
  EXPECT_NE(big_k.find("top_k=17"), std::string::npos) << big_k;
  const std::string k_over_e = message([&] {
    cuda::router_forward(params(4, 4, 5), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                         nullptr, 0, nullptr);
  });
  EXPECT_NE(k_over_e.find("num_experts=4"), std::string::npos) << k_over_e;
  const std::string null_out = message([&] {
    cuda::router_forward(params(4, 8, 2), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                         nullptr, 0, nullptr);
  });
  EXPECT_NE(null_out.find("num_tokens_per_expert"), std::string::npos) << null_out;
  // Workspace sizes are checked before anything is launched (these pointers are never used).
  alignas(16) static int32_t host_words[16];
  const std::string small_ws = message([&] {
    cuda::router_forward(params(4, 8, 2), nullptr, nullptr, nullptr, nullptr, nullptr, host_words, nullptr,
                         reinterpret_cast<float*>(host_words), host_words, 4, nullptr);
  });
  EXPECT_NE(small_ws.find("workspace of 4 bytes is too small, need " +
                          std::to_string(cuda::router_workspace_bytes(params(4, 8, 2)))),
            std::string::npos)
      << small_ws;
  const std::string small_map_ws = message([&] {
    cuda::build_dispatch_map(host_words, 4, 2, 8, 0, host_words, host_words, host_words, host_words, nullptr,
                             host_words, 0, nullptr);
  });
  EXPECT_NE(small_map_ws.find("dispatch_map_workspace_bytes(4, 2, 8)"), std::string::npos) << small_map_ws;
  const std::string negative = message([&] { cuda::dispatch_map_workspace_bytes(-1, 2, 8); });
  EXPECT_NE(negative.find("num_tokens must be >= 0, got -1"), std::string::npos) << negative;
  const std::string map_k = message([&] { cuda::dispatch_map_workspace_bytes(10, 9, 8); });
  EXPECT_NE(map_k.find("top_k=9"), std::string::npos) << map_k;
  const std::string rows = message([&] {
    cuda::permute_forward(nullptr, nullptr, nullptr, int64_t{1} << 30, 8, 64, nullptr, nullptr);
  });
  EXPECT_NE(rows.find("do not fit int32"), std::string::npos) << rows;
  const std::string null_rows = message([&] { cuda::unpermute_forward(nullptr, nullptr, nullptr, 4, 2, 8, nullptr, nullptr); });
  EXPECT_NE(null_rows.find("'y_sorted'"), std::string::npos) << null_rows;
}

// ---------------------------------------------------------------------------------------------
// Dispatch map

enum class RoutePattern { kRandom, kSkewed, kAllToOne };

struct MapCase {
  int64_t T, E, k;
  RoutePattern pattern;
  double capacity_factor;  // 0: dropless
};

std::string map_case_name(const MapCase& c) {
  std::string n = "T" + std::to_string(c.T) + "_E" + std::to_string(c.E) + "_k" + std::to_string(c.k);
  n += c.pattern == RoutePattern::kRandom ? "_random" : c.pattern == RoutePattern::kSkewed ? "_skewed" : "_alltoone";
  if (c.capacity_factor > 0) n += "_cap" + std::to_string(static_cast<int>(c.capacity_factor * 100));
  return n;
}

// k distinct experts per token. kRandom: uniform. kSkewed: from the even experts only (or all
// when k exceeds them), expert 2i drawn with weight 1/(i+1), so odd experts stay empty and the
// load is uneven. kAllToOne: every token takes experts E-1, 0, 1, ..., k-2 in that slot order.
std::vector<int32_t> draw_routes(int64_t T, int64_t E, int64_t k, RoutePattern pattern, uint64_t seed) {
  std::vector<int32_t> idx(static_cast<size_t>(T * k));
  std::mt19937_64 gen(seed);
  std::vector<int32_t> pool;
  if (pattern == RoutePattern::kSkewed && k <= (E + 1) / 2) {
    for (int32_t e = 0; e < E; e += 2) pool.push_back(e);
  } else {
    pool.resize(E);
    std::iota(pool.begin(), pool.end(), 0);
  }
  std::vector<double> weight(pool.size());
  for (size_t i = 0; i < pool.size(); ++i) weight[i] = pattern == RoutePattern::kSkewed ? 1.0 / (i + 1.0) : 1.0;
  for (int64_t t = 0; t < T; ++t) {
    int32_t* row = idx.data() + t * k;
    if (pattern == RoutePattern::kAllToOne) {
      for (int64_t j = 0; j < k; ++j) row[j] = static_cast<int32_t>(j == 0 ? E - 1 : j - 1);
      continue;
    }
    std::vector<double> w = weight;
    for (int64_t j = 0; j < k; ++j) {  // weighted draw without replacement
      std::discrete_distribution<size_t> dist(w.begin(), w.end());
      const size_t i = dist(gen);
      row[j] = pool[i];
      w[i] = 0.0;
    }
  }
  return idx;
}

int64_t capacity_of(double factor, int64_t T, int64_t k, int64_t E) {
  return factor > 0 ? cpu::expert_capacity(factor, T, k, E) : 0;
}

struct MapRef {
  std::vector<int32_t> counts, offsets, sorted_route, route_to_row;
  int32_t dropped = 0;
};

// cpu::build_dispatch_map, then cpu::apply_capacity when capacity > 0.
MapRef cpu_map(const std::vector<int32_t>& idx, int64_t T, int64_t k, int64_t E, int64_t capacity) {
  MapRef m;
  m.counts.resize(E);
  m.offsets.resize(E + 1);
  m.sorted_route.resize(T * k);
  m.route_to_row.resize(T * k);
  cpu::build_dispatch_map(idx.data(), T, k, E, m.counts.data(), m.offsets.data(), m.sorted_route.data(),
                          m.route_to_row.data());
  if (capacity > 0) {
    std::vector<int32_t> kept(E);
    m.dropped = static_cast<int32_t>(cpu::apply_capacity(capacity, T, k, E, m.offsets.data(), m.sorted_route.data(),
                                                         m.route_to_row.data(), kept.data()));
  }
  return m;
}

struct GpuMap {
  int64_t T, k, E;
  GuardedBuffer<int32_t> counts, offsets, sorted_route, route_to_row, dropped;
  GuardedBuffer<uint8_t> workspace;

  GpuMap(int64_t t, int64_t topk, int64_t e)
      : T(t), k(topk), E(e), counts(e), offsets(e + 1), sorted_route(t * topk), route_to_row(t * topk), dropped(1),
        workspace(static_cast<int64_t>(cuda::dispatch_map_workspace_bytes(t, topk, e))) {
    poison(counts);
    poison(offsets);
    poison(sorted_route);
    poison(route_to_row);
    poison(dropped);
  }
  void run(const int32_t* topk_idx, int64_t capacity, cudaStream_t stream) {
    cuda::build_dispatch_map(topk_idx, T, k, E, capacity, counts.data(), offsets.data(), sorted_route.data(),
                             route_to_row.data(), dropped.data(), workspace.data(), workspace.bytes(), stream);
  }
  void expect_matches(const std::string& what, const MapRef& ref) const {
    expect_identical(what + ".num_tokens_per_expert", counts.download(), ref.counts);
    expect_identical(what + ".expert_offsets", offsets.download(), ref.offsets);
    expect_identical(what + ".sorted_route", sorted_route.download(), ref.sorted_route);
    expect_identical(what + ".route_to_row", route_to_row.download(), ref.route_to_row, k);
    expect_identical(what + ".num_dropped", dropped.download(), std::vector<int32_t>{ref.dropped});
  }
  void expect_guards_intact() const {
    counts.expect_guards_intact("num_tokens_per_expert");
    offsets.expect_guards_intact("expert_offsets");
    sorted_route.expect_guards_intact("sorted_route");
    route_to_row.expect_guards_intact("route_to_row");
    dropped.expect_guards_intact("num_dropped");
    workspace.expect_guards_intact("dispatch workspace");
  }
};

class MoeDispatchMapGpu : public ::testing::TestWithParam<MapCase> {};

TEST_P(MoeDispatchMapGpu, MatchesCpu) {
  MOE_SKIP_WITHOUT_GPU();
  const MapCase c = GetParam();
  const auto idx = draw_routes(c.T, c.E, c.k, c.pattern, 5);
  const int64_t capacity = capacity_of(c.capacity_factor, c.T, c.k, c.E);
  const MapRef ref = cpu_map(idx, c.T, c.k, c.E, capacity);
  if (c.capacity_factor > 0 && c.pattern != RoutePattern::kRandom) {
    EXPECT_GT(ref.dropped, 0) << "this case is meant to drop routes";
  }
  GuardedBuffer<int32_t> d_idx(idx);
  GpuMap map(c.T, c.k, c.E);
  TestStream stream;
  map.run(d_idx.data(), capacity, stream.get());
  stream.sync();
  map.expect_matches("map", ref);
  map.expect_guards_intact();
  // A second call over the same buffers gives the same map (nothing accumulates).
  map.run(d_idx.data(), capacity, stream.get());
  stream.sync();
  map.expect_matches("map.again", ref);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MoeDispatchMapGpu,
    ::testing::Values(MapCase{1, 8, 1, RoutePattern::kRandom, 0}, MapCase{1, 8, 8, RoutePattern::kRandom, 0},
                      MapCase{0, 8, 2, RoutePattern::kRandom, 0}, MapCase{4097, 8, 2, RoutePattern::kRandom, 0},
                      MapCase{4097, 64, 8, RoutePattern::kSkewed, 0}, MapCase{4097, 64, 64, RoutePattern::kRandom, 0},
                      MapCase{33, 256, 3, RoutePattern::kRandom, 0}, MapCase{4097, 128, 4, RoutePattern::kSkewed, 1.0},
                      MapCase{4097, 128, 4, RoutePattern::kRandom, 1.25}, MapCase{4097, 64, 1, RoutePattern::kAllToOne, 0},
                      MapCase{4097, 64, 1, RoutePattern::kAllToOne, 1.0},
                      MapCase{1000, 16, 4, RoutePattern::kAllToOne, 2.0},
                      MapCase{65536, 256, 8, RoutePattern::kSkewed, 0}, MapCase{65536, 64, 8, RoutePattern::kRandom, 1.0},
                      MapCase{100003, 256, 16, RoutePattern::kSkewed, 1.5}),
    [](const auto& info) { return map_case_name(info.param); });

// Expert indices outside [0, E) (which the router never writes) are dropped and counted, never
// a trap or an out-of-bounds access: the map equals the CPU map of the valid routes alone.
TEST(MoeDispatchMapGpuEdge, BadExpertIndexIsDroppedAndCounted) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t T = 1000, k = 4, E = 64, R = T * k;
  auto idx = draw_routes(T, E, k, RoutePattern::kRandom, 21);
  std::vector<bool> bad(R, false);
  for (int64_t r = 3; r < R; r += 37) {
    idx[r] = (r % 2) ? static_cast<int32_t>(E + r % 5) : -1 - static_cast<int32_t>(r % 3);
    bad[r] = true;
  }
  // Reference: a stable counting sort of the valid routes (in increasing route id).
  MapRef ref;
  ref.counts.assign(E, 0);
  for (int64_t r = 0; r < R; ++r)
    if (!bad[r]) ++ref.counts[idx[r]];
  ref.offsets.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) ref.offsets[e + 1] = ref.offsets[e] + ref.counts[e];
  ref.sorted_route.assign(R, -1);
  ref.route_to_row.assign(R, -1);
  std::vector<int32_t> fill(ref.offsets.begin(), ref.offsets.end() - 1);
  for (int64_t r = 0; r < R; ++r) {
    if (bad[r]) continue;
    const int32_t row = fill[idx[r]]++;
    ref.sorted_route[row] = static_cast<int32_t>(r);
    ref.route_to_row[r] = row;
  }
  ref.dropped = static_cast<int32_t>(std::count(bad.begin(), bad.end(), true));
  GuardedBuffer<int32_t> d_idx(idx);
  GpuMap map(T, k, E);
  TestStream stream;
  map.run(d_idx.data(), 0, stream.get());
  stream.sync();
  map.expect_matches("map.bad_index", ref);
  map.expect_guards_intact();
}

// ---------------------------------------------------------------------------------------------
// Permute / unpermute on a CPU-built map (the map kernels are tested above).

struct PermuteCase {
  int64_t T, E, k, D;
  double capacity_factor;
  size_t misalign;  // bytes added to every BF16 row pointer (2: forces the 2-byte path)
};

std::string permute_case_name(const PermuteCase& c) {
  std::string n = "T" + std::to_string(c.T) + "_E" + std::to_string(c.E) + "_k" + std::to_string(c.k) + "_D" +
                  std::to_string(c.D);
  if (c.capacity_factor > 0) n += "_cap" + std::to_string(static_cast<int>(c.capacity_factor * 100));
  if (c.misalign) n += "_misaligned";
  return n;
}

struct PermuteSetup {
  int64_t T, k, D, R;
  std::vector<int32_t> idx;
  MapRef map;
  GuardedBuffer<int32_t> d_sorted, d_r2r;

  explicit PermuteSetup(const PermuteCase& c)
      : T(c.T), k(c.k), D(c.D), R(c.T * c.k), idx(draw_routes(c.T, c.E, c.k, RoutePattern::kSkewed, 9)),
        map(cpu_map(idx, c.T, c.k, c.E, capacity_of(c.capacity_factor, c.T, c.k, c.E))),
        d_sorted(map.sorted_route), d_r2r(map.route_to_row) {}
};

class MoePermuteGpu : public ::testing::TestWithParam<PermuteCase> {};

TEST_P(MoePermuteGpu, IntegerValuedDataMovesBitExactly) {
  MOE_SKIP_WITHOUT_GPU();
  const PermuteCase c = GetParam();
  PermuteSetup s(c);
  const int64_t T = s.T, k = s.k, D = s.D, R = s.R;
  if (c.capacity_factor > 0) {
    EXPECT_GT(s.map.dropped, 0) << "this case is meant to drop routes";
  }
  TestStream stream;

  // permute: x_sorted[row] = x[token of row], dropped-tail rows zero.
  const auto x = integer_values(T * D, -8, 8, 1);
  GuardedBuffer<uint16_t> d_x(narrow(x), c.misalign), d_xs(R * D, c.misalign);
  cuda::permute_forward(d_x.data(), s.d_sorted.data(), s.d_r2r.data(), T, k, D, d_xs.data(), stream.get());
  std::vector<float> xs_ref(R * D);
  cpu::permute_forward<float>(x.data(), s.map.sorted_route.data(), R, k, D, xs_ref.data());

  // permute backward: dx += sum of the token's rows.
  const auto dx0 = integer_values(T * D, -8, 8, 2), dxs = integer_values(R * D, -8, 8, 3);
  GuardedBuffer<uint16_t> d_dx(narrow(dx0), c.misalign), d_dxs(narrow(dxs), c.misalign);
  cuda::permute_backward(d_dxs.data(), s.d_r2r.data(), T, k, D, d_dx.data(), stream.get());
  auto dx_ref = dx0;
  cpu::permute_backward<float>(dxs.data(), s.map.sorted_route.data(), R, k, D, dx_ref.data());

  // unpermute (combine) with integer weights, and its backward.
  const auto y = integer_values(R * D, -4, 4, 4), w = integer_values(T * k, -2, 2, 5);
  const auto dout = integer_values(T * D, -8, 8, 6);
  GuardedBuffer<uint16_t> d_y(narrow(y), c.misalign), d_out(T * D, c.misalign), d_dout(narrow(dout), c.misalign),
      d_dy(R * D, c.misalign);
  GuardedBuffer<float> d_w(w), d_dw(T * k);
  cuda::unpermute_forward(d_y.data(), s.d_r2r.data(), d_w.data(), T, k, D, d_out.data(), stream.get());
  cuda::unpermute_backward(d_dout.data(), d_y.data(), s.d_sorted.data(), s.d_r2r.data(), d_w.data(), T, k, D,
                           d_dy.data(), d_dw.data(), stream.get());
  std::vector<float> out_ref(T * D), dy_ref(R * D), dw_ref(T * k);
  cpu::unpermute_forward<float>(y.data(), s.map.route_to_row.data(), w.data(), T, k, D, out_ref.data());
  cpu::unpermute_backward<float>(dout.data(), y.data(), s.map.route_to_row.data(), w.data(), T, k, D, R,
                                 dy_ref.data(), dw_ref.data());
  stream.sync();

  expect_identical("permute.x_sorted", d_xs.download(), narrow(xs_ref), D);
  expect_identical("permute_backward.dx", d_dx.download(), narrow(dx_ref), D);
  expect_identical("unpermute.out", d_out.download(), narrow(out_ref), D);
  expect_identical("unpermute_backward.dy_sorted", d_dy.download(), narrow(dy_ref), D);
  expect_identical("unpermute_backward.dtopk_w", d_dw.download(), dw_ref, k);
  for (const auto* b : {&d_x, &d_xs, &d_dx, &d_dxs, &d_y, &d_out, &d_dout, &d_dy}) b->expect_guards_intact("bf16 rows");
  d_dw.expect_guards_intact("dtopk_w");
  EXPECT_TRUE(bitwise_equal(d_x.download(), narrow(x))) << "x was modified";
}

TEST_P(MoePermuteGpu, RealValuedCombineWithinRounding) {
  MOE_SKIP_WITHOUT_GPU();
  const PermuteCase c = GetParam();
  PermuteSetup s(c);
  const int64_t T = s.T, k = s.k, D = s.D, R = s.R;
  TestStream stream;
  const auto y = random_bf16(R * D, 11), dout = random_bf16(T * D, 12), dx0 = random_bf16(T * D, 13);
  std::vector<float> w(T * k);  // positive weights summing to 1 per token, like normalised router weights
  {
    std::mt19937_64 gen(14);
    std::uniform_real_distribution<float> u(0.05f, 1.f);
    for (int64_t t = 0; t < T; ++t) {
      float sum = 0.f;
      for (int64_t j = 0; j < k; ++j) sum += (w[t * k + j] = u(gen));
      for (int64_t j = 0; j < k; ++j) w[t * k + j] /= sum;
    }
  }
  GuardedBuffer<uint16_t> d_y(y, c.misalign), d_dout(dout, c.misalign), d_out(T * D, c.misalign),
      d_dy(R * D, c.misalign), d_dx(dx0, c.misalign);
  GuardedBuffer<float> d_w(w), d_dw(T * k);
  cuda::unpermute_forward(d_y.data(), s.d_r2r.data(), d_w.data(), T, k, D, d_out.data(), stream.get());
  cuda::unpermute_backward(d_dout.data(), d_y.data(), s.d_sorted.data(), s.d_r2r.data(), d_w.data(), T, k, D,
                           d_dy.data(), d_dw.data(), stream.get());
  cuda::permute_backward(d_y.data(), s.d_r2r.data(), T, k, D, d_dx.data(), stream.get());
  stream.sync();

  const auto yf = widen(y), doutf = widen(dout);
  std::vector<float> out_ref(T * D), dy_ref(R * D), dw_ref(T * k);
  auto dx_ref = widen(dx0);
  cpu::unpermute_forward<float>(yf.data(), s.map.route_to_row.data(), w.data(), T, k, D, out_ref.data());
  cpu::unpermute_backward<float>(doutf.data(), yf.data(), s.map.route_to_row.data(), w.data(), T, k, D, R,
                                 dy_ref.data(), dw_ref.data());
  cpu::permute_backward<float>(yf.data(), s.map.sorted_route.data(), R, k, D, dx_ref.data());
  expect_parity("unpermute.out.real", widen(d_out.download()), out_ref, kBF16Elementwise);
  expect_parity("unpermute_backward.dy_sorted.real", widen(d_dy.download()), dy_ref, kBF16Elementwise);
  expect_parity("unpermute_backward.dtopk_w.real", d_dw.download(), dw_ref, kFP32Reduction);
  expect_parity("permute_backward.dx.real", widen(d_dx.download()), dx_ref, kBF16Elementwise);
  for (const auto* b : {&d_y, &d_dout, &d_out, &d_dy, &d_dx}) b->expect_guards_intact("bf16 rows");
  d_dw.expect_guards_intact("dtopk_w");
}

// The combine added into the residual stream (unpermute_forward_add): on integer values (exact in
// BF16 and FP32) the CPU twin's sums; on real values the bits of unpermute_forward then
// residual_add, with and without the BF16 copy of the sum.
TEST_P(MoePermuteGpu, CombineAddedIntoTheResidualIsCombineThenResidualAdd) {
  MOE_SKIP_WITHOUT_GPU();
  const PermuteCase c = GetParam();
  PermuteSetup s(c);
  const int64_t T = s.T, k = s.k, D = s.D, R = s.R;
  const size_t acc_misalign = c.misalign != 0 ? 4 : 0;  // FP32 rows off 16 bytes: the scalar path
  TestStream stream;
  {
    const auto y = integer_values(R * D, -4, 4, 21), w = integer_values(T * k, -2, 2, 22);
    const auto acc0 = integer_values(T * D, -100, 100, 23);
    GuardedBuffer<uint16_t> d_y(narrow(y), c.misalign), d_out(T * D, c.misalign);
    GuardedBuffer<float> d_w(w), d_acc(acc0, acc_misalign);
    cuda::unpermute_forward_add(d_y.data(), s.d_r2r.data(), d_w.data(), T, k, D, d_acc.data(), d_out.data(),
                                stream.get());
    auto acc_ref = acc0;
    cpu::unpermute_forward_add<float>(y.data(), s.map.route_to_row.data(), w.data(), T, k, D, acc_ref.data());
    stream.sync();
    expect_identical("unpermute_forward_add.acc", d_acc.download(), acc_ref, D);
    expect_identical("unpermute_forward_add.acc_bf16", d_out.download(), narrow(acc_ref), D);
    d_out.expect_guards_intact("acc_bf16");
    d_acc.expect_guards_intact("acc");
  }
  const auto y = random_bf16(R * D, 24);
  std::vector<float> w(T * k), acc0(T * D);
  std::mt19937_64 gen(25);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (float& v : w) v = normal(gen) * 0.3f;
  for (float& v : acc0) v = normal(gen);
  GuardedBuffer<uint16_t> d_y(y, c.misalign), d_branch(T * D, c.misalign), d_out_sep(T * D, c.misalign),
      d_out(T * D, c.misalign);
  GuardedBuffer<float> d_w(w), d_acc_sep(acc0, acc_misalign), d_acc(acc0, acc_misalign),
      d_acc_no_copy(acc0, acc_misalign);
  cuda::unpermute_forward(d_y.data(), s.d_r2r.data(), d_w.data(), T, k, D, d_branch.data(), stream.get());
  cuda::residual_add(d_acc_sep.data(), d_branch.data(), d_out_sep.data(), T * D, stream.get());
  cuda::unpermute_forward_add(d_y.data(), s.d_r2r.data(), d_w.data(), T, k, D, d_acc.data(), d_out.data(),
                              stream.get());
  cuda::unpermute_forward_add(d_y.data(), s.d_r2r.data(), d_w.data(), T, k, D, d_acc_no_copy.data(), nullptr,
                              stream.get());
  stream.sync();
  const auto acc_sep = d_acc_sep.download();
  EXPECT_TRUE(bitwise_equal(d_acc.download(), acc_sep)) << "acc differs from unpermute_forward + residual_add";
  EXPECT_TRUE(bitwise_equal(d_acc_no_copy.download(), acc_sep)) << "acc (no BF16 copy) differs";
  EXPECT_TRUE(bitwise_equal(d_out.download(), d_out_sep.download())) << "acc_bf16 differs";
  for (const auto* b : {&d_y, &d_branch, &d_out_sep, &d_out}) b->expect_guards_intact("bf16 rows");
  for (const auto* b : {&d_acc_sep, &d_acc, &d_acc_no_copy}) b->expect_guards_intact("acc");
}

INSTANTIATE_TEST_SUITE_P(Shapes, MoePermuteGpu,
                         ::testing::Values(PermuteCase{1, 8, 1, 2048, 0, 0}, PermuteCase{513, 64, 8, 2048, 0, 0},
                                           PermuteCase{513, 64, 8, 2048, 1.0, 0}, PermuteCase{4097, 8, 2, 64, 1.25, 0},
                                           PermuteCase{33, 8, 8, 13, 0, 0}, PermuteCase{257, 16, 4, 2048, 0, 2},
                                           PermuteCase{4097, 128, 16, 72, 0, 0}),
                         [](const auto& info) { return permute_case_name(info.param); });

// The FP8 experts' producers: permute_forward_fp8 and unpermute_backward_fp8 write the BF16 rows
// and dtopk_w of permute_forward / unpermute_backward bit for bit, and codes and scales bitwise
// fp8_quantize_blocks' of those BF16 rows under each FP8 rule (whose CPU parity fp8_test.cpp and
// fp8_mx_test.cpp check): rows without a route (capacity drops) as codes 0 with the scale of an
// all-zero block (1; 2^-127 under MX); D = 384 ends its rows half-way through a warp's
// 256-column step; D not a multiple of 128 is refused, naming it.
TEST(MoePermuteGpuFp8, ProducersWriteTheirRowsCodesBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream stream;
  for (const Fp8Rule rule : {Fp8Rule::kBlocks, Fp8Rule::kMx, Fp8Rule::kMxNoSaturation})
  for (const PermuteCase& c : {PermuteCase{513, 64, 8, 2048, 0, 0}, PermuteCase{513, 64, 8, 2048, 1.0, 0},
                               PermuteCase{37, 8, 2, 384, 1.25, 0}, PermuteCase{5, 4, 3, 128, 0, 0}}) {
    const std::string what = "fp8 producers " + permute_case_name(c) + " rule " + std::to_string(int(rule));
    PermuteSetup s(c);
    const int64_t T = s.T, k = s.k, D = s.D, R = s.R;
    if (c.capacity_factor > 0) {
      EXPECT_GT(s.map.dropped, 0) << what << ": meant to drop routes";
    }
    const auto x = random_bf16(T * D, 21, 3.0f), y = random_bf16(R * D, 22), dout = random_bf16(T * D, 23, 0.5f);
    std::vector<float> w(T * k);
    std::mt19937_64 gen(24);
    std::uniform_real_distribution<float> u(0.05f, 1.f);
    for (float& v : w) v = u(gen);
    GuardedBuffer<uint16_t> d_x(x), d_y(y), d_dout(dout), xs(R * D), xs_ref(R * D), dy(R * D), dy_ref(R * D);
    GuardedBuffer<float> d_w(w), dw(T * k), dw_ref(T * k), sc(R * D / 128), sc_ref(R * D / 128);
    GuardedBuffer<uint8_t> q(R * D), q_ref(R * D);
    cuda::permute_forward_fp8(d_x.data(), s.d_sorted.data(), s.d_r2r.data(), T, k, D, xs.data(), q.data(), sc.data(),
                              stream.get(), rule);
    cuda::permute_forward(d_x.data(), s.d_sorted.data(), s.d_r2r.data(), T, k, D, xs_ref.data(), stream.get());
    cuda::fp8_quantize_blocks(xs_ref.data(), R, D, kFp8ActivationBlock, Fp8Format::kE4M3, q_ref.data(), sc_ref.data(),
                              nullptr, stream.get(), rule);
    stream.sync();
    EXPECT_TRUE(bitwise_equal(xs.download(), xs_ref.download())) << what << ": x_sorted";
    EXPECT_TRUE(bitwise_equal(q.download(), q_ref.download())) << what << ": x_sorted codes";
    EXPECT_TRUE(bitwise_equal(sc.download(), sc_ref.download())) << what << ": x_sorted scales";
    cuda::unpermute_backward_fp8(d_dout.data(), d_y.data(), s.d_sorted.data(), s.d_r2r.data(), d_w.data(), T, k, D,
                                 dy.data(), dw.data(), q.data(), sc.data(), stream.get(), rule);
    cuda::unpermute_backward(d_dout.data(), d_y.data(), s.d_sorted.data(), s.d_r2r.data(), d_w.data(), T, k, D,
                             dy_ref.data(), dw_ref.data(), stream.get());
    cuda::fp8_quantize_blocks(dy_ref.data(), R, D, kFp8ActivationBlock, Fp8Format::kE4M3, q_ref.data(), sc_ref.data(),
                              nullptr, stream.get(), rule);
    stream.sync();
    EXPECT_TRUE(bitwise_equal(dy.download(), dy_ref.download())) << what << ": dy_sorted";
    EXPECT_TRUE(bitwise_equal(dw.download(), dw_ref.download())) << what << ": dtopk_w";
    EXPECT_TRUE(bitwise_equal(q.download(), q_ref.download())) << what << ": dy_sorted codes";
    EXPECT_TRUE(bitwise_equal(sc.download(), sc_ref.download())) << what << ": dy_sorted scales";
    if (c.capacity_factor > 0) {  // a dropped route's row: zero, and its blocks' scale that of zeros
      const std::vector<float> scales = sc.download();
      int64_t empty_rows = 0;
      for (int64_t r = 0; r < R; ++r) empty_rows += s.map.sorted_route[size_t(r)] < 0 ? 1 : 0;
      EXPECT_GT(empty_rows, 0) << what;
      const float zero_scale = rule == Fp8Rule::kBlocks ? 1.0f : std::ldexp(1.0f, -127);
      EXPECT_EQ(std::count(scales.begin(), scales.end(), zero_scale), empty_rows * (D / 128)) << what;
    }
    for (const auto* b : {&d_x, &d_y, &d_dout, &xs, &dy}) b->expect_guards_intact(what + " bf16 rows");
    q.expect_guards_intact(what + " codes");
    sc.expect_guards_intact(what + " scales");
    dw.expect_guards_intact(what + " dtopk_w");
  }
  GuardedBuffer<uint16_t> b(4 * 2 * 96);
  GuardedBuffer<uint8_t> cq(4 * 2 * 96);
  GuardedBuffer<float> cs(8);
  GuardedBuffer<int32_t> route(std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7});
  const std::string msg = error_of([&] {
    cuda::permute_forward_fp8(b.data(), route.data(), route.data(), 4, 2, 96, b.data(), cq.data(), cs.data(),
                              stream.get());
  });
  EXPECT_NE(msg.find("cuda::permute_forward_fp8: d must be a multiple of 128"), std::string::npos) << msg;
}

TEST(MoePermuteGpuEdge, NoTokensIsANoOp) {
  MOE_SKIP_WITHOUT_GPU();
  EXPECT_NO_THROW(cuda::permute_forward(nullptr, nullptr, nullptr, 0, 2, 64, nullptr, nullptr));
  EXPECT_NO_THROW(cuda::permute_backward(nullptr, nullptr, 0, 2, 64, nullptr, nullptr));
  EXPECT_NO_THROW(cuda::unpermute_forward(nullptr, nullptr, nullptr, 0, 2, 64, nullptr, nullptr));
  EXPECT_NO_THROW(cuda::unpermute_backward(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 2, 64, nullptr, nullptr,
                                           nullptr));
}

// ---------------------------------------------------------------------------------------------
// CUDA graph: router -> dispatch map -> permute -> unpermute, then unpermute_backward ->
// permute_backward and router_backward, captured once and replayed with new inputs copied in
// before each replay. Capture fails if anything inside synchronises with the host; each replay
// must equal an eager run on the same inputs bit for bit (the kernels are deterministic).

struct ChainShape {
  int64_t T = 2049, E = 64, k = 8, D = 1024;
  double capacity_factor = 1.25;
};

// One set of outputs of the chain.
struct ChainOutputs {
  GpuRouter router;
  GpuMap map;
  GuardedBuffer<uint16_t> x_sorted, out, dy_sorted, dx;
  GuardedBuffer<float> dtopk_w, dlogits;

  ChainOutputs(const ChainShape& s, const cuda::RouterParams& p)
      : router(p), map(s.T, s.k, s.E), x_sorted(s.T * s.k * s.D), out(s.T * s.D), dy_sorted(s.T * s.k * s.D),
        dx(s.T * s.D), dtopk_w(s.T * s.k), dlogits(s.T * s.E) {}
};

// Inputs the replays refresh.
struct ChainInputs {
  GuardedBuffer<float> logits, bias, dlb, dz;
  GuardedBuffer<uint16_t> x, dout, dx0;

  explicit ChainInputs(const ChainShape& s)
      : logits(s.T * s.E), bias(s.E), dlb(1), dz(1), x(s.T * s.D), dout(s.T * s.D), dx0(s.T * s.D) {}
};

void run_chain(const ChainShape& s, const cuda::RouterParams& p, ChainInputs& in, ChainOutputs& o,
               cudaStream_t stream) {
  const int64_t capacity = capacity_of(s.capacity_factor, s.T, s.k, s.E);
  o.router.run(in.logits.data(), in.bias.data(), stream);
  o.map.run(o.router.idx.data(), capacity, stream);
  cuda::permute_forward(in.x.data(), o.map.sorted_route.data(), o.map.route_to_row.data(), s.T, s.k, s.D,
                        o.x_sorted.data(), stream);
  // The experts are elsewhere: combine the permuted rows themselves (y_sorted = x_sorted).
  cuda::unpermute_forward(o.x_sorted.data(), o.map.route_to_row.data(), o.router.topk_w.data(), s.T, s.k, s.D,
                          o.out.data(), stream);
  cuda::unpermute_backward(in.dout.data(), o.x_sorted.data(), o.map.sorted_route.data(), o.map.route_to_row.data(),
                           o.router.topk_w.data(), s.T, s.k, s.D, o.dy_sorted.data(), o.dtopk_w.data(), stream);
  MOE_CUDA_CHECK(cudaMemcpyAsync(o.dx.data(), in.dx0.data(), o.dx.bytes(), cudaMemcpyDeviceToDevice, stream));
  cuda::permute_backward(o.dy_sorted.data(), o.map.route_to_row.data(), s.T, s.k, s.D, o.dx.data(), stream);
  cuda::router_backward(p, in.logits.data(), o.router.scores.data(), o.router.idx.data(), o.router.counts.data(),
                        o.dtopk_w.data(), in.dlb.data(), in.dz.data(), o.dlogits.data(), stream);
}

void expect_same_chain(const std::string& what, const ChainOutputs& a, const ChainOutputs& b) {
  expect_identical(what + ".scores", a.router.scores.download(), b.router.scores.download());
  expect_identical(what + ".topk_idx", a.router.idx.download(), b.router.idx.download());
  expect_identical(what + ".topk_w", a.router.topk_w.download(), b.router.topk_w.download());
  expect_identical(what + ".counts", a.router.counts.download(), b.router.counts.download());
  expect_identical(what + ".score_sum", a.router.score_sum.download(), b.router.score_sum.download());
  expect_identical(what + ".losses", a.router.losses.download(), b.router.losses.download());
  expect_identical(what + ".expert_offsets", a.map.offsets.download(), b.map.offsets.download());
  expect_identical(what + ".sorted_route", a.map.sorted_route.download(), b.map.sorted_route.download());
  expect_identical(what + ".route_to_row", a.map.route_to_row.download(), b.map.route_to_row.download());
  expect_identical(what + ".num_dropped", a.map.dropped.download(), b.map.dropped.download());
  expect_identical(what + ".x_sorted", a.x_sorted.download(), b.x_sorted.download());
  expect_identical(what + ".out", a.out.download(), b.out.download());
  expect_identical(what + ".dy_sorted", a.dy_sorted.download(), b.dy_sorted.download());
  expect_identical(what + ".dtopk_w", a.dtopk_w.download(), b.dtopk_w.download());
  expect_identical(what + ".dx", a.dx.download(), b.dx.download());
  expect_identical(what + ".dlogits", a.dlogits.download(), b.dlogits.download());
}

TEST(MoeRoutingGraph, CapturedChainReplaysWithNewInputs) {
  MOE_SKIP_WITHOUT_GPU();
  const ChainShape s;
  const RouterCase rc{s.T, s.E, s.k, kSoftmax, true, kLearned, BiasKind::kGrid};
  const auto p = gpu_params(rc);
  ChainInputs in(s);
  ChainOutputs graph_out(s, p), eager_out(s, p);
  TestStream stream;

  // Capture with placeholder inputs; the graph must not depend on their values.
  MOE_CUDA_CHECK(cudaMemsetAsync(in.logits.data(), 0, in.logits.bytes(), stream.get()));
  MOE_CUDA_CHECK(cudaMemsetAsync(in.bias.data(), 0, in.bias.bytes(), stream.get()));
  stream.sync();
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  run_chain(s, p, in, graph_out, stream.get());
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  std::vector<int32_t> previous_idx;
  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    const uint64_t seed = 100 + 10 * replay;
    const auto bias = make_bias(rc, seed);
    const auto logits = draw_logits(rc, bias, seed + 1);
    const auto x = random_bf16(s.T * s.D, seed + 2), dout = random_bf16(s.T * s.D, seed + 3),
               dx0 = random_bf16(s.T * s.D, seed + 4);
    const std::vector<float> dlb{0.5f + replay}, dz{0.25f * (replay + 1)};
    MOE_CUDA_CHECK(cudaMemcpyAsync(in.logits.data(), logits.data(), in.logits.bytes(), cudaMemcpyHostToDevice, stream.get()));
    MOE_CUDA_CHECK(cudaMemcpyAsync(in.bias.data(), bias.data(), in.bias.bytes(), cudaMemcpyHostToDevice, stream.get()));
    MOE_CUDA_CHECK(cudaMemcpyAsync(in.x.data(), x.data(), in.x.bytes(), cudaMemcpyHostToDevice, stream.get()));
    MOE_CUDA_CHECK(cudaMemcpyAsync(in.dout.data(), dout.data(), in.dout.bytes(), cudaMemcpyHostToDevice, stream.get()));
    MOE_CUDA_CHECK(cudaMemcpyAsync(in.dx0.data(), dx0.data(), in.dx0.bytes(), cudaMemcpyHostToDevice, stream.get()));
    MOE_CUDA_CHECK(cudaMemcpyAsync(in.dlb.data(), dlb.data(), sizeof(float), cudaMemcpyHostToDevice, stream.get()));
    MOE_CUDA_CHECK(cudaMemcpyAsync(in.dz.data(), dz.data(), sizeof(float), cudaMemcpyHostToDevice, stream.get()));
    MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    run_chain(s, p, in, eager_out, stream.get());
    stream.sync();

    expect_same_chain("graph_vs_eager", graph_out, eager_out);
    // The replay routed the new logits: the CPU router on them picks the same experts.
    const RouterRef ref = cpu_router(rc, logits, bias);
    const auto idx = graph_out.router.idx.download();
    expect_identical("graph.topk_idx_vs_cpu", idx, ref.idx, s.k);
    expect_parity("graph.losses_vs_cpu", graph_out.router.losses.download(), ref.losses, kFP32Reduction);
    EXPECT_NE(idx, previous_idx) << "a replay must route its own inputs";
    previous_idx = idx;
  }
  graph_out.router.expect_guards_intact();
  graph_out.map.expect_guards_intact();
  for (const auto* b : {&graph_out.x_sorted, &graph_out.out, &graph_out.dy_sorted, &graph_out.dx})
    b->expect_guards_intact("graph bf16 rows");
  MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOE_CUDA_CHECK(cudaGraphDestroy(graph));
}

}  // namespace
}  // namespace moe::testing
