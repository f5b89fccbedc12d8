// Grouped SwiGLU experts on CPU: one GEMM pair per expert over its contiguous sorted rows
// [offsets[e], offsets[e+1]) (the "M-grouped contiguous" layout): gate_up = x_e @ w_gate_up[e]^T
// ([n_e, 2I], gate columns first), h = silu(gate) * up, y = h @ w_down[e]^T. Experts with zero
// rows are skipped. R = expert_offsets[E]; rows outside [0, R) are not touched.
#pragma once

#include <cstdint>

#include "cpu/fp8.h"

namespace moe::cpu {

// fp8 (every entry point; null: FP32): the expert GEMMs in the FP8 recipe, emulated
// (cpu/linear_precision.h), each expert's rows quantised on their own (the weight gradient's
// 1 x 128 blocks run down the expert's rows).

// Checks: offsets[0] == 0 and non-decreasing.
template <typename T>
void experts_forward(const T* x_sorted /*[R,D]*/, const int32_t* expert_offsets /*[E+1]*/,
                     const T* w_gate_up /*[E,2I,D]*/, const T* w_down /*[E,D,I]*/,
                     int64_t num_experts, int64_t d, int64_t inner, T* gate_up /*[R,2I], saved*/,
                     T* h /*[R,I], saved*/, T* y /*[R,D]*/, const Fp8Recipe* fp8 = nullptr);

// The part of experts_forward after the gate/up GEMMs, from a saved gate_up (activation
// recomputation): h = silu(gate) * up and y = h @ w_down[e]^T, bitwise experts_forward's h and y.
template <typename T>
void experts_down_forward(const int32_t* expert_offsets /*[E+1]*/, const T* gate_up /*[R,2I]*/,
                          const T* w_down /*[E,D,I]*/, int64_t num_experts, int64_t d, int64_t inner,
                          T* h /*[R,I]*/, T* y /*[R,D]*/, const Fp8Recipe* fp8 = nullptr);

// dx_sorted is overwritten on rows [0, R); dw_gate_up and dw_down accumulate (either may be
// null to skip it). scratch holds dgate_up [R,2I] followed by dh [R,I].
template <typename T>
void experts_backward(const T* x_sorted, const int32_t* expert_offsets, const T* w_gate_up,
                      const T* w_down, const T* gate_up, const T* h, const T* dy /*[R,D]*/,
                      int64_t num_experts, int64_t d, int64_t inner,
                      T* dx_sorted /*[R,D] overwritten*/, T* dw_gate_up /* += */,
                      T* dw_down /* += */, T* scratch /*[R, 3I]*/, const Fp8Recipe* fp8 = nullptr);

// out[b] = the sum of squares (FP64) of block b of the experts' weight gradient dw [E, n, k], the
// 128 x 128 blocks of core/square_blocks.h (square_blocks(E, n, k) values), each summed row by
// row: the twin of cuda::grouped_gemm_wgrad's `squares` (the same values up to the FP64 sum's order).
void block_square_sums(const float* dw, int64_t num_experts, int64_t n, int64_t k, double* out);

}  // namespace moe::cpu
