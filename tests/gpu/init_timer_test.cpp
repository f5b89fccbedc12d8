// cuda/ops/init.h against Model<float>::init_params and core/rng.h (every tensor within 1e-6 std,
// almost every element bitwise, norms exactly 1, padding untouched, resampled elements included),
// and cuda/event_timer.h on work of known relative size (phases positive, the larger one larger,
// collect() resets, reopened phases add up, capture refused).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/rng.h"
#include "cuda/event_timer.h"
#include "cuda/ops/init.h"
#include "cuda/ops/memory.h"
#include "gpu_test_util.h"
#include "model/layout.h"
#include "model/model.h"

namespace moe::testing {
namespace {

// Every kind of tensor: dense layer 0, MoE layers with a shared expert, QK-norm, awkward widths.
void init_test_config(ModelConfig& m, MoeConfig& e) {
  m.vocab_size = 301;
  m.d_model = 96;
  m.n_layers = 3;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.qk_norm = true;
  m.dense_layers = {0};
  m.dense_hidden = 136;
  m.init_std = 0.02;
  e.num_experts = 8;
  e.top_k = 2;
  e.expert_hidden = 72;
  e.shared_experts = 1;
}

// The device init of `layout` into a guarded buffer whose data starts as 0xFF bytes.
std::vector<float> device_init(const ParamLayout& layout, uint64_t seed, double std) {
  GuardedBuffer<float> buf(layout.total_numel());
  TestStream s;
  cuda::init_params(layout, buf.data(), seed, std, s.get());
  s.sync();
  buf.expect_guards_intact("params");
  return buf.download();
}

bool is_unwritten(float v) {
  uint32_t bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  return bits == 0xFFFFFFFFu;
}

TEST(CudaInit, MatchesHostInitParamsEveryTensor) {
  MOE_SKIP_WITHOUT_GPU();
  ModelConfig m;
  MoeConfig e;
  init_test_config(m, e);
  const uint64_t seed = 20261201;
  Model<float> host(m, e);
  host.init_params(seed);
  const ParamLayout& layout = host.layout();
  const std::vector<float> got = device_init(layout, seed, m.init_std);
  const float* want = host.params();

  int64_t resampled = 0, bitwise = 0, compared = 0;
  std::vector<bool> covered(size_t(layout.total_numel()), false);
  for (const ParamEntry& t : layout.entries()) {
    for (int64_t i = 0; i < t.numel; ++i) covered[size_t(t.offset + i)] = true;
    if (t.shape.size() == 1) {
      int64_t not_one = 0;
      for (int64_t i = 0; i < t.numel; ++i) not_one += got[t.offset + i] != 1.0f;
      EXPECT_EQ(not_one, 0) << t.name << ": norm weights must be exactly 1";
      continue;
    }
    double max_diff = 0, max_abs = 0;
    int64_t non_finite = 0;
    for (int64_t i = 0; i < t.numel; ++i) {
      const float g = got[t.offset + i], w = want[t.offset + i];
      non_finite += !std::isfinite(g);
      max_diff = std::max(max_diff, std::abs(double(g) - double(w)));
      max_abs = std::max(max_abs, std::abs(double(g)));
      bitwise += std::memcmp(&g, &w, sizeof g) == 0;
      ++compared;
      // Attempt 0 out of range: the element came from a resample.
      resampled += std::abs(normal_at(seed, t.name, uint64_t(i))) > 3.0f;
    }
    EXPECT_EQ(non_finite, 0) << t.name;
    EXPECT_LE(max_diff, 1e-6 * m.init_std) << t.name << ": GPU init differs from Model<float>::init_params";
    EXPECT_LE(max_abs, 3.0 * m.init_std * (1 + 1e-6)) << t.name << ": value outside the +-3 std truncation";
    EXPECT_GT(max_abs, 1.5 * m.init_std) << t.name << ": values do not spread like N(0, std^2)";
  }
  // CUDA's FP64 log/cos are within a few ulp of libm's: after rounding to FP32 almost every element
  // is bitwise equal (an FP32 Box-Muller would leave far fewer).
  EXPECT_GE(double(bitwise), 0.999 * double(compared)) << bitwise << " of " << compared << " bitwise equal";
  EXPECT_GT(resampled, 0) << "the config must exercise the truncation's resampling";
  int64_t padding_written = 0;
  for (size_t i = 0; i < covered.size(); ++i) padding_written += !covered[i] && !is_unwritten(got[i]);
  EXPECT_EQ(padding_written, 0) << "init_params wrote alignment padding between tensors";
}

TEST(CudaInit, SeedsAndNamesGiveDifferentValues) {
  MOE_SKIP_WITHOUT_GPU();
  ModelConfig m;
  MoeConfig e;
  init_test_config(m, e);
  const ParamLayout layout = build_param_layout(m, e);
  const std::vector<float> a = device_init(layout, 1, m.init_std);
  const std::vector<float> b = device_init(layout, 2, m.init_std);
  const std::vector<float> a2 = device_init(layout, 1, m.init_std);
  EXPECT_EQ(std::memcmp(a.data(), a2.data(), a.size() * sizeof(float)), 0) << "same seed, different values";
  for (const ParamEntry& t : layout.entries()) {
    if (t.shape.size() == 1) continue;
    int64_t same = 0;
    for (int64_t i = 0; i < t.numel; ++i) same += a[t.offset + i] == b[t.offset + i];
    EXPECT_LT(double(same), 1e-3 * double(t.numel) + 1) << t.name << ": seeds 1 and 2 give the same values";
  }
  // Same shape, different names: different values.
  const ParamEntry& q1 = layout.find("model.layers.1.self_attn.q_proj.weight");
  const ParamEntry& q2 = layout.find("model.layers.2.self_attn.q_proj.weight");
  ASSERT_EQ(q1.numel, q2.numel);
  int64_t same = 0;
  for (int64_t i = 0; i < q1.numel; ++i) same += a[q1.offset + i] == a[q2.offset + i];
  EXPECT_LT(double(same), 1e-3 * double(q1.numel) + 1) << "tensor names do not separate the streams";
}

TEST(CudaInit, SlicesAndCountersPast32BitsMatchHost) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream s;
  struct Case {
    int64_t n, offset;
    double std;
  };
  // The second case crosses index 2^32 (the counter's high word).
  for (const Case c : {Case{777, 12345, 0.5}, Case{1000, (int64_t{1} << 32) - 500, 1.0}, Case{1, 0, 2.0}}) {
    const std::string name = "slice.test.weight";
    std::vector<float> want(size_t(c.n));
    fill_trunc_normal(want.data(), c.n, c.offset, 99, name, c.std);
    GuardedBuffer<float> buf(c.n);
    cuda::fill_trunc_normal(buf.data(), c.n, c.offset, 99, name, c.std, s.get());
    s.sync();
    buf.expect_guards_intact("slice");
    const std::vector<float> got = buf.download();
    double max_diff = 0;
    for (int64_t i = 0; i < c.n; ++i) max_diff = std::max(max_diff, std::abs(double(got[i]) - double(want[i])));
    EXPECT_LE(max_diff, 1e-6 * c.std) << "n=" << c.n << " offset=" << c.offset;
  }
}

TEST(CudaInit, RejectsBadArguments) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream s;
  GuardedBuffer<float> buf(16);
  EXPECT_THROW(cuda::fill_trunc_normal(buf.data(), 16, 0, 1, "w", -1.0, s.get()), Error);
  EXPECT_THROW(cuda::fill_trunc_normal(buf.data(), 16, -1, 1, "w", 1.0, s.get()), Error);
  EXPECT_THROW(cuda::fill_trunc_normal(nullptr, 16, 0, 1, "w", 1.0, s.get()), Error);
  ParamLayout layout;
  layout.add("w", {4, 4});
  EXPECT_THROW(cuda::init_params(layout, nullptr, 1, 0.02, s.get()), Error);
}

// Device work of a known relative size: `reps` casts of n floats.
class CastWork {
 public:
  explicit CastWork(int64_t n) : n_(n), src_(size_t(n) * sizeof(float)), dst_(size_t(n) * sizeof(uint16_t)) {}
  void run(cuda::Stream s, int reps) {
    for (int r = 0; r < reps; ++r) cuda::cast_f32_to_bf16(src_.as<float>(), dst_.as<uint16_t>(), n_, s);
  }

 private:
  int64_t n_;
  cuda::DeviceBuffer src_, dst_;
};

constexpr int kAttention = int(cuda::Phase::kAttention), kExperts = int(cuda::Phase::kExperts);

TEST(CudaEventTimer, PhasesTimeKnownWork) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream s;
  CastWork small(int64_t{1} << 16), big(int64_t{1} << 26);
  small.run(s.get(), 1);  // load the kernel before anything is timed
  s.sync();
  cuda::EventTimer timer(s.get());
  const auto t0 = std::chrono::steady_clock::now();
  timer.mark(cuda::Phase::kAttention);
  small.run(s.get(), 1);
  timer.mark(cuda::Phase::kExperts);
  big.run(s.get(), 8);
  timer.close();
  const std::array<double, cuda::kNumPhases> ms = timer.collect();
  const double wall_ms = 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GT(ms[kAttention], 0.0);
  EXPECT_GT(ms[kExperts], 0.0);
  EXPECT_GT(ms[kExperts], 10.0 * ms[kAttention]) << "8 x 2^26 elements against 2^16";
  for (int p = 0; p < cuda::kNumPhases; ++p) {
    if (p != kAttention && p != kExperts) {
      EXPECT_EQ(ms[p], 0.0) << cuda::phase_name(cuda::Phase(p));
    }
  }
  EXPECT_LE(ms[kAttention] + ms[kExperts], wall_ms + 0.1) << "device intervals cannot exceed the host's wall time";
  const std::array<double, cuda::kNumPhases> again = timer.collect();
  for (int p = 0; p < cuda::kNumPhases; ++p) EXPECT_EQ(again[p], 0.0) << "collect() must reset";
}

TEST(CudaEventTimer, ReopenedPhasesAddUpAndEventsAreReused) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream s;
  CastWork small(int64_t{1} << 12), big(int64_t{1} << 25);
  big.run(s.get(), 16);  // load the kernel and let the clocks settle
  s.sync();
  cuda::EventTimer timer(s.get());
  double once_min = 1e30, once_max = 0;  // one interval of the work, three times
  for (int r = 0; r < 3; ++r) {
    timer.mark(cuda::Phase::kExperts);
    big.run(s.get(), 8);
    timer.close();
    const double once = timer.collect()[kExperts];
    ASSERT_GT(once, 0.0);
    once_min = std::min(once_min, once);
    once_max = std::max(once_max, once);
  }
  // Many rounds over the same pool: each round's figures are its own.
  for (int round = 0; round < 3; ++round) {
    for (int r = 0; r < 2; ++r) {
      timer.mark(cuda::Phase::kExperts);
      big.run(s.get(), 8);
      timer.mark(cuda::Phase::kRouter);
      small.run(s.get(), 1);
    }
    for (int r = 0; r < 200; ++r) {
      timer.mark(cuda::Phase::kDispatch);
      timer.mark(cuda::Phase::kCombine);
    }
    timer.close();
    const std::array<double, cuda::kNumPhases> ms = timer.collect();
    EXPECT_GT(ms[kExperts], 1.4 * once_min) << "round " << round << ": two intervals of the same work";
    EXPECT_LT(ms[kExperts], 2.8 * once_max) << "round " << round << ": two intervals of the same work";
    EXPECT_GT(ms[int(cuda::Phase::kRouter)], 0.0);
    EXPECT_LT(ms[int(cuda::Phase::kRouter)], ms[kExperts]);
    EXPECT_EQ(ms[kAttention], 0.0);
  }
}

TEST(CudaEventTimer, CollectClosesTheOpenPhase) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream s;
  CastWork big(int64_t{1} << 24);
  cuda::EventTimer timer(s.get());
  timer.mark(cuda::Phase::kLmHead);
  big.run(s.get(), 2);
  EXPECT_GT(timer.collect()[int(cuda::Phase::kLmHead)], 0.0);
  EXPECT_EQ(timer.collect()[int(cuda::Phase::kLmHead)], 0.0);
  timer.close();  // nothing open: no effect
  EXPECT_EQ(timer.collect()[int(cuda::Phase::kLmHead)], 0.0);
}

TEST(CudaEventTimer, RefusesStreamCaptureAndNamesPhases) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream s;
  cuda::EventTimer timer(s.get());
  MOE_CUDA_CHECK(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeRelaxed));
  EXPECT_THROW(timer.mark(cuda::Phase::kRouter), Error);
  cudaGraph_t graph = nullptr;
  MOE_CUDA_CHECK(cudaStreamEndCapture(s.get(), &graph));
  if (graph != nullptr) MOE_CUDA_CHECK(cudaGraphDestroy(graph));
  const std::vector<std::string> names = {"embedding", "attention", "mlp",         "router",   "dispatch",
                                          "experts",   "combine",   "lm_head",     "recompute", "grad_reduce", "optimizer"};
  ASSERT_EQ(names.size(), size_t(cuda::kNumPhases));
  for (int p = 0; p < cuda::kNumPhases; ++p) EXPECT_EQ(cuda::phase_name(cuda::Phase(p)), names[size_t(p)]);
}

}  // namespace
}  // namespace moe::testing
