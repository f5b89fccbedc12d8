// The model's parameter plan: every tensor's HF-style name and shape in one flat layout
// (core/arena.h), plus the counts users ask for before launch: total and active parameters and
// training FLOPs per token (the formula of docs/architecture.md). Under expert parallelism a
// rank's layout holds only its experts' rows (dim 0) of the stacked expert tensors; where such a
// local tensor sits in its global tensor is global_placement (parallel/topology.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/config.h"
#include "core/moe_types.h"

namespace moe {

// True when layer `l` uses a dense MLP (its index is in model.dense_layers).
bool is_dense_layer(const ModelConfig& m, int64_t l);
int64_t num_moe_layers(const ModelConfig& m);

// Name prefix of layer l: "model.layers.<l>."
std::string layer_prefix(int64_t l);

// Which tensors a layout holds: by default every layer, the embedding and the final norm + LM
// head; a pipeline stage's layout holds only its layers (and the embedding on the first stage,
// the head on the last), in the same order and with the same names.
struct LayoutPart {
  std::vector<char> layers;  // empty: every layer; else one flag per layer
  bool embed = true, head = true;
  bool holds(int64_t l) const { return layers.empty() || layers[size_t(l)] != 0; }
  bool whole() const;
};

// Global layout when `slice` is empty; otherwise mlp.experts.gate_up_proj is [count, 2I, D] and
// mlp.experts.down_proj [count, D, I] (rows first..first+count-1 of the global tensors), names
// unchanged. Checks that the slice lies inside [0, num_experts).
// Only the tensors of `part`.
ParamLayout build_param_layout(const ModelConfig& m, const MoeConfig& e, const ExpertSlice& slice = {},
                               const LayoutPart& part = {});

// Flat ranges [begin, end) of the layout (alignment padding included, adjacent entries merged)
// holding expert tensors (expert == true) or every other tensor (expert == false). Together they
// tile [0, total_numel()). Under EP, expert ranges are reduced over the ranks holding the same
// experts (the ep-dp group), the others over all data-parallel ranks.
struct FlatRange {
  int64_t begin = 0;
  int64_t end = 0;
};
std::vector<FlatRange> flat_ranges(const ParamLayout& layout, bool expert);

// Flat offsets where the gradient groups begin, in layout order: [0] the embedding (offset 0),
// [l + 1] block l, [n_layers + 1] the final norm and LM head. Backward finishes them in the reverse
// order, so after group g every offset >= start[g] is final (data-parallel overlap). Throws when
// the layout holds the tensors in another order.
std::vector<int64_t> grad_group_starts(const ParamLayout& layout, int64_t n_layers);

struct ModelCounts {
  int64_t total_params = 0;   // every parameter
  int64_t active_params = 0;  // parameters one token touches (top_k experts, not all E)
  double flops_per_token = 0; // forward + backward, 6 * matmul params touched + attention
};
ModelCounts count_model(const ModelConfig& m, const MoeConfig& e, int64_t seq_len);

}  // namespace moe

namespace moe {
// Offsets (in the flat layout) of one block's tensors, shared by the CPU and GPU models.
// -1 marks a tensor the block does not have.
struct LayerParams {
  // Attention: input_layernorm, q/k/v/o projections, QK-norm weights (-1 without qk_norm).
  int64_t attn_norm = 0, q_proj = 0, k_proj = 0, v_proj = 0, o_proj = 0, q_norm = -1, k_norm = -1;
  int64_t mlp_norm = 0;                               // post_attention_layernorm
  int64_t mlp_gate = -1, mlp_up = -1, mlp_down = -1;  // dense MLP or shared expert
  int64_t router = -1, experts_gate_up = -1, experts_down = -1;  // MoE router (mlp.gate) and experts
  bool dense = false, shared = false;
  int64_t moe_index = -1;  // index among MoE layers (of the whole model, also on a pipeline stage)
  bool present = true;     // false: the layout does not hold the layer (another pipeline stage's)
  int64_t mlp_hidden = 0;  // dense_hidden or shared_experts * expert_hidden
};
// One per layer of the model; a layer the layout does not hold has present = false and -1 offsets.
std::vector<LayerParams> layer_params(const ParamLayout& layout, const ModelConfig& m, const MoeConfig& e);
// The tensor at `offset` of a flat buffer (parameters or gradients), or null for -1 (absent).
template <typename T>
T* tensor_at(T* base, int64_t offset) {
  return offset < 0 ? nullptr : base + offset;
}
}  // namespace moe
