// The grouped SwiGLU experts of a MoE layer on the GPU, same contract as cpu/experts.h: rows sorted
// by expert, expert e owning rows [expert_offsets[e], expert_offsets[e+1]) (M-grouped contiguous);
// forward gate_up = x_e @ w_gate_up[e]^T (gate columns first), h = silu(gate) * up,
// y = h @ w_down[e]^T; backward the reverse (dgrad and wgrad of down, SwiGLU backward, dgrad and
// wgrad of gate_up). Built from grouped_gemm.h and swiglu.h only, on the caller's stream.
//
// Shapes (R = max_rows, the static row bound; E experts; D width; I expert hidden):
//   x_sorted [R, D], y [R, D], dy [R, D], dx_sorted [R, D]      BF16 (uint16_t bit patterns)
//   w_gate_up [E, 2I, D], w_down [E, D, I]                      BF16
//   gate_up [R, 2I], h [R, I]                                   BF16, saved by forward for backward
//   dw_gate_up [E, 2I, D], dw_down [E, D, I]                    FP32, accumulated (+=) or written
// On the device: every array above and expert_offsets (int32 [E+1], e.g. from the GPU dispatch
// map); the host never reads a device value, launch sizes come from (R, E, D, I) alone, so both
// calls are graph-capturable and a captured graph follows whatever the offsets hold at replay.
// The caller owns every buffer, including the backward's workspace
// (experts_backward_workspace_bytes(R, I) bytes: dgate_up [R, 2I] then dh [R, I], BF16, which
// hold this call's values on return, like the CPU op's scratch). No allocation, no sync.
// Valid offsets are 0 = offsets[0] <= ... <= offsets[E] <= R (the grouped GEMMs clamp others).
// Rows past offsets[E] (a dropped tail) never change a result: y, gate_up and dx are not written
// there; h and the workspace are (SwiGLU runs over all R rows). FP32 accumulation, one BF16
// rounding per stored tensor (gate_up, h, y; dh, dgate_up, dx). Deterministic (no atomics).
// R == 0: nothing is enqueued. Checks (moe::Error): E in [1, 4096], D and I positive multiples of
// 8, non-null 16-byte aligned pointers when R > 0, the workspace size, and dx_sorted either equal
// to dy (in place: dy is read in full before dx is written) or overlapping none of the inputs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/fp8_types.h"
#include "cuda/device.h"
#include "cuda/ops/grouped_gemm.h"

namespace moe::cuda {

void experts_forward(const uint16_t* x_sorted /*[R,D]*/, const int32_t* expert_offsets /*[E+1]*/,
                     const uint16_t* w_gate_up /*[E,2I,D]*/, const uint16_t* w_down /*[E,D,I]*/,
                     int64_t max_rows, int64_t num_experts, int64_t d, int64_t inner,
                     uint16_t* gate_up /*[R,2I], saved*/, uint16_t* h /*[R,I], saved*/,
                     uint16_t* y /*[R,D]*/, Stream stream,
                     GroupedGemmBackend backend = GroupedGemmBackend::kAuto);

// Selective recomputation: h = silu(gate) * up from the forward's gate_up and, when y is not null,
// y = h @ w_down[e]^T, bitwise as experts_forward wrote them (the same SwiGLU and grouped GEMM
// calls). Same checks and row rules as experts_forward; w_down may be null when y is.
void experts_recompute(const uint16_t* gate_up /*[R,2I]*/, const int32_t* expert_offsets /*[E+1]*/,
                       const uint16_t* w_down /*[E,D,I]*/, int64_t max_rows, int64_t num_experts, int64_t d,
                       int64_t inner, uint16_t* h /*[R,I]*/, uint16_t* y /*[R,D] or null*/, Stream stream,
                       GroupedGemmBackend backend = GroupedGemmBackend::kAuto);

// Bytes of the backward's workspace: max_rows * 3 * inner BF16 values.
size_t experts_backward_workspace_bytes(int64_t max_rows, int64_t inner);

// Where the backward writes the sums of squares of the weight gradients it writes (accumulate_dw =
// false only): square_blocks(E, 2I, D) values for dw_gate_up, square_blocks(E, D, I) for dw_down
// (core/square_blocks.h; grouped_gemm_wgrad's `squares`). Null: none.
struct ExpertGradSquares {
  double* gate_up = nullptr;
  double* down = nullptr;
};

// dx_sorted (overwritten on the grouped rows) and dw_gate_up, dw_down (+=; either may be null to
// skip it) from dy and the forward's x_sorted, gate_up and h. accumulate_dw = false writes the
// weight gradients instead (an expert without rows gets zeros; R == 0 zeroes both), never reading
// what they held: the step's first backward, with no zeroing pass before it. squares: with
// accumulate_dw = false, the block sums of squares of the gradients written (R == 0: zeros).
void experts_backward(const uint16_t* x_sorted /*[R,D]*/, const int32_t* expert_offsets /*[E+1]*/,
                      const uint16_t* w_gate_up /*[E,2I,D]*/, const uint16_t* w_down /*[E,D,I]*/,
                      const uint16_t* gate_up /*[R,2I]*/, const uint16_t* h /*[R,I]*/,
                      const uint16_t* dy /*[R,D]*/, int64_t max_rows, int64_t num_experts, int64_t d,
                      int64_t inner, uint16_t* dx_sorted /*[R,D], may be dy*/,
                      float* dw_gate_up /*[E,2I,D] +=*/, float* dw_down /*[E,D,I] +=*/, void* workspace,
                      size_t workspace_bytes, Stream stream,
                      GroupedGemmBackend backend = GroupedGemmBackend::kAuto, bool accumulate_dw = true,
                      const ExpertGradSquares& squares = {});

// ---- The FP8 recipe (train.precision = "fp8") ------------------------------------------------
// The experts' forward GEMMs and data gradients in block-scaled FP8 (cuda::grouped_gemm_fp8, E4M3
// codes, 1 x 128 activation / gradient blocks, 128 x 128 weight blocks), the weight gradients in
// BF16 (grouped_gemm_wgrad on the BF16 tensors the forward saved): each GEMM input is quantised
// over its R rows just before its GEMM (cuda::fp8_quantize_blocks into the FP8 workspace; h and
// dgate_up by the SwiGLU kernels that write them, swiglu_*_fp8, when I is a multiple of 128; x_sorted
// and dy by their producers when the caller says so, input_quantised, below), the
// weights once per step by cuda::fp8_quantize_weights (codes and the transposed copy the data
// gradient reads). Outputs, saved tensors and row rules as experts_forward / experts_backward.
struct Fp8ExpertWeights {
  const uint8_t* gate_up = nullptr;    // [E, 2I, D] codes, scales s_gate_up [E, 2I/128, D/128] (rounded up)
  const float* s_gate_up = nullptr;
  const uint8_t* gate_up_t = nullptr;  // [E, D, 2I], scales [E, D/128, 2I/128]
  const float* s_gate_up_t = nullptr;
  const uint8_t* down = nullptr;       // [E, D, I], scales [E, D/128, I/128]
  const float* s_down = nullptr;
  const uint8_t* down_t = nullptr;     // [E, I, D], scales [E, I/128, D/128]
  const float* s_down_t = nullptr;
  // The rule these codes were quantised by (cuda::fp8_quantize_weights) and by which the experts
  // quantise their activations (core/fp8_types.h): a producer that writes the input's codes
  // (input_quantised) uses it too. The MX rules need D and I multiples of 128.
  Fp8Rule rule = Fp8Rule::kBlocks;
};

// Bytes of the FP8 activation workspace: the codes of the widest GEMM input [R, max(D, 2I)] and
// their 1 x 128 scales.
size_t experts_fp8_workspace_bytes(int64_t max_rows, int64_t d, int64_t inner);

// Where the FP8 workspace holds the 1 x 128 codes [R, D] and scales [R, D / 128] of the experts'
// first GEMM input (x_sorted in the forward, dy in the backward). A producer that writes them
// there as it writes those rows (cuda::permute_forward_fp8, unpermute_backward_fp8; D a multiple
// of 128) passes input_quantised = true, and the experts skip their own quantisation of that input.
struct Fp8Rows {
  uint8_t* codes = nullptr;
  float* scales = nullptr;
  Fp8Rule rule = Fp8Rule::kBlocks;  // the experts' rule (Fp8ExpertWeights::rule), which the producer follows
};
Fp8Rows experts_fp8_input_rows(void* fp8_workspace, size_t fp8_workspace_bytes, int64_t max_rows, int64_t d,
                               int64_t inner);

void experts_forward_fp8(const uint16_t* x_sorted /*[R,D]*/, const int32_t* expert_offsets /*[E+1]*/,
                         const Fp8ExpertWeights& w, int64_t max_rows, int64_t num_experts, int64_t d, int64_t inner,
                         uint16_t* gate_up /*[R,2I], saved*/, uint16_t* h /*[R,I], saved*/, uint16_t* y /*[R,D]*/,
                         void* fp8_workspace, size_t fp8_workspace_bytes, Stream stream,
                         bool input_quantised = false);

// experts_recompute in the FP8 recipe: h again from gate_up (the SwiGLU experts_forward_fp8 ran,
// bitwise) and, when y is not null, y = h @ w_down[e]^T through the same quantisation and FP8
// grouped GEMM, bitwise as experts_forward_fp8 wrote it. w.down and w.s_down are read only for y.
void experts_recompute_fp8(const uint16_t* gate_up /*[R,2I]*/, const int32_t* expert_offsets /*[E+1]*/,
                           const Fp8ExpertWeights& w, int64_t max_rows, int64_t num_experts, int64_t d, int64_t inner,
                           uint16_t* h /*[R,I]*/, uint16_t* y /*[R,D] or null*/, void* fp8_workspace,
                           size_t fp8_workspace_bytes, Stream stream);

// The FP8 weight gradients' workspace (experts_backward_fp8's wgrad_workspace): the operands of
// one weight-gradient GEMM quantised down each expert's rows (cuda::fp8_quantize_expert_columns:
// codes [max(D, 2I), capacity] and [max(D, I), capacity], their scales, the padded offsets). 0 when
// the FP8 weight gradient does not apply (D or I not a multiple of 128).
bool experts_fp8_wgrad_applies(int64_t d, int64_t inner);
size_t experts_fp8_wgrad_workspace_bytes(int64_t max_rows, int64_t num_experts, int64_t d, int64_t inner);

// wgrad_workspace (experts_fp8_wgrad_workspace_bytes, where experts_fp8_wgrad_applies): the weight
// gradients in FP8 too, each GEMM's operands (dy and h; dgate_up and x_sorted) quantised down each
// expert's rows in 1 x 128 blocks (E4M3) and multiplied by cuda::grouped_gemm_fp8_wgrad, the CPU
// recipe's fp8_linear_wgrad per expert; null: BF16 weight gradients from the saved tensors.
// squares as experts_backward's (BF16 weight gradients only: refused with a wgrad workspace).
void experts_backward_fp8(const uint16_t* x_sorted /*[R,D]*/, const int32_t* expert_offsets /*[E+1]*/,
                          const Fp8ExpertWeights& w, const uint16_t* gate_up /*[R,2I]*/, const uint16_t* h /*[R,I]*/,
                          const uint16_t* dy /*[R,D]*/, int64_t max_rows, int64_t num_experts, int64_t d,
                          int64_t inner, uint16_t* dx_sorted /*[R,D], may be dy*/, float* dw_gate_up /*+=*/,
                          float* dw_down /*+=*/, void* workspace, size_t workspace_bytes, void* fp8_workspace,
                          size_t fp8_workspace_bytes, Stream stream, bool accumulate_dw = true,
                          bool input_quantised = false, void* wgrad_workspace = nullptr,
                          size_t wgrad_workspace_bytes = 0, const ExpertGradSquares& squares = {});

}  // namespace moe::cuda
