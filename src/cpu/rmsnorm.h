// RMSNorm over the last dimension: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).
// x, y, dy, dx are [n, d] row-major, w and dw are [d], rstd is [n] (saved by forward).
// Any d works: block norms over d_model and QK-norm over the full projection width.
// The sum of squares and the backward row dot accumulate in double for both scalar types.
#pragma once

#include <cstdint>

namespace moe::cpu {

template <typename T>
void rmsnorm_forward(const T* x, const T* w, T* y, T* rstd /*[N], saved*/, int64_t n, int64_t d,
                     double eps);

// y = x * rstd * w from a saved rstd (activation recomputation): bitwise rmsnorm_forward's y for
// the rstd it wrote.
template <typename T>
void rmsnorm_apply(const T* x, const T* w, const T* rstd, T* y, int64_t n, int64_t d);

// dx = rstd * (w * dy - x * rstd^2 * mean(dy * w * x)) (overwritten); dw += sum_rows dy * x * rstd.
template <typename T>
void rmsnorm_backward(const T* x, const T* w, const T* rstd, const T* dy, T* dx /*overwritten*/,
                      T* dw /* += */, int64_t n, int64_t d);

// rmsnorm_backward with its dx added into acc (acc += dx) instead of stored; dw += as there. The
// twin of cuda::rmsnorm_backward_add (which rounds dx and the sum to BF16 as its storage does).
template <typename T>
void rmsnorm_backward_add(const T* x, const T* w, const T* rstd, const T* dy, T* acc /* += */, T* dw /* += */,
                          int64_t n, int64_t d);

}  // namespace moe::cpu
