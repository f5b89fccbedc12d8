// Block-scaled FP8 reference ops (cpu/fp8.h): every code of both formats decodes and encodes back;
// block quantisation picks amax / fp8_max per block and the nearest code for every element (checked
// against all 256 codes), edge blocks and all-zero blocks; MX (OCP MXFP8) scale exponents by the
// spec's rule and the no-saturation rule, E8M0 codes, the spec's saturation; the block-scaled GEMM
// against the product of the dequantised operands (FP32 reduction) and bitwise on exact cases.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "cpu/fp8.h"
#include "optim/adamw.h"
#include "support/parity.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

using cpu::Fp8Format;

std::vector<float> randn(int64_t n, uint64_t seed, float std = 1.0f) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> nd(0.0f, std);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = nd(gen);
  return v;
}

// The code whose value is nearest to v (the smaller magnitude code's neighbour on exact ties is
// not decided here: ties are checked separately), among every finite code of the format.
float nearest_distance(float v, Fp8Format f) {
  float best = std::numeric_limits<float>::infinity();
  for (int c = 0; c < 256; ++c) {
    const float d = cpu::fp8_decode(uint8_t(c), f);
    if (std::isfinite(d)) best = std::min(best, std::fabs(d - v));
  }
  return best;
}

TEST(Fp8, FormatsAndEveryCodeRoundTrips) {
  EXPECT_EQ(cpu::fp8_max(Fp8Format::kE4M3), 448.0f);
  EXPECT_EQ(cpu::fp8_max(Fp8Format::kE5M2), 57344.0f);
  EXPECT_EQ(cpu::fp8_emax(Fp8Format::kE4M3), 8);
  EXPECT_EQ(cpu::fp8_emax(Fp8Format::kE5M2), 15);
  for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    int finite = 0;
    for (int c = 0; c < 256; ++c) {
      const float v = cpu::fp8_decode(uint8_t(c), f);
      if (!std::isfinite(v)) continue;
      ++finite;
      if (v == 0.0f) continue;  // +0 and -0 both encode from their own sign
      EXPECT_EQ(cpu::fp8_encode(v, f), uint8_t(c)) << "code " << c;
    }
    EXPECT_EQ(finite, f == Fp8Format::kE4M3 ? 254 : 248);
  }
}

TEST(Fp8, BlockQuantisationPicksAmaxScalesAndNearestCodes) {
  const int64_t rows = 5, cols = 300;  // 1 x 128 blocks: 128, 128 and an edge block of 44
  std::vector<float> x = randn(rows * cols, 1, 3.0f);
  for (int64_t c = 256; c < 300; ++c) x[size_t(3 * cols + c)] = 0.0f;  // an all-zero edge block
  for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    const cpu::Fp8Block blk = cpu::kFp8ActivationBlock;
    ASSERT_EQ(cpu::fp8_scale_rows(rows, blk), 5);
    ASSERT_EQ(cpu::fp8_scale_cols(cols, blk), 3);
    std::vector<uint8_t> q(size_t(rows * cols));
    std::vector<float> s(15), back(size_t(rows * cols));
    cpu::fp8_quantize_blocks(x.data(), rows, cols, blk, f, q.data(), s.data());
    cpu::fp8_dequantize_blocks(q.data(), s.data(), rows, cols, blk, f, back.data());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < 3; ++b) {
        float amax = 0.0f;
        for (int64_t c = b * 128; c < std::min<int64_t>(cols, b * 128 + 128); ++c)
          amax = std::max(amax, std::fabs(x[size_t(r * cols + c)]));
        const float want = amax == 0.0f ? 1.0f : amax / cpu::fp8_max(f);
        EXPECT_EQ(s[size_t(r * 3 + b)], want) << "scale of block (" << r << ", " << b << ")";
      }
    }
    for (int64_t i = 0; i < rows * cols; ++i) {
      const float sc = s[size_t((i / cols) * 3 + (i % cols) / 128)];
      const float v = x[size_t(i)] / sc;
      const float got = std::fabs(cpu::fp8_decode(q[size_t(i)], f) - v);
      ASSERT_LE(got, nearest_distance(v, f)) << "element " << i << " is not on its nearest code";
      EXPECT_EQ(back[size_t(i)], cpu::fp8_decode(q[size_t(i)], f) * sc);
    }
    // The all-zero block: scale 1, zero codes; each block's largest magnitude hits fp8_max.
    EXPECT_EQ(s[3 * 3 + 2], 1.0f);
    for (int64_t c = 256; c < 300; ++c) EXPECT_EQ(cpu::fp8_decode(q[size_t(3 * cols + c)], f), 0.0f);
    int at_max = 0;
    for (uint8_t code : q) at_max += std::fabs(cpu::fp8_decode(code, f)) == cpu::fp8_max(f) ? 1 : 0;
    EXPECT_GE(at_max, 14) << "every non-zero block has an element at +-fp8_max";
  }
}

TEST(Fp8, WeightBlocksAreTwoDimensional) {
  const int64_t rows = 200, cols = 260;  // 128 x 128 blocks: a 2 x 3 grid with edge blocks
  std::vector<float> w = randn(rows * cols, 2, 0.02f);
  w[size_t(150 * cols + 5)] = 7.0f;  // block (1, 0) only
  std::vector<uint8_t> q(size_t(rows * cols));
  std::vector<float> s(6);
  cpu::fp8_quantize_blocks(w.data(), rows, cols, cpu::kFp8WeightBlock, Fp8Format::kE4M3, q.data(), s.data());
  EXPECT_EQ(s[3], 7.0f / 448.0f);
  for (int b : {0, 1, 2, 4, 5}) EXPECT_LT(s[size_t(b)], 0.2f / 448.0f) << "block " << b << " saw the outlier";
  EXPECT_EQ(cpu::fp8_decode(q[size_t(150 * cols + 5)], Fp8Format::kE4M3), 448.0f);
}

TEST(Fp8, NonFiniteInputsAreRefusedNamingTheElement) {
  std::vector<float> x(256, 1.0f);
  x[130] = std::numeric_limits<float>::quiet_NaN();
  std::vector<uint8_t> q(256), sc(8);
  std::vector<float> s(2);
  EXPECT_NE(error_of([&] {
    cpu::fp8_quantize_blocks(x.data(), 1, 256, cpu::kFp8ActivationBlock, Fp8Format::kE4M3, q.data(), s.data());
  }).find("element [0, 130]"), std::string::npos);
  x[130] = std::numeric_limits<float>::infinity();
  EXPECT_NE(error_of([&] {
    cpu::mx_quantize(x.data(), 1, 256, Fp8Format::kE4M3, cpu::MxScale::kOcp, q.data(), sc.data());
  }).find("finite"), std::string::npos);
}

TEST(Fp8, MxScaleExponentsFollowTheSpecAndTheNoSaturationRule) {
  using cpu::MxScale;
  const auto e4 = Fp8Format::kE4M3, e5 = Fp8Format::kE5M2;
  EXPECT_EQ(cpu::mx_scale_exponent(448.0f, e4, MxScale::kOcp), 0);
  EXPECT_EQ(cpu::mx_scale_exponent(448.0f, e4, MxScale::kNoSaturation), 0);
  EXPECT_EQ(cpu::mx_scale_exponent(500.0f, e4, MxScale::kOcp), 0);           // 500 saturates to 448
  EXPECT_EQ(cpu::mx_scale_exponent(500.0f, e4, MxScale::kNoSaturation), 1);  // 250
  EXPECT_EQ(cpu::mx_scale_exponent(256.0f, e4, MxScale::kOcp), 0);
  EXPECT_EQ(cpu::mx_scale_exponent(1.0f, e4, MxScale::kOcp), -8);
  EXPECT_EQ(cpu::mx_scale_exponent(0.75f, e4, MxScale::kOcp), -9);
  EXPECT_EQ(cpu::mx_scale_exponent(57344.0f, e5, MxScale::kOcp), 0);
  EXPECT_EQ(cpu::mx_scale_exponent(60000.0f, e5, MxScale::kNoSaturation), 1);
  EXPECT_EQ(cpu::mx_scale_exponent(0.0f, e4, MxScale::kOcp), -127);
  EXPECT_EQ(cpu::mx_scale_exponent(1e-40f, e4, MxScale::kOcp), -127);       // clamped at the bottom
  EXPECT_EQ(cpu::mx_scale_exponent(3e38f, e4, MxScale::kOcp), 127 - 8 + 0);  // floor(log2) = 127
}

TEST(Fp8, MxQuantisationBlocksOf32WithE8M0Scales) {
  const int64_t rows = 3, cols = 70;  // blocks of 32, 32 and 6
  std::vector<float> x = randn(rows * cols, 3);
  x[size_t(1 * cols + 40)] = 500.0f * 8.0f;  // row 1, block 1: the spec's rule saturates it
  for (cpu::MxScale rule : {cpu::MxScale::kOcp, cpu::MxScale::kNoSaturation}) {
    std::vector<uint8_t> q(size_t(rows * cols)), sc(9);
    std::vector<float> back(size_t(rows * cols));
    cpu::mx_quantize(x.data(), rows, cols, Fp8Format::kE4M3, rule, q.data(), sc.data());
    cpu::mx_dequantize(q.data(), sc.data(), rows, cols, Fp8Format::kE4M3, back.data());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < 3; ++b) {
        float amax = 0.0f;
        for (int64_t c = b * 32; c < std::min<int64_t>(cols, b * 32 + 32); ++c)
          amax = std::max(amax, std::fabs(x[size_t(r * cols + c)]));
        const int e = cpu::mx_scale_exponent(amax, Fp8Format::kE4M3, rule);
        ASSERT_EQ(sc[size_t(r * 3 + b)], uint8_t(e + 127));
        EXPECT_EQ(moe::e8m0_to_f32(sc[size_t(r * 3 + b)]), std::ldexp(1.0f, e));
        for (int64_t c = b * 32; c < std::min<int64_t>(cols, b * 32 + 32); ++c) {
          const size_t i = size_t(r * cols + c);
          EXPECT_EQ(q[i], cpu::fp8_encode(std::ldexp(x[i], -e), Fp8Format::kE4M3));
          EXPECT_EQ(back[i], std::ldexp(cpu::fp8_decode(q[i], Fp8Format::kE4M3), e));
        }
      }
    }
    const float big = back[size_t(1 * cols + 40)];
    if (rule == cpu::MxScale::kOcp) {
      EXPECT_EQ(big, 448.0f * 8.0f) << "the spec's scale saturates the block's largest element";
    } else {
      EXPECT_EQ(big, 4096.0f) << "the rounded-up scale keeps it: 4000 / 16 = 250 rounds to 256 (E4M3 steps of 16)";
    }
  }
  std::vector<uint8_t> q(32, 0x38), bad = {0xFF};
  std::vector<float> out(32);
  EXPECT_NE(error_of([&] { cpu::mx_dequantize(q.data(), bad.data(), 1, 32, Fp8Format::kE4M3, out.data()); }).find("0xFF"),
            std::string::npos);
}

TEST(Fp8, BlockScaledGemmEqualsTheDequantisedProduct) {
  const int64_t m = 7, n = 130, k = 300;
  const std::vector<float> a = randn(m * k, 4), b = randn(n * k, 5, 0.05f);
  std::vector<uint8_t> qa(size_t(m * k)), qb(size_t(n * k));
  std::vector<float> sa(size_t(m * 3)), sb(size_t(2 * 3)), da(a.size()), db(b.size());
  cpu::fp8_quantize_blocks(a.data(), m, k, cpu::kFp8ActivationBlock, Fp8Format::kE4M3, qa.data(), sa.data());
  cpu::fp8_quantize_blocks(b.data(), n, k, cpu::kFp8WeightBlock, Fp8Format::kE4M3, qb.data(), sb.data());
  cpu::fp8_dequantize_blocks(qa.data(), sa.data(), m, k, cpu::kFp8ActivationBlock, Fp8Format::kE4M3, da.data());
  cpu::fp8_dequantize_blocks(qb.data(), sb.data(), n, k, cpu::kFp8WeightBlock, Fp8Format::kE4M3, db.data());
  std::vector<float> ref(size_t(m * n)), c(size_t(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p) acc += double(da[size_t(i * k + p)]) * db[size_t(j * k + p)];
      ref[size_t(i * n + j)] = float(acc);
    }
  cpu::fp8_gemm_block_scaled(qa.data(), sa.data(), Fp8Format::kE4M3, qb.data(), sb.data(), Fp8Format::kE4M3, m, n,
                             k, c.data(), false);
  expect_parity("fp8_gemm_block_scaled", c, ref, kFP32Reduction);
  // Accumulate adds the same product again (the K blocks are added to C one by one, so the sum is
  // 2 C up to FP32 rounding).
  std::vector<float> twice = c, ref2(c.size());
  cpu::fp8_gemm_block_scaled(qa.data(), sa.data(), Fp8Format::kE4M3, qb.data(), sb.data(), Fp8Format::kE4M3, m, n,
                             k, twice.data(), true);
  for (size_t i = 0; i < c.size(); ++i) ref2[i] = 2.0f * ref[i];
  expect_parity("fp8_gemm_block_scaled accumulate", twice, ref2, kFP32Reduction);
  // An exact case: codes of small integers and power-of-two scales give the exact product.
  std::vector<uint8_t> one(128, cpu::fp8_encode(1.0f, Fp8Format::kE4M3)), two(128, cpu::fp8_encode(2.0f, Fp8Format::kE4M3));
  const float s1 = 0.5f, s2 = 4.0f;
  float out = -1.0f;
  cpu::fp8_gemm_block_scaled(one.data(), &s1, Fp8Format::kE4M3, two.data(), &s2, Fp8Format::kE4M3, 1, 1, 128, &out,
                             false);
  EXPECT_EQ(out, 128.0f * 1.0f * 2.0f * 0.5f * 4.0f);
}

// x [rows, cols] quantised in `block` blocks of format f and dequantised: what the FP8 GEMM sees.
std::vector<float> fake_quant(const std::vector<float>& x, int64_t rows, int64_t cols, cpu::Fp8Block block,
                              Fp8Format f) {
  std::vector<uint8_t> q(x.size());
  std::vector<float> s(size_t(cpu::fp8_scale_rows(rows, block) * cpu::fp8_scale_cols(cols, block))), d(x.size());
  cpu::fp8_quantize_blocks(x.data(), rows, cols, block, f, q.data(), s.data());
  cpu::fp8_dequantize_blocks(q.data(), s.data(), rows, cols, block, f, d.data());
  return d;
}

std::vector<float> transpose(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> t(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = x[size_t(r * cols + c)];
  return t;
}

// C [m, n] = A [m, k] B [n, k]^T in double.
std::vector<float> gemm_abt(const std::vector<float>& a, const std::vector<float>& b, int64_t m, int64_t n, int64_t k) {
  std::vector<float> c(size_t(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p) acc += double(a[size_t(i * k + p)]) * b[size_t(j * k + p)];
      c[size_t(i * n + j)] = float(acc);
    }
  return c;
}

// The three passes of the FP8 linear recipe: each equals the FP32 product of its operands
// quantised as the recipe says (1 x 128 along the reduced dimension, W in 128 x 128 blocks, dgrad
// reading W's blocks transposed, wgrad both operands along M), and stays within FP8's rounding of
// the unquantised product; E5M2 gradients round coarser than E4M3.
TEST(Fp8, LinearPassesFollowTheRecipe) {
  struct Shape {
    int64_t m, n, k;
  };
  for (const Shape s : {Shape{1, 1, 1}, Shape{3, 200, 130}, Shape{130, 129, 257}}) {
    const std::string at = std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k);
    const std::vector<float> x = randn(s.m * s.k, 11), w = randn(s.n * s.k, 12, 0.05f), dy = randn(s.m * s.n, 13, 1e-3f);
    double err_e4 = 0, err_e5 = 0;
    for (const Fp8Format g : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      const cpu::Fp8Recipe r{Fp8Format::kE4M3, g};
      // Forward.
      std::vector<float> y(size_t(s.m * s.n));
      cpu::fp8_linear_forward(x.data(), w.data(), s.m, s.n, s.k, r, y.data());
      const std::vector<float> xq = fake_quant(x, s.m, s.k, cpu::kFp8ActivationBlock, r.forward);
      const std::vector<float> wq = fake_quant(w, s.n, s.k, cpu::kFp8WeightBlock, r.forward);
      expect_parity("fp8 forward " + at, y, gemm_abt(xq, wq, s.m, s.n, s.k), kFP32Reduction);
      EXPECT_LT(normwise_difference(y, gemm_abt(x, w, s.m, s.n, s.k)), 0.08) << at;
      // dgrad: dx = dy W = dy (W^T)^T.
      std::vector<float> dx(size_t(s.m * s.k));
      cpu::fp8_linear_dgrad(dy.data(), w.data(), s.m, s.n, s.k, r, dx.data());
      const std::vector<float> dyq = fake_quant(dy, s.m, s.n, cpu::kFp8ActivationBlock, g);
      expect_parity("fp8 dgrad " + at, dx, gemm_abt(dyq, transpose(wq, s.n, s.k), s.m, s.k, s.n), kFP32Reduction);
      const double e = normwise_difference(dx, gemm_abt(dy, transpose(w, s.n, s.k), s.m, s.k, s.n));
      EXPECT_LT(e, 0.15) << at;
      (g == Fp8Format::kE4M3 ? err_e4 : err_e5) = e;
      // wgrad accumulates: dW += dy^T x.
      std::vector<float> dw(size_t(s.n * s.k), 1.0f);
      cpu::fp8_linear_wgrad(dy.data(), x.data(), s.m, s.n, s.k, r, dw.data());
      const std::vector<float> dytq = fake_quant(transpose(dy, s.m, s.n), s.n, s.m, cpu::kFp8ActivationBlock, g);
      const std::vector<float> xtq = fake_quant(transpose(x, s.m, s.k), s.k, s.m, cpu::kFp8ActivationBlock, r.forward);
      std::vector<float> want = gemm_abt(dytq, xtq, s.n, s.k, s.m);
      for (float& v : want) v += 1.0f;
      expect_parity("fp8 wgrad " + at, dw, want, kFP32Reduction);
    }
    if (s.m * s.n * s.k > 1000) {
      EXPECT_GT(err_e5, err_e4) << at << ": E5M2 gradients round coarser";
    }
  }
}

}  // namespace
// MXFP8's GEMM (1 x 32 blocks, E8M0 scales, promoted per 32-wide K block) equals the FP32 product
// of the dequantised operands; the same codes re-blocked to 1 x 128 (mx_to_blocks128) give the same
// product when a block's four MX scales agree, and lose low bits of the codes of the sub-blocks
// whose scale is far below the block's largest, which the count reports.
TEST(Fp8, MxGemmAndItsReblockingToOneBy128) {
  const int64_t m = 5, n = 6, k = 256;
  const std::vector<float> a = randn(m * k, 21), b = randn(n * k, 22, 0.05f);
  std::vector<uint8_t> qa(size_t(m * k)), qb(size_t(n * k)), sa(size_t(m * k / 32)), sb(size_t(n * k / 32));
  cpu::mx_quantize(a.data(), m, k, Fp8Format::kE4M3, MxScale::kOcp, qa.data(), sa.data());
  cpu::mx_quantize(b.data(), n, k, Fp8Format::kE4M3, MxScale::kOcp, qb.data(), sb.data());
  std::vector<float> da(a.size()), db(b.size());
  cpu::mx_dequantize(qa.data(), sa.data(), m, k, Fp8Format::kE4M3, da.data());
  cpu::mx_dequantize(qb.data(), sb.data(), n, k, Fp8Format::kE4M3, db.data());
  std::vector<float> c(size_t(m * n));
  cpu::mx_gemm(qa.data(), sa.data(), Fp8Format::kE4M3, qb.data(), sb.data(), Fp8Format::kE4M3, m, n, k, c.data(),
               false);
  expect_parity("mx_gemm", c, gemm_abt(da, db, m, n, k), kFP32Reduction);

  // One scale per 128 block (every element of a row the same magnitude class): re-blocking is exact.
  std::vector<float> flat(size_t(m * k));
  for (size_t i = 0; i < flat.size(); ++i) flat[i] = (i % 3 == 0 ? -1.0f : 1.0f) * (1.0f + float(i % 8) / 8.0f);
  std::vector<uint8_t> qf(flat.size()), sf(size_t(m * k / 32)), q128(flat.size());
  std::vector<float> s128(size_t(m * k / 128));
  cpu::mx_quantize(flat.data(), m, k, Fp8Format::kE4M3, MxScale::kOcp, qf.data(), sf.data());
  EXPECT_EQ(cpu::mx_to_blocks128(qf.data(), sf.data(), m, k, Fp8Format::kE4M3, q128.data(), s128.data()), 0);
  std::vector<float> d_mx(flat.size()), d_128(flat.size());
  cpu::mx_dequantize(qf.data(), sf.data(), m, k, Fp8Format::kE4M3, d_mx.data());
  cpu::fp8_dequantize_blocks(q128.data(), s128.data(), m, k, cpu::kFp8ActivationBlock, Fp8Format::kE4M3, d_128.data());
  EXPECT_EQ(d_128, d_mx) << "equal MX scales: the re-blocked codes are the same values";

  // The random operands: their sub-blocks' scales differ by a few binades, which shifts codes
  // within E4M3's normal range: nothing changes and the 1 x 128 product is the MX one.
  std::vector<uint8_t> qa128(qa.size()), qb128(qb.size());
  std::vector<float> sa128(size_t(m * k / 128)), sb128(size_t(n * k / 128));
  const int64_t ca = cpu::mx_to_blocks128(qa.data(), sa.data(), m, k, Fp8Format::kE4M3, qa128.data(), sa128.data());
  const int64_t cb = cpu::mx_to_blocks128(qb.data(), sb.data(), n, k, Fp8Format::kE4M3, qb128.data(), sb128.data());
  EXPECT_EQ(ca + cb, 0);
  std::vector<float> c128(c.size());
  cpu::fp8_gemm_rowwise_scaled(qa128.data(), sa128.data(), Fp8Format::kE4M3, qb128.data(), sb128.data(),
                               Fp8Format::kE4M3, m, n, k, c128.data(), false);
  expect_parity("re-blocked MX product", c128, c, kFP32Reduction);

  // A sub-block 2^15 below its block's largest scale lands in E4M3's subnormals (steps of 2^-9 of
  // the block scale): the codes needing a finer step round (those of 288, 352 and 416 units; 480
  // saturated to 448 already under the OCP rule, which shifts exactly): 12 of its 32; 2^19 below,
  // every code rounds to zero.
  for (const int gap : {15, 19}) {
    std::vector<float> far(128, 256.0f);
    for (int i = 32; i < 64; ++i) far[size_t(i)] = std::ldexp(256.0f * (1.0f + float(i % 8) / 8.0f), -gap);
    std::vector<uint8_t> qfar(128), sfar(4), qfar128(128);
    float sfar128 = 0;
    cpu::mx_quantize(far.data(), 1, 128, Fp8Format::kE4M3, MxScale::kOcp, qfar.data(), sfar.data());
    const int64_t changed =
        cpu::mx_to_blocks128(qfar.data(), sfar.data(), 1, 128, Fp8Format::kE4M3, qfar128.data(), &sfar128);
    EXPECT_EQ(sfar128, 1.0f) << gap;  // the block's largest MX scale, 2^0 for elements of 256
    EXPECT_EQ(changed, gap == 15 ? 12 : 32) << gap;
    if (gap == 19) {
      for (int i = 32; i < 64; ++i) EXPECT_EQ(cpu::fp8_decode(qfar128[size_t(i)], Fp8Format::kE4M3), 0.0f) << i;
    }
  }
}

// The GPU path's quantisation rule (core/fp8_types.h): kBlocks is fp8_quantize_blocks; an MX rule
// is mx_quantize re-blocked by mx_to_blocks, whose 128 x 128 blocks take the largest scale of their
// 128 rows' sub-blocks; random operands re-block without a change, so their values are the MX
// ones. The weights' two copies follow their own sub-blocks under MX (qt is the quantisation of
// w^T, not q transposed) with the same block scales, and are q transposed under kBlocks.
TEST(Fp8, RuleQuantiseIsTheMxCodesReblocked) {
  const int64_t rows = 256, cols = 384;
  const std::vector<float> x = randn(rows * cols, 31);
  std::vector<uint8_t> q1(static_cast<size_t>(rows * cols)), q2(static_cast<size_t>(rows * cols));
  std::vector<float> s1(static_cast<size_t>(rows * cols / 128)), s2(static_cast<size_t>(rows * cols / 128));
  EXPECT_EQ(cpu::fp8_quantize_blocks(x.data(), rows, cols, cpu::kFp8ActivationBlock, Fp8Format::kE4M3,
                                     Fp8Rule::kBlocks, q1.data(), s1.data()), 0);
  cpu::fp8_quantize_blocks(x.data(), rows, cols, cpu::kFp8ActivationBlock, Fp8Format::kE4M3, q2.data(), s2.data());
  EXPECT_EQ(q1, q2);
  EXPECT_EQ(s1, s2);
  for (const auto& [rule, mx] : {std::pair{Fp8Rule::kMx, MxScale::kOcp},
                                 std::pair{Fp8Rule::kMxNoSaturation, MxScale::kNoSaturation}}) {
    std::vector<uint8_t> qm(static_cast<size_t>(rows * cols)), sm(static_cast<size_t>(rows * cols / 32));
    cpu::mx_quantize(x.data(), rows, cols, Fp8Format::kE4M3, mx, qm.data(), sm.data());
    std::vector<float> want(x.size()), got(x.size());
    cpu::mx_dequantize(qm.data(), sm.data(), rows, cols, Fp8Format::kE4M3, want.data());
    for (const Fp8Block block : {cpu::kFp8ActivationBlock, cpu::kFp8WeightBlock}) {
      const int64_t nb = cpu::fp8_scale_rows(rows, block) * cpu::fp8_scale_cols(cols, block);
      std::vector<float> sr(static_cast<size_t>(nb));
      const int64_t changed =
          cpu::fp8_quantize_blocks(x.data(), rows, cols, block, Fp8Format::kE4M3, rule, q1.data(), sr.data());
      cpu::fp8_dequantize_blocks(q1.data(), sr.data(), rows, cols, block, Fp8Format::kE4M3, got.data());
      const int64_t scale_cols = cpu::fp8_scale_cols(cols, block);
      for (int64_t b = 0; b < nb; ++b) {  // each block's scale: the largest of its sub-blocks' scales
        const int64_t br = b / scale_cols, bc = b % scale_cols;
        int top = 0;
        for (int64_t r = br * block.rows; r < (br + 1) * block.rows; ++r)
          for (int64_t c = bc * 4; c < bc * 4 + 4; ++c) top = std::max(top, int(sm[size_t(r * cols / 32 + c)]));
        ASSERT_EQ(sr[size_t(b)], std::ldexp(1.0f, top - 127)) << "block " << block.rows << " #" << b;
      }
      // MX's values wherever they are normal at the block's scale (2^-6 of it and up); below that
      // within half a subnormal step (2^-10 of it), and the count is that of the values that moved.
      int64_t moved = 0;
      for (int64_t i = 0; i < rows * cols; ++i) {
        const float scale = sr[size_t((i / cols / block.rows) * scale_cols + (i % cols) / 128)];
        if (got[size_t(i)] == want[size_t(i)]) continue;
        ++moved;
        ASSERT_LT(std::fabs(want[size_t(i)]), std::ldexp(scale, -6)) << "block " << block.rows << " #" << i;
        ASSERT_LE(std::fabs(got[size_t(i)] - want[size_t(i)]), std::ldexp(scale, -10)) << "block " << block.rows;
      }
      EXPECT_EQ(moved, changed) << "block " << block.rows;
      EXPECT_LT(moved, rows * cols / 100) << "block " << block.rows << ": random values re-block almost unchanged";
    }
  }
  // The weights' copies, [2, 256, 384]: rows 0 .. 127 of each expert ten times larger in their
  // first 32 columns, so that w's columns and w's rows have other sub-block scales.
  const int64_t e = 2, n = 256, k = 384, numel = e * n * k, ns = e * 2 * 3;
  std::vector<float> w = randn(numel, 32, 0.02f);
  for (int64_t x0 = 0; x0 < e; ++x0)
    for (int64_t r = 0; r < 128; ++r)
      for (int64_t c = 0; c < 32; ++c) w[size_t(x0 * n * k + r * k + c)] *= 10.0f;
  for (const Fp8Rule rule : {Fp8Rule::kBlocks, Fp8Rule::kMx}) {
    const auto codes = static_cast<size_t>(numel);
    std::vector<uint8_t> q(codes), qt(codes), qt_want(codes);
    std::vector<float> sw(static_cast<size_t>(ns)), st(static_cast<size_t>(ns)), st_want(static_cast<size_t>(ns));
    cpu::fp8_quantize_weights(w.data(), e, n, k, Fp8Format::kE4M3, q.data(), sw.data(), qt.data(), st.data(), rule);
    size_t transposed = 0;
    for (int64_t x0 = 0; x0 < e; ++x0) {
      std::vector<float> wt(static_cast<size_t>(n * k));
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < k; ++c) {
          wt[size_t(c * n + r)] = w[size_t(x0 * n * k + r * k + c)];
          transposed += qt[size_t(x0 * n * k + c * n + r)] == q[size_t(x0 * n * k + r * k + c)];
        }
      cpu::fp8_quantize_blocks(wt.data(), k, n, cpu::kFp8WeightBlock, Fp8Format::kE4M3, rule,
                               qt_want.data() + x0 * n * k, st_want.data() + x0 * 6);
    }
    if (rule == Fp8Rule::kBlocks) {
      EXPECT_EQ(transposed, size_t(numel)) << "block recipe: qt is q transposed";
    } else {
      EXPECT_EQ(qt, qt_want) << "MX: qt quantises w's columns";
      EXPECT_LT(transposed, size_t(numel)) << "MX: the column copy is not the row copy transposed";
    }
    for (int64_t x0 = 0; x0 < e; ++x0)  // the same block scales, transposed
      for (int64_t i = 0; i < 2; ++i)
        for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(st[size_t(x0 * 6 + j * 2 + i)], sw[size_t(x0 * 6 + i * 3 + j)]);
  }
}

// One train.fp8_scaling's emulated passes against its reference passes.
static void check_emulated_linear_passes(const cpu::Fp8Recipe& r) {
  const int64_t n = 150, k = 260, m = 140;  // partial blocks on every side
  const std::vector<float> x = randn(n * k, 31), w = randn(m * k, 32, 0.05f), dy = randn(n * m, 33, 0.01f);
  std::vector<float> y(size_t(n * m)), want_y(size_t(n * m));
  cpu::fp8_emulated_linear_forward(x.data(), w.data(), y.data(), n, k, m, false, r);
  cpu::fp8_linear_forward(x.data(), w.data(), n, m, k, r, want_y.data());
  expect_parity("emulated fp8 forward", y, want_y, kFP32Reduction);
  std::vector<float> dx(size_t(n * k)), want_dx(size_t(n * k)), dw(size_t(m * k), 0.25f), want_dw(size_t(m * k), 0.25f);
  cpu::fp8_emulated_linear_backward(x.data(), w.data(), dy.data(), dx.data(), dw.data(), n, k, m, false, r);
  cpu::fp8_linear_dgrad(dy.data(), w.data(), n, m, k, r, want_dx.data());
  cpu::fp8_linear_wgrad(dy.data(), x.data(), n, m, k, r, want_dw.data());
  expect_parity("emulated fp8 dgrad", dx, want_dx, kFP32Reduction);
  expect_parity("emulated fp8 wgrad (accumulated onto 0.25)", dw, want_dw, kFP32Reduction);
  // accumulate / accumulate_dx add onto what the outputs held.
  std::vector<float> y2 = y, dx2 = dx;
  cpu::fp8_emulated_linear_forward(x.data(), w.data(), y2.data(), n, k, m, true, r);
  cpu::fp8_emulated_linear_backward(x.data(), w.data(), dy.data(), dx2.data(), nullptr, n, k, m, true, r);
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y2[i], 2.0f * y[i], 1e-5f * (1.0f + std::fabs(y[i])));
  for (size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx2[i], 2.0f * dx[i], 1e-5f * (1.0f + std::fabs(dx[i])));
}

// The CPU reference's FP8 training passes (fake quantisation + FP32 BLAS GEMM) equal the recipe's
// block-scaled passes (or, under MX scaling, mx_gemm on MX codes) on the same values up to FP32
// summation order, for each train.fp8_scaling.
TEST(Fp8, EmulatedLinearPassesEqualTheRecipe) {
  for (const char* scaling : {"blocks", "mx", "mx_no_saturation"}) {
    SCOPED_TRACE(scaling);
    check_emulated_linear_passes(cpu::fp8_recipe_named(scaling));
  }
}

// MX scaling is not block scaling under another name: the MX forward is exactly the FP32 product
// of the operands' MX dequantised values (1 x 32 blocks, E8M0 scales along K), which differs from
// the 1 x 128 / 128 x 128 recipe's; the two MX rules differ where a block's largest element
// saturates under the OCP rule. An unknown scaling is refused naming the key.
TEST(Fp8, MxRecipeQuantisesInBlocksOf32AlongTheContraction) {
  const int64_t n = 40, k = 96, m = 24;
  const std::vector<float> x = randn(n * k, 41), w = randn(m * k, 42, 0.05f);
  const cpu::Fp8Recipe mx = cpu::fp8_recipe_named("mx");
  EXPECT_EQ(mx.scaling, cpu::Fp8Scaling::kMx);
  EXPECT_EQ(mx.mx_rule, MxScale::kOcp);
  EXPECT_EQ(cpu::fp8_recipe_named("mx_no_saturation").mx_rule, MxScale::kNoSaturation);
  EXPECT_EQ(cpu::fp8_recipe_named("blocks").scaling, cpu::Fp8Scaling::kBlocks);
  std::vector<uint8_t> qx(x.size()), sx(size_t(n * k / 32)), qw(w.size()), sw(size_t(m * k / 32));
  cpu::mx_quantize(x.data(), n, k, Fp8Format::kE4M3, MxScale::kOcp, qx.data(), sx.data());
  cpu::mx_quantize(w.data(), m, k, Fp8Format::kE4M3, MxScale::kOcp, qw.data(), sw.data());
  std::vector<float> dxq(x.size()), dwq(w.size());
  cpu::mx_dequantize(qx.data(), sx.data(), n, k, Fp8Format::kE4M3, dxq.data());
  cpu::mx_dequantize(qw.data(), sw.data(), m, k, Fp8Format::kE4M3, dwq.data());
  std::vector<float> y(size_t(n * m)), y_blocks(size_t(n * m));
  cpu::fp8_emulated_linear_forward(x.data(), w.data(), y.data(), n, k, m, false, mx);
  cpu::fp8_emulated_linear_forward(x.data(), w.data(), y_blocks.data(), n, k, m, false, cpu::Fp8Recipe{});
  expect_parity("MX forward", y, gemm_abt(dxq, dwq, n, m, k), kFP32Reduction);
  EXPECT_GT(normwise_difference(y, y_blocks), 1e-4) << "MX scaling gave the block-scaled product";
  std::vector<float> y_ns(y.size());
  cpu::fp8_emulated_linear_forward(x.data(), w.data(), y_ns.data(), n, k, m, false,
                                   cpu::fp8_recipe_named("mx_no_saturation"));
  EXPECT_NE(y_ns, y) << "the two MX scale rules quantised alike";
  try {
    cpu::fp8_recipe_named("mxfp8");
    ADD_FAILURE() << "an unknown scaling was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.fp8_scaling"), std::string::npos) << e.what();
  }
}


// The experts' weights: per expert the codes and scales of fp8_quantize_blocks in 128 x 128
// blocks, the transposed codes and scale grid exactly their transpose (partial edge blocks).
TEST(Fp8, ExpertWeightsAndTheirTransposedCopy) {
  const int64_t e = 2, n = 200, k = 136, nb = 2, kb = 2;
  const std::vector<float> w = randn(e * n * k, 8, 0.05f);
  std::vector<uint8_t> q(w.size()), qt(w.size()), q1(static_cast<size_t>(n * k));
  std::vector<float> s(static_cast<size_t>(e * nb * kb)), st(s.size()), s1(static_cast<size_t>(nb * kb));
  cpu::fp8_quantize_weights(w.data(), e, n, k, Fp8Format::kE4M3, q.data(), s.data(), qt.data(), st.data());
  for (int64_t x = 0; x < e; ++x) {
    cpu::fp8_quantize_blocks(w.data() + x * n * k, n, k, cpu::kFp8WeightBlock, Fp8Format::kE4M3, q1.data(), s1.data());
    size_t bad = 0;
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < k; ++c) {
        const uint8_t code = q1[size_t(r * k + c)];
        bad += q[size_t(x * n * k + r * k + c)] != code;
        bad += qt[size_t(x * n * k + c * n + r)] != code;
      }
    for (int64_t i = 0; i < nb; ++i)
      for (int64_t j = 0; j < kb; ++j) {
        bad += s[size_t(x * nb * kb + i * kb + j)] != s1[size_t(i * kb + j)];
        bad += st[size_t(x * nb * kb + j * nb + i)] != s1[size_t(i * kb + j)];
      }
    EXPECT_EQ(bad, 0u) << "expert " << x;
  }
}

// moe::adamw_update_fp8_weights (the CPU twin of cuda::adamw_apply_fp8_weights): the parameters
// and moments of adamw_update, bitwise, and the codes, scales and transposed copy of their BF16
// rounding (what the GPU quantises: its BF16 copy); shapes that are not whole 128 x 128 blocks are
// refused by name.
TEST(Fp8, AdamWWithExpertWeightCodesQuantisesTheUpdatedBf16Weights) {
  const int64_t e = 2, n = 256, k = 128, numel = e * n * k, ns = e * 2 * 1;
  const std::vector<float> p0 = randn(numel, 21, 0.05f), g = randn(numel, 22, 0.01f);
  OptimConfig cfg;
  cfg.beta1 = 0.9;
  cfg.beta2 = 0.95;
  cfg.eps = 1e-8;
  cfg.weight_decay = 0.1;
  const AdamWCoefs c = adamw_coefs(cfg, 3, 1e-2);
  std::vector<float> p(p0), m(p0.size(), 0.01f), v(p0.size(), 1e-4f);
  std::vector<float> p_ref(p0), m_ref(p0.size(), 0.01f), v_ref(p0.size(), 1e-4f);
  const size_t count = static_cast<size_t>(numel);
  std::vector<uint8_t> q(count), qt(count), q_ref(count), qt_ref(count);
  std::vector<float> s(static_cast<size_t>(ns)), st(s.size()), s_ref(s.size()), st_ref(s.size());
  adamw_update_fp8_weights(p.data(), g.data(), m.data(), v.data(), e, n, k, c, true, Fp8Format::kE4M3, q.data(),
                           s.data(), qt.data(), st.data());
  adamw_update(p_ref.data(), g.data(), m_ref.data(), v_ref.data(), numel, c, true);
  std::vector<float> w16(p_ref.size());
  for (size_t i = 0; i < w16.size(); ++i) w16[i] = bf16_to_f32(f32_to_bf16(p_ref[i]));
  cpu::fp8_quantize_weights(w16.data(), e, n, k, Fp8Format::kE4M3, q_ref.data(), s_ref.data(), qt_ref.data(),
                            st_ref.data());
  EXPECT_EQ(std::memcmp(p.data(), p_ref.data(), p.size() * 4), 0) << "parameters";
  EXPECT_EQ(std::memcmp(m.data(), m_ref.data(), m.size() * 4), 0) << "exp_avg";
  EXPECT_EQ(std::memcmp(v.data(), v_ref.data(), v.size() * 4), 0) << "exp_avg_sq";
  EXPECT_EQ(q, q_ref);
  EXPECT_EQ(qt, qt_ref);
  EXPECT_EQ(std::memcmp(s.data(), s_ref.data(), s.size() * 4), 0) << "scales";
  EXPECT_EQ(std::memcmp(st.data(), st_ref.data(), st.size() * 4), 0) << "transposed scales";
  try {
    adamw_update_fp8_weights(p.data(), g.data(), m.data(), v.data(), 1, 200, 128, c, true, Fp8Format::kE4M3,
                             q.data(), s.data(), qt.data(), st.data());
    ADD_FAILURE() << "n = 200 was accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("n 200"), std::string::npos) << err.what();
  }
}

// The grouped block-scaled GEMM: each expert's rows through its own weights, equal to
// fp8_gemm_block_scaled per expert; rows outside the groups (an empty expert, a tail) untouched.
TEST(Fp8, GroupedBlockScaledGemmRunsEachExpertOnItsRows) {
  const int64_t e = 3, rows = 20, n = 130, k = 256, kb = 2, nb = 2;
  const std::vector<int32_t> offsets = {0, 7, 7, 16};
  const std::vector<float> a = randn(rows * k, 9), w = randn(e * n * k, 10, 0.05f);
  std::vector<uint8_t> qa(a.size()), qw(w.size());
  std::vector<float> sa(static_cast<size_t>(rows * kb)), sw(static_cast<size_t>(e * nb * kb));
  cpu::fp8_quantize_blocks(a.data(), rows, k, cpu::kFp8ActivationBlock, Fp8Format::kE4M3, qa.data(), sa.data());
  cpu::fp8_quantize_weights(w.data(), e, n, k, Fp8Format::kE4M3, qw.data(), sw.data(), nullptr, nullptr);
  std::vector<float> c(static_cast<size_t>(rows * n), -7.0f), want(c.size(), -7.0f);
  cpu::fp8_grouped_gemm_block_scaled(qa.data(), sa.data(), Fp8Format::kE4M3, qw.data(), sw.data(), Fp8Format::kE4M3,
                                     offsets.data(), rows, e, n, k, c.data());
  for (int64_t x = 0; x < e; ++x) {
    const int64_t r0 = offsets[size_t(x)], r1 = offsets[size_t(x) + 1];
    if (r1 > r0)
      cpu::fp8_gemm_block_scaled(qa.data() + r0 * k, sa.data() + r0 * kb, Fp8Format::kE4M3, qw.data() + x * n * k,
                                 sw.data() + x * nb * kb, Fp8Format::kE4M3, r1 - r0, n, k, want.data() + r0 * n, false);
  }
  size_t bad = 0;
  for (size_t i = 0; i < c.size(); ++i) bad += c[i] != want[i];
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(c[size_t(16 * n)], -7.0f) << "the tail past offsets[E] was written";
}

// The experts' weight-gradient operands quantised down each expert's rows into padded columns
// (cpu::fp8_quantize_expert_columns, the layout of the GPU's FP8 wgrad): each expert's blocks
// through fp8_gemm_rowwise_scaled are the recipe's FP8 wgrad of its rows (fp8_linear_wgrad, whose
// last block is partial where the padded one ends in zeros), bit for bit; an empty expert and a
// dropped tail take no columns; a capacity too small is refused.
TEST(Fp8, ExpertColumnsAreTheRecipesWgradOperands) {
  const int64_t e = 4, max_rows = 330, n = 136, k = 256;
  const std::vector<int32_t> offsets = {0, 130, 130, 258, 300};
  const std::vector<float> dy = randn(max_rows * n, 11), x = randn(max_rows * k, 12);
  const int64_t capacity = 768, kb = capacity / 128;
  std::vector<uint8_t> qa(size_t(n * capacity), 0xEE), qb(size_t(k * capacity), 0xEE);
  std::vector<float> sa(size_t(kb * n)), sb(size_t(kb * k));
  std::vector<int32_t> pad(size_t(e + 1)), pad_b(size_t(e + 1));
  cpu::fp8_quantize_expert_columns(dy.data(), offsets.data(), max_rows, e, n, capacity, Fp8Format::kE4M3, qa.data(),
                                   sa.data(), pad.data());
  cpu::fp8_quantize_expert_columns(x.data(), offsets.data(), max_rows, e, k, capacity, Fp8Format::kE4M3, qb.data(),
                                   sb.data(), pad_b.data());
  EXPECT_EQ(pad, (std::vector<int32_t>{0, 256, 256, 384, 512}));
  EXPECT_EQ(pad_b, pad);
  EXPECT_EQ(qa[size_t(512)], 0xEE) << "a column past padded[E] was written";
  for (int64_t x_e = 0; x_e < e; ++x_e) {
    const int64_t r0 = offsets[size_t(x_e)], rows = offsets[size_t(x_e) + 1] - r0;
    const int64_t p0 = pad[size_t(x_e)], pr = pad[size_t(x_e) + 1] - p0, nb = pr / 128;
    if (rows == 0) {
      EXPECT_EQ(pr, 0);
      continue;
    }
    std::vector<uint8_t> a(size_t(n * pr)), b(size_t(k * pr));
    std::vector<float> as(size_t(n * nb)), bs(size_t(k * nb));
    for (int64_t i = 0; i < n; ++i) {
      std::copy_n(qa.data() + i * capacity + p0, pr, a.data() + i * pr);
      for (int64_t t = 0; t < nb; ++t) as[size_t(i * nb + t)] = sa[size_t((p0 / 128 + t) * n + i)];
    }
    for (int64_t j = 0; j < k; ++j) {
      std::copy_n(qb.data() + j * capacity + p0, pr, b.data() + j * pr);
      for (int64_t t = 0; t < nb; ++t) bs[size_t(j * nb + t)] = sb[size_t((p0 / 128 + t) * k + j)];
    }
    std::vector<float> got(size_t(n * k), 0.0f), want(size_t(n * k), 0.0f);
    cpu::fp8_gemm_rowwise_scaled(a.data(), as.data(), Fp8Format::kE4M3, b.data(), bs.data(), Fp8Format::kE4M3, n, k,
                                 pr, got.data(), true);
    cpu::fp8_linear_wgrad(dy.data() + r0 * n, x.data() + r0 * k, rows, n, k, cpu::Fp8Recipe{}, want.data());
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) bad += std::memcmp(&got[i], &want[i], sizeof(float)) != 0;
    EXPECT_EQ(bad, 0u) << "expert " << x_e;
  }
  std::vector<int32_t> small(size_t(e + 1));
  EXPECT_THROW(cpu::fp8_quantize_expert_columns(dy.data(), offsets.data(), max_rows, e, n, 384, Fp8Format::kE4M3,
                                                qa.data(), sa.data(), small.data()),
               Error);
}

}  // namespace moe::testing

namespace moe::testing {
namespace {

// The FP8 row payload of an expert-parallel exchange: unpacking a packed row gives its row
// quantisation bit for bit (block scaling with a partial last block, MX with both rules, E4M3 and
// E5M2), the payload's size is the codes plus the scales rounded up to 4 bytes, and its bytes are
// the quantiser's codes and scales in that order.
TEST(Fp8, RowPayloadUnpacksToTheRowQuantisation) {
  const int64_t rows = 5;
  for (const char* scaling : {"blocks", "mx", "mx_no_saturation"}) {
    for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (const int64_t cols : {int64_t{8}, int64_t{200}, int64_t{256}}) {
        const cpu::Fp8Recipe r = cpu::fp8_recipe_named(scaling);
        const std::string what =
            std::string(scaling) + (f == Fp8Format::kE4M3 ? " e4m3" : " e5m2") + " cols=" + std::to_string(cols);
        std::vector<float> x = randn(rows * cols, 31 + uint64_t(cols));
        for (int64_t i = 0; i < rows * cols; ++i) x[size_t(i)] *= std::ldexp(1.0f, int(i % 13) - 6);
        const int64_t bytes = cpu::fp8_row_payload_bytes(cols, r);
        const int64_t scale_bytes = r.scaling == cpu::Fp8Scaling::kMx ? (cols + 31) / 32 : 4 * ((cols + 127) / 128);
        EXPECT_EQ(bytes, (cols + scale_bytes + 3) / 4 * 4) << what;
        std::vector<uint8_t> payload(size_t(rows * bytes), 0xAB);
        cpu::fp8_pack_rows(x.data(), rows, cols, f, r, payload.data());
        std::vector<float> unpacked(x.size()), want(x.size());
        cpu::fp8_unpack_rows(payload.data(), rows, cols, f, r, unpacked.data());
        cpu::fp8_quantised_rows(x.data(), rows, cols, f, r, want.data());
        EXPECT_EQ(std::memcmp(unpacked.data(), want.data(), x.size() * sizeof(float)), 0) << what;
        // The codes lead each payload row: the quantiser's codes of that row.
        std::vector<uint8_t> q(x.size());
        if (r.scaling == cpu::Fp8Scaling::kMx) {
          std::vector<uint8_t> s(size_t(rows * ((cols + 31) / 32)));
          cpu::mx_quantize(x.data(), rows, cols, f, r.mx_rule, q.data(), s.data());
        } else {
          std::vector<float> s(size_t(rows * ((cols + 127) / 128)));
          cpu::fp8_quantize_blocks(x.data(), rows, cols, kFp8ActivationBlock, f, q.data(), s.data());
        }
        for (int64_t i = 0; i < rows; ++i) {
          EXPECT_EQ(std::memcmp(payload.data() + i * bytes, q.data() + i * cols, size_t(cols)), 0)
              << what << " row " << i;
          for (int64_t b = cols + scale_bytes; b < bytes; ++b) EXPECT_EQ(payload[size_t(i * bytes + b)], 0) << what;
        }
        // The values on the grid: a second quantisation of the unpacked rows moves none of them by
        // more than one FP32 rounding of their scale.
        std::vector<float> again(x.size());
        cpu::fp8_quantised_rows(unpacked.data(), rows, cols, f, r, again.data());
        for (size_t i = 0; i < x.size(); ++i)
          EXPECT_LE(std::fabs(again[i] - unpacked[i]), std::ldexp(std::fabs(unpacked[i]), -22)) << what << " at " << i;
      }
    }
  }
  EXPECT_EQ(cpu::fp8_row_payload_bytes(2048, cpu::fp8_recipe_named("blocks")), 2048 + 64);
  EXPECT_EQ(cpu::fp8_row_payload_bytes(2048, cpu::fp8_recipe_named("mx")), 2048 + 64);
}

// Blackwell's MX scale layout (cuBLASLt VEC32_UE8M0): 128 x 4 tiles, row-block-major; in a tile
// the 16 bytes at 16 i hold rows i, i + 32, i + 64, i + 96, four columns each. 200 rows of 8
// columns: two tile rows (the second padded from row 200 with 127) of two tile columns.
TEST(Fp8, MxScalesTiledFollowTheBlackwellLayout) {
  const int64_t rows = 200, cols = 8;
  std::vector<uint8_t> s(size_t(rows * cols));
  for (size_t i = 0; i < s.size(); ++i) s[i] = uint8_t(i % 251);  // 127 appears, but not in every place
  const std::vector<uint8_t> t = cpu::mx_scales_tiled(s.data(), rows, cols);
  ASSERT_EQ(int64_t(t.size()), mx_scales_tiled_bytes(rows, cols));
  ASSERT_EQ(t.size(), size_t(2 * 2 * 512));
  auto at = [&](int64_t r, int64_t c) { return s[size_t(r * cols + c)]; };
  for (int64_t c = 0; c < 4; ++c) {
    EXPECT_EQ(t[size_t(c)], at(0, c));
    EXPECT_EQ(t[size_t(4 + c)], at(32, c));
    EXPECT_EQ(t[size_t(8 + c)], at(64, c));
    EXPECT_EQ(t[size_t(12 + c)], at(96, c));
    EXPECT_EQ(t[size_t(16 + c)], at(1, c));
    EXPECT_EQ(t[size_t(31 * 16 + 12 + c)], at(127, c));
    EXPECT_EQ(t[size_t(512 + c)], at(0, 4 + c));       // tile (0, 1): columns 4 .. 7
    EXPECT_EQ(t[size_t(1024 + c)], at(128, c));        // tile (1, 0): rows 128 ..
    EXPECT_EQ(t[size_t(1024 + 8 + c)], at(192, c));    // row 192 = 128 + 64
    EXPECT_EQ(t[size_t(1024 + 12 + c)], uint8_t{127});  // row 224: padding
    EXPECT_EQ(t[size_t(1536 + 16 * 7 + c)], at(135, 4 + c));
  }
  // Every scale once, the rest padding.
  std::vector<int64_t> seen(256, 0), want(256, 0);
  for (uint8_t v : t) ++seen[v];
  for (uint8_t v : s) ++want[v];
  want[127] += int64_t(t.size()) - rows * cols;
  EXPECT_EQ(seen, want);
  EXPECT_EQ(mx_scales_tiled_bytes(1, 1), 512);
  EXPECT_EQ(mx_scales_tiled_bytes(0, 4), 0);
}

}  // namespace
}  // namespace moe::testing
