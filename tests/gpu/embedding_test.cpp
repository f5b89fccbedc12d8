// cuda::embedding_forward / embedding_backward against cpu::embedding_*: forward rows are
// copies (exact); backward sums each id's rows in position order onto dw, the CPU loop's own
// order, so dw must match bitwise. Bad ids: zero rows / skipped, counted on the device.
#include <limits>

#include "cpu/embedding.h"
#include "cuda/ops/embedding.h"
#include "gpu/gpu_test_util.h"
#include "support/parity.h"

namespace moe::testing {
namespace {

struct EmbShape {
  int64_t n, vocab, d;
  size_t misalign;
};

class EmbeddingParity : public ::testing::TestWithParam<EmbShape> {};

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

TEST_P(EmbeddingParity, Forward) {
  MOE_SKIP_WITHOUT_GPU();
  const auto [n, vocab, d, misalign] = GetParam();
  const auto ids = skewed_ids(n, vocab, 51);
  const auto w = random_bf16(vocab * d, 52);
  GuardedBuffer<int32_t> d_ids(ids);
  GuardedBuffer<uint16_t> d_w(w, misalign), d_out(n * d, misalign);
  GuardedBuffer<uint32_t> d_bad(std::vector<uint32_t>{0});
  TestStream stream;
  cuda::embedding_forward(d_ids.data(), d_w.data(), d_out.data(), n, vocab, d, d_bad.data(), stream.get());
  stream.sync();

  std::vector<float> ref(static_cast<size_t>(n * d));
  cpu::embedding_forward(ids.data(), bf16_to_f32(w).data(), ref.data(), n, vocab, d);
  expect_parity("embedding.out", bf16_to_f32(d_out.download()), ref, kExact);
  EXPECT_EQ(read_counter(d_bad), 0u);
  d_w.expect_guards_intact("w");
  d_out.expect_guards_intact("out");
}

TEST_P(EmbeddingParity, Backward) {
  MOE_SKIP_WITHOUT_GPU();
  const auto [n, vocab, d, misalign] = GetParam();
  const auto ids = skewed_ids(n, vocab, 61);
  const auto dout = random_bf16(n * d, 62);
  const auto dw0 = random_f32(vocab * d, 63);
  GuardedBuffer<int32_t> d_ids(ids);
  GuardedBuffer<uint16_t> d_dout(dout, misalign);
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
  expect_parity("embedding.dw", d_dw.download(), ref, kExact);
  EXPECT_EQ(read_counter(d_bad), 0u);
  d_dout.expect_guards_intact("dout");
  d_dw.expect_guards_intact("dw");
  d_ws.expect_guards_intact("workspace");
}

INSTANTIATE_TEST_SUITE_P(Shapes, EmbeddingParity,
                         ::testing::Values(EmbShape{1, 1, 1, 0}, EmbShape{5, 7, 257, 0}, EmbShape{64, 1000, 2048, 0},
                                           EmbShape{300, 50, 4099, 0}, EmbShape{16384, 50304, 512, 0},
                                           EmbShape{16384, 1000, 2048, 0}, EmbShape{100, 300, 2048, 2}),
                         [](const auto& info) {
                           const auto& p = info.param;
                           return param_name("n", p.n, "_v", p.vocab, "_d", p.d, p.misalign ? "_misaligned" : "");
                         });

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
