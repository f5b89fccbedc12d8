// Causal softmax attention with grouped-query heads. q, out, dout, dq are [B, S, Hq, hd];
// k, v, dk, dv are [B, S, Hkv, hd]; query head h reads kv head h / (Hq / Hkv). Scores are
// scaled by 1/sqrt(hd) and query i sees keys 0..i. lse [B, Hq, S] is the log-sum-exp of each
// row of scaled scores, saved so backward recomputes the probabilities (flash-attention
// style, with D_i = dot(dout_i, out_i)). Work is split over (batch, kv head) pairs, each
// computed whole by one thread, so results do not depend on the thread count.
#pragma once

#include <cstdint>

namespace moe::cpu {

template <typename T>
void attention_forward(const T* q, const T* k, const T* v, T* out, T* lse, int64_t batch,
                       int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim);

// Incremental decoding of one sequence: q, out [n, Hq, hd] are the queries at positions
// pos0 .. pos0 + n - 1; k, v [pos0 + n, Hkv, hd] hold every position up to the last query's
// (a KV cache). Query i sees keys 0 .. pos0 + i, scaled and normalised as attention_forward does
// (max-subtracted exp, the row sum in double); equal to its output to rounding, not bitwise (the
// dot products are summed in another order than the forward's GEMM).
template <typename T>
void attention_decode(const T* q, const T* k, const T* v, T* out, int64_t n, int64_t pos0, int64_t q_heads,
                      int64_t kv_heads, int64_t head_dim);

// dq, dk, dv are overwritten.
template <typename T>
void attention_backward(const T* q, const T* k, const T* v, const T* out, const T* lse,
                        const T* dout, T* dq, T* dk, T* dv /*all three overwritten*/,
                        int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads,
                        int64_t head_dim);

}  // namespace moe::cpu
