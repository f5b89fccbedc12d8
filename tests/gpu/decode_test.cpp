// Decoding on the GPU: cuda::attention_decode against cpu::attention_decode (and against the
// training attention at pos0 = 0), cuda::rope_forward_at against cpu::rope_forward_at and against
// the rows of a longer rope_forward (bitwise), CudaModel::decode against Model<float>::decode on
// the same BF16-representable weights (prompt, then one token at a time; dropless under a capacity),
// the prompt in one call against the same tokens one by one, and greedy generation on the GPU
// deterministic and equal to the CPU's on a trained-like model.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "cpu/attention.h"
#include "cpu/rope.h"
#include "cuda/ops/attention.h"
#include "cuda/ops/rope.h"
#include "gpu/op_case_gpu.h"
#include "gpu/small_model.h"
#include "model/cuda_model.h"
#include "model/generate.h"
#include "model/model.h"
#include "support/parity.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

// ---------------------------------------------------------------------------------------------
// Attention over a KV cache.

struct DecodeShape {
  int64_t n, pos0, q_heads, kv_heads, head_dim;
};

const std::vector<DecodeShape> kDecodeShapes = {
    {1, 0, 2, 1, 64},  {1, 37, 4, 2, 64},   {5, 11, 4, 4, 128}, {17, 0, 8, 2, 128}, {1, 3000, 16, 16, 128},
    {3, 9, 2, 1, 80},  {2, 5, 3, 1, 256},   {4, 100, 2, 2, 32}, {6, 2, 4, 1, 16},   {0, 4, 2, 2, 64}};

std::string decode_name(const DecodeShape& p) {
  return param_name("n", p.n, "_pos", p.pos0, "_hq", p.q_heads, "_hkv", p.kv_heads, "_hd", p.head_dim);
}

OpCase<DecodeShape> attention_decode_case() {
  OpCase<DecodeShape> c{"attention_decode", kDecodeShapes, decode_name};
  c.setup = [](const DecodeShape& p, CaseIo& io) {
    const int64_t len = p.pos0 + p.n;
    io.input("q", random_bf16(p.n * p.q_heads * p.head_dim, 51, 1.5f));
    io.input("k", random_bf16(len * p.kv_heads * p.head_dim, 52));
    io.input("v", random_bf16(len * p.kv_heads * p.head_dim, 53));
    io.output<uint16_t>("out", p.n * p.q_heads * p.head_dim, kAttentionBF16);
  };
  c.reference = [](const DecodeShape& p, RefTensors<float>& t) {
    cpu::attention_decode(t.in("q"), t.in("k"), t.in("v"), t.out("out"), p.n, p.pos0, p.q_heads, p.kv_heads,
                          p.head_dim);
  };
  c.device = [](const DecodeShape& p, DeviceTensors& t, cuda::Stream stream) {
    cuda::attention_decode(t.bf16("q"), t.bf16("k"), t.bf16("v"), t.bf16("out"), p.n, p.pos0, p.q_heads, p.kv_heads,
                           p.head_dim, stream);
  };
  return c;
}

MOE_GPU_OP_CASE_TESTS(AttentionDecodeParity, Forward, attention_decode_case);

std::vector<float> widen(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = moe::bf16_to_f32(b[i]);
  return f;
}

// A whole causal sequence decoded at once (pos0 = 0, the prompt) is the training attention's
// forward: both within the attention row of the reference, so within twice it of each other.
TEST(AttentionDecode, PromptEqualsTrainingAttention) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t s = 300, hq = 8, hkv = 2, hd = 128;
  const auto q = random_bf16(s * hq * hd, 61, 1.5f), k = random_bf16(s * hkv * hd, 62), v = random_bf16(s * hkv * hd, 63);
  GuardedBuffer<uint16_t> dq(q), dk(k), dv(v), out_decode(s * hq * hd), out_train(s * hq * hd);
  GuardedBuffer<float> lse(hq * s);
  TestStream stream;
  cuda::attention_decode(dq.data(), dk.data(), dv.data(), out_decode.data(), s, 0, hq, hkv, hd, stream.get());
  cuda::attention_forward(dq.data(), dk.data(), dv.data(), out_train.data(), lse.data(), 1, s, hq, hkv, hd,
                          stream.get());
  stream.sync();
  const std::vector<float> a = widen(out_decode.download()), b = widen(out_train.download());
  const double diff = normwise_difference(a, b);
  std::printf("decode vs training attention, normwise %.3e\n", diff);
  EXPECT_LE(diff, 1e-2);
  out_decode.expect_guards_intact("out");
}

TEST(AttentionDecode, RefusesBadShapes) {
  MOE_SKIP_WITHOUT_GPU();
  GuardedBuffer<uint16_t> b(1024);
  TestStream stream;
  const std::string hd = error_of([&] { cuda::attention_decode(b.data(), b.data(), b.data(), b.data(), 1, 0, 2, 2, 512, stream.get()); });
  EXPECT_NE(hd.find("head_dim in [1, 256], got 512"), std::string::npos) << hd;
  const std::string heads = error_of([&] { cuda::attention_decode(b.data(), b.data(), b.data(), b.data(), 1, 0, 3, 2, 64, stream.get()); });
  EXPECT_NE(heads.find("dividing q_heads"), std::string::npos) << heads;
}

// ---------------------------------------------------------------------------------------------
// RoPE at a position offset.

struct RopeAtShape {
  int64_t n, pos0, heads, head_dim;
};

OpCase<RopeAtShape> rope_at_case() {
  OpCase<RopeAtShape> c{"rope_forward_at",
                        {{1, 0, 4, 64}, {1, 1000, 16, 128}, {7, 33, 2, 128}, {3, 70000, 4, 64}, {5, 9, 3, 6}},
                        [](const RopeAtShape& p) {
                          return param_name("n", p.n, "_pos", p.pos0, "_h", p.heads, "_hd", p.head_dim);
                        }};
  c.setup = [](const RopeAtShape& p, CaseIo& io) {
    io.in_place("x", random_bf16(p.n * p.heads * p.head_dim, 71), kBF16Elementwise);
  };
  c.reference = [](const RopeAtShape& p, RefTensors<float>& t) {
    cpu::rope_forward_at(t.out("x"), p.n, p.pos0, p.heads, p.head_dim, 1e4);
  };
  c.device = [](const RopeAtShape& p, DeviceTensors& t, cuda::Stream stream) {
    cuda::rope_forward_at(t.bf16("x"), p.n, p.pos0, p.heads, p.head_dim, 1e4, stream);
  };
  return c;
}

MOE_GPU_OP_CASE_TESTS(RopeAtParity, Forward, rope_at_case);

// Rows at offset pos0 rotate bitwise as rows pos0.. of a sequence rotated from 0.
TEST(RopeAt, EqualsTheRowsOfALongerSequenceBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t pos0 = 517, n = 9, h = 4, hd = 128, row = h * hd;
  const auto x = random_bf16((pos0 + n) * row, 72);
  GuardedBuffer<uint16_t> whole(x);
  GuardedBuffer<uint16_t> tail(std::vector<uint16_t>(x.begin() + pos0 * row, x.end()));
  TestStream stream;
  cuda::rope_forward(whole.data(), 1, pos0 + n, h, hd, 5e5, stream.get());
  cuda::rope_forward_at(tail.data(), n, pos0, h, hd, 5e5, stream.get());
  stream.sync();
  const auto w = whole.download(), t = tail.download();
  EXPECT_TRUE(std::equal(t.begin(), t.end(), w.begin() + pos0 * row));
}

// ---------------------------------------------------------------------------------------------
// The model.



// Model<float> with BF16-representable weights (the GPU's BF16 copy is then exact) and a non-zero
// expert bias, so the selection bias is exercised too. The router gates are scaled by 16: at the
// init scale the top-k choice of a token is often within BF16 rounding of a tie, and one flipped
// route moves that token's logits by more than rounding (seen: 3.2e-2 against 6e-3 without);
// decisive routers keep the comparison on the decode path's numerics.
void init_model(Model<float>& cpu, uint64_t seed) {
  cpu.init_params(seed);
  for (const ParamEntry& p : cpu.layout().entries())
    if (p.name.find("mlp.gate.weight") != std::string::npos)
      for (int64_t i = 0; i < p.numel; ++i) cpu.params()[p.offset + i] *= 16.f;
  for (int64_t i = 0; i < cpu.layout().total_numel(); ++i) cpu.params()[i] = moe::bf16_to_f32(moe::f32_to_bf16(cpu.params()[i]));
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> u(-0.01f, 0.01f);
  for (float& b : cpu.expert_bias()) b = u(gen);
}

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = tok(gen);
  return t;
}

// The prompt in one call, then `extra` tokens one at a time, on both models; the last logits of
// each call compared normwise. BF16 activations on the GPU: a router near-tie may flip a route,
// which moves that token's logits by more than rounding, hence 3e-2.
void check_decode_against_cpu(const ModelConfig& mc, const MoeConfig& ec) {
  Model<float> cpu(mc, ec);
  init_model(cpu, 4321);
  CudaModel gpu(mc, ec);
  gpu.load_params(cpu.params());
  gpu.load_expert_bias(cpu.expert_bias());
  const int64_t v = mc.vocab_size, prompt = 13, extra = 6;
  const std::vector<int32_t> tokens = random_tokens(prompt + extra, v, 99);
  KvCache<float> cpu_cache;
  CudaKvCache gpu_cache;
  double worst = 0;
  for (int64_t call = 0; call <= extra; ++call) {
    const int64_t at = call == 0 ? 0 : prompt + call - 1, n = call == 0 ? prompt : 1;
    const std::vector<float> all = cpu.decode(tokens.data() + at, n, cpu_cache);
    const std::vector<float> want(all.end() - v, all.end());
    const std::vector<float> got = gpu.decode(tokens.data() + at, n, gpu_cache);
    ASSERT_EQ(int64_t(got.size()), v);
    const double diff = normwise_difference(got, want);
    std::printf("decode call %lld (%lld tokens at %lld): logits normwise %.3e\n", (long long)call, (long long)n,
                (long long)at, diff);
    EXPECT_LE(diff, 3e-2) << "call " << call;
    worst = std::max(worst, diff);
    EXPECT_EQ(gpu_cache.length, cpu_cache.length);
  }
  std::printf("worst %.3e\n", worst);
}

TEST(CudaDecode, MatchesCpuDecode) {
  MOE_SKIP_WITHOUT_GPU();
  check_decode_against_cpu(small_gpu_model_config(), small_gpu_moe_config());
}

// head_dim 128 without QK-norm, sigmoid router, no shared expert, and a capacity factor that
// training would apply: decoding keeps every route on both backends.
TEST(CudaDecode, MatchesCpuDecodeSigmoidDroplessUnderCapacity) {
  MOE_SKIP_WITHOUT_GPU();
  ModelConfig mc = small_gpu_model_config();
  mc.n_heads = 2;
  mc.n_kv_heads = 1;
  mc.qk_norm = false;
  mc.dense_layers = {};
  MoeConfig ec = small_gpu_moe_config();
  ec.router = "sigmoid";
  ec.norm_topk_prob = true;
  ec.shared_experts = 0;
  ec.capacity_factor = 1.0;
  check_decode_against_cpu(mc, ec);
}

// The prompt in one call and the same tokens one at a time give the same last logits (different
// GEMM shapes, so to BF16 rounding), and the cache grows past its first capacity (256 rows).
TEST(CudaDecode, PromptAtOnceEqualsOneByOne) {
  MOE_SKIP_WITHOUT_GPU();
  const ModelConfig mc = small_gpu_model_config();
  const MoeConfig ec = small_gpu_moe_config();
  Model<float> cpu(mc, ec);
  init_model(cpu, 77);
  CudaModel gpu(mc, ec);
  gpu.load_params(cpu.params());
  gpu.load_expert_bias(cpu.expert_bias());
  const int64_t n = 300;
  const std::vector<int32_t> tokens = random_tokens(n, mc.vocab_size, 5);
  CudaKvCache whole, stepwise;
  const std::vector<float> a = gpu.decode(tokens.data(), n, whole);
  std::vector<float> b;
  for (int64_t i = 0; i < n; ++i) b = gpu.decode(tokens.data() + i, 1, stepwise);
  EXPECT_EQ(whole.length, n);
  EXPECT_EQ(stepwise.length, n);
  EXPECT_GE(stepwise.capacity, n);
  const double diff = normwise_difference(b, a);
  std::printf("prompt at once vs one by one: normwise %.3e\n", diff);
  EXPECT_LE(diff, 2e-2);
}

// Greedy generation on the GPU: two runs give the same tokens; and a bad token id is refused by name.
TEST(CudaDecode, GreedyGenerationIsDeterministic) {
  MOE_SKIP_WITHOUT_GPU();
  const ModelConfig mc = small_gpu_model_config();
  const MoeConfig ec = small_gpu_moe_config();
  Model<float> cpu(mc, ec);
  init_model(cpu, 8);
  const std::vector<int32_t> prompt = random_tokens(9, mc.vocab_size, 3);
  const SamplingOptions greedy;
  const Generation a = generate(cuda_decoder(cpu), mc.vocab_size, prompt, 40, -1, greedy, true);
  const Generation b = generate(cuda_decoder(cpu), mc.vocab_size, prompt, 40, -1, greedy, true);
  ASSERT_EQ(a.ids.size(), 40u);
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.logits, b.logits);
  SamplingOptions hot;
  hot.temperature = 0.8;
  hot.top_p = 0.9;
  hot.seed = 11;
  const Generation c = generate(cuda_decoder(cpu), mc.vocab_size, prompt, 20, -1, hot, false);
  const Generation d = generate(cuda_decoder(cpu), mc.vocab_size, prompt, 20, -1, hot, false);
  EXPECT_EQ(c.ids, d.ids);
  CudaModel gpu(mc, ec);
  CudaKvCache cache;
  const int32_t bad = 256;
  const std::string msg = error_of([&] { gpu.decode(&bad, 1, cache); });
  EXPECT_NE(msg.find("token 0 is 256, not an id of this model"), std::string::npos) << msg;
  EXPECT_EQ(cache.length, 0);
}

}  // namespace
}  // namespace moe::testing
