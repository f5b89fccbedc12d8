// Causal GQA attention: forward against an explicit masked softmax matrix, finite-difference
// gradients of q, k, v in double (Hq/Hkv = 2, 1 and Hq with one kv head), causality, float
// vs double agreement and independence of the result from the thread split.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "cpu/attention.h"
#include "support/gradcheck.h"

namespace moe::testing {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct Shape {
  int64_t b, s, hq, hkv, hd;
  int64_t q_size() const { return b * s * hq * hd; }
  int64_t kv_size() const { return b * s * hkv * hd; }
  std::string name() const {
    return "attention[b" + std::to_string(b) + " s" + std::to_string(s) + " hq" + std::to_string(hq) +
           " hkv" + std::to_string(hkv) + " hd" + std::to_string(hd) + "]";
  }
};

std::vector<float> to_float(const std::vector<double>& v) { return {v.begin(), v.end()}; }

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

// Reference: for every (b, h) an explicit [S, S] score matrix with -inf above the diagonal,
// a row softmax, then P @ V.
void naive_attention(const Shape& sh, const std::vector<double>& q, const std::vector<double>& k,
                     const std::vector<double>& v, std::vector<double>& out, std::vector<double>& lse) {
  const int64_t S = sh.s, hd = sh.hd;
  out.assign(sh.q_size(), 0.0);
  lse.assign(sh.b * sh.hq * S, 0.0);
  std::vector<double> scores(S * S);
  for (int64_t b = 0; b < sh.b; ++b)
    for (int64_t h = 0; h < sh.hq; ++h) {
      const int64_t g = h / (sh.hq / sh.hkv);
      auto qa = [&](int64_t i, int64_t c) { return q[((b * S + i) * sh.hq + h) * hd + c]; };
      auto ka = [&](int64_t j, int64_t c) { return k[((b * S + j) * sh.hkv + g) * hd + c]; };
      auto va = [&](int64_t j, int64_t c) { return v[((b * S + j) * sh.hkv + g) * hd + c]; };
      for (int64_t i = 0; i < S; ++i)
        for (int64_t j = 0; j < S; ++j) {
          double sc = 0;
          for (int64_t c = 0; c < hd; ++c) sc += qa(i, c) * ka(j, c);
          scores[i * S + j] = j <= i ? sc / std::sqrt(static_cast<double>(hd))
                                     : -std::numeric_limits<double>::infinity();
        }
      for (int64_t i = 0; i < S; ++i) {
        double sum = 0;
        for (int64_t j = 0; j < S; ++j) sum += std::exp(scores[i * S + j]);
        lse[(b * sh.hq + h) * S + i] = std::log(sum);
        for (int64_t c = 0; c < hd; ++c) {
          double acc = 0;
          for (int64_t j = 0; j < S; ++j) acc += std::exp(scores[i * S + j]) / sum * va(j, c);
          out[((b * S + i) * sh.hq + h) * hd + c] = acc;
        }
      }
    }
}

template <typename T>
void run_forward(const Shape& sh, const std::vector<T>& q, const std::vector<T>& k,
                 const std::vector<T>& v, std::vector<T>& out, std::vector<T>& lse) {
  out.assign(sh.q_size(), std::numeric_limits<T>::quiet_NaN());
  lse.assign(sh.b * sh.hq * sh.s, std::numeric_limits<T>::quiet_NaN());
  cpu::attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), sh.b, sh.s, sh.hq,
                         sh.hkv, sh.hd);
}

template <typename T>
void run_backward(const Shape& sh, const std::vector<T>& q, const std::vector<T>& k,
                  const std::vector<T>& v, const std::vector<T>& out, const std::vector<T>& lse,
                  const std::vector<T>& dout, std::vector<T>& dq, std::vector<T>& dk,
                  std::vector<T>& dv) {
  const T nan = std::numeric_limits<T>::quiet_NaN();  // outputs must be overwritten
  dq.assign(sh.q_size(), nan);
  dk.assign(sh.kv_size(), nan);
  dv.assign(sh.kv_size(), nan);
  cpu::attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(), dq.data(),
                          dk.data(), dv.data(), sh.b, sh.s, sh.hq, sh.hkv, sh.hd);
}

TEST(Attention, ForwardMatchesExplicitSoftmax) {
  for (const Shape sh : {Shape{2, 5, 4, 2, 5}, Shape{1, 1, 3, 3, 4}, Shape{2, 7, 4, 1, 3},
                         Shape{1, 70, 2, 1, 4}, Shape{1, 130, 2, 2, 3}}) {
    SCOPED_TRACE(sh.name());
    auto q = random_vector(sh.q_size(), 51), k = random_vector(sh.kv_size(), 52),
         v = random_vector(sh.kv_size(), 53);
    std::vector<double> out, lse, ref_out, ref_lse;
    run_forward(sh, q, k, v, out, lse);
    naive_attention(sh, q, k, v, ref_out, ref_lse);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref_out[i], 1e-12) << "out " << i;
    for (size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse[i], ref_lse[i], 1e-12) << "lse " << i;
  }
}

TEST(Attention, SingleTokenReturnsItsValue) {
  const Shape sh{1, 1, 4, 2, 3};
  auto q = random_vector(sh.q_size(), 54), k = random_vector(sh.kv_size(), 55),
       v = random_vector(sh.kv_size(), 56);
  std::vector<double> out, lse;
  run_forward(sh, q, k, v, out, lse);
  for (int64_t h = 0; h < sh.hq; ++h)
    for (int64_t c = 0; c < sh.hd; ++c) EXPECT_NEAR(out[h * sh.hd + c], v[(h / 2) * sh.hd + c], 1e-15);
}

TEST(Attention, GradCheck) {
  for (const Shape sh : {Shape{2, 5, 4, 2, 5}, Shape{2, 4, 3, 3, 4}, Shape{1, 6, 4, 1, 3},
                         Shape{1, 1, 2, 1, 3}, Shape{1, 70, 2, 1, 4}}) {
    SCOPED_TRACE(sh.name());
    auto q = random_vector(sh.q_size(), 61), k = random_vector(sh.kv_size(), 62),
         v = random_vector(sh.kv_size(), 63), r = random_vector(sh.q_size(), 64);
    auto loss = [&] {
      std::vector<double> out, lse;
      run_forward(sh, q, k, v, out, lse);
      return dot(out, r);
    };
    std::vector<double> out, lse, dq, dk, dv;
    run_forward(sh, q, k, v, out, lse);
    run_backward(sh, q, k, v, out, lse, r, dq, dk, dv);
    expect_grad_close(sh.name() + ".dq", q, dq, loss);
    expect_grad_close(sh.name() + ".dk", k, dk, loss);
    expect_grad_close(sh.name() + ".dv", v, dv, loss);
  }
}

// Changing k and v at position t leaves every output and lse before t bit-for-bit equal;
// gradients flowing only from positions before t leave dk and dv at t and later exactly 0.
template <typename T>
void check_causality() {
  const Shape sh{2, 9, 4, 2, 6};
  const int64_t t = 4;
  auto qd = random_vector(sh.q_size(), 71), kd = random_vector(sh.kv_size(), 72),
       vd = random_vector(sh.kv_size(), 73), dod = random_vector(sh.q_size(), 74);
  std::vector<T> q(qd.begin(), qd.end()), k(kd.begin(), kd.end()), v(vd.begin(), vd.end()),
      dout(dod.begin(), dod.end());
  std::vector<T> out, lse, out2, lse2;
  run_forward(sh, q, k, v, out, lse);
  auto k2 = k, v2 = v;
  for (int64_t b = 0; b < sh.b; ++b)
    for (int64_t j = t; j < sh.s; ++j)
      for (int64_t c = 0; c < sh.hkv * sh.hd; ++c) {
        k2[(b * sh.s + j) * sh.hkv * sh.hd + c] += T(3);
        v2[(b * sh.s + j) * sh.hkv * sh.hd + c] -= T(2);
      }
  run_forward(sh, q, k2, v2, out2, lse2);
  bool later_changed = false;
  for (int64_t b = 0; b < sh.b; ++b)
    for (int64_t i = 0; i < sh.s; ++i)
      for (int64_t c = 0; c < sh.hq * sh.hd; ++c) {
        const int64_t idx = (b * sh.s + i) * sh.hq * sh.hd + c;
        if (i < t) ASSERT_EQ(out[idx], out2[idx]) << "position " << i;
        else later_changed |= out[idx] != out2[idx];
      }
  EXPECT_TRUE(later_changed);
  for (int64_t bh = 0; bh < sh.b * sh.hq; ++bh)
    for (int64_t i = 0; i < t; ++i) ASSERT_EQ(lse[bh * sh.s + i], lse2[bh * sh.s + i]);

  for (int64_t b = 0; b < sh.b; ++b)
    for (int64_t i = t; i < sh.s; ++i)
      for (int64_t c = 0; c < sh.hq * sh.hd; ++c) dout[(b * sh.s + i) * sh.hq * sh.hd + c] = T(0);
  std::vector<T> dq, dk, dv;
  run_backward(sh, q, k, v, out, lse, dout, dq, dk, dv);
  for (int64_t b = 0; b < sh.b; ++b)
    for (int64_t j = t; j < sh.s; ++j)
      for (int64_t c = 0; c < sh.hkv * sh.hd; ++c) {
        ASSERT_EQ(dk[(b * sh.s + j) * sh.hkv * sh.hd + c], T(0)) << "dk position " << j;
        ASSERT_EQ(dv[(b * sh.s + j) * sh.hkv * sh.hd + c], T(0)) << "dv position " << j;
      }
}

TEST(Attention, CausalDouble) { check_causality<double>(); }
TEST(Attention, CausalFloat) { check_causality<float>(); }

TEST(Attention, FloatMatchesDouble) {
  for (const Shape sh : {Shape{8, 128, 4, 4, 32}, Shape{2, 70, 4, 2, 16}, Shape{1, 3, 2, 1, 5}}) {
    SCOPED_TRACE(sh.name());
    auto q = random_vector(sh.q_size(), 81), k = random_vector(sh.kv_size(), 82),
         v = random_vector(sh.kv_size(), 83), dout = random_vector(sh.q_size(), 84);
    std::vector<double> out, lse, dq, dk, dv;
    run_forward(sh, q, k, v, out, lse);
    run_backward(sh, q, k, v, out, lse, dout, dq, dk, dv);
    auto qf = to_float(q), kf = to_float(k), vf = to_float(v), doutf = to_float(dout);
    std::vector<float> outf, lsef, dqf, dkf, dvf;
    run_forward(sh, qf, kf, vf, outf, lsef);
    run_backward(sh, qf, kf, vf, outf, lsef, doutf, dqf, dkf, dvf);
    const double e_out = float_error(outf, out), e_lse = float_error(lsef, lse),
                 e_dq = float_error(dqf, dq), e_dk = float_error(dkf, dk), e_dv = float_error(dvf, dv);
    std::printf("%s float vs double: out %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", sh.name().c_str(),
                e_out, e_lse, e_dq, e_dk, e_dv);
    EXPECT_LE(e_out, 1e-5);
    EXPECT_LE(e_lse, 1e-6);
    EXPECT_LE(e_dq, 1e-5);
    EXPECT_LE(e_dk, 1e-5);
    EXPECT_LE(e_dv, 1e-5);
  }
}

TEST(Attention, ThreadSplitDoesNotChangeResults) {
  // Batch 3 x 2 kv heads is split over threads; each sequence alone runs on one thread.
  const Shape sh{3, 80, 4, 2, 32}, one{1, 80, 4, 2, 32};
  auto q = to_float(random_vector(sh.q_size(), 91)), k = to_float(random_vector(sh.kv_size(), 92)),
       v = to_float(random_vector(sh.kv_size(), 93)), dout = to_float(random_vector(sh.q_size(), 94));
  std::vector<float> out, lse, dq, dk, dv;
  run_forward(sh, q, k, v, out, lse);
  run_backward(sh, q, k, v, out, lse, dout, dq, dk, dv);
  for (int64_t b = 0; b < sh.b; ++b) {
    auto slice = [&](const std::vector<float>& x, int64_t per) {
      return std::vector<float>(x.begin() + b * per, x.begin() + (b + 1) * per);
    };
    const auto qb = slice(q, one.q_size()), kb = slice(k, one.kv_size()), vb = slice(v, one.kv_size()),
               db = slice(dout, one.q_size());
    std::vector<float> ob, lb, dqb, dkb, dvb;
    run_forward(one, qb, kb, vb, ob, lb);
    run_backward(one, qb, kb, vb, ob, lb, db, dqb, dkb, dvb);
    EXPECT_EQ(ob, slice(out, one.q_size())) << "batch " << b;
    EXPECT_EQ(lb, slice(lse, one.hq * one.s)) << "batch " << b;
    EXPECT_EQ(dqb, slice(dq, one.q_size())) << "batch " << b;
    EXPECT_EQ(dkb, slice(dk, one.kv_size())) << "batch " << b;
    EXPECT_EQ(dvb, slice(dv, one.kv_size())) << "batch " << b;
  }
}

TEST(Attention, BadHeadCountsThrow) {
  std::vector<float> x(64), lse(16);
  try {
    cpu::attention_forward(x.data(), x.data(), x.data(), x.data(), lse.data(), 1, 2, 3, 2, 4);
    ADD_FAILURE() << "expected moe::Error";
  } catch (const moe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("q_heads=3 kv_heads=2"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moe::testing
