// MX scaling on Hopper (train.fp8_scaling = "mx" / "mx_no_saturation" on the GPU): the FP8 path's
// quantisers under the MX rules (core/fp8_types.h) against their CPU twin cpu::fp8_quantize_blocks
// with the rule (MX's 1 x 32 sub-blocks, re-blocked at each 1 x 128 or 128 x 128 block's largest
// sub-block scale): the row quantiser (FP32 and BF16 inputs, both formats), the row quantiser into
// a wider operand and the expert exchange's row payload, and the weights' two copies (w's rows and
// w's columns, each quantised along its own sub-blocks), bit for bit, on values whose sub-blocks
// lie up to 2^20 apart within a block (so that the re-blocking loses bits, and the largest
// elements of a sub-block saturate under the OCP rule). Shapes outside whole blocks are refused,
// naming the op.
#include <gtest/gtest.h>

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
#include "gpu/gpu_test_util.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

constexpr Fp8Rule kMxRules[] = {Fp8Rule::kMx, Fp8Rule::kMxNoSaturation};

std::string rule_name(Fp8Rule r) { return r == Fp8Rule::kMx ? "mx" : "mx_no_saturation"; }

// Values whose magnitude moves by sub-block: 32 consecutive elements of a row share a binade
// offset of 0 .. 20 (a different one per sub-block, row and column band), some sub-blocks zero,
// some with an element at 1.99 x their binade (amax / 2^e in [448, 512): it saturates under the
// OCP rule), rounded to BF16 when bf16 (so that BF16 and FP32 inputs are the same values).
std::vector<float> sub_block_values(int64_t rows, int64_t cols, uint64_t seed, bool bf16) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t sb = c / 32;
      const int shift = static_cast<int>((r * 5 + sb * 7 + (r / 32) * 3) % 21);
      float x = std::ldexp(dist(gen), -shift);
      if ((r + 3 * sb) % 17 == 4) x = 0.0f;
      if ((r + sb) % 5 == 1 && c % 32 == 7) x = std::ldexp(1.99f, -shift + 2);
      v[size_t(r * cols + c)] = bf16 ? ::moe::bf16_to_f32(::moe::f32_to_bf16(x)) : x;
    }
  return v;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& f) {
  std::vector<uint16_t> b(f.size());
  for (size_t i = 0; i < f.size(); ++i) b[i] = ::moe::f32_to_bf16(f[i]);
  return b;
}

TEST(Fp8MxRule, RowQuantisersMatchCpuBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream stream;
  for (const Fp8Rule rule : kMxRules) {
    for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 128}, {37, 384}, {130, 2048}}) {
        const std::string what = rule_name(rule) + (f == Fp8Format::kE4M3 ? " e4m3 " : " e5m2 ") +
                                 std::to_string(rows) + "x" + std::to_string(cols);
        const int64_t n = rows * cols, nb = rows * (cols / 128);
        for (const bool bf16 : {false, true}) {
          const std::vector<float> x = sub_block_values(rows, cols, 7 + uint64_t(cols), bf16);
          std::vector<uint8_t> q_ref(static_cast<size_t>(n)), q_blocks(static_cast<size_t>(n));
          std::vector<float> s_ref(static_cast<size_t>(nb)), s_blocks(static_cast<size_t>(nb));
          const int64_t changed =
              cpu::fp8_quantize_blocks(x.data(), rows, cols, kFp8ActivationBlock, f, rule, q_ref.data(), s_ref.data());
          if (f == Fp8Format::kE4M3 && rows > 1) {
            EXPECT_GT(changed, 0) << what << ": meant to lose bits re-blocking";
          }
          cpu::fp8_quantize_blocks(x.data(), rows, cols, kFp8ActivationBlock, f, q_blocks.data(), s_blocks.data());
          EXPECT_NE(s_ref, s_blocks) << what << ": the MX scales are powers of two, not amax / fp8_max";
          GuardedBuffer<uint8_t> q(n);
          GuardedBuffer<float> s(nb);
          GuardedBuffer<uint32_t> bad(std::vector<uint32_t>{0});
          if (bf16) {
            GuardedBuffer<uint16_t> dx(to_bf16(x));
            cuda::fp8_quantize_blocks(dx.data(), rows, cols, kFp8ActivationBlock, f, q.data(), s.data(), bad.data(),
                                      stream.get(), rule);
          } else {
            GuardedBuffer<float> dx(x);
            cuda::fp8_quantize_blocks(dx.data(), rows, cols, kFp8ActivationBlock, f, q.data(), s.data(), bad.data(),
                                      stream.get(), rule);
          }
          stream.sync();
          const std::string w = what + (bf16 ? " bf16" : " f32");
          expect_equal(q.download(), q_ref, w + " codes");
          expect_equal(s.download(), s_ref, w + " scales");
          EXPECT_EQ(bad.download()[0], 0u) << w;
          q.expect_guards_intact(w + " codes");
          s.expect_guards_intact(w + " scales");
        }
        // Into a wider operand (BF16), and as the exchange's payload rows: the same codes and scales.
        const std::vector<float> x = sub_block_values(rows, cols, 7 + uint64_t(cols), true);
        std::vector<uint8_t> q_ref(static_cast<size_t>(n));
        std::vector<float> s_ref(static_cast<size_t>(nb));
        cpu::fp8_quantize_blocks(x.data(), rows, cols, kFp8ActivationBlock, f, rule, q_ref.data(), s_ref.data());
        GuardedBuffer<uint16_t> dx(to_bf16(x));
        const int64_t ldq = cols + 256;
        GuardedBuffer<uint8_t> wide(std::vector<uint8_t>(size_t(rows * ldq), 0x5a));
        GuardedBuffer<float> ws(nb);
        cuda::fp8_quantize_rows_into(dx.data(), rows, cols, ldq, f, wide.data(), ws.data(), nullptr, stream.get(),
                                     rule);
        const int64_t per = cuda::fp8_row_payload_bytes(cols);
        GuardedBuffer<uint8_t> payload(rows * per);
        cuda::fp8_pack_rows(dx.data(), rows, cols, f, payload.data(), nullptr, stream.get(), 0, rule);
        stream.sync();
        const std::vector<uint8_t> wq = wide.download(), pl = payload.download();
        std::vector<uint8_t> wide_codes(static_cast<size_t>(n)), payload_codes(static_cast<size_t>(n));
        std::vector<float> payload_scales(static_cast<size_t>(nb));
        size_t untouched = 0;
        for (int64_t r = 0; r < rows; ++r) {
          std::memcpy(&wide_codes[size_t(r * cols)], &wq[size_t(r * ldq)], size_t(cols));
          for (int64_t c = cols; c < ldq; ++c) untouched += wq[size_t(r * ldq + c)] == 0x5a;
          std::memcpy(&payload_codes[size_t(r * cols)], &pl[size_t(r * per)], size_t(cols));
          std::memcpy(&payload_scales[size_t(r * (cols / 128))], &pl[size_t(r * per + cols)],
                      size_t(cols / 128) * sizeof(float));
        }
        expect_equal(wide_codes, q_ref, what + " rows into a wider operand: codes");
        expect_equal(ws.download(), s_ref, what + " rows into a wider operand: scales");
        EXPECT_EQ(untouched, size_t(rows * (ldq - cols))) << what << ": codes outside the columns written";
        expect_equal(payload_codes, q_ref, what + " payload codes");
        expect_equal(payload_scales, s_ref, what + " payload scales");
      }
    }
  }
}

TEST(Fp8MxRule, WeightCopiesFollowTheirOwnSubBlocksBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream stream;
  const int64_t e = 2, n = 256, k = 384, numel = e * n * k, ns = e * (n / 128) * (k / 128);
  for (const Fp8Rule rule : kMxRules) {
    for (const bool bf16 : {false, true}) {
      const std::string what = rule_name(rule) + (bf16 ? " bf16" : " f32");
      const std::vector<float> w = sub_block_values(e * n, k, 11, bf16);
      std::vector<uint8_t> q_ref(static_cast<size_t>(numel)), qt_ref(static_cast<size_t>(numel));
      std::vector<float> s_ref(static_cast<size_t>(ns)), st_ref(static_cast<size_t>(ns));
      cpu::fp8_quantize_weights(w.data(), e, n, k, Fp8Format::kE4M3, q_ref.data(), s_ref.data(), qt_ref.data(),
                                st_ref.data(), rule);
      // The column copy is not the row copy transposed (else this test could not tell them apart).
      size_t differ = 0;
      for (int64_t x = 0; x < e; ++x)
        for (int64_t r = 0; r < n; ++r)
          for (int64_t c = 0; c < k; ++c)
            differ += q_ref[size_t(x * n * k + r * k + c)] != qt_ref[size_t(x * n * k + c * n + r)];
      EXPECT_GT(differ, 0u) << what;
      GuardedBuffer<uint8_t> q(numel), qt(numel);
      GuardedBuffer<float> s(ns), st(ns);
      if (bf16) {
        GuardedBuffer<uint16_t> dw(to_bf16(w));
        cuda::fp8_quantize_weights(dw.data(), e, n, k, Fp8Format::kE4M3, q.data(), s.data(), qt.data(), st.data(),
                                   nullptr, stream.get(), rule);
      } else {
        GuardedBuffer<float> dw(w);
        cuda::fp8_quantize_weights(dw.data(), e, n, k, Fp8Format::kE4M3, q.data(), s.data(), qt.data(), st.data(),
                                   nullptr, stream.get(), rule);
      }
      stream.sync();
      expect_equal(q.download(), q_ref, what + " codes");
      expect_equal(s.download(), s_ref, what + " scales");
      expect_equal(qt.download(), qt_ref, what + " column copy");
      expect_equal(st.download(), st_ref, what + " column copy's scales");
      qt.expect_guards_intact(what + " qt");
      st.expect_guards_intact(what + " st");
    }
  }
}

TEST(Fp8MxRule, RefusesWhatIsNotWholeBlocks) {
  MOE_SKIP_WITHOUT_GPU();
  GuardedBuffer<float> x(4 * 200), s(16);
  GuardedBuffer<uint8_t> q(4 * 200);
  std::string msg = error_of([&] {
    cuda::fp8_quantize_blocks(x.data(), 4, 200, kFp8ActivationBlock, Fp8Format::kE4M3, q.data(), s.data(), nullptr,
                              nullptr, Fp8Rule::kMx);
  });
  EXPECT_NE(msg.find("cuda::fp8_quantize_blocks: the MX rules quantise whole 1 x 128 blocks"), std::string::npos)
      << msg;
  msg = error_of([&] {
    cuda::fp8_quantize_weights(x.data(), 1, 4, 200, Fp8Format::kE4M3, q.data(), s.data(), nullptr, nullptr, nullptr,
                               nullptr, Fp8Rule::kMx);
  });
  EXPECT_NE(msg.find("cuda::fp8_quantize_weights: the MX rules quantise whole 128 x 128 blocks"), std::string::npos)
      << msg;
}

}  // namespace
}  // namespace moe::testing
