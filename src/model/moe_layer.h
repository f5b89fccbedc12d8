// MoE block of a pre-norm decoder layer on the CPU ops: x += MoE(h) + SharedMLP(h), h = RMSNorm(x).
// MoE: router (scores, selection-only expert bias, top-k weights, lb/z losses) -> dispatch handle
// (stable counting sort of the N*K routes by expert, optional capacity) -> permute into expert-sorted
// rows -> experts (model/experts.h: local or expert-parallel) -> combine (weighted unpermute).
// Backward of dispatch is a combine and vice versa. Row-major activations, token t = b*S + s.
// Legend: N tokens, D model width, E experts, K top_k, R routed rows (N*K, or kept rows), I expert
// hidden, F shared MLP hidden, L experts this rank holds.
#pragma once

#include <cstdint>
#include <vector>

#include "core/config.h"
#include "core/phase_timer.h"
#include "core/recompute.h"
#include "cpu/router.h"
#include "model/experts.h"
#include "model/layout.h"
#include "model/mlp.h"

namespace moe {

// Resolved once from the config; only the token count and the routing seed change per forward.
struct MoeLayerConfig {
  cpu::RouterParams router;   // d_model, num_experts, top_k, score, norm_topk, mode (num_tokens, seed: 0)
  int64_t expert_hidden = 0;  // I
  int64_t shared_hidden = 0;  // F = shared_experts * I; 0: no shared expert
  double capacity_factor = 0; // 0: dropless
  double norm_eps = 1e-5;
  const cpu::Fp8Recipe* fp8 = nullptr;  // the shared expert's projections in the FP8 recipe (emulated); null: FP32
};
MoeLayerConfig moe_layer_config(const ModelConfig& m, const MoeConfig& e);

// The block's tensors in a flat buffer: P = const T* (weights) or T* (gradients). The shared
// expert's are null without one.
template <typename P>
struct MoeTensors {
  P mlp_norm, router;              // [D], [E, D]
  P experts_gate_up, experts_down; // [L, 2I, D], [L, D, I]
  P mlp_gate, mlp_up, mlp_down;    // shared expert: [F, D], [F, D], [D, F]
};
template <typename T>
MoeTensors<T*> moe_tensors(T* base, const LayerParams& p) {
  return {tensor_at(base, p.mlp_norm),        tensor_at(base, p.router),  tensor_at(base, p.experts_gate_up),
          tensor_at(base, p.experts_down),    tensor_at(base, p.mlp_gate), tensor_at(base, p.mlp_up),
          tensor_at(base, p.mlp_down)};
}

// Where each (token, slot) route's row sits in the expert-sorted buffer. Route r = t*K + j.
struct DispatchHandle {
  std::vector<int32_t> counts_E;        // [E] routes per expert (the router's, before capacity)
  std::vector<int32_t> offsets_E1;      // [E + 1] expert e owns sorted rows [offsets[e], offsets[e+1])
  std::vector<int32_t> sorted_route_R;  // [N*K] route of each sorted row (kept rows first)
  std::vector<int32_t> route_to_row_R;  // [N*K] sorted row of each route; -1 when dropped
  std::vector<int32_t> kept_E;          // [E] rows each expert keeps (capacity_factor > 0 only)
  int64_t num_rows = 0;                 // R: rows the experts run (N*K when dropless)
};

template <typename T>
struct MoeLayerSaved {
  std::vector<T> x_in_ND;          // block input (the residual stream)
  std::vector<T> norm_ND, rstd_N;  // mlp_norm output (the router's and experts' input) and its rstd
  cpu::RouterParams router;        // this forward's: token count and routing seed set
  std::vector<T> logits_NE, scores_NE, topk_w_NK;
  std::vector<int32_t> topk_idx_NK;
  DispatchHandle dispatch;
  ExpertsSaved<T> experts;
  std::vector<T> y_sorted_RD;      // expert outputs in sorted rows (combine's backward reads them)
  MlpSaved<T> shared;              // shared expert
};

struct MoeLayerStats {
  double lb_loss = 0, z_loss = 0;  // the router's losses (cpu/router.h)
  int64_t num_routes = 0;          // N*K
  int64_t num_dropped = 0;         // routes dropped by capacity
  std::vector<int32_t> counts_E;   // routes per expert, before capacity
};

// x_ND [N, D] in place: x += branch. expert_bias_E [E]: selection-only bias (may be null).
// routing_seed: this layer's (random routing). Saves what backward needs, x_in_ND included; run
// again on saved.x_in_ND with the same seed and bias it saves bitwise the same. Under expert
// parallelism a collective over the experts' EP group.
template <typename T>
MoeLayerStats moe_layer_forward(const MoeLayerConfig& c, const MoeTensors<const T*>& w, const Experts<T>& experts,
                                const float* expert_bias_E, int64_t n, uint64_t routing_seed, T* x_ND,
                                MoeLayerSaved<T>& saved, PhaseTimer* timer = nullptr);

// Bytes the saved tensors hold (core/recompute.h: held_bytes), the routing and dispatch map included.
template <typename T>
int64_t saved_bytes(const MoeLayerSaved<T>& s);

// Activation recomputation (core/recompute.h). Exchanges between a and b the tensors `mode` does
// not keep: selective norm_ND, experts.x_GD, experts.h_GI, y_sorted_RD and shared.h_NF; full also
// x_in_ND, rstd_N, experts.gate_up_G2I and shared.gate_up_N2F. Never the routing (router params,
// logits, scores, top-k ids and weights), the dispatch map or the experts' layout and exchange
// handle. kNone exchanges nothing.
template <typename T>
void swap_recomputed(Recompute mode, MoeLayerSaved<T>& a, MoeLayerSaved<T>& b);

// Recomputes what `mode` does not keep from saved.x_in_ND, the block's input (kept by selective;
// under full the caller writes it, the recomputed attention block's output), with the saved
// routing: the norm output (selective with the saved rstd; full rstd too), the dispatched rows,
// the experts (Experts::recompute: gate/up under full only; under expert parallelism the rows are
// exchanged again, a collective), the shared expert's gate/up (full only) and SwiGLU output;
// bitwise the forward's values. The router does not run (no selection, no lb/z losses, no
// counts) and the block's output is not formed again.
template <typename T>
void moe_layer_recompute(const MoeLayerConfig& c, const MoeTensors<const T*>& w, const Experts<T>& experts,
                         Recompute mode, MoeLayerSaved<T>& saved, PhaseTimer* timer = nullptr);

// dx_ND [N, D] in place: the gradient at the block's output in, at its input out. dlb, dz: the
// loss's derivatives by this layer's lb_loss and z_loss. dw += ...
template <typename T>
void moe_layer_backward(const MoeLayerConfig& c, const MoeTensors<const T*>& w, const Experts<T>& experts,
                        const MoeLayerSaved<T>& saved, T dlb, T dz, T* dx_ND, const MoeTensors<T*>& dw,
                        PhaseTimer* timer = nullptr);

}  // namespace moe
