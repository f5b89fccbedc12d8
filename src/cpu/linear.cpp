// GEMM on CPU: OpenBLAS for float, straightforward loops for double.
#include "cpu/linear.h"

#include <cblas.h>

#include <vector>

#include "core/error.h"

namespace moe::cpu {

template <>
void gemm<float>(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                 const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                 int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.f ? 0.f : beta * c[i * ldc + j];
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
              static_cast<blasint>(ldc));
}

template <>
void gemm<double>(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
                  const double* a, int64_t lda, const double* b, int64_t ldb, double beta,
                  double* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int64_t p = 0; p < k; ++p) {
        const double av = trans_a ? a[p * lda + i] : a[i * lda + p];
        const double bv = trans_b ? b[j * ldb + p] : b[p * ldb + j];
        acc += av * bv;
      }
      c[i * ldc + j] = alpha * acc + (beta == 0.0 ? 0.0 : beta * c[i * ldc + j]);
    }
  }
}

template <typename T>
void linear_forward(const T* x, const T* w, T* y, int64_t n, int64_t k, int64_t m, bool accumulate) {
  MOE_CHECK(n >= 0 && k >= 0 && m >= 0, "linear_forward: negative size n=", n, " k=", k, " m=", m);
  gemm<T>(false, true, n, m, k, T(1), x, k, w, k, accumulate ? T(1) : T(0), y, m);
}

template <typename T>
void linear_backward(const T* x, const T* w, const T* dy, T* dx, T* dw, int64_t n, int64_t k,
                     int64_t m, bool accumulate_dx) {
  if (dx) gemm<T>(false, false, n, k, m, T(1), dy, m, w, k, accumulate_dx ? T(1) : T(0), dx, k);
  if (dw) gemm<T>(true, false, m, k, n, T(1), dy, m, x, k, T(1), dw, k);
}

template void linear_forward<float>(const float*, const float*, float*, int64_t, int64_t, int64_t, bool);
template void linear_forward<double>(const double*, const double*, double*, int64_t, int64_t, int64_t, bool);
template void linear_backward<float>(const float*, const float*, const float*, float*, float*, int64_t,
                                     int64_t, int64_t, bool);
template void linear_backward<double>(const double*, const double*, const double*, double*, double*,
                                      int64_t, int64_t, int64_t, bool);

}  // namespace moe::cpu
