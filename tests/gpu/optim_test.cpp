// cuda::global_grad_norm and cuda::adamw_step against moe::global_grad_norm, clip_grads and
// moe::AdamW on the same data. Without clipping the update is bitwise the CPU's (same FP32
// operations in the same order); with clipping, per element within 1e-6 relative. Also: padding
// never touched, the BF16 copy equals f32_to_bf16(master), skips on NaN/Inf gradients, bitwise
// reproducible norms (any n, any alignment, beyond 2^31 elements), and a graph replaying steps.
// ZeRO-1: grad_sum_squares against the CPU sum (its root bitwise the norm), AdamW on a shard's
// segments with compact moments against the CPU AdamW.
#include <bit>
#include <cmath>
#include <random>
#include <limits>

#include "core/arena.h"
#include "core/config.h"
#include "cpu/fp8.h"
#include "cuda/ops/fp8.h"
#include "cuda/ops/optim.h"
#include "gpu/gpu_test_util.h"
#include "core/dtype.h"
#include "optim/adamw.h"
#include "optim/flat_shards.h"
#include "support/parity.h"

namespace moe::testing {
namespace {

constexpr float kPaddingParam = 7.0f;  // parameter padding starts here and must stay

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---------------------------------------------------------------- global_grad_norm

// Test buffers are filled on the legacy default stream (cudaMemset; a pageable cudaMemcpy may
// return before its DMA lands) while the ops run on a non-blocking stream: wait for the fills first.
void settle_uploads() { MOE_CUDA_CHECK(cudaDeviceSynchronize()); }

double device_norm(const float* d_grads, int64_t n, cudaStream_t s) {
  GuardedBuffer<double> norm(1);
  const size_t bytes = cuda::global_grad_norm_workspace_bytes(n);
  GuardedBuffer<uint8_t> ws(static_cast<int64_t>(bytes));
  settle_uploads();
  cuda::global_grad_norm(d_grads, n, norm.data(), ws.data(), bytes, s);
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  norm.expect_guards_intact("norm");
  ws.expect_guards_intact("norm workspace");
  return norm.download()[0];
}

class GradNormParity : public ::testing::TestWithParam<int64_t> {};

TEST_P(GradNormParity, MatchesCpuAndIsReproducible) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t n = GetParam();
  auto g = random_f32(n, 201, 0.01f);
  for (int64_t i = 0; i < n; i += 1001) g[i] = 30.0f;  // a few large entries
  const double ref = moe::global_grad_norm(g.data(), n);
  GuardedBuffer<float> d_g(g), d_g_shifted(g, 4);  // 16-byte aligned and 4-byte aligned copies
  TestStream stream;
  const double got = device_norm(d_g.data(), n, stream.get());
  const double again = device_norm(d_g.data(), n, stream.get());
  const double shifted = device_norm(d_g_shifted.data(), n, stream.get());
  const double rel = std::fabs(got - ref) / ref;
  std::printf("parity grad_norm n=%lld: got %.17g ref %.17g rel %.3e\n", static_cast<long long>(n), got, ref, rel);
  EXPECT_LE(rel, 1e-6);
  EXPECT_EQ(std::memcmp(&got, &again, sizeof(double)), 0) << "two runs differ: " << got << " vs " << again;
  EXPECT_EQ(std::memcmp(&got, &shifted, sizeof(double)), 0)
      << "the summation order depends on alignment: " << got << " vs " << shifted;
  EXPECT_TRUE(same_bits(d_g.download(), g)) << "grads were modified";
  d_g.expect_guards_intact("grads");
}

INSTANTIATE_TEST_SUITE_P(Sizes, GradNormParity,
                         ::testing::Values(1, 3, 4, 5, 4099, 16384, 16385, (int64_t{1} << 20) + 7, 50'000'003),
                         [](const auto& info) { return param_name("n", info.param); });

TEST(GradNorm, EmptyIsZeroAndNonFiniteStaysNonFinite) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream stream;
  GuardedBuffer<double> norm(1);  // starts as NaN bytes
  settle_uploads();
  cuda::global_grad_norm(nullptr, 0, norm.data(), nullptr, 0, stream.get());
  stream.sync();
  EXPECT_EQ(norm.download()[0], 0.0);

  auto g = random_f32(10000, 202);
  g[7777] = std::numeric_limits<float>::quiet_NaN();
  GuardedBuffer<float> d_nan(g);
  EXPECT_TRUE(std::isnan(device_norm(d_nan.data(), 10000, stream.get())));
  g[7777] = -std::numeric_limits<float>::infinity();
  GuardedBuffer<float> d_inf(g);
  EXPECT_TRUE(std::isinf(device_norm(d_inf.data(), 10000, stream.get())));
}

TEST(GradNorm, WorkspaceTooSmallIsRejected) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t n = 100000;
  const size_t need = cuda::global_grad_norm_workspace_bytes(n);
  EXPECT_EQ(need, 7 * sizeof(double));  // ceil(100000 / 16384) blocks
  GuardedBuffer<float> g(n);
  GuardedBuffer<double> norm(8);
  try {
    cuda::global_grad_norm(g.data(), n, norm.data(), norm.data() + 1, need - 8, nullptr);
    ADD_FAILURE() << "expected moe::Error";
  } catch (const moe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("global_grad_norm_workspace_bytes"), std::string::npos) << e.what();
  }
}

// 2^31 + 5 elements (8 GiB): indices past 2^31 are reached. All entries hold one value x, except two
// beyond 2^31 whose squares dominate a missed element.
TEST(GradNorm, MoreThan2Pow31Elements) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t n = (int64_t{1} << 31) + 5;
  size_t free_bytes = 0, total_bytes = 0;
  MOE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (free_bytes < static_cast<size_t>(n) * sizeof(float) + (size_t{1} << 30)) {
    GTEST_SKIP() << "needs " << (n * 4) / (1 << 20) << " MiB of free device memory";
  }
  float* g = nullptr;
  MOE_CUDA_CHECK(cudaMalloc(&g, static_cast<size_t>(n) * sizeof(float)));
  MOE_CUDA_CHECK(cudaMemset(g, 0x3C, static_cast<size_t>(n) * sizeof(float)));
  const float big[2] = {500.0f, 1000.0f};
  MOE_CUDA_CHECK(cudaMemcpy(g + (int64_t{1} << 31), &big[0], sizeof(float), cudaMemcpyHostToDevice));
  MOE_CUDA_CHECK(cudaMemcpy(g + n - 1, &big[1], sizeof(float), cudaMemcpyHostToDevice));
  float x = 0.0f;
  const uint32_t bits = 0x3C3C3C3Cu;
  std::memcpy(&x, &bits, sizeof(float));
  const double ref = std::sqrt(double(n - 2) * double(x) * double(x) + 500.0 * 500.0 + 1000.0 * 1000.0);
  TestStream stream;
  const double got = device_norm(g, n, stream.get());
  const double again = device_norm(g, n, stream.get());
  MOE_CUDA_CHECK(cudaFree(g));
  std::printf("parity grad_norm n=2^31+5: got %.17g ref %.17g rel %.3e\n", got, ref, std::fabs(got - ref) / ref);
  EXPECT_LE(std::fabs(got - ref) / ref, 1e-6);
  EXPECT_EQ(std::memcmp(&got, &again, sizeof(double)), 0);
}

// ---------------------------------------------------------------- adamw_step

// Tensors of awkward sizes, decayed and not; the layout pads each to 64 elements.
ParamLayout test_layout() {
  ParamLayout layout;
  layout.add("model.embed.weight", {3, 257});
  layout.add("model.norm.weight", {257}, /*decay=*/false);
  layout.add("model.layers.0.mlp.weight", {4099});
  layout.add("model.layers.0.scale", {1}, /*decay=*/false);
  layout.add("model.layers.0.attn.weight", {70, 130});
  layout.add("model.layers.0.bias", {5}, /*decay=*/false);
  return layout;
}

OptimConfig test_config(double grad_clip) {
  OptimConfig cfg;
  cfg.lr = 1e-2;
  cfg.min_lr = 1e-3;
  cfg.warmup_steps = 2;
  cfg.schedule = "cosine";
  cfg.beta1 = 0.9;
  cfg.beta2 = 0.95;
  cfg.eps = 1e-8;
  cfg.weight_decay = 0.1;
  cfg.grad_clip = grad_clip;
  return cfg;
}

// The CPU twin on a compact ParamLayout and the GPU on segments that may sit at other offsets in a
// larger buffer: element j of CPU entry i is element j of device segment i.
struct AdamWHarness {
  ParamLayout layout;  // CPU layout (offsets padded to 64)
  OptimConfig cfg;
  std::vector<cuda::ParamSegment> segs;  // device placement of the same tensors
  int64_t total;                         // device buffer extent
  size_t misalign;                       // bytes added to the FP32 device buffers

  // CPU state
  AdamW cpu_opt{layout, cfg};
  std::vector<float> cpu_params;

  // GPU state
  cuda::ParamSegmentTable table{segs, total};
  std::vector<float> params0;
  GuardedBuffer<float> params{total, misalign}, grads{total, misalign}, m{total, misalign}, v{total, misalign};
  GuardedBuffer<uint16_t> params_bf16{total, misalign / 2};
  GuardedBuffer<cuda::OptimStepScalars> scalars{std::vector<cuda::OptimStepScalars>(1)};
  size_t ws_bytes = cuda::global_grad_norm_workspace_bytes(total);
  GuardedBuffer<uint8_t> ws{static_cast<int64_t>(ws_bytes)};

  AdamWHarness(ParamLayout l, OptimConfig c, std::vector<cuda::ParamSegment> s, int64_t t, size_t mis)
      : layout(std::move(l)), cfg(c), segs(std::move(s)), total(t), misalign(mis) {
    cpu_params.assign(static_cast<size_t>(layout.total_numel()), kPaddingParam);
    params0.assign(static_cast<size_t>(total), kPaddingParam);
    const auto init = random_f32(total, 301);
    for_each_element([&](int64_t cpu_i, int64_t dev_i) { params0[dev_i] = cpu_params[cpu_i] = init[dev_i]; });
    params.upload(params0);
    m.upload(std::vector<float>(static_cast<size_t>(total), 0.0f));
    v.upload(std::vector<float>(static_cast<size_t>(total), 0.0f));
  }

  template <typename F>
  void for_each_element(F f) const {
    for (size_t i = 0; i < segs.size(); ++i) {
      const ParamEntry& e = layout.entries()[i];
      for (int64_t j = 0; j < e.numel; ++j) f(e.offset + j, segs[i].offset + j);
    }
  }

  // Device gradients: N(0, scale) on the segments, 0 in the padding (as a real gradient buffer).
  std::vector<float> make_grads(uint64_t seed, float scale) const {
    const auto r = random_f32(total, seed, scale);
    std::vector<float> g(static_cast<size_t>(total), 0.0f);
    for_each_element([&](int64_t, int64_t dev_i) { g[dev_i] = r[dev_i]; });
    return g;
  }

  // One trainer step on the CPU (norm, skip, clip, AdamW::step); returns the clip factor (0: skipped).
  double cpu_step(const std::vector<float>& dev_grads, double lr) {
    std::vector<float> g(static_cast<size_t>(layout.total_numel()), 0.0f);
    for_each_element([&](int64_t cpu_i, int64_t dev_i) { g[cpu_i] = dev_grads[dev_i]; });
    const double norm = moe::global_grad_norm(g.data(), layout.total_numel());
    if (!std::isfinite(norm)) return 0.0;
    const double factor = clip_grads(g.data(), layout.total_numel(), norm, cfg.grad_clip);
    cpu_opt.step(cpu_params.data(), g.data(), lr);
    return factor;
  }

  // The GPU step's device work, grads and lr already in place.
  void enqueue_step(cudaStream_t s) {
    cuda::global_grad_norm(grads.data(), total, &scalars.data()->grad_norm, ws.data(), ws_bytes, s);
    cuda::adamw_step(table, cfg, params.data(), grads.data(), m.data(), v.data(), params_bf16.data(), scalars.data(),
                     s);
  }

  void gpu_step(const std::vector<float>& dev_grads, double lr, cudaStream_t s) {
    grads.upload(dev_grads);
    MOE_CUDA_CHECK(cudaMemcpy(&scalars.data()->lr, &lr, sizeof(double), cudaMemcpyHostToDevice));
    settle_uploads();
    enqueue_step(s);
    MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  }

  cuda::OptimStepScalars read_scalars() const { return scalars.download()[0]; }

  // The CPU state scattered into the device placement (padding: params kPaddingParam, moments 0).
  std::vector<float> expected(const std::vector<float>& cpu, float padding) const {
    std::vector<float> out(static_cast<size_t>(total), padding);
    for_each_element([&](int64_t cpu_i, int64_t dev_i) { out[dev_i] = cpu[cpu_i]; });
    return out;
  }

  // GPU params, moments and BF16 copy against the CPU; bitwise when `exact`.
  void expect_matches_cpu(const std::string& tag, bool exact) {
    const auto p = params.download(), mm = m.download(), vv = v.download();
    const auto want_p = expected(cpu_params, kPaddingParam), want_m = expected(cpu_opt.exp_avg(), 0.0f),
               want_v = expected(cpu_opt.exp_avg_sq(), 0.0f);
    const Tolerance& tol = exact ? kExact : kFP32Update;
    expect_parity(tag + ".params", p, want_p, tol);
    expect_parity(tag + ".exp_avg", mm, want_m, tol);
    expect_parity(tag + ".exp_avg_sq", vv, want_v, tol);
    if (!exact) {
      std::printf("adamw %s: bitwise equal to the CPU: params %d exp_avg %d exp_avg_sq %d\n", tag.c_str(),
                  same_bits(p, want_p), same_bits(mm, want_m), same_bits(vv, want_v));
    }
    // Padding: exact start values everywhere outside the segments.
    std::vector<char> inside(static_cast<size_t>(total), 0);
    for_each_element([&](int64_t, int64_t dev_i) { inside[dev_i] = 1; });
    const auto b = params_bf16.download();
    for (int64_t i = 0; i < total; ++i) {
      if (inside[i]) {
        ASSERT_EQ(b[i], f32_to_bf16(p[i])) << tag << ": BF16 copy at " << i << " is not bf16(params)";
      } else {
        ASSERT_EQ(b[i], uint16_t{0xFFFF}) << tag << ": BF16 padding at " << i << " was written";
        ASSERT_EQ(p[i], kPaddingParam) << tag << ": parameter padding at " << i << " was written";
        ASSERT_EQ(mm[i], 0.0f) << tag << ": exp_avg padding at " << i << " was written";
        ASSERT_EQ(vv[i], 0.0f) << tag << ": exp_avg_sq padding at " << i << " was written";
      }
    }
  }

  void expect_guards_intact() const {
    params.expect_guards_intact("params");
    grads.expect_guards_intact("grads");
    m.expect_guards_intact("exp_avg");
    v.expect_guards_intact("exp_avg_sq");
    params_bf16.expect_guards_intact("params_bf16");
    scalars.expect_guards_intact("scalars");
  }
};

std::vector<cuda::ParamSegment> layout_segments(const ParamLayout& layout) {
  std::vector<cuda::ParamSegment> s;
  for (const ParamEntry& e : layout.entries()) s.push_back({e.offset, e.numel, e.decay ? 1 : 0, 0});
  return s;
}

// The same tensors packed at odd offsets (1 element apart, first at 3): every segment starts and
// ends off a multiple of 4, so the float4 path's scalar heads and tails run, and several segments
// share a 4096-element chunk while others span chunks.
std::vector<cuda::ParamSegment> odd_segments(const ParamLayout& layout, int64_t* total) {
  std::vector<cuda::ParamSegment> s;
  int64_t at = 3;
  for (const ParamEntry& e : layout.entries()) {
    s.push_back({at, e.numel, e.decay ? 1 : 0, 0});
    at += e.numel + 1;
  }
  *total = at + 2;
  return s;
}

struct AdamWCase {
  double grad_clip;
  bool odd_offsets;
  size_t misalign;  // 4: FP32 buffers 4-byte aligned, the scalar path
};

class AdamWParity : public ::testing::TestWithParam<AdamWCase> {};

TEST_P(AdamWParity, StepsMatchCpu) {
  MOE_SKIP_WITHOUT_GPU();
  const AdamWCase c = GetParam();
  ParamLayout layout = test_layout();
  int64_t total = layout.total_numel();
  std::vector<cuda::ParamSegment> segs =
      c.odd_offsets ? odd_segments(layout, &total) : layout_segments(layout);
  AdamWHarness h(layout, test_config(c.grad_clip), segs, total, c.misalign);
  TestStream stream;
  const int64_t kSteps = 5;
  for (int64_t step = 0; step < kSteps; ++step) {
    const auto g = h.make_grads(400 + step, 0.05f);  // norm ~6: clipped when grad_clip = 1
    const double lr = lr_at(h.cfg, step, kSteps);
    const double factor = h.cpu_step(g, lr);
    h.gpu_step(g, lr, stream.get());
    const cuda::OptimStepScalars s = h.read_scalars();
    EXPECT_EQ(s.step, step + 1);
    EXPECT_EQ(s.skipped, 0);
    EXPECT_EQ(s.num_skipped, 0);
    EXPECT_NEAR(s.clip_factor, factor, 1e-12 * factor) << "step " << step;
    if (c.grad_clip > 0) {
      EXPECT_LT(s.clip_factor, 1.0) << "the test means to clip";
    }
    h.expect_matches_cpu(param_name("adamw.step", step + 1), /*exact=*/c.grad_clip <= 0);
  }
  EXPECT_EQ(h.cpu_opt.steps_taken(), kSteps);
  h.expect_guards_intact();
}

INSTANTIATE_TEST_SUITE_P(Cases, AdamWParity,
                         ::testing::Values(AdamWCase{0.0, false, 0}, AdamWCase{1.0, false, 0}, AdamWCase{0.0, true, 0},
                                           AdamWCase{1.0, true, 0}, AdamWCase{0.0, false, 4},
                                           AdamWCase{1.0, true, 4}),
                         [](const auto& info) {
                           return param_name(info.param.grad_clip > 0 ? "clip" : "noclip",
                                             info.param.odd_offsets ? "_odd_offsets" : "_layout",
                                             info.param.misalign ? "_misaligned" : "");
                         });

// A NaN and then an Inf gradient: the device skips both steps (nothing changes but the skip count),
// and the steps around them match the CPU trainer, which skips them too.
TEST(AdamW, NonFiniteGradientSkipsTheStep) {
  MOE_SKIP_WITHOUT_GPU();
  ParamLayout layout = test_layout();
  AdamWHarness h(layout, test_config(1.0), layout_segments(layout), layout.total_numel(), 0);
  TestStream stream;
  const float bad[2] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()};
  for (int64_t step = 0; step < 4; ++step) {
    auto g = h.make_grads(500 + step, 0.05f);
    const bool skip = step == 1 || step == 2;
    if (skip) g[layout.entries()[2].offset + 17] = bad[step - 1];
    const auto p_before = h.params.download(), m_before = h.m.download(), v_before = h.v.download();
    const auto b_before = h.params_bf16.download();
    const double lr = 1e-2;
    EXPECT_EQ(h.cpu_step(g, lr) == 0.0, skip);
    h.gpu_step(g, lr, stream.get());
    const cuda::OptimStepScalars s = h.read_scalars();
    EXPECT_EQ(s.skipped, skip ? 1 : 0) << "step " << step;
    EXPECT_EQ(s.num_skipped, std::min<int64_t>(step, 2)) << "step " << step;
    EXPECT_EQ(s.step, step == 3 ? 2 : 1) << "step " << step;
    if (skip) {
      EXPECT_FALSE(std::isfinite(s.grad_norm));
      EXPECT_TRUE(same_bits(h.params.download(), p_before)) << "params changed on a skipped step";
      EXPECT_TRUE(same_bits(h.m.download(), m_before)) << "exp_avg changed on a skipped step";
      EXPECT_TRUE(same_bits(h.v.download(), v_before)) << "exp_avg_sq changed on a skipped step";
      EXPECT_TRUE(bitwise_equal(h.params_bf16.download(), b_before)) << "BF16 copy changed on a skipped step";
    }
    h.expect_matches_cpu(param_name("adamw.skip.step", step + 1), /*exact=*/false);
  }
  EXPECT_EQ(h.cpu_opt.steps_taken(), 2);
  h.expect_guards_intact();
}

// grad norm + AdamW captured once; the learning rate enters through a memcpy node from pinned host
// memory. Three replays (a normal step, a NaN-gradient skip, a normal step) reproduce the eager run
// bitwise: params, moments, BF16 copy and every device scalar.
TEST(AdamW, CapturedStepReplaysLikeEager) {
  MOE_SKIP_WITHOUT_GPU();
  ParamLayout layout = test_layout();
  const int64_t total = layout.total_numel();
  AdamWHarness h(layout, test_config(1.0), layout_segments(layout), total, 0);
  std::vector<std::vector<float>> grads;
  for (int i = 0; i < 3; ++i) grads.push_back(h.make_grads(600 + i, 0.05f));
  grads[1][layout.entries()[4].offset + 99] = std::numeric_limits<float>::quiet_NaN();
  const double lrs[3] = {3e-3, 2e-3, 1e-3};
  const auto bf16_0 = h.params_bf16.download();
  const auto scalars_0 = h.scalars.download();

  struct State {
    std::vector<float> p, m, v;
    std::vector<uint16_t> b;
    cuda::OptimStepScalars s;
  };
  auto snapshot = [&] { return State{h.params.download(), h.m.download(), h.v.download(), h.params_bf16.download(),
                                     h.read_scalars()}; };
  TestStream stream;
  std::vector<State> eager;
  for (int i = 0; i < 3; ++i) {
    h.gpu_step(grads[i], lrs[i], stream.get());
    eager.push_back(snapshot());
  }
  EXPECT_EQ(eager[2].s.step, 2);
  EXPECT_EQ(eager[2].s.num_skipped, 1);

  // Back to the start.
  h.params.upload(h.params0);
  h.m.upload(std::vector<float>(static_cast<size_t>(total), 0.0f));
  h.v.upload(std::vector<float>(static_cast<size_t>(total), 0.0f));
  h.params_bf16.upload(bf16_0);
  h.scalars.upload(scalars_0);

  double* lr_pinned = nullptr;
  MOE_CUDA_CHECK(cudaMallocHost(&lr_pinned, sizeof(double)));
  cudaGraph_t graph = nullptr;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  MOE_CUDA_CHECK(
      cudaMemcpyAsync(&h.scalars.data()->lr, lr_pinned, sizeof(double), cudaMemcpyHostToDevice, stream.get()));
  h.enqueue_step(stream.get());
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) {
    h.grads.upload(grads[i]);
    *lr_pinned = lrs[i];
    settle_uploads();
    MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    stream.sync();
    const State got = snapshot();
    EXPECT_TRUE(same_bits(got.p, eager[i].p)) << "replay " << i + 1 << ": params differ from eager";
    EXPECT_TRUE(same_bits(got.m, eager[i].m)) << "replay " << i + 1 << ": exp_avg differs from eager";
    EXPECT_TRUE(same_bits(got.v, eager[i].v)) << "replay " << i + 1 << ": exp_avg_sq differs from eager";
    EXPECT_TRUE(bitwise_equal(got.b, eager[i].b)) << "replay " << i + 1 << ": BF16 copy differs from eager";
    EXPECT_EQ(std::memcmp(&got.s, &eager[i].s, sizeof(cuda::OptimStepScalars)), 0)
        << "replay " << i + 1 << ": device scalars differ from eager (step " << got.s.step << " vs "
        << eager[i].s.step << ", lr " << got.s.lr << " vs " << eager[i].s.lr << ")";
  }
  MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOE_CUDA_CHECK(cudaGraphDestroy(graph));
  MOE_CUDA_CHECK(cudaFreeHost(lr_pinned));
  h.expect_guards_intact();
}

// ---------------------------------------------------------------- ZeRO-1 pieces

// grad_sum_squares is global_grad_norm without the root: the CPU twin's sum of squares within
// 1e-12, and its square root bitwise the device norm of the same n (same blocks, same order).
TEST(GradSumSquares, MatchesCpuAndItsRootIsTheNorm) {
  MOE_SKIP_WITHOUT_GPU();
  for (const int64_t n : {int64_t(1), int64_t(4099), (int64_t{1} << 20) + 7}) {
    const auto g = random_f32(n, 203, 0.01f);
    double ref = 0;
    for (float x : g) ref += double(x) * double(x);
    GuardedBuffer<float> d_g(g, 4);  // 4-byte aligned: the scalar loads
    GuardedBuffer<double> sum(1), root(1);
    const size_t bytes = cuda::global_grad_norm_workspace_bytes(n);
    GuardedBuffer<uint8_t> ws(static_cast<int64_t>(bytes));
    TestStream stream;
    settle_uploads();
    cuda::grad_sum_squares(d_g.data(), n, sum.data(), ws.data(), bytes, stream.get());
    cuda::global_grad_norm(d_g.data(), n, root.data(), ws.data(), bytes, stream.get());
    stream.sync();
    const double got = sum.download()[0], norm = root.download()[0];
    EXPECT_NEAR(got, ref, 1e-12 * ref) << "n=" << n;
    const double r = std::sqrt(got);
    EXPECT_EQ(std::memcmp(&r, &norm, sizeof(double)), 0) << "n=" << n << ": sqrt(sum) " << r << " vs norm " << norm;
    sum.expect_guards_intact("sum");
  }
}

// sum_f64 (the step's sum of the experts' block square sums): the exact sum within FP64 rounding
// of a tree of n terms, the same bits run to run, zero for n = 0.
TEST(SumF64, MatchesCpuAndRepeats) {
  MOE_SKIP_WITHOUT_GPU();
  for (const int64_t n : {int64_t(0), int64_t(1), int64_t(98304), (int64_t{1} << 20) + 7}) {
    const auto f = random_f32(std::max<int64_t>(n, 1), 204, 1.0f);
    std::vector<double> v(static_cast<size_t>(n));
    // The reference in long double: a plain FP64 running sum of 2^20 terms can itself be off by
    // about 1e-13 relative, the tolerance below.
    long double ref_sum = 0;
    for (int64_t i = 0; i < n; ++i) ref_sum += v[size_t(i)] = double(f[size_t(i)]) * double(f[size_t(i)]);
    const double ref = static_cast<double>(ref_sum);
    GuardedBuffer<double> d_v(std::max<int64_t>(n, 1)), sum(1), again(1);
    if (n > 0) d_v.upload(v);
    const size_t bytes = cuda::global_grad_norm_workspace_bytes(std::max<int64_t>(n, 1));
    GuardedBuffer<uint8_t> ws(static_cast<int64_t>(bytes));
    TestStream stream;
    settle_uploads();
    cuda::sum_f64(d_v.data(), n, sum.data(), ws.data(), bytes, stream.get());
    cuda::sum_f64(d_v.data(), n, again.data(), ws.data(), bytes, stream.get());
    stream.sync();
    const double got = sum.download()[0], got2 = again.download()[0];
    EXPECT_NEAR(got, ref, 1e-13 * ref) << "n=" << n;
    if (n == 0) {
      EXPECT_EQ(got, 0.0);
    }
    EXPECT_EQ(std::memcmp(&got, &got2, sizeof(double)), 0) << "n=" << n;
    sum.expect_guards_intact("sum");
    d_v.expect_guards_intact("values");
  }
}

// AdamW on a shard: the segments of rank 1 of 3 (FlatShardPlan: its chunk and the replicated
// tail, cut at the layout's entries) with compact moments [state_numel]; and the same segments
// with their moments shifted by one element (no float4 path). Updated elements are bitwise the
// CPU AdamW's on the whole layout, moments at their state offsets bitwise the CPU's, and every
// other element (other ranks' chunks, padding) unchanged.
TEST(AdamW, ShardedMomentsMatchCpu) {
  MOE_SKIP_WITHOUT_GPU();
  const ParamLayout layout = test_layout();
  const int64_t total = layout.total_numel();
  const OptimConfig cfg = test_config(/*grad_clip=*/0.0);
  const FlatShardPlan plan({{0, total, 0}}, {3}, {1}, 1 << 20, 64);
  for (const int64_t shift : {int64_t(0), int64_t(1)}) {
    std::vector<cuda::ParamSegment> segs;
    for (const ShardSegment& z : plan.segments(layout))
      segs.push_back({z.offset, z.numel, z.decay ? 1 : 0, 0, z.state_offset + shift});
    ASSERT_GE(segs.size(), 2u);
    const int64_t state_numel = plan.state_numel() + shift;
    cuda::ParamSegmentTable table(segs, total, state_numel);
    EXPECT_EQ(table.states_vec4(), shift == 0);
    std::vector<float> p0 = random_f32(total, 11, 1.0f);
    std::vector<float> cpu_p = p0, cpu_m(size_t(total), 0.f), cpu_v(size_t(total), 0.f);
    GuardedBuffer<float> d_p(p0), d_g(total), d_m(std::vector<float>(size_t(state_numel), 0.f)),
        d_v(std::vector<float>(size_t(state_numel), 0.f));
    GuardedBuffer<uint16_t> d_b(std::vector<uint16_t>(size_t(total), 0));
    GuardedBuffer<cuda::OptimStepScalars> sc(std::vector<cuda::OptimStepScalars>(1));
    TestStream stream;
    for (int64_t t = 1; t <= 3; ++t) {
      const std::vector<float> g = random_f32(total, 100 + uint64_t(t), 0.1f);
      d_g.upload(g);
      std::vector<cuda::OptimStepScalars> s = sc.download();
      s[0].lr = 1e-2 / double(t);
      s[0].grad_norm = 1.0;
      sc.upload(s);
      settle_uploads();
      cuda::adamw_step(table, cfg, d_p.data(), d_g.data(), d_m.data(), d_v.data(), d_b.data(), sc.data(), stream.get());
      stream.sync();
      const AdamWCoefs c = adamw_coefs(cfg, t, 1e-2 / double(t));
      for (const ParamEntry& e : layout.entries())
        adamw_update(cpu_p.data() + e.offset, g.data() + e.offset, cpu_m.data() + e.offset, cpu_v.data() + e.offset,
                     e.numel, c, e.decay);
    }
    const std::vector<float> p = d_p.download(), m = d_m.download(), v = d_v.download();
    const std::vector<uint16_t> b = d_b.download();
    std::vector<char> updated(size_t(total), 0);
    size_t bad_p = 0, bad_m = 0, bad_b = 0;
    for (const cuda::ParamSegment& seg : segs)
      for (int64_t i = 0; i < seg.numel; ++i) {
        const size_t f = size_t(seg.offset + i), st = size_t(seg.state_offset + i);
        updated[f] = 1;
        bad_p += std::memcmp(&p[f], &cpu_p[f], 4) != 0;
        bad_m += std::memcmp(&m[st], &cpu_m[f], 4) != 0 || std::memcmp(&v[st], &cpu_v[f], 4) != 0;
        bad_b += b[f] != f32_to_bf16(cpu_p[f]);
      }
    size_t touched = 0;
    for (int64_t i = 0; i < total; ++i)
      if (!updated[size_t(i)]) touched += std::memcmp(&p[size_t(i)], &p0[size_t(i)], 4) != 0 || b[size_t(i)] != 0;
    EXPECT_EQ(bad_p, 0u) << "shift " << shift << ": updated parameters differ from the CPU";
    EXPECT_EQ(bad_m, 0u) << "shift " << shift << ": moments differ from the CPU's at their state offsets";
    EXPECT_EQ(bad_b, 0u) << "shift " << shift << ": BF16 copy";
    EXPECT_EQ(touched, 0u) << "shift " << shift << ": elements outside the shard were written";
    d_m.expect_guards_intact("exp_avg");
    d_v.expect_guards_intact("exp_avg_sq");
  }
}

// adamw_apply kept to a few multiprocessors (sms > 0: one resident block on each, walking the
// chunks; the deferred update beside the forward) against the block-per-chunk launch: the same
// parameters, moments and BF16 copy bit for bit. Moments at the flat offsets take the bulk-copy
// ring (optim_resident.cuh; 15 chunks on 2 blocks wrap its 3 stages twice); moments shifted by 4
// or 1 element take the plain loads (float4 and scalar). Segments start and end off the float4
// grid, a gap between them stays unwritten; the step is clipped.
TEST(AdamW, OnAFewMultiprocessorsIsTheFullLaunchBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  const OptimConfig cfg = test_config(/*grad_clip=*/0.5);
  const int64_t total = 60016;  // a multiple of 4: the bulk copies take the last, partial chunk
  for (const int64_t shift : {int64_t(0), int64_t(4), int64_t(1)}) {
    const std::vector<cuda::ParamSegment> segs = {{0, 10000, 1, 0, shift},
                                                  {10003, 30001, 0, 0, 10003 + shift},
                                                  {40008, 5, 1, 0, 40008 + shift},
                                                  {40016, 20000, 1, 0, 40016 + shift}};
    const int64_t state_numel = total + shift;
    const cuda::ParamSegmentTable table(segs, total, state_numel);
    EXPECT_EQ(table.states_vec4(), shift % 4 == 0);
    EXPECT_EQ(table.states_at_offsets(), shift == 0);
    ASSERT_EQ(table.num_chunks(), 15);
    const std::vector<float> p0 = random_f32(total, 21, 1.0f), g = random_f32(total, 22, 0.1f);
    std::vector<float> m0 = random_f32(state_numel, 23, 0.01f), v0 = random_f32(state_numel, 24, 1e-3f);
    for (float& x : v0) x = std::fabs(x);
    std::vector<cuda::OptimStepScalars> sc0(1);
    sc0[0].lr = 1e-2;
    sc0[0].grad_norm = 2.0;  // above grad_clip: the clip factor applies
    sc0[0].step = 2;
    struct State {
      GuardedBuffer<float> p, g, m, v;
      GuardedBuffer<uint16_t> b;
      GuardedBuffer<cuda::OptimStepScalars> sc;
    };
    auto fresh = [&] {
      return State{GuardedBuffer<float>(p0), GuardedBuffer<float>(g), GuardedBuffer<float>(m0),
                   GuardedBuffer<float>(v0), GuardedBuffer<uint16_t>(std::vector<uint16_t>(size_t(total), 0)),
                   GuardedBuffer<cuda::OptimStepScalars>(sc0)};
    };
    State full = fresh(), few = fresh();
    settle_uploads();
    TestStream stream;
    cuda::adamw_prepare(cfg, full.sc.data(), stream.get());
    cuda::adamw_apply(table, cfg, full.p.data(), full.g.data(), full.m.data(), full.v.data(), full.b.data(),
                      full.sc.data(), false, stream.get());
    cuda::adamw_prepare(cfg, few.sc.data(), stream.get());
    cuda::adamw_apply(table, cfg, few.p.data(), few.g.data(), few.m.data(), few.v.data(), few.b.data(), few.sc.data(),
                      false, stream.get(), /*sms=*/2);
    stream.sync();
    const std::string w = "shift " + std::to_string(shift);
    const std::vector<float> p = few.p.download();
    EXPECT_FALSE(same_bits(p, p0)) << w << ": the update changed nothing";
    EXPECT_TRUE(same_bits(std::vector<float>(p.begin() + 40004, p.begin() + 40008),
                          std::vector<float>(p0.begin() + 40004, p0.begin() + 40008)))
        << w << ": the gap between segments was written";
    EXPECT_TRUE(same_bits(p, full.p.download())) << w << ": parameters";
    EXPECT_TRUE(same_bits(few.m.download(), full.m.download())) << w << ": exp_avg";
    EXPECT_TRUE(same_bits(few.v.download(), full.v.download())) << w << ": exp_avg_sq";
    EXPECT_EQ(few.b.download(), full.b.download()) << w << ": BF16 copy";
    few.p.expect_guards_intact("params");
    few.m.expect_guards_intact("exp_avg");
    few.v.expect_guards_intact("exp_avg_sq");
    few.b.expect_guards_intact("params_bf16");
  }
  EXPECT_THROW(cuda::adamw_apply(cuda::ParamSegmentTable(test_layout()), test_config(0.0), nullptr, nullptr,
                                 static_cast<float*>(nullptr), static_cast<float*>(nullptr), nullptr, nullptr, false,
                                 nullptr, -1),
               Error);
}

// The float4 update (one range check for four square roots and four quotients, then the
// compiler's fast sequences; optim.cuh) against the scalar update (the intrinsics, a branch an
// element) over values whose exponents span every binade, zeros, subnormals, infinities and
// NaNs included, with clipping: parameters, moments and BF16 copy bitwise. The scalar path is
// taken by handing the table buffers one float past a 16-byte boundary; the update on a
// few multiprocessors (the bulk-copy ring) gives the float4 path's bits too.
TEST(AdamW, Float4PathIsTheScalarPathOverEveryExponent) {
  MOE_SKIP_WITHOUT_GPU();
  const OptimConfig cfg = test_config(/*grad_clip=*/0.5);
  constexpr int64_t n = int64_t{1} << 22;
  std::mt19937_64 rng(20261206);
  auto any_float = [&](bool non_negative) {
    const uint64_t r = rng();
    const uint32_t exponent = static_cast<uint32_t>(r % 256);
    const uint32_t mantissa = static_cast<uint32_t>(r >> 8) & 0x7fffffu;
    const uint32_t sign = non_negative ? 0u : static_cast<uint32_t>(r >> 63);
    return std::bit_cast<float>((sign << 31) | (exponent << 23) | mantissa);
  };
  std::vector<float> p0(size_t(n + 1)), g(size_t(n + 1)), m0(size_t(n + 1)), v0(size_t(n + 1));
  for (int64_t i = 0; i < n + 1; ++i) {
    p0[size_t(i)] = any_float(false);
    g[size_t(i)] = any_float(false);
    m0[size_t(i)] = any_float(false);
    v0[size_t(i)] = any_float(i % 64 != 0);  // a few negative second moments too (NaN roots)
  }
  std::vector<cuda::OptimStepScalars> sc0(1);
  sc0[0].lr = 1e-2;
  sc0[0].grad_norm = 2.0;
  sc0[0].step = 3;
  const cuda::ParamSegmentTable table({{0, n, 1, 0, 0}}, n, n);
  struct State {
    GuardedBuffer<float> p, g, m, v;
    GuardedBuffer<uint16_t> b;
    GuardedBuffer<cuda::OptimStepScalars> sc;
  };
  // shifted: the values one element later in the buffers (the scalar run reads them at data() + 1).
  auto fresh = [&](bool shifted) {
    auto at = [&](const std::vector<float>& x) {
      if (!shifted) return x;
      std::vector<float> y(x.size());
      std::copy(x.begin(), x.end() - 1, y.begin() + 1);
      return y;
    };
    return State{GuardedBuffer<float>(at(p0)), GuardedBuffer<float>(at(g)), GuardedBuffer<float>(at(m0)),
                 GuardedBuffer<float>(at(v0)), GuardedBuffer<uint16_t>(std::vector<uint16_t>(size_t(n + 1), 0)),
                 GuardedBuffer<cuda::OptimStepScalars>(sc0)};
  };
  State vec = fresh(false), scalar = fresh(true), few = fresh(false);
  settle_uploads();
  TestStream stream;
  cuda::adamw_prepare(cfg, vec.sc.data(), stream.get());
  cuda::adamw_apply(table, cfg, vec.p.data(), vec.g.data(), vec.m.data(), vec.v.data(), vec.b.data(), vec.sc.data(),
                    false, stream.get());
  cuda::adamw_prepare(cfg, scalar.sc.data(), stream.get());
  cuda::adamw_apply(table, cfg, scalar.p.data() + 1, scalar.g.data() + 1, scalar.m.data() + 1, scalar.v.data() + 1,
                    scalar.b.data() + 1, scalar.sc.data(), false, stream.get());
  cuda::adamw_prepare(cfg, few.sc.data(), stream.get());
  cuda::adamw_apply(table, cfg, few.p.data(), few.g.data(), few.m.data(), few.v.data(), few.b.data(), few.sc.data(),
                    false, stream.get(), /*sms=*/4);
  stream.sync();
  auto head = [](const std::vector<float>& x) { return std::vector<float>(x.begin(), x.end() - 1); };
  auto tail = [](const std::vector<float>& x) { return std::vector<float>(x.begin() + 1, x.end()); };
  const std::vector<float> pv = vec.p.download();
  EXPECT_FALSE(same_bits(head(pv), head(p0))) << "the update changed nothing";
  EXPECT_TRUE(same_bits(head(pv), tail(scalar.p.download()))) << "parameters";
  EXPECT_TRUE(same_bits(head(vec.m.download()), tail(scalar.m.download()))) << "exp_avg";
  EXPECT_TRUE(same_bits(head(vec.v.download()), tail(scalar.v.download()))) << "exp_avg_sq";
  const std::vector<uint16_t> bv = vec.b.download(), bs = scalar.b.download();
  EXPECT_TRUE(std::equal(bv.begin(), bv.end() - 1, bs.begin() + 1)) << "BF16 copy";
  EXPECT_TRUE(same_bits(pv, few.p.download())) << "parameters, few multiprocessors";
  EXPECT_TRUE(same_bits(vec.m.download(), few.m.download())) << "exp_avg, few multiprocessors";
  EXPECT_TRUE(same_bits(vec.v.download(), few.v.download())) << "exp_avg_sq, few multiprocessors";
  EXPECT_EQ(bv, few.b.download()) << "BF16 copy, few multiprocessors";
}

// Validation happens on the host before any device call (these run without a GPU).
// ---------------------------------------------------------------- AdamW with the FP8 weight codes

// cuda::adamw_apply_fp8_weights against its two passes (adamw_apply of the same segment, then
// fp8_quantize_weights of the updated BF16 copy) from the same state: parameters, moments, BF16
// copy (the padding around the segment untouched), codes, scales and transposed copies bitwise,
// without clipping, with clipping (grad_clip 0.5 under a norm of 2) and on a skipped step (a NaN
// norm: nothing written, codes included); without clipping the parameters and codes are also
// the CPU twin's (moe::adamw_update_fp8_weights). Moments at other offsets than the parameters.
// Under each FP8 rule: the block recipe's and the two MX ones (the column copy quantised on its own).
TEST(AdamWFp8Weights, UpdateAndCodesAreTheTwoPassesBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t E = 2, n = 256, k = 384, numel = E * n * k, offset = 64, total = offset + numel + 32;
  const int64_t shift = 8, state_numel = total + shift;
  const cuda::ParamSegment seg{offset, numel, 1, 0, offset + shift};
  const cuda::ParamSegmentTable table({seg}, total, state_numel);
  const std::vector<float> p0 = random_f32(total, 41, 0.05f), g = random_f32(total, 42, 0.02f);
  std::vector<float> m0 = random_f32(state_numel, 43, 0.01f), v0 = random_f32(state_numel, 44, 1e-4f);
  for (float& x : v0) x = std::fabs(x);
  const std::vector<uint16_t> b0(size_t(total), 0x3f80);  // 1.0: the padding's BF16 stays so
  const std::vector<uint8_t> q0(size_t(numel), 0xab);
  const int64_t ns = E * (n / 128) * (k / 128);
  const std::vector<float> s0(size_t(ns), -3.0f);
  struct Case {
    const char* name;
    double grad_clip, norm;
  };
  for (const Fp8Rule rule : {Fp8Rule::kBlocks, Fp8Rule::kMx, Fp8Rule::kMxNoSaturation})
  for (const Case cs : {Case{"unclipped", 0.0, 1.0}, Case{"clipped", 0.5, 2.0},
                        Case{"skipped", 1.0, std::numeric_limits<double>::quiet_NaN()}}) {
    const OptimConfig cfg = test_config(cs.grad_clip);
    struct State {
      GuardedBuffer<float> p, g, m, v, s, st;
      GuardedBuffer<uint16_t> b;
      GuardedBuffer<uint8_t> q, qt;
      GuardedBuffer<cuda::OptimStepScalars> sc;
    };
    std::vector<cuda::OptimStepScalars> sc0(1);
    sc0[0].lr = 1e-2;
    sc0[0].grad_norm = cs.norm;
    sc0[0].step = 4;
    auto fresh = [&] {
      return State{GuardedBuffer<float>(p0), GuardedBuffer<float>(g), GuardedBuffer<float>(m0),
                   GuardedBuffer<float>(v0), GuardedBuffer<float>(s0), GuardedBuffer<float>(s0),
                   GuardedBuffer<uint16_t>(b0), GuardedBuffer<uint8_t>(q0), GuardedBuffer<uint8_t>(q0),
                   GuardedBuffer<cuda::OptimStepScalars>(sc0)};
    };
    State two = fresh(), one = fresh();
    settle_uploads();
    TestStream stream;
    cuda::adamw_prepare(cfg, two.sc.data(), stream.get());
    cuda::adamw_apply(table, cfg, two.p.data(), two.g.data(), two.m.data(), two.v.data(), two.b.data(), two.sc.data(),
                      false, stream.get());
    stream.sync();
    if (two.sc.download()[0].skipped == 0) {
      cuda::fp8_quantize_weights(two.b.data() + offset, E, n, k, Fp8Format::kE4M3, two.q.data(), two.s.data(),
                                 two.qt.data(), two.st.data(), nullptr, stream.get(), rule);
    }
    cuda::adamw_prepare(cfg, one.sc.data(), stream.get());
    cuda::adamw_apply_fp8_weights(seg, E, n, k, cfg, one.p.data(), one.g.data(), one.m.data(), one.v.data(),
                                  one.b.data(), Fp8Format::kE4M3, one.q.data(), one.s.data(), one.qt.data(),
                                  one.st.data(), nullptr, one.sc.data(), false, stream.get(), rule);
    stream.sync();
    const std::string w = std::string(cs.name) + " rule " + std::to_string(int(rule));
    EXPECT_TRUE(same_bits(one.p.download(), two.p.download())) << w << ": parameters";
    EXPECT_TRUE(same_bits(one.m.download(), two.m.download())) << w << ": exp_avg";
    EXPECT_TRUE(same_bits(one.v.download(), two.v.download())) << w << ": exp_avg_sq";
    EXPECT_EQ(one.b.download(), two.b.download()) << w << ": BF16 copy";
    EXPECT_EQ(one.q.download(), two.q.download()) << w << ": codes";
    EXPECT_EQ(one.qt.download(), two.qt.download()) << w << ": transposed codes";
    EXPECT_TRUE(same_bits(one.s.download(), two.s.download())) << w << ": scales";
    EXPECT_TRUE(same_bits(one.st.download(), two.st.download())) << w << ": transposed scales";
    const std::vector<uint16_t> b = one.b.download();
    size_t padding = 0;
    for (int64_t i = 0; i < total; ++i)
      if (i < offset || i >= offset + numel) padding += b[size_t(i)] != 0x3f80;
    EXPECT_EQ(padding, 0u) << w << ": BF16 copy written outside the segment";
    if (std::string(cs.name) == "skipped") {
      EXPECT_EQ(one.sc.download()[0].skipped, 1) << w;
      EXPECT_EQ(one.q.download(), q0) << w << ": codes written on a skipped step";
      EXPECT_TRUE(same_bits(one.p.download(), p0)) << w << ": parameters written on a skipped step";
    }
    if (std::string(cs.name) == "unclipped") {
      const std::string r = " (rule " + std::to_string(int(rule)) + ")";
      // The CPU twin (adamw_update, bitwise the GPU's without clipping, then the quantiser).
      std::vector<float> cp(p0.begin() + offset, p0.begin() + offset + numel);
      std::vector<float> cm(m0.begin() + offset + shift, m0.begin() + offset + shift + numel);
      std::vector<float> cv(v0.begin() + offset + shift, v0.begin() + offset + shift + numel);
      std::vector<uint8_t> cq(static_cast<size_t>(numel)), cqt(static_cast<size_t>(numel));
      std::vector<float> cs_(static_cast<size_t>(ns)), cst(static_cast<size_t>(ns));
      adamw_update_fp8_weights(cp.data(), g.data() + offset, cm.data(), cv.data(), E, n, k, adamw_coefs(cfg, 5, 1e-2),
                               true, Fp8Format::kE4M3, cq.data(), cs_.data(), cqt.data(), cst.data(), rule);
      const std::vector<float> gp = one.p.download();
      EXPECT_TRUE(same_bits(std::vector<float>(gp.begin() + offset, gp.begin() + offset + numel), cp))
          << "parameters against the CPU twin" << r;
      EXPECT_EQ(one.q.download(), cq) << "codes against the CPU" << r;
      EXPECT_EQ(one.qt.download(), cqt) << "transposed codes against the CPU" << r;
      EXPECT_TRUE(same_bits(one.s.download(), cs_)) << "scales against the CPU" << r;
      EXPECT_TRUE(same_bits(one.st.download(), cst)) << "transposed scales against the CPU" << r;
    }
  }
}

// optim.moment_dtype = "bf16": the moments held as BF16 bits (read widened, the update in FP32,
// stored rounded to nearest even) on every path of the update, each bitwise the CPU twin
// (adamw_update with AdamWCoefs::bf16_moments, which reads and keeps the moments as BF16 values):
// the block-per-chunk launch (float4, and scalar where the moments sit 1 element off or the
// buffers are misaligned), a few multiprocessors (the bulk-copy ring with its BF16 stages, and the
// plain loads), and the experts' update that writes their FP8 codes. The overload taken must
// match the config: FP32 buffers with a bf16 config are refused, and BF16 ones with fp32.
TEST(AdamW, Bf16MomentsAreTheCpuTwinOnEveryPath) {
  MOE_SKIP_WITHOUT_GPU();
  OptimConfig cfg = test_config(/*grad_clip=*/0.0);
  cfg.moment_dtype = "bf16";
  const AdamWCoefs coefs = adamw_coefs(cfg, 3, 1e-2);  // the step after sc.step = 2, at lr 1e-2
  ASSERT_TRUE(coefs.bf16_moments);
  auto bits_of = [](const std::vector<float>& x) {
    std::vector<uint16_t> b(x.size());
    for (size_t i = 0; i < x.size(); ++i) b[i] = f32_to_bf16(x[i]);
    return b;
  };
  std::vector<cuda::OptimStepScalars> sc0(1);
  sc0[0].lr = 1e-2;
  sc0[0].grad_norm = 1.0;
  sc0[0].step = 2;
  const int64_t total = 60016;
  struct Path {
    const char* name;
    int64_t shift;     // moments at offset + shift
    int sms;           // 0: a block per chunk
    size_t misalign;   // bytes added to the FP32 buffers (half of it to the BF16 ones)
  };
  for (const Path path : {Path{"float4", 0, 0, 0}, Path{"scalar (shift 1)", 1, 0, 0}, Path{"misaligned", 0, 0, 4},
                          Path{"ring on 2 SMs", 0, 2, 0}, Path{"plain loads on 2 SMs", 4, 2, 0}}) {
    const int64_t shift = path.shift, state_numel = total + shift;
    const std::vector<cuda::ParamSegment> segs = {{0, 10000, 1, 0, shift},
                                                  {10003, 30001, 0, 0, 10003 + shift},
                                                  {40008, 5, 1, 0, 40008 + shift},
                                                  {40016, 20000, 1, 0, 40016 + shift}};
    const cuda::ParamSegmentTable table(segs, total, state_numel);
    const std::vector<float> p0 = random_f32(total, 51, 1.0f), g = random_f32(total, 52, 0.1f);
    std::vector<float> v_init = random_f32(state_numel, 54, 1e-3f);
    for (float& x : v_init) x = std::fabs(x);
    const std::vector<uint16_t> m0 = bits_of(random_f32(state_numel, 53, 0.01f)), v0 = bits_of(v_init);
    GuardedBuffer<float> p(p0, path.misalign), gd(g, path.misalign);
    GuardedBuffer<uint16_t> m(m0, path.misalign / 2), v(v0, path.misalign / 2);
    GuardedBuffer<uint16_t> b(std::vector<uint16_t>(size_t(total), 0), path.misalign / 2);
    GuardedBuffer<cuda::OptimStepScalars> sc(sc0);
    settle_uploads();
    TestStream stream;
    cuda::adamw_prepare(cfg, sc.data(), stream.get());
    cuda::adamw_apply(table, cfg, p.data(), gd.data(), m.data(), v.data(), b.data(), sc.data(), false, stream.get(),
                      path.sms);
    stream.sync();
    // The CPU twin, segment by segment.
    std::vector<float> cp = p0, cm = bf16_to_f32(m0), cv = bf16_to_f32(v0);
    for (const cuda::ParamSegment& s : segs)
      adamw_update(cp.data() + s.offset, g.data() + s.offset, cm.data() + s.state_offset, cv.data() + s.state_offset,
                   s.numel, coefs, s.decay != 0);
    const std::string w = path.name;
    const std::vector<float> gp = p.download();
    EXPECT_FALSE(same_bits(gp, p0)) << w << ": the update changed nothing";
    EXPECT_TRUE(same_bits(gp, cp)) << w << ": parameters against the CPU twin";
    EXPECT_EQ(m.download(), bits_of(cm)) << w << ": exp_avg against the CPU twin";
    EXPECT_EQ(v.download(), bits_of(cv)) << w << ": exp_avg_sq against the CPU twin";
    std::vector<uint16_t> want_b(size_t(total), 0);
    for (const cuda::ParamSegment& s : segs)
      for (int64_t i = s.offset; i < s.offset + s.numel; ++i) want_b[size_t(i)] = f32_to_bf16(cp[size_t(i)]);
    EXPECT_EQ(b.download(), want_b) << w << ": BF16 copy";
    p.expect_guards_intact("params");
    m.expect_guards_intact("exp_avg");
    v.expect_guards_intact("exp_avg_sq");
    b.expect_guards_intact("params_bf16");
  }

  // The experts' update with their FP8 codes.
  {
    const int64_t E = 2, n = 256, k = 384, numel = E * n * k, offset = 64, etotal = offset + numel + 32, shift = 8;
    const cuda::ParamSegment seg{offset, numel, 1, 0, offset + shift};
    const std::vector<float> p0 = random_f32(etotal, 61, 0.05f), g = random_f32(etotal, 62, 0.02f);
    std::vector<float> v_init = random_f32(etotal + shift, 64, 1e-4f);
    for (float& x : v_init) x = std::fabs(x);
    const std::vector<uint16_t> m0 = bits_of(random_f32(etotal + shift, 63, 0.01f)), v0 = bits_of(v_init);
    const int64_t ns = E * (n / 128) * (k / 128);
    GuardedBuffer<float> p(p0), gd(g), s(ns), st(ns);
    GuardedBuffer<uint16_t> m(m0), v(v0);
    GuardedBuffer<uint8_t> q(numel), qt(numel);
    GuardedBuffer<cuda::OptimStepScalars> sc(sc0);
    settle_uploads();
    TestStream stream;
    cuda::adamw_prepare(cfg, sc.data(), stream.get());
    cuda::adamw_apply_fp8_weights(seg, E, n, k, cfg, p.data(), gd.data(), m.data(), v.data(), nullptr,
                                  Fp8Format::kE4M3, q.data(), s.data(), qt.data(), st.data(), nullptr, sc.data(),
                                  false, stream.get());
    stream.sync();
    std::vector<float> cp(p0.begin() + offset, p0.begin() + offset + numel);
    const std::vector<float> mv = bf16_to_f32(m0), vv = bf16_to_f32(v0);
    std::vector<float> cm(mv.begin() + offset + shift, mv.begin() + offset + shift + numel);
    std::vector<float> cv(vv.begin() + offset + shift, vv.begin() + offset + shift + numel);
    std::vector<uint8_t> cq(static_cast<size_t>(numel)), cqt(static_cast<size_t>(numel));
    std::vector<float> cs(static_cast<size_t>(ns)), cst(static_cast<size_t>(ns));
    adamw_update_fp8_weights(cp.data(), g.data() + offset, cm.data(), cv.data(), E, n, k, coefs, true,
                             Fp8Format::kE4M3, cq.data(), cs.data(), cqt.data(), cst.data());
    const std::vector<float> gp = p.download();
    EXPECT_TRUE(same_bits(std::vector<float>(gp.begin() + offset, gp.begin() + offset + numel), cp))
        << "FP8 experts' update: parameters against the CPU twin";
    const std::vector<uint16_t> gm = m.download(), gv = v.download();
    EXPECT_EQ(std::vector<uint16_t>(gm.begin() + offset + shift, gm.begin() + offset + shift + numel), bits_of(cm))
        << "FP8 experts' update: exp_avg";
    EXPECT_EQ(std::vector<uint16_t>(gv.begin() + offset + shift, gv.begin() + offset + shift + numel), bits_of(cv))
        << "FP8 experts' update: exp_avg_sq";
    EXPECT_EQ(q.download(), cq) << "FP8 experts' update: codes";
    EXPECT_EQ(qt.download(), cqt) << "FP8 experts' update: transposed codes";
    EXPECT_TRUE(same_bits(s.download(), cs)) << "FP8 experts' update: scales";
  }

  // The buffers' type must be the config's.
  const cuda::ParamSegmentTable table(test_layout());
  const int64_t n = table.total_numel();
  GuardedBuffer<float> p(n), g(n), m32(n), v32(n);
  GuardedBuffer<uint16_t> m16(n), v16(n);
  GuardedBuffer<cuda::OptimStepScalars> sc(sc0);
  EXPECT_THROW(cuda::adamw_apply(table, cfg, p.data(), g.data(), m32.data(), v32.data(), nullptr, sc.data(), false,
                                 nullptr),
               Error);
  EXPECT_THROW(cuda::adamw_apply(table, test_config(0.0), p.data(), g.data(), m16.data(), v16.data(), nullptr,
                                 sc.data(), false, nullptr),
               Error);
}

TEST(AdamWFp8Weights, RefusesShapesOffsetsAndAlignment) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t E = 1, n = 128, k = 128, numel = E * n * k;
  GuardedBuffer<float> p(numel + 8), g(numel + 8), m(numel + 8), v(numel + 8), s(4), st(4);
  GuardedBuffer<uint8_t> q(numel + 16), qt(numel);
  GuardedBuffer<cuda::OptimStepScalars> sc(std::vector<cuda::OptimStepScalars>(1));
  const OptimConfig cfg = test_config(0.0);
  TestStream stream;
  auto call = [&](cuda::ParamSegment seg, int64_t nn, int64_t kk, uint8_t* qq) {
    cuda::adamw_apply_fp8_weights(seg, E, nn, kk, cfg, p.data(), g.data(), m.data(), v.data(), nullptr,
                                  Fp8Format::kE4M3, qq, s.data(), qt.data(), st.data(), nullptr, sc.data(), false,
                                  stream.get());
  };
  EXPECT_THROW(call({0, E * 128 * 64, 1, 0, -1}, 128, 64, q.data()), Error);  // k not a multiple of 128
  EXPECT_THROW(call({0, numel - 1, 1, 0, -1}, n, k, q.data()), Error);       // numel not E n k
  EXPECT_THROW(call({2, numel, 1, 0, -1}, n, k, q.data()), Error);           // offset not a multiple of 4
  EXPECT_THROW(call({0, numel, 1, 0, 2}, n, k, q.data()), Error);            // moments' shift not a multiple of 4
  EXPECT_THROW(call({0, numel, 1, 0, -1}, n, k, q.data() + 8), Error);       // codes not 16-byte aligned
  stream.sync();
}

TEST(ParamSegmentTable, RejectsOverlapsAndOutOfRangeSegments) {
  auto message = [](std::vector<cuda::ParamSegment> s, int64_t total) -> std::string {
    try {
      cuda::ParamSegmentTable t(std::move(s), total);
    } catch (const moe::Error& e) {
      return e.what();
    }
    return "";
  };
  const std::string overlap = message({{0, 10, 1, 0}, {8, 4, 0, 0}}, 64);
  EXPECT_NE(overlap.find("segment 1 starts at 8 inside the previous one"), std::string::npos) << overlap;
  const std::string outside = message({{0, 10, 1, 0}, {60, 5, 0, 0}}, 64);
  EXPECT_NE(outside.find("outside the flat buffer of 64 elements"), std::string::npos) << outside;
  const std::string decay = message({{0, 10, 2, 0}}, 64);
  EXPECT_NE(decay.find("decay 2"), std::string::npos) << decay;
  auto with_state = [](std::vector<cuda::ParamSegment> s, int64_t total, int64_t state) -> std::string {
    try {
      cuda::ParamSegmentTable t(std::move(s), total, state);
    } catch (const moe::Error& e) {
      return e.what();
    }
    return "";
  };
  const std::string state_out = with_state({{0, 10, 1, 0, 8}}, 64, 16);
  EXPECT_NE(state_out.find("outside the moment buffers of 16 elements"), std::string::npos) << state_out;
  const std::string shared = with_state({{0, 10, 1, 0, 0}, {32, 10, 1, 0, 5}}, 64, 16);
  EXPECT_NE(shared.find("share moments"), std::string::npos) << shared;
}

// A valid table with moment offsets is built (its upload needs a GPU).
TEST(ParamSegmentTable, AcceptsDisjointMomentOffsets) {
  MOE_SKIP_WITHOUT_GPU();
  EXPECT_NO_THROW(cuda::ParamSegmentTable({{0, 10, 1, 0, 0}, {32, 10, 1, 0, 10}}, 64, 20));
}

// The chunks an update launches blocks for: those the segments touch, as runs (a chunk two
// segments share counted once, adjacent chunks one run); the gaps between them get no block.
TEST(ParamSegmentTable, ChunkRunsCoverOnlyTheTouchedChunks) {
  MOE_SKIP_WITHOUT_GPU();
  const cuda::ParamSegmentTable t({{0, 10, 1, 0}, {4090, 10, 1, 0}, {100000, 5, 0, 0}, {200000, 8192, 1, 0},
                                   {208192, 0, 1, 0}, {208200, 4, 1, 0}},
                                  300000);
  EXPECT_EQ(t.num_chunk_runs(), 3);  // chunks 0-1, 24, 48-50 (the last segment ends in chunk 50)
  EXPECT_EQ(t.num_chunks(), 2 + 1 + 3);
  const cuda::ParamSegmentTable empty({}, 100);
  EXPECT_EQ(empty.num_chunks(), 0);
  EXPECT_EQ(empty.num_chunk_runs(), 0);
}

}  // namespace
}  // namespace moe::testing
