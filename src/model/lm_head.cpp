// LM head forward/backward: final RMSNorm, head GEMM, cross-entropy; backward in reverse.
#include "model/lm_head.h"

#include "cpu/cross_entropy.h"
#include "cpu/linear.h"
#include "cpu/rmsnorm.h"

namespace moe {

template <typename T>
LmHeadLoss lm_head_forward(const LmHeadTensors<const T*>& w, const T* x, const int32_t* targets, int64_t n, int64_t d,
                           int64_t v, double eps, LmHeadSaved<T>& s, PhaseTimer* timer) {
  if (timer) timer->lap(Phase::kLmHead);
  s.x_in_ND.assign(x, x + n * d);
  s.targets_N.assign(targets, targets + n);
  s.norm_ND.resize(n * d);
  s.rstd_N.resize(n);
  cpu::rmsnorm_forward(x, w.final_norm, s.norm_ND.data(), s.rstd_N.data(), n, d, eps);
  s.logits_NV.resize(n * v);
  cpu::linear_forward(s.norm_ND.data(), w.lm_head, s.logits_NV.data(), n, d, v);
  s.lse_N.resize(n);
  s.loss_N.resize(n);
  cpu::cross_entropy_forward(s.logits_NV.data(), targets, s.loss_N.data(), s.lse_N.data(), n, v, 0.0);
  LmHeadLoss out;
  for (int64_t i = 0; i < n; ++i) {
    if (targets[i] < 0) continue;
    out.ce_sum += double(s.loss_N[i]);
    out.num_targets += 1;
  }
  return out;
}

template <typename T>
void lm_head_backward(const LmHeadTensors<const T*>& w, const LmHeadSaved<T>& s, int64_t d, int64_t v, T ce_scale,
                      T* dx, const LmHeadTensors<T*>& dw, PhaseTimer* timer) {
  const int64_t n = static_cast<int64_t>(s.targets_N.size());
  if (timer) timer->lap(Phase::kLmHead);
  std::vector<T> dlogits(n * v), dnorm(n * d);
  cpu::cross_entropy_backward(s.logits_NV.data(), s.targets_N.data(), s.lse_N.data(), dlogits.data(), n, v, 0.0,
                              ce_scale);
  cpu::linear_backward(s.norm_ND.data(), w.lm_head, dlogits.data(), dnorm.data(), dw.lm_head, n, d, v);
  cpu::rmsnorm_backward(s.x_in_ND.data(), w.final_norm, s.rstd_N.data(), dnorm.data(), dx, dw.final_norm, n, d);
}

#define MOE_INSTANTIATE_LM_HEAD(T)                                                                                \
  template LmHeadLoss lm_head_forward<T>(const LmHeadTensors<const T*>&, const T*, const int32_t*, int64_t, int64_t, \
                                         int64_t, double, LmHeadSaved<T>&, PhaseTimer*);                          \
  template void lm_head_backward<T>(const LmHeadTensors<const T*>&, const LmHeadSaved<T>&, int64_t, int64_t, T, T*, \
                                    const LmHeadTensors<T*>&, PhaseTimer*);
MOE_INSTANTIATE_LM_HEAD(float)
MOE_INSTANTIATE_LM_HEAD(double)
#undef MOE_INSTANTIATE_LM_HEAD

}  // namespace moe
