// cuda::rope_forward / rope_backward against cpu::rope_* in float on the same BF16 inputs (the
// CPU forms angles, cos and sin in double; the GPU's cos/sin are within 3e-7 of those, so the
// BF16 row applies). Covers scalar-path widths (head_dim/2 not a multiple of 8) and a long sequence.
#include "cpu/rope.h"
#include "cuda/ops/rope.h"
#include "gpu/gpu_test_util.h"
#include "support/parity.h"

namespace moe::testing {
namespace {

struct RopeShape {
  int64_t batch, seq, heads, head_dim;
  double theta;
  size_t misalign;
};

class RopeParity : public ::testing::TestWithParam<RopeShape> {};

void run_rope_case(const RopeShape& p, bool backward) {
  const int64_t n = p.batch * p.seq * p.heads * p.head_dim;
  const auto x = random_bf16(n, backward ? 42 : 41);
  GuardedBuffer<uint16_t> d_x(x, p.misalign);
  TestStream stream;
  if (backward) {
    cuda::rope_backward(d_x.data(), p.batch, p.seq, p.heads, p.head_dim, p.theta, stream.get());
  } else {
    cuda::rope_forward(d_x.data(), p.batch, p.seq, p.heads, p.head_dim, p.theta, stream.get());
  }
  stream.sync();
  auto ref = bf16_to_f32(x);
  if (backward) {
    cpu::rope_backward(ref.data(), p.batch, p.seq, p.heads, p.head_dim, p.theta);
  } else {
    cpu::rope_forward(ref.data(), p.batch, p.seq, p.heads, p.head_dim, p.theta);
  }
  expect_parity(backward ? "rope.dx" : "rope.y", bf16_to_f32(d_x.download()), ref, kBF16Elementwise);
  d_x.expect_guards_intact("x");
}

TEST_P(RopeParity, Forward) {
  MOE_SKIP_WITHOUT_GPU();
  run_rope_case(GetParam(), false);
}

TEST_P(RopeParity, Backward) {
  MOE_SKIP_WITHOUT_GPU();
  run_rope_case(GetParam(), true);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RopeParity,
    ::testing::Values(RopeShape{1, 1, 1, 2, 1e4, 0}, RopeShape{2, 17, 3, 6, 1e4, 0}, RopeShape{1, 5, 2, 130, 1e4, 0},
                      RopeShape{2, 33, 4, 64, 1e4, 0}, RopeShape{3, 7, 2, 256, 5e5, 0},
                      RopeShape{1, 4096, 16, 128, 1e4, 0}, RopeShape{1, 16384, 2, 128, 5e5, 0},
                      RopeShape{2, 9, 3, 128, 1e4, 2}),
    [](const auto& info) {
      const auto& p = info.param;
      return param_name("b", p.batch, "_s", p.seq, "_h", p.heads, "_hd", p.head_dim, "_theta",
                        static_cast<int64_t>(p.theta), p.misalign ? "_misaligned" : "");
    });

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

TEST(Rope, RejectsOddHeadDim) {
  MOE_SKIP_WITHOUT_GPU();
  GuardedBuffer<uint16_t> d_x(2 * 3 * 5);
  EXPECT_THROW(cuda::rope_forward(d_x.data(), 1, 2, 3, 5, 1e4, nullptr), moe::Error);
  EXPECT_NO_THROW(cuda::rope_forward(nullptr, 0, 2, 3, 4, 1e4, nullptr));  // empty batch: no-op
}

}  // namespace
}  // namespace moe::testing
