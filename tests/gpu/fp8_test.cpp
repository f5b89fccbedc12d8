// cuda::fp8_quantize_blocks / fp8_dequantize_blocks / mx_quantize / mx_dequantize against their
// CPU twins (cpu/fp8.h): the same FP8 codes and scales bit for bit on FP32 and BF16 inputs, in
// both formats, for 1 x 128, 128 x 128 and MX 1 x 32 blocks with partial edge blocks; values over
// many binades (subnormal blocks, zero blocks, the largest magnitudes); the dequantised values
// equal the CPU's bitwise; non-finite inputs are counted, never trap.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "cpu/fp8.h"
#include "cuda/ops/fp8.h"
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

template <typename T>
void expect_equal(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0 && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " differ, first at " << first;
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

}  // namespace
}  // namespace moe::testing
