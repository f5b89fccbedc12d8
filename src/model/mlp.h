// SwiGLU MLP with separate gate/up weights (dense layers and the shared expert):
// out = (silu(x Wg^T) * (x Wu^T)) Wd^T. Legend: N tokens, D model width, F hidden width.
// Weights are [F, D] (gate, up) and [D, F] (down); gate and up outputs share one [N, 2F]
// buffer (gate columns first) so that cpu::swiglu applies directly. The dense MLP block of a
// pre-norm layer is x += MLP(RMSNorm(x)) (mlp_block_*); the MoE layer uses mlp_* for its shared expert.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/fp8.h"
#include "core/phase_timer.h"
#include "core/recompute.h"
#include "model/layout.h"

namespace moe {

template <typename T>
struct MlpSaved {
  std::vector<T> gate_up_N2F;
  std::vector<T> h_NF;
};

// out (+= when accumulate) = MLP(x). fp8 (every function here; null: FP32): the three projections
// in the FP8 recipe, emulated (cpu/linear_precision.h).
template <typename T>
void mlp_forward(const T* x_ND, const T* w_gate_FD, const T* w_up_FD, const T* w_down_DF, int64_t n,
                 int64_t d, int64_t f, MlpSaved<T>& saved, T* out_ND, bool accumulate,
                 const cpu::Fp8Recipe* fp8 = nullptr);

// What mlp_forward saves (gate/up projection, unless gate_up_kept: saved.gate_up_N2F is kept; the
// SwiGLU output) with the same calls, bitwise its values; the down projection is not formed
// (activation recomputation: backward does not read it).
template <typename T>
void mlp_recompute(const T* x_ND, const T* w_gate_FD, const T* w_up_FD, int64_t n, int64_t d, int64_t f,
                   bool gate_up_kept, MlpSaved<T>& saved, const cpu::Fp8Recipe* fp8 = nullptr);

// dx += ..., parameter gradients += ...
template <typename T>
void mlp_backward(const T* x_ND, const T* w_gate_FD, const T* w_up_FD, const T* w_down_DF,
                  const MlpSaved<T>& saved, const T* dout_ND, int64_t n, int64_t d, int64_t f,
                  T* dx_ND, T* dw_gate, T* dw_up, T* dw_down, const cpu::Fp8Recipe* fp8 = nullptr);

// The dense block's tensors in a flat buffer: P = const T* (weights) or T* (gradients).
template <typename P>
struct MlpTensors {
  P mlp_norm, mlp_gate, mlp_up, mlp_down;  // [D], [F,D], [F,D], [D,F]
};
template <typename T>
MlpTensors<T*> mlp_tensors(T* base, const LayerParams& p) {
  return {tensor_at(base, p.mlp_norm), tensor_at(base, p.mlp_gate), tensor_at(base, p.mlp_up),
          tensor_at(base, p.mlp_down)};
}

template <typename T>
struct MlpBlockSaved {
  int64_t num_tokens = 0;
  std::vector<T> x_in_ND;          // block input (the residual stream)
  std::vector<T> norm_ND, rstd_N;  // mlp_norm output and its rstd
  MlpSaved<T> mlp;
};

// Dense block, x_ND [N, D] in place: x += MLP(RMSNorm(x)) (the residual add is the down GEMM's
// accumulate). Saves what backward needs, x_in_ND included.
template <typename T>
void mlp_block_forward(const MlpTensors<const T*>& w, int64_t n, int64_t d, int64_t f, double eps, T* x_ND,
                       MlpBlockSaved<T>& saved, PhaseTimer* timer = nullptr, const cpu::Fp8Recipe* fp8 = nullptr);

// Bytes the saved tensors hold (core/recompute.h: held_bytes).
template <typename T>
int64_t saved_bytes(const MlpSaved<T>& s) {
  return held_bytes(s.gate_up_N2F, s.h_NF);
}
template <typename T>
int64_t saved_bytes(const MlpBlockSaved<T>& s) {
  return held_bytes(s.x_in_ND, s.norm_ND, s.rstd_N) + saved_bytes(s.mlp);
}

// Activation recomputation (core/recompute.h). Exchanges between a and b the tensors `mode` does
// not keep: selective norm_ND and mlp.h_NF; full also x_in_ND, rstd_N and mlp.gate_up_N2F (every
// tensor). kNone exchanges nothing.
template <typename T>
void swap_recomputed(Recompute mode, MlpBlockSaved<T>& a, MlpBlockSaved<T>& b);

// Recomputes what `mode` does not keep from saved.x_in_ND, the block's input (kept by selective;
// under full the caller writes it, the recomputed attention block's output): the norm output
// (selective with the saved rstd; full rstd too), the gate/up projection (full only) and the
// SwiGLU output, bitwise the forward's values. The block's output is not formed again.
template <typename T>
void mlp_block_recompute(const MlpTensors<const T*>& w, Recompute mode, int64_t d, int64_t f, double eps,
                         MlpBlockSaved<T>& saved, PhaseTimer* timer = nullptr, const cpu::Fp8Recipe* fp8 = nullptr);

// dx_ND [N, D] in place: the gradient at the block's output in, at its input out. dw += ...
template <typename T>
void mlp_block_backward(const MlpTensors<const T*>& w, const MlpBlockSaved<T>& saved, int64_t d, int64_t f,
                        T* dx_ND, const MlpTensors<T*>& dw, PhaseTimer* timer = nullptr,
                        const cpu::Fp8Recipe* fp8 = nullptr);

}  // namespace moe
