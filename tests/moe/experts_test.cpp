// Grouped expert tests: forward against a per-row loop written out in full, finite-difference
// gradients with empty experts (first, middle and last groups), gradient accumulation,
// float vs double agreement, the down part from a saved gate/up output, and offset errors.
#include <cmath>
#include <cstring>
#include <string>

#include "core/square_blocks.h"
#include "moe_test_util.h"

namespace moe::testing {
namespace {

struct ExpertsCase {
  int64_t ne, d, inner;
  std::vector<int32_t> offsets;
};

// Experts 0, 2 and 4 of 5 are empty; expert 3 holds most rows.
const ExpertsCase kCase{5, 6, 4, {0, 0, 3, 3, 8, 8}};

template <typename T>
struct ExpertsOut {
  std::vector<T> gate_up, h, y;
};

template <typename T>
ExpertsOut<T> run_experts(const ExpertsCase& c, const std::vector<T>& x, const std::vector<T>& wgu,
                          const std::vector<T>& wd) {
  const int64_t rows = c.offsets.back();
  ExpertsOut<T> o;
  o.gate_up.resize(rows * 2 * c.inner);
  o.h.resize(rows * c.inner);
  o.y.resize(rows * c.d);
  cpu::experts_forward(x.data(), c.offsets.data(), wgu.data(), wd.data(), c.ne, c.d, c.inner,
                       o.gate_up.data(), o.h.data(), o.y.data());
  return o;
}

TEST(Experts, MatchesPerRowLoop) {
  const auto& c = kCase;
  const int64_t rows = c.offsets.back(), d = c.d, in = c.inner;
  const auto x = random_vector(rows * d, 1), wgu = random_vector(c.ne * 2 * in * d, 2),
             wd = random_vector(c.ne * d * in, 3);
  const auto o = run_experts(c, x, wgu, wd);
  for (int64_t e = 0; e < c.ne; ++e) {
    for (int64_t row = c.offsets[e]; row < c.offsets[e + 1]; ++row) {
      std::vector<double> hrow(in);
      for (int64_t i = 0; i < in; ++i) {
        double g = 0, u = 0;
        for (int64_t k = 0; k < d; ++k) {
          g += x[row * d + k] * wgu[(e * 2 * in + i) * d + k];
          u += x[row * d + k] * wgu[(e * 2 * in + in + i) * d + k];
        }
        hrow[i] = g / (1 + std::exp(-g)) * u;
        EXPECT_NEAR(o.h[row * in + i], hrow[i], 1e-12);
      }
      for (int64_t k = 0; k < d; ++k) {
        double yv = 0;
        for (int64_t i = 0; i < in; ++i) yv += hrow[i] * wd[(e * d + k) * in + i];
        EXPECT_NEAR(o.y[row * d + k], yv, 1e-12) << "expert " << e << " row " << row;
      }
    }
  }
}

// experts_down_forward on experts_forward's gate_up reproduces its h and y bit for bit (the
// recomputation of SwiGLU and down projection), empty experts included.
TEST(Experts, DownFromSavedGateUpIsForwardsOutput) {
  const auto& c = kCase;
  const int64_t rows = c.offsets.back();
  const auto x = random_vector(rows * c.d, 4), wgu = random_vector(c.ne * 2 * c.inner * c.d, 5),
             wd = random_vector(c.ne * c.d * c.inner, 6);
  const auto o = run_experts(c, x, wgu, wd);
  std::vector<double> h(rows * c.inner, std::nan("")), y(rows * c.d, std::nan(""));
  cpu::experts_down_forward(c.offsets.data(), o.gate_up.data(), wd.data(), c.ne, c.d, c.inner, h.data(), y.data());
  EXPECT_EQ(std::memcmp(h.data(), o.h.data(), h.size() * sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(y.data(), o.y.data(), y.size() * sizeof(double)), 0);
}

TEST(Experts, GradCheck) {
  const auto& c = kCase;
  const int64_t rows = c.offsets.back(), d = c.d, in = c.inner;
  auto x = random_vector(rows * d, 11), wgu = random_vector(c.ne * 2 * in * d, 12, 0.5),
       wd = random_vector(c.ne * d * in, 13, 0.5);
  const auto r = random_vector(rows * d, 14);
  auto loss = [&] { return dot(run_experts(c, x, wgu, wd).y, r); };
  const auto o = run_experts(c, x, wgu, wd);
  std::vector<double> dx(rows * d, 7.0), dwgu(wgu.size(), 0.0), dwd(wd.size(), 0.0),
      scratch(rows * 3 * in);
  cpu::experts_backward(x.data(), c.offsets.data(), wgu.data(), wd.data(), o.gate_up.data(),
                        o.h.data(), r.data(), c.ne, d, in, dx.data(), dwgu.data(), dwd.data(),
                        scratch.data());
  expect_grad_close("experts.dx_sorted", x, dx, loss);
  expect_grad_close("experts.dw_gate_up", wgu, dwgu, loss);
  expect_grad_close("experts.dw_down", wd, dwd, loss);
  // Empty experts get exactly zero weight gradient.
  for (int64_t e : {0, 2, 4}) {
    for (int64_t i = 0; i < 2 * in * d; ++i) EXPECT_EQ(dwgu[e * 2 * in * d + i], 0.0);
    for (int64_t i = 0; i < d * in; ++i) EXPECT_EQ(dwd[e * d * in + i], 0.0);
  }
  // Weight gradients accumulate; dx is overwritten; null weight gradients are skipped.
  auto dwgu2 = dwgu, dwd2 = dwd;
  std::vector<double> dx2(rows * d, -3.0);
  cpu::experts_backward(x.data(), c.offsets.data(), wgu.data(), wd.data(), o.gate_up.data(),
                        o.h.data(), r.data(), c.ne, d, in, dx2.data(), dwgu2.data(), dwd2.data(),
                        scratch.data());
  EXPECT_EQ(dx2, dx);
  for (size_t i = 0; i < dwgu.size(); ++i) EXPECT_NEAR(dwgu2[i], 2 * dwgu[i], 1e-14 * (1 + std::abs(dwgu[i])));
  for (size_t i = 0; i < dwd.size(); ++i) EXPECT_NEAR(dwd2[i], 2 * dwd[i], 1e-14 * (1 + std::abs(dwd[i])));
  std::vector<double> dx3(rows * d);
  cpu::experts_backward(x.data(), c.offsets.data(), wgu.data(), wd.data(), o.gate_up.data(),
                        o.h.data(), r.data(), c.ne, d, in, dx3.data(), static_cast<double*>(nullptr),
                        static_cast<double*>(nullptr),
                        scratch.data());
  EXPECT_EQ(dx3, dx);
}

TEST(Experts, FloatMatchesDouble) {
  // Awkward sizes: 37 rows over 6 experts (two empty), d = 33, inner = 19.
  const ExpertsCase c{6, 33, 19, {0, 10, 10, 21, 30, 30, 37}};
  const int64_t rows = c.offsets.back(), d = c.d, in = c.inner;
  const auto x = random_vector(rows * d, 21), wgu = random_vector(c.ne * 2 * in * d, 22, 0.2),
             wd = random_vector(c.ne * d * in, 23, 0.2), r = random_vector(rows * d, 24);
  const auto od = run_experts(c, x, wgu, wd);
  const auto of = run_experts(c, cast<float>(x), cast<float>(wgu), cast<float>(wd));
  for (size_t i = 0; i < od.y.size(); ++i) EXPECT_NEAR(of.y[i], od.y[i], 1e-5 * (1 + std::abs(od.y[i])));
  std::vector<double> dxd(rows * d), dwgud(wgu.size(), 0.0), dwdd(wd.size(), 0.0), sd(rows * 3 * in);
  std::vector<float> dxf(rows * d), dwguf(wgu.size(), 0.f), dwdf(wd.size(), 0.f), sf(rows * 3 * in);
  cpu::experts_backward(x.data(), c.offsets.data(), wgu.data(), wd.data(), od.gate_up.data(),
                        od.h.data(), r.data(), c.ne, d, in, dxd.data(), dwgud.data(), dwdd.data(), sd.data());
  const auto xf = cast<float>(x), wguf = cast<float>(wgu), wdf = cast<float>(wd), rf = cast<float>(r);
  cpu::experts_backward(xf.data(), c.offsets.data(), wguf.data(), wdf.data(), of.gate_up.data(),
                        of.h.data(), rf.data(), c.ne, d, in, dxf.data(), dwguf.data(), dwdf.data(), sf.data());
  for (size_t i = 0; i < dxd.size(); ++i) EXPECT_NEAR(dxf[i], dxd[i], 1e-5 * (1 + std::abs(dxd[i])));
  for (size_t i = 0; i < dwgud.size(); ++i) EXPECT_NEAR(dwguf[i], dwgud[i], 1e-5 * (1 + std::abs(dwgud[i])));
  for (size_t i = 0; i < dwdd.size(); ++i) EXPECT_NEAR(dwdf[i], dwdd[i], 1e-5 * (1 + std::abs(dwdd[i])));
}

TEST(Experts, BadOffsetsNameTheValue) {
  std::vector<double> x(12), wgu(2 * 4 * 3), wd(2 * 3 * 2), gu(4 * 4), h(4 * 2), y(12);
  const std::vector<int32_t> decreasing = {0, 3, 2};
  std::string msg = error_of([&] {
    cpu::experts_forward(x.data(), decreasing.data(), wgu.data(), wd.data(), 2, 3, 2, gu.data(),
                         h.data(), y.data());
  });
  EXPECT_NE(msg.find("got 3 then 2 at expert 1"), std::string::npos) << msg;
  const std::vector<int32_t> shifted = {1, 2, 3};
  msg = error_of([&] {
    cpu::experts_forward(x.data(), shifted.data(), wgu.data(), wd.data(), 2, 3, 2, gu.data(),
                         h.data(), y.data());
  });
  EXPECT_NE(msg.find("expert_offsets[0] must be 0, got 1"), std::string::npos) << msg;
}

// The block sums of squares (the twin of the grouped wgrad's square sums): 128 x 128 blocks of each
// expert's [n, k] gradient in core/square_blocks.h's order, clipped at n and k; together the
// squared norm.
TEST(Experts, BlockSquareSumsAreTheBlocksOfTheNorm) {
  const int64_t E = 3, n = 200, k = 130;  // 2 x 2 blocks per expert, the last ones partial
  std::vector<float> dw(static_cast<size_t>(E * n * k));
  for (size_t i = 0; i < dw.size(); ++i) dw[i] = static_cast<float>(static_cast<int64_t>(i % 17) - 8) * 0.25f;
  ASSERT_EQ(square_blocks(E, n, k), 12);
  std::vector<double> sums(12, -1.0);
  cpu::block_square_sums(dw.data(), E, n, k, sums.data());
  double total = 0, blocks = 0;
  for (float v : dw) total += double(v) * double(v);
  for (double s : sums) blocks += s;
  EXPECT_EQ(blocks, total);  // integers times 1/16: every partial sum exact
  // Expert 2, row block 1 (rows 128..199), column block 1 (column 128..129).
  double want = 0;
  for (int64_t r = 128; r < n; ++r)
    for (int64_t c = 128; c < k; ++c) {
      const double v = dw[size_t((2 * n + r) * k + c)];
      want += v * v;
    }
  EXPECT_EQ(sums[size_t((2 * 2 + 1) * 2 + 1)], want);
  EXPECT_THROW(cpu::block_square_sums(dw.data(), E, -1, k, sums.data()), Error);
}

}  // namespace
}  // namespace moe::testing
