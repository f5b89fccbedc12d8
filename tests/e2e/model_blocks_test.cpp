// The CPU model as block calls. (1) The embedding, blocks [0, k), blocks [k, n) and the LM head,
// run by hand in one model and split over two models (pipeline stages), equal forward/backward
// bitwise: logits, stats and every gradient, for every split point k. (2) recompute_block reruns a
// block from its saved input and writes bitwise the same saved activations and output (and
// different ones when the weights changed, so a recompute that writes nothing fails). Float (BLAS)
// and double, dense and MoE blocks, shared experts, capacity drops, random routing, and MoE blocks
// under expert parallelism on thread ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "model/model.h"
#include "support/block_cases.h"
#include "parallel/ep_thread_comm.h"
#include "parallel/topology.h"

namespace moe::testing {
namespace {

using Case = BlockCase;
using Batch = CaseBatch;

std::vector<Case> cases() { return block_cases(29, "shared_expert", "capacity", "random_sigmoid"); }

// Two micro-batches of different shapes, so that saved buffers are resized between them.
std::vector<Batch> batches(int64_t vocab) {
  return {make_case_batch(2, 5, 3, vocab), make_case_batch(1, 7, 8, vocab)};
}
Batch make_batch(int64_t batch, int64_t seq, uint64_t seed, int64_t vocab) {
  return make_case_batch(batch, seq, seed, vocab);
}

const LossScales kScales{1.0 / 17, 0.1, 0.01};

template <typename T>
void init(Model<T>& model, const Case& c) {
  model.init_params(17);
  if (!c.bias.empty()) model.expert_bias() = c.bias;
  model.zero_grads();
}

// forward(), by hand: embedding, blocks [0, k) and [k, n) on `first` and `second` (the same
// model, or two pipeline stages), the LM head on `second`.
template <typename T>
ForwardStats staged_forward(Model<T>& first, Model<T>& second, int64_t k, const Batch& b) {
  const int64_t n = b.batch * b.seq, layers = first.model_config().n_layers;
  std::vector<T> x(n * first.model_config().d_model);
  ForwardStats stats;
  first.embed_forward(b.inputs.data(), n, x.data());
  first.forward_blocks(0, k, b.batch, b.seq, b.seed, x.data(), stats);
  second.forward_blocks(k, layers, b.batch, b.seq, b.seed, x.data(), stats);
  if (first.num_moe_layers() > 0) {
    stats.lb_loss /= double(first.num_moe_layers());
    stats.z_loss /= double(first.num_moe_layers());
  }
  second.head_forward(x.data(), b.targets.data(), n, stats);
  return stats;
}

template <typename T>
void staged_backward(Model<T>& first, Model<T>& second, int64_t k, int64_t n) {
  const int64_t layers = first.model_config().n_layers;
  std::vector<T> dx(n * first.model_config().d_model);
  second.head_backward(kScales, dx.data());
  second.backward_blocks(k, layers, kScales, dx.data());
  first.backward_blocks(0, k, kScales, dx.data());
  first.embed_backward(dx.data());
}

// Whether tensor `name` belongs to the first stage (embedding and blocks < k).
bool in_first_stage(const std::string& name, int64_t k) {
  if (name.rfind("model.embed_tokens.", 0) == 0) return true;
  const std::string pre = "model.layers.";
  if (name.rfind(pre, 0) != 0) return false;
  return std::stoll(name.substr(pre.size())) < k;
}

template <typename T>
void check_blocks_split(const Case& c) {
  const auto mb = batches(c.m.vocab_size);
  Model<T> ref(c.m, c.e);
  init(ref, c);
  std::vector<ForwardStats> ref_stats;
  std::vector<std::vector<T>> ref_logits;
  for (const Batch& b : mb) {
    ref_stats.push_back(ref.forward(b.inputs.data(), b.targets.data(), b.batch, b.seq, b.seed));
    ref_logits.push_back(ref.logits());
    ref.backward(kScales);
  }
  const int64_t total = ref.layout().total_numel();
  const std::vector<T> ref_grads(ref.grads(), ref.grads() + total);

  for (int64_t k = 0; k <= c.m.n_layers; ++k) {
    const std::string tag = c.name + " split at " + std::to_string(k);
    // One model running its blocks in two ranges.
    Model<T> one(c.m, c.e);
    init(one, c);
    // Two models, each running its own stage (same parameters, separate gradients).
    Model<T> s1(c.m, c.e), s2(c.m, c.e);
    init(s1, c);
    init(s2, c);
    for (size_t i = 0; i < mb.size(); ++i) {
      const Batch& b = mb[i];
      const int64_t n = b.batch * b.seq;
      expect_same_stats(staged_forward(one, one, k, b), ref_stats[i], tag + " (one model)");
      EXPECT_TRUE(same_bits(one.logits(), ref_logits[i])) << tag << ": logits (one model)";
      staged_backward(one, one, k, n);
      expect_same_stats(staged_forward(s1, s2, k, b), ref_stats[i], tag + " (two stages)");
      EXPECT_TRUE(same_bits(s2.logits(), ref_logits[i])) << tag << ": logits (two stages)";
      staged_backward(s1, s2, k, n);
    }
    EXPECT_TRUE(same_bits(std::vector<T>(one.grads(), one.grads() + total), ref_grads)) << tag << ": gradients";
    for (const ParamEntry& p : ref.layout().entries()) {
      const bool first = in_first_stage(p.name, k);
      const T* own = (first ? s1.grads() : s2.grads()) + p.offset;
      const T* other = (first ? s2.grads() : s1.grads()) + p.offset;
      EXPECT_EQ(std::memcmp(own, ref.grads() + p.offset, p.numel * sizeof(T)), 0)
          << tag << ": gradient of " << p.name << " in its stage";
      for (int64_t i = 0; i < p.numel; ++i)
        ASSERT_EQ(other[i], T(0)) << tag << ": the other stage wrote a gradient of " << p.name;
    }
  }
}

TEST(ModelBlocks, SplitRangesEqualWholeModelFloat) {
  for (const Case& c : cases()) check_blocks_split<float>(c);
}

TEST(ModelBlocks, SplitRangesEqualWholeModelDouble) {
  for (const Case& c : cases()) check_blocks_split<double>(c);
}

TEST(ModelBlocks, RangesOutsideTheModelAreRefused) {
  Model<float> model(block_case_model(29), block_case_moe());
  ForwardStats stats;
  std::vector<float> x(16 * 10);
  EXPECT_THROW(model.forward_blocks(2, 5, 2, 5, 0, x.data(), stats), Error);
  EXPECT_THROW(model.forward_blocks(3, 2, 2, 5, 0, x.data(), stats), Error);
  EXPECT_THROW(model.backward_blocks(0, 1, kScales, x.data()), Error);  // no forward yet
  EXPECT_THROW(model.recompute_block(0), Error);
  EXPECT_THROW(model.recompute_block(4), Error);
}

// Names of the saved activations that differ between a and b (empty: bitwise the same).
template <typename T>
std::vector<std::string> saved_diffs(const BlockSaved<T>& a, const BlockSaved<T>& b) {
  std::vector<std::string> out;
  auto cmp = [&](bool same, const char* what) {
    if (!same) out.push_back(what);
  };
#define MOE_CMP(field) cmp(same_bits(a.field, b.field), #field)
#define MOE_CMP_EQ(field) cmp(a.field == b.field, #field)
  MOE_CMP_EQ(attn.batch);
  MOE_CMP_EQ(attn.seq);
  MOE_CMP(attn.x_in_ND);
  MOE_CMP(attn.norm_ND);
  MOE_CMP(attn.rstd_N);
  MOE_CMP(attn.q_raw_NQ);
  MOE_CMP(attn.k_raw_NC);
  MOE_CMP(attn.q_rstd_N);
  MOE_CMP(attn.k_rstd_N);
  MOE_CMP(attn.q_NQ);
  MOE_CMP(attn.k_NC);
  MOE_CMP(attn.v_NC);
  MOE_CMP(attn.attn_NQ);
  MOE_CMP(attn.lse_BHS);
  MOE_CMP_EQ(mlp.num_tokens);
  MOE_CMP(mlp.x_in_ND);
  MOE_CMP(mlp.norm_ND);
  MOE_CMP(mlp.rstd_N);
  MOE_CMP(mlp.mlp.gate_up_N2F);
  MOE_CMP(mlp.mlp.h_NF);
  MOE_CMP(moe.x_in_ND);
  MOE_CMP(moe.norm_ND);
  MOE_CMP(moe.rstd_N);
  MOE_CMP_EQ(moe.router.num_tokens);
  MOE_CMP_EQ(moe.router.seed);
  MOE_CMP(moe.logits_NE);
  MOE_CMP(moe.scores_NE);
  MOE_CMP(moe.topk_w_NK);
  MOE_CMP(moe.topk_idx_NK);
  MOE_CMP(moe.dispatch.counts_E);
  MOE_CMP(moe.dispatch.offsets_E1);
  MOE_CMP(moe.dispatch.sorted_route_R);
  MOE_CMP(moe.dispatch.route_to_row_R);
  MOE_CMP(moe.dispatch.kept_E);
  MOE_CMP_EQ(moe.dispatch.num_rows);
  MOE_CMP(moe.experts.offsets_L1);
  MOE_CMP(moe.experts.x_GD);
  MOE_CMP(moe.experts.gate_up_G2I);
  MOE_CMP(moe.experts.h_GI);
  MOE_CMP(moe.experts.handle.num_recv_tokens_per_expert);
  MOE_CMP(moe.experts.handle.grouped_to_recv);
  MOE_CMP_EQ(moe.experts.handle.num_recv_rows);
  MOE_CMP(moe.y_sorted_RD);
  MOE_CMP(moe.shared.gate_up_N2F);
  MOE_CMP(moe.shared.h_NF);
#undef MOE_CMP
#undef MOE_CMP_EQ
  return out;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

// Every block of a forward: recompute_block with scaled weights must change its saved
// activations; with the weights restored it must reproduce them and the block's output (the next
// block's or the head's saved input) bitwise. Collective under expert parallelism.
template <typename T>
void check_recompute(Model<T>& model, const std::string& tag) {
  const int64_t layers = model.model_config().n_layers, total = model.layout().total_numel();
  const std::vector<T> params(model.params(), model.params() + total);
  for (int64_t l = 0; l < layers; ++l) {
    const BlockSaved<T> before = model.block_saved(l);
    const std::vector<T>& next = l + 1 < layers ? model.block_saved(l + 1).attn.x_in_ND : model.head_saved().x_in_ND;
    std::vector<T> out(next.size());
    for (int64_t i = 0; i < total; ++i) model.params()[i] = params[i] * T(1.25);
    model.recompute_block(l, out.data());
    // What each kind of block computes must have been rewritten.
    std::vector<std::string> computed = {"attn.norm_ND", "attn.attn_NQ"};
    if (model.block_saved(l).moe.x_in_ND.empty()) {
      computed.insert(computed.end(), {"mlp.norm_ND", "mlp.mlp.h_NF"});
    } else {
      computed.insert(computed.end(), {"moe.norm_ND", "moe.logits_NE", "moe.y_sorted_RD"});
      if (model.moe_config().shared_experts > 0) computed.push_back("moe.shared.h_NF");
    }
    const auto changed = saved_diffs(before, model.block_saved(l));
    for (const std::string& name : computed)
      EXPECT_NE(std::find(changed.begin(), changed.end(), name), changed.end())
          << tag << " block " << l << ": recompute with other weights left " << name << " unchanged";
    EXPECT_FALSE(same_bits(out, next)) << tag << " block " << l << ": output with other weights";
    std::copy(params.begin(), params.end(), model.params());
    model.recompute_block(l, out.data());
    const auto diffs = saved_diffs(before, model.block_saved(l));
    EXPECT_TRUE(diffs.empty()) << tag << " block " << l << ": recompute changed " << join(diffs);
    EXPECT_TRUE(same_bits(out, next)) << tag << " block " << l << ": recomputed output";
  }
}

template <typename T>
void check_recompute_case(const Case& c) {
  const Batch b = make_batch(2, 6, 5, c.m.vocab_size);
  Model<T> model(c.m, c.e), ref(c.m, c.e);
  init(model, c);
  init(ref, c);
  model.forward(b.inputs.data(), b.targets.data(), b.batch, b.seq, b.seed);
  check_recompute(model, c.name);
  // Backward after recomputing every block (last first, as activation recomputation would) gives
  // the gradients of a plain forward/backward.
  ref.forward(b.inputs.data(), b.targets.data(), b.batch, b.seq, b.seed);
  ref.backward(kScales);
  for (int64_t l = c.m.n_layers - 1; l >= 0; --l) model.recompute_block(l);
  model.backward(kScales);
  const int64_t total = ref.layout().total_numel();
  EXPECT_TRUE(same_bits(std::vector<T>(model.grads(), model.grads() + total),
                        std::vector<T>(ref.grads(), ref.grads() + total)))
      << c.name << ": gradients after recompute";
}

TEST(ModelBlocks, RecomputeFromSavedInputIsBitwiseFloat) {
  for (const Case& c : cases()) check_recompute_case<float>(c);
}

TEST(ModelBlocks, RecomputeFromSavedInputIsBitwiseDouble) {
  for (const Case& c : cases()) check_recompute_case<double>(c);
}

// Under expert parallelism (2 thread ranks, 2 of 4 experts each) the MoE blocks recompute through
// the exchange, and split block ranges equal the whole model on every rank.
TEST(ModelBlocks, ExpertParallelRecomputeAndSplitOnThreadRanks) {
  ModelConfig m = block_case_model(29);
  MoeConfig e = block_case_moe();
  run_thread_ranks(2, [&](Comm& world) {
    ExpertParallelGroups groups = split_expert_parallel(world, 2);
    const ExpertParallel ep = make_expert_parallel(*groups.ep, e.num_experts);
    const std::string tag = "rank " + std::to_string(world.rank());
    const Batch b = make_batch(2, 4 + world.rank(), 9 + world.rank(), m.vocab_size);  // ranks differ
    Case c{"ep", m, e, {}};
    Model<float> model(m, e, &ep), split(m, e, &ep);
    init(model, c);
    init(split, c);
    ASSERT_NE(model.expert_parallel(), nullptr);
    const ForwardStats st = model.forward(b.inputs.data(), b.targets.data(), b.batch, b.seq, b.seed);
    expect_same_stats(staged_forward(split, split, 2, b), st, tag + " split forward");
    EXPECT_TRUE(same_bits(split.logits(), model.logits())) << tag;
    check_recompute(model, tag);
    model.backward(kScales);
    staged_backward(split, split, 2, b.batch * b.seq);
    const int64_t total = model.layout().total_numel();
    EXPECT_TRUE(same_bits(std::vector<float>(model.grads(), model.grads() + total),
                          std::vector<float>(split.grads(), split.grads() + total)))
        << tag << ": split gradients";
  });
}

}  // namespace
}  // namespace moe::testing
