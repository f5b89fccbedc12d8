// Kernel of the expert-parallel exchange (cuda/ops/ep_exchange.h): a row gather of BF16 rows,
// dst[i] = src[idx[i]] for i < rows, rows of d elements. Used to regroup received rows from
// peer-major to local-expert-major order and back. One thread moves Vec bf16 values (Vec = 8:
// 16-byte loads and stores, needs d % 8 == 0 and 16-byte aligned buffers; Vec = 1 otherwise).
// An index outside [0, src_rows) zeroes the destination row (never an out-of-bounds read).
// Also the one-thread combine of range norms for the expert-parallel grad norm.
#pragma once

#include <cstdint>

namespace moe::cuda::kernels {

constexpr int kEpGatherThreads = 256;

template <int Vec>
__global__ void ep_gather_rows_kernel(const uint16_t* __restrict__ src, const int32_t* __restrict__ idx,
                                      int64_t rows, int64_t src_rows, int64_t d, uint16_t* __restrict__ dst) {
  const int64_t packs = d / Vec;
  const int64_t total = rows * packs;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / packs, pack = i - row * packs;
    const int32_t from = idx[row];
    if constexpr (Vec == 8) {
      uint4 v = make_uint4(0, 0, 0, 0);
      if (from >= 0 && from < src_rows) v = reinterpret_cast<const uint4*>(src + int64_t(from) * d)[pack];
      reinterpret_cast<uint4*>(dst + row * d)[pack] = v;
    } else {
      uint16_t v = 0;
      if (from >= 0 && from < src_rows) v = src[int64_t(from) * d + pack];
      dst[row * d + pack] = v;
    }
  }
}

// out[0] = sum_i v[i]^2 (square) or sum_i v[i] then sqrt; one thread, in index order.
__global__ void ep_norm_combine_kernel(const double* v, int64_t n, bool square, double* out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += square ? v[i] * v[i] : v[i];
  out[0] = square ? acc : sqrt(acc);
}

}  // namespace moe::cuda::kernels
