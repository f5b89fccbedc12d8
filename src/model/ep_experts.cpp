// Expert-parallel experts: exchange counts, dispatch rows, cpu::experts_* on the local experts,
// combine rows; backward dispatches the row gradients and combines the input gradients; recompute
// dispatches and combines again on the saved exchange.
#include "model/ep_experts.h"

#include <cmath>
#include <vector>

#include "core/error.h"
#include "cpu/experts.h"

namespace moe {

void ep_experts_forward(const ExpertParallel& ep, const float* x_sorted, const int32_t* counts_E,
                        const float* w_gate_up, const float* w_down, int64_t d, int64_t inner,
                        EpExpertsSaved& s, float* y_sorted, PhaseTimer* timer) {
  if (timer) timer->lap(Phase::kDispatch);
  if (ep.rowwise) {
    // The capacity from this rank's rows, the same on every rank (equal micro-batches, dropless map).
    int64_t rows = 0;
    for (int64_t e = 0; e < ep.num_experts; ++e) rows += counts_E[e];
    const int64_t capacity =
        ep.capacity_factor > 0
            ? static_cast<int64_t>(std::ceil(ep.capacity_factor * double(rows * ep.size()) / double(ep.num_experts)))
            : 0;
    s.handle = ep_rowwise_handle(ep, counts_E, capacity);
  } else {
    s.handle = ep_exchange_counts(ep, counts_E);
  }
  s.offsets_L1 = s.handle.local_offsets;
  const int64_t g = s.handle.num_recv_rows;
  s.x_GD.resize(g * d);
  ep_dispatch(ep, s.handle, x_sorted, d, s.x_GD.data());
  s.gate_up_G2I.resize(g * 2 * inner);
  s.h_GI.resize(g * inner);
  std::vector<float> y_grouped(g * d);
  if (timer) timer->lap(Phase::kExperts);
  cpu::experts_forward(s.x_GD.data(), s.offsets_L1.data(), w_gate_up, w_down, ep.local_experts(), d, inner,
                       s.gate_up_G2I.data(), s.h_GI.data(), y_grouped.data());
  if (timer) timer->lap(Phase::kCombine);
  ep_combine(ep, s.handle, y_grouped.data(), d, y_sorted);
}

void ep_experts_recompute(const ExpertParallel& ep, const float* x_sorted, const float* w_gate_up,
                          const float* w_down, int64_t d, int64_t inner, bool gate_up_kept, EpExpertsSaved& s,
                          float* y_sorted, PhaseTimer* timer) {
  const int64_t g = s.handle.num_recv_rows;
  if (timer) timer->lap(Phase::kDispatch);
  s.x_GD.resize(g * d);
  ep_dispatch(ep, s.handle, x_sorted, d, s.x_GD.data());
  s.h_GI.resize(g * inner);
  std::vector<float> y_grouped(g * d);
  if (timer) timer->lap(Phase::kExperts);
  if (gate_up_kept) {
    MOE_CHECK(static_cast<int64_t>(s.gate_up_G2I.size()) == g * 2 * inner, "ep_experts_recompute: saved gate/up "
              "outputs hold ", s.gate_up_G2I.size(), " values, expected ", g * 2 * inner, " (forward not run?)");
    cpu::experts_down_forward(s.offsets_L1.data(), s.gate_up_G2I.data(), w_down, ep.local_experts(), d, inner,
                              s.h_GI.data(), y_grouped.data());
  } else {
    s.gate_up_G2I.resize(g * 2 * inner);
    cpu::experts_forward(s.x_GD.data(), s.offsets_L1.data(), w_gate_up, w_down, ep.local_experts(), d, inner,
                         s.gate_up_G2I.data(), s.h_GI.data(), y_grouped.data());
  }
  if (timer) timer->lap(Phase::kCombine);
  ep_combine(ep, s.handle, y_grouped.data(), d, y_sorted);
}

void ep_experts_backward(const ExpertParallel& ep, const EpExpertsSaved& s, const float* w_gate_up,
                         const float* w_down, const float* dy_sorted, int64_t d, int64_t inner,
                         float* dx_sorted, float* dw_gate_up, float* dw_down, PhaseTimer* timer) {
  const int64_t g = s.handle.num_recv_rows;
  MOE_CHECK(static_cast<int64_t>(s.x_GD.size()) == g * d, "ep_experts_backward: saved inputs hold ",
            s.x_GD.size(), " values, expected ", g * d, " (forward not run?)");
  // Backward of combine is a dispatch (gradients travel to the experts), of dispatch a combine.
  std::vector<float> dy_grouped(g * d), dx_grouped(g * d), scratch(g * 3 * inner);
  if (timer) timer->lap(Phase::kCombine);
  ep_dispatch(ep, s.handle, dy_sorted, d, dy_grouped.data());
  if (timer) timer->lap(Phase::kExperts);
  cpu::experts_backward(s.x_GD.data(), s.offsets_L1.data(), w_gate_up, w_down, s.gate_up_G2I.data(), s.h_GI.data(),
                        dy_grouped.data(), ep.local_experts(), d, inner, dx_grouped.data(), dw_gate_up, dw_down,
                        scratch.data());
  if (timer) timer->lap(Phase::kDispatch);
  ep_combine(ep, s.handle, dx_grouped.data(), d, dx_sorted);
}

void EpExperts::forward(const float* x_sorted_RD, const int32_t* offsets_E1, const float* w_gate_up_L2ID,
                        const float* w_down_LDI, ExpertsSaved<float>& saved, float* y_sorted_RD,
                        PhaseTimer* timer) const {
  // Rows per global expert: the dispatch map's offsets are dropless here, so these are the routed counts.
  std::vector<int32_t> counts_E(ep_.num_experts);
  for (int64_t e = 0; e < ep_.num_experts; ++e) counts_E[e] = offsets_E1[e + 1] - offsets_E1[e];
  ep_experts_forward(ep_, x_sorted_RD, counts_E.data(), w_gate_up_L2ID, w_down_LDI, d_, inner_, saved, y_sorted_RD,
                     timer);
}

void EpExperts::recompute(const float* x_sorted_RD, const float* w_gate_up_L2ID, const float* w_down_LDI,
                          bool gate_up_kept, ExpertsSaved<float>& saved, float* y_sorted_RD, PhaseTimer* timer) const {
  ep_experts_recompute(ep_, x_sorted_RD, w_gate_up_L2ID, w_down_LDI, d_, inner_, gate_up_kept, saved, y_sorted_RD,
                       timer);
}

void EpExperts::backward(const ExpertsSaved<float>& saved, const float* w_gate_up_L2ID, const float* w_down_LDI,
                         const float* dy_sorted_RD, float* dx_sorted_RD, float* dw_gate_up_L2ID, float* dw_down_LDI,
                         PhaseTimer* timer) const {
  ep_experts_backward(ep_, saved, w_gate_up_L2ID, w_down_LDI, dy_sorted_RD, d_, inner_, dx_sorted_RD,
                      dw_gate_up_L2ID, dw_down_LDI, timer);
}

}  // namespace moe
