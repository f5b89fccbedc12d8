// Pipeline stages of the CUDA model on one GPU: two CudaModels holding layers [0, 2) with the
// embedding and [2, 3) with the LM head, the first stage's output residual handed to the second
// (set_stage_input) and the second's input gradient back (set_stage_output_grad), reproduce the
// whole model bitwise: the CE sum, each MoE layer's expert counts and every gradient tensor (by
// name), for two micro-batches accumulated one after the other, recompute none and full. A stage
// refuses the pieces it does not hold, naming them.
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "cuda/ops/memory.h"
#include "gpu/gpu_test_util.h"
#include "gpu/small_model.h"
#include "model/cuda_model.h"
#include "model/model.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {



// Copies the whole model's values into a stage's layout, tensor by tensor (by name).
std::vector<float> stage_values(const ParamLayout& whole, const float* values, const ParamLayout& stage) {
  std::vector<float> out(static_cast<size_t>(stage.total_numel()), 0.f);
  for (const ParamEntry& e : stage.entries()) {
    const ParamEntry& w = whole.find(e.name);
    std::copy(values + w.offset, values + w.offset + w.numel, out.begin() + e.offset);
  }
  return out;
}

std::vector<int32_t> random_ids(int64_t n, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int32_t> tok(0, 255);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& t : v) t = tok(gen);
  return v;
}

TEST(CudaPipelineStage, TwoStagesEqualTheWholeModelBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  const ModelConfig mc = small_gpu_model_config();
  const MoeConfig ec = small_gpu_moe_config();
  Model<float> cpu(mc, ec);
  cpu.init_params(17);
  const int64_t batch = 2, seq = 64, n = batch * seq;
  LayoutPart first, second;
  first.layers = {1, 1, 0};
  first.head = false;
  second.layers = {0, 0, 1};
  second.embed = false;
  for (const Recompute mode : {Recompute::kNone, Recompute::kFull}) {
    SCOPED_TRACE(recompute_name(mode));
    CudaModel whole(mc, ec), s0(mc, ec, nullptr, first), s1(mc, ec, nullptr, second);
    EXPECT_FALSE(s0.part().whole());
    EXPECT_LT(s0.layout().total_numel(), whole.layout().total_numel());
    for (CudaModel* m : {&whole, &s0, &s1}) m->set_recompute(mode);
    whole.load_params(cpu.params());
    s0.load_params(stage_values(cpu.layout(), cpu.params(), s0.layout()).data());
    s1.load_params(stage_values(cpu.layout(), cpu.params(), s1.layout()).data());
    for (CudaModel* m : {&whole, &s0, &s1}) m->zero_grads();
    const LossScales scales{1.0 / double(2 * n), ec.lb_loss_weight, ec.z_loss_weight};
    for (CudaModel* m : {&whole, &s0, &s1}) {
      m->set_loss_scales(scales);
      m->reset_stats();
    }
    for (int micro = 0; micro < 2; ++micro) {
      const std::vector<int32_t> in = random_ids(n, 40 + micro), tg = random_ids(n, 50 + micro);
      GuardedBuffer<int32_t> d_in(in), d_tg(tg);
      const uint64_t seed = 5 + micro;
      whole.forward_device(d_in.data(), d_tg.data(), batch, seq, seed);
      whole.backward();
      // Stage 0 forward, hand over, stage 1 forward and backward, hand back, stage 0 backward.
      s0.begin_forward(d_in.data(), d_tg.data(), batch, seq, seed);
      s0.embedding_forward();
      s0.forward_blocks(0, 2);
      s0.end_forward();
      cuda::stream_sync(s0.stream());
      s1.begin_forward(d_in.data(), d_tg.data(), batch, seq, seed);
      s1.set_stage_input(s0.residual_device());
      s1.forward_blocks(2, 3);
      s1.lm_head_forward();
      s1.end_forward();
      s1.lm_head_backward();
      s1.backward_blocks(2, 3);
      cuda::stream_sync(s1.stream());
      s0.set_stage_output_grad(s1.residual_grad_device());
      s0.backward_blocks(0, 2);
      s0.embedding_backward();
      cuda::stream_sync(s0.stream());
      cuda::stream_sync(whole.stream());
    }
    const ForwardStats w = whole.read_stats(), a = s0.read_stats(), b = s1.read_stats();
    EXPECT_EQ(b.ce_sum, w.ce_sum);
    ASSERT_EQ(w.tokens_per_expert.size(), 2u);
    EXPECT_EQ(a.tokens_per_expert[0], w.tokens_per_expert[0]) << "MoE layer 0 (layer 1, stage 0)";
    EXPECT_EQ(b.tokens_per_expert[1], w.tokens_per_expert[1]) << "MoE layer 1 (layer 2, stage 1)";
    const std::vector<float> gw = whole.download_grads(), g0 = s0.download_grads(), g1 = s1.download_grads();
    int64_t compared = 0;
    for (const auto* stage : {&s0, &s1}) {
      const std::vector<float>& g = stage == &s0 ? g0 : g1;
      for (const ParamEntry& e : stage->layout().entries()) {
        const ParamEntry& we = whole.layout().find(e.name);
        EXPECT_TRUE(std::equal(g.begin() + e.offset, g.begin() + e.offset + e.numel, gw.begin() + we.offset))
            << e.name;
        ++compared;
      }
    }
    EXPECT_EQ(compared, int64_t(whole.layout().entries().size()));
  }
}

TEST(CudaPipelineStage, RefusesWhatTheStageDoesNotHold) {
  MOE_SKIP_WITHOUT_GPU();
  LayoutPart second;
  second.layers = {0, 0, 1};
  second.embed = false;
  CudaModel s1(small_gpu_model_config(), small_gpu_moe_config(), nullptr, second);
  GuardedBuffer<int32_t> ids(std::vector<int32_t>(128, 1));
  const std::string whole = error_of([&] { s1.forward_device(ids.data(), ids.data(), 2, 64); });
  EXPECT_NE(whole.find("holds one pipeline stage's tensors"), std::string::npos) << whole;
  s1.begin_forward(ids.data(), ids.data(), 2, 64);
  const std::string emb = error_of([&] { s1.embedding_forward(); });
  EXPECT_NE(emb.find("does not hold the embedding"), std::string::npos) << emb;
  const std::string layer = error_of([&] { s1.forward_blocks(1, 3); });
  EXPECT_NE(layer.find("layer 1 belongs to another pipeline stage"), std::string::npos) << layer;
}

}  // namespace
}  // namespace moe::testing
