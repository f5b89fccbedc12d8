// The OLMoE-style decoder-only MoE transformer on the CPU reference ops, with explicit
// forward and backward as a list of block calls: embedding, then per layer (a block) the attention
// block (model/attention_block.h) and the dense MLP block (model/mlp.h) or the MoE block
// (model/moe_layer.h), then the LM head (model/lm_head.h). Parameters and gradients live in two
// flat buffers laid out by build_param_layout. Expert parallelism (Model<float>): with an EP group
// of ep > 1 ranks the layout holds only this rank's E/ep experts per MoE layer and every MoE layer
// runs its experts through the exchange (model/ep_experts.h); everything else is replicated and
// sees only local tokens. Activation recomputation (set_recompute, core/recompute.h): each block's
// forward keeps only what the mode keeps, and backward_blocks recomputes the rest of a block right
// before its backward, in one pooled set of buffers that every block borrows in turn.
// Legend: B batch, S sequence, N = B*S tokens, D model width, V vocabulary, E experts.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/config.h"
#include "core/phase_timer.h"
#include "core/recompute.h"
#include "model/attention_block.h"
#include "model/experts.h"
#include "model/layout.h"
#include "model/lm_head.h"
#include "model/mlp.h"
#include "model/moe_layer.h"
#include "parallel/expert_parallel.h"
#include "parallel/topology.h"

namespace moe {

struct ForwardStats {
  double ce_sum = 0;        // sum of per-token cross-entropy over targets >= 0
  int64_t num_targets = 0;  // tokens that count towards the loss
  double lb_loss = 0;       // load-balancing loss, mean over MoE layers
  double z_loss = 0;        // router z-loss, mean over MoE layers
  int64_t num_routes = 0;   // (token, slot) pairs over MoE layers
  int64_t num_dropped = 0;  // of which dropped by expert capacity (capacity_factor > 0)
  // Routed (token, slot) pairs per expert (before capacity dropping), one vector of E counts per
  // MoE layer: this rank's tokens over all E global experts, also under expert parallelism.
  std::vector<std::vector<int32_t>> tokens_per_expert;
  // Each MoE layer's own figures, in the same order: its router's losses and dropped routes.
  std::vector<double> layer_lb_loss, layer_z_loss;
  std::vector<int64_t> layer_dropped;
};

// What backward differentiates: ce_scale * ce_sum + lb_scale * lb_loss + z_scale * z_loss.
struct LossScales {
  double ce_scale = 1;
  double lb_scale = 0;
  double z_scale = 0;
  double objective(const ForwardStats& s) const {
    return ce_scale * s.ce_sum + lb_scale * s.lb_loss + z_scale * s.z_loss;
  }
};

// What block (decoder layer) l saved in the last forward: its attention block and, by the layer's
// kind, its dense MLP block or its MoE block. attn.x_in_ND is the block's input.
template <typename T>
struct BlockSaved {
  AttentionSaved<T> attn;
  MlpBlockSaved<T> mlp;  // dense layers
  MoeLayerSaved<T> moe;  // MoE layers
};

// Bytes the saved tensors of one block hold (core/recompute.h: held_bytes).
template <typename T>
int64_t saved_bytes(const BlockSaved<T>& s) {
  return saved_bytes(s.attn) + saved_bytes(s.mlp) + saved_bytes(s.moe);
}

// What a forward of a pipeline stage's blocks (and its embedding / head) saved for backward, moved
// out of the model (Model::take_activations) so that the next micro-batch's forward can run while
// this one waits for its backward (1F1B keeps up to pp micro-batches in flight per stage).
template <typename T>
struct StageActivations {
  int64_t first = 0, last = 0;
  bool embed = false, head = false;
  std::vector<BlockSaved<T>> blocks;  // blocks [first, last)
  std::vector<Recompute> released;
  std::vector<int32_t> inputs;  // embed: the token ids
  LmHeadSaved<T> head_saved;
};

// Keys (after QK-norm and RoPE) and values of the positions Model::decode has run, one
// [length, C] buffer per block (C = n_kv_heads * head_dim). Empty: nothing decoded yet.
template <typename T>
struct KvCache {
  int64_t length = 0;  // positions held
  std::vector<std::vector<T>> k_LPC, v_LPC;
};

// The aux-loss-free bias update of every MoE layer: bias[m * E + e] += rate * sign(mean_m - count_m,e)
// from the step's token counts per expert (the formula of Model::update_expert_bias, shared with the
// GPU pipeline step, which keeps its own copy of the biases).
void apply_expert_bias_update(std::vector<float>& bias, const std::vector<std::vector<int64_t>>& counts,
                              int64_t num_experts, double rate);

template <typename T>
class Model {
 public:
  // ep: this rank's expert-parallel context (copied; its communicator must outlive the model),
  // or null. With ep->size() > 1 (Model<float> only, dropless only) the layout holds experts
  // [ep->first_expert(), + ep->local_experts()) of every MoE layer, and forward/backward are
  // collectives over ep->group: every rank of the group calls them in the same order.
  // part: the tensors this model holds (model/layout.h); a pipeline stage's model holds its
  // layers only and runs only them (forward_blocks / backward_blocks on its layers, the
  // embedding and head calls when it holds them); forward() and backward() need the whole model.
  Model(const ModelConfig& model, const MoeConfig& moe, const ExpertParallel* ep = nullptr,
        const LayoutPart& part = {});
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& model_config() const { return mcfg_; }
  const MoeConfig& moe_config() const { return ecfg_; }
  const ParamLayout& layout() const { return layout_; }
  // Per layout entry, in entry order: its global shape and the flat offset of the local tensor in
  // it (global_placement with this model's ep size and rank; expert tensors under EP sit at their
  // experts' rows, every other tensor is whole at offset 0). Checkpoints and resume use it.
  const std::vector<GlobalPlacement>& placements() const { return placements_; }
  // The expert-parallel context, or null when the experts are not sharded (no EP or ep == 1).
  const ExpertParallel* expert_parallel() const { return ep_ ? &*ep_ : nullptr; }
  // Global experts this rank holds ({0, E} without expert parallelism).
  ExpertSlice expert_slice() const { return slice_; }
  T* params() { return params_.data(); }
  T* grads() { return grads_.data(); }
  const T* params() const { return params_.data(); }
  int64_t num_moe_layers() const { return num_moe_layers_; }
  // Selection-only expert bias (aux-loss-free balancing): [num_moe_layers, E], FP32.
  std::vector<float>& expert_bias() { return expert_bias_; }
  const std::vector<float>& expert_bias() const { return expert_bias_; }

  // Weights ~ truncated N(0, init_std) by (seed, name, global index); norm weights = 1. A local
  // expert slice gets exactly the values of the same rows of the global tensor.
  void init_params(uint64_t seed);
  void zero_grads();
  // Frees the gradient buffer of a model that only mirrors another backend's weights (the GPU
  // trainer's host copy for checkpoints): grads() is then null, and backward must not run.
  void release_grads() { std::vector<T>().swap(grads_); }

  // inputs/targets: [B, S] token ids; targets < 0 do not count. Saves what backward needs.
  // routing_seed drives random routing (mixed with the layer index).
  ForwardStats forward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                       uint64_t routing_seed = 0);
  // Accumulates (+=) the gradient of scales.objective(stats) into grads().
  void backward(const LossScales& scales);

  // Incremental decoding of one sequence (generation): tokens [n] at positions cache.length ..
  // cache.length + n - 1 run through every block with attention over the cache and themselves
  // (attention_block_decode), the dense MLP blocks, and the MoE blocks on the new tokens alone
  // (dropless: moe.capacity_factor does not apply, every route is kept; routing seed 0, as
  // forward's default), then the final norm and LM head; the new positions' K/V are appended to
  // the cache. Returns the logits [n, V] of the new positions. Touches none of forward's saved
  // state. Learned (and dropless) routing is per token, so the logits of position p equal those
  // forward() of the whole sequence gives at p, to rounding (tests/e2e/generate_test.cpp holds
  // them to 1e-5). Not under expert parallelism (a single-rank path). Ids are checked against
  // model.vocab_size.
  std::vector<T> decode(const int32_t* tokens, int64_t n, KvCache<T>& cache);

  // The block calls forward() and backward() are made of, for callers that run part of the model
  // (a pipeline stage: the embedding, a contiguous range of blocks, the LM head). x_ND and dx_ND
  // are the residual stream [N, D] and its gradient, N = batch * seq. Under expert parallelism
  // the MoE blocks are collectives over the EP group.
  // x_ND = embed_tokens[inputs], inputs [N] (kept for embed_backward).
  void embed_forward(const int32_t* inputs, int64_t n, T* x_ND);
  // Blocks [first, last) in order, x_ND in place, each saving its activations. Adds each MoE
  // block's router losses (sums over the blocks: forward() divides them by num_moe_layers()),
  // routes, dropped routes and counts (one entry per MoE block, in order) to stats.
  void forward_blocks(int64_t first, int64_t last, int64_t batch, int64_t seq, uint64_t routing_seed, T* x_ND,
                      ForwardStats& stats);
  // Final norm, LM head, cross-entropy on x_ND; sets stats.ce_sum and stats.num_targets.
  void head_forward(const T* x_ND, const int32_t* targets, int64_t n, ForwardStats& stats);
  // dx_ND (overwritten) = gradient of scales.ce_scale * ce_sum at the head's input; dW += ...
  void head_backward(const LossScales& scales, T* dx_ND);
  // Blocks last-1 down to first, dx_ND in place (the gradient at block last-1's output in, at
  // block first's input out); lb/z gradients use scales / num_moe_layers(). dW += ...
  void backward_blocks(int64_t first, int64_t last, const LossScales& scales, T* dx_ND);
  // Embedding gradient (+=) from dx_ND at the first block's input.
  void embed_backward(const T* dx_ND);
  // Moves out what the last forward of blocks [first, last) (and the embedding / head when
  // asked) saved; the model's slots are left empty (a backward before restore_activations fails).
  StageActivations<T> take_activations(int64_t first, int64_t last, bool embed, bool head);
  // Moves `a` back in (what those slots held is dropped); the next backward of those blocks uses it.
  void restore_activations(StageActivations<T>&& a);
  const LayoutPart& part() const { return part_; }

  // Runs block l's forward again from its saved input (block_saved(l).attn.x_in_ND, with the
  // same shape, routing seed and the current expert bias), router included, overwriting its saved
  // activations with bitwise the same values; x_out_ND (optional) receives its output. Stats are
  // not re-counted. Afterwards block l holds all of its activations, whatever the recompute mode
  // its forward ran under (backward then recomputes nothing for it).
  void recompute_block(int64_t l, T* x_out_ND = nullptr);

  // Activation recomputation (train.recompute; core/recompute.h has what each mode keeps), kNone
  // by default; it takes effect from the next forward (a block's backward follows the mode its
  // forward ran under). Under selective or full every block's forward keeps only what the mode
  // keeps; the rest lives in one pooled set of buffers (one attention block, one dense MLP block,
  // one MoE block) that each block's forward, and each block's recomputation in backward_blocks,
  // borrows in turn. The recomputation reuses the saved routing (no router selection, lb/z losses
  // or counts again) and, under expert parallelism, exchanges the rows again (a collective, in
  // backward's block order on every rank). Gradients are bitwise those of kNone.
  void set_recompute(Recompute mode);
  // train.precision = "fp8" on the CPU: the attention projections, dense and shared MLPs and the
  // routed experts' GEMMs in the FP8 recipe, emulated (cpu/linear_precision.h: operands quantised
  // as the recipe says, FP32 GEMMs); the router, the attention core and the LM head stay FP32. For
  // float models without expert parallelism (refused otherwise, naming the reason); null: FP32.
  void set_fp8(const cpu::Fp8Recipe* recipe);
  // set_fp8 from train.precision and train.fp8_scaling: "fp8" the recipe of E4M3 forward and
  // gradients in the scaling fp8_scaling names (cpu::fp8_recipe_named), any other precision FP32
  // (a checkpoint trained in bf16 on the GPU runs in FP32 here).
  void set_matmul_precision(const std::string& train_precision, const std::string& fp8_scaling = "blocks");
  bool fp8() const { return fp8_on_; }
  Recompute recompute() const { return recompute_; }
  // Bytes the blocks' saved activations hold now (every block's plus the pool's; vector capacity,
  // so released memory counts as released), not the LM head's. After a forward: smaller under
  // selective than none, smaller still under full (with more than a couple of layers).
  int64_t saved_activation_bytes() const;
  const BlockSaved<T>& block_saved(int64_t l) const { return saved_.at(l); }
  const LmHeadSaved<T>& head_saved() const { return head_; }

  // Per-phase wall time of forward/backward (off unless enabled).
  PhaseTimer& timer() { return timer_; }

  // Logits [N, V] of the last forward.
  const std::vector<T>& logits() const { return head_.logits_NV; }

  // bias_e += rate * sign(mean_count - count_e) per MoE layer, from counts summed over a step.
  void update_expert_bias(const std::vector<std::vector<int64_t>>& counts, double rate);

 private:
  MoeLayerStats forward_block(int64_t l, int64_t batch, int64_t seq, uint64_t layer_seed, T* x_ND);
  void check_blocks(const char* op, int64_t first, int64_t last) const;
  // Exchanges the tensors `mode` does not keep between block l's saved activations and the pool.
  void swap_pool(int64_t l, Recompute mode);
  // Rebuilds block l's tensors that `mode` did not keep (the pool's storage swapped in).
  void recompute_saved(int64_t l, Recompute mode);

  ModelConfig mcfg_;
  MoeConfig ecfg_;
  LayoutPart part_;
  std::optional<ExpertParallel> ep_;
  ExpertSlice slice_;
  ParamLayout layout_;
  std::vector<GlobalPlacement> placements_;
  int64_t num_moe_layers_ = 0;
  std::vector<T> params_, grads_;
  std::vector<float> expert_bias_;
  PhaseTimer timer_;
  // Block settings, resolved once.
  AttentionConfig attn_cfg_;
  MoeLayerConfig moe_cfg_;
  std::unique_ptr<Experts<T>> experts_;  // LocalExperts, or EpExperts under expert parallelism
  std::vector<LayerParams> layers_;
  int64_t embed_ = 0, final_norm_ = 0, lm_head_ = 0;  // flat offsets
  // Saved activations of the last forward.
  int64_t batch_ = 0, seq_ = 0;
  std::vector<int32_t> inputs_;
  std::vector<BlockSaved<T>> saved_;
  LmHeadSaved<T> head_;
  // Activation recomputation: the mode of the next forward; per block, the mode its last forward
  // released under (kNone: it holds everything); the pooled buffers of what is recomputed.
  Recompute recompute_ = Recompute::kNone;
  bool fp8_on_ = false;
  cpu::Fp8Recipe fp8_recipe_;
  const cpu::Fp8Recipe* fp8_ptr() const { return fp8_on_ ? &fp8_recipe_ : nullptr; }
  std::vector<Recompute> released_;
  BlockSaved<T> pool_;
};

}  // namespace moe
