// The FP8 recipe's dense linears on the GPU (model/cuda_fp8_linear.h) against the CPU recipe
// (cpu::fp8_linear_forward / _dgrad, cpu/fp8.h): the strided 1 x 128 quantiser writes the dense
// quantiser's codes and scales bitwise into its columns of a wider operand and nothing else; the
// forward on a row block of a stacked weight and the data gradient over several gradients side
// by side along K (the attention projections' q/k/v) follow the CPU recipe on the same BF16 values
// within the FP8 GEMM bound plus the BF16 output's rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "cpu/fp8.h"
#include "cuda/ops/fp8.h"
#include "cuda/ops/gemm.h"
#include "gpu/gpu_test_util.h"
#include "model/cuda_block.h"
#include "model/cuda_fp8_linear.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

std::vector<float> values_of(const std::vector<uint16_t>& b) { return bf16_to_f32(b); }

// Rows [r0, r0 + rows) of a row-major [., cols] matrix.
std::vector<float> row_block(const std::vector<float>& w, int64_t cols, int64_t r0, int64_t rows) {
  return std::vector<float>(w.begin() + r0 * cols, w.begin() + (r0 + rows) * cols);
}

// |got - want| <= 2^-10 sum_p |a_ip b_jp| + 2^-8 |want| per element (the FP8 GEMM's bound on the
// unquantised operands, whose products the codes are within 2^-4 of, and the BF16 output).
void expect_within_fp8_bound(const std::vector<uint16_t>& got, const std::vector<float>& want,
                             const std::vector<double>& abs_sum, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, first = 0;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = ::moe::bf16_to_f32(got[i]), w = want[i];
    const double bound = std::ldexp(abs_sum[i], -10) + std::ldexp(std::fabs(w), -8) + 1e-30;
    worst = std::max(worst, std::fabs(g - w) / bound);
    if (!(std::fabs(g - w) <= bound) && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " elements outside the bound, first at " << first << " (got "
                     << ::moe::bf16_to_f32(got[first]) << ", want " << want[first] << ")";
  std::printf("%s: worst error %.3f of the bound\n", what.c_str(), worst);
}

TEST(Fp8Gpu, RowsQuantisedIntoAWiderOperandAreTheDenseQuantisation) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream stream;
  const int64_t n = 37, ld = 640;
  const std::vector<uint16_t> a16 = random_bf16(n * 256, 3, 0.5f), b16 = random_bf16(n * 384, 4, 3.0f);
  GuardedBuffer<uint16_t> a(a16), b(b16);
  GuardedBuffer<uint8_t> q(n * ld);
  GuardedBuffer<float> sa(n * 2), sb(n * 3);
  cuda::fp8_quantize_rows_into(a.data(), n, 256, ld, Fp8Format::kE4M3, q.data(), sa.data(), nullptr, stream.get());
  cuda::fp8_quantize_rows_into(b.data(), n, 384, ld, Fp8Format::kE4M3, q.data() + 256, sb.data(), nullptr,
                               stream.get());
  stream.sync();
  std::vector<uint8_t> qa(size_t(n * 256)), qb(size_t(n * 384));
  std::vector<float> sa_ref(size_t(n * 2)), sb_ref(size_t(n * 3));
  const std::vector<float> af = values_of(a16), bf = values_of(b16);
  cpu::fp8_quantize_blocks(af.data(), n, 256, kFp8ActivationBlock, Fp8Format::kE4M3, qa.data(), sa_ref.data());
  cpu::fp8_quantize_blocks(bf.data(), n, 384, kFp8ActivationBlock, Fp8Format::kE4M3, qb.data(), sb_ref.data());
  const std::vector<uint8_t> got = q.download();
  size_t bad = 0;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < ld; ++c) {
      const uint8_t g = got[size_t(r * ld + c)];
      const uint8_t want = c < 256 ? qa[size_t(r * 256 + c)] : c < 640 ? qb[size_t(r * 384 + c - 256)] : kUnwrittenByte;
      bad += g != want;
    }
  EXPECT_EQ(bad, 0u) << "codes of the two tensors side by side";
  EXPECT_EQ(sa.download(), sa_ref);
  EXPECT_EQ(sb.download(), sb_ref);
  q.expect_guards_intact("codes");
  // Columns the call does not own stay as they were: a 256-wide tensor into the middle.
  GuardedBuffer<uint8_t> mid(n * ld);
  cuda::fp8_quantize_rows_into(a.data(), n, 256, ld, Fp8Format::kE4M3, mid.data() + 128, sa.data(), nullptr,
                               stream.get());
  stream.sync();
  const std::vector<uint8_t> m = mid.download();
  bad = 0;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < ld; ++c) {
      const bool inside = c >= 128 && c < 384;
      bad += m[size_t(r * ld + c)] != (inside ? qa[size_t(r * 256 + c - 128)] : kUnwrittenByte);
    }
  EXPECT_EQ(bad, 0u) << "a tensor quantised into columns [128, 384)";
  EXPECT_THROW(cuda::fp8_quantize_rows_into(a.data(), n, 256, 200, Fp8Format::kE4M3, q.data(), sa.data(), nullptr,
                                            stream.get()),
               Error);  // ldq < cols
  EXPECT_THROW(cuda::fp8_quantize_rows_into(a.data(), n, 200, 256, Fp8Format::kE4M3, q.data(), sa.data(), nullptr,
                                            stream.get()),
               Error);  // cols not whole blocks
}

// W [Q + 2C, D] stacked as the attention's q/k/v weights (Q 256, C 128, D 384): the forward on
// each row block and the data gradient of [gq | gk | gv] in one GEMM.
TEST(Fp8Gpu, DenseLinearOnStackedWeightsFollowsTheCpuRecipe) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream stream;
  const int64_t n = 64, d = 384, q = 256, c = 128, rows = q + 2 * c;
  const std::vector<uint16_t> w16 = random_bf16(rows * d, 11, 0.05f), x16 = random_bf16(n * d, 12, 1.0f);
  const std::vector<uint16_t> gq16 = random_bf16(n * q, 13, 0.01f), gk16 = random_bf16(n * c, 14, 0.03f),
                              gv16 = random_bf16(n * c, 15, 0.002f);
  GuardedBuffer<uint16_t> w(w16), x(x16), gq(gq16), gk(gk16), gv(gv16);
  CudaBufferGrower grower(stream.get());
  CudaFp8Scratch sc;
  sc.reserve(n, rows, rows * d, grower);
  CudaFp8Weight wq;
  wq.reserve(rows, d, grower, "stacked weight codes");
  wq.quantize(w.data(), sc, stream.get());
  cuda::GemmHandle gemm;
  const std::vector<float> wf = values_of(w16), xf = values_of(x16);
  const cpu::Fp8Recipe recipe;

  fp8_quantize_operand(x.data(), n, d, sc, stream.get());
  const int64_t starts[3] = {0, q, q + c}, widths[3] = {q, c, c};
  for (int part = 0; part < 3; ++part) {
    const int64_t r0 = starts[part], m = widths[part];
    GuardedBuffer<uint16_t> y(n * m);
    fp8_linear(gemm, sc, wq, false, r0, n, m, d, y.data(), stream.get());
    stream.sync();
    const std::vector<float> wb = row_block(wf, d, r0, m);
    std::vector<float> want(size_t(n * m));
    cpu::fp8_linear_forward(xf.data(), wb.data(), n, m, d, recipe, want.data());
    std::vector<double> abs_sum(want.size(), 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < m; ++j)
        for (int64_t p = 0; p < d; ++p) abs_sum[size_t(i * m + j)] += std::fabs(double(xf[size_t(i * d + p)]) * wb[size_t(j * d + p)]);
    expect_within_fp8_bound(y.download(), want, abs_sum, "forward rows [" + std::to_string(r0) + ", " +
                                                             std::to_string(r0 + m) + ")");
    y.expect_guards_intact("forward output");
  }

  // dx = gq Wq + gk Wk + gv Wv through one GEMM over the three gradients' codes side by side.
  fp8_quantize_operand_part(gq.data(), n, q, rows, 0, sc, stream.get());
  fp8_quantize_operand_part(gk.data(), n, c, rows, q, sc, stream.get());
  fp8_quantize_operand_part(gv.data(), n, c, rows, q + c, sc, stream.get());
  GuardedBuffer<uint16_t> dx(n * d);
  fp8_linear(gemm, sc, wq, true, 0, n, d, rows, dx.data(), stream.get());
  stream.sync();
  std::vector<float> want(size_t(n * d), 0.0f);
  std::vector<double> abs_sum(want.size(), 0.0);
  const std::vector<float> gs[3] = {values_of(gq16), values_of(gk16), values_of(gv16)};
  for (int part = 0; part < 3; ++part) {
    const int64_t r0 = starts[part], m = widths[part];
    const std::vector<float> wb = row_block(wf, d, r0, m);
    std::vector<float> one(want.size());
    cpu::fp8_linear_dgrad(gs[part].data(), wb.data(), n, m, d, recipe, one.data());
    for (size_t i = 0; i < want.size(); ++i) want[i] += one[i];
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < d; ++j)
        for (int64_t p = 0; p < m; ++p)
          abs_sum[size_t(i * d + j)] += std::fabs(double(gs[part][size_t(i * m + p)]) * wb[size_t(p * d + j)]);
  }
  expect_within_fp8_bound(dx.download(), want, abs_sum, "data gradient over [gq | gk | gv]");
  dx.expect_guards_intact("data gradient output");
  EXPECT_THROW(fp8_linear(gemm, sc, wq, false, 64, n, 128, d, dx.data(), stream.get()), Error);  // r0 not a block
  EXPECT_THROW(fp8_linear(gemm, sc, wq, false, 384, n, 256, d, dx.data(), stream.get()), Error);  // past the rows
}

}  // namespace
}  // namespace moe::testing
