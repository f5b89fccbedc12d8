// Embedding kernels. Forward: out[i, :] = w[ids[i], :] (raw BF16 row copy). Backward: keys (id,
// or `vocab` for a bad id) radix-sorted stably with positions as values; a warp per (run of equal
// keys, column chunk) adds the run's dout rows onto dw's FP32 row in position order, the CPU
// loop's own order (bit-identical). Bad ids never index memory: forward writes a zero row,
// backward skips the row, both add 1 per bad id to *num_bad_ids (integer atomics).
#pragma once

#include "cuda/kernels/vec.cuh"

namespace moe::cuda::kernels {

constexpr int kEmbeddingSegmentsPerBlock = 4;  // warps per block in embedding_accumulate_segments

template <int V>
__global__ void embedding_forward_rows(const int32_t* __restrict__ ids, const uint16_t* __restrict__ w,
                                       uint16_t* __restrict__ out, int64_t n, int64_t vocab, int64_t d,
                                       uint32_t* __restrict__ num_bad_ids) {
  const int64_t vecs = d / V;
  for (int64_t row = int64_t{blockIdx.x} * blockDim.y + threadIdx.y; row < n;
       row += int64_t{gridDim.x} * blockDim.y) {
    const int64_t id = ids[row];
    uint16_t* out_row = out + row * d;
    if (id < 0 || id >= vocab) {
      if (threadIdx.x == 0) atomicAdd(num_bad_ids, 1u);
      for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) store_zero_bf16<V>(out_row + v * V);
      continue;
    }
    const uint16_t* w_row = w + id * d;
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) copy_bf16<V>(w_row + v * V, out_row + v * V);
  }
}

// keys[i] = ids[i] if valid else vocab (sorts last, skipped); positions[i] = i.
__global__ void embedding_make_sort_keys(const int32_t* __restrict__ ids, uint32_t* __restrict__ keys,
                                         uint32_t* __restrict__ positions, int64_t n, int64_t vocab,
                                         uint32_t* __restrict__ num_bad_ids) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t id = ids[i];
    const bool valid = id >= 0 && id < vocab;
    if (!valid) atomicAdd(num_bad_ids, 1u);
    keys[i] = static_cast<uint32_t>(valid ? id : vocab);
    positions[i] = static_cast<uint32_t>(i);
  }
}

template <int V>
__device__ __forceinline__ void load_f32(const float* __restrict__ p, float (&out)[V]) {
  if constexpr (V == 1) {
    out[0] = *p;
  } else {
#pragma unroll
    for (int i = 0; i < V; i += 4) {
      const float4 q = reinterpret_cast<const float4*>(p)[i / 4];
      out[i] = q.x;
      out[i + 1] = q.y;
      out[i + 2] = q.z;
      out[i + 3] = q.w;
    }
  }
}

template <int V>
__device__ __forceinline__ void store_f32(float* __restrict__ p, const float (&in)[V]) {
  if constexpr (V == 1) {
    *p = in[0];
  } else {
#pragma unroll
    for (int i = 0; i < V; i += 4) reinterpret_cast<float4*>(p)[i / 4] = make_float4(in[i], in[i + 1], in[i + 2], in[i + 3]);
  }
}

// Block (32, kEmbeddingSegmentsPerBlock): warp y takes sorted index i = blockIdx.x * 4 + y;
// lane x takes the V columns at vector (blockIdx.y * 32 + x). Only the warp at the start of a
// segment of equal keys works; it owns dw[key, those columns] outright, so no atomics.
template <int V>
__global__ void embedding_accumulate_segments(const uint32_t* __restrict__ sorted_keys,
                                              const uint32_t* __restrict__ sorted_positions,
                                              const uint16_t* __restrict__ dout, float* __restrict__ dw, int64_t n,
                                              int64_t vocab, int64_t d) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.y + threadIdx.y;
  const int64_t vec = int64_t{blockIdx.y} * blockDim.x + threadIdx.x;
  if (i >= n || vec * V >= d) return;
  const uint32_t key = sorted_keys[i];
  if (key >= vocab || (i > 0 && sorted_keys[i - 1] == key)) return;
  const int64_t c = vec * V;
  float* dw_p = dw + int64_t{key} * d + c;
  float acc[V];
  load_f32<V>(dw_p, acc);
  for (int64_t j = i; j < n && sorted_keys[j] == key; ++j) {
    float g[V];
    load_bf16<V>(dout + int64_t{sorted_positions[j]} * d + c, g);
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] += g[k];
  }
  store_f32<V>(dw_p, acc);
}

}  // namespace moe::cuda::kernels
