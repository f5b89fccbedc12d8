// Rotary position embedding on the GPU, same contract as cpu/rope.h: x[batch, seq, heads,
// head_dim] in BF16 (uint16_t bit patterns), rotated in place; position = sequence index s,
// pairs (i, i + head_dim/2) (HF rotate_half), angle = s * theta^(-2i/head_dim). The backward
// applies the inverse rotation to the gradient in place. FP32 math; cos/sin within 3e-7 of
// the double-precision values, so results match the reference to one BF16 rounding.
#pragma once

#include <cstdint>

#include "cuda/device.h"

namespace moe::cuda {

void rope_forward(uint16_t* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double theta,
                  Stream stream);

// Rows x[n, heads, head_dim] at positions pos0 .. pos0 + n - 1 (as cpu::rope_forward_at): the
// new tokens of a KV-cached decode, whose cache holds pos0 positions.
void rope_forward_at(uint16_t* x, int64_t n, int64_t pos0, int64_t heads, int64_t head_dim, double theta,
                     Stream stream);

void rope_backward(uint16_t* dx, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double theta,
                   Stream stream);

// QK-norm then RoPE: rmsnorm_forward(x, w, y, rstd, batch * seq, heads * head_dim, eps), then
// rope_forward(y, batch, seq, heads, head_dim, theta) (pos0 = 0) or rope_forward_at(y, seq, pos0,
// ...) (batch = 1), in one pass where head_dim / 2 is a multiple of 8 and x, w, y are 16-byte
// aligned (else the two ops): the same bits. The CPU twin is cpu::rmsnorm_rope_forward (BF16 storage
// between the two ops aside).
void rmsnorm_rope_forward(const uint16_t* x, const uint16_t* w, uint16_t* y, float* rstd, int64_t batch, int64_t seq,
                          int64_t pos0, int64_t heads, int64_t head_dim, double eps, double theta, Stream stream);

}  // namespace moe::cuda
