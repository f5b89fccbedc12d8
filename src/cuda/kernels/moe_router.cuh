// MoE router kernels: one warp per token holds its E <= 256 FP32 logits (lane owns experts
// lane + 32*i, i < kPerLane), computes softmax/sigmoid scores, selects k experts by k warp
// arg-max rounds over (key desc, index asc) or by the random / uniform rule, and leaves per-block
// partial sums (scores per expert, lse^2, counts); a one-block kernel reduces them in a fixed
// order into counts, score sums and the lb/z losses. Backward: dlogits [T,E] per token.
#pragma once

#include <climits>
#include <cstdint>

#include "core/moe_types.h"
#include "cuda/kernels/moe_common.cuh"

namespace moe::cuda::kernels {

using moe::RoutingMode;

constexpr int kRouterWarps = 8;
constexpr int kRouterThreads = kRouterWarps * 32;
constexpr int kFinishThreads = 1024;
constexpr int kFinishWarps = kFinishThreads / 32;
constexpr int kRouterMaxExperts = 256;  // 8 per lane

// The CPU router's counter-based hash (src/cpu/router.cpp), bit for bit.
__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__device__ __forceinline__ uint64_t route_hash(uint64_t seed, uint64_t token, uint64_t slot) {
  return splitmix64(splitmix64(splitmix64(seed) ^ token) ^ slot);
}

// Selection order: the larger key first, equal keys to the lower expert index.
__device__ __forceinline__ bool ranks_before(float key_a, int idx_a, float key_b, int idx_b) {
  return key_a > key_b || (key_a == key_b && idx_a < idx_b);
}

struct ForwardArgs {
  const float* logits;
  const float* bias;
  float* scores;
  int32_t* topk_idx;
  float* topk_w;
  float* score_partial;   // [blocks, E+1]: per-block sums of scores[:,e], then of lse^2
  int32_t* count_partial;  // [blocks, E]
  int64_t num_tokens;
  int num_experts;
  int top_k;
  bool softmax;
  bool norm_topk;
  RoutingMode mode;
  uint64_t seed;
  const uint64_t* seed_device;  // non-null: seed = layer_routing_seed(*seed_device, seed_layer)
  uint64_t seed_layer;
};

template <int kPerLane>
__global__ void __launch_bounds__(kRouterThreads) router_forward_warp_per_token(ForwardArgs a) {
  __shared__ float s_sum[kRouterWarps][kRouterMaxExperts + 1];
  __shared__ int32_t s_count[kRouterMaxExperts];
  __shared__ int32_t s_perm[kRouterWarps][kRouterMaxExperts];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int E = a.num_experts, k = a.top_k;
  for (int e = threadIdx.x; e < E; e += kRouterThreads) s_count[e] = 0;
  __syncthreads();

  float acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) acc[i] = 0.f;
  float lse_sq = 0.f;

  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRouterWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kRouterWarps + warp; t < a.num_tokens;
       t += stride) {
    const float* l = a.logits + t * E;
    float x[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      x[i] = e < E ? l[e] : -INFINITY;
    }
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) m = fmaxf(m, x[i]);
    m = warp_max(m);
    float ex[kPerLane];
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      ex[i] = lane + 32 * i < E ? expf(x[i] - m) : 0.f;
      sum += ex[i];
    }
    sum = warp_sum(sum);
    const float lse = m + logf(sum);
    if (lane == 0) lse_sq += lse * lse;

    float s[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      s[i] = 0.f;
      if (e < E) {
        s[i] = a.softmax ? ex[i] / sum : 1.f / (1.f + expf(-x[i]));
        a.scores[t * E + e] = s[i];
        acc[i] += s[i];
      }
    }

    int my_idx = 0;    // lane j < k: the expert of slot j
    float my_w = 0.f;  // and its weight
    if (a.mode == RoutingMode::kLearned) {
      float key[kPerLane];
      uint32_t taken = 0;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int e = lane + 32 * i;
        if (e < E) {
          const float kv = s[i] + (a.bias ? a.bias[e] : 0.f);
          key[i] = kv != kv ? -INFINITY : kv;  // NaN ranks below every number
        } else {
          key[i] = -INFINITY;
          taken |= 1u << i;
        }
      }
      for (int j = 0; j < k; ++j) {
        float best_key = -INFINITY, best_s = 0.f;
        int best = INT_MAX;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const int e = lane + 32 * i;
          if (!((taken >> i) & 1u) && ranks_before(key[i], e, best_key, best)) {
            best_key = key[i];
            best = e;
            best_s = s[i];
          }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          const float other_key = __shfl_xor_sync(kFullMask, best_key, o);
          const int other = __shfl_xor_sync(kFullMask, best, o);
          const float other_s = __shfl_xor_sync(kFullMask, best_s, o);
          if (ranks_before(other_key, other, best_key, best)) {
            best_key = other_key;
            best = other;
            best_s = other_s;
          }
        }
        if ((best & 31) == lane) taken |= 1u << (best >> 5);
        if (lane == j) {
          my_idx = best;
          my_w = best_s;
        }
      }
    } else {
      if (a.mode == RoutingMode::kRandom) {
        const uint64_t seed = a.seed_device != nullptr ? layer_routing_seed(*a.seed_device, a.seed_layer) : a.seed;
        // First k steps of a Fisher-Yates shuffle of 0..E-1; step j swaps slot j with
        // j + h(seed, t, j) mod (E - j), exactly as the CPU op.
        int32_t* perm = s_perm[warp];
        for (int e = lane; e < E; e += 32) perm[e] = e;
        __syncwarp();
        if (lane == 0) {
          for (int j = 0; j < k; ++j) {
            const uint64_t span = static_cast<uint64_t>(E - j);
            const int r = j + static_cast<int>(route_hash(seed, static_cast<uint64_t>(t),
                                                          static_cast<uint64_t>(j)) % span);
            const int32_t tmp = perm[j];
            perm[j] = perm[r];
            perm[r] = tmp;
          }
        }
        __syncwarp();
        if (lane < k) my_idx = perm[lane];
        __syncwarp();  // perm is refilled for the next token
      } else {
        if (lane < k) my_idx = static_cast<int>((t * k + lane) % E);
      }
      // Weight of slot j: the score this warp just stored (ordered by __syncwarp); reading it
      // back keeps s[] in registers, where a run-time index would move it to local memory.
      __syncwarp();
      if (lane < k) my_w = a.scores[t * E + my_idx];
    }
    if (a.norm_topk) {
      float sum_w = 0.f;  // slot order, as the CPU op
      for (int j = 0; j < k; ++j) sum_w += __shfl_sync(kFullMask, my_w, j);
      my_w /= sum_w;
    }
    if (lane < k) {
      a.topk_idx[t * k + lane] = my_idx;
      a.topk_w[t * k + lane] = my_w;
      atomicAdd(&s_count[my_idx], 1);  // integer: order-free
    }
  }

#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    if (e < E) s_sum[warp][e] = acc[i];
  }
  if (lane == 0) s_sum[warp][E] = lse_sq;
  __syncthreads();
  for (int c = threadIdx.x; c <= E; c += kRouterThreads) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kRouterWarps; ++w) v += s_sum[w][c];
    a.score_partial[static_cast<int64_t>(blockIdx.x) * (E + 1) + c] = v;
  }
  for (int e = threadIdx.x; e < E; e += kRouterThreads)
    a.count_partial[static_cast<int64_t>(blockIdx.x) * E + e] = s_count[e];
}

// One block: column c of the partials is summed by 32 warps (warp w takes blocks w, w+32, ...)
// and then over warps in order; counts, score sums and losses are written, never accumulated.
__global__ void __launch_bounds__(kFinishThreads)
    router_finish_losses(const float* score_partial, const int32_t* count_partial, int num_blocks,
                         int64_t num_tokens, int num_experts, int top_k,
                         int32_t* num_tokens_per_expert, float* score_sum, float* losses) {
  __shared__ float s_part[kFinishWarps][33];
  __shared__ int32_t s_cpart[kFinishWarps][33];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int E = num_experts;
  double lb = 0.0;   // warp 0: sum_e count_e * score_sum_e over this lane's experts
  float lse_sq = 0.f;  // warp 0, lane E % 32
  for (int c0 = 0; c0 <= E; c0 += 32) {
    const int c = c0 + lane;
    float v = 0.f;
    int32_t n = 0;
    if (c <= E) {
      for (int b = warp; b < num_blocks; b += kFinishWarps) {
        v += score_partial[static_cast<int64_t>(b) * (E + 1) + c];
        if (c < E) n += count_partial[static_cast<int64_t>(b) * E + c];
      }
    }
    s_part[warp][lane] = v;
    s_cpart[warp][lane] = n;
    __syncthreads();
    if (warp == 0 && c <= E) {
      float tot = 0.f;
      int32_t cnt = 0;
      for (int w = 0; w < kFinishWarps; ++w) {
        tot += s_part[w][lane];
        cnt += s_cpart[w][lane];
      }
      if (c < E) {
        num_tokens_per_expert[c] = cnt;
        if (score_sum) score_sum[c] = tot;
        lb += static_cast<double>(cnt) * static_cast<double>(tot);
      } else {
        lse_sq = tot;
      }
    }
    __syncthreads();
  }
  if (warp == 0) {
    lb = warp_sum(lb);
    lse_sq = __shfl_sync(kFullMask, lse_sq, E & 31);
    if (lane == 0) {
      const double n = static_cast<double>(num_tokens);
      losses[0] = num_tokens > 0 ? static_cast<float>(E * lb / (n * top_k * n)) : 0.f;
      losses[1] = num_tokens > 0 ? static_cast<float>(static_cast<double>(lse_sq) / n) : 0.f;
    }
  }
}

struct BackwardArgs {
  const float* logits;
  const float* scores;
  const int32_t* topk_idx;
  const int32_t* counts;
  const float* dtopk_w;
  const float* dlb;
  const float* dz;
  float* dlogits;
  int64_t num_tokens;
  int num_experts;
  int top_k;
  bool softmax;
  bool norm_topk;
};

template <int kPerLane>
__global__ void __launch_bounds__(kRouterThreads) router_backward_warp_per_token(BackwardArgs a) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int E = a.num_experts, k = a.top_k;
  const float dlb = a.dlb ? *a.dlb : 0.f;
  const float dz = a.dz ? *a.dz : 0.f;
  const float n = static_cast<float>(a.num_tokens);
  const float nk = static_cast<float>(a.num_tokens * k);
  float lb_grad[kPerLane];  // dlb * d lb / d scores[t,e], the same for every token
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    lb_grad[i] = e < E ? dlb * static_cast<float>(E) * (static_cast<float>(a.counts[e]) / nk) / n
                       : 0.f;
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRouterWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kRouterWarps + warp; t < a.num_tokens;
       t += stride) {
    float s[kPerLane], ds[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      s[i] = e < E ? a.scores[t * E + e] : 0.f;
      ds[i] = lb_grad[i];
    }
    int my_idx = 0;
    float my_g = 0.f, my_s = 0.f;
    if (lane < k) {
      my_idx = a.topk_idx[t * k + lane];
      if (my_idx >= 0 && my_idx < E) {  // a bad index contributes nothing (and reads nothing)
        my_g = a.dtopk_w[t * k + lane];
        my_s = a.scores[t * E + my_idx];
      } else {
        my_idx = -1;
      }
    }
    // Through w_j = s_j / S when norm_topk: ds_i = (g_i - sum_j g_j w_j) / S.
    float sum = 0.f, gw = 0.f;
    if (a.norm_topk) {
      for (int j = 0; j < k; ++j) sum += __shfl_sync(kFullMask, my_s, j);
      for (int j = 0; j < k; ++j)
        gw += __shfl_sync(kFullMask, my_g, j) * __shfl_sync(kFullMask, my_s, j) / sum;
    }
    for (int j = 0; j < k; ++j) {
      const int e = __shfl_sync(kFullMask, my_idx, j);
      const float g = __shfl_sync(kFullMask, my_g, j);
      const float v = a.norm_topk ? (g - gw) / sum : g;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) ds[i] += lane + 32 * i == e ? v : 0.f;  // no run-time index
    }
    if (a.softmax) {
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) dot += ds[i] * s[i];
      dot = warp_sum(dot);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) ds[i] = s[i] * (ds[i] - dot);
    } else {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) ds[i] = ds[i] * s[i] * (1.f - s[i]);
    }
    if (dz != 0.f) {  // z term: dz * 2/T * lse_t * softmax(logits)_t
      const float* l = a.logits + t * E;
      float x[kPerLane];
      float m = -INFINITY;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int e = lane + 32 * i;
        x[i] = e < E ? l[e] : -INFINITY;
        m = fmaxf(m, x[i]);
      }
      m = warp_max(m);
      float se = 0.f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) se += lane + 32 * i < E ? expf(x[i] - m) : 0.f;
      const float lse = m + logf(warp_sum(se));
      const float c = dz * 2.f / n * lse;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (lane + 32 * i < E) ds[i] += c * expf(x[i] - lse);
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < E) a.dlogits[t * E + e] = ds[i];
    }
  }
}

}  // namespace moe::cuda::kernels
