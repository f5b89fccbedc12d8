// Per-token cross-entropy over the vocabulary with an optional z-loss on the LM head:
// loss_i = lse_i - logits_i[target_i] + z_weight * lse_i^2, lse_i = log(sum_j exp(logits_ij)).
// logits and dlogits are [n, vocab] row-major; loss, lse and targets are [n]. Targets < 0 are
// ignored (loss 0, zero gradient; lse is still written). Row sums accumulate in double.
#pragma once

#include <cstdint>

namespace moe::cpu {

// Throws moe::Error for a target >= vocab, naming the position.
template <typename T>
void cross_entropy_forward(const T* logits /*[N,V]*/, const int32_t* targets, T* loss /*[N]*/,
                           T* lse /*[N]*/, int64_t n, int64_t vocab, double z_weight);

// dlogits_ij = grad_scale * (softmax_ij * (1 + 2 z_weight lse_i) - [j == target_i]), overwritten.
template <typename T>
void cross_entropy_backward(const T* logits, const int32_t* targets, const T* lse,
                            T* dlogits /*[N,V] overwritten*/, int64_t n, int64_t vocab,
                            double z_weight, T grad_scale);

}  // namespace moe::cpu
