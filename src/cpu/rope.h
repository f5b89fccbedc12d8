// Rotary position embedding, HF "rotate_half" (non-interleaved) convention: within each head
// of width hd, element i pairs with i + hd/2 and rotates by angle = pos * theta^(-2i/hd):
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin. x is [batch, seq, heads, hd] row-major and is
// rotated in place; positions are 0..seq-1 within each sequence. hd must be even. Angles,
// cos and sin are computed in double for both scalar types, then rounded to T.
#pragma once

#include <cstdint>

namespace moe::cpu {

template <typename T>
void rope_forward(T* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double theta);

// Incremental decoding: x [n, heads, hd] holds the tokens at positions pos0 .. pos0 + n - 1 of
// one sequence; each is rotated exactly as rope_forward rotates that position (the same angles).
template <typename T>
void rope_forward_at(T* x, int64_t n, int64_t pos0, int64_t heads, int64_t head_dim, double theta);

// In place: dx = R^T dy, the inverse rotation (rotation by -angle).
template <typename T>
void rope_backward(T* dx, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double theta);

// QK-norm then RoPE: rmsnorm_forward(x, w, y, rstd, batch * seq, heads * head_dim, eps), then
// rope_forward(y, ...) (pos0 = 0) or rope_forward_at(y, seq, pos0, ...) (batch = 1). The twin of
// cuda::rmsnorm_rope_forward (which rounds the normalised values to BF16 before rotating them,
// as its storage between the two ops would).
template <typename T>
void rmsnorm_rope_forward(const T* x, const T* w, T* y, T* rstd, int64_t batch, int64_t seq, int64_t pos0,
                          int64_t heads, int64_t head_dim, double eps, double theta);

// QK-norm's backward after RoPE's: rope_backward(dy, ...) in place, then rmsnorm_backward(x, w,
// rstd, dy, dx, dw, batch * seq, heads * head_dim). The twin of cuda::rope_rmsnorm_backward (which
// leaves dy as it was and rounds the rotated gradient to BF16 as its storage would).
template <typename T>
void rope_rmsnorm_backward(const T* x, const T* w, const T* rstd, T* dy, T* dx, T* dw, int64_t batch, int64_t seq,
                           int64_t heads, int64_t head_dim, double theta);

}  // namespace moe::cpu
