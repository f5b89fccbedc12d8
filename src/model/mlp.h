// SwiGLU MLP with separate gate/up weights (dense layers and the shared expert):
// out = (silu(x Wg^T) * (x Wu^T)) Wd^T. Legend: N tokens, D model width, F hidden width.
// Weights are [F, D] (gate, up) and [D, F] (down); gate and up outputs share one [N, 2F]
// buffer (gate columns first) so that cpu::swiglu applies directly.
#pragma once

#include <cstdint>
#include <vector>

namespace moe {

template <typename T>
struct MlpSaved {
  std::vector<T> gate_up_N2F;
  std::vector<T> h_NF;
};

// out (+= when accumulate) = MLP(x).
template <typename T>
void mlp_forward(const T* x_ND, const T* w_gate_FD, const T* w_up_FD, const T* w_down_DF, int64_t n,
                 int64_t d, int64_t f, MlpSaved<T>& saved, T* out_ND, bool accumulate);

// dx += ..., parameter gradients += ...
template <typename T>
void mlp_backward(const T* x_ND, const T* w_gate_FD, const T* w_up_FD, const T* w_down_DF,
                  const MlpSaved<T>& saved, const T* dout_ND, int64_t n, int64_t d, int64_t f,
                  T* dx_ND, T* dw_gate, T* dw_up, T* dw_down);

}  // namespace moe
