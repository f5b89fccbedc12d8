// Grouped experts as a loop of per-expert linear + SwiGLU calls. Forward: the gate/up GEMM per
// expert, then experts_down_forward (SwiGLU and down GEMM per expert). Backward per expert:
// dh = dy_e @ w_down[e], dw_down[e] += dy_e^T @ h_e, dgate_up = swiglu'(dh),
// dx_e = dgate_up @ w_gate_up[e], dw_gate_up[e] += dgate_up^T @ x_e.
#include "cpu/experts.h"

#include <algorithm>

#include "core/error.h"
#include "core/square_blocks.h"
#include "cpu/linear.h"
#include "cpu/linear_precision.h"
#include "cpu/swiglu.h"

namespace moe::cpu {
namespace {

void check_offsets(const char* op, const int32_t* offsets, int64_t num_experts, int64_t d,
                   int64_t inner) {
  MOE_CHECK(num_experts > 0, op, ": num_experts must be > 0, got ", num_experts);
  MOE_CHECK(d > 0 && inner > 0, op, ": d and inner must be > 0, got d=", d, " inner=", inner);
  MOE_CHECK(offsets[0] == 0, op, ": expert_offsets[0] must be 0, got ", offsets[0]);
  for (int64_t e = 0; e < num_experts; ++e)
    MOE_CHECK(offsets[e + 1] >= offsets[e], op, ": expert_offsets must be non-decreasing, got ",
              offsets[e], " then ", offsets[e + 1], " at expert ", e);
}

}  // namespace

template <typename T>
void experts_forward(const T* x_sorted, const int32_t* expert_offsets, const T* w_gate_up,
                     const T* w_down, int64_t num_experts, int64_t d, int64_t inner, T* gate_up,
                     T* h, T* y, const Fp8Recipe* fp8) {
  check_offsets("experts_forward", expert_offsets, num_experts, d, inner);
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t row0 = expert_offsets[e];
    const int64_t n = expert_offsets[e + 1] - row0;
    if (n == 0) continue;
    linear_forward_at(fp8, x_sorted + row0 * d, w_gate_up + e * 2 * inner * d, gate_up + row0 * 2 * inner, n, d,
                      2 * inner);
  }
  experts_down_forward(expert_offsets, gate_up, w_down, num_experts, d, inner, h, y, fp8);
}

template <typename T>
void experts_down_forward(const int32_t* expert_offsets, const T* gate_up, const T* w_down, int64_t num_experts,
                          int64_t d, int64_t inner, T* h, T* y, const Fp8Recipe* fp8) {
  check_offsets("experts_down_forward", expert_offsets, num_experts, d, inner);
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t row0 = expert_offsets[e];
    const int64_t n = expert_offsets[e + 1] - row0;
    if (n == 0) continue;
    T* he = h + row0 * inner;
    swiglu_forward(gate_up + row0 * 2 * inner, he, n, inner);
    linear_forward_at(fp8, he, w_down + e * d * inner, y + row0 * d, n, inner, d);
  }
}

template <typename T>
void experts_backward(const T* x_sorted, const int32_t* expert_offsets, const T* w_gate_up,
                      const T* w_down, const T* gate_up, const T* h, const T* dy,
                      int64_t num_experts, int64_t d, int64_t inner, T* dx_sorted, T* dw_gate_up,
                      T* dw_down, T* scratch, const Fp8Recipe* fp8) {
  check_offsets("experts_backward", expert_offsets, num_experts, d, inner);
  const int64_t rows = expert_offsets[num_experts];
  T* dgate_up_all = scratch;                 // [R, 2I]
  T* dh_all = scratch + rows * 2 * inner;    // [R, I]
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t row0 = expert_offsets[e];
    const int64_t n = expert_offsets[e + 1] - row0;
    if (n == 0) continue;
    T* dgu = dgate_up_all + row0 * 2 * inner;
    T* dh = dh_all + row0 * inner;
    linear_backward_at(fp8, h + row0 * inner, w_down + e * d * inner, dy + row0 * d, dh,
                    dw_down ? dw_down + e * d * inner : nullptr, n, inner, d);
    swiglu_backward(gate_up + row0 * 2 * inner, dh, dgu, n, inner);
    linear_backward_at(fp8, x_sorted + row0 * d, w_gate_up + e * 2 * inner * d, dgu, dx_sorted + row0 * d,
                    dw_gate_up ? dw_gate_up + e * 2 * inner * d : nullptr, n, d, 2 * inner);
  }
}

template void experts_forward<float>(const float*, const int32_t*, const float*, const float*,
                                     int64_t, int64_t, int64_t, float*, float*, float*, const Fp8Recipe*);
template void experts_forward<double>(const double*, const int32_t*, const double*, const double*,
                                      int64_t, int64_t, int64_t, double*, double*, double*, const Fp8Recipe*);
template void experts_down_forward<float>(const int32_t*, const float*, const float*, int64_t, int64_t, int64_t,
                                          float*, float*, const Fp8Recipe*);
template void experts_down_forward<double>(const int32_t*, const double*, const double*, int64_t, int64_t,
                                           int64_t, double*, double*, const Fp8Recipe*);
template void experts_backward<float>(const float*, const int32_t*, const float*, const float*,
                                      const float*, const float*, const float*, int64_t, int64_t,
                                      int64_t, float*, float*, float*, float*, const Fp8Recipe*);
template void experts_backward<double>(const double*, const int32_t*, const double*, const double*,
                                       const double*, const double*, const double*, int64_t,
                                       int64_t, int64_t, double*, double*, double*, double*, const Fp8Recipe*);

void block_square_sums(const float* dw, int64_t num_experts, int64_t n, int64_t k, double* out) {
  MOE_CHECK(num_experts >= 0 && n >= 0 && k >= 0, "cpu::block_square_sums: expected E, n, k >= 0, got ", num_experts,
            ", ", n, ", ", k);
  const int64_t rb = (n + kSquareBlock - 1) / kSquareBlock, cb = (k + kSquareBlock - 1) / kSquareBlock;
  for (int64_t e = 0; e < num_experts; ++e)
    for (int64_t i = 0; i < rb; ++i)
      for (int64_t j = 0; j < cb; ++j) {
        double sum = 0.0;
        for (int64_t r = i * kSquareBlock; r < std::min(n, (i + 1) * kSquareBlock); ++r)
          for (int64_t c = j * kSquareBlock; c < std::min(k, (j + 1) * kSquareBlock); ++c) {
            const double v = dw[(e * n + r) * k + c];
            sum += v * v;
          }
        out[(e * rb + i) * cb + j] = sum;
      }
}

}  // namespace moe::cpu
