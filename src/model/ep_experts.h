// Expert-parallel experts (Model<float> with an EP group of ep > 1 ranks): this rank's rows sorted
// by global expert travel to their experts' ranks (parallel/expert_parallel.h: ep_exchange_counts,
// ep_dispatch), run through the L = E/ep local experts in the grouped layout (local expert major,
// sending peer minor) and come back in the sender's order (ep_combine). Dropless. Backward: the
// row gradients travel the same way; backward of dispatch is a combine and vice versa.
// Under the FP8 recipe (fp8 not null, train.precision = "fp8") the rows that feed an FP8 GEMM on the
// expert's rank, x_sorted and dy_sorted, travel as their FP8 payload (cpu::fp8_pack_rows: codes and
// scales, about a quarter of the FP32 bytes) and enter the experts as their row-quantised values,
// as the local experts' do (model/experts.h); the outputs and input gradients travel in FP32.
// Legend: R rows this rank sends, G rows its experts receive, D model width, I expert hidden,
// E experts, L local experts.
#pragma once

#include <cstdint>

#include "core/phase_timer.h"
#include "model/experts.h"
#include "parallel/expert_parallel.h"

namespace moe {

// What the expert-parallel experts save for backward: the exchange and, for the G received rows
// in grouped layout, the expert inputs, the fused gate/up outputs and the SwiGLU outputs.
using EpExpertsSaved = ExpertsSaved<float>;

// Collective drop-in for cpu::experts_forward on this rank's rows sorted by global expert:
// x_sorted [R, D] with counts_E [E] rows per global expert (R = their sum) -> y_sorted [R, D],
// each row computed by its expert on the expert's rank. w_gate_up [L, 2I, D] and w_down [L, D, I]
// are this rank's local experts (L = E/ep). timer (optional) gets the exchanges as dispatch and
// combine laps and the expert GEMMs as an experts lap (backward: the same phases).
void ep_experts_forward(const ExpertParallel& ep, const float* x_sorted, const int32_t* counts_E,
                        const float* w_gate_up, const float* w_down, int64_t d, int64_t inner,
                        EpExpertsSaved& saved, float* y_sorted, PhaseTimer* timer = nullptr,
                        const cpu::Fp8Recipe* fp8 = nullptr);

// Activation recomputation (Experts::recompute): forward again on the same x_sorted [R, D] with the
// saved exchange (saved.handle: no count exchange; the rows are dispatched again and the outputs
// combined again, a collective over the group), rewriting saved.x_GD, saved.h_GI and, unless
// gate_up_kept, saved.gate_up_G2I, and y_sorted [R, D]: bitwise ep_experts_forward's values.
void ep_experts_recompute(const ExpertParallel& ep, const float* x_sorted, const float* w_gate_up,
                          const float* w_down, int64_t d, int64_t inner, bool gate_up_kept, EpExpertsSaved& saved,
                          float* y_sorted, PhaseTimer* timer = nullptr, const cpu::Fp8Recipe* fp8 = nullptr);

// Collective drop-in for cpu::experts_backward: dy_sorted [R, D] -> dx_sorted [R, D]
// (overwritten); the local experts' weight gradients dw_gate_up [L, 2I, D] and dw_down
// [L, D, I] accumulate (+=) over the rows of every rank of the group.
void ep_experts_backward(const ExpertParallel& ep, const EpExpertsSaved& saved, const float* w_gate_up,
                         const float* w_down, const float* dy_sorted, int64_t d, int64_t inner,
                         float* dx_sorted, float* dw_gate_up, float* dw_down, PhaseTimer* timer = nullptr,
                         const cpu::Fp8Recipe* fp8 = nullptr);

// ep_dispatch of rows as their FP8 payload: x_sorted [R, D] packed by cpu::fp8_pack_rows (format f,
// recipe r's scaling), the payload rows exchanged as 32-bit words (their bits unchanged), and
// x_grouped [G, D] their dequantised values: cpu::fp8_quantised_rows of the rows it receives, bit
// for bit. Collective over the group.
void ep_dispatch_fp8(const ExpertParallel& ep, const EpHandle& h, const float* x_sorted, int64_t d, Fp8Format f,
                     const cpu::Fp8Recipe& r, float* x_grouped);

// The Experts interface over ep_experts_forward/backward. The EP group's communicator must outlive
// it; forward and backward are collectives over the group.
class EpExperts final : public Experts<float> {
 public:
  EpExperts(const ExpertParallel& ep, int64_t d_model, int64_t expert_hidden)
      : ep_(ep), d_(d_model), inner_(expert_hidden) {}
  void forward(const float* x_sorted_RD, const int32_t* offsets_E1, const float* w_gate_up_L2ID,
               const float* w_down_LDI, ExpertsSaved<float>& saved, float* y_sorted_RD,
               PhaseTimer* timer) const override;
  void recompute(const float* x_sorted_RD, const float* w_gate_up_L2ID, const float* w_down_LDI, bool gate_up_kept,
                 ExpertsSaved<float>& saved, float* y_sorted_RD, PhaseTimer* timer) const override;
  void backward(const ExpertsSaved<float>& saved, const float* w_gate_up_L2ID, const float* w_down_LDI,
                const float* dy_sorted_RD, float* dx_sorted_RD, float* dw_gate_up_L2ID, float* dw_down_LDI,
                PhaseTimer* timer) const override;

 private:
  ExpertParallel ep_;
  int64_t d_, inner_;
};

}  // namespace moe
