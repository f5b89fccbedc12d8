// cuda::attention_forward / attention_backward against cpu::attention_* in float on the same BF16
// inputs (the backward also gets the reference's out, rounded to BF16, and its lse), under the
// attention row below; lse under the FP32-reduction row. Then one captured graph of cross-entropy
// plus attention forward and backward must replay bitwise equal to an eager run.
#include <algorithm>
#include <cmath>

#include "cpu/attention.h"
#include "cuda/ops/attention.h"
#include "cuda/ops/cross_entropy.h"
#include "gpu/gpu_test_util.h"
#include "support/parity.h"

namespace moe::testing {
namespace {

// BF16 outputs of attention. The kernels round the probabilities P (forward, and dV in the
// backward) and dS (dQ, dK) to BF16 before their tensor-core products, as FlashAttention does;
// the FP32 reference does not. Each such rounding is an independent relative error of at most
// 2^-9 per term, so a sum over keys (or queries) carries a random-walk error of about
// 2^-9 / sqrt(3) of the root-sum-square of its terms, about the size of the result itself on
// these random inputs; the output's own rounding adds up to 2^-9 more. Hence 2 BF16 ulps
// (2^-6) per element, a floor of 2^-8 of the tensor's largest value for results that cancel
// (some 15 standard deviations of the rounding noise above it), and 2^-7 normwise (about 3x the
// expected error). An emulation of these roundings in double on the test's shapes (seq
// 7 to 4096, hd 64 and 128) gave norm errors 1.5e-3 to 2.4e-3 and worst elements at 0.45 of the bound.
inline constexpr Tolerance kAttentionBF16{"bf16-attention", 0x1p-6, 0x1p-8, 0x1p-7, false};

struct AttnShape {
  int64_t batch, seq, q_heads, kv_heads, head_dim;
};

struct AttnInputs {
  std::vector<uint16_t> q, k, v, dout;
};

AttnInputs make_inputs(const AttnShape& s, uint64_t seed) {
  const int64_t nq = s.batch * s.seq * s.q_heads * s.head_dim, nkv = s.batch * s.seq * s.kv_heads * s.head_dim;
  // q at 1.5x: scaled scores ~N(0, 2.25), so softmax rows are far from uniform.
  return {random_bf16(nq, seed, 1.5f), random_bf16(nkv, seed + 1), random_bf16(nkv, seed + 2),
          random_bf16(nq, seed + 3)};
}

std::vector<uint16_t> to_bf16(const std::vector<float>& f) {
  std::vector<uint16_t> b(f.size());
  for (size_t i = 0; i < f.size(); ++i) b[i] = f32_to_bf16(f[i]);
  return b;
}

class AttentionParity : public ::testing::TestWithParam<AttnShape> {};

TEST_P(AttentionParity, Forward) {
  MOE_SKIP_WITHOUT_GPU();
  const AttnShape s = GetParam();
  const AttnInputs in = make_inputs(s, 201);
  const int64_t nq = static_cast<int64_t>(in.q.size()), nlse = s.batch * s.q_heads * s.seq;
  GuardedBuffer<uint16_t> d_q(in.q), d_k(in.k), d_v(in.v), d_out(nq);
  GuardedBuffer<float> d_lse(nlse);
  TestStream stream;
  cuda::attention_forward(d_q.data(), d_k.data(), d_v.data(), d_out.data(), d_lse.data(), s.batch, s.seq, s.q_heads,
                          s.kv_heads, s.head_dim, stream.get());
  stream.sync();
  const auto out = d_out.download();
  const auto lse = d_lse.download();

  std::vector<float> out_ref(static_cast<size_t>(nq)), lse_ref(static_cast<size_t>(nlse));
  cpu::attention_forward(bf16_to_f32(in.q).data(), bf16_to_f32(in.k).data(), bf16_to_f32(in.v).data(),
                         out_ref.data(), lse_ref.data(), s.batch, s.seq, s.q_heads, s.kv_heads, s.head_dim);
  expect_parity("attention.out", bf16_to_f32(out), out_ref, kAttentionBF16);
  expect_parity("attention.lse", lse, lse_ref, kFP32Reduction);
  EXPECT_TRUE(bitwise_equal(d_q.download(), in.q) && bitwise_equal(d_k.download(), in.k) &&
              bitwise_equal(d_v.download(), in.v))
      << "the forward wrote into an input";
  d_q.expect_guards_intact("q");
  d_k.expect_guards_intact("k");
  d_v.expect_guards_intact("v");
  d_out.expect_guards_intact("out");
  d_lse.expect_guards_intact("lse");

  cuda::attention_forward(d_q.data(), d_k.data(), d_v.data(), d_out.data(), d_lse.data(), s.batch, s.seq, s.q_heads,
                          s.kv_heads, s.head_dim, stream.get());
  stream.sync();
  EXPECT_TRUE(bitwise_equal(d_out.download(), out)) << "out differs between two identical runs";
  const auto lse2 = d_lse.download();
  EXPECT_EQ(std::memcmp(lse2.data(), lse.data(), lse.size() * sizeof(float)), 0) << "lse differs between runs";
}

TEST_P(AttentionParity, Backward) {
  MOE_SKIP_WITHOUT_GPU();
  const AttnShape s = GetParam();
  const AttnInputs in = make_inputs(s, 301);
  const int64_t nq = static_cast<int64_t>(in.q.size()), nkv = static_cast<int64_t>(in.k.size());
  const int64_t nlse = s.batch * s.q_heads * s.seq;
  const auto qf = bf16_to_f32(in.q), kf = bf16_to_f32(in.k), vf = bf16_to_f32(in.v), dof = bf16_to_f32(in.dout);
  // Both sides start from the reference forward: out rounded to BF16 (as a GPU forward stores
  // it) and the FP32 lse.
  std::vector<float> out_f(static_cast<size_t>(nq)), lse(static_cast<size_t>(nlse));
  cpu::attention_forward(qf.data(), kf.data(), vf.data(), out_f.data(), lse.data(), s.batch, s.seq, s.q_heads,
                         s.kv_heads, s.head_dim);
  const auto out = to_bf16(out_f);

  GuardedBuffer<uint16_t> d_q(in.q), d_k(in.k), d_v(in.v), d_out(out), d_dout(in.dout);
  GuardedBuffer<uint16_t> d_dq(nq), d_dk(nkv), d_dv(nkv);
  GuardedBuffer<float> d_lse(lse);
  const size_t ws_bytes = cuda::attention_backward_workspace_bytes(s.batch, s.seq, s.q_heads);
  GuardedBuffer<uint8_t> d_ws(static_cast<int64_t>(ws_bytes));
  TestStream stream;
  auto run = [&] {
    cuda::attention_backward(d_q.data(), d_k.data(), d_v.data(), d_out.data(), d_lse.data(), d_dout.data(),
                             d_dq.data(), d_dk.data(), d_dv.data(), s.batch, s.seq, s.q_heads, s.kv_heads,
                             s.head_dim, d_ws.data(), ws_bytes, stream.get());
    stream.sync();
  };
  run();
  const auto dq = d_dq.download(), dk = d_dk.download(), dv = d_dv.download();

  std::vector<float> dq_ref(static_cast<size_t>(nq)), dk_ref(static_cast<size_t>(nkv)), dv_ref(static_cast<size_t>(nkv));
  cpu::attention_backward(qf.data(), kf.data(), vf.data(), bf16_to_f32(out).data(), lse.data(), dof.data(),
                          dq_ref.data(), dk_ref.data(), dv_ref.data(), s.batch, s.seq, s.q_heads, s.kv_heads,
                          s.head_dim);
  // With one key per query (seq 1) dq and dk are zero in exact arithmetic: dS = P * (dP - D)
  // with P = 1 and D = dP. Both sides keep a cancellation residue (the GPU forms D from the BF16
  // output), so a relative tolerance against a reference that is only residue cannot apply;
  // such outputs are held to an absolute bound of 2^-16 times the cancelling terms' magnitude.
  auto max_abs = [](const std::vector<float>& v) {
    float m = 0.f;
    for (float x : v) m = std::max(m, std::abs(x));
    return m;
  };
  auto expect_parity_or_cancelled = [&](const char* what, const std::vector<float>& got,
                                        const std::vector<float>& ref, float cancel_scale) {
    const float bound = 0x1p-16f * cancel_scale;
    if (max_abs(ref) > bound) {
      expect_parity(what, got, ref, kAttentionBF16);
      return;
    }
    float err = 0.f;
    for (size_t i = 0; i < got.size(); ++i) err = std::max(err, std::abs(got[i] - ref[i]));
    std::printf("parity %s: reference is cancellation residue, max |got - ref| %.3e (bound %.3e)\n", what, err,
                bound);
    EXPECT_LE(err, bound) << what << ": the reference is zero up to cancellation";
  };
  const float dp_scale = max_abs(dof) * max_abs(vf);
  expect_parity_or_cancelled("attention.dq", bf16_to_f32(dq), dq_ref, dp_scale * max_abs(kf));
  expect_parity_or_cancelled("attention.dk", bf16_to_f32(dk), dk_ref, dp_scale * max_abs(qf));
  expect_parity("attention.dv", bf16_to_f32(dv), dv_ref, kAttentionBF16);
  for (auto* b : {&d_q, &d_k, &d_v, &d_out, &d_dout, &d_dq, &d_dk, &d_dv}) {
    b->expect_guards_intact("attention backward bf16 buffer");
  }
  d_lse.expect_guards_intact("lse");
  d_ws.expect_guards_intact("workspace");

  run();
  EXPECT_TRUE(bitwise_equal(d_dq.download(), dq)) << "dq differs between two identical runs";
  EXPECT_TRUE(bitwise_equal(d_dk.download(), dk)) << "dk differs between two identical runs";
  EXPECT_TRUE(bitwise_equal(d_dv.download(), dv)) << "dv differs between two identical runs";
}

// seq 1, 7, 63, 129 and one 4096; B 1..4; Hq/Hkv 16/16, 16/4, 8/1; head dims 64 and 128.
INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionParity,
    ::testing::Values(AttnShape{1, 1, 16, 16, 64}, AttnShape{2, 1, 8, 1, 128}, AttnShape{2, 7, 16, 4, 64},
                      AttnShape{3, 7, 16, 16, 128}, AttnShape{4, 129, 8, 1, 64}, AttnShape{1, 129, 16, 4, 128},
                      AttnShape{2, 129, 16, 16, 64}, AttnShape{1, 63, 8, 1, 128}, AttnShape{3, 200, 16, 4, 128},
                      AttnShape{2, 333, 8, 1, 64}, AttnShape{1, 4096, 16, 4, 128}),
    [](const auto& info) {
      const auto& p = info.param;
      return param_name("b", p.batch, "_s", p.seq, "_hq", p.q_heads, "_hkv", p.kv_heads, "_hd", p.head_dim);
    });

TEST(Attention, BadArgumentsAreRejected) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t n = 2 * 8 * 4 * 128;
  GuardedBuffer<uint16_t> x(n + 8);
  GuardedBuffer<float> f(64);
  auto expect_error = [](auto fn, const char* needle) {
    try {
      fn();
      ADD_FAILURE() << "expected moe::Error mentioning '" << needle << "'";
    } catch (const moe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  uint16_t* p = x.data();
  expect_error([&] { cuda::attention_forward(p, p, p, p, f.data(), 2, 8, 4, 4, 96, nullptr); }, "head dims are 64 and 128");
  expect_error([&] { cuda::attention_forward(p, p, p, p, f.data(), 2, 8, 4, 3, 64, nullptr); }, "multiple of kv_heads");
  expect_error([&] { cuda::attention_forward(p + 1, p, p, p, f.data(), 2, 8, 4, 4, 64, nullptr); }, "16-byte aligned");
  const size_t need = cuda::attention_backward_workspace_bytes(2, 8, 4);
  EXPECT_EQ(need, size_t{2} * 8 * 4 * sizeof(float));
  expect_error([&] {
    cuda::attention_backward(p, p, p, p, f.data(), p, p, p, p, 2, 8, 4, 4, 64, f.data(), need - 4, nullptr);
  }, "attention_backward_workspace_bytes");
  EXPECT_TRUE(cuda::attention_supports_head_dim(64) && cuda::attention_supports_head_dim(128));
  EXPECT_FALSE(cuda::attention_supports_head_dim(96));
  EXPECT_NO_THROW(cuda::attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 8, 4, 4, 64, nullptr));
  EXPECT_NO_THROW(cuda::attention_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                           nullptr, 2, 0, 4, 4, 64, nullptr, 0, nullptr));
}

// One LM-head chunk and one attention layer, forward and backward, captured once: every replay
// equals the eager run bitwise; a replay after a new grad_scale value equals an eager run with
// that value; the bad-target counter advances on every replay.
struct GraphStep {
  static constexpr int64_t kBatch = 2, kSeq = 160, kHq = 8, kHkv = 2, kHd = 128;
  static constexpr int64_t kTokens = 96, kVocab = 5000;
  static constexpr int64_t kNq = kBatch * kSeq * kHq * kHd, kNkv = kBatch * kSeq * kHkv * kHd;

  std::vector<uint16_t> logits0 = random_bf16(kTokens * kVocab, 401, 3.0f);
  std::vector<int32_t> targets_host = [] {
    std::vector<int32_t> t(kTokens);
    for (int64_t i = 0; i < kTokens; ++i) t[i] = static_cast<int32_t>((i * 131) % kVocab);
    t[4] = -1;
    t[9] = static_cast<int32_t>(kVocab);  // one bad target per run
    return t;
  }();

  GuardedBuffer<uint16_t> logits_start{logits0}, logits{kTokens * kVocab};
  GuardedBuffer<int32_t> targets{targets_host};
  GuardedBuffer<float> loss{kTokens}, ce_lse{kTokens}, grad_scale{std::vector<float>{0.5f}};
  GuardedBuffer<double> loss_sum{std::vector<double>{0.0}};
  GuardedBuffer<uint32_t> num_bad{std::vector<uint32_t>{0}};

  GuardedBuffer<uint16_t> q{random_bf16(kNq, 402, 1.5f)}, k{random_bf16(kNkv, 403)}, v{random_bf16(kNkv, 404)};
  GuardedBuffer<uint16_t> out{kNq}, dout{random_bf16(kNq, 405)}, dq{kNq}, dk{kNkv}, dv{kNkv};
  GuardedBuffer<float> lse{kBatch * kHq * kSeq};
  size_t ws_bytes = cuda::attention_backward_workspace_bytes(kBatch, kSeq, kHq);
  GuardedBuffer<uint8_t> ws{static_cast<int64_t>(ws_bytes)};

  void run(cudaStream_t s) {
    MOE_CUDA_CHECK(cudaMemcpyAsync(logits.data(), logits_start.data(), logits.bytes(), cudaMemcpyDeviceToDevice, s));
    MOE_CUDA_CHECK(cudaMemsetAsync(loss_sum.data(), 0, sizeof(double), s));
    cuda::attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), kBatch, kSeq, kHq, kHkv, kHd, s);
    cuda::cross_entropy_forward_backward(logits.data(), logits.data(), targets.data(), loss.data(), ce_lse.data(),
                                         kTokens, kVocab, 1e-4, grad_scale.data(), loss_sum.data(), num_bad.data(), s);
    cuda::attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(), dq.data(), dk.data(),
                             dv.data(), kBatch, kSeq, kHq, kHkv, kHd, ws.data(), ws_bytes, s);
  }
};

struct GraphSnapshot {
  std::vector<uint16_t> dlogits, out, dq, dk, dv;
  std::vector<float> loss, ce_lse, lse;
  std::vector<double> loss_sum;
  bool operator==(const GraphSnapshot& o) const {
    auto same = [](const auto& a, const auto& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
    };
    return same(dlogits, o.dlogits) && same(out, o.out) && same(dq, o.dq) && same(dk, o.dk) && same(dv, o.dv) &&
           same(loss, o.loss) && same(ce_lse, o.ce_lse) && same(lse, o.lse) && same(loss_sum, o.loss_sum);
  }
};

GraphSnapshot snapshot(const GraphStep& g) {
  return {g.logits.download(), g.out.download(), g.dq.download(), g.dk.download(),  g.dv.download(),
          g.loss.download(),   g.ce_lse.download(), g.lse.download(), g.loss_sum.download()};
}

TEST(AttentionCrossEntropyGraph, CapturedStepReplaysBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  GraphStep g;
  TestStream stream;
  g.run(stream.get());
  stream.sync();
  const GraphSnapshot eager = snapshot(g);
  EXPECT_EQ(g.num_bad.download()[0], 1u);

  cudaGraph_t graph = nullptr;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  g.run(stream.get());
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (int replay = 1; replay <= 2; ++replay) {
    MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    stream.sync();
    EXPECT_TRUE(snapshot(g) == eager) << "graph replay " << replay << " differs from the eager run";
    EXPECT_EQ(g.num_bad.download()[0], 1u + replay) << "after replay " << replay;
  }

  // A new grad_scale in device memory: the replay picks it up, and equals an eager run with it.
  g.grad_scale.upload({0.125f});
  MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
  stream.sync();
  const GraphSnapshot replayed = snapshot(g);
  EXPECT_FALSE(replayed.dlogits == eager.dlogits) << "the replay ignored the new grad_scale";
  g.run(stream.get());
  stream.sync();
  EXPECT_TRUE(snapshot(g) == replayed) << "replay with grad_scale 0.125 differs from the eager run";

  MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOE_CUDA_CHECK(cudaGraphDestroy(graph));
}

}  // namespace
}  // namespace moe::testing
