// Cross-entropy with z-loss, forward and backward. Softmax is max-shifted; exponentials are
// taken in T and summed in double. d(lse)/d(logits) = softmax, hence the (1 + 2 z lse) factor.
#include "cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace moe::cpu {
namespace {

void check_target(const char* op, const int32_t* targets, int64_t i, int64_t vocab) {
  MOE_CHECK(targets[i] < vocab, op, ": target ", targets[i], " at position ", i,
            " is outside the vocabulary [0, ", vocab, ") (negative targets are ignored); check "
            "the data's vocab_size against [model] vocab_size");
}

void check_sizes(const char* op, int64_t n, int64_t vocab) {
  MOE_CHECK(n >= 0 && vocab > 0, op, ": expected n >= 0 and vocab > 0, got n=", n, " vocab=", vocab);
}

}  // namespace

template <typename T>
void cross_entropy_forward(const T* logits, const int32_t* targets, T* loss, T* lse, int64_t n,
                           int64_t vocab, double z_weight) {
  check_sizes("cross_entropy_forward", n, vocab);
  for (int64_t i = 0; i < n; ++i) {
    check_target("cross_entropy_forward", targets, i, vocab);
    const T* row = logits + i * vocab;
    const T m = *std::max_element(row, row + vocab);
    double sum = 0.0;
    for (int64_t j = 0; j < vocab; ++j) sum += static_cast<double>(std::exp(row[j] - m));
    const double l = static_cast<double>(m) + std::log(sum);
    lse[i] = static_cast<T>(l);
    const int32_t t = targets[i];
    loss[i] = t < 0 ? T(0) : static_cast<T>(l - static_cast<double>(row[t]) + z_weight * l * l);
  }
}

template <typename T>
void cross_entropy_backward(const T* logits, const int32_t* targets, const T* lse, T* dlogits,
                            int64_t n, int64_t vocab, double z_weight, T grad_scale) {
  check_sizes("cross_entropy_backward", n, vocab);
  for (int64_t i = 0; i < n; ++i) {
    check_target("cross_entropy_backward", targets, i, vocab);
    const T* row = logits + i * vocab;
    T* drow = dlogits + i * vocab;
    const int32_t t = targets[i];
    if (t < 0) {
      std::fill(drow, drow + vocab, T(0));
      continue;
    }
    const T l = lse[i];
    const T factor = static_cast<T>(static_cast<double>(grad_scale) *
                                    (1.0 + 2.0 * z_weight * static_cast<double>(l)));
    for (int64_t j = 0; j < vocab; ++j) drow[j] = factor * std::exp(row[j] - l);
    drow[t] -= grad_scale;
  }
}

template void cross_entropy_forward<float>(const float*, const int32_t*, float*, float*, int64_t, int64_t,
                                           double);
template void cross_entropy_forward<double>(const double*, const int32_t*, double*, double*, int64_t,
                                            int64_t, double);
template void cross_entropy_backward<float>(const float*, const int32_t*, const float*, float*, int64_t,
                                            int64_t, double, float);
template void cross_entropy_backward<double>(const double*, const int32_t*, const double*, double*,
                                             int64_t, int64_t, double, double);

}  // namespace moe::cpu
