// cuda::embedding_forward / embedding_backward against cpu::embedding_*: forward rows are
// copies (exact); backward sums each id's rows in position order onto dw, the CPU loop's own
// order, so dw must match bitwise. Bad ids: zero rows / skipped, counted on the device.
#include <limits>

#include "cpu/embedding.h"
#include "cuda/ops/embedding.h"
#include "gpu/op_case_gpu.h"

namespace moe::testing {
namespace {

struct EmbShape {
  int64_t n, vocab, d;
  size_t misalign;  // bytes added to the BF16 device pointers
};

const std::vector<EmbShape> kShapes = {{0, 7, 64, 0},         {1, 1, 1, 0},           {5, 7, 257, 0},
                                       {64, 1000, 2048, 0},   {300, 50, 4099, 0},     {16384, 50304, 512, 0},
                                       {16384, 1000, 2048, 0}, {100, 300, 2048, 2}};

std::string shape_name(const EmbShape& p) {
  return param_name("n", p.n, "_v", p.vocab, "_d", p.d, p.misalign ? "_misaligned" : "");
}

// Half the positions take one frequent id (a long segment), the rest are uniform.
std::vector<int32_t> skewed_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int64_t> any(0, vocab - 1);
  const int32_t frequent = static_cast<int32_t>(any(gen));
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = (gen() % 2) ? frequent : static_cast<int32_t>(any(gen));
  return ids;
}

uint32_t read_counter(const GuardedBuffer<uint32_t>& c) { return c.download()[0]; }

// Valid ids only: the bad-id counter must stay 0 (the reference leaves it at its start).
OpCase<EmbShape> embedding_forward_case() {
  OpCase<EmbShape> c{"embedding", kShapes, shape_name};
  c.setup = [](const EmbShape& p, CaseIo& io) {
    io.input("ids", skewed_ids(p.n, p.vocab, 51));
    io.input("w", random_bf16(p.vocab * p.d, 52), p.misalign);
    io.output<uint16_t>("out", p.n * p.d, kExact, p.misalign);
    io.accumulate("num_bad_ids", std::vector<uint32_t>{0}, kExact);
  };
  c.reference = [](const EmbShape& p, RefTensors<float>& t) {
    cpu::embedding_forward(t.in<int32_t>("ids"), t.in("w"), t.out("out"), p.n, p.vocab, p.d);
  };
  c.device = [](const EmbShape& p, DeviceTensors& t, cuda::Stream stream) {
    cuda::embedding_forward(t.i32("ids"), t.bf16("w"), t.bf16("out"), p.n, p.vocab, p.d, t.u32("num_bad_ids"),
                            stream);
  };
  return c;
}

OpCase<EmbShape> embedding_backward_case() {
  OpCase<EmbShape> c{"embedding", kShapes, shape_name};
  c.setup = [](const EmbShape& p, CaseIo& io) {
    io.input("ids", skewed_ids(p.n, p.vocab, 61));
    io.input("dout", random_bf16(p.n * p.d, 62), p.misalign);
    io.accumulate("dw", random_f32(p.vocab * p.d, 63), kExact);
    io.accumulate("num_bad_ids", std::vector<uint32_t>{0}, kExact);
    io.workspace("workspace", cuda::embedding_backward_workspace_bytes(p.n, p.vocab));
  };
  c.reference = [](const EmbShape& p, RefTensors<float>& t) {
    cpu::embedding_backward(t.in<int32_t>("ids"), t.in("dout"), t.out("dw"), p.n, p.vocab, p.d);
  };
  c.device = [](const EmbShape& p, DeviceTensors& t, cuda::Stream stream) {
    cuda::embedding_backward(t.i32("ids"), t.bf16("dout"), t.f32("dw"), p.n, p.vocab, p.d, t.u32("num_bad_ids"),
                             t.workspace("workspace"), t.workspace_bytes("workspace"), stream);
  };
  return c;
}

MOE_GPU_OP_CASE_TESTS(EmbeddingParity, Forward, embedding_forward_case);
MOE_GPU_OP_CASE_TESTS(EmbeddingParity, Backward, embedding_backward_case);

// Bad ids: -1, vocab, INT32_MIN, INT32_MAX. Forward writes zero rows and counts; backward skips
// them and counts; the counter accumulates across calls.
TEST(Embedding, BadIdsAreContainedAndCounted) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t vocab = 10, d = 24, n = 9;
  const std::vector<int32_t> ids = {3, -1, 9, 10, std::numeric_limits<int32_t>::min(), 3,
                                    std::numeric_limits<int32_t>::max(), 0, 3};
  const auto w = random_bf16(vocab * d, 71);
  const auto dout = random_bf16(n * d, 72);
  const auto dw0 = random_f32(vocab * d, 73);
  GuardedBuffer<int32_t> d_ids(ids);
  GuardedBuffer<uint16_t> d_w(w), d_out(n * d), d_dout(dout);
  GuardedBuffer<float> d_dw(dw0);
  GuardedBuffer<uint32_t> d_bad(std::vector<uint32_t>{5});
  const size_t ws_bytes = cuda::embedding_backward_workspace_bytes(n, vocab);
  GuardedBuffer<uint8_t> d_ws(static_cast<int64_t>(ws_bytes));
  TestStream stream;

  cuda::embedding_forward(d_ids.data(), d_w.data(), d_out.data(), n, vocab, d, d_bad.data(), stream.get());
  stream.sync();
  EXPECT_EQ(read_counter(d_bad), 5u + 4u);
  std::vector<int32_t> good_ids;
  std::vector<float> good_dout, ref_out(static_cast<size_t>(n * d), 0.0f);
  const auto wf = bf16_to_f32(w), doutf = bf16_to_f32(dout);
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) continue;
    std::copy(wf.begin() + ids[i] * d, wf.begin() + (ids[i] + 1) * d, ref_out.begin() + i * d);
    good_ids.push_back(ids[i]);
    good_dout.insert(good_dout.end(), doutf.begin() + i * d, doutf.begin() + (i + 1) * d);
  }
  expect_parity("embedding.out_bad_ids", bf16_to_f32(d_out.download()), ref_out, kExact);

  cuda::embedding_backward(d_ids.data(), d_dout.data(), d_dw.data(), n, vocab, d, d_bad.data(), d_ws.data(), ws_bytes,
                           stream.get());
  stream.sync();
  EXPECT_EQ(read_counter(d_bad), 5u + 8u);
  std::vector<float> ref_dw = dw0;
  cpu::embedding_backward(good_ids.data(), good_dout.data(), ref_dw.data(), static_cast<int64_t>(good_ids.size()),
                          vocab, d);
  expect_parity("embedding.dw_bad_ids", d_dw.download(), ref_dw, kExact);
  d_out.expect_guards_intact("out");
  d_dw.expect_guards_intact("dw");
}

// Every position the same id: one segment of n rows.
TEST(Embedding, BackwardAllOneId) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t n = 4096, vocab = 50304, d = 256;
  const std::vector<int32_t> ids(static_cast<size_t>(n), 50303);
  const auto dout = random_bf16(n * d, 81);
  std::vector<float> dw0(static_cast<size_t>(vocab * d), 0.0f);
  GuardedBuffer<int32_t> d_ids(ids);
  GuardedBuffer<uint16_t> d_dout(dout);
  GuardedBuffer<float> d_dw(dw0);
  GuardedBuffer<uint32_t> d_bad(std::vector<uint32_t>{0});
  const size_t ws_bytes = cuda::embedding_backward_workspace_bytes(n, vocab);
  GuardedBuffer<uint8_t> d_ws(static_cast<int64_t>(ws_bytes));
  TestStream stream;
  cuda::embedding_backward(d_ids.data(), d_dout.data(), d_dw.data(), n, vocab, d, d_bad.data(), d_ws.data(), ws_bytes,
                           stream.get());
  stream.sync();
  std::vector<float> ref = dw0;
  cpu::embedding_backward(ids.data(), bf16_to_f32(dout).data(), ref.data(), n, vocab, d);
  expect_parity("embedding.dw_one_id", d_dw.download(), ref, kExact);
}

TEST(Embedding, WorkspaceTooSmallIsRejected) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t n = 8, vocab = 16, d = 8;
  GuardedBuffer<int32_t> d_ids(std::vector<int32_t>(n, 1));
  GuardedBuffer<uint16_t> d_dout(n * d);
  GuardedBuffer<float> d_dw(vocab * d);
  GuardedBuffer<uint32_t> d_bad(1);
  const size_t ws_bytes = cuda::embedding_backward_workspace_bytes(n, vocab);
  GuardedBuffer<uint8_t> d_ws(static_cast<int64_t>(ws_bytes));
  EXPECT_THROW(cuda::embedding_backward(d_ids.data(), d_dout.data(), d_dw.data(), n, vocab, d, d_bad.data(),
                                        d_ws.data(), ws_bytes - 1, nullptr),
               moe::Error);
  EXPECT_THROW(cuda::embedding_forward(d_ids.data(), d_dout.data(), d_dout.data(), n, vocab, d, nullptr, nullptr),
               moe::Error);  // the bad-id counter is required
}

}  // namespace
}  // namespace moe::testing
