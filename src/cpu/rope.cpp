// RoPE forward (rotation by +angle) and backward (rotation by -angle, the transpose), sharing
// one cos/sin table of [seq, hd/2] built per call.
#include "cpu/rope.h"

#include <cmath>
#include <vector>

#include "core/error.h"
#include "cpu/rmsnorm.h"

namespace moe::cpu {
namespace {

template <typename T>
void rope_apply(const char* op, T* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim,
                double theta, double sign, int64_t pos0 = 0) {
  MOE_CHECK(batch >= 0 && seq >= 0 && heads >= 0, op,
            ": expected non-negative sizes, got batch=", batch, " seq=", seq, " heads=", heads);
  MOE_CHECK(head_dim > 0 && head_dim % 2 == 0, op, ": head_dim must be even and positive, got ",
            head_dim);
  MOE_CHECK(theta > 0.0, op, ": rope_theta must be positive, got ", theta);
  const int64_t half = head_dim / 2;
  std::vector<T> cos_t(static_cast<size_t>(seq * half)), sin_t(static_cast<size_t>(seq * half));
  for (int64_t i = 0; i < half; ++i) {
    const double inv_freq =
        std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
    for (int64_t s = 0; s < seq; ++s) {
      const double angle = static_cast<double>(pos0 + s) * inv_freq;
      cos_t[s * half + i] = static_cast<T>(std::cos(angle));
      sin_t[s * half + i] = static_cast<T>(sign * std::sin(angle));
    }
  }
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t s = 0; s < seq; ++s) {
      const T* c = cos_t.data() + s * half;
      const T* sn = sin_t.data() + s * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = x + ((b * seq + s) * heads + h) * head_dim;
        T* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const T a = x1[i], bb = x2[i];
          x1[i] = a * c[i] - bb * sn[i];
          x2[i] = bb * c[i] + a * sn[i];
        }
      }
    }
  }
}

}  // namespace

template <typename T>
void rope_forward(T* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double theta) {
  rope_apply("rope_forward", x, batch, seq, heads, head_dim, theta, 1.0);
}

template <typename T>
void rope_forward_at(T* x, int64_t n, int64_t pos0, int64_t heads, int64_t head_dim, double theta) {
  MOE_CHECK(pos0 >= 0, "rope_forward_at: the first position must be >= 0, got ", pos0);
  rope_apply("rope_forward_at", x, 1, n, heads, head_dim, theta, 1.0, pos0);
}

template <typename T>
void rope_backward(T* dx, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double theta) {
  rope_apply("rope_backward", dx, batch, seq, heads, head_dim, theta, -1.0);
}

template <typename T>
void rmsnorm_rope_forward(const T* x, const T* w, T* y, T* rstd, int64_t batch, int64_t seq, int64_t pos0,
                          int64_t heads, int64_t head_dim, double eps, double theta) {
  MOE_CHECK(pos0 == 0 || batch == 1, "rmsnorm_rope_forward: rows at a position offset are one sequence, got batch=",
            batch, " pos0=", pos0);
  rmsnorm_forward(x, w, y, rstd, batch * seq, heads * head_dim, eps);
  if (pos0 == 0) {
    rope_forward(y, batch, seq, heads, head_dim, theta);
  } else {
    rope_forward_at(y, seq, pos0, heads, head_dim, theta);
  }
}

template <typename T>
void rope_rmsnorm_backward(const T* x, const T* w, const T* rstd, T* dy, T* dx, T* dw, int64_t batch, int64_t seq,
                           int64_t heads, int64_t head_dim, double theta) {
  rope_backward(dy, batch, seq, heads, head_dim, theta);
  rmsnorm_backward(x, w, rstd, dy, dx, dw, batch * seq, heads * head_dim);
}

template void rope_forward<float>(float*, int64_t, int64_t, int64_t, int64_t, double);
template void rope_forward<double>(double*, int64_t, int64_t, int64_t, int64_t, double);
template void rope_forward_at<float>(float*, int64_t, int64_t, int64_t, int64_t, double);
template void rope_forward_at<double>(double*, int64_t, int64_t, int64_t, int64_t, double);
template void rope_backward<float>(float*, int64_t, int64_t, int64_t, int64_t, double);
template void rope_backward<double>(double*, int64_t, int64_t, int64_t, int64_t, double);
template void rope_rmsnorm_backward<float>(const float*, const float*, const float*, float*, float*, float*, int64_t,
                                           int64_t, int64_t, int64_t, double);
template void rope_rmsnorm_backward<double>(const double*, const double*, const double*, double*, double*, double*,
                                            int64_t, int64_t, int64_t, int64_t, double);
template void rmsnorm_rope_forward<float>(const float*, const float*, float*, float*, int64_t, int64_t, int64_t,
                                          int64_t, int64_t, double, double);
template void rmsnorm_rope_forward<double>(const double*, const double*, double*, double*, int64_t, int64_t, int64_t,
                                           int64_t, int64_t, double, double);

}  // namespace moe::cpu
