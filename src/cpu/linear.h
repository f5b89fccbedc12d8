// CPU GEMM and linear layers. gemm: C = alpha * op(A) @ op(B) + beta * C, row-major, with
// op = transpose when the flag is set (float: OpenBLAS sgemm; double: plain loops, so the
// gradient checks use an independent code path). Linear weights are [out, in] (PyTorch):
// y[N,M] = x[N,K] @ W[M,K]^T.
#pragma once

#include <cstdint>

namespace moe::cpu {

template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

// y = x @ W^T (+ y when accumulate).
template <typename T>
void linear_forward(const T* x, const T* w, T* y, int64_t n, int64_t k, int64_t m,
                    bool accumulate = false);

// dx = dy @ W (+= when accumulate_dx; skipped when dx is null); dW += dy^T @ x (skipped when null).
template <typename T>
void linear_backward(const T* x, const T* w, const T* dy, T* dx, T* dw, int64_t n, int64_t k,
                     int64_t m, bool accumulate_dx = false);

}  // namespace moe::cpu
