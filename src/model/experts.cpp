// LocalExperts: the sorted rows are the grouped rows (G = R, L = E); forward keeps a copy of its
// input rows and of the offsets for backward; recompute rebuilds the copy and the SwiGLU (and,
// unless kept, gate/up) outputs on the saved offsets.
#include "model/experts.h"

#include "cpu/experts.h"

namespace moe {

template <typename T>
void LocalExperts<T>::forward(const T* x_sorted_RD, const int32_t* offsets_E1, const T* w_gate_up_L2ID,
                              const T* w_down_LDI, ExpertsSaved<T>& s, T* y_sorted_RD, PhaseTimer* timer) const {
  const int64_t rows = offsets_E1[num_experts_];
  s.offsets_L1.assign(offsets_E1, offsets_E1 + num_experts_ + 1);
  s.x_GD.assign(x_sorted_RD, x_sorted_RD + rows * d_);
  if (timer) timer->lap(Phase::kExperts);
  s.gate_up_G2I.resize(rows * 2 * inner_);
  s.h_GI.resize(rows * inner_);
  cpu::experts_forward(s.x_GD.data(), s.offsets_L1.data(), w_gate_up_L2ID, w_down_LDI, num_experts_, d_, inner_,
                       s.gate_up_G2I.data(), s.h_GI.data(), y_sorted_RD, this->fp8_);
}

template <typename T>
void LocalExperts<T>::recompute(const T* x_sorted_RD, const T* w_gate_up_L2ID, const T* w_down_LDI,
                                bool gate_up_kept, ExpertsSaved<T>& s, T* y_sorted_RD, PhaseTimer* timer) const {
  const int64_t rows = s.offsets_L1[num_experts_];
  s.x_GD.assign(x_sorted_RD, x_sorted_RD + rows * d_);
  if (timer) timer->lap(Phase::kExperts);
  s.h_GI.resize(rows * inner_);
  if (gate_up_kept) {
    cpu::experts_down_forward(s.offsets_L1.data(), s.gate_up_G2I.data(), w_down_LDI, num_experts_, d_, inner_,
                              s.h_GI.data(), y_sorted_RD, this->fp8_);
  } else {
    s.gate_up_G2I.resize(rows * 2 * inner_);
    cpu::experts_forward(s.x_GD.data(), s.offsets_L1.data(), w_gate_up_L2ID, w_down_LDI, num_experts_, d_, inner_,
                         s.gate_up_G2I.data(), s.h_GI.data(), y_sorted_RD, this->fp8_);
  }
}

template <typename T>
void LocalExperts<T>::backward(const ExpertsSaved<T>& s, const T* w_gate_up_L2ID, const T* w_down_LDI,
                               const T* dy_sorted_RD, T* dx_sorted_RD, T* dw_gate_up_L2ID, T* dw_down_LDI,
                               PhaseTimer* timer) const {
  const int64_t rows = s.offsets_L1[num_experts_];
  std::vector<T> scratch(rows * 3 * inner_);
  if (timer) timer->lap(Phase::kExperts);
  cpu::experts_backward(s.x_GD.data(), s.offsets_L1.data(), w_gate_up_L2ID, w_down_LDI, s.gate_up_G2I.data(),
                        s.h_GI.data(), dy_sorted_RD, num_experts_, d_, inner_, dx_sorted_RD, dw_gate_up_L2ID,
                        dw_down_LDI, scratch.data(), this->fp8_);
}

template class LocalExperts<float>;
template class LocalExperts<double>;

}  // namespace moe
