// Fused cross-entropy for a chunked LM head on the GPU, same math as cpu/cross_entropy.h:
// loss_i = lse_i - x_i[t_i] + z_weight * lse_i^2 and dlogits = grad_scale * (softmax * (1 + 2 z lse)
// - onehot(t_i)), forward and backward in one pass pair over BF16 logits [n, vocab] (row-major,
// uint16_t bit patterns). loss, lse [n] FP32; dlogits BF16, written over the logits when the two
// pointers are equal, so a chunk never holds two [n, vocab] buffers.
#pragma once

#include <cstdint>

#include "cuda/device.h"

namespace moe::cuda {

// For each row i < n: lse[i] (always written), loss[i], and dlogits row i (overwritten).
// - targets[i] < 0: ignored, loss 0 and a zero gradient row (as on CPU).
// - targets[i] >= vocab: adds 1 to *num_bad_targets (a caller-owned device counter, never reset
//   here) and is otherwise treated as ignored: loss 0, zero gradient. Never traps (graph-safe);
//   the CPU twin throws instead.
// - grad_scale: a device FP32 scalar read by the kernel (a captured graph replays with whatever
//   value it holds then), e.g. 1 / (number of counted tokens in the step).
// - loss_sum (device FP64, may be null): += sum_i loss[i], summed in an order fixed by n alone
//   (deterministic), after the per-token losses are written, on the same stream.
// dlogits either equals logits (in place) or does not overlap it. Vocab up to 2^31 - 1, n up to
// 2^31 - 1 rows. Logits are read twice, dlogits written once; no workspace.
// block_threads: the threads of a row's block, 0 for cross_entropy_block_threads(vocab), else a
// power of two in [32, 512] (the op bench times the choices; the results do not depend on it
// beyond FP32 summation order).
void cross_entropy_forward_backward(const uint16_t* logits, uint16_t* dlogits, const int32_t* targets,
                                    float* loss, float* lse, int64_t n, int64_t vocab, double z_weight,
                                    const float* grad_scale, double* loss_sum, uint32_t* num_bad_targets,
                                    Stream stream, int block_threads = 0);

// The launcher's threads a row for `vocab`: the smallest power of two in [32, 512] whose threads
// cover the row's 16-byte vectors in kCeVecBatch loads each.
int cross_entropy_block_threads(int64_t vocab);

}  // namespace moe::cuda
