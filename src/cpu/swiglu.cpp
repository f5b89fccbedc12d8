// SwiGLU forward/backward. d/dg silu(g) = s * (1 + g * (1 - s)), s = sigmoid(g).
#include "cpu/swiglu.h"

#include <cmath>

namespace moe::cpu {

template <typename T>
void swiglu_forward(const T* gate_up, T* h, int64_t n, int64_t inner) {
  for (int64_t r = 0; r < n; ++r) {
    const T* g = gate_up + r * 2 * inner;
    const T* u = g + inner;
    T* out = h + r * inner;
    for (int64_t i = 0; i < inner; ++i) {
      const T s = T(1) / (T(1) + std::exp(-g[i]));
      out[i] = g[i] * s * u[i];
    }
  }
}

template <typename T>
void swiglu_backward(const T* gate_up, const T* dh, T* dgate_up, int64_t n, int64_t inner) {
  for (int64_t r = 0; r < n; ++r) {
    const T* g = gate_up + r * 2 * inner;
    const T* u = g + inner;
    const T* d = dh + r * inner;
    T* dg = dgate_up + r * 2 * inner;
    T* du = dg + inner;
    for (int64_t i = 0; i < inner; ++i) {
      const T s = T(1) / (T(1) + std::exp(-g[i]));
      const T silu = g[i] * s;
      dg[i] = d[i] * u[i] * s * (T(1) + g[i] * (T(1) - s));
      du[i] = d[i] * silu;
    }
  }
}

template void swiglu_forward<float>(const float*, float*, int64_t, int64_t);
template void swiglu_forward<double>(const double*, double*, int64_t, int64_t);
template void swiglu_backward<float>(const float*, const float*, float*, int64_t, int64_t);
template void swiglu_backward<double>(const double*, const double*, double*, int64_t, int64_t);

}  // namespace moe::cpu
