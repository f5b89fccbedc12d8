// cuda::rmsnorm_forward / rmsnorm_backward against cpu::rmsnorm_* in float on the same BF16
// inputs: y and dx under the BF16 row, rstd and dw under the FP32-reduction row; the backward
// twice from the same start must agree bitwise (dw's reduction order is fixed); widths whose rows
// the backward keeps in shared memory between its phases and one whose rows it reads again. The backward
// with the residual add in its pass, and the forward writing its output's FP8 codes, against the
// two ops each replaces.
#include "cpu/rmsnorm.h"
#include "cuda/ops/fp8.h"
#include "cuda/ops/memory.h"
#include "cuda/ops/rmsnorm.h"
#include "cuda/ops/rope.h"
#include "gpu/op_case_gpu.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

constexpr double kEps = 1e-5;

struct RmsShape {
  int64_t n, d;
  size_t misalign;  // bytes added to the BF16 device pointers
};

// d = 4096 and 6144: the backward keeps its rows in more than 48 KiB of shared memory; d = 6400:
// too wide for that, it reads them again (rmsnorm_backward_stage_bytes).
const std::vector<RmsShape> kShapes = {{0, 64, 0},    {1, 1, 0},       {1, 257, 0},   {3, 4099, 0},
                                       {33, 8, 0},    {5, 2048, 0},    {70, 128, 0},  {257, 259, 0},
                                       {40, 2048, 2}, {16384, 2048, 0}, {40, 4096, 0}, {37, 6144, 0},
                                       {37, 6400, 0}};

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

// cuda::rmsnorm_backward_add against cuda::rmsnorm_backward then cuda::residual_add from the same
// start: the FP32 residual gradient, its BF16 copy and dw bitwise (vector and scalar paths, with
// and without the BF16 copy). Its contract with the CPU is theirs (the parity cases above).
TEST(RmsnormBackwardAdd, IsTheBackwardThenTheResidualAddBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  for (const RmsShape& sh : {RmsShape{70, 2048, 0}, RmsShape{33, 8, 0}, RmsShape{37, 259, 0}, RmsShape{9, 6400, 0}}) {
    for (const bool with_bf16 : {true, false}) {
      const int64_t n = sh.n, d = sh.d;
      const std::string what = shape_name(sh) + (with_bf16 ? "" : "_no_bf16_copy");
      const auto x = scaled_rows(n, d, 11), dy = random_bf16(n * d, 12), w = random_bf16(d, 13, 0.5f, 1.0f);
      std::vector<float> rstd(static_cast<size_t>(n)), y(static_cast<size_t>(n * d));
      cpu::rmsnorm_forward(bf16_to_f32(x).data(), bf16_to_f32(w).data(), y.data(), rstd.data(), n, d, kEps);
      const auto acc0 = random_f32(n * d, 14), dw0 = random_f32(d, 15, 0.1f);
      GuardedBuffer<uint16_t> xb(x), dyb(dy), wb(w), dx(n * d), two_b(n * d), one_b(n * d);
      GuardedBuffer<float> rb(rstd), two_acc(acc0), one_acc(acc0), two_dw(dw0), one_dw(dw0);
      const size_t ws_bytes = cuda::rmsnorm_backward_workspace_bytes(n, d);
      GuardedBuffer<float> ws(int64_t(ws_bytes / sizeof(float)) + 1);
      MOE_CUDA_CHECK(cudaDeviceSynchronize());
      TestStream stream;
      cuda::rmsnorm_backward(xb.data(), wb.data(), rb.data(), dyb.data(), dx.data(), two_dw.data(), n, d, ws.data(),
                             ws_bytes, stream.get());
      cuda::residual_add(two_acc.data(), dx.data(), with_bf16 ? two_b.data() : nullptr, n * d, stream.get());
      cuda::rmsnorm_backward_add(xb.data(), wb.data(), rb.data(), dyb.data(), one_acc.data(),
                                 with_bf16 ? one_b.data() : nullptr, one_dw.data(), n, d, ws.data(), ws_bytes,
                                 stream.get());
      stream.sync();
      const auto a1 = one_acc.download(), a2 = two_acc.download();
      EXPECT_EQ(0, std::memcmp(a1.data(), a2.data(), a1.size() * sizeof(float))) << what << ": acc";
      EXPECT_NE(0, std::memcmp(a1.data(), acc0.data(), a1.size() * sizeof(float))) << what << ": nothing added";
      const auto w1 = one_dw.download(), w2 = two_dw.download();
      EXPECT_EQ(0, std::memcmp(w1.data(), w2.data(), w1.size() * sizeof(float))) << what << ": dw";
      EXPECT_EQ(one_b.download(), two_b.download()) << what << ": BF16 copy";
      one_acc.expect_guards_intact("acc");
      one_b.expect_guards_intact("acc_bf16");
    }
  }
}

// cuda::rmsnorm_forward_fp8 against cuda::rmsnorm_forward then cuda::fp8_quantize_blocks (1 x 128,
// E4M3) of its y, under each FP8 rule (the block recipe's and the two MX ones): y, rstd, codes and
// scales bitwise; shapes it refuses (d not a multiple of 128) named.
TEST(RmsnormForwardFp8, IsTheNormThenTheQuantiserBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  for (const Fp8Rule rule : {Fp8Rule::kBlocks, Fp8Rule::kMx, Fp8Rule::kMxNoSaturation})
  for (const RmsShape& sh : {RmsShape{70, 2048, 0}, RmsShape{9, 128, 0}, RmsShape{33, 384, 0}, RmsShape{1, 640, 0}}) {
    const int64_t n = sh.n, d = sh.d, nb = d / 128;
    const std::string what = shape_name(sh) + " rule " + std::to_string(int(rule));
    const auto x = scaled_rows(n, d, 21), w = random_bf16(d, 22, 0.5f, 1.0f);
    GuardedBuffer<uint16_t> xb(x), wb(w), y1(n * d), y2(n * d);
    GuardedBuffer<float> r1(n), r2(n), s1(n * nb), s2(n * nb);
    GuardedBuffer<uint8_t> q1(n * d), q2(n * d);
    TestStream stream;
    cuda::rmsnorm_forward(xb.data(), wb.data(), y2.data(), r2.data(), n, d, kEps, stream.get());
    cuda::fp8_quantize_blocks(y2.data(), n, d, kFp8ActivationBlock, Fp8Format::kE4M3, q2.data(), s2.data(), nullptr,
                              stream.get(), rule);
    ASSERT_TRUE(cuda::rmsnorm_forward_fp8_fuses(xb.data(), wb.data(), y1.data(), q1.data(), d)) << what;
    cuda::rmsnorm_forward_fp8(xb.data(), wb.data(), y1.data(), r1.data(), q1.data(), s1.data(), n, d, kEps,
                              stream.get(), rule);
    stream.sync();
    EXPECT_EQ(y1.download(), y2.download()) << what << ": y";
    const auto ra = r1.download(), rb = r2.download(), sa = s1.download(), sb = s2.download();
    EXPECT_EQ(0, std::memcmp(ra.data(), rb.data(), ra.size() * sizeof(float))) << what << ": rstd";
    EXPECT_EQ(0, std::memcmp(sa.data(), sb.data(), sa.size() * sizeof(float))) << what << ": scales";
    EXPECT_EQ(q1.download(), q2.download()) << what << ": codes";
    y1.expect_guards_intact(what + " y");
    q1.expect_guards_intact(what + " q");
    s1.expect_guards_intact(what + " scales");
  }
  GuardedBuffer<uint16_t> xb(4 * 200), wb(200), yb(4 * 200);
  GuardedBuffer<float> rb(4), sb(8);
  GuardedBuffer<uint8_t> qb(4 * 200);
  EXPECT_FALSE(cuda::rmsnorm_forward_fp8_fuses(xb.data(), wb.data(), yb.data(), qb.data(), 200));
  const std::string msg = error_of([&] {
    cuda::rmsnorm_forward_fp8(xb.data(), wb.data(), yb.data(), rb.data(), qb.data(), sb.data(), 4, 200, kEps, nullptr);
  });
  EXPECT_NE(msg.find("cuda::rmsnorm_forward_fp8: expected d a multiple of 128 (got 200)"), std::string::npos) << msg;
}

// cuda::rope_rmsnorm_backward against cuda::rope_backward (on a copy of dy) then
// cuda::rmsnorm_backward: dx and dw bitwise, dy unchanged; shapes it refuses (head_dim / 2 not a
// multiple of 8) named.
TEST(RopeRmsnormBackward, IsTheRotationThenTheNormBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  struct Case {
    int64_t batch, seq, heads, head_dim;
  };
  const double theta = 5e5;
  // The last case's rows (d = 6656) are too wide to be kept in shared memory between the phases; the
  // one before (d = 6016) is kept there, with its rotated dy (over 96 KiB of shared memory).
  for (const Case& k : {Case{3, 37, 16, 128}, Case{1, 9, 4, 64}, Case{2, 64, 2, 16}, Case{1, 5, 47, 128},
                        Case{1, 7, 52, 128}}) {
    const int64_t n = k.batch * k.seq, d = k.heads * k.head_dim;
    const std::string what = param_name("b", k.batch, "_s", k.seq, "_h", k.heads, "_hd", k.head_dim);
    const auto x = scaled_rows(n, d, 21), dy = random_bf16(n * d, 22), w = random_bf16(d, 23, 0.5f, 1.0f);
    std::vector<float> rstd(static_cast<size_t>(n)), y(static_cast<size_t>(n * d));
    cpu::rmsnorm_forward(bf16_to_f32(x).data(), bf16_to_f32(w).data(), y.data(), rstd.data(), n, d, kEps);
    const auto dw0 = random_f32(d, 24, 0.1f);
    GuardedBuffer<uint16_t> xb(x), wb(w), dyb(dy), dy_copy(dy), dx_two(n * d), dx_one(n * d);
    GuardedBuffer<float> rb(rstd), dw_two(dw0), dw_one(dw0);
    const size_t ws_bytes = cuda::rope_rmsnorm_backward_workspace_bytes(n, d, k.seq, k.head_dim);
    ASSERT_GE(ws_bytes, cuda::rmsnorm_backward_workspace_bytes(n, d));
    GuardedBuffer<float> ws(int64_t(ws_bytes / sizeof(float)) + 1);
    ASSERT_TRUE(cuda::rope_rmsnorm_backward_fuses(xb.data(), wb.data(), dyb.data(), dx_one.data(), k.heads, k.head_dim));
    TestStream stream;
    cuda::rope_backward(dy_copy.data(), k.batch, k.seq, k.heads, k.head_dim, theta, stream.get());
    cuda::rmsnorm_backward(xb.data(), wb.data(), rb.data(), dy_copy.data(), dx_two.data(), dw_two.data(), n, d,
                           ws.data(), ws_bytes, stream.get());
    cuda::rope_rmsnorm_backward(xb.data(), wb.data(), rb.data(), dyb.data(), dx_one.data(), dw_one.data(), k.batch,
                                k.seq, k.heads, k.head_dim, theta, ws.data(), ws_bytes, stream.get());
    stream.sync();
    EXPECT_EQ(dx_one.download(), dx_two.download()) << what << ": dx";
    const auto w1 = dw_one.download(), w2 = dw_two.download();
    EXPECT_EQ(0, std::memcmp(w1.data(), w2.data(), w1.size() * sizeof(float))) << what << ": dw";
    EXPECT_EQ(dyb.download(), dy) << what << ": dy changed";
    dx_one.expect_guards_intact("dx");
    ws.expect_guards_intact("workspace");
  }
  GuardedBuffer<uint16_t> bf(2 * 3 * 12);
  GuardedBuffer<float> f(64);
  EXPECT_FALSE(cuda::rope_rmsnorm_backward_fuses(bf.data(), bf.data(), bf.data(), bf.data(), 3, 12));
  try {
    cuda::rope_rmsnorm_backward(bf.data(), bf.data(), f.data(), bf.data(), bf.data(), f.data(), 1, 2, 3, 12, 1e4,
                                f.data(), 256, nullptr);
    ADD_FAILURE() << "expected moe::Error";
  } catch (const moe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim=12"), std::string::npos) << e.what();
  }
}

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
