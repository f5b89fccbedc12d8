// Cross-entropy kernels for the fused LM head. cross_entropy_fused_rows: a block per row; pass 1
// reads the row once with an online max / sum (lse = m + log sum exp(x - m), exponentials as
// exp2f((x - m) * log2 e)), pass 2 reads it again and writes
// dlogits = grad_scale * (softmax * (1 + 2 z lse) - onehot(target)) in BF16, possibly over the
// logits (every element is read, then written, by the same thread). cross_entropy_sum_losses adds
// the per-token losses in a fixed order (one block, FP64 tree) onto a device accumulator.
#pragma once

#include <cmath>

#include "cuda/kernels/vec.cuh"

namespace moe::cuda::kernels {

constexpr int kCeMaxThreads = 512;     // threads per row block (the launcher may use fewer, a power of two >= 32)
constexpr int kCeVecBatch = 4;         // 16-byte vectors loaded per thread before they are used
constexpr int kCeSumThreads = 1024;    // threads of the single loss-sum block
constexpr float kLog2e = 1.4426950408889634f;

// Running (max, sum of exp(x - max)) of one thread.
struct OnlineMaxSum {
  float m = -INFINITY;
  float s = 0.0f;

  template <int N>
  __device__ __forceinline__ void add(const float (&x)[N]) {
    float mx = x[0];
#pragma unroll
    for (int i = 1; i < N; ++i) mx = fmaxf(mx, x[i]);
    if (mx > m) {
      s *= exp2f((m - mx) * kLog2e);  // m = -inf: s is 0 and stays 0
      m = mx;
    }
    const float shift = m == -INFINITY ? 0.0f : m;  // all -inf so far: exp(-inf) = 0, never NaN
#pragma unroll
    for (int i = 0; i < N; ++i) s += exp2f((x[i] - shift) * kLog2e);
  }

  __device__ __forceinline__ void merge(float m2, float s2) {
    const float mm = fmaxf(m, m2);
    if (mm == -INFINITY) return;  // both empty (or all -inf): stays (-inf, 0)
    s = s * exp2f((m - mm) * kLog2e) + s2 * exp2f((m2 - mm) * kLog2e);
    m = mm;
  }
};

// Elements before the row's first 16-byte boundary (0..7), given a 2-byte-aligned row start.
__device__ __forceinline__ int64_t head_elements(const uint16_t* row, int64_t vocab) {
  const int64_t to_boundary = static_cast<int64_t>((16u - (reinterpret_cast<uintptr_t>(row) & 15u)) & 15u) / 2;
  return to_boundary < vocab ? to_boundary : vocab;
}

// Grid: one block per row (blockIdx.x = row); blockDim.x a power of two in [32, kCeMaxThreads].
// V = 8: 16-byte accesses in the middle of each row (scalar head and tail up to 16-byte
// boundaries); logits and dlogits must then have the same address modulo 16. V = 1: all scalar.
// A target outside [0, vocab) adds 1 to *num_bad_targets and is treated as ignored (loss 0,
// zero gradient); a negative target is ignored silently. lse is written for every row.
template <int V>
__global__ void __launch_bounds__(kCeMaxThreads, 2)
    cross_entropy_fused_rows(const uint16_t* logits, uint16_t* dlogits, const int32_t* __restrict__ targets,
                             float* __restrict__ loss, float* __restrict__ lse, int64_t vocab, float z_weight,
                             const float* __restrict__ grad_scale, uint32_t* __restrict__ num_bad_targets) {
  __shared__ float s_max[kCeMaxThreads / kWarpSize];
  __shared__ float s_sum[kCeMaxThreads / kWarpSize];
  __shared__ float s_lse;
  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  const uint16_t* x = logits + row * vocab;
  uint16_t* dx = dlogits + row * vocab;
  const int32_t target = targets[row];
  const bool valid = target >= 0 && target < vocab;
  // The target logit is read before the barrier below, hence before pass 2 may overwrite it.
  const float x_target = (tid == 0 && valid) ? bf16_bits_to_f32(x[target]) : 0.0f;

  const int64_t head = V == 1 ? vocab : head_elements(x, vocab);
  const int64_t num_vecs = (vocab - head) / V;
  const int64_t tail = V == 1 ? vocab : head + num_vecs * V;

  // Pass 1: online max / sum.
  OnlineMaxSum acc;
  for (int64_t j = tid; j < head; j += nthreads) {
    const float v[1] = {bf16_bits_to_f32(x[j])};
    acc.add(v);
  }
  if constexpr (V != 1) {
    const uint16_t* xv = x + head;
    for (int64_t base = tid; base < num_vecs; base += int64_t{nthreads} * kCeVecBatch) {
      float v[kCeVecBatch][V];
#pragma unroll
      for (int u = 0; u < kCeVecBatch; ++u) {
        const int64_t idx = base + int64_t{u} * nthreads;
        if (idx < num_vecs) {
          load_bf16<V>(xv + idx * V, v[u]);
        } else {
#pragma unroll
          for (int i = 0; i < V; ++i) v[u][i] = -INFINITY;
        }
      }
#pragma unroll
      for (int u = 0; u < kCeVecBatch; ++u) acc.add(v[u]);
    }
    for (int64_t j = tail + tid; j < vocab; j += nthreads) {
      const float v[1] = {bf16_bits_to_f32(x[j])};
      acc.add(v);
    }
  }

  // Block reduction of (max, sum): warp butterfly, then warp 0 merges the warps in order.
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, acc.m, offset);
    const float s2 = __shfl_xor_sync(0xffffffffu, acc.s, offset);
    acc.merge(m2, s2);
  }
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  if (lane == 0) {
    s_max[warp] = acc.m;
    s_sum[warp] = acc.s;
  }
  __syncthreads();
  if (tid == 0) {
    OnlineMaxSum total;
    for (int w = 0; w < nthreads / kWarpSize; ++w) total.merge(s_max[w], s_sum[w]);
    const float l = total.m + logf(total.s);
    s_lse = l;
    lse[row] = l;
    loss[row] = valid ? (l - x_target) + z_weight * l * l : 0.0f;
    if (target >= vocab) atomicAdd(num_bad_targets, 1u);
  }
  __syncthreads();

  // Pass 2: dlogits (zeros for an ignored or bad target).
  const float l = s_lse;
  const float gs = valid ? *grad_scale : 0.0f;
  const float factor = gs * (1.0f + 2.0f * z_weight * l);
  auto grad = [&](float xj, bool is_target) {
    if (!valid) return 0.0f;
    const float g = factor * exp2f((xj - l) * kLog2e);
    return is_target ? g - gs : g;
  };
  for (int64_t j = tid; j < head; j += nthreads) {
    const float out[1] = {grad(bf16_bits_to_f32(x[j]), j == target)};
    store_bf16<1>(dx + j, out);
  }
  if constexpr (V != 1) {
    const uint16_t* xv = x + head;
    uint16_t* dxv = dx + head;
    for (int64_t base = tid; base < num_vecs; base += int64_t{nthreads} * kCeVecBatch) {
      float v[kCeVecBatch][V];
#pragma unroll
      for (int u = 0; u < kCeVecBatch; ++u) {
        const int64_t idx = base + int64_t{u} * nthreads;
        if (idx < num_vecs) load_bf16<V>(xv + idx * V, v[u]);
      }
#pragma unroll
      for (int u = 0; u < kCeVecBatch; ++u) {
        const int64_t idx = base + int64_t{u} * nthreads;
        if (idx < num_vecs) {
          float out[V];
#pragma unroll
          for (int i = 0; i < V; ++i) out[i] = grad(v[u][i], head + idx * V + i == target);
          store_bf16<V>(dxv + idx * V, out);
        }
      }
    }
    for (int64_t j = tail + tid; j < vocab; j += nthreads) {
      const float out[1] = {grad(bf16_bits_to_f32(x[j]), j == target)};
      store_bf16<1>(dx + j, out);
    }
  }
}

// *loss_sum += sum_i loss[i], in FP64, in an order fixed by n alone: thread t adds i = t, t + 1024,
// ... in order, then a tree over the 1024 partials. One block of kCeSumThreads threads.
__global__ void __launch_bounds__(kCeSumThreads)
    cross_entropy_sum_losses(const float* __restrict__ loss, int64_t n, double* __restrict__ loss_sum) {
  __shared__ double s_part[kCeSumThreads];
  const int tid = threadIdx.x;
  double acc = 0.0;
  for (int64_t i = tid; i < n; i += kCeSumThreads) acc += static_cast<double>(loss[i]);
  s_part[tid] = acc;
  __syncthreads();
#pragma unroll
  for (int stride = kCeSumThreads / 2; stride > 0; stride >>= 1) {
    if (tid < stride) s_part[tid] += s_part[tid + stride];
    __syncthreads();
  }
  if (tid == 0) *loss_sum += s_part[0];
}

}  // namespace moe::cuda::kernels
