// Expert-parallel experts: exchange counts, dispatch rows, cpu::experts_* on the local experts,
// combine rows; backward dispatches the row gradients and combines the input gradients; recompute
// dispatches and combines again on the saved exchange.
#include "model/ep_experts.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "cpu/experts.h"

namespace moe {

void ep_dispatch_fp8(const ExpertParallel& ep, const EpHandle& h, const float* x_sorted, int64_t d, Fp8Format f,
                     const cpu::Fp8Recipe& r, float* x_grouped) {
  const int64_t bytes = cpu::fp8_row_payload_bytes(d, r), words = bytes / 4;
  std::vector<uint8_t> send(static_cast<size_t>(h.num_rows * bytes));
  cpu::fp8_pack_rows(x_sorted, h.num_rows, d, f, r, send.data());
  std::vector<float> send_words(static_cast<size_t>(h.num_rows * words));
  std::vector<float> recv_words(static_cast<size_t>(h.num_recv_rows * words));
  // A rank may send or receive no rows: no copy then (memcpy of a null pointer is undefined even
  // for 0 bytes).
  if (!send.empty()) std::memcpy(send_words.data(), send.data(), send.size());
  ep_dispatch(ep, h, send_words.data(), words, recv_words.data());
  std::vector<uint8_t> recv(static_cast<size_t>(h.num_recv_rows * bytes));
  if (!recv.empty()) std::memcpy(recv.data(), recv_words.data(), recv.size());
  cpu::fp8_unpack_rows(recv.data(), h.num_recv_rows, d, f, r, x_grouped);
}

namespace {

// The rows of an exchange that feeds an FP8 GEMM: their FP8 payload under the recipe, else FP32.
void dispatch_rows(const ExpertParallel& ep, const EpHandle& h, const float* rows, int64_t d,
                   const cpu::Fp8Recipe* fp8, Fp8Format f, float* grouped) {
  if (fp8 != nullptr) {
    ep_dispatch_fp8(ep, h, rows, d, f, *fp8, grouped);
  } else {
    ep_dispatch(ep, h, rows, d, grouped);
  }
}

}  // namespace

void ep_experts_forward(const ExpertParallel& ep, const float* x_sorted, const int32_t* counts_E,
                        const float* w_gate_up, const float* w_down, int64_t d, int64_t inner,
                        EpExpertsSaved& s, float* y_sorted, PhaseTimer* timer, const cpu::Fp8Recipe* fp8) {
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
  dispatch_rows(ep, s.handle, x_sorted, d, fp8, fp8 ? fp8->forward : Fp8Format::kE4M3, s.x_GD.data());
  s.gate_up_G2I.resize(g * 2 * inner);
  s.h_GI.resize(g * inner);
  std::vector<float> y_grouped(g * d);
  if (timer) timer->lap(Phase::kExperts);
  cpu::experts_forward(s.x_GD.data(), s.offsets_L1.data(), w_gate_up, w_down, ep.local_experts(), d, inner,
                       s.gate_up_G2I.data(), s.h_GI.data(), y_grouped.data(), fp8);
  if (timer) timer->lap(Phase::kCombine);
  ep_combine(ep, s.handle, y_grouped.data(), d, y_sorted);
}

void ep_experts_recompute(const ExpertParallel& ep, const float* x_sorted, const float* w_gate_up,
                          const float* w_down, int64_t d, int64_t inner, bool gate_up_kept, EpExpertsSaved& s,
                          float* y_sorted, PhaseTimer* timer, const cpu::Fp8Recipe* fp8) {
  const int64_t g = s.handle.num_recv_rows;
  if (timer) timer->lap(Phase::kDispatch);
  s.x_GD.resize(g * d);
  dispatch_rows(ep, s.handle, x_sorted, d, fp8, fp8 ? fp8->forward : Fp8Format::kE4M3, s.x_GD.data());
  s.h_GI.resize(g * inner);
  std::vector<float> y_grouped(g * d);
  if (timer) timer->lap(Phase::kExperts);
  if (gate_up_kept) {
    MOE_CHECK(static_cast<int64_t>(s.gate_up_G2I.size()) == g * 2 * inner, "ep_experts_recompute: saved gate/up "
              "outputs hold ", s.gate_up_G2I.size(), " values, expected ", g * 2 * inner, " (forward not run?)");
    cpu::experts_down_forward(s.offsets_L1.data(), s.gate_up_G2I.data(), w_down, ep.local_experts(), d, inner,
                              s.h_GI.data(), y_grouped.data(), fp8);
  } else {
    s.gate_up_G2I.resize(g * 2 * inner);
    cpu::experts_forward(s.x_GD.data(), s.offsets_L1.data(), w_gate_up, w_down, ep.local_experts(), d, inner,
                         s.gate_up_G2I.data(), s.h_GI.data(), y_grouped.data(), fp8);
  }
  if (timer) timer->lap(Phase::kCombine);
  ep_combine(ep, s.handle, y_grouped.data(), d, y_sorted);
}

void ep_experts_backward(const ExpertParallel& ep, const EpExpertsSaved& s, const float* w_gate_up,
                         const float* w_down, const float* dy_sorted, int64_t d, int64_t inner,
                         float* dx_sorted, float* dw_gate_up, float* dw_down, PhaseTimer* timer,
                         const cpu::Fp8Recipe* fp8) {
  const int64_t g = s.handle.num_recv_rows;
  MOE_CHECK(static_cast<int64_t>(s.x_GD.size()) == g * d, "ep_experts_backward: saved inputs hold ",
            s.x_GD.size(), " values, expected ", g * d, " (forward not run?)");
  // Backward of combine is a dispatch (gradients travel to the experts), of dispatch a combine.
  std::vector<float> dy_grouped(g * d), dx_grouped(g * d), scratch(g * 3 * inner);
  if (timer) timer->lap(Phase::kCombine);
  dispatch_rows(ep, s.handle, dy_sorted, d, fp8, fp8 ? fp8->grad : Fp8Format::kE4M3, dy_grouped.data());
  if (timer) timer->lap(Phase::kExperts);
  cpu::experts_backward(s.x_GD.data(), s.offsets_L1.data(), w_gate_up, w_down, s.gate_up_G2I.data(), s.h_GI.data(),
                        dy_grouped.data(), ep.local_experts(), d, inner, dx_grouped.data(), dw_gate_up, dw_down,
                        scratch.data(), fp8);
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
                     timer, fp8_);
}

void EpExperts::recompute(const float* x_sorted_RD, const float* w_gate_up_L2ID, const float* w_down_LDI,
                          bool gate_up_kept, ExpertsSaved<float>& saved, float* y_sorted_RD, PhaseTimer* timer) const {
  ep_experts_recompute(ep_, x_sorted_RD, w_gate_up_L2ID, w_down_LDI, d_, inner_, gate_up_kept, saved, y_sorted_RD,
                       timer, fp8_);
}

void EpExperts::backward(const ExpertsSaved<float>& saved, const float* w_gate_up_L2ID, const float* w_down_LDI,
                         const float* dy_sorted_RD, float* dx_sorted_RD, float* dw_gate_up_L2ID, float* dw_down_LDI,
                         PhaseTimer* timer) const {
  ep_experts_backward(ep_, saved, w_gate_up_L2ID, w_down_LDI, dy_sorted_RD, d_, inner_, dx_sorted_RD,
                      dw_gate_up_L2ID, dw_down_LDI, timer, fp8_);
}

}  // namespace moe
