// cuda::rmsnorm_forward / rmsnorm_backward against cpu::rmsnorm_* in float on the same BF16
// inputs: y and dx under the BF16 row, rstd and dw under the FP32-reduction row; dw twice from
// the same start must agree bitwise (the reduction order is fixed).
#include "cpu/rmsnorm.h"
#include "cuda/ops/rmsnorm.h"
#include "gpu/gpu_test_util.h"
#include "support/parity.h"

namespace moe::testing {
namespace {

constexpr double kEps = 1e-5;

struct RmsShape {
  int64_t n, d;
  size_t misalign;
};

class RmsnormParity : public ::testing::TestWithParam<RmsShape> {};

// Rows of different scales (2^-3 .. 2^3), so rstd varies over two decades.
std::vector<uint16_t> scaled_rows(int64_t n, int64_t d, uint64_t seed) {
  auto x = random_bf16(n * d, seed);
  for (int64_t r = 0; r < n; ++r) {
    const float s = std::ldexp(1.0f, static_cast<int>(r % 7) - 3);
    for (int64_t j = 0; j < d; ++j) x[r * d + j] = f32_to_bf16(moe::bf16_to_f32(x[r * d + j]) * s);
  }
  return x;
}

TEST_P(RmsnormParity, Forward) {
  MOE_SKIP_WITHOUT_GPU();
  const auto [n, d, misalign] = GetParam();
  const auto x = scaled_rows(n, d, 21);
  const auto w = random_bf16(d, 22, 0.2f, 1.0f);
  GuardedBuffer<uint16_t> d_x(x, misalign), d_w(w, misalign), d_y(n * d, misalign);
  GuardedBuffer<float> d_rstd(n);
  TestStream stream;
  cuda::rmsnorm_forward(d_x.data(), d_w.data(), d_y.data(), d_rstd.data(), n, d, kEps, stream.get());
  stream.sync();

  std::vector<float> y_ref(static_cast<size_t>(n * d)), rstd_ref(static_cast<size_t>(n));
  cpu::rmsnorm_forward(bf16_to_f32(x).data(), bf16_to_f32(w).data(), y_ref.data(), rstd_ref.data(), n, d, kEps);
  expect_parity("rmsnorm.y", bf16_to_f32(d_y.download()), y_ref, kBF16Elementwise);
  expect_parity("rmsnorm.rstd", d_rstd.download(), rstd_ref, kFP32Reduction);
  d_x.expect_guards_intact("x");
  d_w.expect_guards_intact("w");
  d_y.expect_guards_intact("y");
  d_rstd.expect_guards_intact("rstd");
}

TEST_P(RmsnormParity, Backward) {
  MOE_SKIP_WITHOUT_GPU();
  const auto [n, d, misalign] = GetParam();
  const auto x = scaled_rows(n, d, 31);
  const auto w = random_bf16(d, 32, 0.2f, 1.0f);
  const auto dy = random_bf16(n * d, 33);
  const auto dw0 = random_f32(d, 34);  // dw accumulates onto this
  const auto xf = bf16_to_f32(x), wf = bf16_to_f32(w), dyf = bf16_to_f32(dy);
  std::vector<float> y_ref(static_cast<size_t>(n * d)), rstd(static_cast<size_t>(n));
  cpu::rmsnorm_forward(xf.data(), wf.data(), y_ref.data(), rstd.data(), n, d, kEps);

  GuardedBuffer<uint16_t> d_x(x, misalign), d_w(w, misalign), d_dy(dy, misalign), d_dx(n * d, misalign);
  GuardedBuffer<float> d_rstd(rstd), d_dw(dw0);
  const size_t ws_bytes = cuda::rmsnorm_backward_workspace_bytes(n, d);
  GuardedBuffer<uint8_t> d_ws(static_cast<int64_t>(ws_bytes));
  TestStream stream;
  cuda::rmsnorm_backward(d_x.data(), d_w.data(), d_rstd.data(), d_dy.data(), d_dx.data(), d_dw.data(), n, d,
                         d_ws.data(), ws_bytes, stream.get());
  stream.sync();
  const auto dx_gpu = d_dx.download();
  const auto dw_gpu = d_dw.download();

  std::vector<float> dx_ref(static_cast<size_t>(n * d)), dw_ref = dw0;
  cpu::rmsnorm_backward(xf.data(), wf.data(), rstd.data(), dyf.data(), dx_ref.data(), dw_ref.data(), n, d);
  expect_parity("rmsnorm.dx", bf16_to_f32(dx_gpu), dx_ref, kBF16Elementwise);
  expect_parity("rmsnorm.dw", dw_gpu, dw_ref, kFP32Reduction);
  for (auto* b : {&d_x, &d_w, &d_dy, &d_dx}) b->expect_guards_intact("rmsnorm backward bf16 buffer");
  d_rstd.expect_guards_intact("rstd");
  d_dw.expect_guards_intact("dw");
  d_ws.expect_guards_intact("workspace");

  // Same inputs, same start: bitwise the same dx and dw.
  d_dw.upload(dw0);
  cuda::rmsnorm_backward(d_x.data(), d_w.data(), d_rstd.data(), d_dy.data(), d_dx.data(), d_dw.data(), n, d,
                         d_ws.data(), ws_bytes, stream.get());
  stream.sync();
  EXPECT_TRUE(bitwise_equal(d_dx.download(), dx_gpu)) << "dx differs between two identical runs";
  const auto dw_again = d_dw.download();
  EXPECT_EQ(std::memcmp(dw_again.data(), dw_gpu.data(), dw_gpu.size() * sizeof(float)), 0)
      << "dw differs between two identical runs";
}

INSTANTIATE_TEST_SUITE_P(Shapes, RmsnormParity,
                         ::testing::Values(RmsShape{1, 1, 0}, RmsShape{1, 257, 0}, RmsShape{3, 4099, 0},
                                           RmsShape{33, 8, 0}, RmsShape{5, 2048, 0}, RmsShape{16384, 2048, 0},
                                           RmsShape{70, 128, 0}, RmsShape{40, 2048, 2}),
                         [](const auto& info) {
                           return param_name("n", info.param.n, "_d", info.param.d,
                                             info.param.misalign ? "_misaligned" : "");
                         });

TEST(Rmsnorm, WorkspaceTooSmallIsRejected) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t n = 40, d = 64;
  GuardedBuffer<uint16_t> bf(n * d);
  GuardedBuffer<float> f(n * d);
  const size_t need = cuda::rmsnorm_backward_workspace_bytes(n, d);
  EXPECT_EQ(need, size_t{2} * d * sizeof(float));  // ceil(40 / 32) chunks
  try {
    cuda::rmsnorm_backward(bf.data(), bf.data(), f.data(), bf.data(), bf.data(), f.data(), n, d, f.data(), need - 4,
                           nullptr);
    ADD_FAILURE() << "expected moe::Error";
  } catch (const moe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("workspace"), std::string::npos) << e.what();
  }
}

TEST(Rmsnorm, ZeroRowsIsANoOp) {
  MOE_SKIP_WITHOUT_GPU();
  EXPECT_NO_THROW(cuda::rmsnorm_forward(nullptr, nullptr, nullptr, nullptr, 0, 64, kEps, nullptr));
  EXPECT_EQ(cuda::rmsnorm_backward_workspace_bytes(0, 64), 0u);
  EXPECT_NO_THROW(
      cuda::rmsnorm_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 64, nullptr, 0, nullptr));
}

}  // namespace
}  // namespace moe::testing
