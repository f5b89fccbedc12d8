// train.precision = "fp8" in the CUDA model (CudaModel::set_fp8): the FP8 experts, MLPs and
// attention projections against the BF16 model on the same BF16-exact weights and batches (the loss
// within 1%, each gradient tensor close in direction, the experts' and the projections' not BF16's
// bit for bit), activation recomputation bitwise under FP8,
// the weight codes rebuilt when (and only when) the parameters' version moves, and the refusals.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/recompute.h"
#include "gpu_test_util.h"
#include "model/cuda_model.h"
#include "model/model.h"
#include "small_model.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

constexpr int64_t kBatch = 2, kSeq = 64;

// The GPU tests' small model (small_model.h: a dense first layer, 8 experts top-2, a shared
// expert) with experts of hidden `inner`.
MoeConfig fp8_moe_config(int64_t inner) {
  MoeConfig e = small_gpu_moe_config();
  e.expert_hidden = inner;
  return e;
}

std::vector<float> bf16_weights(const ModelConfig& mc, const MoeConfig& ec, uint64_t seed) {
  Model<float> cpu(mc, ec);
  cpu.init_params(seed);
  std::vector<float> p(cpu.params(), cpu.params() + cpu.layout().total_numel());
  for (float& v : p) v = moe::bf16_to_f32(moe::f32_to_bf16(v));
  return p;
}

struct Result {
  std::vector<uint8_t> record;  // the statistics record (CE, lb, z sums, counts), bitwise
  double ce_sum = 0;
  std::vector<std::vector<int32_t>> load;  // routes per expert, per MoE layer
  std::vector<float> grads;
};

// A micro-batch of random ids from `seed`.
void make_batch(const ModelConfig& mc, uint64_t seed, std::vector<int32_t>& inputs, std::vector<int32_t>& targets) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int32_t> tok(0, int32_t(mc.vocab_size - 1));
  inputs.assign(kBatch * kSeq, 0);
  targets.assign(kBatch * kSeq, 0);
  for (auto& t : inputs) t = tok(gen);
  for (size_t i = 0; i < targets.size(); ++i) targets[i] = i % 17 == 3 ? -1 : inputs[(i + 1) % inputs.size()];
}

// One micro-batch of random ids from `seed` through `gpu` (forward + backward, gradients zeroed
// first).
Result step(CudaModel& gpu, const ModelConfig& mc, const MoeConfig& ec, uint64_t seed) {
  gpu.zero_grads();
  gpu.reset_stats();
  std::vector<int32_t> inputs, targets;
  make_batch(mc, seed, inputs, targets);
  GuardedBuffer<int32_t> ids(inputs), tgt(targets);
  gpu.set_loss_scales(LossScales{1.0 / 250.0, ec.lb_loss_weight, ec.z_loss_weight});
  gpu.forward_device(ids.data(), tgt.data(), kBatch, kSeq);
  gpu.backward();
  MOE_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(gpu.stream())));
  Result r;
  r.grads = gpu.download_grads();
  r.record.resize(gpu.stats_bytes());
  MOE_CUDA_CHECK(cudaMemcpy(r.record.data(), gpu.stats_record(), r.record.size(), cudaMemcpyDeviceToHost));
  const ForwardStats stats = gpu.read_stats();
  r.ce_sum = stats.ce_sum;
  r.load = stats.tokens_per_expert;
  return r;
}

Result run(const ModelConfig& mc, const MoeConfig& ec, bool fp8, Recompute mode, const std::vector<float>& w,
           uint64_t seed, Fp8Rule rule = Fp8Rule::kBlocks) {
  CudaModel gpu(mc, ec);
  gpu.set_recompute(mode);
  gpu.set_fp8(fp8, rule);
  gpu.load_params(w.data());
  return step(gpu, mc, ec, seed);
}

double cosine(const float* a, const float* b, int64_t n) {
  double ab = 0, aa = 0, bb = 0;
  for (int64_t i = 0; i < n; ++i) ab += double(a[i]) * b[i], aa += double(a[i]) * a[i], bb += double(b[i]) * b[i];
  return aa == 0 && bb == 0 ? 1.0 : ab / std::sqrt(aa * bb + 1e-300);
}

class CudaFp8Model : public ::testing::TestWithParam<int64_t> {};

// I = 128: SwiGLU writes the FP8 codes of h and dgate_up itself; I = 192: a quantisation pass
// before each GEMM (a partial last 1 x 128 block).
TEST_P(CudaFp8Model, FollowsTheBf16ModelAndRecomputesBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  const ModelConfig mc = small_gpu_model_config();
  const MoeConfig ec = fp8_moe_config(GetParam());
  const std::vector<float> w = bf16_weights(mc, ec, 4321);
  const Result bf16 = run(mc, ec, false, Recompute::kNone, w, 5);
  const Result fp8 = run(mc, ec, true, Recompute::kNone, w, 5);
  const double rel = std::abs(fp8.ce_sum - bf16.ce_sum) / bf16.ce_sum;
  std::printf("I %lld: CE sum bf16 %.6f fp8 %.6f (rel %.2e)\n", (long long)ec.expert_hidden, bf16.ce_sum, fp8.ce_sum,
              rel);
  EXPECT_LT(rel, 1e-2);
  ASSERT_EQ(fp8.grads.size(), bf16.grads.size());
  // The FP8 projections and MLPs move the hidden state the router reads, which flips some near-tied
  // top-k choices of this random-init model: a routed expert's gradient sums other tokens then.
  ASSERT_EQ(fp8.load.size(), bf16.load.size());
  int64_t moved = 0, routes = 0;
  for (size_t l = 0; l < fp8.load.size(); ++l)
    for (size_t e = 0; e < fp8.load[l].size(); ++e)
      moved += std::abs(fp8.load[l][e] - bf16.load[l][e]), routes += bf16.load[l][e];
  std::printf("I %lld: routes on another expert under FP8: at least %lld of %lld\n", (long long)ec.expert_hidden,
              (long long)(moved / 2), (long long)routes);
  EXPECT_LT(double(moved / 2), 0.05 * double(routes));
  CudaModel shape(mc, ec);
  double worst = 1.0;
  bool experts_differ = false;
  for (const ParamEntry& e : shape.layout().entries()) {
    const float* a = fp8.grads.data() + e.offset;
    const float* b = bf16.grads.data() + e.offset;
    const double c = cosine(a, b, e.numel);
    worst = std::min(worst, c);
    EXPECT_GT(c, e.expert ? 0.93 : 0.98) << e.name;
    if (e.expert && std::memcmp(a, b, size_t(e.numel) * sizeof(float)) != 0)
      experts_differ = true;
  }
  std::printf("I %lld: the least gradient cosine fp8 vs bf16 %.5f\n", (long long)ec.expert_hidden, worst);
  EXPECT_TRUE(experts_differ) << "the FP8 experts gave the BF16 experts' gradients bit for bit";
  // Recomputation under FP8: the same kernels on the same inputs and codes.
  for (Recompute mode : {Recompute::kSelective, Recompute::kFull}) {
    const Result r = run(mc, ec, true, mode, w, 5);
    EXPECT_EQ(r.record, fp8.record) << recompute_name(mode);
    EXPECT_EQ(std::memcmp(r.grads.data(), fp8.grads.data(), r.grads.size() * sizeof(float)), 0)
        << recompute_name(mode) << " recompute changed an FP8 gradient";
  }
}

INSTANTIATE_TEST_SUITE_P(Inner, CudaFp8Model, ::testing::Values(int64_t(128), int64_t(192)),
                         [](const auto& info) {
                           char name[32];
                           std::snprintf(name, sizeof name, "I%lld", static_cast<long long>(info.param));
                           return std::string(name);
                         });

// train.fp8_scaling = "mx" on the GPU (MX's 1 x 32 sub-blocks re-blocked into the kernels' 1 x 128
// and 128 x 128 blocks) against the CPU reference's MX recipe (Model<float> under
// set_matmul_precision("fp8", "mx"): every GEMM operand fake-quantised in 1 x 32 blocks along its
// contraction) on the same BF16-exact weights and batch: the loss within 1% and every gradient
// tensor close in direction (the GPU's activations are BF16, the CPU's FP32; a few near-tied routes
// flip); other experts' gradients than the block recipe's; recomputation bitwise; both MX rules.
// An expert hidden size that is not whole 128-wide blocks is refused, naming it.
TEST(CudaFp8ModelMx, FollowsTheCpuMxRecipeAndRecomputesBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  const ModelConfig mc = small_gpu_model_config();
  const MoeConfig ec = fp8_moe_config(128);
  const std::vector<float> w = bf16_weights(mc, ec, 4321);
  const Result blocks = run(mc, ec, true, Recompute::kNone, w, 5);
  for (const auto& [name, rule] : {std::pair<const char*, Fp8Rule>{"mx", Fp8Rule::kMx},
                                   std::pair<const char*, Fp8Rule>{"mx_no_saturation", Fp8Rule::kMxNoSaturation}}) {
    Model<float> cpu(mc, ec);
    std::copy(w.begin(), w.end(), cpu.params());
    cpu.set_matmul_precision("fp8", name);
    std::vector<int32_t> inputs, targets;
    make_batch(mc, 5, inputs, targets);
    cpu.zero_grads();
    const ForwardStats want = cpu.forward(inputs.data(), targets.data(), kBatch, kSeq);
    cpu.backward(LossScales{1.0 / 250.0, ec.lb_loss_weight, ec.z_loss_weight});
    const Result mx = run(mc, ec, true, Recompute::kNone, w, 5, rule);
    const double rel = std::abs(mx.ce_sum - want.ce_sum) / want.ce_sum;
    std::printf("%s: CE sum gpu %.6f cpu %.6f (rel %.2e)\n", name, mx.ce_sum, want.ce_sum, rel);
    EXPECT_LT(rel, 1e-2) << name;
    CudaModel shape(mc, ec);
    double worst = 1.0;
    bool experts_differ = false;
    for (const ParamEntry& e : shape.layout().entries()) {
      const double c = cosine(mx.grads.data() + e.offset, cpu.grads() + e.offset, e.numel);
      worst = std::min(worst, c);
      EXPECT_GT(c, e.expert ? 0.93 : 0.98) << name << " " << e.name;
      if (e.expert && std::memcmp(mx.grads.data() + e.offset, blocks.grads.data() + e.offset,
                                  size_t(e.numel) * sizeof(float)) != 0)
        experts_differ = true;
    }
    std::printf("%s: the least gradient cosine gpu vs cpu %.5f\n", name, worst);
    EXPECT_TRUE(experts_differ) << name << ": the MX rule gave the block recipe's expert gradients bit for bit";
    for (Recompute mode : {Recompute::kSelective, Recompute::kFull}) {
      const Result r = run(mc, ec, true, mode, w, 5, rule);
      EXPECT_EQ(r.record, mx.record) << name << " " << recompute_name(mode);
      EXPECT_EQ(std::memcmp(r.grads.data(), mx.grads.data(), r.grads.size() * sizeof(float)), 0)
          << name << " " << recompute_name(mode) << " recompute changed an MX gradient";
    }
  }
  const std::string msg = error_of([&] {
    CudaModel gpu(mc, fp8_moe_config(192));
    gpu.set_fp8(true, Fp8Rule::kMx);
  });
  EXPECT_NE(msg.find("moe.expert_hidden (192) must be multiples of 128"), std::string::npos) << msg;
}

// The codes are rebuilt from the BF16 copy when the parameters' version moves: a model that ran on
// weights p1 and then loaded p2 gives what a fresh model on p2 gives, bit for bit. A BF16 copy
// changed behind the model's back keeps the old codes until mark_params_changed().
TEST(CudaFp8ModelCodes, FollowTheParametersVersion) {
  MOE_SKIP_WITHOUT_GPU();
  const ModelConfig mc = small_gpu_model_config();
  const MoeConfig ec = fp8_moe_config(128);
  const std::vector<float> p1 = bf16_weights(mc, ec, 11), p2 = bf16_weights(mc, ec, 12);
  CudaModel fresh(mc, ec);
  fresh.set_fp8(true);
  fresh.load_params(p2.data());
  const Result want = step(fresh, mc, ec, 7);

  CudaModel a(mc, ec);
  a.set_fp8(true);
  a.load_params(p1.data());
  const Result on_p1 = step(a, mc, ec, 7);
  EXPECT_NE(on_p1.record, want.record);
  EXPECT_EQ(step(a, mc, ec, 7).record, on_p1.record) << "a second forward on the same weights differs";
  a.load_params(p2.data());
  const Result on_p2 = step(a, mc, ec, 7);
  EXPECT_EQ(on_p2.record, want.record) << "the codes did not follow load_params";
  EXPECT_EQ(std::memcmp(on_p2.grads.data(), want.grads.data(), want.grads.size() * sizeof(float)), 0);

  // The BF16 copy of p1 written straight into the device copy: the experts, MLPs and attention
  // projections still hold p2's codes (the router and the norms read the BF16 copy and see p1),
  // until the version moves.
  // A model that stepped on p2, then had `w` written straight into its BF16 copy.
  const auto behind_its_back = [&](CudaModel& m, const std::vector<float>& w) {
    m.set_fp8(true);
    m.load_params(p2.data());
    step(m, mc, ec, 7);
    std::vector<uint16_t> bits(w.size());
    for (size_t i = 0; i < w.size(); ++i) bits[i] = moe::f32_to_bf16(w[i]);
    MOE_CUDA_CHECK(cudaMemcpy(m.params_bf16(), bits.data(), bits.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
  };
  CudaModel b(mc, ec);
  behind_its_back(b, p1);
  const Result stale = step(b, mc, ec, 7);
  EXPECT_NE(stale.record, on_p1.record) << "the experts read the BF16 copy, not their codes";
  b.mark_params_changed();
  EXPECT_EQ(step(b, mc, ec, 7).record, on_p1.record) << "mark_params_changed did not rebuild the codes";

  // Only the attention projections (D 256, Q 256, C 128: all in FP8) changed behind the model's
  // back: their stale codes give p2's step bit for bit, the rebuilt ones a fresh model's on the mix.
  std::vector<float> mix = p2;
  for (const ParamEntry& e : fresh.layout().entries())
    if (e.name.find("self_attn.") != std::string::npos && e.name.find("_proj.weight") != std::string::npos)
      std::copy(p1.begin() + e.offset, p1.begin() + e.offset + e.numel, mix.begin() + e.offset);
  CudaModel m(mc, ec);
  behind_its_back(m, mix);
  EXPECT_EQ(step(m, mc, ec, 7).record, want.record) << "the attention projections read the BF16 copy, not codes";
  m.mark_params_changed();
  const Result rebuilt = step(m, mc, ec, 7);
  EXPECT_NE(rebuilt.record, want.record);
  CudaModel fresh_mix(mc, ec);
  fresh_mix.set_fp8(true);
  fresh_mix.load_params(mix.data());
  EXPECT_EQ(step(fresh_mix, mc, ec, 7).record, rebuilt.record);
}

TEST(CudaFp8ModelCodes, PrecisionIsSetBeforeReserveAndShapesAreChecked) {
  MOE_SKIP_WITHOUT_GPU();
  const ModelConfig mc = small_gpu_model_config();
  CudaModel gpu(mc, fp8_moe_config(128));
  gpu.reserve(kBatch, kSeq);
  EXPECT_NO_THROW(gpu.set_fp8(false));  // unchanged
  EXPECT_NE(error_of([&] { gpu.set_fp8(true); }).find("before the first forward"), std::string::npos);
  CudaModel odd(mc, fp8_moe_config(72));
  const std::string e = error_of([&] { odd.set_fp8(true); });
  EXPECT_NE(e.find("moe.expert_hidden (72)"), std::string::npos) << e;
  EXPECT_FALSE(odd.fp8());
}

}  // namespace
}  // namespace moe::testing
