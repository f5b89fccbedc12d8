// Model<T>: the embedding, the blocks and the LM head, each a forward/backward pair on the flat
// parameter and gradient buffers (attention_block.h, mlp.h, moe_layer.h, lm_head.h). Gradient
// conventions: parameter gradients accumulate (+=); activation gradients are overwritten except
// the residual stream, to which each block adds its branch's gradient.
// Legend: N tokens, D model width, V vocabulary, E experts.
#include "model/model.h"

#include <algorithm>
#include <type_traits>

#include "core/error.h"
#include "core/rng.h"
#include "cpu/embedding.h"
#include "model/ep_experts.h"
#include "model/layout.h"

namespace moe {

template <typename T>
Model<T>::Model(const ModelConfig& model, const MoeConfig& moe, const ExpertParallel* ep, const LayoutPart& part)
    : mcfg_(model), ecfg_(moe), part_(part) {
  slice_ = {0, moe.num_experts};
  if (ep != nullptr && ep->size() > 1) {
    MOE_CHECK((std::is_same_v<T, float>), "expert parallelism (ep = ", ep->size(),
              ") runs in Model<float> only; the double model is single-rank");
    MOE_CHECK(ep->num_experts == moe.num_experts, "expert parallelism: the EP context has ", ep->num_experts,
              " experts, moe.num_experts is ", moe.num_experts);
    MOE_CHECK(moe.num_experts % ep->size() == 0, "expert parallelism: parallel.ep = ", ep->size(),
              " must divide moe.num_experts = ", moe.num_experts);
    MOE_CHECK(moe.capacity_factor == 0, "expert parallelism is dropless only: moe.capacity_factor must be 0 with "
              "parallel.ep = ", ep->size(), ", got ", moe.capacity_factor);
    ep_ = *ep;
    slice_ = ep->slice();
  }
  layout_ = build_param_layout(model, moe, slice_, part_);
  for (const ParamEntry& e : layout_.entries())
    placements_.push_back(global_placement(e, ep_ ? ep_->size() : 1, ep_ ? ep_->rank() : 0));
  params_.assign(layout_.total_numel(), T(0));
  grads_.assign(layout_.total_numel(), T(0));
  num_moe_layers_ = moe::num_moe_layers(model);
  expert_bias_.assign(num_moe_layers_ * moe.num_experts, 0.f);

  attn_cfg_ = attention_config(model);
  moe_cfg_ = moe_layer_config(model, moe);
  if constexpr (std::is_same_v<T, float>) {
    if (ep_) experts_ = std::make_unique<EpExperts>(*ep_, model.d_model, moe.expert_hidden);
  }
  if (!experts_) experts_ = std::make_unique<LocalExperts<T>>(moe.num_experts, model.d_model, moe.expert_hidden);
  layers_ = layer_params(layout_, mcfg_, ecfg_);
  saved_.resize(layers_.size());
  released_.assign(layers_.size(), Recompute::kNone);
  embed_ = part_.embed ? layout_.find("model.embed_tokens.weight").offset : -1;
  final_norm_ = part_.head ? layout_.find("model.norm.weight").offset : -1;
  lm_head_ = part_.head ? layout_.find("lm_head.weight").offset : -1;
}

template <typename T>
StageActivations<T> Model<T>::take_activations(int64_t first, int64_t last, bool embed, bool head) {
  check_blocks("take_activations", first, last);
  StageActivations<T> a;
  a.first = first;
  a.last = last;
  a.embed = embed;
  a.head = head;
  a.blocks.resize(size_t(last - first));
  a.released.resize(size_t(last - first));
  for (int64_t l = first; l < last; ++l) {
    std::swap(a.blocks[size_t(l - first)], saved_[size_t(l)]);
    a.released[size_t(l - first)] = released_[size_t(l)];
  }
  if (embed) a.inputs.swap(inputs_);
  if (head) std::swap(a.head_saved, head_);
  return a;
}

template <typename T>
void Model<T>::restore_activations(StageActivations<T>&& a) {
  check_blocks("restore_activations", a.first, a.last);
  MOE_CHECK(int64_t(a.blocks.size()) == a.last - a.first, "restore_activations: ", a.blocks.size(),
            " saved blocks for blocks [", a.first, ", ", a.last, ")");
  for (int64_t l = a.first; l < a.last; ++l) {
    saved_[size_t(l)] = std::move(a.blocks[size_t(l - a.first)]);
    released_[size_t(l)] = a.released[size_t(l - a.first)];
  }
  if (a.embed) inputs_ = std::move(a.inputs);
  if (a.head) head_ = std::move(a.head_saved);
}

template <typename T>
Model<T>::~Model() = default;

template <typename T>
void Model<T>::init_params(uint64_t seed) {
  const auto& entries = layout_.entries();
  for (size_t i = 0; i < entries.size(); ++i) {
    const ParamEntry& e = entries[i];
    T* p = params_.data() + e.offset;
    if (e.shape.size() == 1) {  // norm weights
      for (int64_t j = 0; j < e.numel; ++j) p[j] = T(1);
    } else {
      // The global tensor's stream from the local tensor's offset in it.
      fill_trunc_normal(p, e.numel, placements_[i].offset, seed, e.name, mcfg_.init_std);
    }
  }
  std::fill(expert_bias_.begin(), expert_bias_.end(), 0.f);
}

template <typename T>
void Model<T>::zero_grads() {
  std::fill(grads_.begin(), grads_.end(), T(0));
}

template <typename T>
ForwardStats Model<T>::forward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                               uint64_t routing_seed) {
  MOE_CHECK(batch > 0 && seq > 0, "forward: batch and sequence must be positive, got batch=", batch,
            " seq=", seq);
  MOE_CHECK(part_.whole(), "forward: this model holds one pipeline stage's layers; run its stage calls "
            "(embed_forward, forward_blocks, head_forward)");
  const int64_t n = batch * seq;
  batch_ = batch;
  seq_ = seq;
  ForwardStats stats;
  std::vector<T> x(n * mcfg_.d_model);
  embed_forward(inputs, n, x.data());
  forward_blocks(0, mcfg_.n_layers, batch, seq, routing_seed, x.data(), stats);
  if (num_moe_layers_ > 0) {
    stats.lb_loss /= double(num_moe_layers_);
    stats.z_loss /= double(num_moe_layers_);
  }
  head_forward(x.data(), targets, n, stats);
  timer_.stop();
  return stats;
}

template <typename T>
std::vector<T> Model<T>::decode(const int32_t* tokens, int64_t n, KvCache<T>& cache) {
  MOE_CHECK(!ep_, "decode: incremental decoding runs on one rank; this model shards its experts over ",
            ep_ ? ep_->size() : 1, " expert-parallel ranks");
  MOE_CHECK(n > 0, "decode: expected at least one token, got ", n);
  const int64_t d = mcfg_.d_model, v = mcfg_.vocab_size, nl = mcfg_.n_layers;
  for (int64_t i = 0; i < n; ++i)
    MOE_CHECK(tokens[i] >= 0 && tokens[i] < v, "decode: token ", i, " is ", tokens[i], ", not an id of this model: ",
              "expected [0, ", v, ") (model.vocab_size)");
  if (cache.k_LPC.empty()) {
    MOE_CHECK(cache.length == 0, "decode: a KV cache of length ", cache.length, " without buffers");
    cache.k_LPC.resize(nl);
    cache.v_LPC.resize(nl);
  }
  MOE_CHECK(int64_t(cache.k_LPC.size()) == nl && int64_t(cache.v_LPC.size()) == nl, "decode: the KV cache has ",
            cache.k_LPC.size(), " blocks, the model ", nl);
  const T* P = params_.data();
  std::vector<T> x(n * d);
  cpu::embedding_forward(tokens, P + embed_, x.data(), n, v, d);
  MoeLayerConfig dropless = moe_cfg_;
  dropless.capacity_factor = 0;
  for (int64_t l = 0; l < nl; ++l) {
    const LayerParams& p = layers_[l];
    attention_block_decode(attn_cfg_, attention_tensors(P, p), n, x.data(), cache.k_LPC[l], cache.v_LPC[l]);
    if (p.dense) {
      MlpBlockSaved<T> scratch;
      mlp_block_forward(mlp_tensors(P, p), n, d, p.mlp_hidden, mcfg_.norm_eps, x.data(), scratch, nullptr, fp8_ptr());
    } else {
      MoeLayerSaved<T> scratch;
      const float* bias = expert_bias_.data() + p.moe_index * ecfg_.num_experts;
      moe_layer_forward(dropless, moe_tensors(P, p), *experts_, bias, n, layer_routing_seed(0, static_cast<uint64_t>(l)),
                        x.data(), scratch);
    }
  }
  cache.length += n;
  LmHeadSaved<T> head;
  const std::vector<int32_t> no_targets(n, -1);
  lm_head_forward<T>({P + final_norm_, P + lm_head_}, x.data(), no_targets.data(), n, d, v, mcfg_.norm_eps, head);
  return std::move(head.logits_NV);
}

template <typename T>
void Model<T>::backward(const LossScales& scales) {
  MOE_CHECK(batch_ > 0, "backward called before forward");
  std::vector<T> dx(batch_ * seq_ * mcfg_.d_model);
  head_backward(scales, dx.data());
  backward_blocks(0, mcfg_.n_layers, scales, dx.data());
  embed_backward(dx.data());
  timer_.stop();
}

template <typename T>
void Model<T>::embed_forward(const int32_t* inputs, int64_t n, T* x) {
  MOE_CHECK(embed_ >= 0, "embed_forward: this pipeline stage's model does not hold the embedding");
  timer_.lap(Phase::kEmbedding);
  inputs_.assign(inputs, inputs + n);
  cpu::embedding_forward(inputs, params_.data() + embed_, x, n, mcfg_.vocab_size, mcfg_.d_model);
}

template <typename T>
void Model<T>::embed_backward(const T* dx) {
  MOE_CHECK(embed_ >= 0, "embed_backward: this pipeline stage's model does not hold the embedding");
  timer_.lap(Phase::kEmbedding);
  cpu::embedding_backward(inputs_.data(), dx, grads_.data() + embed_, static_cast<int64_t>(inputs_.size()),
                          mcfg_.vocab_size, mcfg_.d_model);
}

template <typename T>
void Model<T>::head_forward(const T* x, const int32_t* targets, int64_t n, ForwardStats& stats) {
  MOE_CHECK(lm_head_ >= 0, "head_forward: this pipeline stage's model does not hold the LM head");
  const T* P = params_.data();
  const LmHeadLoss loss = lm_head_forward<T>({P + final_norm_, P + lm_head_}, x, targets, n, mcfg_.d_model,
                                             mcfg_.vocab_size, mcfg_.norm_eps, head_, &timer_);
  stats.ce_sum = loss.ce_sum;
  stats.num_targets = loss.num_targets;
}

template <typename T>
void Model<T>::head_backward(const LossScales& scales, T* dx) {
  MOE_CHECK(!head_.targets_N.empty(), "head_backward: no saved head forward");
  const T* P = params_.data();
  T* G = grads_.data();
  lm_head_backward<T>({P + final_norm_, P + lm_head_}, head_, mcfg_.d_model, mcfg_.vocab_size, T(scales.ce_scale), dx,
                      {G + final_norm_, G + lm_head_}, &timer_);
}

template <typename T>
void Model<T>::check_blocks(const char* op, int64_t first, int64_t last) const {
  MOE_CHECK(0 <= first && first <= last && last <= mcfg_.n_layers, op, ": blocks [", first, ", ", last,
            ") must lie in [0, ", mcfg_.n_layers, ")");
  for (int64_t l = first; l < last; ++l)
    MOE_CHECK(layers_[size_t(l)].present, op, ": block ", l, " is not held by this pipeline stage's model");
}

// Block l: the attention block, then the dense MLP block or the MoE block. Returns the MoE block's
// stats (empty for a dense block).
template <typename T>
MoeLayerStats Model<T>::forward_block(int64_t l, int64_t batch, int64_t seq, uint64_t layer_seed, T* x) {
  const LayerParams& p = layers_[l];
  BlockSaved<T>& s = saved_[l];
  const T* P = params_.data();
  const int64_t n = batch * seq;
  attention_block_forward(attn_cfg_, attention_tensors(P, p), batch, seq, x, s.attn, &timer_);
  if (p.dense) {
    mlp_block_forward(mlp_tensors(P, p), n, mcfg_.d_model, p.mlp_hidden, mcfg_.norm_eps, x, s.mlp, &timer_, fp8_ptr());
    return {};
  }
  const float* bias = expert_bias_.data() + p.moe_index * ecfg_.num_experts;
  return moe_layer_forward(moe_cfg_, moe_tensors(P, p), *experts_, bias, n, layer_seed, x, s.moe, &timer_);
}

template <typename T>
void Model<T>::set_fp8(const cpu::Fp8Recipe* recipe) {
  if (recipe != nullptr) {
    MOE_CHECK((std::is_same_v<T, float>), "train.precision = \"fp8\": the CPU model emulates the FP8 recipe on "
              "FP32 tensors only");
    fp8_recipe_ = *recipe;
  }
  fp8_on_ = recipe != nullptr;
  attn_cfg_.fp8 = fp8_ptr();
  moe_cfg_.fp8 = fp8_ptr();
  experts_->set_fp8(fp8_ptr());
}

template <typename T>
void Model<T>::set_matmul_precision(const std::string& train_precision, const std::string& fp8_scaling) {
  const cpu::Fp8Recipe recipe = cpu::fp8_recipe_named(fp8_scaling);
  set_fp8(train_precision == "fp8" ? &recipe : nullptr);
}

template <typename T>
void Model<T>::set_recompute(Recompute mode) {
  recompute_ = mode;
  pool_ = BlockSaved<T>{};  // another mode pools another set of tensors
}

template <typename T>
int64_t Model<T>::saved_activation_bytes() const {
  int64_t bytes = saved_bytes(pool_);
  for (const BlockSaved<T>& s : saved_) bytes += saved_bytes(s);
  return bytes;
}

template <typename T>
void Model<T>::swap_pool(int64_t l, Recompute mode) {
  BlockSaved<T>& s = saved_[l];
  swap_recomputed(mode, s.attn, pool_.attn);
  if (layers_[l].dense) {
    swap_recomputed(mode, s.mlp, pool_.mlp);
  } else {
    swap_recomputed(mode, s.moe, pool_.moe);
  }
}

// Full: the attention block's forward again (its output, in the MLP/MoE block's input, is what
// that block recomputes from). Selective: the attention block's tensors before the kernel. Then
// the dense or MoE block's recomputation on the saved routing.
template <typename T>
void Model<T>::recompute_saved(int64_t l, Recompute mode) {
  const LayerParams& p = layers_[l];
  BlockSaved<T>& s = saved_[l];
  const T* P = params_.data();
  if (mode == Recompute::kFull) {
    std::vector<T>& x = p.dense ? s.mlp.x_in_ND : s.moe.x_in_ND;
    x.assign(s.attn.x_in_ND.begin(), s.attn.x_in_ND.end());
    attention_block_forward(attn_cfg_, attention_tensors(P, p), s.attn.batch, s.attn.seq, x.data(), s.attn, &timer_);
  } else {
    attention_block_recompute(attn_cfg_, attention_tensors(P, p), s.attn, &timer_);
  }
  if (p.dense) {
    mlp_block_recompute(mlp_tensors(P, p), mode, mcfg_.d_model, p.mlp_hidden, mcfg_.norm_eps, s.mlp, &timer_,
                        fp8_ptr());
  } else {
    moe_layer_recompute(moe_cfg_, moe_tensors(P, p), *experts_, mode, s.moe, &timer_);
  }
}

template <typename T>
void Model<T>::forward_blocks(int64_t first, int64_t last, int64_t batch, int64_t seq, uint64_t routing_seed, T* x,
                              ForwardStats& stats) {
  check_blocks("forward_blocks", first, last);
  for (int64_t l = first; l < last; ++l) {
    // Under recompute the block's forward writes the tensors it does not keep into the pool's
    // buffers and gives them back after; whatever the block held of them before is freed first.
    const Recompute mode = recompute_;
    if (mode != Recompute::kNone) {
      BlockSaved<T> stale;
      swap_recomputed(mode, saved_[l].attn, stale.attn);
      swap_recomputed(mode, saved_[l].mlp, stale.mlp);
      swap_recomputed(mode, saved_[l].moe, stale.moe);
    }
    swap_pool(l, mode);
    const MoeLayerStats ms = forward_block(l, batch, seq, layer_routing_seed(routing_seed, static_cast<uint64_t>(l)), x);
    swap_pool(l, mode);
    released_[l] = mode;
    if (layers_[l].dense) continue;
    stats.lb_loss += ms.lb_loss;
    stats.z_loss += ms.z_loss;
    stats.num_routes += ms.num_routes;
    stats.num_dropped += ms.num_dropped;
    stats.tokens_per_expert.push_back(ms.counts_E);
    stats.layer_lb_loss.push_back(ms.lb_loss);
    stats.layer_z_loss.push_back(ms.z_loss);
    stats.layer_dropped.push_back(ms.num_dropped);
  }
}

template <typename T>
void Model<T>::backward_blocks(int64_t first, int64_t last, const LossScales& scales, T* dx) {
  check_blocks("backward_blocks", first, last);
  const T* P = params_.data();
  T* G = grads_.data();
  const T dlb = num_moe_layers_ ? T(scales.lb_scale / double(num_moe_layers_)) : T(0);
  const T dz = num_moe_layers_ ? T(scales.z_scale / double(num_moe_layers_)) : T(0);
  for (int64_t l = last - 1; l >= first; --l) {
    const LayerParams& p = layers_[l];
    const BlockSaved<T>& s = saved_[l];
    MOE_CHECK(s.attn.batch > 0, "backward_blocks: block ", l, " has no saved forward");
    // What the block's forward did not keep: recomputed into the pool's buffers, given back after.
    const Recompute mode = released_[l];
    if (mode != Recompute::kNone) {
      swap_pool(l, mode);
      recompute_saved(l, mode);
    }
    if (p.dense) {
      mlp_block_backward(mlp_tensors(P, p), s.mlp, mcfg_.d_model, p.mlp_hidden, dx, mlp_tensors(G, p), &timer_,
                         fp8_ptr());
    } else {
      moe_layer_backward(moe_cfg_, moe_tensors(P, p), *experts_, s.moe, dlb, dz, dx, moe_tensors(G, p), &timer_);
    }
    attention_block_backward(attn_cfg_, attention_tensors(P, p), s.attn, dx, attention_tensors(G, p), &timer_);
    swap_pool(l, mode);
  }
}

template <typename T>
void Model<T>::recompute_block(int64_t l, T* x_out) {
  check_blocks("recompute_block", l, l + 1);
  const BlockSaved<T>& s = saved_[l];
  MOE_CHECK(s.attn.batch > 0, "recompute_block: block ", l, " has no saved forward");
  if (released_[l] != Recompute::kNone) {  // the pool's buffers stay with the block
    swap_pool(l, released_[l]);
    released_[l] = Recompute::kNone;
  }
  std::vector<T> x = s.attn.x_in_ND;
  forward_block(l, s.attn.batch, s.attn.seq, layers_[l].dense ? 0 : s.moe.router.seed, x.data());
  if (x_out) std::copy(x.begin(), x.end(), x_out);
}

void apply_expert_bias_update(std::vector<float>& bias, const std::vector<std::vector<int64_t>>& counts,
                              int64_t num_experts, double rate) {
  MOE_CHECK(bias.size() == counts.size() * static_cast<size_t>(num_experts), "expert-bias update: ", bias.size(),
            " biases for ", counts.size(), " MoE layers of ", num_experts, " experts");
  const int64_t e = num_experts;
  for (size_t m = 0; m < counts.size(); ++m) {
    MOE_CHECK(static_cast<int64_t>(counts[m].size()) == e, "expert-bias update: expected ", e, " counts");
    double mean = 0;
    for (int64_t c : counts[m]) mean += double(c);
    mean /= double(e);
    for (int64_t i = 0; i < e; ++i) {
      const double diff = mean - double(counts[m][size_t(i)]);
      const double sign = diff > 0 ? 1.0 : (diff < 0 ? -1.0 : 0.0);
      bias[m * size_t(e) + size_t(i)] += static_cast<float>(rate * sign);
    }
  }
}

template <typename T>
void Model<T>::update_expert_bias(const std::vector<std::vector<int64_t>>& counts, double rate) {
  MOE_CHECK(static_cast<int64_t>(counts.size()) == num_moe_layers_, "expert-bias update: expected counts for ",
            num_moe_layers_, " MoE layers, got ", counts.size());
  apply_expert_bias_update(expert_bias_, counts, ecfg_.num_experts, rate);
}

template class Model<float>;
template class Model<double>;

}  // namespace moe
