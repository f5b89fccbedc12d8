// MoE dispatch and combine on CPU. A route r = t*k + j is token t's slot j. The dispatch map is
// a stable counting sort of the T*k routes by expert: expert e owns the contiguous sorted rows
// [expert_offsets[e], expert_offsets[e+1]), rows within an expert in increasing route id.
// permute gathers token rows into that expert-contiguous buffer; unpermute (combine) is its
// weighted inverse. Backward of permute is a (weight-1) combine and vice versa.
#pragma once

#include <cstdint>

namespace moe::cpu {

// Stable counting sort of the T*k (token, slot) routes by expert.
// MOE_CHECK every index in [0, E) naming token and slot.
void build_dispatch_map(const int32_t* topk_idx, int64_t num_tokens, int64_t top_k,
                        int64_t num_experts, int32_t* num_tokens_per_expert /*[E]*/,
                        int32_t* expert_offsets /*[E+1], prefix sum*/,
                        int32_t* sorted_route /*[T*k]: route id r = t*k + j held by each sorted row*/,
                        int32_t* route_to_row /*[T*k]: the sorted row of each route (inverse permutation)*/);

// x_sorted[row] = x[sorted_route[row] / top_k]; a row whose route is -1 (padding) is zeroed.
template <typename T>
void permute_forward(const T* x /*[T,D]*/, const int32_t* sorted_route, int64_t rows, int64_t top_k,
                     int64_t d, T* x_sorted /*[rows,D]*/);

// dx[sorted_route[row] / top_k] += dx_sorted[row]; padding rows (-1) are skipped.
template <typename T>
void permute_backward(const T* dx_sorted, const int32_t* sorted_route, int64_t rows, int64_t top_k,
                      int64_t d, T* dx /*[T,D], += */);

// combine: out[t] = sum_j topk_w[t,j] * y_sorted[route_to_row[t*k+j]]; a route whose row is -1
// (dropped) contributes nothing.
template <typename T>
void unpermute_forward(const T* y_sorted, const int32_t* route_to_row, const T* topk_w,
                       int64_t num_tokens, int64_t top_k, int64_t d, T* out /*[T,D] overwritten*/);

// unpermute_forward added into acc (acc[t] += out[t]) instead of stored: the twin of
// cuda::unpermute_forward_add (which rounds the combine and the sum to BF16 as its storage does).
template <typename T>
void unpermute_forward_add(const T* y_sorted, const int32_t* route_to_row, const T* topk_w,
                           int64_t num_tokens, int64_t top_k, int64_t d, T* acc /*[T,D] += */);

// dy_sorted[row of (t,j)] = topk_w[t,j] * dout[t] (rows no route names are zeroed);
// dtopk_w[t,j] = <dout[t], y_sorted[row of (t,j)]> (0 for a dropped route).
template <typename T>
void unpermute_backward(const T* dout, const T* y_sorted, const int32_t* route_to_row,
                        const T* topk_w, int64_t num_tokens, int64_t top_k, int64_t d, int64_t rows,
                        T* dy_sorted /*[rows,D] overwritten*/, T* dtopk_w /*[T,k] overwritten*/);

}  // namespace moe::cpu
