// LM head of the CPU model: logits = RMSNorm(x) W_head^T (final norm model.norm, untied head
// lm_head [V, D]), then per-token cross-entropy over the vocabulary (cpu/cross_entropy.h; targets
// < 0 do not count). Logits are materialised whole ([N, V], the CPU reference keeps them).
// Legend: N tokens, D model width, V vocabulary.
#pragma once

#include <cstdint>
#include <vector>

#include "core/phase_timer.h"

namespace moe {

// P = const T* (weights) or T* (gradients).
template <typename P>
struct LmHeadTensors {
  P final_norm, lm_head;  // [D], [V, D]
};

template <typename T>
struct LmHeadSaved {
  std::vector<T> x_in_ND;          // head input (the residual stream after the last block)
  std::vector<T> norm_ND, rstd_N;  // final norm output and its rstd
  std::vector<T> logits_NV, lse_N, loss_N;
  std::vector<int32_t> targets_N;
};

struct LmHeadLoss {
  double ce_sum = 0;        // sum of per-token cross-entropy over targets >= 0, in token order
  int64_t num_targets = 0;  // targets >= 0
};

template <typename T>
LmHeadLoss lm_head_forward(const LmHeadTensors<const T*>& w, const T* x_ND, const int32_t* targets_N, int64_t n,
                           int64_t d, int64_t v, double eps, LmHeadSaved<T>& saved, PhaseTimer* timer = nullptr);

// dx_ND [N, D] overwritten with the gradient of ce_scale * ce_sum; dw += ...
template <typename T>
void lm_head_backward(const LmHeadTensors<const T*>& w, const LmHeadSaved<T>& saved, int64_t d, int64_t v, T ce_scale,
                      T* dx_ND, const LmHeadTensors<T*>& dw, PhaseTimer* timer = nullptr);

}  // namespace moe
