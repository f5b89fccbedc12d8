// The routed experts of an MoE layer behind one interface: rows sorted by global expert in
// (expert e owns rows [offsets_E1[e], offsets_E1[e+1]), the dispatch map's layout), each row through
// its expert's SwiGLU (gate_up = x W_gu^T, h = silu(gate) * up, y = h W_d^T) and back in the same
// order. LocalExperts runs every expert here (cpu::experts_*); EpExperts (model/ep_experts.h)
// sends rows to their experts' ranks and back. The caller owns every buffer.
// Legend: R rows sorted by global expert, D model width, I expert hidden, E experts, L experts this
// rank holds (E without expert parallelism), G rows this rank's experts run (R when local).
#pragma once

#include <cstdint>
#include <vector>

#include "core/phase_timer.h"
#include "core/recompute.h"
#include "cpu/fp8.h"
#include "parallel/expert_parallel.h"

namespace moe {

// What the experts' backward needs: for the G rows this rank's experts ran (grouped by local
// expert), their inputs, fused gate/up outputs and SwiGLU outputs, and the layout of those rows.
template <typename T>
struct ExpertsSaved {
  std::vector<int32_t> offsets_L1;  // [L + 1] local expert j owns rows [offsets_L1[j], offsets_L1[j+1])
  std::vector<T> x_GD, gate_up_G2I, h_GI;
  EpHandle handle;  // expert-parallel only: the exchange (handle.local_offsets == offsets_L1)
};

// Bytes the saved tensors hold (core/recompute.h: held_bytes), the exchange's layout included.
template <typename T>
int64_t saved_bytes(const ExpertsSaved<T>& s) {
  const EpHandle& h = s.handle;
  return held_bytes(s.offsets_L1, s.x_GD, s.gate_up_G2I, s.h_GI) +
         held_bytes(h.num_rows_per_rank, h.num_recv_rows_per_rank, h.num_recv_tokens_per_expert, h.local_offsets,
                    h.grouped_to_recv);
}

template <typename T>
class Experts {
 public:
  virtual ~Experts() = default;
  // x_sorted_RD [R, D] -> y_sorted_RD [R, D] (overwritten), R = offsets_E1[E]. w_gate_up_L2ID
  // [L, 2I, D] and w_down_LDI [L, D, I] are this rank's experts. timer (optional) gets experts laps
  // (and dispatch/combine laps for the exchange).
  virtual void forward(const T* x_sorted_RD, const int32_t* offsets_E1, const T* w_gate_up_L2ID,
                       const T* w_down_LDI, ExpertsSaved<T>& saved, T* y_sorted_RD,
                       PhaseTimer* timer) const = 0;
  // Activation recomputation (core/recompute.h): forward again on the same rows x_sorted_RD with the
  // layout forward saved (saved.offsets_L1; under expert parallelism saved.handle, so no count
  // exchange, but the rows travel again: a collective), rewriting saved.x_GD, saved.h_GI and, unless
  // gate_up_kept (selective: saved.gate_up_G2I is kept), saved.gate_up_G2I, and y_sorted_RD [R, D]:
  // bitwise forward's values.
  virtual void recompute(const T* x_sorted_RD, const T* w_gate_up_L2ID, const T* w_down_LDI, bool gate_up_kept,
                         ExpertsSaved<T>& saved, T* y_sorted_RD, PhaseTimer* timer) const = 0;
  // dy_sorted_RD [R, D] -> dx_sorted_RD [R, D] (overwritten); dw_gate_up and dw_down accumulate
  // (+=) over every row this rank's experts ran.
  virtual void backward(const ExpertsSaved<T>& saved, const T* w_gate_up_L2ID, const T* w_down_LDI,
                        const T* dy_sorted_RD, T* dx_sorted_RD, T* dw_gate_up_L2ID, T* dw_down_LDI,
                        PhaseTimer* timer) const = 0;
  // The expert GEMMs in the FP8 recipe, emulated (null: FP32); the local experts only.
  void set_fp8(const cpu::Fp8Recipe* fp8) { fp8_ = fp8; }

 protected:
  const cpu::Fp8Recipe* fp8_ = nullptr;
};

// Every expert on this rank (L = E): cpu::experts_forward/backward on the sorted rows.
template <typename T>
class LocalExperts final : public Experts<T> {
 public:
  LocalExperts(int64_t num_experts, int64_t d_model, int64_t expert_hidden)
      : num_experts_(num_experts), d_(d_model), inner_(expert_hidden) {}
  void forward(const T* x_sorted_RD, const int32_t* offsets_E1, const T* w_gate_up_L2ID, const T* w_down_LDI,
               ExpertsSaved<T>& saved, T* y_sorted_RD, PhaseTimer* timer) const override;
  void recompute(const T* x_sorted_RD, const T* w_gate_up_L2ID, const T* w_down_LDI, bool gate_up_kept,
                 ExpertsSaved<T>& saved, T* y_sorted_RD, PhaseTimer* timer) const override;
  void backward(const ExpertsSaved<T>& saved, const T* w_gate_up_L2ID, const T* w_down_LDI, const T* dy_sorted_RD,
                T* dx_sorted_RD, T* dw_gate_up_L2ID, T* dw_down_LDI, PhaseTimer* timer) const override;

 private:
  int64_t num_experts_, d_, inner_;
};

}  // namespace moe
