// Token embedding lookup: out[i, :] = w[ids[i], :]. w is [vocab, d], out and dout are [n, d],
// row-major. Backward scatters rows into dw (+=) in position order, so repeated ids
// accumulate deterministically. Ids outside [0, vocab) throw moe::Error.
#pragma once

#include <cstdint>

namespace moe::cpu {

template <typename T>
void embedding_forward(const int32_t* ids, const T* w /*[V,D]*/, T* out /*[N,D]*/, int64_t n,
                       int64_t vocab, int64_t d);

// dw[ids[i], :] += dout[i, :] for i = 0..n-1.
template <typename T>
void embedding_backward(const int32_t* ids, const T* dout, T* dw /* += */, int64_t n,
                        int64_t vocab, int64_t d);

}  // namespace moe::cpu
