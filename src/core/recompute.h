// Activation recomputation (train.recompute), one meaning on both backends. What a layer keeps
// from its forward for backward, by mode (docs/numerics.md has the table with sizes):
//   none       everything its backward reads.
//   selective  its input (and the MoE layer's input, the attention block's output); every norm's
//              rstd; the attention output and its log-sum-exp; the router's outputs (logits,
//              scores, top-k ids and weights, dropped routes) and the dispatch map; the gate/up
//              projection of every SwiGLU MLP (experts, shared expert, dense MLP). Backward first
//              recomputes the rest from those: the norm outputs, the q/k/v projections (with
//              QK-norm and RoPE), the dispatched rows, the SwiGLU outputs and the experts' down
//              projection outputs. No attention kernel and no gate/up GEMM run twice.
//   full       its input (on the GPU also the FP32 residual stream at it) and the routing
//              decision (the router's outputs and the dispatch map); backward re-runs the whole
//              layer's forward from them before its backward.
// Routing is never decided again: a recomputed forward reuses the saved top-k ids, weights and
// dispatch map, so recomputation changes no value (bitwise on the CPU). The recomputed tensors
// of all layers share one set of buffers: only one layer's worth exists at a time.
#pragma once

#include <cstdint>
#include <string>

namespace moe {

enum class Recompute { kNone, kSelective, kFull };

// "none" | "selective" | "full"; throws naming train.recompute and the accepted values otherwise.
Recompute parse_recompute(const std::string& mode);
const char* recompute_name(Recompute mode);

// Bytes the vectors hold (their capacity, not their size): what saved activations really occupy.
template <typename... V>
int64_t held_bytes(const V&... v) {
  return (int64_t{0} + ... + static_cast<int64_t>(v.capacity() * sizeof(typename V::value_type)));
}

}  // namespace moe
