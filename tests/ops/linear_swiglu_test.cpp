// Gradient checks for linear (GEMM) and SwiGLU, and float/double agreement of gemm.
#include "cpu/linear.h"
#include "cpu/swiglu.h"
#include "support/gradcheck.h"

namespace moe::testing {
namespace {

TEST(Linear, GradCheck) {
  const int64_t n = 5, k = 7, m = 3;
  auto x = random_vector(n * k, 1), w = random_vector(m * k, 2), r = random_vector(n * m, 3);
  auto loss = [&] {
    std::vector<double> y(n * m);
    cpu::linear_forward(x.data(), w.data(), y.data(), n, k, m);
    return dot(y, r);
  };
  std::vector<double> dx(n * k), dw(m * k, 0.0);
  cpu::linear_backward(x.data(), w.data(), r.data(), dx.data(), dw.data(), n, k, m);
  expect_grad_close("linear.dx", x, dx, loss);
  expect_grad_close("linear.dw", w, dw, loss);
}

TEST(Linear, FloatMatchesDouble) {
  const int64_t n = 33, k = 65, m = 17;
  auto xd = random_vector(n * k, 4), wd = random_vector(m * k, 5);
  std::vector<float> xf(xd.begin(), xd.end()), wf(wd.begin(), wd.end());
  std::vector<double> yd(n * m);
  std::vector<float> yf(n * m);
  cpu::linear_forward(xd.data(), wd.data(), yd.data(), n, k, m);
  cpu::linear_forward(xf.data(), wf.data(), yf.data(), n, k, m);
  for (int64_t i = 0; i < n * m; ++i) EXPECT_NEAR(yf[i], yd[i], 1e-4 * (1 + std::abs(yd[i])));
}

TEST(Linear, AccumulateAndEmpty) {
  std::vector<double> x = {1, 2}, w = {3, 4}, y = {10};
  cpu::linear_forward(x.data(), w.data(), y.data(), 1, 2, 1, /*accumulate=*/true);
  EXPECT_EQ(y[0], 21.0);
  std::vector<float> xf, wf = {1.f, 2.f}, yf;
  cpu::linear_forward(xf.data(), wf.data(), yf.data(), 0, 2, 1);  // zero rows: no-op
  std::vector<float> c = {5.f};
  cpu::gemm<float>(false, false, 1, 1, 0, 1.f, nullptr, 1, nullptr, 1, 0.f, c.data(), 1);
  EXPECT_EQ(c[0], 0.f);  // k == 0 with beta 0 clears
}

TEST(SwiGLU, GradCheck) {
  const int64_t n = 4, inner = 6;
  auto gu = random_vector(n * 2 * inner, 6, 2.0), r = random_vector(n * inner, 7);
  auto loss = [&] {
    std::vector<double> h(n * inner);
    cpu::swiglu_forward(gu.data(), h.data(), n, inner);
    return dot(h, r);
  };
  std::vector<double> dgu(n * 2 * inner);
  cpu::swiglu_backward(gu.data(), r.data(), dgu.data(), n, inner);
  expect_grad_close("swiglu.dgate_up", gu, dgu, loss);
}

}  // namespace
}  // namespace moe::testing
