// Embedding, RMSNorm, RoPE and cross-entropy: finite-difference gradients in double, forward
// values against independent formulas, float vs double agreement, RMSNorm from a saved rstd and
// error messages.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "cpu/cross_entropy.h"
#include "cpu/embedding.h"
#include "cpu/rmsnorm.h"
#include "cpu/rope.h"
#include "support/gradcheck.h"

namespace moe::testing {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr float kNaNf = std::numeric_limits<float>::quiet_NaN();

std::vector<float> to_float(const std::vector<double>& v) { return {v.begin(), v.end()}; }

// max |f - d| / max |d|: the normalised error used for float vs double agreement.
double float_error(const std::vector<float>& f, const std::vector<double>& d) {
  EXPECT_EQ(f.size(), d.size());
  double err = 0.0, ref = 0.0;
  for (size_t i = 0; i < d.size(); ++i) {
    EXPECT_FALSE(std::isnan(f[i])) << "NaN at " << i;
    err = std::max(err, std::abs(static_cast<double>(f[i]) - d[i]));
    ref = std::max(ref, std::abs(d[i]));
  }
  return err / std::max(ref, 1e-30);
}

// Runs `fn` expecting moe::Error whose message contains every string in `parts`.
template <typename Fn>
void expect_error_mentions(Fn fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected moe::Error";
  } catch (const moe::Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

// ---------------------------------------------------------------- embedding

TEST(Embedding, ForwardCopiesRows) {
  const int64_t vocab = 5, d = 3;
  auto w = random_vector(vocab * d, 11);
  const std::vector<int32_t> ids = {2, 0, 2, 4};
  std::vector<double> out(ids.size() * d, kNaN);
  cpu::embedding_forward(ids.data(), w.data(), out.data(), 4, vocab, d);
  for (size_t i = 0; i < ids.size(); ++i)
    for (int64_t j = 0; j < d; ++j) EXPECT_EQ(out[i * d + j], w[ids[i] * d + j]);
}

TEST(Embedding, GradCheckRepeatedIds) {
  const int64_t vocab = 5, d = 3;
  const std::vector<int32_t> ids = {1, 3, 1, 1, 0, 3};
  const int64_t n = static_cast<int64_t>(ids.size());
  auto w = random_vector(vocab * d, 12), r = random_vector(n * d, 13);
  auto loss = [&] {
    std::vector<double> out(n * d);
    cpu::embedding_forward(ids.data(), w.data(), out.data(), n, vocab, d);
    return dot(out, r);
  };
  const auto prefill = random_vector(vocab * d, 14);
  auto dw = prefill;  // backward accumulates
  cpu::embedding_backward(ids.data(), r.data(), dw.data(), n, vocab, d);
  std::vector<double> grad(vocab * d);
  for (int64_t i = 0; i < vocab * d; ++i) grad[i] = dw[i] - prefill[i];
  for (int64_t j = 0; j < d; ++j) {  // rows 2 and 4 never appear: untouched
    EXPECT_EQ(dw[2 * d + j], prefill[2 * d + j]);
    EXPECT_EQ(dw[4 * d + j], prefill[4 * d + j]);
  }
  expect_grad_close("embedding.dw", w, grad, loss);
}

TEST(Embedding, FloatMatchesDouble) {
  const int64_t vocab = 37, d = 19, n = 41;
  std::vector<int32_t> ids(n);
  for (int64_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>((i * 7) % 11);  // repeats
  auto dout = random_vector(n * d, 15);
  std::vector<double> dw(vocab * d, 0.0);
  std::vector<float> dwf(vocab * d, 0.f), doutf = to_float(dout);
  cpu::embedding_backward(ids.data(), dout.data(), dw.data(), n, vocab, d);
  cpu::embedding_backward(ids.data(), doutf.data(), dwf.data(), n, vocab, d);
  EXPECT_LE(float_error(dwf, dw), 1e-6);
}

TEST(Embedding, OutOfRangeIdsThrow) {
  const int64_t vocab = 5, d = 2;
  std::vector<float> w(vocab * d, 1.f), out(4 * d), dw(vocab * d);
  const std::vector<int32_t> too_big = {0, 1, 7, 2}, negative = {0, -3, 1, 2};
  expect_error_mentions([&] { cpu::embedding_forward(too_big.data(), w.data(), out.data(), 4, vocab, d); },
                        {"token id 7", "position 2", "[0, 5)"});
  expect_error_mentions([&] { cpu::embedding_forward(negative.data(), w.data(), out.data(), 4, vocab, d); },
                        {"token id -3", "position 1"});
  expect_error_mentions([&] { cpu::embedding_backward(too_big.data(), out.data(), dw.data(), 4, vocab, d); },
                        {"token id 7", "position 2"});
}

// ---------------------------------------------------------------- rmsnorm

TEST(RMSNorm, KnownValues) {
  const std::vector<double> x = {3, 4, 0, -2}, w = {1, 2};
  std::vector<double> y(4), rstd(2);
  cpu::rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), 2, 2, 0.0);
  // row 0: mean(9, 16) = 12.5; row 1: mean(0, 4) = 2
  EXPECT_NEAR(rstd[0], 1 / std::sqrt(12.5), 1e-15);
  EXPECT_NEAR(rstd[1], 1 / std::sqrt(2.0), 1e-15);
  EXPECT_NEAR(y[0], 3 / std::sqrt(12.5), 1e-15);
  EXPECT_NEAR(y[1], 8 / std::sqrt(12.5), 1e-15);
  EXPECT_EQ(y[2], 0.0);
  EXPECT_NEAR(y[3], -4 / std::sqrt(2.0), 1e-15);
}

TEST(RMSNorm, GradCheck) {
  struct Shape { int64_t n, d; double eps; };
  for (const Shape sh : {Shape{3, 7, 1e-5}, Shape{1, 1, 0.5}, Shape{2, 96, 1e-6}, Shape{4, 2, 0.1}}) {
    SCOPED_TRACE("n=" + std::to_string(sh.n) + " d=" + std::to_string(sh.d));
    const int64_t n = sh.n, d = sh.d;
    auto x = random_vector(n * d, 21), w = random_vector(d, 22, 0.5), r = random_vector(n * d, 23);
    for (auto& v : w) v += 1.0;
    auto loss = [&] {
      std::vector<double> y(n * d), rs(n);
      cpu::rmsnorm_forward(x.data(), w.data(), y.data(), rs.data(), n, d, sh.eps);
      return dot(y, r);
    };
    std::vector<double> y(n * d), rstd(n), dx(n * d, kNaN);
    cpu::rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), n, d, sh.eps);
    const auto prefill = random_vector(d, 24);
    auto dw = prefill;
    cpu::rmsnorm_backward(x.data(), w.data(), rstd.data(), r.data(), dx.data(), dw.data(), n, d);
    for (int64_t j = 0; j < d; ++j) dw[j] -= prefill[j];
    const std::string tag = "rmsnorm[" + std::to_string(n) + "x" + std::to_string(d) + "]";
    expect_grad_close(tag + ".dx", x, dx, loss);
    expect_grad_close(tag + ".dw", w, dw, loss);
  }
}

TEST(RMSNorm, FloatMatchesDouble) {
  const int64_t n = 17, d = 257;
  auto x = random_vector(n * d, 25, 3.0), w = random_vector(d, 26), dy = random_vector(n * d, 27);
  std::vector<double> y(n * d), rstd(n), dx(n * d), dw(d, 0.0);
  std::vector<float> xf = to_float(x), wf = to_float(w), dyf = to_float(dy), yf(n * d), rstdf(n),
                     dxf(n * d, kNaNf), dwf(d, 0.f);
  cpu::rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), n, d, 1e-5);
  cpu::rmsnorm_forward(xf.data(), wf.data(), yf.data(), rstdf.data(), n, d, 1e-5);
  cpu::rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data(), n, d);
  cpu::rmsnorm_backward(xf.data(), wf.data(), rstdf.data(), dyf.data(), dxf.data(), dwf.data(), n, d);
  EXPECT_LE(float_error(yf, y), 1e-6);
  EXPECT_LE(float_error(rstdf, rstd), 1e-6);
  EXPECT_LE(float_error(dxf, dx), 1e-5);
  EXPECT_LE(float_error(dwf, dw), 1e-5);
}

// rmsnorm_apply with the rstd rmsnorm_forward saved writes its y bit for bit (recomputation relies
// on it), float and double, on an awkward width.
template <typename T>
void check_rmsnorm_apply() {
  const int64_t n = 5, d = 67;
  const auto xd = random_vector(n * d, 28, 2.0), wd = random_vector(d, 29);
  const std::vector<T> x(xd.begin(), xd.end()), w(wd.begin(), wd.end());
  std::vector<T> y(n * d), rstd(n), again(n * d, T(kNaN));
  cpu::rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), n, d, 1e-5);
  cpu::rmsnorm_apply(x.data(), w.data(), rstd.data(), again.data(), n, d);
  EXPECT_EQ(std::memcmp(y.data(), again.data(), y.size() * sizeof(T)), 0);
  // Another rstd gives another y (the saved rstd is used, not recomputed).
  for (T& r : rstd) r *= T(2);
  cpu::rmsnorm_apply(x.data(), w.data(), rstd.data(), again.data(), n, d);
  EXPECT_NE(std::memcmp(y.data(), again.data(), y.size() * sizeof(T)), 0);
}

TEST(RMSNorm, ApplyWithSavedRstdIsForwardsOutput) {
  check_rmsnorm_apply<float>();
  check_rmsnorm_apply<double>();
}

// rmsnorm_backward_add is rmsnorm_backward followed by acc += dx, bit for bit (float and double),
// dw accumulated the same way.
template <typename T>
void check_rmsnorm_backward_add() {
  const int64_t n = 6, d = 67;
  const auto xd = random_vector(n * d, 31, 2.0), wd = random_vector(d, 32), gd = random_vector(n * d, 33);
  const auto ad = random_vector(n * d, 34);
  const std::vector<T> x(xd.begin(), xd.end()), w(wd.begin(), wd.end()), dy(gd.begin(), gd.end());
  std::vector<T> y(n * d), rstd(n), dx(n * d), two(ad.begin(), ad.end()), one(two), dw_two(d, T(0.5)), dw_one(dw_two);
  cpu::rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), n, d, 1e-5);
  cpu::rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw_two.data(), n, d);
  for (int64_t i = 0; i < n * d; ++i) two[i] += dx[i];
  cpu::rmsnorm_backward_add(x.data(), w.data(), rstd.data(), dy.data(), one.data(), dw_one.data(), n, d);
  EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(T)), 0);
  EXPECT_EQ(std::memcmp(dw_one.data(), dw_two.data(), dw_one.size() * sizeof(T)), 0);
}

TEST(RMSNorm, BackwardAddIsTheBackwardThenTheAdd) {
  check_rmsnorm_backward_add<float>();
  check_rmsnorm_backward_add<double>();
}

// ---------------------------------------------------------------- rope
// rmsnorm_rope_forward is rmsnorm_forward over the row's heads * head_dim, then rope_forward (or
// rope_forward_at at a position offset), bit for bit; a batch at an offset is refused.
TEST(RoPE, NormThenRotationIsTheTwoOps) {
  const int64_t b = 2, s = 5, h = 3, hd = 8, n = b * s, d = h * hd;
  const auto x = random_vector(n * d, 41, 2.0), w = random_vector(d, 42);
  std::vector<double> y(n * d), rstd(n), y2(n * d), rstd2(n);
  cpu::rmsnorm_rope_forward(x.data(), w.data(), y.data(), rstd.data(), b, s, 0, h, hd, 1e-6, 1e4);
  cpu::rmsnorm_forward(x.data(), w.data(), y2.data(), rstd2.data(), n, d, 1e-6);
  cpu::rope_forward(y2.data(), b, s, h, hd, 1e4);
  EXPECT_EQ(std::memcmp(y.data(), y2.data(), y.size() * sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(rstd.data(), rstd2.data(), rstd.size() * sizeof(double)), 0);
  cpu::rmsnorm_rope_forward(x.data(), w.data(), y.data(), rstd.data(), 1, s, 7, h, hd, 1e-6, 1e4);
  cpu::rmsnorm_forward(x.data(), w.data(), y2.data(), rstd2.data(), s, d, 1e-6);
  cpu::rope_forward_at(y2.data(), s, 7, h, hd, 1e4);
  EXPECT_EQ(std::memcmp(y.data(), y2.data(), size_t(s * d) * sizeof(double)), 0);
  expect_error_mentions(
      [&] { cpu::rmsnorm_rope_forward(x.data(), w.data(), y.data(), rstd.data(), 2, s, 7, h, hd, 1e-6, 1e4); },
      {"rmsnorm_rope_forward", "batch=2", "pos0=7"});
}


// rope_rmsnorm_backward is rope_backward then rmsnorm_backward, bit for bit.
TEST(RoPE, RotationBackThenNormBackwardIsTheTwoOps) {
  const int64_t b = 2, s = 5, h = 3, hd = 8, n = b * s, d = h * hd;
  const auto x = random_vector(n * d, 51, 2.0), w = random_vector(d, 52), g = random_vector(n * d, 53);
  std::vector<double> y(n * d), rstd(n), dy1(g), dy2(g), dx1(n * d), dx2(n * d), dw1(d, 0.25), dw2(d, 0.25);
  cpu::rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), n, d, 1e-6);
  cpu::rope_rmsnorm_backward(x.data(), w.data(), rstd.data(), dy1.data(), dx1.data(), dw1.data(), b, s, h, hd, 1e4);
  cpu::rope_backward(dy2.data(), b, s, h, hd, 1e4);
  cpu::rmsnorm_backward(x.data(), w.data(), rstd.data(), dy2.data(), dx2.data(), dw2.data(), n, d);
  EXPECT_EQ(std::memcmp(dx1.data(), dx2.data(), dx1.size() * sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(dw1.data(), dw2.data(), dw1.size() * sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(dy1.data(), dy2.data(), dy1.size() * sizeof(double)), 0);
}

TEST(RoPE, MatchesRotateHalfConvention) {
  // hd = 4, theta = 10000, position 1: pair (0, 2) turns by 1 rad, pair (1, 3) by 0.01 rad.
  std::vector<double> x = {0, 0, 0, 0, 1, 0, 0, 0,   // batch 0: positions 0 and 1
                           0, 0, 0, 0, 0, 1, 0, 0};  // batch 1
  x[0] = 0.3;  // position 0 must stay as it is
  cpu::rope_forward(x.data(), 2, 2, 1, 4, 10000.0);
  EXPECT_EQ(x[0], 0.3);
  EXPECT_NEAR(x[4], std::cos(1.0), 1e-15);
  EXPECT_NEAR(x[5], 0.0, 1e-15);
  EXPECT_NEAR(x[6], std::sin(1.0), 1e-15);
  EXPECT_NEAR(x[12], 0.0, 1e-15);
  EXPECT_NEAR(x[13], std::cos(0.01), 1e-15);
  EXPECT_NEAR(x[15], std::sin(0.01), 1e-15);
}

TEST(RoPE, GradCheck) {
  struct Shape { int64_t b, s, h, hd; };
  for (const Shape sh : {Shape{2, 3, 3, 6}, Shape{1, 1, 1, 2}, Shape{1, 5, 2, 10}}) {
    const int64_t size = sh.b * sh.s * sh.h * sh.hd;
    auto x = random_vector(size, 31), r = random_vector(size, 32);
    auto loss = [&] {
      auto y = x;
      cpu::rope_forward(y.data(), sh.b, sh.s, sh.h, sh.hd, 500.0);
      return dot(y, r);
    };
    auto dx = r;
    cpu::rope_backward(dx.data(), sh.b, sh.s, sh.h, sh.hd, 500.0);
    expect_grad_close("rope[" + std::to_string(sh.b) + "x" + std::to_string(sh.s) + "x" +
                          std::to_string(sh.h) + "x" + std::to_string(sh.hd) + "].dx",
                      x, dx, loss);
  }
}

TEST(RoPE, PreservesNormsAndInverts) {
  const int64_t b = 2, s = 9, h = 3, hd = 8, half = hd / 2;
  const auto x = random_vector(b * s * h * hd, 33);
  auto y = x;
  cpu::rope_forward(y.data(), b, s, h, hd, 10000.0);
  for (int64_t row = 0; row < b * s * h; ++row)
    for (int64_t i = 0; i < half; ++i) {
      const int64_t a = row * hd + i, c = a + half;
      EXPECT_NEAR(y[a] * y[a] + y[c] * y[c], x[a] * x[a] + x[c] * x[c], 1e-13);
    }
  cpu::rope_backward(y.data(), b, s, h, hd, 10000.0);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], x[i], 1e-14);

  std::vector<float> yf = to_float(x);
  cpu::rope_forward(yf.data(), b, s, h, hd, 10000.0);
  cpu::rope_backward(yf.data(), b, s, h, hd, 10000.0);
  EXPECT_LE(float_error(yf, x), 1e-6);
}

TEST(RoPE, ScoresDependOnRelativePosition) {
  // The same q at positions 3 and 10 against the same k at 1 and 8 gives the same score.
  const int64_t s = 12, hd = 16;
  const auto qv = random_vector(hd, 34), kv = random_vector(hd, 35);
  std::vector<double> q(s * hd, 0.0), k(s * hd, 0.0);
  for (int64_t pos : {3, 10}) std::copy(qv.begin(), qv.end(), q.begin() + pos * hd);
  for (int64_t pos : {1, 8}) std::copy(kv.begin(), kv.end(), k.begin() + pos * hd);
  cpu::rope_forward(q.data(), 1, s, 1, hd, 10000.0);
  cpu::rope_forward(k.data(), 1, s, 1, hd, 10000.0);
  double a = 0, c = 0, plain = 0;
  for (int64_t i = 0; i < hd; ++i) {
    a += q[3 * hd + i] * k[1 * hd + i];
    c += q[10 * hd + i] * k[8 * hd + i];
    plain += qv[i] * kv[i];
  }
  EXPECT_NEAR(a, c, 1e-12);
  EXPECT_GT(std::abs(a - plain), 1e-3);  // the rotation did change the score
}

TEST(RoPE, FloatMatchesDoubleAtLongPositions) {
  const int64_t b = 1, s = 4096, h = 2, hd = 8;
  const auto x = random_vector(b * s * h * hd, 36);
  auto y = x;
  auto yf = to_float(x);
  cpu::rope_forward(y.data(), b, s, h, hd, 10000.0);
  cpu::rope_forward(yf.data(), b, s, h, hd, 10000.0);
  EXPECT_LE(float_error(yf, y), 1e-6);
  cpu::rope_backward(y.data(), b, s, h, hd, 10000.0);
  cpu::rope_backward(yf.data(), b, s, h, hd, 10000.0);
  EXPECT_LE(float_error(yf, y), 1e-6);
}

TEST(RoPE, OddHeadDimThrows) {
  std::vector<float> x(2 * 5);
  expect_error_mentions([&] { cpu::rope_forward(x.data(), 1, 2, 1, 5, 10000.0); }, {"head_dim", "5"});
}

// ---------------------------------------------------------------- cross-entropy

// Independent reference: loss_i from an explicit softmax.
double naive_ce(const std::vector<double>& logits, int64_t i, int64_t vocab, int32_t target,
                double z_weight, double* lse_out) {
  double sum = 0.0;
  for (int64_t j = 0; j < vocab; ++j) sum += std::exp(logits[i * vocab + j]);
  const double lse = std::log(sum);
  *lse_out = lse;
  if (target < 0) return 0.0;
  return -std::log(std::exp(logits[i * vocab + target]) / sum) + z_weight * lse * lse;
}

TEST(CrossEntropy, ForwardMatchesExplicitSoftmax) {
  const int64_t n = 4, vocab = 9;
  auto logits = random_vector(n * vocab, 41, 2.0);
  const std::vector<int32_t> targets = {0, 8, -100, 4};
  for (double z : {0.0, 1e-2}) {
    std::vector<double> loss(n, kNaN), lse(n, kNaN);
    cpu::cross_entropy_forward(logits.data(), targets.data(), loss.data(), lse.data(), n, vocab, z);
    for (int64_t i = 0; i < n; ++i) {
      double ref_lse = 0;
      const double ref = naive_ce(logits, i, vocab, targets[i], z, &ref_lse);
      EXPECT_NEAR(loss[i], ref, 1e-13);
      EXPECT_NEAR(lse[i], ref_lse, 1e-13);
    }
    EXPECT_EQ(loss[2], 0.0);
  }
}

TEST(CrossEntropy, GradCheck) {
  const int64_t n = 5, vocab = 7;
  const std::vector<int32_t> targets = {3, 0, -1, 6, 3};
  const double grad_scale = 0.7;
  for (double z : {0.0, 1e-2, 0.5}) {
    auto logits = random_vector(n * vocab, 42, 1.5);
    auto loss_fn = [&] {
      std::vector<double> loss(n), lse(n);
      cpu::cross_entropy_forward(logits.data(), targets.data(), loss.data(), lse.data(), n, vocab, z);
      double total = 0.0;
      for (double l : loss) total += l;
      return grad_scale * total;
    };
    std::vector<double> loss(n), lse(n), dlogits(n * vocab, kNaN);
    cpu::cross_entropy_forward(logits.data(), targets.data(), loss.data(), lse.data(), n, vocab, z);
    cpu::cross_entropy_backward(logits.data(), targets.data(), lse.data(), dlogits.data(), n, vocab, z,
                                grad_scale);
    for (int64_t j = 0; j < vocab; ++j) EXPECT_EQ(dlogits[2 * vocab + j], 0.0);  // ignored row
    char tag[64];
    std::snprintf(tag, sizeof(tag), "cross_entropy[z=%g].dlogits", z);
    expect_grad_close(tag, logits, dlogits, loss_fn);
  }
}

TEST(CrossEntropy, LargeLogitsStayFinite) {
  // Adding a constant to a row leaves the z=0 loss unchanged; float must not overflow at 1e3.
  const int64_t n = 3, vocab = 50;
  auto logits = random_vector(n * vocab, 43);
  const std::vector<int32_t> targets = {1, 49, 0};
  std::vector<double> loss(n), lse(n);
  cpu::cross_entropy_forward(logits.data(), targets.data(), loss.data(), lse.data(), n, vocab, 0.0);
  std::vector<float> shifted(n * vocab), lossf(n), lsef(n), dlf(n * vocab);
  for (int64_t i = 0; i < n * vocab; ++i) shifted[i] = static_cast<float>(logits[i] + 1000.0);
  cpu::cross_entropy_forward(shifted.data(), targets.data(), lossf.data(), lsef.data(), n, vocab, 0.0);
  cpu::cross_entropy_backward(shifted.data(), targets.data(), lsef.data(), dlf.data(), n, vocab, 0.0, 1.f);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(lossf[i], loss[i], 1e-4);
    EXPECT_NEAR(lsef[i], lse[i] + 1000.0, 1e-3);
  }
  for (float g : dlf) EXPECT_TRUE(std::isfinite(g));
}

TEST(CrossEntropy, FloatMatchesDouble) {
  const int64_t n = 9, vocab = 1001;
  auto logits = random_vector(n * vocab, 44, 3.0);
  std::vector<int32_t> targets(n);
  for (int64_t i = 0; i < n; ++i) targets[i] = static_cast<int32_t>((i * 131) % vocab);
  targets[4] = -1;
  const double z = 1e-3;
  std::vector<double> loss(n), lse(n), dl(n * vocab);
  std::vector<float> lf = to_float(logits), lossf(n), lsef(n), dlf(n * vocab, kNaNf);
  cpu::cross_entropy_forward(logits.data(), targets.data(), loss.data(), lse.data(), n, vocab, z);
  cpu::cross_entropy_forward(lf.data(), targets.data(), lossf.data(), lsef.data(), n, vocab, z);
  cpu::cross_entropy_backward(logits.data(), targets.data(), lse.data(), dl.data(), n, vocab, z, 0.25);
  cpu::cross_entropy_backward(lf.data(), targets.data(), lsef.data(), dlf.data(), n, vocab, z, 0.25f);
  EXPECT_LE(float_error(lossf, loss), 1e-6);
  EXPECT_LE(float_error(lsef, lse), 1e-6);
  EXPECT_LE(float_error(dlf, dl), 1e-5);
}

TEST(CrossEntropy, OutOfRangeTargetThrows) {
  const int64_t n = 4, vocab = 7;
  std::vector<float> logits(n * vocab, 0.f), loss(n), lse(n, 0.f), dl(n * vocab);
  const std::vector<int32_t> targets = {0, 1, 2, 7};
  expect_error_mentions(
      [&] { cpu::cross_entropy_forward(logits.data(), targets.data(), loss.data(), lse.data(), n, vocab, 0.0); },
      {"target 7", "position 3", "[0, 7)"});
  expect_error_mentions(
      [&] {
        cpu::cross_entropy_backward(logits.data(), targets.data(), lse.data(), dl.data(), n, vocab, 0.0, 1.f);
      },
      {"target 7", "position 3"});
}

}  // namespace
}  // namespace moe::testing
