// RMSNorm forward/backward. With r = (mean(x^2) + eps)^(-1/2), dr/dx_k = -r^3 x_k / d, so
// dx_k = r * w_k * dy_k - x_k * r^3 * sum_j(dy_j w_j x_j) / d.
#include "cpu/rmsnorm.h"

#include <cmath>

#include "core/error.h"

namespace moe::cpu {

template <typename T>
void rmsnorm_forward(const T* x, const T* w, T* y, T* rstd, int64_t n, int64_t d, double eps) {
  MOE_CHECK(n >= 0 && d > 0, "rmsnorm_forward: expected n >= 0 and d > 0, got n=", n, " d=", d);
  MOE_CHECK(eps >= 0.0, "rmsnorm_forward: expected eps >= 0, got ", eps);
  for (int64_t i = 0; i < n; ++i) {
    const T* xr = x + i * d;
    T* yr = y + i * d;
    double ss = 0.0;
    for (int64_t j = 0; j < d; ++j) ss += static_cast<double>(xr[j]) * static_cast<double>(xr[j]);
    const T r = static_cast<T>(1.0 / std::sqrt(ss / static_cast<double>(d) + eps));
    rstd[i] = r;
    for (int64_t j = 0; j < d; ++j) yr[j] = xr[j] * r * w[j];
  }
}

template <typename T>
void rmsnorm_apply(const T* x, const T* w, const T* rstd, T* y, int64_t n, int64_t d) {
  MOE_CHECK(n >= 0 && d > 0, "rmsnorm_apply: expected n >= 0 and d > 0, got n=", n, " d=", d);
  for (int64_t i = 0; i < n; ++i) {
    const T* xr = x + i * d;
    T* yr = y + i * d;
    const T r = rstd[i];
    for (int64_t j = 0; j < d; ++j) yr[j] = xr[j] * r * w[j];  // rmsnorm_forward's expression
  }
}

namespace {

// rmsnorm_backward's rows; kAdd: the row gradient added into dx (+=) instead of stored there.
template <bool kAdd, typename T>
void backward_rows(const T* x, const T* w, const T* rstd, const T* dy, T* dx, T* dw, int64_t n, int64_t d) {
  for (int64_t i = 0; i < n; ++i) {
    const T* xr = x + i * d;
    const T* gr = dy + i * d;
    T* dxr = dx + i * d;
    const T r = rstd[i];
    double dot = 0.0;
    for (int64_t j = 0; j < d; ++j)
      dot += static_cast<double>(gr[j]) * static_cast<double>(w[j]) * static_cast<double>(xr[j]);
    const T c = static_cast<T>(dot / static_cast<double>(d)) * r * r * r;
    for (int64_t j = 0; j < d; ++j) {
      const T dxj = r * w[j] * gr[j] - xr[j] * c;
      if constexpr (kAdd) {
        dxr[j] += dxj;
      } else {
        dxr[j] = dxj;
      }
      dw[j] += gr[j] * xr[j] * r;
    }
  }
}

}  // namespace

template <typename T>
void rmsnorm_backward(const T* x, const T* w, const T* rstd, const T* dy, T* dx, T* dw, int64_t n,
                      int64_t d) {
  MOE_CHECK(n >= 0 && d > 0, "rmsnorm_backward: expected n >= 0 and d > 0, got n=", n, " d=", d);
  backward_rows<false>(x, w, rstd, dy, dx, dw, n, d);
}

template <typename T>
void rmsnorm_backward_add(const T* x, const T* w, const T* rstd, const T* dy, T* acc, T* dw, int64_t n, int64_t d) {
  MOE_CHECK(n >= 0 && d > 0, "rmsnorm_backward_add: expected n >= 0 and d > 0, got n=", n, " d=", d);
  backward_rows<true>(x, w, rstd, dy, acc, dw, n, d);
}

template void rmsnorm_forward<float>(const float*, const float*, float*, float*, int64_t, int64_t, double);
template void rmsnorm_forward<double>(const double*, const double*, double*, double*, int64_t, int64_t,
                                      double);
template void rmsnorm_apply<float>(const float*, const float*, const float*, float*, int64_t, int64_t);
template void rmsnorm_apply<double>(const double*, const double*, const double*, double*, int64_t, int64_t);
template void rmsnorm_backward<float>(const float*, const float*, const float*, const float*, float*,
                                      float*, int64_t, int64_t);
template void rmsnorm_backward<double>(const double*, const double*, const double*, const double*,
                                       double*, double*, int64_t, int64_t);
template void rmsnorm_backward_add<float>(const float*, const float*, const float*, const float*, float*, float*,
                                          int64_t, int64_t);
template void rmsnorm_backward_add<double>(const double*, const double*, const double*, const double*, double*,
                                           double*, int64_t, int64_t);

}  // namespace moe::cpu
