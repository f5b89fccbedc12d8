// cuda::swiglu_forward / swiglu_backward against cpu::swiglu_* in float on the same BF16 inputs.
#include "cpu/swiglu.h"
#include "cuda/ops/swiglu.h"
#include "gpu/gpu_test_util.h"
#include "support/parity.h"

namespace moe::testing {
namespace {

struct SwigluShape {
  int64_t n, inner;
  size_t misalign;  // bytes added to every device pointer (2: forces the scalar path)
};

class SwigluParity : public ::testing::TestWithParam<SwigluShape> {};

// Gate values N(0, 2) plus a few far in the tails, where sigmoid saturates.
std::vector<uint16_t> gate_up_input(int64_t n, int64_t inner, uint64_t seed) {
  auto gu = random_bf16(n * 2 * inner, seed, 2.0f);
  for (int64_t i = 0; i < static_cast<int64_t>(gu.size()); i += 97) gu[i] = f32_to_bf16(i % 2 ? 90.0f : -90.0f);
  return gu;
}

TEST_P(SwigluParity, Forward) {
  MOE_SKIP_WITHOUT_GPU();
  const auto [n, inner, misalign] = GetParam();
  const auto gu = gate_up_input(n, inner, 11);
  GuardedBuffer<uint16_t> d_gu(gu, misalign), d_h(n * inner, misalign);
  TestStream stream;
  cuda::swiglu_forward(d_gu.data(), d_h.data(), n, inner, stream.get());
  stream.sync();

  std::vector<float> ref(static_cast<size_t>(n * inner));
  cpu::swiglu_forward(bf16_to_f32(gu).data(), ref.data(), n, inner);
  expect_parity("swiglu.h", bf16_to_f32(d_h.download()), ref, kBF16Elementwise);
  EXPECT_TRUE(bitwise_equal(d_gu.download(), gu)) << "gate_up was modified";
  d_gu.expect_guards_intact("gate_up");
  d_h.expect_guards_intact("h");
}

TEST_P(SwigluParity, Backward) {
  MOE_SKIP_WITHOUT_GPU();
  const auto [n, inner, misalign] = GetParam();
  const auto gu = gate_up_input(n, inner, 12);
  const auto dh = random_bf16(n * inner, 13);
  GuardedBuffer<uint16_t> d_gu(gu, misalign), d_dh(dh, misalign), d_dgu(n * 2 * inner, misalign);
  TestStream stream;
  cuda::swiglu_backward(d_gu.data(), d_dh.data(), d_dgu.data(), n, inner, stream.get());
  stream.sync();

  std::vector<float> ref(static_cast<size_t>(n * 2 * inner));
  cpu::swiglu_backward(bf16_to_f32(gu).data(), bf16_to_f32(dh).data(), ref.data(), n, inner);
  expect_parity("swiglu.dgate_up", bf16_to_f32(d_dgu.download()), ref, kBF16Elementwise);
  d_gu.expect_guards_intact("gate_up");
  d_dh.expect_guards_intact("dh");
  d_dgu.expect_guards_intact("dgate_up");
}

INSTANTIATE_TEST_SUITE_P(Shapes, SwigluParity,
                         ::testing::Values(SwigluShape{1, 1, 0}, SwigluShape{1, 8, 0}, SwigluShape{3, 257, 0},
                                           SwigluShape{7, 4099, 0}, SwigluShape{64, 2048, 0},
                                           SwigluShape{16384, 1024, 0}, SwigluShape{33, 1024, 2}),
                         [](const auto& info) {
                           return param_name("n", info.param.n, "_inner", info.param.inner,
                                             info.param.misalign ? "_misaligned" : "");
                         });

TEST(Swiglu, ZeroRowsIsANoOp) {
  MOE_SKIP_WITHOUT_GPU();
  EXPECT_NO_THROW(cuda::swiglu_forward(nullptr, nullptr, 0, 128, nullptr));
  EXPECT_NO_THROW(cuda::swiglu_backward(nullptr, nullptr, nullptr, 0, 128, nullptr));
}

TEST(Swiglu, RejectsNullAndNegativeSizes) {
  MOE_SKIP_WITHOUT_GPU();
  GuardedBuffer<uint16_t> buf(16);
  EXPECT_THROW(cuda::swiglu_forward(buf.data(), nullptr, 2, 4, nullptr), moe::Error);
  EXPECT_THROW(cuda::swiglu_forward(buf.data(), buf.data(), -1, 4, nullptr), moe::Error);
}

}  // namespace
}  // namespace moe::testing
