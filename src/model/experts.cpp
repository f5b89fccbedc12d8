// LocalExperts: the sorted rows are the grouped rows (G = R, L = E); forward keeps a copy of its
// input rows and of the offsets for backward; recompute rebuilds the copy and the SwiGLU (and,
// unless kept, gate/up) outputs on the saved offsets. Under the FP8 recipe the input rows and the
// row gradients enter the experts as their row-quantised values (cpu::fp8_quantised_rows), what
// an FP8 row exchange delivers to expert-parallel experts (model/ep_experts.h): the same values in
// every layout, so the weight gradients quantise those values down the token dimension.
#include "model/experts.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu/experts.h"

namespace moe {
namespace {

// x_sorted's rows as the experts read them: a copy, or under the FP8 recipe its row quantisation.
template <typename T>
void keep_rows(const T* x, int64_t rows, int64_t d, const cpu::Fp8Recipe* fp8, Fp8Format f, std::vector<T>& out) {
  out.resize(static_cast<size_t>(rows * d));
  if constexpr (std::is_same_v<T, float>) {
    if (fp8 != nullptr) return cpu::fp8_quantised_rows(x, rows, d, f, *fp8, out.data());
  }
  std::copy(x, x + rows * d, out.begin());
}

}  // namespace

template <typename T>
void LocalExperts<T>::forward(const T* x_sorted_RD, const int32_t* offsets_E1, const T* w_gate_up_L2ID,
                              const T* w_down_LDI, ExpertsSaved<T>& s, T* y_sorted_RD, PhaseTimer* timer) const {
  const int64_t rows = offsets_E1[num_experts_];
  s.offsets_L1.assign(offsets_E1, offsets_E1 + num_experts_ + 1);
  if (timer) timer->lap(Phase::kExperts);
  keep_rows(x_sorted_RD, rows, d_, this->fp8_, this->fp8_ ? this->fp8_->forward : Fp8Format::kE4M3, s.x_GD);
  s.gate_up_G2I.resize(rows * 2 * inner_);
  s.h_GI.resize(rows * inner_);
  cpu::experts_forward(s.x_GD.data(), s.offsets_L1.data(), w_gate_up_L2ID, w_down_LDI, num_experts_, d_, inner_,
                       s.gate_up_G2I.data(), s.h_GI.data(), y_sorted_RD, this->fp8_);
}

template <typename T>
void LocalExperts<T>::recompute(const T* x_sorted_RD, const T* w_gate_up_L2ID, const T* w_down_LDI,
                                bool gate_up_kept, ExpertsSaved<T>& s, T* y_sorted_RD, PhaseTimer* timer) const {
  const int64_t rows = s.offsets_L1[num_experts_];
  if (timer) timer->lap(Phase::kExperts);
  keep_rows(x_sorted_RD, rows, d_, this->fp8_, this->fp8_ ? this->fp8_->forward : Fp8Format::kE4M3, s.x_GD);
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
  std::vector<T> dy_q;  // the row gradients as the experts read them under the FP8 recipe
  if (this->fp8_ != nullptr) keep_rows(dy_sorted_RD, rows, d_, this->fp8_, this->fp8_->grad, dy_q);
  cpu::experts_backward(s.x_GD.data(), s.offsets_L1.data(), w_gate_up_L2ID, w_down_LDI, s.gate_up_G2I.data(),
                        s.h_GI.data(), this->fp8_ != nullptr ? dy_q.data() : dy_sorted_RD, num_experts_, d_, inner_,
                        dx_sorted_RD, dw_gate_up_L2ID, dw_down_LDI, scratch.data(), this->fp8_);
}

template class LocalExperts<float>;
template class LocalExperts<double>;

}  // namespace moe
