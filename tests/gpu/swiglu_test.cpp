// cuda::swiglu_forward / swiglu_backward against cpu::swiglu_* in float on the same BF16 inputs.
#include "cpu/swiglu.h"
#include "cuda/ops/swiglu.h"
#include "gpu/op_case_gpu.h"

namespace moe::testing {
namespace {

struct SwigluShape {
  int64_t n, inner;
  size_t misalign;  // bytes added to every device pointer (2: forces the scalar path)
};

const std::vector<SwigluShape> kShapes = {{0, 128, 0},   {1, 1, 0},      {1, 8, 0},       {3, 257, 0},
                                          {7, 4099, 0},  {64, 2048, 0},  {16384, 1024, 0}, {33, 1024, 2}};

std::string shape_name(const SwigluShape& s) {
  return param_name("n", s.n, "_inner", s.inner, s.misalign ? "_misaligned" : "");
}

// Gate values N(0, 2) plus a few far in the tails, where sigmoid saturates.
std::vector<uint16_t> gate_up_input(int64_t n, int64_t inner, uint64_t seed) {
  auto gu = random_bf16(n * 2 * inner, seed, 2.0f);
  for (int64_t i = 0; i < static_cast<int64_t>(gu.size()); i += 97) gu[i] = f32_to_bf16(i % 2 ? 90.0f : -90.0f);
  return gu;
}

OpCase<SwigluShape> swiglu_forward_case() {
  OpCase<SwigluShape> c{"swiglu", kShapes, shape_name};
  c.setup = [](const SwigluShape& s, CaseIo& io) {
    io.input("gate_up", gate_up_input(s.n, s.inner, 11), s.misalign);
    io.output<uint16_t>("h", s.n * s.inner, kBF16Elementwise, s.misalign);
  };
  c.reference = [](const SwigluShape& s, RefTensors<float>& t) {
    cpu::swiglu_forward(t.in("gate_up"), t.out("h"), s.n, s.inner);
  };
  c.device = [](const SwigluShape& s, DeviceTensors& t, cuda::Stream stream) {
    cuda::swiglu_forward(t.bf16("gate_up"), t.bf16("h"), s.n, s.inner, stream);
  };
  return c;
}

OpCase<SwigluShape> swiglu_backward_case() {
  OpCase<SwigluShape> c{"swiglu", kShapes, shape_name};
  c.setup = [](const SwigluShape& s, CaseIo& io) {
    io.input("gate_up", gate_up_input(s.n, s.inner, 12), s.misalign);
    io.input("dh", random_bf16(s.n * s.inner, 13), s.misalign);
    io.output<uint16_t>("dgate_up", s.n * 2 * s.inner, kBF16Elementwise, s.misalign);
  };
  c.reference = [](const SwigluShape& s, RefTensors<float>& t) {
    cpu::swiglu_backward(t.in("gate_up"), t.in("dh"), t.out("dgate_up"), s.n, s.inner);
  };
  c.device = [](const SwigluShape& s, DeviceTensors& t, cuda::Stream stream) {
    cuda::swiglu_backward(t.bf16("gate_up"), t.bf16("dh"), t.bf16("dgate_up"), s.n, s.inner, stream);
  };
  return c;
}

MOE_GPU_OP_CASE_TESTS(SwigluParity, Forward, swiglu_forward_case);
MOE_GPU_OP_CASE_TESTS(SwigluParity, Backward, swiglu_backward_case);

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
