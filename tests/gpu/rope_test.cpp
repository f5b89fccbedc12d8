// cuda::rope_forward / rope_backward against cpu::rope_* in float on the same BF16 inputs (the
// CPU forms angles, cos and sin in double; the GPU's cos/sin are within 3e-7 of those, so the
// BF16 row applies). Covers scalar-path widths (head_dim/2 not a multiple of 8) and a long sequence.
#include "cpu/rmsnorm.h"
#include "cpu/rope.h"
#include "cuda/ops/rmsnorm.h"
#include "cuda/ops/rope.h"
#include "gpu/op_case_gpu.h"

namespace moe::testing {
namespace {

struct RopeShape {
  int64_t batch, seq, heads, head_dim;
  double theta;
  size_t misalign;
};

const std::vector<RopeShape> kShapes = {
    {0, 3, 2, 64, 1e4, 0},      {1, 1, 1, 2, 1e4, 0},       {2, 17, 3, 6, 1e4, 0},
    {1, 5, 2, 130, 1e4, 0},     {2, 33, 4, 64, 1e4, 0},     {3, 7, 2, 256, 5e5, 0},
    {1, 4096, 16, 128, 1e4, 0}, {1, 16384, 2, 128, 5e5, 0}, {2, 9, 3, 128, 1e4, 2}};

std::string shape_name(const RopeShape& p) {
  return param_name("b", p.batch, "_s", p.seq, "_h", p.heads, "_hd", p.head_dim, "_theta",
                    static_cast<int64_t>(p.theta), p.misalign ? "_misaligned" : "");
}

// x rotated in place: the forward's result is y, the backward's dx.
OpCase<RopeShape> rope_case(bool backward) {
  OpCase<RopeShape> c{"rope", kShapes, shape_name};
  const char* name = backward ? "dx" : "y";
  const auto cpu_op = backward ? cpu::rope_backward<float> : cpu::rope_forward<float>;
  const auto cuda_op = backward ? cuda::rope_backward : cuda::rope_forward;
  c.setup = [=](const RopeShape& p, CaseIo& io) {
    const int64_t n = p.batch * p.seq * p.heads * p.head_dim;
    io.in_place(name, random_bf16(n, backward ? 42 : 41), kBF16Elementwise, p.misalign);
  };
  c.reference = [=](const RopeShape& p, RefTensors<float>& t) {
    cpu_op(t.out(name), p.batch, p.seq, p.heads, p.head_dim, p.theta);
  };
  c.device = [=](const RopeShape& p, DeviceTensors& t, cuda::Stream stream) {
    cuda_op(t.bf16(name), p.batch, p.seq, p.heads, p.head_dim, p.theta, stream);
  };
  return c;
}

OpCase<RopeShape> rope_forward_case() { return rope_case(false); }
OpCase<RopeShape> rope_backward_case() { return rope_case(true); }

MOE_GPU_OP_CASE_TESTS(RopeParity, Forward, rope_forward_case);
MOE_GPU_OP_CASE_TESTS(RopeParity, Backward, rope_backward_case);

// Forward then backward is the identity up to two BF16 roundings (kBF16x2Pairs).
TEST(Rope, BackwardUndoesForward) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t b = 2, s = 300, h = 4, hd = 64;
  const auto x = random_bf16(b * s * h * hd, 43);
  GuardedBuffer<uint16_t> d_x(x);
  TestStream stream;
  cuda::rope_forward(d_x.data(), b, s, h, hd, 1e4, stream.get());
  cuda::rope_backward(d_x.data(), b, s, h, hd, 1e4, stream.get());
  stream.sync();
  expect_parity("rope.roundtrip", bf16_to_f32(d_x.download()), bf16_to_f32(x), kBF16x2Pairs);
}

// cuda::rmsnorm_rope_forward against cuda::rmsnorm_forward then cuda::rope_forward (or
// rope_forward_at at a position offset) from the same inputs: y and rstd bitwise, on the fused
// path (head_dim / 2 a multiple of 8; batches that fill a block's four warps, leave some idle, or
// take three blocks of a position) and the fallback (head_dim 12); the fused y also against the
// CPU twins (cpu::rmsnorm_forward then cpu::rope_forward) within a BF16 rounding of each.
TEST(RmsnormRope, IsTheNormThenTheRotationBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  struct Case {
    int64_t batch, seq, pos0, heads, head_dim;
  };
  for (const Case& k : {Case{3, 37, 0, 16, 128}, Case{1, 9, 21, 4, 64}, Case{2, 5, 0, 3, 12}, Case{4, 64, 0, 2, 16},
                       Case{9, 7, 0, 2, 16}}) {
    const int64_t n = k.batch * k.seq, d = k.heads * k.head_dim;
    const std::string what = param_name("b", k.batch, "_s", k.seq, "_pos", k.pos0, "_h", k.heads, "_hd", k.head_dim);
    const double eps = 1e-6, theta = 5e5;
    auto x = random_bf16(n * d, 71, 3.0f);
    const auto w = random_bf16(d, 72, 0.3f, 1.0f);
    GuardedBuffer<uint16_t> xb(x), wb(w), y_two(n * d), y_one(n * d);
    GuardedBuffer<float> r_two(n), r_one(n);
    TestStream stream;
    cuda::rmsnorm_forward(xb.data(), wb.data(), y_two.data(), r_two.data(), n, d, eps, stream.get());
    if (k.pos0 == 0) {
      cuda::rope_forward(y_two.data(), k.batch, k.seq, k.heads, k.head_dim, theta, stream.get());
    } else {
      cuda::rope_forward_at(y_two.data(), k.seq, k.pos0, k.heads, k.head_dim, theta, stream.get());
    }
    cuda::rmsnorm_rope_forward(xb.data(), wb.data(), y_one.data(), r_one.data(), k.batch, k.seq, k.pos0, k.heads,
                               k.head_dim, eps, theta, stream.get());
    stream.sync();
    const auto y1 = y_one.download(), y2 = y_two.download();
    EXPECT_EQ(y1, y2) << what << ": y";
    const auto r1 = r_one.download(), r2 = r_two.download();
    EXPECT_EQ(0, std::memcmp(r1.data(), r2.data(), r1.size() * sizeof(float))) << what << ": rstd";
    y_one.expect_guards_intact("y");
    // The CPU twins on the same BF16 values.
    std::vector<float> yc(static_cast<size_t>(n * d)), rc(static_cast<size_t>(n));
    cpu::rmsnorm_forward(bf16_to_f32(x).data(), bf16_to_f32(w).data(), yc.data(), rc.data(), n, d, eps);
    for (float& v : yc) v = moe::bf16_to_f32(f32_to_bf16(v));
    if (k.pos0 == 0) {
      cpu::rope_forward(yc.data(), k.batch, k.seq, k.heads, k.head_dim, theta);
    } else {
      cpu::rope_forward_at(yc.data(), k.seq, k.pos0, k.heads, k.head_dim, theta);
    }
    expect_parity("rmsnorm_rope." + what, bf16_to_f32(y1), yc, kBF16x2Pairs);
  }
}

TEST(Rope, RejectsOddHeadDim) {
  MOE_SKIP_WITHOUT_GPU();
  GuardedBuffer<uint16_t> d_x(2 * 3 * 5);
  EXPECT_THROW(cuda::rope_forward(d_x.data(), 1, 2, 3, 5, 1e4, nullptr), moe::Error);
  EXPECT_NO_THROW(cuda::rope_forward(nullptr, 0, 2, 3, 4, 1e4, nullptr));  // empty batch: no-op
}

}  // namespace
}  // namespace moe::testing
