// Sync-free MoE routing on the GPU: router (scores, top-k, weights, counts, lb/z losses) forward
// and backward, the dispatch map (stable counting sort of the T*k routes by expert, optional
// capacity), permute (gather into expert-contiguous rows) and unpermute (weighted combine), with
// the same contracts as src/cpu/{router,dispatch,capacity}.h. Every size is a static shape; no
// entry point reads a device value on the host, so a whole sequence is capturable in a CUDA graph.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/fp8_types.h"
#include "core/moe_types.h"  // ScoreFunc, RoutingMode: shared with the CPU reference
#include "cuda/device.h"  // Stream = CUstream_st* (cudaStream_t); no CUDA headers here

namespace moe::cuda {

using moe::RoutingMode;
using moe::ScoreFunc;

constexpr int64_t kMaxRouterExperts = 256;  // one warp holds a token's E scores (8 per lane)
constexpr int64_t kMaxRouterTopK = 16;

// Shapes and modes of one router call (T = num_tokens, E = num_experts, k = top_k).
struct RouterParams {
  int64_t num_tokens = 0, num_experts = 0, top_k = 0;
  ScoreFunc score = ScoreFunc::kSoftmax;
  bool norm_topk = false;
  RoutingMode mode = RoutingMode::kLearned;
  uint64_t seed = 0;  // random routing: experts depend only on (seed, token index, k)
  // Random routing inside a CUDA graph: when set, the seed is layer_routing_seed(*seed_device,
  // seed_layer), read by the kernel from device memory (the step writes it before each replay),
  // and `seed` is not used.
  const uint64_t* seed_device = nullptr;
  uint64_t seed_layer = 0;
};

// ---------------------------------------------------------------------------------------------
// Router. Semantics as cpu::router_forward on the same FP32 logits (the gate GEMM is elsewhere):
// - scores = softmax(logits) per row (max-subtracted) or sigmoid(logits), FP32.
// - kLearned: top-k of key = score + expert_bias (bias may be null; selection only), slots in
//   decreasing key, equal keys to the lowest expert index; a NaN key ranks below every number.
//   kRandom: the CPU op's hashed partial Fisher-Yates shuffle (bitwise the same experts).
//   kUniform: experts (t*k + j) mod E.
// - topk_w[t,j] = scores[t, topk_idx[t,j]], divided by their sum when norm_topk.
// - num_tokens_per_expert[e] = routes to e (sums to T*k); score_sum[e] = sum_t scores[t,e];
//   losses[0] = lb_loss = E * sum_e (count_e / (T*k)) * (score_sum_e / T),
//   losses[1] = z_loss = mean_t (logsumexp_e logits[t,e])^2; all 0 when T = 0.
// Every output is written (never accumulated). Sums run in a fixed order: results are
// deterministic for given shapes. `workspace` is caller-owned device scratch of at least
// router_workspace_bytes(p) bytes (a smaller workspace_bytes throws naming the query).
// Checks (moe::Error): T >= 0, E in [1, 256], top_k in [1, min(E, 16)], non-null buffers.
size_t router_workspace_bytes(const RouterParams& p);

void router_forward(const RouterParams& p, const float* logits /*[T,E]*/,
                    const float* expert_bias /*[E] or nullptr*/, float* scores /*[T,E]*/,
                    int32_t* topk_idx /*[T,k]*/, float* topk_w /*[T,k]*/,
                    int32_t* num_tokens_per_expert /*[E]*/, float* score_sum /*[E] or nullptr*/,
                    float* losses /*[2]: lb_loss, z_loss*/, void* workspace,
                    size_t workspace_bytes, Stream stream);

// dlogits [T,E] (overwritten) of L = sum(topk_w * dtopk_w) + dlb * lb_loss + dz * z_loss, from
// the saved logits, scores, topk_idx and counts. dlb and dz are FP32 scalars in device memory
// (null means 0) so a captured graph replays with new values. dx and dW_gate come from the gate
// GEMM's backward elsewhere. A saved expert index outside [0, E) contributes nothing.
void router_backward(const RouterParams& p, const float* logits /*[T,E]*/,
                     const float* scores /*[T,E]*/, const int32_t* topk_idx /*[T,k]*/,
                     const int32_t* num_tokens_per_expert /*[E]*/, const float* dtopk_w /*[T,k]*/,
                     const float* dlb /*device scalar or nullptr*/,
                     const float* dz /*device scalar or nullptr*/, float* dlogits /*[T,E]*/,
                     Stream stream);

// ---------------------------------------------------------------------------------------------
// Dispatch map: stable counting sort of the R = T*k routes r = t*k + j by expert, as
// cpu::build_dispatch_map followed (capacity > 0) by cpu::apply_capacity:
// - num_tokens_per_expert[e]: routes to e before any dropping (the real load).
// - expert_offsets [E+1]: prefix sums of the kept rows per expert (min(count, capacity), or the
//   count when capacity <= 0); expert e owns rows [offsets[e], offsets[e+1]), in increasing r.
// - sorted_route [R]: route id of each row; rows past offsets[E] (dropped tail) hold -1.
// - route_to_row [R]: row of each route, -1 when dropped.
// - num_dropped [1] (or nullptr): routes without a row, R - offsets[E] (0 when dropless).
// An expert index outside [0, E) never traps (graph-safe) and never indexes memory: the route is
// left out of every count and dropped (route_to_row = -1), so it shows in num_dropped; the
// CPU op throws instead. Deterministic: per-tile histograms, one scan over (expert, tile), a
// stable per-warp ranking. Checks: T >= 0, E in [1, 256], top_k in [1, E], T*k fits int32,
// workspace_bytes >= dispatch_map_workspace_bytes(T, k, E).
size_t dispatch_map_workspace_bytes(int64_t num_tokens, int64_t top_k, int64_t num_experts);

void build_dispatch_map(const int32_t* topk_idx /*[T,k]*/, int64_t num_tokens, int64_t top_k,
                        int64_t num_experts, int64_t capacity /*<= 0: dropless*/,
                        int32_t* num_tokens_per_expert /*[E]*/, int32_t* expert_offsets /*[E+1]*/,
                        int32_t* sorted_route /*[T*k]*/, int32_t* route_to_row /*[T*k]*/,
                        int32_t* num_dropped /*[1] or nullptr*/, void* workspace,
                        size_t workspace_bytes, Stream stream);

// ---------------------------------------------------------------------------------------------
// Data movement on BF16 rows (bit patterns as uint16_t). Row buffers hold R = T*k rows (the
// static bound); rows are D elements. 16-byte accesses when D % 8 == 0 and every row pointer is
// 16-byte aligned, else 2-byte accesses. A route id or row outside [0, R) is read as -1 (padding
// or dropped): never a trap, never an out-of-bounds access; build_dispatch_map makes none.

// x_sorted[row] = x[sorted_route[row] / k]; a row whose route is -1 is zeroed. route_to_row is
// sorted_route's inverse (build_dispatch_map writes both): the op scatters each token row, read
// once, into the rows route_to_row names for its kept routes, and zeroes the rows sorted_route
// leaves without a route. Maps that are not each other's inverse never index out of bounds, but
// the rows they name get unspecified values.
void permute_forward(const uint16_t* x /*[T,D]*/, const int32_t* sorted_route /*[R]*/,
                     const int32_t* route_to_row /*[T*k]*/, int64_t num_tokens, int64_t top_k, int64_t d,
                     uint16_t* x_sorted /*[R,D]*/, Stream stream);

// dx[t] += sum_j dx_sorted[route_to_row[t*k + j]] (dropped routes skipped): a gather over the
// token's k routes in slot order, FP32 accumulation, one BF16 rounding; no atomics.
void permute_backward(const uint16_t* dx_sorted /*[R,D]*/, const int32_t* route_to_row /*[T*k]*/,
                      int64_t num_tokens, int64_t top_k, int64_t d, uint16_t* dx /*[T,D], += */,
                      Stream stream);

// Combine: out[t] = sum_j topk_w[t,j] * y_sorted[route_to_row[t*k + j]] in slot order, FP32
// accumulation, BF16 out (overwritten); dropped routes contribute nothing.
void unpermute_forward(const uint16_t* y_sorted /*[R,D]*/, const int32_t* route_to_row /*[T*k]*/,
                       const float* topk_w /*[T,k]*/, int64_t num_tokens, int64_t top_k, int64_t d,
                       uint16_t* out /*[T,D]*/, Stream stream);

// unpermute_forward added into the residual stream: acc[t] (FP32) += the combine rounded to BF16,
// then acc_bf16[t] = bf16(acc[t]) when acc_bf16 is not null: unpermute_forward into a BF16 tensor
// and residual_add(acc, it, acc_bf16) (cuda/ops/memory.h), the same bits without that tensor.
void unpermute_forward_add(const uint16_t* y_sorted /*[R,D]*/, const int32_t* route_to_row /*[T*k]*/,
                           const float* topk_w /*[T,k]*/, int64_t num_tokens, int64_t top_k, int64_t d,
                           float* acc /*[T,D] FP32, += */, uint16_t* acc_bf16 /*[T,D] or null*/, Stream stream);

// dy_sorted[row of (t,j)] = topk_w[t,j] * dout[t] (BF16), rows whose sorted_route is -1 zeroed;
// dtopk_w[t,j] = <dout[t], y_sorted[row of (t,j)]> in FP32 (0 for a dropped route).
void unpermute_backward(const uint16_t* dout /*[T,D]*/, const uint16_t* y_sorted /*[R,D]*/,
                        const int32_t* sorted_route /*[R]*/, const int32_t* route_to_row /*[T*k]*/,
                        const float* topk_w /*[T,k]*/, int64_t num_tokens, int64_t top_k, int64_t d,
                        uint16_t* dy_sorted /*[R,D]*/, float* dtopk_w /*[T,k]*/,
                        Stream stream);

// The FP8 experts' producers (train.precision = "fp8", d a multiple of 128; rows 16-byte and q
// 8-byte aligned): permute_forward and unpermute_backward, their BF16 rows and dtopk_w bitwise, that
// also write the rows' 1 x 128 E4M3 codes q [R, D] and FP32 scales [R, D / 128] (row-major),
// bitwise what fp8_quantize_blocks (cuda/ops/fp8.h) writes for the BF16 rows they store; a row
// without a route gets codes 0 and scale 1. The experts' first FP8 GEMM then reads these codes
// (experts_forward_fp8 / experts_backward_fp8 with the input quantised) instead of a
// quantisation pass over rows that were just written.
void permute_forward_fp8(const uint16_t* x /*[T,D]*/, const int32_t* sorted_route /*[R]*/,
                         const int32_t* route_to_row /*[T*k]*/, int64_t num_tokens, int64_t top_k, int64_t d,
                         uint16_t* x_sorted /*[R,D]*/, uint8_t* q /*[R,D]*/, float* scales /*[R,D/128]*/,
                         Stream stream, Fp8Rule rule = Fp8Rule::kBlocks);
void unpermute_backward_fp8(const uint16_t* dout /*[T,D]*/, const uint16_t* y_sorted /*[R,D]*/,
                            const int32_t* sorted_route /*[R]*/, const int32_t* route_to_row /*[T*k]*/,
                            const float* topk_w /*[T,k]*/, int64_t num_tokens, int64_t top_k, int64_t d,
                            uint16_t* dy_sorted /*[R,D]*/, float* dtopk_w /*[T,k]*/, uint8_t* q /*[R,D]*/,
                            float* scales /*[R,D/128]*/, Stream stream, Fp8Rule rule = Fp8Rule::kBlocks);

}  // namespace moe::cuda
