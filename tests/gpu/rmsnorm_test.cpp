// cuda::rmsnorm_forward / rmsnorm_backward against cpu::rmsnorm_* in float on the same BF16
// inputs: y and dx under the BF16 row, rstd and dw under the FP32-reduction row; the backward
// twice from the same start must agree bitwise (dw's reduction order is fixed).
#include "cpu/rmsnorm.h"
#include "cuda/ops/rmsnorm.h"
#include "gpu/op_case_gpu.h"

namespace moe::testing {
namespace {

constexpr double kEps = 1e-5;

struct RmsShape {
  int64_t n, d;
  size_t misalign;  // bytes added to the BF16 device pointers
};

const std::vector<RmsShape> kShapes = {{0, 64, 0},    {1, 1, 0},       {1, 257, 0},  {3, 4099, 0},
                                       {33, 8, 0},    {5, 2048, 0},    {70, 128, 0}, {257, 259, 0},
                                       {40, 2048, 2}, {16384, 2048, 0}};

std::string shape_name(const RmsShape& s) {
  return param_name("n", s.n, "_d", s.d, s.misalign ? "_misaligned" : "");
}

// Rows of different scales (2^-3 .. 2^3), so rstd varies over two decades.
std::vector<uint16_t> scaled_rows(int64_t n, int64_t d, uint64_t seed) {
  auto x = random_bf16(n * d, seed);
  for (int64_t r = 0; r < n; ++r) {
    const float s = std::ldexp(1.0f, static_cast<int>(r % 7) - 3);
    for (int64_t j = 0; j < d; ++j) x[r * d + j] = f32_to_bf16(moe::bf16_to_f32(x[r * d + j]) * s);
  }
  return x;
}

OpCase<RmsShape> rmsnorm_forward_case() {
  OpCase<RmsShape> c{"rmsnorm", kShapes, shape_name};
  c.setup = [](const RmsShape& s, CaseIo& io) {
    io.input("x", scaled_rows(s.n, s.d, 21), s.misalign);
    io.input("w", random_bf16(s.d, 22, 0.2f, 1.0f), s.misalign);
    io.output<uint16_t>("y", s.n * s.d, kBF16Elementwise, s.misalign);
    io.output<float>("rstd", s.n, kFP32Reduction);
  };
  c.reference = [](const RmsShape& s, RefTensors<float>& t) {
    cpu::rmsnorm_forward(t.in("x"), t.in("w"), t.out("y"), t.out("rstd"), s.n, s.d, kEps);
  };
  c.device = [](const RmsShape& s, DeviceTensors& t, cuda::Stream stream) {
    cuda::rmsnorm_forward(t.bf16("x"), t.bf16("w"), t.bf16("y"), t.f32("rstd"), s.n, s.d, kEps, stream);
  };
  return c;
}

// Both sides get the reference forward's rstd; dw accumulates onto random values.
OpCase<RmsShape> rmsnorm_backward_case() {
  OpCase<RmsShape> c{"rmsnorm", kShapes, shape_name};
  c.setup = [](const RmsShape& s, CaseIo& io) {
    const auto x = scaled_rows(s.n, s.d, 31), w = random_bf16(s.d, 32, 0.2f, 1.0f);
    std::vector<float> y(static_cast<size_t>(s.n * s.d)), rstd(static_cast<size_t>(s.n));
    cpu::rmsnorm_forward(bf16_to_f32(x).data(), bf16_to_f32(w).data(), y.data(), rstd.data(), s.n, s.d, kEps);
    io.input("x", x, s.misalign);
    io.input("w", w, s.misalign);
    io.input("rstd", rstd);
    io.input("dy", random_bf16(s.n * s.d, 33), s.misalign);
    io.output<uint16_t>("dx", s.n * s.d, kBF16Elementwise, s.misalign);
    io.accumulate("dw", random_f32(s.d, 34), kFP32Reduction);
    io.workspace("workspace", cuda::rmsnorm_backward_workspace_bytes(s.n, s.d));
  };
  c.reference = [](const RmsShape& s, RefTensors<float>& t) {
    cpu::rmsnorm_backward(t.in("x"), t.in("w"), t.in("rstd"), t.in("dy"), t.out("dx"), t.out("dw"), s.n, s.d);
  };
  c.device = [](const RmsShape& s, DeviceTensors& t, cuda::Stream stream) {
    cuda::rmsnorm_backward(t.bf16("x"), t.bf16("w"), t.f32("rstd"), t.bf16("dy"), t.bf16("dx"), t.f32("dw"), s.n, s.d,
                           t.workspace("workspace"), t.workspace_bytes("workspace"), stream);
  };
  c.deterministic = true;
  return c;
}

MOE_GPU_OP_CASE_TESTS(RmsnormParity, Forward, rmsnorm_forward_case);
MOE_GPU_OP_CASE_TESTS(RmsnormParity, Backward, rmsnorm_backward_case);

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
