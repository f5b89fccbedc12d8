// cuda::attention_forward / attention_backward on both backends (own kernels, cuDNN SDPA) against
// cpu::attention_* in float on the same BF16 inputs (the backward also gets the reference's out,
// rounded to BF16, and its lse), under the attention row (kAttentionBF16, support/parity.h); lse
// under the FP32-reduction row.
// The backends against each other; one captured graph of cross-entropy plus attention forward and
// backward replays bitwise equal to an eager run; cuDNN refuses to build a plan under capture.
// cuDNN cases skip, saying so, in builds without cuDNN.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "cpu/attention.h"
#include "cuda/ops/attention.h"
#include "cuda/ops/attention_cudnn.h"
#include "cuda/ops/cross_entropy.h"
#include "gpu/gpu_test_util.h"
#include "support/parity.h"

namespace moe::testing {
namespace {

using cuda::AttentionBackend;

// Rows: kAttentionBF16 (against the reference), kAttentionBF16Pair and kFP32ReductionPair (one
// backend against the other), in support/parity.h with their reasoning.

#define MOE_SKIP_WITHOUT_BACKEND(backend)                                                                   \
  do {                                                                                                      \
    MOE_SKIP_WITHOUT_GPU();                                                                                 \
    if ((backend) == AttentionBackend::kCudnn && !cuda::attention_cudnn_available()) {                      \
      GTEST_SKIP() << "this build has no cuDNN attention backend (configured without cuDNN 9 or without "   \
                      "the cuDNN frontend headers, MOECORE_HAS_CUDNN unset): the cudnn case did not run";   \
    }                                                                                                       \
  } while (0)

struct AttnShape {
  int64_t batch, seq, q_heads, kv_heads, head_dim;
};

struct AttnCase {
  AttnShape shape;
  AttentionBackend backend;
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

float max_abs(const std::vector<float>& v) {
  float m = 0.f;
  for (float x : v) m = std::max(m, std::abs(x));
  return m;
}

struct ForwardResult {
  std::vector<uint16_t> out;
  std::vector<float> lse;
};

// One forward on the device; checks inputs untouched and guards intact, and that a second run
// gives bitwise the same out and lse.
ForwardResult run_forward(const AttnShape& s, const AttnInputs& in, AttentionBackend backend) {
  const int64_t nq = static_cast<int64_t>(in.q.size()), nlse = s.batch * s.q_heads * s.seq;
  GuardedBuffer<uint16_t> d_q(in.q), d_k(in.k), d_v(in.v), d_out(nq);
  GuardedBuffer<float> d_lse(nlse);
  TestStream stream;
  auto run = [&] {
    cuda::attention_forward(d_q.data(), d_k.data(), d_v.data(), d_out.data(), d_lse.data(), s.batch, s.seq,
                            s.q_heads, s.kv_heads, s.head_dim, stream.get(), backend);
    stream.sync();
  };
  run();
  ForwardResult r{d_out.download(), d_lse.download()};
  EXPECT_TRUE(bitwise_equal(d_q.download(), in.q) && bitwise_equal(d_k.download(), in.k) &&
              bitwise_equal(d_v.download(), in.v))
      << "the forward wrote into an input";
  d_q.expect_guards_intact("q");
  d_k.expect_guards_intact("k");
  d_v.expect_guards_intact("v");
  d_out.expect_guards_intact("out");
  d_lse.expect_guards_intact("lse");
  run();
  EXPECT_TRUE(bitwise_equal(d_out.download(), r.out)) << "out differs between two identical runs";
  const auto lse2 = d_lse.download();
  EXPECT_EQ(std::memcmp(lse2.data(), r.lse.data(), lse2.size() * sizeof(float)), 0) << "lse differs between runs";
  return r;
}

struct BackwardResult {
  std::vector<uint16_t> dq, dk, dv;
};

// One backward on the device from the given out (BF16) and lse; checks guards and that a second
// run gives bitwise the same gradients.
BackwardResult run_backward(const AttnShape& s, const AttnInputs& in, const std::vector<uint16_t>& out,
                            const std::vector<float>& lse, AttentionBackend backend) {
  const int64_t nq = static_cast<int64_t>(in.q.size()), nkv = static_cast<int64_t>(in.k.size());
  GuardedBuffer<uint16_t> d_q(in.q), d_k(in.k), d_v(in.v), d_out(out), d_dout(in.dout);
  GuardedBuffer<uint16_t> d_dq(nq), d_dk(nkv), d_dv(nkv);
  GuardedBuffer<float> d_lse(lse);
  const size_t ws_bytes = cuda::attention_backward_workspace_bytes(s.batch, s.seq, s.q_heads);
  GuardedBuffer<uint8_t> d_ws(static_cast<int64_t>(ws_bytes));
  TestStream stream;
  auto run = [&] {
    cuda::attention_backward(d_q.data(), d_k.data(), d_v.data(), d_out.data(), d_lse.data(), d_dout.data(),
                             d_dq.data(), d_dk.data(), d_dv.data(), s.batch, s.seq, s.q_heads, s.kv_heads,
                             s.head_dim, d_ws.data(), ws_bytes, stream.get(), backend);
    stream.sync();
  };
  run();
  BackwardResult r{d_dq.download(), d_dk.download(), d_dv.download()};
  for (auto* b : {&d_q, &d_k, &d_v, &d_out, &d_dout, &d_dq, &d_dk, &d_dv}) {
    b->expect_guards_intact("attention backward bf16 buffer");
  }
  d_lse.expect_guards_intact("lse");
  d_ws.expect_guards_intact("workspace");
  run();
  EXPECT_TRUE(bitwise_equal(d_dq.download(), r.dq)) << "dq differs between two identical runs";
  EXPECT_TRUE(bitwise_equal(d_dk.download(), r.dk)) << "dk differs between two identical runs";
  EXPECT_TRUE(bitwise_equal(d_dv.download(), r.dv)) << "dv differs between two identical runs";
  return r;
}

// The reference forward in FP32 on the BF16 inputs: out (FP32) and lse.
void reference_forward(const AttnShape& s, const AttnInputs& in, std::vector<float>& out, std::vector<float>& lse) {
  out.assign(in.q.size(), 0.f);
  lse.assign(static_cast<size_t>(s.batch * s.q_heads * s.seq), 0.f);
  cpu::attention_forward(bf16_to_f32(in.q).data(), bf16_to_f32(in.k).data(), bf16_to_f32(in.v).data(), out.data(),
                         lse.data(), s.batch, s.seq, s.q_heads, s.kv_heads, s.head_dim);
}

class AttentionParity : public ::testing::TestWithParam<AttnCase> {};

TEST_P(AttentionParity, Forward) {
  const AttnShape s = GetParam().shape;
  const AttentionBackend backend = GetParam().backend;
  MOE_SKIP_WITHOUT_BACKEND(backend);
  const AttnInputs in = make_inputs(s, 201);
  const ForwardResult got = run_forward(s, in, backend);
  std::vector<float> out_ref, lse_ref;
  reference_forward(s, in, out_ref, lse_ref);
  expect_parity("attention.out", bf16_to_f32(got.out), out_ref, kAttentionBF16);
  expect_parity("attention.lse", got.lse, lse_ref, kFP32Reduction);
}

TEST_P(AttentionParity, Backward) {
  const AttnShape s = GetParam().shape;
  const AttentionBackend backend = GetParam().backend;
  MOE_SKIP_WITHOUT_BACKEND(backend);
  const AttnInputs in = make_inputs(s, 301);
  const auto qf = bf16_to_f32(in.q), kf = bf16_to_f32(in.k), vf = bf16_to_f32(in.v), dof = bf16_to_f32(in.dout);
  // Both sides start from the reference forward: out rounded to BF16 (as a GPU forward stores
  // it) and the FP32 lse.
  std::vector<float> out_f, lse;
  reference_forward(s, in, out_f, lse);
  const auto out = to_bf16(out_f);
  const BackwardResult got = run_backward(s, in, out, lse, backend);

  const size_t nq = in.q.size(), nkv = in.k.size();
  std::vector<float> dq_ref(nq), dk_ref(nkv), dv_ref(nkv);
  cpu::attention_backward(qf.data(), kf.data(), vf.data(), bf16_to_f32(out).data(), lse.data(), dof.data(),
                          dq_ref.data(), dk_ref.data(), dv_ref.data(), s.batch, s.seq, s.q_heads, s.kv_heads,
                          s.head_dim);
  // With one key per query (seq 1) dq and dk are zero in exact arithmetic: dS = P * (dP - D)
  // with P = 1 and D = dP. The reference (and the own kernels, which form D from the BF16
  // output) keep a cancellation residue, so a relative tolerance against a reference that is
  // only residue cannot apply; such outputs are held to an absolute bound of 2^-16 times the
  // cancelling terms' magnitude (the cudnn backend writes exact zeros there).
  auto expect_parity_or_cancelled = [&](const char* what, const std::vector<float>& g, const std::vector<float>& ref,
                                        float cancel_scale) {
    const float bound = 0x1p-16f * cancel_scale;
    if (max_abs(ref) > bound) {
      expect_parity(what, g, ref, kAttentionBF16);
      return;
    }
    float err = 0.f;
    for (size_t i = 0; i < g.size(); ++i) err = std::max(err, std::abs(g[i] - ref[i]));
    std::printf("parity %s: reference is cancellation residue, max |got - ref| %.3e (bound %.3e)\n", what, err,
                bound);
    EXPECT_LE(err, bound) << what << ": the reference is zero up to cancellation";
  };
  const float dp_scale = max_abs(dof) * max_abs(vf);
  expect_parity_or_cancelled("attention.dq", bf16_to_f32(got.dq), dq_ref, dp_scale * max_abs(kf));
  expect_parity_or_cancelled("attention.dk", bf16_to_f32(got.dk), dk_ref, dp_scale * max_abs(qf));
  expect_parity("attention.dv", bf16_to_f32(got.dv), dv_ref, kAttentionBF16);
}

std::string case_name(const AttnCase& c) {
  const AttnShape& p = c.shape;
  return param_name(cuda::attention_backend_name(c.backend), "_b", p.batch, "_s", p.seq, "_hq", p.q_heads, "_hkv",
                    p.kv_heads, "_hd", p.head_dim);
}

// Shapes of both backends: seq 1, 7, 63, 129 and one 4096; B 1..4; Hq/Hkv 16/16, 16/4, 8/1;
// head dims 64 and 128.
const std::vector<AttnShape> kSharedShapes = {
    {1, 1, 16, 16, 64},  {2, 1, 8, 1, 128},    {2, 7, 16, 4, 64},   {3, 7, 16, 16, 128},
    {4, 129, 8, 1, 64},  {1, 129, 16, 4, 128}, {2, 129, 16, 16, 64}, {1, 63, 8, 1, 128},
    {3, 200, 16, 4, 128}, {2, 333, 8, 1, 64},  {1, 4096, 16, 4, 128}};

// Head dims only cuDNN runs (32, 96, 256), each with GQA and batch > 1, seq 1, odd seq and a
// multiple of 128 (the backward with and without its padding mask on cuDNN <= 9.15); and the
// ends of the claimed range, 8 and an odd multiple of 8 (40).
const std::vector<AttnShape> kCudnnOnlyShapes = {
    {2, 1, 8, 2, 96},    {3, 77, 16, 4, 96},  {2, 640, 16, 4, 96}, {1, 1, 4, 1, 32},
    {2, 200, 8, 2, 32},  {4, 128, 4, 2, 32},  {2, 1, 4, 4, 256},   {1, 129, 8, 1, 256},
    {2, 256, 4, 4, 256}, {1, 1024, 8, 2, 256}, {2, 100, 4, 2, 40}, {1, 33, 2, 2, 8}};

std::vector<AttnCase> parity_cases() {
  std::vector<AttnCase> cases;
  for (const AttnShape& s : kSharedShapes) {
    cases.push_back({s, AttentionBackend::kOwn});
    cases.push_back({s, AttentionBackend::kCudnn});
  }
  for (const AttnShape& s : kCudnnOnlyShapes) cases.push_back({s, AttentionBackend::kCudnn});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionParity, ::testing::ValuesIn(parity_cases()),
                         [](const auto& info) { return case_name(info.param); });

// cuDNN against the own kernels on the same inputs: forward out and lse, and the backward from
// the same (reference) out and lse.
class AttentionBackendAgreement : public ::testing::TestWithParam<AttnShape> {};

TEST_P(AttentionBackendAgreement, CudnnMatchesOwn) {
  const AttnShape s = GetParam();
  MOE_SKIP_WITHOUT_BACKEND(AttentionBackend::kCudnn);
  const AttnInputs in = make_inputs(s, 501);
  const ForwardResult own_f = run_forward(s, in, AttentionBackend::kOwn);
  const ForwardResult cudnn_f = run_forward(s, in, AttentionBackend::kCudnn);
  expect_parity("cudnn vs own: out", bf16_to_f32(cudnn_f.out), bf16_to_f32(own_f.out), kAttentionBF16Pair);
  expect_parity("cudnn vs own: lse", cudnn_f.lse, own_f.lse, kFP32ReductionPair);

  std::vector<float> out_f, lse;
  reference_forward(s, in, out_f, lse);
  const auto out = to_bf16(out_f);
  const BackwardResult own_b = run_backward(s, in, out, lse, AttentionBackend::kOwn);
  const BackwardResult cudnn_b = run_backward(s, in, out, lse, AttentionBackend::kCudnn);
  expect_parity("cudnn vs own: dq", bf16_to_f32(cudnn_b.dq), bf16_to_f32(own_b.dq), kAttentionBF16Pair);
  expect_parity("cudnn vs own: dk", bf16_to_f32(cudnn_b.dk), bf16_to_f32(own_b.dk), kAttentionBF16Pair);
  expect_parity("cudnn vs own: dv", bf16_to_f32(cudnn_b.dv), bf16_to_f32(own_b.dv), kAttentionBF16Pair);
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionBackendAgreement,
                         ::testing::Values(AttnShape{2, 7, 16, 4, 64}, AttnShape{4, 129, 8, 1, 64},
                                           AttnShape{3, 200, 16, 4, 128}, AttnShape{2, 512, 16, 16, 128},
                                           AttnShape{1, 4096, 16, 4, 128}),
                         [](const auto& info) { return case_name({info.param, AttentionBackend::kCudnn}); });

template <typename Fn>
void expect_error(Fn fn, const char* needle) {
  try {
    fn();
    ADD_FAILURE() << "expected moe::Error mentioning '" << needle << "'";
  } catch (const moe::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Attention, BadArgumentsAreRejected) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t n = 2 * 8 * 4 * 128;
  GuardedBuffer<uint16_t> x(n + 8);
  GuardedBuffer<float> f(64);
  uint16_t* p = x.data();
  const AttentionBackend own = AttentionBackend::kOwn;
  expect_error([&] { cuda::attention_forward(p, p, p, p, f.data(), 2, 8, 4, 4, 96, nullptr, own); },
               "head dims are 64 and 128");
  expect_error([&] { cuda::attention_forward(p, p, p, p, f.data(), 2, 8, 4, 3, 64, nullptr, own); },
               "multiple of kv_heads");
  expect_error([&] { cuda::attention_forward(p + 1, p, p, p, f.data(), 2, 8, 4, 4, 64, nullptr, own); },
               "16-byte aligned");
  const size_t need = cuda::attention_backward_workspace_bytes(2, 8, 4);
  EXPECT_EQ(need, size_t{2} * 8 * 4 * sizeof(float));
  expect_error([&] {
    cuda::attention_backward(p, p, p, p, f.data(), p, p, p, p, 2, 8, 4, 4, 64, f.data(), need - 4, nullptr, own);
  }, "attention_backward_workspace_bytes");
  EXPECT_NO_THROW(
      cuda::attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 8, 4, 4, 64, nullptr, own));
  EXPECT_NO_THROW(cuda::attention_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                           nullptr, 2, 0, 4, 4, 64, nullptr, 0, nullptr, own));
}

TEST(AttentionCudnn, BadArgumentsAreRejected) {
  MOE_SKIP_WITHOUT_BACKEND(AttentionBackend::kCudnn);
  const int64_t n = 2 * 8 * 4 * 256;
  GuardedBuffer<uint16_t> x(n + 8);
  GuardedBuffer<float> f(64);
  uint16_t* p = x.data();
  const AttentionBackend cudnn = AttentionBackend::kCudnn;
  for (int64_t bad_hd : {0, 4, 100, 264}) {
    expect_error([&] { cuda::attention_forward(p, p, p, p, f.data(), 2, 8, 4, 4, bad_hd, nullptr, cudnn); },
                 "multiples of 8 from 8 to 256");
  }
  expect_error([&] { cuda::attention_forward(p, p, p, p, f.data(), 2, 8, 4, 3, 64, nullptr, cudnn); },
               "multiple of kv_heads");
  expect_error([&] { cuda::attention_forward(p + 1, p, p, p, f.data(), 2, 8, 4, 4, 96, nullptr, cudnn); },
               "16-byte aligned");
  const size_t need = cuda::attention_backward_workspace_bytes(2, 8, 4);
  expect_error([&] {
    cuda::attention_backward(p, p, p, p, f.data(), p, p, p, p, 2, 8, 4, 4, 96, f.data(), need - 4, nullptr, cudnn);
  }, "attention_backward_workspace_bytes");
  EXPECT_NO_THROW(
      cuda::attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 8, 4, 4, 96, nullptr, cudnn));
  EXPECT_NO_THROW(cuda::attention_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                           nullptr, 2, 0, 4, 4, 96, nullptr, 0, nullptr, cudnn));
}

// MOECORE_ATTENTION and the per-backend head dims (host-only: runs without a GPU too).
TEST(Attention, BackendChoice) {
  const char* saved = std::getenv("MOECORE_ATTENTION");
  const std::string saved_value = saved ? saved : "";
  ::unsetenv("MOECORE_ATTENTION");
  const AttentionBackend default_backend =
      cuda::attention_cudnn_available() ? AttentionBackend::kCudnn : AttentionBackend::kOwn;
  EXPECT_EQ(cuda::attention_resolve_backend(), default_backend) << "the default: cudnn where built, else own";
  EXPECT_EQ(cuda::attention_resolve_backend(AttentionBackend::kOwn), AttentionBackend::kOwn);
  ::setenv("MOECORE_ATTENTION", "", 1);
  EXPECT_EQ(cuda::attention_resolve_backend(), default_backend) << "an empty value means unset";
  ::setenv("MOECORE_ATTENTION", "own", 1);
  EXPECT_EQ(cuda::attention_resolve_backend(), AttentionBackend::kOwn);
  ::setenv("MOECORE_ATTENTION", "flash", 1);
  expect_error([] { cuda::attention_resolve_backend(); }, "MOECORE_ATTENTION must be 'own' or 'cudnn'");
  expect_error([] { cuda::attention_supports_head_dim(64); }, "MOECORE_ATTENTION");
  EXPECT_EQ(cuda::attention_resolve_backend(AttentionBackend::kOwn), AttentionBackend::kOwn)
      << "an explicit backend does not read the variable";
  ::setenv("MOECORE_ATTENTION", "cudnn", 1);
  if (cuda::attention_cudnn_available()) {
    EXPECT_EQ(cuda::attention_resolve_backend(), AttentionBackend::kCudnn);
    EXPECT_TRUE(cuda::attention_supports_head_dim(96));
  } else {
    // Without cuDNN in the build, asking for it (by variable or argument) is an error saying so.
    expect_error([] { cuda::attention_resolve_backend(); }, "MOECORE_ATTENTION=cudnn");
    expect_error([] { cuda::attention_resolve_backend(AttentionBackend::kCudnn); }, "not in this build");
  }
  if (saved) {
    ::setenv("MOECORE_ATTENTION", saved_value.c_str(), 1);
  } else {
    ::unsetenv("MOECORE_ATTENTION");
  }

  for (int64_t hd : {8, 32, 64, 96, 100, 128, 256, 264}) {
    EXPECT_EQ(cuda::attention_supports_head_dim(hd, AttentionBackend::kOwn), hd == 64 || hd == 128) << "hd " << hd;
    if (cuda::attention_cudnn_available()) {
      EXPECT_EQ(cuda::attention_supports_head_dim(hd, AttentionBackend::kCudnn), hd % 8 == 0 && hd <= 256)
          << "hd " << hd;
    }
  }
  EXPECT_STREQ(cuda::attention_backend_name(AttentionBackend::kCudnn), "cudnn");
  EXPECT_STREQ(cuda::attention_backend_name(AttentionBackend::kOwn), "own");
  std::printf("cuDNN attention backend: %s\n", cuda::attention_cudnn_version().c_str());
}

// One LM-head chunk and one attention layer, forward and backward, captured once after an eager
// run (which builds the cuDNN plans): every replay equals the eager run bitwise; a replay after a
// new grad_scale value equals an eager run with that value; the bad-target counter advances on
// every replay.
struct GraphCase {
  AttentionBackend backend;
  int64_t seq, head_dim;
};

struct GraphStep {
  static constexpr int64_t kBatch = 2, kHq = 8, kHkv = 2;
  static constexpr int64_t kTokens = 96, kVocab = 5000;
  AttentionBackend backend;
  int64_t seq, hd, nq, nkv;

  explicit GraphStep(const GraphCase& c)
      : backend(c.backend), seq(c.seq), hd(c.head_dim), nq(kBatch * c.seq * kHq * c.head_dim),
        nkv(kBatch * c.seq * kHkv * c.head_dim) {}

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

  GuardedBuffer<uint16_t> q{random_bf16(nq, 402, 1.5f)}, k{random_bf16(nkv, 403)}, v{random_bf16(nkv, 404)};
  GuardedBuffer<uint16_t> out{nq}, dout{random_bf16(nq, 405)}, dq{nq}, dk{nkv}, dv{nkv};
  GuardedBuffer<float> lse{kBatch * kHq * seq};
  size_t ws_bytes = cuda::attention_backward_workspace_bytes(kBatch, seq, kHq);
  GuardedBuffer<uint8_t> ws{static_cast<int64_t>(ws_bytes)};

  void run(cudaStream_t s) {
    MOE_CUDA_CHECK(cudaMemcpyAsync(logits.data(), logits_start.data(), logits.bytes(), cudaMemcpyDeviceToDevice, s));
    MOE_CUDA_CHECK(cudaMemsetAsync(loss_sum.data(), 0, sizeof(double), s));
    cuda::attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), kBatch, seq, kHq, kHkv, hd, s,
                            backend);
    cuda::cross_entropy_forward_backward(logits.data(), logits.data(), targets.data(), loss.data(), ce_lse.data(),
                                         kTokens, kVocab, 1e-4, grad_scale.data(), loss_sum.data(), num_bad.data(), s);
    cuda::attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(), dq.data(), dk.data(),
                             dv.data(), kBatch, seq, kHq, kHkv, hd, ws.data(), ws_bytes, s, backend);
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

class AttentionCrossEntropyGraph : public ::testing::TestWithParam<GraphCase> {};

TEST_P(AttentionCrossEntropyGraph, CapturedStepReplaysBitwise) {
  MOE_SKIP_WITHOUT_BACKEND(GetParam().backend);
  GraphStep g(GetParam());
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

// seq 160 is not a multiple of 128 (the cuDNN backward's explicit padding mask on cuDNN <= 9.15),
// 256 is; hd 96 runs on cuDNN only.
INSTANTIATE_TEST_SUITE_P(Backends, AttentionCrossEntropyGraph,
                         ::testing::Values(GraphCase{AttentionBackend::kOwn, 160, 128},
                                           GraphCase{AttentionBackend::kCudnn, 160, 128},
                                           GraphCase{AttentionBackend::kCudnn, 256, 96}),
                         [](const auto& info) {
                           return param_name(cuda::attention_backend_name(info.param.backend), "_s", info.param.seq,
                                             "_hd", info.param.head_dim);
                         });

// A cuDNN call under capture whose plan was never built throws, naming the direction and the
// shape, and leaves the capture valid; after attention_prepare (eager) the same calls capture,
// and the replay equals an eager run bitwise. The shape (S 48) appears in no other test.
TEST(AttentionCudnn, PlanMissingUnderCaptureIsRefused) {
  MOE_SKIP_WITHOUT_BACKEND(AttentionBackend::kCudnn);
  const AttnShape s{1, 48, 2, 1, 64};
  const AttentionBackend cudnn = AttentionBackend::kCudnn;
  const AttnInputs in = make_inputs(s, 601);
  const int64_t nq = static_cast<int64_t>(in.q.size()), nkv = static_cast<int64_t>(in.k.size());
  GuardedBuffer<uint16_t> q(in.q), k(in.k), v(in.v), out(nq), dout(in.dout), dq(nq), dk(nkv), dv(nkv);
  GuardedBuffer<float> lse(s.batch * s.q_heads * s.seq);
  const size_t ws_bytes = cuda::attention_backward_workspace_bytes(s.batch, s.seq, s.q_heads);
  GuardedBuffer<uint8_t> ws(static_cast<int64_t>(ws_bytes));
  TestStream stream;
  auto forward = [&] {
    cuda::attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), s.batch, s.seq, s.q_heads,
                            s.kv_heads, s.head_dim, stream.get(), cudnn);
  };
  auto backward = [&] {
    cuda::attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(), dq.data(), dk.data(),
                             dv.data(), s.batch, s.seq, s.q_heads, s.kv_heads, s.head_dim, ws.data(), ws_bytes,
                             stream.get(), cudnn);
  };
  const size_t plans_before = cuda::attention_cudnn_cached_plans();

  auto refused_under_capture = [&](auto call) {
    std::string message;
    cudaGraph_t graph = nullptr;
    MOE_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
    try {
      call();
    } catch (const moe::Error& e) {
      message = e.what();
    }
    EXPECT_EQ(cudaStreamEndCapture(stream.get(), &graph), cudaSuccess) << "the refusal invalidated the capture";
    if (graph != nullptr) MOE_CUDA_CHECK(cudaGraphDestroy(graph));
    return message;
  };
  const std::string fwd = refused_under_capture(forward);
  EXPECT_NE(fwd.find("no plan for forward B=1 S=48 Hq=2 Hkv=1 D=64"), std::string::npos) << fwd;
  EXPECT_NE(fwd.find("being captured"), std::string::npos) << fwd;
  const std::string bwd = refused_under_capture(backward);
  EXPECT_NE(bwd.find("no plan for backward B=1 S=48 Hq=2 Hkv=1 D=64"), std::string::npos) << bwd;
  EXPECT_EQ(cuda::attention_cudnn_cached_plans(), plans_before) << "a plan was built under capture";

  cuda::attention_prepare(s.batch, s.seq, s.q_heads, s.kv_heads, s.head_dim, stream.get(), cudnn);
  EXPECT_EQ(cuda::attention_cudnn_cached_plans(), plans_before + 2) << "prepare builds forward and backward";
  cuda::attention_prepare(s.batch, s.seq, s.q_heads, s.kv_heads, s.head_dim, stream.get(), cudnn);
  EXPECT_EQ(cuda::attention_cudnn_cached_plans(), plans_before + 2) << "a second prepare builds nothing";

  cudaGraph_t graph = nullptr;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  forward();
  backward();
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
  stream.sync();
  const auto out_g = out.download(), dq_g = dq.download(), dk_g = dk.download(), dv_g = dv.download();
  const auto lse_g = lse.download();
  MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOE_CUDA_CHECK(cudaGraphDestroy(graph));
  forward();
  backward();
  stream.sync();
  EXPECT_TRUE(bitwise_equal(out.download(), out_g) && bitwise_equal(dq.download(), dq_g) &&
              bitwise_equal(dk.download(), dk_g) && bitwise_equal(dv.download(), dv_g))
      << "the replay of the prepared shape differs from the eager run";
  EXPECT_EQ(std::memcmp(lse.download().data(), lse_g.data(), lse_g.size() * sizeof(float)), 0);
  // And the results are attention: out against the reference.
  std::vector<float> out_ref, lse_ref;
  reference_forward(s, in, out_ref, lse_ref);
  expect_parity("attention.out (prepared, replayed)", bf16_to_f32(out_g), out_ref, kAttentionBF16);
}

}  // namespace
}  // namespace moe::testing
