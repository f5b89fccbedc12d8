// Embedding gather (forward) and scatter-add (backward), with the id range checked per row.
#include "cpu/embedding.h"

#include <algorithm>

#include "core/error.h"

namespace moe::cpu {
namespace {

void check_id(const char* op, const int32_t* ids, int64_t i, int64_t vocab) {
  MOE_CHECK(ids[i] >= 0 && ids[i] < vocab, op, ": token id ", ids[i], " at position ", i,
            " is outside the vocabulary [0, ", vocab, "); check the data's vocab_size against "
            "[model] vocab_size");
}

void check_sizes(const char* op, int64_t n, int64_t vocab, int64_t d) {
  MOE_CHECK(n >= 0 && vocab > 0 && d >= 0, op, ": expected n >= 0, vocab > 0, d >= 0, got n=", n,
            " vocab=", vocab, " d=", d);
}

}  // namespace

template <typename T>
void embedding_forward(const int32_t* ids, const T* w, T* out, int64_t n, int64_t vocab, int64_t d) {
  check_sizes("embedding_forward", n, vocab, d);
  for (int64_t i = 0; i < n; ++i) {
    check_id("embedding_forward", ids, i, vocab);
    const T* row = w + static_cast<int64_t>(ids[i]) * d;
    std::copy(row, row + d, out + i * d);
  }
}

template <typename T>
void embedding_backward(const int32_t* ids, const T* dout, T* dw, int64_t n, int64_t vocab, int64_t d) {
  check_sizes("embedding_backward", n, vocab, d);
  for (int64_t i = 0; i < n; ++i) {
    check_id("embedding_backward", ids, i, vocab);
    T* row = dw + static_cast<int64_t>(ids[i]) * d;
    const T* g = dout + i * d;
    for (int64_t j = 0; j < d; ++j) row[j] += g[j];
  }
}

template void embedding_forward<float>(const int32_t*, const float*, float*, int64_t, int64_t, int64_t);
template void embedding_forward<double>(const int32_t*, const double*, double*, int64_t, int64_t, int64_t);
template void embedding_backward<float>(const int32_t*, const float*, float*, int64_t, int64_t, int64_t);
template void embedding_backward<double>(const int32_t*, const double*, double*, int64_t, int64_t,
                                         int64_t);

}  // namespace moe::cpu
