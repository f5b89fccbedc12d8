// The model's linear passes at its matmul precision: cpu::linear (FP32, or double in the gradient
// checks) when fp8 is null, else the FP8 recipe emulated on FP32 (cpu::fp8_emulated_linear_*,
// train.precision = "fp8" on the cpu backend). The FP8 path exists for float only.
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/error.h"
#include "cpu/fp8.h"
#include "cpu/linear.h"

namespace moe::cpu {

template <typename T>
void linear_forward_at(const Fp8Recipe* fp8, const T* x, const T* w, T* y, int64_t n, int64_t k, int64_t m,
                       bool accumulate = false) {
  if (fp8 == nullptr) return linear_forward(x, w, y, n, k, m, accumulate);
  if constexpr (std::is_same_v<T, float>) {
    fp8_emulated_linear_forward(x, w, y, n, k, m, accumulate, *fp8);
  } else {
    MOE_CHECK(false, "the FP8 recipe is emulated on FP32 tensors only");
  }
}

template <typename T>
void linear_backward_at(const Fp8Recipe* fp8, const T* x, const T* w, const T* dy, T* dx, T* dw, int64_t n,
                        int64_t k, int64_t m, bool accumulate_dx = false) {
  if (fp8 == nullptr) return linear_backward(x, w, dy, dx, dw, n, k, m, accumulate_dx);
  if constexpr (std::is_same_v<T, float>) {
    fp8_emulated_linear_backward(x, w, dy, dx, dw, n, k, m, accumulate_dx, *fp8);
  } else {
    MOE_CHECK(false, "the FP8 recipe is emulated on FP32 tensors only");
  }
}

}  // namespace moe::cpu
