// cuda::grouped_gemm_forward / _dgrad / _wgrad against a loop of cpu::gemm<float> over the experts
// on the same BF16 inputs, for both backends (mma; wgmma where the device is sm_90): forward and
// dgrad (BF16) under the bf16 row, wgrad (FP32) under the GEMM bound below; integer-valued inputs
// bitwise. Groups include empty experts, every row in one expert, single rows and odd counts, and
// widths around the wgmma tiles (8, 136, 200, 264, 520); rows past offsets[E] hold NaN inputs
// (never change a result) and stay unwritten; a captured CUDA graph replays with the offsets
// changed on the device and must match eager runs bitwise.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <ostream>
#include <tuple>

#include "core/square_blocks.h"
#include "cpu/experts.h"
#include "cpu/linear.h"
#include "cuda/ops/device_info.h"
#include "cuda/ops/grouped_gemm.h"
#include "cuda/sm_reserve.h"
#include "gpu/gpu_test_util.h"
#include "support/parity.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

// A grouped problem: rows per expert (prefix sums give the offsets) and spare rows past offsets[E],
// so max_rows = sum(counts) + spare_rows.
struct GroupedCase {
  const char* name;
  int64_t n, k;
  std::vector<int64_t> counts;
  int64_t spare_rows;

  int64_t num_experts() const { return static_cast<int64_t>(counts.size()); }
  int64_t rows() const { return std::accumulate(counts.begin(), counts.end(), int64_t{0}); }
  int64_t max_rows() const { return rows() + spare_rows; }
  std::vector<int32_t> offsets() const {
    std::vector<int32_t> off(counts.size() + 1, 0);
    for (size_t e = 0; e < counts.size(); ++e) off[e + 1] = off[e] + static_cast<int32_t>(counts[e]);
    return off;
  }
};

using Backend = cuda::GroupedGemmBackend;

// Skips the test when the backend cannot run on this device (wgmma needs compute capability 9.0).
#define MOE_SKIP_WITHOUT_BACKEND(backend)                                                    \
  do {                                                                                       \
    MOE_SKIP_WITHOUT_GPU();                                                                  \
    if ((backend) == Backend::kWgmma && !cuda::grouped_gemm_wgmma_available())               \
      GTEST_SKIP() << "the wgmma backend needs a compute capability 9.0 device";             \
  } while (0)

void PrintTo(const GroupedCase& c, std::ostream* os) {
  *os << c.name << " (E=" << c.num_experts() << ", n=" << c.n << ", k=" << c.k << ", rows=" << c.rows()
      << ", max_rows=" << c.max_rows() << ")";
}

// `rows` rows drawn over the experts with weights; experts of weight 0 stay empty.
std::vector<int64_t> drawn_counts(int64_t rows, const std::vector<double>& weights, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::discrete_distribution<int64_t> pick(weights.begin(), weights.end());
  std::vector<int64_t> counts(weights.size(), 0);
  for (int64_t r = 0; r < rows; ++r) ++counts[static_cast<size_t>(pick(gen))];
  return counts;
}

std::vector<double> uniform_weights(int64_t num_experts, std::initializer_list<int64_t> empty = {}) {
  std::vector<double> w(static_cast<size_t>(num_experts), 1.0);
  for (int64_t e : empty) w[static_cast<size_t>(e)] = 0.0;
  return w;
}

// Skewed: weight 1 + e % 7, every fifth expert empty.
std::vector<double> skewed_weights(int64_t num_experts) {
  std::vector<double> w(static_cast<size_t>(num_experts));
  for (int64_t e = 0; e < num_experts; ++e) w[static_cast<size_t>(e)] = e % 5 == 0 ? 0.0 : 1.0 + e % 7;
  return w;
}

std::vector<GroupedCase> parity_cases() {
  return {
      {"awkward", 40, 72, {0, 1, 130, 17, 0}, 5},
      {"single_row", 64, 64, {0, 0, 1, 0}, 0},
      {"one_expert_all_rows", 136, 264, {0, 0, 0, 1000, 0, 0, 0, 0}, 24},
      {"all_empty", 32, 48, {0, 0, 0, 0}, 64},
      {"tile_edges", 256, 320, {128, 127, 129}, 0},
      {"olmoe_gate_up_e8", 2048, 2048, drawn_counts(4096, uniform_weights(8), 61), 0},
      {"olmoe_down_e8", 2048, 1024, drawn_counts(4096, uniform_weights(8), 62), 0},
      {"e64_rows131072_down", 2048, 1024, drawn_counts(16384 * 8, uniform_weights(64, {5, 40}), 63), 0},
      {"e128_skewed", 512, 2048, drawn_counts(16384, skewed_weights(128), 64), 3},
      // Around the wgmma tiles (128 x 256 x 64; wgrad: 64-row reduction steps from each expert's
      // first row): widths below one box, one box plus a chunk, not a multiple of 64 or 256;
      // groups of exactly 64 / 128 rows (no partial step) next to 63, 65, 1 and 0.
      {"n8_k8", 8, 8, {3, 0, 1, 70, 0}, 9},
      {"n136_k200", 136, 200, {65, 64, 0, 63, 129, 1, 128}, 11},
      {"n200_k136", 200, 136, {64, 1, 191, 0, 256}, 0},
      {"n264_k520", 264, 520, {0, 300, 7, 64, 513}, 2},
      {"n520_k72", 520, 72, {127, 1, 0, 66}, 4},
      // E = 300: the wgmma M-grouped schedule no longer fits beside a 4-stage ring (3 stages).
      {"e300_small", 24, 40, drawn_counts(3000, skewed_weights(300), 65), 5},
  };
}

// Float copies of the BF16 inputs, for the CPU reference.
struct HostInputs {
  std::vector<uint16_t> x, w, dy;  // x [R, k], w [E, n, k], dy [R, n]
  std::vector<float> xf, wf, dyf;
};

// Rows [from, rows) of a [rows, width] BF16 array become NaN: rows outside every group (the
// dispatcher's dropped tail) must never be read, or they would poison the results.
constexpr uint16_t kBF16NaN = 0x7FC0;

void poison_rows(std::vector<uint16_t>& v, int64_t width, int64_t from) {
  std::fill(v.begin() + from * width, v.end(), kBF16NaN);
}

HostInputs make_inputs(const GroupedCase& c, uint64_t seed) {
  HostInputs in;
  in.x = random_bf16(c.max_rows() * c.k, seed);
  in.w = random_bf16(c.num_experts() * c.n * c.k, seed + 1);
  in.dy = random_bf16(c.max_rows() * c.n, seed + 2);
  poison_rows(in.x, c.k, c.rows());
  poison_rows(in.dy, c.n, c.rows());
  in.xf = bf16_to_f32(in.x);
  in.wf = bf16_to_f32(in.w);
  in.dyf = bf16_to_f32(in.dy);
  return in;
}

// Per-expert column norms of dy_e and x_e ([E, n] and [E, k]) for the weight gradient's bound.
struct WgradNorms {
  std::vector<double> dy, x;
};

// References over the grouped rows [0, offsets[E]) (the cases' offsets start at 0).
std::vector<float> reference_forward(const GroupedCase& c, const std::vector<int32_t>& off, const float* x,
                                     const float* w) {
  std::vector<float> y(static_cast<size_t>(c.rows() * c.n), 0.0f);
  for (int64_t e = 0; e < c.num_experts(); ++e) {
    const int64_t r0 = off[e], rows = off[e + 1] - off[e];
    if (rows == 0) continue;
    cpu::gemm<float>(false, true, rows, c.n, c.k, 1.0f, x + r0 * c.k, c.k, w + e * c.n * c.k, c.k, 0.0f,
                     y.data() + r0 * c.n, c.n);
  }
  return y;
}

std::vector<float> reference_dgrad(const GroupedCase& c, const std::vector<int32_t>& off, const float* dy,
                                   const float* w) {
  std::vector<float> dx(static_cast<size_t>(c.rows() * c.k), 0.0f);
  for (int64_t e = 0; e < c.num_experts(); ++e) {
    const int64_t r0 = off[e], rows = off[e + 1] - off[e];
    if (rows == 0) continue;
    cpu::gemm<float>(false, false, rows, c.k, c.n, 1.0f, dy + r0 * c.n, c.n, w + e * c.n * c.k, c.k, 0.0f,
                     dx.data() + r0 * c.k, c.k);
  }
  return dx;
}

// dw[e] = dy_e^T x_e (+ dw[e]); empty experts: unchanged (accumulate) or zero.
void reference_wgrad(const GroupedCase& c, const std::vector<int32_t>& off, const float* dy, const float* x,
                     std::vector<float>& dw, bool accumulate) {
  const int64_t per_expert = c.n * c.k;
  for (int64_t e = 0; e < c.num_experts(); ++e) {
    const int64_t r0 = off[e], rows = off[e + 1] - off[e];
    float* dw_e = dw.data() + e * per_expert;
    if (rows == 0) {
      if (!accumulate) std::fill(dw_e, dw_e + per_expert, 0.0f);
      continue;
    }
    cpu::gemm<float>(true, false, c.n, c.k, rows, 1.0f, dy + r0 * c.n, c.n, x + r0 * c.k, c.k,
                     accumulate ? 1.0f : 0.0f, dw_e, c.k);
  }
}

std::vector<float> head(const std::vector<float>& v, int64_t count) {
  return std::vector<float>(v.begin(), v.begin() + count);
}

// Rows [from, to) of a [rows, width] BF16 output still hold the unwritten pattern.
void expect_rows_unwritten(const std::string& what, const std::vector<uint16_t>& out, int64_t width, int64_t from,
                           int64_t to) {
  for (int64_t i = from * width; i < to * width; ++i) {
    if (out[static_cast<size_t>(i)] != 0xFFFFu) {
      ADD_FAILURE() << what << ": row " << i / width << " past offsets[E] was written (element " << i % width << ")";
      return;
    }
  }
}

// FP32 GEMM bound for dw[e][i][j] = dw0 + sum_r dy[r][i] x[r][j] summed in another order (and with
// the tensor cores' own rounding): |got - ref| <= 2^-16 ||dy_e[:, i]|| ||x_e[:, j]|| + 2^-22 |ref|.
// The first term bounds the dot product's rounding for up to ~10^5 rows (Cauchy-Schwarz: the terms'
// absolute sum is at most the product of norms); the second, the final add onto dw0. An empty
// expert's norms are 0, so its dw[e] must come out unchanged or zero.
constexpr double kGemmDotTol = 0x1p-16;
constexpr double kGemmAddTol = 0x1p-22;

WgradNorms wgrad_norms(const GroupedCase& c, const std::vector<int32_t>& off, const std::vector<float>& dyf,
                       const std::vector<float>& xf) {
  WgradNorms norms{std::vector<double>(static_cast<size_t>(c.num_experts() * c.n), 0.0),
                   std::vector<double>(static_cast<size_t>(c.num_experts() * c.k), 0.0)};
  for (int64_t e = 0; e < c.num_experts(); ++e) {
    double* norm_dy = norms.dy.data() + e * c.n;
    double* norm_x = norms.x.data() + e * c.k;
    for (int64_t r = off[e]; r < off[e + 1]; ++r) {
      for (int64_t i = 0; i < c.n; ++i) norm_dy[i] += double{dyf[r * c.n + i]} * dyf[r * c.n + i];
      for (int64_t j = 0; j < c.k; ++j) norm_x[j] += double{xf[r * c.k + j]} * xf[r * c.k + j];
    }
  }
  for (auto& v : norms.dy) v = std::sqrt(v);
  for (auto& v : norms.x) v = std::sqrt(v);
  return norms;
}

void expect_wgrad_parity(const std::string& what, const GroupedCase& c, const WgradNorms& norms,
                         const std::vector<float>& got, const std::vector<float>& ref) {
  ASSERT_EQ(got.size(), ref.size());
  int64_t bad = 0, nonfinite = 0, first_bad = -1;
  double max_abs = 0.0, max_ratio = 0.0;
  for (int64_t e = 0; e < c.num_experts(); ++e) {
    const double* norm_dy = norms.dy.data() + e * c.n;
    const double* norm_x = norms.x.data() + e * c.k;
    for (int64_t i = 0; i < c.n; ++i) {
      for (int64_t j = 0; j < c.k; ++j) {
        const int64_t idx = (e * c.n + i) * c.k + j;
        const double g = got[idx], f = ref[idx];
        if (!std::isfinite(g) || !std::isfinite(f)) {
          ++nonfinite;
          if (first_bad < 0) first_bad = idx;
          continue;
        }
        const double err = std::fabs(g - f);
        const double bound = kGemmDotTol * norm_dy[i] * norm_x[j] + kGemmAddTol * std::fabs(f);
        max_abs = std::max(max_abs, err);
        if (bound > 0.0) max_ratio = std::max(max_ratio, err / bound);
        if (err > bound) {
          ++bad;
          if (first_bad < 0) first_bad = idx;
        }
      }
    }
  }
  std::printf("parity %s: n=%zu tol=fp32-gemm max_abs=%.3e max_err/bound=%.3e bad=%lld nonfinite=%lld\n",
              what.c_str(), got.size(), max_abs, max_ratio, static_cast<long long>(bad),
              static_cast<long long>(nonfinite));
  if (bad + nonfinite > 0) {
    ADD_FAILURE() << what << " fails the fp32-gemm bound: " << bad << " of " << got.size() << " out of bounds, "
                  << nonfinite << " NaN/Inf; first at index " << first_bad << " (expert "
                  << first_bad / (c.n * c.k) << "): got " << got[first_bad] << ", reference " << ref[first_bad];
  }
}

// Empty experts' dw[e] must be bitwise the start value (accumulate) or +0.0 (overwrite).
void expect_empty_experts_exact(const GroupedCase& c, const std::vector<float>& got, const std::vector<float>& start,
                                bool accumulate) {
  const int64_t per_expert = c.n * c.k;
  for (int64_t e = 0; e < c.num_experts(); ++e) {
    if (c.counts[e] != 0) continue;
    const float* g = got.data() + e * per_expert;
    if (accumulate) {
      EXPECT_EQ(std::memcmp(g, start.data() + e * per_expert, per_expert * sizeof(float)), 0)
          << "dw of empty expert " << e << " changed under accumulate";
    } else {
      const std::vector<float> zeros(static_cast<size_t>(per_expert), 0.0f);
      EXPECT_EQ(std::memcmp(g, zeros.data(), per_expert * sizeof(float)), 0)
          << "dw of empty expert " << e << " is not +0.0 under overwrite";
    }
  }
}

// One case per test, run on every backend the device has (mma; wgmma on sm_90) against the same
// host inputs and CPU reference, which the largest cases spend most of their time building (normal
// draws and CPU GEMMs over 10^8-10^9 elements), so they are built once for both backends. Where
// the device lacks wgmma the test ends skipped after mma ran (a failure of mma still fails it).
class GroupedGemmParity : public ::testing::TestWithParam<GroupedCase> {
 protected:
  const GroupedCase& problem() const { return GetParam(); }
  static std::vector<Backend> backends() {
    std::vector<Backend> b = {Backend::kMma};
    if (cuda::grouped_gemm_wgmma_available()) b.push_back(Backend::kWgmma);
    return b;
  }
  static void skip_if_wgmma_missing() {
    if (!cuda::grouped_gemm_wgmma_available())
      GTEST_SKIP() << "mma ran; the wgmma backend needs a compute capability 9.0 device";
  }
  std::string label(const char* what, Backend b) const {
    return param_name(what, "[", problem().name, ",", cuda::grouped_gemm_backend_name(b), "]");
  }
};

TEST_P(GroupedGemmParity, Forward) {
  MOE_SKIP_WITHOUT_GPU();
  const GroupedCase& c = problem();
  const auto off = c.offsets();
  const HostInputs in = make_inputs(c, 101);
  const auto ref = reference_forward(c, off, in.xf.data(), in.wf.data());
  for (const Backend backend : backends()) {
    SCOPED_TRACE(label("forward", backend));
    GuardedBuffer<uint16_t> d_x(in.x), d_w(in.w), d_y(c.max_rows() * c.n);
    GuardedBuffer<int32_t> d_off(off);
    TestStream stream;
    cuda::grouped_gemm_forward(d_x.data(), d_w.data(), d_off.data(), d_y.data(), c.max_rows(), c.num_experts(), c.n,
                               c.k, stream.get(), backend);
    stream.sync();

    const auto y = d_y.download();
    expect_parity(label("grouped_gemm.y", backend), head(bf16_to_f32(y), c.rows() * c.n), ref, kBF16Elementwise);
    expect_rows_unwritten("y", y, c.n, c.rows(), c.max_rows());
    EXPECT_TRUE(bitwise_equal(d_x.download(), in.x)) << "x was modified";
    EXPECT_TRUE(bitwise_equal(d_w.download(), in.w)) << "w was modified";
    d_x.expect_guards_intact("x");
    d_w.expect_guards_intact("w");
    d_y.expect_guards_intact("y");
    d_off.expect_guards_intact("expert_offsets");
  }
  skip_if_wgmma_missing();
}

TEST_P(GroupedGemmParity, Dgrad) {
  MOE_SKIP_WITHOUT_GPU();
  const GroupedCase& c = problem();
  const auto off = c.offsets();
  const HostInputs in = make_inputs(c, 201);
  const auto ref = reference_dgrad(c, off, in.dyf.data(), in.wf.data());
  for (const Backend backend : backends()) {
    SCOPED_TRACE(label("dgrad", backend));
    GuardedBuffer<uint16_t> d_dy(in.dy), d_w(in.w), d_dx(c.max_rows() * c.k);
    GuardedBuffer<int32_t> d_off(off);
    TestStream stream;
    cuda::grouped_gemm_dgrad(d_dy.data(), d_w.data(), d_off.data(), d_dx.data(), c.max_rows(), c.num_experts(), c.n,
                             c.k, stream.get(), backend);
    stream.sync();

    const auto dx = d_dx.download();
    expect_parity(label("grouped_gemm.dx", backend), head(bf16_to_f32(dx), c.rows() * c.k), ref, kBF16Elementwise);
    expect_rows_unwritten("dx", dx, c.k, c.rows(), c.max_rows());
    EXPECT_TRUE(bitwise_equal(d_dy.download(), in.dy)) << "dy was modified";
    d_dy.expect_guards_intact("dy");
    d_w.expect_guards_intact("w");
    d_dx.expect_guards_intact("dx");
  }
  skip_if_wgmma_missing();
}

void run_wgrad_case(const GroupedCase& c, const std::vector<Backend>& backends, bool accumulate) {
  const auto off = c.offsets();
  const HostInputs in = make_inputs(c, accumulate ? 301 : 401);
  const auto dw0 = random_f32(c.num_experts() * c.n * c.k, accumulate ? 302 : 402);
  std::vector<float> ref = dw0;
  reference_wgrad(c, off, in.dyf.data(), in.xf.data(), ref, accumulate);
  const WgradNorms norms = wgrad_norms(c, off, in.dyf, in.xf);
  for (const Backend backend : backends) {
    const std::string what = param_name("grouped_gemm.dw[", c.name, ",", cuda::grouped_gemm_backend_name(backend),
                                        accumulate ? ",accumulate]" : ",overwrite]");
    SCOPED_TRACE(what);
    GuardedBuffer<uint16_t> d_dy(in.dy), d_x(in.x);
    GuardedBuffer<float> d_dw(dw0);
    GuardedBuffer<int32_t> d_off(off);
    TestStream stream;
    cuda::grouped_gemm_wgrad(d_dy.data(), d_x.data(), d_off.data(), d_dw.data(), c.max_rows(), c.num_experts(), c.n,
                             c.k, accumulate, stream.get(), backend);
    stream.sync();
    const auto dw = d_dw.download();

    expect_wgrad_parity(what, c, norms, dw, ref);
    expect_empty_experts_exact(c, dw, dw0, accumulate);
    d_dy.expect_guards_intact("dy");
    d_x.expect_guards_intact("x");
    d_dw.expect_guards_intact("dw");

    // Same inputs, same start: bitwise the same dw (fixed reduction order).
    d_dw.upload(dw0);
    cuda::grouped_gemm_wgrad(d_dy.data(), d_x.data(), d_off.data(), d_dw.data(), c.max_rows(), c.num_experts(), c.n,
                             c.k, accumulate, stream.get(), backend);
    stream.sync();
    const auto again = d_dw.download();
    EXPECT_EQ(std::memcmp(again.data(), dw.data(), dw.size() * sizeof(float)), 0) << "dw differs between two runs";
    d_dw.expect_guards_intact("dw (second run)");
  }
}

TEST_P(GroupedGemmParity, WgradAccumulate) {
  MOE_SKIP_WITHOUT_GPU();
  run_wgrad_case(problem(), backends(), true);
  skip_if_wgmma_missing();
}

TEST_P(GroupedGemmParity, WgradOverwrite) {
  MOE_SKIP_WITHOUT_GPU();
  run_wgrad_case(problem(), backends(), false);
  skip_if_wgmma_missing();
}

// Overwrite with square sums: dw bitwise the call without them, each 128 x 128 block's sum the
// CPU's sum of squares of that block of the GPU's dw (FP64, up to the order of the sum: relative
// 1e-11 for up to 16384 exact squares), empty experts' blocks +0.0 exactly.
TEST_P(GroupedGemmParity, WgradSquareSums) {
  MOE_SKIP_WITHOUT_GPU();
  const GroupedCase& c = problem();
  const auto off = c.offsets();
  const HostInputs in = make_inputs(c, 501);
  const auto dw_start = random_f32(c.num_experts() * c.n * c.k, 502);
  const int64_t blocks = square_blocks(c.num_experts(), c.n, c.k);
  for (const Backend backend : backends()) {
    SCOPED_TRACE(label("square sums", backend));
    GuardedBuffer<uint16_t> d_dy(in.dy), d_x(in.x);
    GuardedBuffer<float> d_dw(dw_start), d_plain(c.num_experts() * c.n * c.k);
    GuardedBuffer<int32_t> d_off(off);
    GuardedBuffer<double> d_sq(std::vector<double>(static_cast<size_t>(blocks), std::nan("")));
    TestStream stream;
    cuda::grouped_gemm_wgrad(d_dy.data(), d_x.data(), d_off.data(), d_plain.data(), c.max_rows(), c.num_experts(),
                             c.n, c.k, false, stream.get(), backend);
    cuda::grouped_gemm_wgrad(d_dy.data(), d_x.data(), d_off.data(), d_dw.data(), c.max_rows(), c.num_experts(), c.n,
                             c.k, false, stream.get(), backend, d_sq.data());
    stream.sync();
    const auto dw = d_dw.download();
    const auto plain = d_plain.download();
    EXPECT_EQ(std::memcmp(dw.data(), plain.data(), dw.size() * sizeof(float)), 0)
        << label("dw", backend) << " differs from the call without square sums";
    std::vector<double> want(static_cast<size_t>(blocks));
    cpu::block_square_sums(dw.data(), c.num_experts(), c.n, c.k, want.data());
    const auto got = d_sq.download();
    const int64_t per_expert = blocks / std::max<int64_t>(1, c.num_experts());
    int bad = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      const double g = got[size_t(b)], w = want[size_t(b)];
      const bool empty = c.counts[size_t(b / per_expert)] == 0;
      const bool ok = empty ? (g == 0.0 && !std::signbit(g)) : std::abs(g - w) <= 1e-11 * w;
      if (!ok && ++bad <= 5)
        ADD_FAILURE() << label("squares", backend) << " block " << b << ": got " << g
                      << ", the CPU's sum of the GPU's dw " << w;
    }
    EXPECT_EQ(bad, 0);
    d_sq.expect_guards_intact("squares");
    d_dw.expect_guards_intact("dw");
  }
  skip_if_wgmma_missing();
}

INSTANTIATE_TEST_SUITE_P(Groups, GroupedGemmParity, ::testing::ValuesIn(parity_cases()),
                         [](const auto& info) { return std::string(info.param.name); });

// Small integers (|v| <= 3) in BF16: every product and partial sum is an integer below 2^24, exact
// in FP32 in any order, so the GPU must match the reference bitwise (BF16 outputs: the reference
// rounded to nearest even).
std::vector<uint16_t> small_int_bf16(int64_t count, uint64_t seed, int max_abs) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> dist(-max_abs, max_abs);
  std::vector<uint16_t> v(static_cast<size_t>(count));
  for (auto& b : v) b = f32_to_bf16(static_cast<float>(dist(gen)));
  return v;
}

std::vector<uint16_t> round_to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f32_to_bf16(v[i]);
  return out;
}

// Enqueues the forward (y), the data gradient (dx) and both weight gradients (dw_acc accumulated
// into, dw_new overwritten) of case c on stream s.
void run_all_four(const GroupedCase& c, const uint16_t* x, const uint16_t* w, const uint16_t* dy, const int32_t* off,
                  uint16_t* y, uint16_t* dx, float* dw_acc, float* dw_new, cudaStream_t s, Backend backend) {
  cuda::grouped_gemm_forward(x, w, off, y, c.max_rows(), c.num_experts(), c.n, c.k, s, backend);
  cuda::grouped_gemm_dgrad(dy, w, off, dx, c.max_rows(), c.num_experts(), c.n, c.k, s, backend);
  cuda::grouped_gemm_wgrad(dy, x, off, dw_acc, c.max_rows(), c.num_experts(), c.n, c.k, true, s, backend);
  cuda::grouped_gemm_wgrad(dy, x, off, dw_new, c.max_rows(), c.num_experts(), c.n, c.k, false, s, backend);
}

class GroupedGemmBackends : public ::testing::TestWithParam<Backend> {};

TEST_P(GroupedGemmBackends, IntegerInputsMatchBitwise) {
  const Backend backend = GetParam();
  MOE_SKIP_WITHOUT_BACKEND(backend);
  const GroupedCase c{"integers", 264, 520, {0, 1, 257, 64, 129, 3}, 7};
  const auto off = c.offsets();
  auto x = small_int_bf16(c.max_rows() * c.k, 501, 3), dy = small_int_bf16(c.max_rows() * c.n, 503, 3);
  const auto w = small_int_bf16(c.num_experts() * c.n * c.k, 502, 3);
  poison_rows(x, c.k, c.rows());
  poison_rows(dy, c.n, c.rows());
  std::vector<float> dw0(static_cast<size_t>(c.num_experts() * c.n * c.k));
  for (size_t i = 0; i < dw0.size(); ++i) dw0[i] = static_cast<float>(static_cast<int>(i % 17) - 8);
  const auto xf = bf16_to_f32(x), wf = bf16_to_f32(w), dyf = bf16_to_f32(dy);

  GuardedBuffer<uint16_t> d_x(x), d_w(w), d_dy(dy), d_y(c.max_rows() * c.n), d_dx(c.max_rows() * c.k);
  GuardedBuffer<float> d_dw_acc(dw0), d_dw_new(dw0);
  GuardedBuffer<int32_t> d_off(off);
  TestStream stream;
  const cudaStream_t s = stream.get();
  run_all_four(c, d_x.data(), d_w.data(), d_dy.data(), d_off.data(), d_y.data(), d_dx.data(), d_dw_acc.data(),
               d_dw_new.data(), s, backend);
  stream.sync();

  const auto y = d_y.download(), dx = d_dx.download();
  const auto y_ref = round_to_bf16(reference_forward(c, off, xf.data(), wf.data()));
  const auto dx_ref = round_to_bf16(reference_dgrad(c, off, dyf.data(), wf.data()));
  const char* name = cuda::grouped_gemm_backend_name(backend);
  EXPECT_TRUE(bitwise_equal(std::vector<uint16_t>(y.begin(), y.begin() + c.rows() * c.n), y_ref)) << "y, " << name;
  EXPECT_TRUE(bitwise_equal(std::vector<uint16_t>(dx.begin(), dx.begin() + c.rows() * c.k), dx_ref)) << "dx, " << name;
  expect_rows_unwritten("y", y, c.n, c.rows(), c.max_rows());
  expect_rows_unwritten("dx", dx, c.k, c.rows(), c.max_rows());
  for (bool accumulate : {true, false}) {
    std::vector<float> ref = dw0;
    reference_wgrad(c, off, dyf.data(), xf.data(), ref, accumulate);
    const auto got = (accumulate ? d_dw_acc : d_dw_new).download();
    expect_parity(param_name("grouped_gemm.dw[integers,", name, accumulate ? ",accumulate]" : ",overwrite]"), got,
                  ref, kExact);
  }
  for (auto* b : {&d_x, &d_w, &d_dy, &d_y, &d_dx}) b->expect_guards_intact("grouped gemm bf16 buffer");
  d_dw_acc.expect_guards_intact("dw (accumulate)");
  d_dw_new.expect_guards_intact("dw (overwrite)");
}

// A reserve of multiprocessors (cuda/sm_reserve.h: the deferred update beside the forward) shrinks
// the persistent grids, so each CTA walks more tiles; every tile is still reduced by one CTA in
// the same order: forward, dgrad and both wgrads give the same bits as on the whole GPU, on
// random (non-integer) inputs, where another summation order would show.
TEST_P(GroupedGemmBackends, ReservedMultiprocessorsGiveTheSameBits) {
  const Backend backend = GetParam();
  MOE_SKIP_WITHOUT_BACKEND(backend);
  const GroupedCase c{"reserve", 264, 520, {0, 1, 257, 64, 129, 3, 700, 511}, 7};
  const auto off = c.offsets();
  std::mt19937_64 gen(611);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  auto random_bf16 = [&](int64_t count) {
    std::vector<uint16_t> v(static_cast<size_t>(count));
    for (auto& b : v) b = f32_to_bf16(dist(gen));
    return v;
  };
  const auto x = random_bf16(c.max_rows() * c.k), dy = random_bf16(c.max_rows() * c.n);
  const auto w = random_bf16(c.num_experts() * c.n * c.k);
  std::vector<float> dw0(static_cast<size_t>(c.num_experts() * c.n * c.k));
  for (size_t i = 0; i < dw0.size(); ++i) dw0[i] = dist(gen);
  GuardedBuffer<uint16_t> d_x(x), d_w(w), d_dy(dy);
  GuardedBuffer<int32_t> d_off(off);
  TestStream stream;
  const cudaStream_t s = stream.get();
  struct Out {
    std::vector<uint16_t> y, dx;
    std::vector<float> dw_acc, dw_new;
  };
  auto run = [&](int reserve) {
    const cuda::ScopedSmReserve r(reserve);
    GuardedBuffer<uint16_t> d_y(c.max_rows() * c.n), d_dx(c.max_rows() * c.k);
    GuardedBuffer<float> d_dw_acc(dw0), d_dw_new(dw0);
    run_all_four(c, d_x.data(), d_w.data(), d_dy.data(), d_off.data(), d_y.data(), d_dx.data(), d_dw_acc.data(),
                 d_dw_new.data(), s, backend);
    stream.sync();
    const auto y = d_y.download(), dx = d_dx.download();
    return Out{std::vector<uint16_t>(y.begin(), y.begin() + c.rows() * c.n),
               std::vector<uint16_t>(dx.begin(), dx.begin() + c.rows() * c.k), d_dw_acc.download(),
               d_dw_new.download()};
  };
  const Out whole = run(0);
  const int sms = cuda::device_info().sm_count;
  const Out reserved = run(sms - 2);  // two CTAs walk every tile
  const char* name = cuda::grouped_gemm_backend_name(backend);
  EXPECT_EQ(cuda::reserved_sms(), 0) << "the scoped reserve was not restored";
  EXPECT_TRUE(bitwise_equal(reserved.y, whole.y)) << "y, " << name;
  EXPECT_TRUE(bitwise_equal(reserved.dx, whole.dx)) << "dx, " << name;
  EXPECT_EQ(std::memcmp(reserved.dw_acc.data(), whole.dw_acc.data(), whole.dw_acc.size() * 4), 0) << "dw acc, " << name;
  EXPECT_EQ(std::memcmp(reserved.dw_new.data(), whole.dw_new.data(), whole.dw_new.size() * 4), 0) << "dw new, " << name;
}

// Expects fn() to throw moe::Error whose message contains every one of `parts`.
template <typename Fn>
void expect_error_naming(Fn fn, std::initializer_list<const char*> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected moe::Error";
  } catch (const moe::Error& e) {
    for (const char* p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

// Size checks come before any pointer or device use, so these run without a GPU.
TEST(GroupedGemm, RejectsWidthsNotMultipleOf8) {
  expect_error_naming(
      [] { cuda::grouped_gemm_forward(nullptr, nullptr, nullptr, nullptr, 64, 4, 36, 64, nullptr); },
      {"grouped_gemm_forward", "n=36", "multiple of 8"});
  expect_error_naming([] { cuda::grouped_gemm_dgrad(nullptr, nullptr, nullptr, nullptr, 64, 4, 64, 20, nullptr); },
                      {"grouped_gemm_dgrad", "k=20", "multiple of 8"});
  expect_error_naming(
      [] { cuda::grouped_gemm_wgrad(nullptr, nullptr, nullptr, nullptr, 64, 4, 0, 64, true, nullptr); },
      {"grouped_gemm_wgrad", "n=0"});
  expect_error_naming([] { cuda::grouped_gemm_forward(nullptr, nullptr, nullptr, nullptr, 64, 0, 64, 64, nullptr); },
                      {"num_experts", "got 0"});
  expect_error_naming([] { cuda::grouped_gemm_forward(nullptr, nullptr, nullptr, nullptr, -1, 4, 64, 64, nullptr); },
                      {"max_rows", "got -1"});
}

TEST(GroupedGemm, RejectsMisalignedPointers) {
  MOE_SKIP_WITHOUT_GPU();
  GuardedBuffer<uint16_t> bf(64 * 64 + 8);
  GuardedBuffer<float> f(4 * 64 * 64);
  GuardedBuffer<int32_t> off(std::vector<int32_t>{0, 16, 32, 48, 64});
  expect_error_naming(
      [&] { cuda::grouped_gemm_forward(bf.data() + 1, bf.data(), off.data(), bf.data(), 64, 4, 64, 64, nullptr); },
      {"'x'", "16-byte aligned"});
  expect_error_naming(
      [&] { cuda::grouped_gemm_dgrad(bf.data(), bf.data() + 4, off.data(), bf.data(), 64, 4, 64, 64, nullptr); },
      {"'w'", "16-byte aligned"});
  expect_error_naming(
      [&] {
        cuda::grouped_gemm_wgrad(bf.data(), bf.data(), off.data(), f.data() + 1, 64, 4, 64, 64, true, nullptr);
      },
      {"'dw'", "16-byte aligned"});
}

TEST(GroupedGemm, ZeroMaxRows) {
  MOE_SKIP_WITHOUT_GPU();
  // Nothing to compute: no pointer is touched, except that overwrite zeroes dw.
  EXPECT_NO_THROW(cuda::grouped_gemm_forward(nullptr, nullptr, nullptr, nullptr, 0, 4, 64, 64, nullptr));
  EXPECT_NO_THROW(cuda::grouped_gemm_dgrad(nullptr, nullptr, nullptr, nullptr, 0, 4, 64, 64, nullptr));
  EXPECT_NO_THROW(cuda::grouped_gemm_wgrad(nullptr, nullptr, nullptr, nullptr, 0, 4, 64, 64, true, nullptr));
  const auto dw0 = random_f32(2 * 16 * 24, 601);
  GuardedBuffer<float> d_dw(dw0);
  TestStream stream;
  cuda::grouped_gemm_wgrad(nullptr, nullptr, nullptr, d_dw.data(), 0, 2, 16, 24, false, stream.get());
  stream.sync();
  EXPECT_EQ(d_dw.download(), std::vector<float>(dw0.size(), 0.0f));
  d_dw.expect_guards_intact("dw");
  // With square sums: zeros too (2 experts x one 128 x 128 block each).
  GuardedBuffer<double> d_sq(std::vector<double>{1.0, 2.0});
  d_dw.upload(dw0);
  cuda::grouped_gemm_wgrad(nullptr, nullptr, nullptr, d_dw.data(), 0, 2, 16, 24, false, stream.get(), Backend::kAuto,
                           d_sq.data());
  stream.sync();
  EXPECT_EQ(d_sq.download(), std::vector<double>(2, 0.0));
  d_sq.expect_guards_intact("squares");
  // Accumulate with square sums is refused: they would miss what dw held.
  EXPECT_THROW(cuda::grouped_gemm_wgrad(nullptr, nullptr, nullptr, d_dw.data(), 0, 2, 16, 24, true, stream.get(),
                                        Backend::kAuto, d_sq.data()),
               Error);
}

// One captured graph of forward, dgrad and wgrad (accumulate and overwrite), replayed after the
// offsets were rewritten on the device: each replay must equal an eager run with the same offsets.
struct GraphBuffers {
  static constexpr int64_t kExperts = 8, kN = 256, kK = 192, kMaxRows = 700;
  GuardedBuffer<uint16_t> x{random_bf16(kMaxRows * kK, 701)}, w{random_bf16(kExperts * kN * kK, 702)},
      dy{random_bf16(kMaxRows * kN, 703)}, y{kMaxRows * kN}, dx{kMaxRows * kK};
  GuardedBuffer<float> dw_start{random_f32(kExperts * kN * kK, 704)}, dw_acc{kExperts * kN * kK},
      dw_new{kExperts * kN * kK};
  GuardedBuffer<int32_t> offsets{kExperts + 1};
  Backend backend = Backend::kAuto;

  void run(cudaStream_t s) {
    MOE_CUDA_CHECK(cudaMemsetAsync(y.data(), 0xFF, y.bytes(), s));
    MOE_CUDA_CHECK(cudaMemsetAsync(dx.data(), 0xFF, dx.bytes(), s));
    MOE_CUDA_CHECK(cudaMemsetAsync(dw_new.data(), 0xFF, dw_new.bytes(), s));
    MOE_CUDA_CHECK(cudaMemcpyAsync(dw_acc.data(), dw_start.data(), dw_acc.bytes(), cudaMemcpyDeviceToDevice, s));
    cuda::grouped_gemm_forward(x.data(), w.data(), offsets.data(), y.data(), kMaxRows, kExperts, kN, kK, s, backend);
    cuda::grouped_gemm_dgrad(dy.data(), w.data(), offsets.data(), dx.data(), kMaxRows, kExperts, kN, kK, s, backend);
    cuda::grouped_gemm_wgrad(dy.data(), x.data(), offsets.data(), dw_acc.data(), kMaxRows, kExperts, kN, kK, true, s,
                             backend);
    cuda::grouped_gemm_wgrad(dy.data(), x.data(), offsets.data(), dw_new.data(), kMaxRows, kExperts, kN, kK, false,
                             s, backend);
  }
};

struct GraphSnapshot {
  std::vector<uint16_t> y, dx;
  std::vector<float> dw_acc, dw_new;
  bool operator==(const GraphSnapshot& o) const {
    return bitwise_equal(y, o.y) && bitwise_equal(dx, o.dx) &&
           std::memcmp(dw_acc.data(), o.dw_acc.data(), dw_acc.size() * sizeof(float)) == 0 &&
           std::memcmp(dw_new.data(), o.dw_new.data(), dw_new.size() * sizeof(float)) == 0;
  }
};

GraphSnapshot snapshot(const GraphBuffers& b) {
  return {b.y.download(), b.dx.download(), b.dw_acc.download(), b.dw_new.download()};
}

TEST_P(GroupedGemmBackends, GraphReplaysWithOffsetsChangedOnDevice) {
  const Backend backend = GetParam();
  MOE_SKIP_WITHOUT_BACKEND(backend);
  GraphBuffers b;
  b.backend = backend;
  TestStream stream;
  const std::vector<std::vector<int32_t>> offset_sets = {
      {0, 100, 100, 350, 351, 450, 450, 650, 700},  // mixed, two empty experts, one single row
      {0, 0, 700, 700, 700, 700, 700, 700, 700},    // every row in expert 1
      {0, 10, 30, 60, 60, 60, 65, 70, 73},          // 73 of 700 rows grouped
      {0, 100, 100, 350, 351, 450, 450, 650, 700},  // the first set again
  };
  b.offsets.upload(offset_sets[0]);
  cudaGraph_t graph = nullptr;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  b.run(stream.get());
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  std::vector<GraphSnapshot> replays;
  for (size_t i = 0; i < offset_sets.size(); ++i) {
    b.offsets.upload(offset_sets[i]);  // the graph's kernels read the offsets at replay time
      b.run(stream.get());
    stream.sync();
    const GraphSnapshot eager = snapshot(b);
    MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    stream.sync();
    replays.push_back(snapshot(b));
    EXPECT_TRUE(replays.back() == eager) << "replay with offset set " << i << " differs from the eager run";
  }
  EXPECT_FALSE(replays[0] == replays[1]) << "replays with different offsets gave the same results";
  EXPECT_TRUE(replays[0] == replays[3]) << "replays with the same offsets differ";
  // Set 2 groups 73 rows: the rest of y stays at the pattern the graph's memset wrote.
  expect_rows_unwritten("y (replay, 73 rows grouped)", replays[2].y, GraphBuffers::kN, 73, GraphBuffers::kMaxRows);
  MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOE_CUDA_CHECK(cudaGraphDestroy(graph));
  for (auto* buf : {&b.x, &b.w, &b.dy, &b.y, &b.dx}) buf->expect_guards_intact("graph bf16 buffer");
  for (auto* buf : {&b.dw_acc, &b.dw_new}) buf->expect_guards_intact("graph dw");
}

INSTANTIATE_TEST_SUITE_P(Backends, GroupedGemmBackends, ::testing::Values(Backend::kMma, Backend::kWgmma),
                         [](const auto& info) { return std::string(cuda::grouped_gemm_backend_name(info.param)); });

// MOECORE_GROUPED_GEMM picks the backend of kAuto calls; an explicit backend argument wins; a bad
// value is refused naming the variable (checked before any device query, so this runs anywhere).

TEST(GroupedGemm, BackendFromEnvironment) {
  {
    ScopedEnv env("MOECORE_GROUPED_GEMM", "tensorcore");
    expect_error_naming([] { cuda::grouped_gemm_resolve_backend(); }, {"MOECORE_GROUPED_GEMM", "'tensorcore'"});
  }
  MOE_SKIP_WITHOUT_GPU();
  const bool sm90 = cuda::grouped_gemm_wgmma_available();
  {
    ScopedEnv env("MOECORE_GROUPED_GEMM", "mma");
    EXPECT_EQ(cuda::grouped_gemm_resolve_backend(), Backend::kMma);
    if (sm90) {
      EXPECT_EQ(cuda::grouped_gemm_resolve_backend(Backend::kWgmma), Backend::kWgmma);
    }
  }
  {
    ScopedEnv env("MOECORE_GROUPED_GEMM", "");
    EXPECT_EQ(cuda::grouped_gemm_resolve_backend(), sm90 ? Backend::kWgmma : Backend::kMma);
  }
  if (!sm90) {
    expect_error_naming([] { cuda::grouped_gemm_resolve_backend(Backend::kWgmma); }, {"wgmma", "9.0"});
  }
}

// The weight gradient's grid (host arithmetic, runs anywhere): rounds of whole experts where that
// keeps 95% of the multiprocessors, the whole grid otherwise; bad sizes are refused by name.
TEST(GroupedGemm, WgradGridTakesRoundsOfWholeExperts) {
  EXPECT_EQ(cuda::wgrad_grid(132, 128), 128);  // olmoe-8l's gate/up: one expert a round
  EXPECT_EQ(cuda::wgrad_grid(132, 64), 128);   // its down projection: two experts a round
  EXPECT_EQ(cuda::wgrad_grid(132, 512), 128);  // a quarter of an expert a round
  EXPECT_EQ(cuda::wgrad_grid(132, 132), 132);
  EXPECT_EQ(cuda::wgrad_grid(132, 5), 130);
  EXPECT_EQ(cuda::wgrad_grid(132, 88), 132);   // 88 would idle a third of the multiprocessors
  EXPECT_EQ(cuda::wgrad_grid(132, 1031), 132);  // a prime: no divisor near the grid
  EXPECT_EQ(cuda::wgrad_grid(100, 128), 100);  // 64 (a reserve left 100) is too few
  EXPECT_EQ(cuda::wgrad_grid(1, 7), 1);
  EXPECT_EQ(cuda::wgrad_grid(8, 8), 8);
  expect_error_naming([] { cuda::wgrad_grid(0, 8); }, {"grid", "0"});
  expect_error_naming([] { cuda::wgrad_grid(132, 0); }, {"tiles_per_expert"});
}

}  // namespace
}  // namespace moe::testing
