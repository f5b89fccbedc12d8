// Activation recomputation on the GPU (train.recompute; core/recompute.h): CudaModel with
// selective or full recomputation against the same model without, on the same weights and
// batches: the statistics record, every gradient and the grads-ready offsets bitwise equal (the
// same kernels on the same inputs; routing not decided again), over two accumulated micro-batches,
// for learned and random routing, a dense layer, a shared expert, QK-norm on and off. The model's
// own device bytes fall with each mode. The experts' recompute op against experts_forward.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/dtype.h"
#include "core/recompute.h"
#include "cuda/ops/experts.h"
#include "gpu_test_util.h"
#include "support/test_util.h"
#include "model/cuda_model.h"
#include "model/model.h"

namespace moe::testing {
namespace {

constexpr int64_t kBatch = 2, kSeq = 64;

ModelConfig recompute_model_config(bool qk_norm) {
  ModelConfig m;
  m.vocab_size = 256;
  m.d_model = 256;
  m.n_layers = 4;
  m.n_heads = 4;  // head_dim 64
  m.n_kv_heads = 2;
  m.qk_norm = qk_norm;
  m.dense_layers = {1};
  m.dense_hidden = 256;
  m.init_std = 0.02;
  return m;
}

MoeConfig recompute_moe_config(const std::string& routing, int64_t shared) {
  MoeConfig e;
  e.num_experts = 8;
  e.top_k = 2;
  e.expert_hidden = 128;
  e.shared_experts = shared;
  e.routing = routing;
  e.lb_loss_weight = 0.01;
  e.z_loss_weight = 0.001;
  return e;
}

struct Result {
  std::vector<uint8_t> record;  // statistics record: CE, lb, z sums, bad counters, expert counts
  std::vector<float> grads;
  std::vector<int64_t> hook;
  int64_t device_bytes = 0;
};

bool same(const Result& a, const Result& b) {
  return a.record == b.record && a.hook == b.hook && a.grads.size() == b.grads.size() &&
         std::memcmp(a.grads.data(), b.grads.data(), a.grads.size() * sizeof(float)) == 0;
}

// Two micro-batches (forward + backward each, gradients accumulating) on BF16-exact weights.
// prepare: the step's way (CudaModel::prepare_grads_for_step) on gradients filled with NaN first,
// instead of zero_grads; fuse_head: the LM head's backward GEMMs done by its forward.
Result run(const ModelConfig& mc, const MoeConfig& ec, Recompute mode, const std::vector<float>& params,
           uint64_t seed, bool prepare = false, bool fuse_head = false) {
  CudaModel gpu(mc, ec);
  gpu.set_recompute(mode);
  gpu.set_fuse_head_backward(fuse_head);
  gpu.load_params(params.data());
  Result r;
  gpu.set_grads_ready_hook([&](int64_t from) { r.hook.push_back(from); });
  if (prepare) {
    MOE_CUDA_CHECK(cudaMemset(gpu.grads(), 0xff, size_t(gpu.layout().total_numel()) * sizeof(float)));  // NaN
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    gpu.prepare_grads_for_step();
  } else {
    gpu.zero_grads();
  }
  gpu.reset_stats();
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int32_t> tok(0, int32_t(mc.vocab_size - 1));
  for (int micro = 0; micro < 2; ++micro) {
    std::vector<int32_t> inputs(kBatch * kSeq), targets(kBatch * kSeq);
    for (auto& t : inputs) t = tok(gen);
    for (size_t i = 0; i < targets.size(); ++i) targets[i] = i % 17 == 3 ? -1 : inputs[(i + 1) % inputs.size()];
    GuardedBuffer<int32_t> ids(inputs), tgt(targets);
    gpu.set_loss_scales(LossScales{1.0 / 250.0, ec.lb_loss_weight, ec.z_loss_weight});
    gpu.forward_device(ids.data(), tgt.data(), kBatch, kSeq, 1000 + micro);
    gpu.backward();
    MOE_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(gpu.stream())));
  }
  r.grads = gpu.download_grads();
  r.record.resize(gpu.stats_bytes());
  MOE_CUDA_CHECK(cudaMemcpy(r.record.data(), gpu.stats_record(), r.record.size(), cudaMemcpyDeviceToHost));
  r.device_bytes = gpu.device_bytes();
  return r;
}

std::vector<float> bf16_weights(const ModelConfig& mc, const MoeConfig& ec) {
  Model<float> cpu(mc, ec);
  cpu.init_params(4321);
  std::vector<float> p(cpu.params(), cpu.params() + cpu.layout().total_numel());
  for (float& v : p) v = moe::bf16_to_f32(moe::f32_to_bf16(v));
  return p;
}

using Case = std::tuple<std::string /*routing*/, bool /*qk_norm*/, int64_t /*shared experts*/>;

class CudaRecompute : public ::testing::TestWithParam<Case> {};

TEST_P(CudaRecompute, GradientsAndStatisticsEqualNoRecomputeBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  const auto& [routing, qk_norm, shared] = GetParam();
  const ModelConfig mc = recompute_model_config(qk_norm);
  const MoeConfig ec = recompute_moe_config(routing, shared);
  const std::vector<float> w = bf16_weights(mc, ec);
  const Result none = run(mc, ec, Recompute::kNone, w, 5);
  ASSERT_TRUE(same(run(mc, ec, Recompute::kNone, w, 5), none)) << "two runs without recompute differ";
  ASSERT_FALSE(same(run(mc, ec, Recompute::kNone, w, 6), none)) << "another batch changed nothing";
  const Result selective = run(mc, ec, Recompute::kSelective, w, 5);
  const Result full = run(mc, ec, Recompute::kFull, w, 5);
  EXPECT_TRUE(same(selective, none)) << "selective recompute changed a gradient or a statistic";
  EXPECT_TRUE(same(full, none)) << "full recompute changed a gradient or a statistic";
  std::printf("device bytes: none %lld, selective %lld, full %lld\n", (long long)none.device_bytes,
              (long long)selective.device_bytes, (long long)full.device_bytes);
  EXPECT_LT(selective.device_bytes, none.device_bytes);
  EXPECT_LT(full.device_bytes, selective.device_bytes);
}

// The first backward of a step writes the GEMM-produced gradients instead of adding them to zeros:
// the same gradients (every element written: no NaN of the fill survives), bit for bit up to the
// sign of a zero and FP32 subnormals (the accumulating grouped wgrad flushes them to zero), and the
// same statistics; with every recompute mode, and with the LM head's backward fused into its
// forward (bitwise the same alone).
TEST_P(CudaRecompute, FirstBackwardWritesGradientsAsZeroingAndAdding) {
  MOE_SKIP_WITHOUT_GPU();
  const auto& [routing, qk_norm, shared] = GetParam();
  const ModelConfig mc = recompute_model_config(qk_norm);
  const MoeConfig ec = recompute_moe_config(routing, shared);
  const std::vector<float> w = bf16_weights(mc, ec);
  const Result zeroed = run(mc, ec, Recompute::kNone, w, 5);
  EXPECT_TRUE(same(run(mc, ec, Recompute::kNone, w, 5, false, /*fuse_head=*/true), zeroed))
      << "the LM head's backward done in its forward changed a gradient or a statistic";
  for (Recompute mode : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
    const Result written = run(mc, ec, mode, w, 5, /*prepare=*/true, /*fuse_head=*/mode != Recompute::kSelective);
    ASSERT_EQ(written.grads.size(), zeroed.grads.size());
    EXPECT_EQ(written.record, zeroed.record) << recompute_name(mode);
    EXPECT_EQ(written.hook, zeroed.hook) << recompute_name(mode);
    int64_t differ = 0, tiny = 0;
    for (size_t i = 0; i < zeroed.grads.size(); ++i) {
      const float a = written.grads[i], b = zeroed.grads[i];
      if (std::memcmp(&a, &b, sizeof(float)) == 0) continue;
      if (std::fabs(a) < FLT_MIN && std::fabs(b) < FLT_MIN) {
        ++tiny;
        continue;
      }
      if (differ++ < 5)
        ADD_FAILURE() << recompute_name(mode) << ": gradient " << i << " is " << a << " written, " << b
                      << " zeroed and added";
    }
    EXPECT_EQ(differ, 0) << recompute_name(mode);
    std::printf("%s: %lld gradients differ only as zero signs or subnormals\n", recompute_name(mode),
                (long long)tiny);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaRecompute,
                         ::testing::Values(Case{"learned", true, 1}, Case{"random", true, 1},
                                           Case{"learned", false, 0}, Case{"uniform", false, 1}),
                         [](const auto& info) {
                           return std::get<0>(info.param) + (std::get<1>(info.param) ? "_qknorm" : "_noqknorm") +
                                  "_shared" + std::to_string(std::get<2>(info.param));
                         });

TEST(CudaRecompute, ModeIsSetBeforeTheFirstForward) {
  MOE_SKIP_WITHOUT_GPU();
  const ModelConfig mc = recompute_model_config(true);
  const MoeConfig ec = recompute_moe_config("learned", 1);
  CudaModel gpu(mc, ec);
  gpu.reserve(kBatch, kSeq);
  EXPECT_NO_THROW(gpu.set_recompute(Recompute::kNone));  // unchanged: nothing to do
  EXPECT_NE(error_of([&] { gpu.set_recompute(Recompute::kFull); }).find("before the first forward"), std::string::npos);
}

// cuda::experts_recompute gives experts_forward's h and y bitwise from its gate_up, with empty
// experts and rows past offsets[E] (left as forward leaves them).
TEST(CudaExpertsRecompute, HAndYEqualTheForwardBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t e = 4, d = 64, inner = 32, rows = 96;
  const std::vector<int32_t> offsets = {0, 20, 20, 70, 90};  // expert 1 empty, 6 rows past the end
  std::mt19937_64 gen(3);
  std::normal_distribution<float> nd(0.f, 0.5f);
  auto bf16 = [&](int64_t n) {
    std::vector<uint16_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = moe::f32_to_bf16(nd(gen));
    return v;
  };
  GuardedBuffer<uint16_t> x(bf16(rows * d)), wgu(bf16(e * 2 * inner * d)), wd(bf16(e * d * inner));
  GuardedBuffer<int32_t> off(offsets);
  GuardedBuffer<uint16_t> gu(rows * 2 * inner), h(rows * inner), y(rows * d), h2(rows * inner), y2(rows * d);
  cuda::experts_forward(x.data(), off.data(), wgu.data(), wd.data(), rows, e, d, inner, gu.data(), h.data(), y.data(),
                        nullptr);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  // Outputs start as forward left them past the rows it writes, so every element can be compared.
  MOE_CUDA_CHECK(cudaMemcpy(y2.data(), y.data(), size_t(rows * d) * 2, cudaMemcpyDeviceToDevice));
  cuda::experts_recompute(gu.data(), off.data(), wd.data(), rows, e, d, inner, h2.data(), y2.data(), nullptr);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(h2.download(), h.download());
  EXPECT_EQ(y2.download(), y.download());
  // h only (the expert-parallel case): y untouched.
  GuardedBuffer<uint16_t> h3(rows * inner);
  cuda::experts_recompute(gu.data(), off.data(), nullptr, rows, e, d, inner, h3.data(), nullptr, nullptr);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(h3.download(), h.download());
  for (auto* b : {&gu, &h, &y, &h2, &y2, &h3}) b->expect_guards_intact("experts buffer");
}

}  // namespace
}  // namespace moe::testing
