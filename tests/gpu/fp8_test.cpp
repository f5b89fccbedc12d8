// cuda::fp8_quantize_blocks / fp8_dequantize_blocks / mx_quantize / mx_dequantize against their
// CPU twins (cpu/fp8.h): the same FP8 codes and scales bit for bit on FP32 and BF16 inputs, in
// both formats, for 1 x 128, 128 x 128 and MX 1 x 32 blocks with partial edge blocks; values over
// many binades (subnormal blocks, zero blocks, the largest magnitudes) and quotients beside every
// FP8 rounding boundary (where a quotient one FP32 ulp off changes the code); the dequantised values
// equal the CPU's bitwise; non-finite inputs are counted, never trap; cuda::mx_to_blocks128 (MX
// codes re-blocked to 1 x 128) bitwise cpu::mx_to_blocks128. cuda::fp8_gemm (cuBLASLt's
// block-scaled FP8) against cpu::fp8_gemm_block_scaled / fp8_gemm_rowwise_scaled on the same codes
// and scales, within FP32 summation-order tolerance, BF16 and FP32 outputs, accumulating.
// cuda::fp8_quantize_weights (the experts' 128 x 128 codes and their transposed copy in one pass)
// bitwise its CPU twin; cuda::grouped_gemm_fp8 (the experts' FP8 wgmma kernel, forward on the codes
// and data gradient on the transposed copy) against cpu::fp8_grouped_gemm_block_scaled on the same
// codes, with empty experts, partial tiles, a dropped tail, and n / k not multiples of 128.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "cpu/fp8.h"
#include "cuda/ops/fp8.h"
#include "cuda/ops/experts.h"
#include "cuda/ops/gemm.h"
#include "cuda/ops/grouped_gemm.h"
#include "cuda/ops/memory.h"
#include "cuda/ops/swiglu.h"
#include "gpu/gpu_test_util.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

struct Shape {
  int64_t rows, cols;
};

// Normal values whose scale changes per row and per 40-column band over 2^-140 .. 2^100 (subnormal
// and huge blocks), with some all-zero stretches and exact powers of two.
std::vector<float> wide_values(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int band = static_cast<int>((r * 7 + c / 40) % 13);
      const int exp2 = band == 0 ? -140 : band == 1 ? 100 : band * 9 - 60;
      float x = std::ldexp(dist(gen), exp2);
      if ((r + c / 64) % 11 == 5) x = 0.0f;          // zero blocks
      if ((r * cols + c) % 97 == 3) x = std::ldexp(1.0f, exp2);  // powers of two
      v[size_t(r * cols + c)] = x;
    }
  return v;
}

std::vector<float> bf16_values(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = ::moe::bf16_to_f32(b[i]);
  return f;
}

std::string where(const char* what, Shape s, Fp8Format f) {
  return std::string(what) + " " + std::to_string(s.rows) + "x" + std::to_string(s.cols) +
         (f == Fp8Format::kE4M3 ? " e4m3" : " e5m2");
}

const std::vector<Shape> kShapes = {{1, 1}, {1, 128}, {3, 200}, {129, 257}, {256, 384}, {5, 4096}};

TEST(Fp8Gpu, BlockScaledQuantiseMatchesCpuBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream stream;
  for (const Fp8Block block : {kFp8ActivationBlock, kFp8WeightBlock}) {
    for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (const Shape s : kShapes) {
        const int64_t n = s.rows * s.cols;
        const int64_t ns = cpu::fp8_scale_rows(s.rows, block) * cpu::fp8_scale_cols(s.cols, block);
        // FP32 input, and a BF16 input (quantised as its FP32 copy).
        const std::vector<float> x32 = wide_values(s.rows, s.cols, 7 + uint64_t(n));
        const std::vector<uint16_t> x16 = random_bf16(n, 11 + uint64_t(n), 3.0f);
        for (int input = 0; input < 2; ++input) {
          const std::vector<float> x = input == 0 ? x32 : bf16_values(x16);
          std::vector<uint8_t> q_ref(static_cast<size_t>(n));
          std::vector<float> s_ref(static_cast<size_t>(ns)), d_ref(static_cast<size_t>(n));
          cpu::fp8_quantize_blocks(x.data(), s.rows, s.cols, block, f, q_ref.data(), s_ref.data());
          cpu::fp8_dequantize_blocks(q_ref.data(), s_ref.data(), s.rows, s.cols, block, f, d_ref.data());
          GuardedBuffer<uint8_t> q(n);
          GuardedBuffer<float> sc(ns), d(n);
          GuardedBuffer<uint32_t> bad(std::vector<uint32_t>{0});
          if (input == 0) {
            GuardedBuffer<float> dx(x32);
            cuda::fp8_quantize_blocks(dx.data(), s.rows, s.cols, block, f, q.data(), sc.data(), bad.data(), stream.get());
            stream.sync();
          } else {
            GuardedBuffer<uint16_t> dx(x16);
            cuda::fp8_quantize_blocks(dx.data(), s.rows, s.cols, block, f, q.data(), sc.data(), bad.data(), stream.get());
            stream.sync();
          }
          cuda::fp8_dequantize_blocks(q.data(), sc.data(), s.rows, s.cols, block, f, d.data(), stream.get());
          stream.sync();
          const std::string w = where(input == 0 ? "fp8 blocks f32" : "fp8 blocks bf16", s, f) + " block " +
                                std::to_string(block.rows) + "x" + std::to_string(block.cols);
          expect_equal(q.download(), q_ref, w + " codes");
          expect_equal(sc.download(), s_ref, w + " scales");
          expect_equal(d.download(), d_ref, w + " dequantised");
          EXPECT_EQ(bad.download()[0], 0u) << w;
          q.expect_guards_intact(w + " q");
          sc.expect_guards_intact(w + " scales");
        }
      }
    }
  }
}

// Values whose quotients by their block's scale fall a few FP32 ulps either side of every FP8
// rounding boundary (the midpoints between neighbouring codes, from the subnormals to the largest):
// each 128 x 128 block holds its amax a once per row, at its first column (so every 1 x 128 block
// of it has the same scale s = a / fp8_max, a mantissa other than 1 so that x / s is inexact), and
// elsewhere x = RN(m s) for a midpoint m, moved by -4 .. 4 ulps, either sign.
std::vector<float> boundary_values(int64_t rows, int64_t cols, Fp8Format f, uint64_t seed) {
  std::vector<float> mids;
  float prev = 0.0f;
  for (int c = 1; c < 0x80; ++c) {
    const float v = cpu::fp8_decode(static_cast<uint8_t>(c), f);
    if (!std::isfinite(v)) break;
    mids.push_back(0.5f * (prev + v));
    prev = v;
  }
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> mant(1.05f, 1.95f);
  std::uniform_int_distribution<int> expo(-30, 30), ulps(-4, 4), sign(0, 1);
  std::uniform_int_distribution<size_t> pick(0, mids.size() - 1);
  const float fmax = cpu::fp8_max(f);
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (int64_t br = 0; br < rows; br += 128)
    for (int64_t bc = 0; bc < cols; bc += 128) {
      const float a = std::ldexp(mant(gen), expo(gen)) * fmax, s = a / fmax;
      for (int64_t r = br; r < std::min(rows, br + 128); ++r)
        for (int64_t c = bc; c < std::min(cols, bc + 128); ++c) {
          float v = a;
          if (c != bc) {
            v = mids[pick(gen)] * s;
            int32_t bits = 0;
            std::memcpy(&bits, &v, sizeof bits);
            bits += ulps(gen);
            std::memcpy(&v, &bits, sizeof bits);
            v = std::min(v, a);
          }
          x[size_t(r * cols + c)] = sign(gen) != 0 ? -v : v;
        }
    }
  return x;
}

// The codes are the CPU's fp8(x / s) also where x / s sits within a few FP32 ulps of a rounding
// boundary, so that any quotient not rounded as IEEE division rounds it shows, in every kernel:
// 1 x 128 rows, generic blocks, the experts' whole-block and edge-block weights, both formats.
TEST(Fp8Gpu, QuotientsBesideEveryRoundingBoundaryMatchCpuBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream stream;
  for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (const Fp8Block block : {kFp8ActivationBlock, kFp8WeightBlock}) {
      for (const Shape s : std::vector<Shape>{{512, 256}, {200, 136}}) {
        const int64_t n = s.rows * s.cols;
        const int64_t ns = cpu::fp8_scale_rows(s.rows, block) * cpu::fp8_scale_cols(s.cols, block);
        const std::vector<float> x = boundary_values(s.rows, s.cols, f, 3 + uint64_t(n) + block.rows);
        std::vector<uint8_t> q_ref(static_cast<size_t>(n));
        std::vector<float> s_ref(static_cast<size_t>(ns));
        cpu::fp8_quantize_blocks(x.data(), s.rows, s.cols, block, f, q_ref.data(), s_ref.data());
        GuardedBuffer<float> dx(x);
        GuardedBuffer<uint8_t> q(n);
        GuardedBuffer<float> sc(ns);
        cuda::fp8_quantize_blocks(dx.data(), s.rows, s.cols, block, f, q.data(), sc.data(), nullptr, stream.get());
        stream.sync();
        const std::string w = where("boundary quotients, blocks", s, f) + " block " + std::to_string(block.rows) +
                              "x" + std::to_string(block.cols);
        expect_equal(q.download(), q_ref, w + " codes");
        expect_equal(sc.download(), s_ref, w + " scales");
      }
    }
    for (const Shape s : std::vector<Shape>{{256, 384}, {200, 136}}) {
      const int64_t e = 2, n = s.rows, k = s.cols, numel = e * n * k;
      const int64_t ns = e * cpu::fp8_scale_rows(n, kFp8WeightBlock) * cpu::fp8_scale_cols(k, kFp8WeightBlock);
      const std::vector<float> w = boundary_values(e * n, k, f, 17 + uint64_t(numel));
      std::vector<uint8_t> q_ref(static_cast<size_t>(numel)), qt_ref(static_cast<size_t>(numel));
      std::vector<float> s_ref(static_cast<size_t>(ns)), st_ref(static_cast<size_t>(ns));
      cpu::fp8_quantize_weights(w.data(), e, n, k, f, q_ref.data(), s_ref.data(), qt_ref.data(), st_ref.data());
      GuardedBuffer<float> dw(w);
      GuardedBuffer<uint8_t> q(numel), qt(numel);
      GuardedBuffer<float> sc(ns), sct(ns);
      cuda::fp8_quantize_weights(dw.data(), e, n, k, f, q.data(), sc.data(), qt.data(), sct.data(), nullptr,
                                 stream.get());
      stream.sync();
      const std::string what = where("boundary quotients, weights", s, f);
      expect_equal(q.download(), q_ref, what + " codes");
      expect_equal(qt.download(), qt_ref, what + " transposed codes");
      expect_equal(sc.download(), s_ref, what + " scales");
    }
  }
}

// cuda::fp8_quantize_weights_bf16_rounded: the codes of FP32 weights' BF16 rounding, bitwise its CPU
// twin and cuda::fp8_quantize_weights of the BF16 copy (cast_f32_to_bf16), whole blocks and the
// generic kernel, by the block and MX rules; and not the codes of the FP32 values themselves.
TEST(Fp8Gpu, WeightsFromFp32AreTheCodesOfTheirBf16Rounding) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream stream;
  for (const Shape s : std::vector<Shape>{{256, 384}, {200, 136}}) {
    for (const Fp8Rule rule : {Fp8Rule::kBlocks, Fp8Rule::kMx}) {
      if (rule != Fp8Rule::kBlocks && (s.rows % 128 != 0 || s.cols % 128 != 0)) continue;
      const int64_t e = 2, n = s.rows, k = s.cols, numel = e * n * k;
      const int64_t ns = e * cpu::fp8_scale_rows(n, kFp8WeightBlock) * cpu::fp8_scale_cols(k, kFp8WeightBlock);
      const std::string what = where("bf16-rounded weights", s, Fp8Format::kE4M3) +
                               (rule == Fp8Rule::kBlocks ? " blocks" : " mx");
      const std::vector<float> w = wide_values(e * n, k, 29 + uint64_t(numel));
      std::vector<uint8_t> q_ref(static_cast<size_t>(numel)), qt_ref(static_cast<size_t>(numel));
      std::vector<float> s_ref(static_cast<size_t>(ns)), st_ref(static_cast<size_t>(ns));
      cpu::fp8_quantize_weights_bf16_rounded(w.data(), e, n, k, Fp8Format::kE4M3, q_ref.data(), s_ref.data(),
                                             qt_ref.data(), st_ref.data(), rule);
      std::vector<uint8_t> q_f32(static_cast<size_t>(numel));
      std::vector<float> s_f32(static_cast<size_t>(ns));
      cpu::fp8_quantize_weights(w.data(), e, n, k, Fp8Format::kE4M3, q_f32.data(), s_f32.data(), nullptr, nullptr,
                                rule);
      EXPECT_TRUE(q_f32 != q_ref || s_f32 != s_ref) << what << ": the rounding changes no code (a weak case)";
      GuardedBuffer<float> dw(w);
      GuardedBuffer<uint16_t> dw16(numel);
      GuardedBuffer<uint8_t> q(numel), qt(numel), q16(numel), qt16(numel);
      GuardedBuffer<float> sc(ns), sct(ns), sc16(ns), sct16(ns);
      cuda::fp8_quantize_weights_bf16_rounded(dw.data(), e, n, k, Fp8Format::kE4M3, q.data(), sc.data(), qt.data(),
                                              sct.data(), nullptr, stream.get(), rule);
      cuda::cast_f32_to_bf16(dw.data(), dw16.data(), numel, stream.get());
      cuda::fp8_quantize_weights(dw16.data(), e, n, k, Fp8Format::kE4M3, q16.data(), sc16.data(), qt16.data(),
                                 sct16.data(), nullptr, stream.get(), rule);
      stream.sync();
      expect_equal(q.download(), q_ref, what + " codes");
      expect_equal(qt.download(), qt_ref, what + " transposed codes");
      expect_equal(sc.download(), s_ref, what + " scales");
      expect_equal(sct.download(), st_ref, what + " transposed scales");
      expect_equal(q16.download(), q_ref, what + " codes of the BF16 copy");
      expect_equal(qt16.download(), qt_ref, what + " transposed codes of the BF16 copy");
      expect_equal(sc16.download(), s_ref, what + " scales of the BF16 copy");
      qt.expect_guards_intact(what + " qt");
      sct.expect_guards_intact(what + " st");
    }
  }
}

TEST(Fp8Gpu, MxQuantiseMatchesCpuBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream stream;
  for (const MxScale rule : {MxScale::kOcp, MxScale::kNoSaturation}) {
    for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (const Shape s : kShapes) {
        const int64_t n = s.rows * s.cols, ns = s.rows * ((s.cols + kMxBlock - 1) / kMxBlock);
        const std::vector<float> x32 = wide_values(s.rows, s.cols, 5 + uint64_t(n));
        const std::vector<uint16_t> x16 = random_bf16(n, 13 + uint64_t(n), 100.0f);
        for (int input = 0; input < 2; ++input) {
          const std::vector<float> x = input == 0 ? x32 : bf16_values(x16);
          std::vector<uint8_t> q_ref(static_cast<size_t>(n)), s_ref(static_cast<size_t>(ns));
          std::vector<float> d_ref(static_cast<size_t>(n));
          cpu::mx_quantize(x.data(), s.rows, s.cols, f, rule, q_ref.data(), s_ref.data());
          cpu::mx_dequantize(q_ref.data(), s_ref.data(), s.rows, s.cols, f, d_ref.data());
          GuardedBuffer<uint8_t> q(n), sc(ns);
          GuardedBuffer<float> d(n);
          if (input == 0) {
            GuardedBuffer<float> dx(x32);
            cuda::mx_quantize(dx.data(), s.rows, s.cols, f, rule, q.data(), sc.data(), nullptr, stream.get());
            stream.sync();
          } else {
            GuardedBuffer<uint16_t> dx(x16);
            cuda::mx_quantize(dx.data(), s.rows, s.cols, f, rule, q.data(), sc.data(), nullptr, stream.get());
            stream.sync();
          }
          cuda::mx_dequantize(q.data(), sc.data(), s.rows, s.cols, f, d.data(), stream.get());
          stream.sync();
          const std::string w = where(input == 0 ? "mx f32" : "mx bf16", s, f) +
                                (rule == MxScale::kOcp ? " ocp" : " no-saturation");
          expect_equal(q.download(), q_ref, w + " codes");
          expect_equal(sc.download(), s_ref, w + " scales");
          expect_equal(d.download(), d_ref, w + " dequantised");
          q.expect_guards_intact(w + " q");
          sc.expect_guards_intact(w + " scales");
        }
      }
    }
  }
}

// MX codes re-blocked into 1 x 128 blocks: codes, scales and the count of changed codes bitwise
// the CPU twin's, on values whose MX scales spread over many binades inside a 128 block (codes
// lose bits, into subnormals or to zero) and on normal ones; an E8M0 NaN scale is counted (the CPU
// twin refuses it).
TEST(Fp8Gpu, MxToBlocks128MatchesCpuBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream stream;
  for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (const Shape s : kShapes) {
      const int64_t n = s.rows * s.cols, nmx = s.rows * ((s.cols + kMxBlock - 1) / kMxBlock);
      const int64_t nout = s.rows * ((s.cols + 127) / 128);
      for (int input = 0; input < 2; ++input) {
        const std::vector<float> x = input == 0 ? wide_values(s.rows, s.cols, 17 + uint64_t(n))
                                                : bf16_values(random_bf16(n, 19 + uint64_t(n), 2.0f));
        std::vector<uint8_t> q(static_cast<size_t>(n)), mxs(static_cast<size_t>(nmx)), q_ref(static_cast<size_t>(n));
        std::vector<float> s_ref(static_cast<size_t>(nout));
        cpu::mx_quantize(x.data(), s.rows, s.cols, f, MxScale::kOcp, q.data(), mxs.data());
        const int64_t changed_ref =
            cpu::mx_to_blocks128(q.data(), mxs.data(), s.rows, s.cols, f, q_ref.data(), s_ref.data());
        GuardedBuffer<uint8_t> d_q(q), d_mxs(mxs), d_out(n);
        GuardedBuffer<float> d_s(nout);
        GuardedBuffer<unsigned long long> changed(std::vector<unsigned long long>{0});
        GuardedBuffer<uint32_t> nan_scales(std::vector<uint32_t>{0});
        cuda::mx_to_blocks128(d_q.data(), d_mxs.data(), s.rows, s.cols, f, d_out.data(), d_s.data(), changed.data(),
                              nan_scales.data(), stream.get());
        stream.sync();
        const std::string w = where(input == 0 ? "mx_to_blocks128 wide" : "mx_to_blocks128 narrow", s, f);
        expect_equal(d_out.download(), q_ref, w + " codes");
        expect_equal(d_s.download(), s_ref, w + " scales");
        EXPECT_EQ(int64_t(changed.download()[0]), changed_ref) << w << ": codes changed";
        EXPECT_EQ(nan_scales.download()[0], 0u) << w;
        if (input == 0 && s.cols >= 128) {
          EXPECT_GT(changed_ref, 0) << w << ": the wide values lost no bits";
        }
        d_out.expect_guards_intact(w + " q_out");
        d_s.expect_guards_intact(w + " scales_out");
      }
    }
  }
  // Two E8M0 NaN scales (0xFF) in a 3 x 300 tensor: counted, not trapped.
  std::vector<uint8_t> q(3 * 300, 0x38), mxs(3 * 10, 127);
  mxs[4] = 0xFF;
  mxs[29] = 0xFF;
  GuardedBuffer<uint8_t> d_q(q), d_mxs(mxs), d_out(3 * 300);
  GuardedBuffer<float> d_s(3 * 3);
  GuardedBuffer<uint32_t> nan_scales(std::vector<uint32_t>{0});
  cuda::mx_to_blocks128(d_q.data(), d_mxs.data(), 3, 300, Fp8Format::kE4M3, d_out.data(), d_s.data(), nullptr,
                        nan_scales.data(), stream.get());
  stream.sync();
  EXPECT_EQ(nan_scales.download()[0], 2u);
}

// NaN and infinity never trap: each is counted (the CPU twin refuses them instead).
TEST(Fp8Gpu, NonFiniteInputsAreCounted) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream stream;
  std::vector<float> x(3 * 300, 1.0f);
  x[5] = NAN;
  x[400] = INFINITY;
  x[899] = -INFINITY;
  GuardedBuffer<float> dx(x);
  GuardedBuffer<uint8_t> q(3 * 300), mxs(3 * 10);
  GuardedBuffer<float> sc(3 * 3);
  GuardedBuffer<uint32_t> bad(std::vector<uint32_t>{0});
  cuda::fp8_quantize_blocks(dx.data(), 3, 300, kFp8ActivationBlock, Fp8Format::kE4M3, q.data(), sc.data(), bad.data(),
                            stream.get());
  cuda::mx_quantize(dx.data(), 3, 300, Fp8Format::kE4M3, MxScale::kOcp, q.data(), mxs.data(), bad.data(), stream.get());
  stream.sync();
  EXPECT_EQ(bad.download()[0], 6u);
  // The CPU twin refuses them, naming the element.
  std::vector<uint8_t> qh(x.size());
  std::vector<float> sh(9);
  const std::string msg = error_of(
      [&] { cpu::fp8_quantize_blocks(x.data(), 3, 300, kFp8ActivationBlock, Fp8Format::kE4M3, qh.data(), sh.data()); });
  EXPECT_NE(msg.find("element [0, 5]"), std::string::npos) << msg;
}

TEST(Fp8Gpu, RefusesBadShapes) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream stream;
  GuardedBuffer<float> x(8);
  GuardedBuffer<uint8_t> q(8);
  GuardedBuffer<float> s(8);
  const std::string msg = error_of([&] {
    cuda::fp8_quantize_blocks(x.data(), 2, 4, Fp8Block{0, 4}, Fp8Format::kE4M3, q.data(), s.data(), nullptr,
                              stream.get());
  });
  EXPECT_NE(msg.find("cuda::fp8_quantize_blocks: block must be positive"), std::string::npos) << msg;
  const std::string neg = error_of([&] {
    cuda::mx_quantize(x.data(), -1, 4, Fp8Format::kE4M3, MxScale::kOcp, q.data(), q.data(), nullptr, stream.get());
  });
  EXPECT_NE(neg.find("rows and cols must be >= 0"), std::string::npos) << neg;
}

// The FP32-summation bound of each element of A [m, k] B [n, k]^T from the dequantised operands:
// 2^-11 sum_p |a_ip b_jp| (plus a floor for all-zero rows).
std::vector<double> fp32_gemm_bounds(const std::vector<float>& da, const std::vector<float>& db, int64_t m,
                                     int64_t n, int64_t k) {
  std::vector<double> bound(size_t(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double t = 0;
      for (int64_t p = 0; p < k; ++p) t += std::fabs(double(da[size_t(i * k + p)]) * double(db[size_t(j * k + p)]));
      bound[size_t(i * n + j)] = std::ldexp(t, -11) + 1e-30;
    }
  return bound;
}

// One FP8 GEMM case: A [m, k] in 1 x 128 blocks, B [n, k] in 128 x 128 blocks (weights) or 1 x 128
// blocks (the weight-gradient GEMM), quantised on the CPU; the GPU product from the same codes and
// scales (A's scales and a 1 x 128 B's put K-block-major by cuda::fp8_scales_k_major) against the
// CPU's block-scaled product: |gpu - cpu| <= 2^-11 * sum_k |a_ik b_jk| for FP32 C, and the BF16 C
// within one BF16 rounding of that. The products of FP8 codes are exact, but Hopper's FP8 tensor
// cores add them within a 128-wide K block in an accumulator of about 14 mantissa bits (the
// limitation DeepSeek-V3 describes, which is why the partial sums are promoted to FP32 per block):
// measured up to 16.6 x 2^-17 = 2^-13 of sum |a b| on these cases. A wrong scale layout errs by
// O(1) of it.
void check_fp8_gemm(int64_t m, int64_t n, int64_t k, Fp8Format fa, Fp8Format fb, cuda::Fp8BScaling bs,
                    uint64_t seed) {
  const std::string what = "fp8_gemm " + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) +
                           (bs == cuda::Fp8BScaling::kBlock128x128 ? " B 128x128" : " B 1x128");
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> a(size_t(m * k)), b(size_t(n * k)), c0(size_t(m * n));
  for (size_t i = 0; i < a.size(); ++i) a[i] = dist(gen) * (1.0f + float(i % 7));
  for (float& x : b) x = dist(gen) * 0.05f;
  for (float& x : c0) x = dist(gen);
  const Fp8Block bblock = bs == cuda::Fp8BScaling::kBlock128x128 ? kFp8WeightBlock : kFp8ActivationBlock;
  const int64_t kb = k / 128;
  std::vector<uint8_t> qa(a.size()), qb(b.size());
  std::vector<float> sa(size_t(m * kb)), sb(size_t(cpu::fp8_scale_rows(n, bblock) * kb));
  cpu::fp8_quantize_blocks(a.data(), m, k, kFp8ActivationBlock, fa, qa.data(), sa.data());
  cpu::fp8_quantize_blocks(b.data(), n, k, bblock, fb, qb.data(), sb.data());
  std::vector<float> want(c0.size());
  if (bs == cuda::Fp8BScaling::kBlock128x128) {
    cpu::fp8_gemm_block_scaled(qa.data(), sa.data(), fa, qb.data(), sb.data(), fb, m, n, k, want.data(), false);
  } else {
    cpu::fp8_gemm_rowwise_scaled(qa.data(), sa.data(), fa, qb.data(), sb.data(), fb, m, n, k, want.data(), false);
  }
  // Bound per element from the dequantised operands.
  std::vector<float> da(a.size()), db(b.size());
  cpu::fp8_dequantize_blocks(qa.data(), sa.data(), m, k, kFp8ActivationBlock, fa, da.data());
  cpu::fp8_dequantize_blocks(qb.data(), sb.data(), n, k, bblock, fb, db.data());
  const std::vector<double> bound = fp32_gemm_bounds(da, db, m, n, k);

  // The GPU's scale layouts: A's K-block-major; B's 128 x 128 as [n/128, kb] padded to 4 columns,
  // a 1 x 128 B's K-block-major.
  const int64_t lds_b = bs == cuda::Fp8BScaling::kBlock128x128 ? (kb + 3) / 4 * 4 : n;
  std::vector<float> sb_dev(size_t(bs == cuda::Fp8BScaling::kBlock128x128 ? cpu::fp8_scale_rows(n, bblock) * lds_b
                                                                           : kb * n), 0.0f);
  GuardedBuffer<uint8_t> d_qa(qa), d_qb(qb);
  GuardedBuffer<float> d_sa(sa), d_sa_t(kb * m), d_sb_rows(sb), d_sb(int64_t(sb_dev.size()));
  TestStream stream;
  if (bs == cuda::Fp8BScaling::kBlock128x128) {
    for (int64_t r = 0; r < cpu::fp8_scale_rows(n, bblock); ++r)
      for (int64_t c = 0; c < kb; ++c) sb_dev[size_t(r * lds_b + c)] = sb[size_t(r * kb + c)];
    d_sb.upload(sb_dev);
  } else {
    cuda::fp8_scales_k_major(d_sb_rows.data(), n, kb, n, d_sb.data(), stream.get());
  }
  cuda::fp8_scales_k_major(d_sa.data(), m, kb, m, d_sa_t.data(), stream.get());
  stream.sync();
  {  // fp8_scales_k_major is a transposition
    const std::vector<float> t = d_sa_t.download();
    size_t bad = 0;
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < kb; ++c) bad += t[size_t(c * m + r)] != sa[size_t(r * kb + c)];
    EXPECT_EQ(bad, 0u) << what << ": scales transposed wrongly";
  }
  cuda::GemmHandle gemm;
  GuardedBuffer<float> c32(std::vector<float>(c0.size(), NAN)), cacc(c0);
  GuardedBuffer<uint16_t> c16(m * n);
  cuda::fp8_gemm(gemm, d_qa.data(), d_sa_t.data(), m, fa, d_qb.data(), d_sb.data(), lds_b, fb, bs, m, n, k,
                 c32.data(), false, stream.get());
  cuda::fp8_gemm(gemm, d_qa.data(), d_sa_t.data(), m, fa, d_qb.data(), d_sb.data(), lds_b, fb, bs, m, n, k,
                 cacc.data(), true, stream.get());
  cuda::fp8_gemm(gemm, d_qa.data(), d_sa_t.data(), m, fa, d_qb.data(), d_sb.data(), lds_b, fb, bs, m, n, k,
                 c16.data(), stream.get());
  stream.sync();
  const std::vector<float> got = c32.download(), acc = cacc.download();
  const std::vector<uint16_t> got16 = c16.download();
  size_t bad = 0, bad_acc = 0, bad16 = 0;
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double e = std::fabs(double(got[i]) - double(want[i]));
    worst = std::max(worst, e / bound[i]);
    if (!(e <= bound[i]) && bad++ < 3)
      ADD_FAILURE() << what << ": C[" << i << "] = " << got[i] << ", CPU " << want[i] << ", bound " << bound[i];
    const double ea = std::fabs(double(acc[i]) - (double(c0[i]) + double(want[i])));
    if (!(ea <= bound[i] + std::ldexp(std::fabs(double(c0[i]) + double(want[i])), -23))) ++bad_acc;
    const double b16 = ::moe::bf16_to_f32(got16[i]);
    if (!(std::fabs(b16 - double(want[i])) <= bound[i] + std::ldexp(std::fabs(double(want[i])), -8))) ++bad16;
  }
  EXPECT_EQ(bad, 0u) << what << " (FP32 C)";
  EXPECT_EQ(bad_acc, 0u) << what << " (FP32 C accumulated)";
  EXPECT_EQ(bad16, 0u) << what << " (BF16 C)";
  std::printf("%s: worst |gpu - cpu| / bound %.3f\n", what.c_str(), worst);
  c32.expect_guards_intact(what + " C");
}

// cuda::mx_gemm (MX operands re-blocked to 1 x 128, then cuBLASLt's FP8 GEMM) against the CPU's
// re-blocking and cpu::fp8_gemm_rowwise_scaled, and against cpu::mx_gemm where the re-blocking is
// exact: within the FP32-summation bound of the dequantised operands; the count of altered codes
// the CPU's; FP32 C overwritten and accumulated. With `exact`, magnitudes in [1, 2) times each
// 32-wide block's power of two (0 to 4 binades apart), so every re-blocked code stays a normal E4M3
// value and the re-blocking changes nothing; otherwise normal values with blocks up to 16 binades
// apart, whose smaller blocks lose bits.
// The current GPU's compute capability, major version.
int device_major() {
  int device = 0, major = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major;
}

// cuda::mx_gemm against the CPU: on Hopper its re-blocking (the CPU's re-blocking then the 1 x 128
// GEMM, and cpu::mx_gemm itself while nothing was altered); on Blackwell the tensor cores' own MX
// GEMM (cpu::mx_gemm, nothing re-blocked).
void check_mx_gemm(int64_t m, int64_t n, int64_t k, bool exact, uint64_t seed) {
  const std::string what = "mx_gemm " + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) +
                           (exact ? " (re-blocking exact)" : " (re-blocking lossy)");
  const Fp8Format f = Fp8Format::kE4M3;
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(1.0f, 2.0f);
  const auto value = [&](float scale) {
    return exact ? (gen() % 2 ? scale : -scale) * unit(gen) : scale * dist(gen);
  };
  std::vector<float> a(size_t(m * k)), b(size_t(n * k)), c0(size_t(m * n));
  for (size_t i = 0; i < a.size(); ++i) a[i] = std::ldexp(value(1.0f), int(i / 32 % 5) * (exact ? 1 : 4));
  for (float& x : b) x = value(0.05f);
  for (float& x : c0) x = dist(gen);
  const int64_t kb = k / 128, sk = k / 32;
  std::vector<uint8_t> qa(a.size()), qb(b.size()), sa(size_t(m * sk)), sb(size_t(n * sk));
  cpu::mx_quantize(a.data(), m, k, f, MxScale::kOcp, qa.data(), sa.data());
  cpu::mx_quantize(b.data(), n, k, f, MxScale::kOcp, qb.data(), sb.data());
  std::vector<uint8_t> qa2(qa.size()), qb2(qb.size());
  std::vector<float> sa2(size_t(m * kb)), sb2(size_t(n * kb));
  const int64_t changed_ref = cpu::mx_to_blocks128(qa.data(), sa.data(), m, k, f, qa2.data(), sa2.data()) +
                              cpu::mx_to_blocks128(qb.data(), sb.data(), n, k, f, qb2.data(), sb2.data());
  std::vector<float> want(c0.size()), want_mx(c0.size());
  cpu::fp8_gemm_rowwise_scaled(qa2.data(), sa2.data(), f, qb2.data(), sb2.data(), f, m, n, k, want.data(), false);
  cpu::mx_gemm(qa.data(), sa.data(), f, qb.data(), sb.data(), f, m, n, k, want_mx.data(), false);
  std::vector<float> da(a.size()), db(b.size());
  cpu::mx_dequantize(qa.data(), sa.data(), m, k, f, da.data());
  cpu::mx_dequantize(qb.data(), sb.data(), n, k, f, db.data());
  const std::vector<double> bound = fp32_gemm_bounds(da, db, m, n, k);

  GuardedBuffer<uint8_t> d_qa(qa), d_qb(qb), d_sa(sa), d_sb(sb);
  GuardedBuffer<float> c32(std::vector<float>(c0.size(), NAN)), cacc(c0);
  GuardedBuffer<unsigned char> ws(int64_t(cuda::mx_gemm_workspace_bytes(m, n, k)));
  GuardedBuffer<unsigned long long> changed(std::vector<unsigned long long>{0});
  GuardedBuffer<uint32_t> nan_scales(std::vector<uint32_t>{0});
  cuda::GemmHandle gemm;
  TestStream stream;
  cuda::mx_gemm(gemm, d_qa.data(), d_sa.data(), f, d_qb.data(), d_sb.data(), f, m, n, k, c32.data(), false, ws.data(),
                ws.bytes(), changed.data(), nan_scales.data(), stream.get());
  cuda::mx_gemm(gemm, d_qa.data(), d_sa.data(), f, d_qb.data(), d_sb.data(), f, m, n, k, cacc.data(), true, ws.data(),
                ws.bytes(), nullptr, nullptr, stream.get());
  stream.sync();
  const bool blackwell = device_major() >= 10;
  if (blackwell) {  // no re-blocking: the MX product itself
    want = want_mx;
    EXPECT_EQ(changed.download()[0], 0ull) << what << ": nothing is re-blocked on Blackwell";
  } else {
    EXPECT_EQ(int64_t(changed.download()[0]), changed_ref) << what << ": codes the re-blocking altered";
  }
  if (exact) {
    EXPECT_EQ(changed_ref, 0) << what;
  } else {
    EXPECT_GT(changed_ref, 0) << what;
  }
  EXPECT_EQ(nan_scales.download()[0], 0u) << what;
  const std::vector<float> got = c32.download(), acc = cacc.download();
  size_t bad = 0, bad_mx = 0, bad_acc = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double e = std::fabs(double(got[i]) - double(want[i]));
    if (!(e <= bound[i]) && bad++ < 3)
      ADD_FAILURE() << what << ": C[" << i << "] = " << got[i] << ", CPU " << want[i] << ", bound " << bound[i];
    if ((changed_ref == 0 || blackwell) && !(std::fabs(double(got[i]) - double(want_mx[i])) <= bound[i])) ++bad_mx;
    const double ea = std::fabs(double(acc[i]) - (double(c0[i]) + double(want[i])));
    if (!(ea <= bound[i] + std::ldexp(std::fabs(double(c0[i]) + double(want[i])), -23))) ++bad_acc;
  }
  EXPECT_EQ(bad, 0u) << what << " (against the CPU's re-blocking)";
  EXPECT_EQ(bad_mx, 0u) << what << " (against cpu::mx_gemm, the re-blocking exact)";
  EXPECT_EQ(bad_acc, 0u) << what << " (accumulated)";
  c32.expect_guards_intact(what + " C");
  ws.expect_guards_intact(what + " workspace");
}

TEST(Fp8Gpu, MxGemmOnHopperMatchesCpu) {
  MOE_SKIP_WITHOUT_GPU();
  check_mx_gemm(128, 256, 512, true, 41);
  check_mx_gemm(64, 128, 1024, false, 43);
}

// Blackwell's tile layout of MX scales on the GPU: cpu::mx_scales_tiled's bytes bit for bit, rows
// and columns padded (shapes with and without whole tiles).
TEST(Fp8Gpu, MxScalesTiledMatchCpuBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  std::mt19937_64 gen(17);
  TestStream stream;
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{200, 8}, {384, 64}, {1, 4}, {130, 12}}) {
    std::vector<uint8_t> s(size_t(rows * cols));
    for (uint8_t& v : s) v = uint8_t(gen() % 255);
    const std::vector<uint8_t> want = cpu::mx_scales_tiled(s.data(), rows, cols);
    GuardedBuffer<uint8_t> d_s(s), out(int64_t(want.size()));
    cuda::mx_scales_tiled(d_s.data(), rows, cols, out.data(), stream.get());
    stream.sync();
    EXPECT_EQ(out.download(), want) << rows << " x " << cols;
    out.expect_guards_intact("mx_scales_tiled " + std::to_string(rows) + " x " + std::to_string(cols));
  }
  const std::string msg = error_of([&] { cuda::mx_scales_tiled(nullptr, -1, 4, nullptr, stream.get()); });
  EXPECT_NE(msg.find("rows, cols >= 0"), std::string::npos) << msg;
}

// The tensor cores' own MX GEMM (cuBLASLt's VEC32_UE8M0) is Blackwell's: below compute capability
// 10.0 it is refused, naming it, before cuBLASLt is asked; on Blackwell it is cpu::mx_gemm within
// the FP32-reduction bound (check_mx_gemm runs it through cuda::mx_gemm).
TEST(Fp8Gpu, MxGemmTiledIsBlackwellsAndRefusedBefore) {
  MOE_SKIP_WITHOUT_GPU();
  cuda::GemmHandle gemm;
  TestStream stream;
  GuardedBuffer<uint8_t> q(int64_t(128 * 128)), scales(mx_scales_tiled_bytes(128, 4));
  GuardedBuffer<float> c(int64_t(128 * 128));
  const auto run = [&] {
    cuda::mx_gemm_tiled(gemm, q.data(), scales.data(), Fp8Format::kE4M3, q.data(), scales.data(), Fp8Format::kE4M3,
                        128, 128, 128, c.data(), false, stream.get());
  };
  if (device_major() < 10) {
    const std::string msg = error_of(run);
    EXPECT_NE(msg.find("compute capability 10.0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cuda::mx_gemm re-blocks"), std::string::npos) << msg;
  } else {
    EXPECT_NO_THROW(run());
    stream.sync();
    check_mx_gemm(128, 256, 512, true, 47);
  }
}

TEST(Fp8Gpu, BlockScaledGemmMatchesCpuOnTheSameCodes) {
  MOE_SKIP_WITHOUT_GPU();
  // Forward / data gradient (weights in 128 x 128 blocks), K blocks not a multiple of 4 (padded scales).
  check_fp8_gemm(256, 384, 1024, Fp8Format::kE4M3, Fp8Format::kE4M3, cuda::Fp8BScaling::kBlock128x128, 1);
  check_fp8_gemm(132, 272, 384, Fp8Format::kE4M3, Fp8Format::kE4M3, cuda::Fp8BScaling::kBlock128x128, 2);
  check_fp8_gemm(64, 128, 256, Fp8Format::kE5M2, Fp8Format::kE4M3, cuda::Fp8BScaling::kBlock128x128, 3);
  // The weight-gradient GEMM: both operands in 1 x 128 blocks.
  check_fp8_gemm(256, 256, 512, Fp8Format::kE4M3, Fp8Format::kE4M3, cuda::Fp8BScaling::kRow1x128, 4);
}

TEST(Fp8Gpu, BlockScaledGemmRefusesBadShapes) {
  MOE_SKIP_WITHOUT_GPU();
  cuda::GemmHandle gemm;
  GuardedBuffer<uint8_t> q(64 * 256);
  GuardedBuffer<float> s(64 * 4), c(64 * 64);
  TestStream stream;
  auto call = [&](int64_t m, int64_t n, int64_t k, int64_t lds_a, int64_t lds_b, Fp8Format fa, Fp8Format fb) {
    cuda::fp8_gemm(gemm, q.data(), s.data(), lds_a, fa, q.data(), s.data(), lds_b, fb,
                   cuda::Fp8BScaling::kBlock128x128, m, n, k, c.data(), false, stream.get());
  };
  EXPECT_THROW(call(64, 64, 200, 64, 4, Fp8Format::kE4M3, Fp8Format::kE4M3), Error);   // k not a multiple of 128
  EXPECT_THROW(call(64, 60, 256, 64, 4, Fp8Format::kE4M3, Fp8Format::kE4M3), Error);   // n not a multiple of 16
  EXPECT_THROW(call(64, 64, 256, 60, 4, Fp8Format::kE4M3, Fp8Format::kE4M3), Error);   // lds_a < m
  EXPECT_THROW(call(64, 64, 256, 64, 2, Fp8Format::kE4M3, Fp8Format::kE4M3), Error);   // lds_b not padded to 4
  EXPECT_THROW(call(64, 64, 256, 64, 4, Fp8Format::kE5M2, Fp8Format::kE5M2), Error);   // E5M2 x E5M2
  EXPECT_NO_THROW(call(0, 64, 256, 0, 4, Fp8Format::kE4M3, Fp8Format::kE4M3));         // nothing to do
}

// Experts' weights [E, n, k] in 128 x 128 blocks with the transposed copy: the CPU's codes and
// scales bitwise, from FP32 and BF16 weights, partial edge blocks included.
TEST(Fp8Gpu, WeightQuantiseWithTransposeMatchesCpuBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream stream;
  for (const Shape s : std::vector<Shape>{{256, 384}, {200, 136}, {128, 2048}}) {
    const int64_t e = 3, n = s.rows, k = s.cols, numel = e * n * k;
    const int64_t ns = e * cpu::fp8_scale_rows(n, kFp8WeightBlock) * cpu::fp8_scale_cols(k, kFp8WeightBlock);
    const std::vector<uint16_t> w16 = random_bf16(numel, 5 + uint64_t(n), 0.02f);
    const std::vector<float> w32 = wide_values(e * n, k, 9 + uint64_t(k));
    for (int input = 0; input < 2; ++input) {
      const std::vector<float> w = input == 0 ? w32 : bf16_values(w16);
      std::vector<uint8_t> q_ref(static_cast<size_t>(numel)), qt_ref(static_cast<size_t>(numel));
      std::vector<float> s_ref(static_cast<size_t>(ns)), st_ref(static_cast<size_t>(ns));
      cpu::fp8_quantize_weights(w.data(), e, n, k, Fp8Format::kE4M3, q_ref.data(), s_ref.data(), qt_ref.data(),
                                st_ref.data());
      GuardedBuffer<uint8_t> q(numel), qt(numel);
      GuardedBuffer<float> sc(ns), sct(ns);
      GuardedBuffer<uint32_t> bad(std::vector<uint32_t>{0});
      if (input == 0) {
        GuardedBuffer<float> dw(w32);
        cuda::fp8_quantize_weights(dw.data(), e, n, k, Fp8Format::kE4M3, q.data(), sc.data(), qt.data(), sct.data(),
                                   bad.data(), stream.get());
        stream.sync();
      } else {
        GuardedBuffer<uint16_t> dw(w16);
        cuda::fp8_quantize_weights(dw.data(), e, n, k, Fp8Format::kE4M3, q.data(), sc.data(), qt.data(), sct.data(),
                                   bad.data(), stream.get());
        stream.sync();
      }
      const std::string w_what = std::string("fp8 weights ") + (input == 0 ? "f32 " : "bf16 ") +
                                 std::to_string(e) + "x" + std::to_string(n) + "x" + std::to_string(k);
      expect_equal(q.download(), q_ref, w_what + " codes");
      expect_equal(sc.download(), s_ref, w_what + " scales");
      expect_equal(qt.download(), qt_ref, w_what + " transposed codes");
      expect_equal(sct.download(), st_ref, w_what + " transposed scales");
      EXPECT_EQ(bad.download()[0], 0u) << w_what;
      qt.expect_guards_intact(w_what + " qt");
      sct.expect_guards_intact(w_what + " st");
    }
  }
}

// The GPU's BF16 output of one grouped FP8 GEMM against the CPU on the same codes: `in` [max_rows,
// k_red] (the GEMM's input before quantisation, FP32 values) quantised by the CPU in 1 x 128 blocks,
// qb / sb the weights' codes and scales as B ([E, n_out, k_red]); |gpu - cpu| <= 2^-11 sum |a b|
// plus one BF16 rounding (the bound of check_fp8_gemm) on the grouped rows; rows outside them keep
// `sentinel` when given. Returns the worst error / bound.
double compare_grouped_fp8(const std::string& what, const std::vector<float>& in, const std::vector<uint8_t>& qb,
                           const std::vector<float>& sb, const std::vector<int32_t>& offsets, int64_t max_rows,
                           int64_t n_out, int64_t k_red, const std::vector<uint16_t>& got, const uint16_t* sentinel) {
  const int64_t e = int64_t(offsets.size()) - 1, kb = (k_red + 127) / 128, per_w = n_out * k_red;
  const int64_t per_s = ((n_out + 127) / 128) * kb;
  std::vector<uint8_t> qa(in.size());
  std::vector<float> sa(static_cast<size_t>(max_rows * kb)), da(in.size()), db(qb.size());
  cpu::fp8_quantize_blocks(in.data(), max_rows, k_red, kFp8ActivationBlock, Fp8Format::kE4M3, qa.data(), sa.data());
  cpu::fp8_dequantize_blocks(qa.data(), sa.data(), max_rows, k_red, kFp8ActivationBlock, Fp8Format::kE4M3, da.data());
  for (int64_t x = 0; x < e; ++x)
    cpu::fp8_dequantize_blocks(qb.data() + x * per_w, sb.data() + x * per_s, n_out, k_red, kFp8WeightBlock,
                               Fp8Format::kE4M3, db.data() + x * per_w);
  const float kUnset = 12345.0f;
  std::vector<float> want(static_cast<size_t>(max_rows * n_out), kUnset);
  cpu::fp8_grouped_gemm_block_scaled(qa.data(), sa.data(), Fp8Format::kE4M3, qb.data(), sb.data(), Fp8Format::kE4M3,
                                     offsets.data(), max_rows, e, n_out, k_red, want.data());
  size_t bad = 0, written_outside = 0;
  double worst = 0;
  for (int64_t x = 0; x < e; ++x) {
    const int64_t start = std::clamp<int64_t>(offsets[size_t(x)], 0, max_rows);
    const int64_t end = std::clamp<int64_t>(offsets[size_t(x) + 1], start, max_rows);
    for (int64_t r = start; r < end; ++r)
      for (int64_t j = 0; j < n_out; ++j) {
        double t = 0;
        for (int64_t p = 0; p < k_red; ++p)
          t += std::fabs(double(da[size_t(r * k_red + p)]) * double(db[size_t(x * per_w + j * k_red + p)]));
        const double ref = want[size_t(r * n_out + j)];
        const double bound = std::ldexp(t, -11) + std::ldexp(std::fabs(ref), -8) + 1e-30;
        const double v = ::moe::bf16_to_f32(got[size_t(r * n_out + j)]);
        const double err = std::fabs(v - ref);
        worst = std::max(worst, err / bound);
        if (!(err <= bound) && bad++ < 3)
          ADD_FAILURE() << what << ": out[" << r << ", " << j << "] = " << v << ", CPU " << ref << ", bound " << bound;
      }
  }
  if (sentinel != nullptr)
    for (size_t i = 0; i < want.size(); ++i)
      if (want[i] == kUnset) written_outside += got[i] != *sentinel;
  EXPECT_EQ(bad, 0u) << what;
  EXPECT_EQ(written_outside, 0u) << what << ": rows outside the groups were written";
  std::printf("%s: worst |gpu - cpu| / bound %.3f\n", what.c_str(), worst);
  return worst;
}

// One grouped FP8 GEMM case: activations [max_rows, k_red] and weights [E, n_w, k_w] quantised on
// the CPU; forward (out = a W_e^T: n_out = n_w, k_red = k_w, B = the codes) or data gradient (out =
// a W_e: n_out = k_w, k_red = n_w, B = the transposed copy), compare_grouped_fp8 on the output.
void check_grouped_fp8(const std::vector<int32_t>& offsets, int64_t max_rows, int64_t n_w, int64_t k_w, bool dgrad,
                       uint64_t seed) {
  const int64_t e = int64_t(offsets.size()) - 1;
  const int64_t n_out = dgrad ? k_w : n_w, k_red = dgrad ? n_w : k_w, kb = (k_red + 127) / 128;
  const std::string what = std::string("grouped_gemm_fp8 ") + (dgrad ? "dgrad" : "forward") + " E=" +
                           std::to_string(e) + " rows=" + std::to_string(max_rows) + " n=" + std::to_string(n_out) +
                           " k=" + std::to_string(k_red);
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> a(size_t(max_rows * k_red)), w(size_t(e * n_w * k_w));
  for (size_t i = 0; i < a.size(); ++i) a[i] = dist(gen) * (1.0f + float(i % 7));
  for (float& x : w) x = dist(gen) * 0.05f;
  std::vector<uint8_t> qa(a.size()), qw(w.size()), qwt(w.size());
  const int64_t nws = e * ((n_w + 127) / 128) * ((k_w + 127) / 128);
  std::vector<float> sa(size_t(max_rows * kb)), sw(static_cast<size_t>(nws)), swt(static_cast<size_t>(nws));
  cpu::fp8_quantize_blocks(a.data(), max_rows, k_red, kFp8ActivationBlock, Fp8Format::kE4M3, qa.data(), sa.data());
  cpu::fp8_quantize_weights(w.data(), e, n_w, k_w, Fp8Format::kE4M3, qw.data(), sw.data(), qwt.data(), swt.data());
  const std::vector<uint8_t>& qb = dgrad ? qwt : qw;
  const std::vector<float>& sb = dgrad ? swt : sw;
  GuardedBuffer<uint8_t> d_qa(qa), d_qb(qb);
  GuardedBuffer<float> d_sa(sa), d_sb(sb);
  GuardedBuffer<int32_t> d_off(offsets);
  const uint16_t kSentinel = 0x7fc1;
  // Each output starts as sentinels: rows outside the groups must keep them.
  GuardedBuffer<uint16_t> out(std::vector<uint16_t>(size_t(max_rows * n_out), kSentinel));
  TestStream stream;
  cuda::grouped_gemm_fp8(d_qa.data(), d_sa.data(), d_qb.data(), d_sb.data(), d_off.data(), out.data(), max_rows, e,
                         n_out, k_red, stream.get());
  stream.sync();
  compare_grouped_fp8(what, a, qb, sb, offsets, max_rows, n_out, k_red, out.download(), &kSentinel);
  out.expect_guards_intact(what + " out");
}

TEST(Fp8Gpu, GroupedGemmMatchesCpuOnTheSameCodes) {
  MOE_SKIP_WITHOUT_GPU();
  if (!cuda::grouped_gemm_wgmma_available()) GTEST_SKIP() << "the FP8 grouped GEMM needs a compute capability 9.0 GPU";
  // Five experts: 130 rows (a whole tile and 2 rows), none, 256, 77, 1; a dropped tail of 40 rows.
  const std::vector<int32_t> offsets = {0, 130, 130, 386, 463, 464};
  for (const bool dgrad : {false, true}) {
    check_grouped_fp8(offsets, 504, 384, 512, dgrad, 11 + dgrad);
    check_grouped_fp8(offsets, 504, 272, 400, dgrad, 13 + dgrad);  // partial weight blocks, K tail
  }
  // One expert over many rows (several M tiles per CTA) at an expert shape.
  check_grouped_fp8({0, 700}, 700, 1024, 256, false, 17);
  // Many experts, more tiles than CTAs (each walks several), an odd N-tile count.
  std::vector<int32_t> many = {0};
  for (int x = 0; x < 24; ++x) many.push_back(many.back() + 33 + 41 * (x % 5));
  check_grouped_fp8(many, many.back() + 5, 1024, 256, false, 19);
  check_grouped_fp8(many, many.back() + 5, 384, 256, false, 23);
}

TEST(Fp8Gpu, GroupedGemmRefusesBadShapes) {
  MOE_SKIP_WITHOUT_GPU();
  GuardedBuffer<uint8_t> q(64 * 256);
  GuardedBuffer<float> s(64);
  GuardedBuffer<int32_t> off(std::vector<int32_t>{0, 64});
  GuardedBuffer<uint16_t> out(64 * 64);
  TestStream stream;
  const std::string msg = error_of([&] {
    cuda::grouped_gemm_fp8(q.data(), s.data(), q.data(), s.data(), off.data(), out.data(), 64, 1, 64, 24,
                           stream.get());
  });
  EXPECT_NE(msg.find("cuda::grouped_gemm_fp8: k=24 must be a multiple of 16"), std::string::npos) << msg;
}

// Offsets of a grouped weight-gradient case: a partial block, an empty expert, exactly one block,
// one row, more than two blocks, and a dropped tail past offsets[E].
const std::vector<int32_t> kColumnOffsets = {0, 100, 100, 228, 229, 520};
constexpr int64_t kColumnMaxRows = 560;

// cuda::fp8_quantize_expert_columns against cpu::fp8_quantize_expert_columns: padded offsets, the
// codes of every expert's columns (padding included) and the scales, bitwise; the dropped tail's
// rows (NaN) never read; widths with a partial 64-column tile.
TEST(Fp8Gpu, ExpertColumnsMatchCpuBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t E = int64_t(kColumnOffsets.size()) - 1, R = kColumnMaxRows;
  const int64_t capacity = cuda::fp8_expert_columns_capacity(R, E);
  for (const int64_t width : {int64_t{256}, int64_t{200}}) {
    std::vector<uint16_t> x = random_bf16(R * width, 41 + width, 2.0f);
    for (int64_t i = kColumnOffsets.back() * width; i < R * width; ++i) x[size_t(i)] = 0x7FC0;  // NaN tail
    for (int64_t j = 0; j < width; ++j) x[size_t(5 * width + j)] = f32_to_bf16(j % 3 == 0 ? 300.0f : 0.0f);
    const std::vector<float> xf = bf16_to_f32(x);
    std::vector<uint8_t> q_cpu(size_t(width * capacity), 0xAB);
    std::vector<float> s_cpu(size_t(capacity / 128 * width), -1.0f);
    std::vector<int32_t> pad_cpu(size_t(E + 1));
    cpu::fp8_quantize_expert_columns(xf.data(), kColumnOffsets.data(), R, E, width, capacity, Fp8Format::kE4M3,
                                     q_cpu.data(), s_cpu.data(), pad_cpu.data());
    GuardedBuffer<uint16_t> d_x(x);
    GuardedBuffer<int32_t> d_off(kColumnOffsets), d_pad(E + 1);
    GuardedBuffer<uint8_t> d_q(std::vector<uint8_t>(size_t(width * capacity), 0xAB));
    GuardedBuffer<float> d_s(std::vector<float>(size_t(capacity / 128 * width), -1.0f));
    GuardedBuffer<uint32_t> bad(std::vector<uint32_t>{0});
    TestStream stream;
    cuda::fp8_quantize_expert_columns(d_x.data(), d_off.data(), R, E, width, capacity, Fp8Format::kE4M3, d_q.data(),
                                      d_s.data(), d_pad.data(), bad.data(), stream.get());
    stream.sync();
    const std::string what = "width " + std::to_string(width);
    EXPECT_EQ(d_pad.download(), pad_cpu) << what;
    EXPECT_EQ(pad_cpu.back(), 128 + 0 + 128 + 128 + 384) << what;
    const std::vector<uint8_t> q = d_q.download();
    const std::vector<float> sc = d_s.download();
    int64_t code_diffs = 0, scale_diffs = 0;
    for (int64_t j = 0; j < width; ++j) {
      for (int64_t p = 0; p < pad_cpu.back(); ++p) {
        code_diffs += q[size_t(j * capacity + p)] != q_cpu[size_t(j * capacity + p)];
      }
      for (int64_t p = pad_cpu.back(); p < capacity; ++p) code_diffs += q[size_t(j * capacity + p)] != 0xAB;
    }
    for (size_t i = 0; i < sc.size(); ++i) scale_diffs += std::memcmp(&sc[i], &s_cpu[i], sizeof(float)) != 0;
    EXPECT_EQ(code_diffs, 0) << what;
    EXPECT_EQ(scale_diffs, 0) << what;
    EXPECT_EQ(bad.download()[0], 0u) << what << ": the NaN tail was read";
    d_x.expect_guards_intact(what + " x");
    d_q.expect_guards_intact(what + " q_t");
    d_s.expect_guards_intact(what + " scales_t");
  }
}

// cuda::grouped_gemm_fp8_wgrad against the CPU on the same codes: dy [R, n] and x [R, k] quantised
// down each expert's rows by the CPU twin, dw[e] = per expert cpu::fp8_gemm_rowwise_scaled of its
// blocks; |gpu - cpu| <= 2^-11 sum |a b| + 2^-20 |cpu| (the tensor cores' in-block sums, as
// check_fp8_gemm), overwrite (the empty expert's dw zeros) and accumulate (onto random dw, the
// empty expert's untouched, plus one FP32 rounding of the sum).
TEST(Fp8Gpu, GroupedWgradMatchesCpuOnTheSameCodes) {
  MOE_SKIP_WITHOUT_GPU();
  if (!cuda::grouped_gemm_wgmma_available()) GTEST_SKIP() << "the FP8 grouped GEMM needs a compute capability 9.0 GPU";
  const int64_t E = int64_t(kColumnOffsets.size()) - 1, R = kColumnMaxRows, n = 256, k = 384;
  const int64_t capacity = cuda::fp8_expert_columns_capacity(R, E), kb = capacity / 128;
  const std::vector<float> dyf = bf16_to_f32(random_bf16(R * n, 51, 1.0f)), xf = bf16_to_f32(random_bf16(R * k, 52));
  std::vector<uint8_t> qa(size_t(n * capacity), 0), qb(size_t(k * capacity), 0);
  std::vector<float> sa(size_t(kb * n), 1.0f), sb(size_t(kb * k), 1.0f);
  std::vector<int32_t> pad(size_t(E + 1));
  cpu::fp8_quantize_expert_columns(dyf.data(), kColumnOffsets.data(), R, E, n, capacity, Fp8Format::kE4M3, qa.data(),
                                   sa.data(), pad.data());
  cpu::fp8_quantize_expert_columns(xf.data(), kColumnOffsets.data(), R, E, k, capacity, Fp8Format::kE4M3, qb.data(),
                                   sb.data(), pad.data());
  // Per expert: its blocks as row-major operands [n, pr] / [k, pr] with [rows, pr / 128] scales.
  std::vector<float> want(size_t(E * n * k), 0.0f), sum_ab(size_t(E * n * k), 0.0f);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t p0 = pad[size_t(e)], pr = pad[size_t(e) + 1] - p0, nb = pr / 128;
    if (pr == 0) continue;
    std::vector<uint8_t> a(size_t(n * pr)), b(size_t(k * pr));
    std::vector<float> as(size_t(n * nb)), bs(size_t(k * nb));
    for (int64_t i = 0; i < n; ++i) {
      std::copy_n(qa.data() + i * capacity + p0, pr, a.data() + i * pr);
      for (int64_t x = 0; x < nb; ++x) as[size_t(i * nb + x)] = sa[size_t((p0 / 128 + x) * n + i)];
    }
    for (int64_t j = 0; j < k; ++j) {
      std::copy_n(qb.data() + j * capacity + p0, pr, b.data() + j * pr);
      for (int64_t x = 0; x < nb; ++x) bs[size_t(j * nb + x)] = sb[size_t((p0 / 128 + x) * k + j)];
    }
    cpu::fp8_gemm_rowwise_scaled(a.data(), as.data(), Fp8Format::kE4M3, b.data(), bs.data(), Fp8Format::kE4M3, n, k,
                                 pr, want.data() + e * n * k, false);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < k; ++j) {
        double t = 0;
        for (int64_t p = 0; p < pr; ++p) {
          const double va = cpu::fp8_decode(a[size_t(i * pr + p)], Fp8Format::kE4M3) * as[size_t(i * nb + p / 128)];
          const double vb = cpu::fp8_decode(b[size_t(j * pr + p)], Fp8Format::kE4M3) * bs[size_t(j * nb + p / 128)];
          t += std::fabs(va * vb);
        }
        sum_ab[size_t((e * n + i) * k + j)] = float(t);
      }
  }
  GuardedBuffer<uint8_t> d_qa(qa), d_qb(qb);
  GuardedBuffer<float> d_sa(sa), d_sb(sb);
  GuardedBuffer<int32_t> d_pad(pad);
  const std::vector<float> old = random_f32(E * n * k, 53);
  for (const bool accumulate : {false, true}) {
    const std::string what = accumulate ? "fp8 wgrad accumulate" : "fp8 wgrad overwrite";
    GuardedBuffer<float> dw(accumulate ? old : std::vector<float>(size_t(E * n * k), std::nanf("")));
    TestStream stream;
    cuda::grouped_gemm_fp8_wgrad(d_qa.data(), d_sa.data(), d_qb.data(), d_sb.data(), d_pad.data(), dw.data(), E, n, k,
                                 capacity, accumulate, stream.get());
    stream.sync();
    const std::vector<float> got = dw.download();
    size_t bad = 0;
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double base = accumulate ? old[i] : 0.0, ref = base + want[i];
      const double bound = std::ldexp(double(sum_ab[i]), -11) + std::ldexp(std::fabs(ref), -20) +
                           std::ldexp(std::fabs(base), -22) + 1e-30;
      const double err = std::fabs(double(got[i]) - ref);
      worst = std::max(worst, err / bound);
      if (!(err <= bound) && bad++ < 3) ADD_FAILURE() << what << ": dw[" << i << "] = " << got[i] << ", CPU " << ref;
    }
    EXPECT_EQ(bad, 0u) << what;
    std::printf("%s: worst |gpu - cpu| / bound %.3f\n", what.c_str(), worst);
    // The empty expert (e = 1): zeros when overwriting, untouched when accumulating.
    for (int64_t i = n * k; i < 2 * n * k; ++i)
      ASSERT_EQ(got[size_t(i)], accumulate ? old[size_t(i)] : 0.0f) << what << ": the empty expert's dw";
    dw.expect_guards_intact(what + " dw");
  }
}

TEST(Fp8Gpu, GroupedWgradRefusesBadShapes) {
  MOE_SKIP_WITHOUT_GPU();
  GuardedBuffer<uint8_t> q(128 * 256);
  GuardedBuffer<float> s(256);
  GuardedBuffer<int32_t> pad(std::vector<int32_t>{0, 128});
  GuardedBuffer<float> dw(128 * 192);
  TestStream stream;
  const std::string msg = error_of([&] {
    cuda::grouped_gemm_fp8_wgrad(q.data(), s.data(), q.data(), s.data(), pad.data(), dw.data(), 1, 128, 192, 256,
                                 false, stream.get());
  });
  EXPECT_NE(msg.find("cuda::grouped_gemm_fp8_wgrad: n=128 and k=192 must be positive multiples of 128"),
            std::string::npos)
      << msg;
}

// The expert exchange's FP8 rows: cuda::fp8_pack_rows bitwise cpu::fp8_pack_rows (block scaling,
// both formats; rows whose payload is not 8-byte aligned, cols 384: 396 bytes a row), and
// cuda::fp8_unpack_rows' codes and scales the payload's, its BF16 rows the rounding of
// cpu::fp8_unpack_rows' FP32 values; an output left null is not written.
TEST(Fp8Gpu, RowPayloadMatchesCpuBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t rows = 37, cols = 384, kb = cols / 128;
  const int64_t per = cuda::fp8_row_payload_bytes(cols);
  for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    const std::string what = f == Fp8Format::kE4M3 ? "e4m3" : "e5m2";
    std::vector<uint16_t> x = random_bf16(rows * cols, 61, 3.0f);
    for (int64_t j = 0; j < 128; ++j) x[size_t(2 * cols + j)] = 0;  // an all-zero block: scale 1
    const std::vector<float> xf = bf16_to_f32(x);
    cpu::Fp8Recipe r;
    r.forward = r.grad = f;
    ASSERT_EQ(per, cpu::fp8_row_payload_bytes(cols, r));
    std::vector<uint8_t> want(size_t(rows * per));
    cpu::fp8_pack_rows(xf.data(), rows, cols, f, r, want.data());
    std::vector<float> values(size_t(rows * cols));
    cpu::fp8_unpack_rows(want.data(), rows, cols, f, r, values.data());
    GuardedBuffer<uint16_t> d_x(x);
    GuardedBuffer<uint8_t> payload(rows * per), codes(std::vector<uint8_t>(size_t(rows * cols), 0xCD));
    GuardedBuffer<float> scales(rows * kb);
    GuardedBuffer<uint16_t> out(rows * cols);
    GuardedBuffer<uint32_t> bad(std::vector<uint32_t>{0});
    TestStream stream;
    cuda::fp8_pack_rows(d_x.data(), rows, cols, f, payload.data(), bad.data(), stream.get());
    cuda::fp8_unpack_rows(payload.data(), rows, cols, f, nullptr, scales.data(), out.data(), stream.get());
    stream.sync();
    EXPECT_EQ(payload.download(), want) << what << ": payload";
    EXPECT_EQ(bad.download()[0], 0u) << what;
    const std::vector<uint8_t> untouched = codes.download();
    EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(), [](uint8_t c) { return c == 0xCD; }))
        << what << ": codes were written although null was passed for them";
    cuda::fp8_unpack_rows(payload.data(), rows, cols, f, codes.data(), nullptr, nullptr, stream.get());
    stream.sync();
    const std::vector<uint8_t> got_codes = codes.download();
    const std::vector<float> got_scales = scales.download();
    const std::vector<uint16_t> got_out = out.download();
    int64_t diffs = 0;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        diffs += got_codes[size_t(i * cols + j)] != want[size_t(i * per + j)];
        diffs += got_out[size_t(i * cols + j)] != f32_to_bf16(values[size_t(i * cols + j)]);
      }
      for (int64_t b = 0; b < kb; ++b) {
        float s;
        std::memcpy(&s, want.data() + i * per + cols + 4 * b, sizeof(float));
        diffs += std::memcmp(&s, &got_scales[size_t(i * kb + b)], sizeof(float)) != 0;
      }
    }
    EXPECT_EQ(diffs, 0) << what << ": unpacked codes, scales or BF16 rows";
    EXPECT_EQ(got_scales[size_t(2 * kb)], 1.0f) << what << ": the all-zero block's scale";
    for (auto* b : {&payload, &codes}) b->expect_guards_intact(what);
    out.expect_guards_intact(what + " out");
  }
}

// The FP8 recipe's experts (cuda::experts_forward_fp8 / experts_backward_fp8) stage by stage
// against the CPU on the same codes: gate_up from x, y from the saved h, dh from dy (the down
// weights' transposed codes), dx from dgate_up (the gate_up weights' transposed codes); the weight
// gradients bitwise the BF16 grouped wgrad of the same saved tensors; a dropped tail and an empty
// expert; the weights quantised on the GPU from FP32 (bitwise the CPU's codes, tested above).
// I = 192: h and dgate_up quantised by their own pass; I = 256: by the SwiGLU kernels (fused).
void check_experts_fp8(const int64_t I) {
  const int64_t R = 384, E = 3, D = 256;
  const std::vector<int32_t> offsets = {0, 150, 150, 340};
  std::mt19937_64 gen(21);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> w_gu(static_cast<size_t>(E * 2 * I * D)), w_dn(static_cast<size_t>(E * D * I));
  for (float& v : w_gu) v = dist(gen) * 0.05f;
  for (float& v : w_dn) v = dist(gen) * 0.05f;
  const std::vector<uint16_t> x = random_bf16(R * D, 31, 1.0f), dy = random_bf16(R * D, 32, 1.0f);
  // CPU codes of the weights (the GPU's, bitwise).
  const auto nsc = [](int64_t a, int64_t b) { return static_cast<size_t>(E * ((a + 127) / 128) * ((b + 127) / 128)); };
  std::vector<uint8_t> q_gu(w_gu.size()), qt_gu(w_gu.size()), q_dn(w_dn.size()), qt_dn(w_dn.size());
  std::vector<float> s_gu(nsc(2 * I, D)), st_gu(nsc(2 * I, D)), s_dn(nsc(D, I)), st_dn(nsc(D, I));
  cpu::fp8_quantize_weights(w_gu.data(), E, 2 * I, D, Fp8Format::kE4M3, q_gu.data(), s_gu.data(), qt_gu.data(),
                            st_gu.data());
  cpu::fp8_quantize_weights(w_dn.data(), E, D, I, Fp8Format::kE4M3, q_dn.data(), s_dn.data(), qt_dn.data(),
                            st_dn.data());
  TestStream stream;
  GuardedBuffer<float> d_wgu(w_gu), d_wdn(w_dn);
  GuardedBuffer<uint8_t> g_qgu(static_cast<int64_t>(q_gu.size())), g_qtgu(static_cast<int64_t>(q_gu.size())), g_qdn(static_cast<int64_t>(q_dn.size())),
      g_qtdn(static_cast<int64_t>(q_dn.size()));
  GuardedBuffer<float> g_sgu(static_cast<int64_t>(s_gu.size())), g_stgu(static_cast<int64_t>(s_gu.size())), g_sdn(static_cast<int64_t>(s_dn.size())),
      g_stdn(static_cast<int64_t>(s_dn.size()));
  cuda::fp8_quantize_weights(d_wgu.data(), E, 2 * I, D, Fp8Format::kE4M3, g_qgu.data(), g_sgu.data(), g_qtgu.data(),
                             g_stgu.data(), nullptr, stream.get());
  cuda::fp8_quantize_weights(d_wdn.data(), E, D, I, Fp8Format::kE4M3, g_qdn.data(), g_sdn.data(), g_qtdn.data(),
                             g_stdn.data(), nullptr, stream.get());
  const cuda::Fp8ExpertWeights fw{g_qgu.data(), g_sgu.data(), g_qtgu.data(), g_stgu.data(),
                                  g_qdn.data(), g_sdn.data(), g_qtdn.data(), g_stdn.data()};
  GuardedBuffer<uint16_t> d_x(x), d_dy(dy), gate_up(R * 2 * I), h(R * I), y(R * D), dx(R * D);
  GuardedBuffer<int32_t> d_off(offsets);
  const size_t ws_bytes = cuda::experts_backward_workspace_bytes(R, I), f8_bytes = cuda::experts_fp8_workspace_bytes(R, D, I);
  GuardedBuffer<uint8_t> ws(static_cast<int64_t>(ws_bytes)), f8(static_cast<int64_t>(f8_bytes));
  GuardedBuffer<float> dw_gu(E * 2 * I * D), dw_dn(E * D * I), ref_gu(E * 2 * I * D), ref_dn(E * D * I);
  cuda::experts_forward_fp8(d_x.data(), d_off.data(), fw, R, E, D, I, gate_up.data(), h.data(), y.data(), f8.data(),
                            f8_bytes, stream.get());
  cuda::experts_backward_fp8(d_x.data(), d_off.data(), fw, gate_up.data(), h.data(), d_dy.data(), R, E, D, I,
                             dx.data(), dw_gu.data(), dw_dn.data(), ws.data(), ws_bytes, f8.data(), f8_bytes,
                             stream.get(), /*accumulate_dw=*/false);
  stream.sync();
  const std::vector<uint16_t> g_gate_up = gate_up.download(), g_h = h.download(), g_y = y.download(),
                              g_dx = dx.download(), g_ws16 = [&] {
                                const std::vector<uint8_t> b = ws.download();
                                std::vector<uint16_t> v(b.size() / 2);
                                std::memcpy(v.data(), b.data(), v.size() * 2);
                                return v;
                              }();
  const std::vector<uint16_t> g_dgate_up(g_ws16.begin(), g_ws16.begin() + R * 2 * I),
      g_dh(g_ws16.begin() + R * 2 * I, g_ws16.begin() + R * 3 * I);
  // Rows past the groups hold what SwiGLU made of unwritten memory: only the grouped rows feed the checks.
  auto grouped_only = [&](const std::vector<uint16_t>& v, int64_t cols) {
    std::vector<float> f = bf16_values(v);
    for (int64_t r = offsets.back(); r < R; ++r)
      for (int64_t c = 0; c < cols; ++c) f[size_t(r * cols + c)] = 0.0f;
    return f;
  };
  compare_grouped_fp8("experts fp8 gate_up", bf16_values(x), q_gu, s_gu, offsets, R, 2 * I, D, g_gate_up, nullptr);
  compare_grouped_fp8("experts fp8 down", grouped_only(g_h, I), q_dn, s_dn, offsets, R, D, I, g_y, nullptr);
  compare_grouped_fp8("experts fp8 dh", bf16_values(dy), qt_dn, st_dn, offsets, R, I, D, g_dh, nullptr);
  compare_grouped_fp8("experts fp8 dx", grouped_only(g_dgate_up, 2 * I), qt_gu, st_gu, offsets, R, D, 2 * I, g_dx,
                      nullptr);
  // The weight gradients: the BF16 grouped wgrad of the saved tensors, bitwise.
  cuda::grouped_gemm_wgrad(d_dy.data(), h.data(), d_off.data(), ref_dn.data(), R, E, D, I, false, stream.get());
  GuardedBuffer<uint16_t> d_dgate_up(g_dgate_up);
  cuda::grouped_gemm_wgrad(d_dgate_up.data(), d_x.data(), d_off.data(), ref_gu.data(), R, E, 2 * I, D, false,
                           stream.get());
  stream.sync();
  expect_equal(dw_dn.download(), ref_dn.download(), "experts fp8 dw_down");
  expect_equal(dw_gu.download(), ref_gu.download(), "experts fp8 dw_gate_up");
  // With the FP8 weight gradients (D and I multiples of 128): dx the same bits; each dw bitwise
  // cuda::grouped_gemm_fp8_wgrad of the operands quantised down the experts' rows (the kernels'
  // own tests compare them with the CPU), and within FP8's error of the BF16 weight gradients.
  if (cuda::experts_fp8_wgrad_applies(D, I)) {
    const size_t wg_bytes = cuda::experts_fp8_wgrad_workspace_bytes(R, E, D, I);
    GuardedBuffer<uint8_t> wg(static_cast<int64_t>(wg_bytes));
    GuardedBuffer<uint16_t> dx3(R * D);
    GuardedBuffer<float> dw_gu3(E * 2 * I * D), dw_dn3(E * D * I), want_gu(E * 2 * I * D), want_dn(E * D * I);
    cuda::experts_backward_fp8(d_x.data(), d_off.data(), fw, gate_up.data(), h.data(), d_dy.data(), R, E, D, I,
                               dx3.data(), dw_gu3.data(), dw_dn3.data(), ws.data(), ws_bytes, f8.data(), f8_bytes,
                               stream.get(), /*accumulate_dw=*/false, /*input_quantised=*/false, wg.data(), wg_bytes);
    const int64_t cap = cuda::fp8_expert_columns_capacity(R, E);
    GuardedBuffer<uint8_t> qa(std::max(D, 2 * I) * cap), qb(std::max(D, I) * cap);
    GuardedBuffer<float> sa(cap / 128 * std::max(D, 2 * I)), sb(cap / 128 * std::max(D, I));
    GuardedBuffer<int32_t> pad(E + 1);
    const auto wgrad = [&](const uint16_t* a, int64_t n, const uint16_t* b, int64_t k, float* out) {
      cuda::fp8_quantize_expert_columns(a, d_off.data(), R, E, n, cap, Fp8Format::kE4M3, qa.data(), sa.data(),
                                        pad.data(), nullptr, stream.get());
      cuda::fp8_quantize_expert_columns(b, d_off.data(), R, E, k, cap, Fp8Format::kE4M3, qb.data(), sb.data(),
                                        pad.data(), nullptr, stream.get());
      cuda::grouped_gemm_fp8_wgrad(qa.data(), sa.data(), qb.data(), sb.data(), pad.data(), out, E, n, k, cap, false,
                                   stream.get());
    };
    wgrad(d_dy.data(), D, h.data(), I, want_dn.data());
    wgrad(d_dgate_up.data(), 2 * I, d_x.data(), D, want_gu.data());
    stream.sync();
    const auto head_of = [](const std::vector<uint16_t>& v, int64_t n) {
      return std::vector<uint16_t>(v.begin(), v.begin() + n);
    };
    expect_equal(head_of(dx3.download(), offsets.back() * D), head_of(g_dx, offsets.back() * D), "fp8 wgrad: dx");
    expect_equal(dw_dn3.download(), want_dn.download(), "fp8 wgrad: dw_down");
    expect_equal(dw_gu3.download(), want_gu.download(), "fp8 wgrad: dw_gate_up");
    const auto rel = [](const std::vector<float>& got, const std::vector<float>& ref) {
      double num = 0, den = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        num += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
        den += double(ref[i]) * ref[i];
      }
      return std::sqrt(num / std::max(den, 1e-300));
    };
    EXPECT_LT(rel(dw_dn3.download(), ref_dn.download()), 0.1) << "fp8 dw_down against the BF16 weight gradient";
    EXPECT_LT(rel(dw_gu3.download(), ref_gu.download()), 0.1) << "fp8 dw_gate_up against the BF16 weight gradient";
    wg.expect_guards_intact("fp8 wgrad workspace");
  }
  // The inputs' codes written by their producer into the workspace (here by the quantiser, which
  // the permute and the combine's backward equal bitwise: moe_routing_test.cpp), input_quantised:
  // every output bitwise the run that quantised x and dy itself.
  {
    const cuda::Fp8Rows in = cuda::experts_fp8_input_rows(f8.data(), f8_bytes, R, D, I);
    GuardedBuffer<uint16_t> gate_up2(R * 2 * I), h2(R * I), y2(R * D), dx2(R * D);
    GuardedBuffer<float> dw_gu2(E * 2 * I * D), dw_dn2(E * D * I);
    cuda::fp8_quantize_blocks(d_x.data(), R, D, kFp8ActivationBlock, Fp8Format::kE4M3, in.codes, in.scales, nullptr,
                              stream.get());
    cuda::experts_forward_fp8(d_x.data(), d_off.data(), fw, R, E, D, I, gate_up2.data(), h2.data(), y2.data(),
                              f8.data(), f8_bytes, stream.get(), /*input_quantised=*/true);
    cuda::fp8_quantize_blocks(d_dy.data(), R, D, kFp8ActivationBlock, Fp8Format::kE4M3, in.codes, in.scales, nullptr,
                              stream.get());
    cuda::experts_backward_fp8(d_x.data(), d_off.data(), fw, gate_up2.data(), h2.data(), d_dy.data(), R, E, D, I,
                               dx2.data(), dw_gu2.data(), dw_dn2.data(), ws.data(), ws_bytes, f8.data(), f8_bytes,
                               stream.get(), /*accumulate_dw=*/false, /*input_quantised=*/true);
    stream.sync();
    auto head = [](const std::vector<uint16_t>& v, int64_t n) { return std::vector<uint16_t>(v.begin(), v.begin() + n); };
    const int64_t used = offsets.back();  // rows past the groups are not outputs
    expect_equal(head(gate_up2.download(), used * 2 * I), head(g_gate_up, used * 2 * I), "input_quantised gate_up");
    expect_equal(head(y2.download(), used * D), head(g_y, used * D), "input_quantised y");
    expect_equal(head(dx2.download(), used * D), head(g_dx, used * D), "input_quantised dx");
    expect_equal(dw_dn2.download(), dw_dn.download(), "input_quantised dw_down");
    expect_equal(dw_gu2.download(), dw_gu.download(), "input_quantised dw_gate_up");
  }
  const std::string msg = error_of([&] {
    cuda::experts_forward_fp8(d_x.data(), d_off.data(), fw, R, E, D, I, gate_up.data(), h.data(), y.data(), f8.data(),
                              f8_bytes - 16, stream.get());
  });
  EXPECT_NE(msg.find("cuda::experts_forward_fp8: FP8 workspace of"), std::string::npos) << msg;
}

TEST(Fp8Gpu, ExpertsFp8FollowTheCpuStageByStage) {
  MOE_SKIP_WITHOUT_GPU();
  if (!cuda::grouped_gemm_wgmma_available()) GTEST_SKIP() << "the FP8 grouped GEMM needs a compute capability 9.0 GPU";
  check_experts_fp8(192);
  check_experts_fp8(256);
}

// The SwiGLU kernels with the quantisation fused in: h / dgate_up bitwise swiglu_forward /
// swiglu_backward's, their codes and scales bitwise fp8_quantize_blocks' of those BF16 outputs
// (whose CPU parity is tested above and in swiglu_test.cpp); rows not a multiple of the CTA's 16
// blocks; inner not a multiple of 128 refused.
TEST(Fp8Gpu, SwigluWritesItsOutputsCodesBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream stream;
  for (const Fp8Rule rule : {Fp8Rule::kBlocks, Fp8Rule::kMx, Fp8Rule::kMxNoSaturation})
  for (const int64_t inner : {int64_t{128}, int64_t{384}}) {
    const int64_t n = 37;
    const std::string what = "swiglu fp8 n=" + std::to_string(n) + " inner=" + std::to_string(inner) + " rule " +
                             std::to_string(int(rule));
    GuardedBuffer<uint16_t> gu(random_bf16(n * 2 * inner, 41 + uint64_t(inner), 2.0f)),
        dh(random_bf16(n * inner, 43 + uint64_t(inner), 1.0f));
    GuardedBuffer<uint16_t> h(n * inner), h_ref(n * inner), dgu(n * 2 * inner), dgu_ref(n * 2 * inner);
    GuardedBuffer<uint8_t> q(n * 2 * inner), q_ref(n * 2 * inner);
    GuardedBuffer<float> sc(n * 2 * inner / 128), sc_ref(n * 2 * inner / 128);
    cuda::swiglu_forward_fp8(gu.data(), h.data(), q.data(), sc.data(), n, inner, stream.get(), rule);
    cuda::swiglu_forward(gu.data(), h_ref.data(), n, inner, stream.get());
    cuda::fp8_quantize_blocks(h_ref.data(), n, inner, kFp8ActivationBlock, Fp8Format::kE4M3, q_ref.data(),
                              sc_ref.data(), nullptr, stream.get(), rule);
    stream.sync();
    expect_equal(h.download(), h_ref.download(), what + " h");
    const std::vector<uint8_t> qf = q.download(), qr = q_ref.download();
    const std::vector<float> sf = sc.download(), sr = sc_ref.download();
    expect_equal(std::vector<uint8_t>(qf.begin(), qf.begin() + n * inner),
                 std::vector<uint8_t>(qr.begin(), qr.begin() + n * inner), what + " h codes");
    expect_equal(std::vector<float>(sf.begin(), sf.begin() + n * inner / 128),
                 std::vector<float>(sr.begin(), sr.begin() + n * inner / 128), what + " h scales");
    cuda::swiglu_backward_fp8(gu.data(), dh.data(), dgu.data(), q.data(), sc.data(), n, inner, stream.get(), rule);
    cuda::swiglu_backward(gu.data(), dh.data(), dgu_ref.data(), n, inner, stream.get());
    cuda::fp8_quantize_blocks(dgu_ref.data(), n, 2 * inner, kFp8ActivationBlock, Fp8Format::kE4M3, q_ref.data(),
                              sc_ref.data(), nullptr, stream.get(), rule);
    stream.sync();
    expect_equal(dgu.download(), dgu_ref.download(), what + " dgate_up");
    expect_equal(q.download(), q_ref.download(), what + " dgate_up codes");
    expect_equal(sc.download(), sc_ref.download(), what + " dgate_up scales");
    q.expect_guards_intact(what + " q");
    sc.expect_guards_intact(what + " scales");
  }
  const std::string msg = error_of([&] {
    GuardedBuffer<uint16_t> b(64 * 2 * 96);
    GuardedBuffer<uint8_t> c(64 * 96);
    GuardedBuffer<float> s(64);
    cuda::swiglu_forward_fp8(b.data(), b.data(), c.data(), s.data(), 64, 96, stream.get());
  });
  EXPECT_NE(msg.find("cuda::swiglu_forward_fp8: expected n >= 0 and inner a multiple of 128"), std::string::npos)
      << msg;
}

}  // namespace
}  // namespace moe::testing

