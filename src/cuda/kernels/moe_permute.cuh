// Permute / unpermute kernels on BF16 rows (bit patterns), driven by the dispatch map. No atomics,
// deterministic: one thread per kVec-value pack (kVec = 8: one 16-byte access) for permute (a
// scatter: each token row read once, stored into its routes' rows, one writer per row), its
// backward and the combine (gathers); one warp per route for unpermute's
// backward, which also reduces <dout[t], y_sorted[row]>. FP32 sums in slot order, one BF16
// rounding per output. Indices outside [0, R = T*k) count as -1 (none). The FP8 experts'
// producers (permute_scatter_rows_fp8, unpermute_backward_warp_per_route<8, true>) write the same BF16 rows and their
// 1 x 128 E4M3 codes and FP32 scales by the FP8 rule (fp8_quantize_half_warp_block of the stored values: bitwise
// what fp8_quantize_blocks writes for those rows), d a multiple of 128.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/kernels/fp8_codes.cuh"
#include "cuda/kernels/moe_common.cuh"
#include "cuda/kernels/vec.cuh"

namespace moe::cuda::kernels {

constexpr int kPermuteThreads = 256;

// Sizes of one call: R = routes = T*k rows, rows of d values, packs_per_row = d / kVec.
struct RowShape {
  int64_t num_tokens, top_k, routes, d, packs_per_row;
};

// A route id or row index that names one of the R rows; -1 (padding, dropped) and anything
// else outside [0, R) read as "none", so a bad map never indexes memory.
__device__ __forceinline__ bool in_rows(int32_t i, const RowShape& s) { return i >= 0 && i < s.routes; }

// Runs body(t, v) for every pack v of every token row t, a thread per pack, grid-stride over the
// first `blocks` blocks of the grid.
template <typename Body>
__device__ __forceinline__ void for_each_token_pack(const RowShape& s, int64_t blocks, Body&& body) {
  const int64_t total = s.num_tokens * s.packs_per_row;
  for (int64_t i = int64_t{blockIdx.x} * kPermuteThreads + threadIdx.x; i < total; i += blocks * kPermuteThreads) {
    const int64_t t = i / s.packs_per_row;
    body(t, i - t * s.packs_per_row);
  }
}

// Runs zero_row(r) for every row r of the R whose sorted_route names no route (padding of a capacity
// factor; none when dropless), on the warps of the blocks from first_block on: each warp reads 32
// entries of sorted_route and its lanes take the rows it found one after the other. Every lane of
// the warp calls zero_row (the FP8 producer's shuffles).
template <typename ZeroRow>
__device__ __forceinline__ void for_rows_without_route(const int32_t* sorted_route, const RowShape& s,
                                                       int64_t first_block, ZeroRow&& zero_row) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t{gridDim.x} - first_block) * (kPermuteThreads / 32);
  for (int64_t g = ((int64_t{blockIdx.x} - first_block) * kPermuteThreads + threadIdx.x) / 32; g * 32 < s.routes;
       g += warps) {
    const int64_t r = g * 32 + lane;
    unsigned none = __ballot_sync(0xffffffffu, r < s.routes && !in_rows(sorted_route[r], s));
    while (none != 0) {
      const int b = __ffs(none) - 1;
      none &= none - 1;
      zero_row(g * 32 + b);
    }
  }
}

// Permute as a scatter: thread i takes pack v of token t's row (read once) and stores it into the
// row of each of its kept routes (route_to_row, the inverse of sorted_route: no two routes share a
// row, so every store has one writer and no atomics are needed); the blocks from scatter_blocks on
// zero the rows without a route. Against a gather in row order, which reads each token row k times
// in expert order (mostly from DRAM), the token rows are read once.
template <int kVec>
__global__ void __launch_bounds__(kPermuteThreads)
    permute_scatter_rows(const uint16_t* __restrict__ x, const int32_t* __restrict__ sorted_route,
                         const int32_t* __restrict__ route_to_row, RowShape s, int64_t scatter_blocks,
                         uint16_t* __restrict__ x_sorted) {
  if (blockIdx.x >= scatter_blocks) {
    const int lane = threadIdx.x & 31;
    for_rows_without_route(sorted_route, s, scatter_blocks, [&](int64_t row) {
      for (int64_t v = lane; v < s.packs_per_row; v += 32) store_zero_bf16<kVec>(x_sorted + row * s.d + v * kVec);
    });
    return;
  }
  for_each_token_pack(s, scatter_blocks, [&](int64_t t, int64_t v) {
    using Pack = std::conditional_t<kVec == kVecBf16, uint4, uint16_t>;  // the pack's bits, loaded once
    const Pack bits = *reinterpret_cast<const Pack*>(x + t * s.d + v * kVec);
    const int32_t* routes = route_to_row + t * s.top_k;
    for (int64_t j = 0; j < s.top_k; ++j) {
      const int32_t row = routes[j];
      if (in_rows(row, s)) *reinterpret_cast<Pack*>(x_sorted + row * s.d + v * kVec) = bits;
    }
  });
}

template <int kVec>
__global__ void __launch_bounds__(kPermuteThreads)
    permute_backward_gather(const uint16_t* dx_sorted, const int32_t* route_to_row, RowShape s,
                            uint16_t* dx) {
  for_each_token_pack(s, gridDim.x, [&](int64_t t, int64_t v) {
    float acc[kVec];
    load_bf16<kVec>(dx + t * s.d + v * kVec, acc);
    for (int64_t j = 0; j < s.top_k; ++j) {
      const int32_t row = route_to_row[t * s.top_k + j];
      if (!in_rows(row, s)) continue;
      float y[kVec];
      load_bf16<kVec>(dx_sorted + row * s.d + v * kVec, y);
#pragma unroll
      for (int q = 0; q < kVec; ++q) acc[q] += y[q];
    }
    store_bf16<kVec>(dx + t * s.d + v * kVec, acc);
  });
}

// Pack v of token t's combine: sum over its k routes in slot order of topk_w * the route's row, FP32.
template <int kVec>
__device__ __forceinline__ void combine_pack(const uint16_t* y_sorted, const int32_t* route_to_row,
                                             const float* topk_w, const RowShape& s, int64_t t, int64_t v,
                                             float (&acc)[kVec]) {
#pragma unroll
  for (int q = 0; q < kVec; ++q) acc[q] = 0.f;
  for (int64_t j = 0; j < s.top_k; ++j) {
    const int32_t row = route_to_row[t * s.top_k + j];
    if (!in_rows(row, s)) continue;
    const float w = topk_w[t * s.top_k + j];
    float y[kVec];
    load_bf16<kVec>(y_sorted + row * s.d + v * kVec, y);
#pragma unroll
    for (int q = 0; q < kVec; ++q) acc[q] += w * y[q];
  }
}

template <int kVec>
__global__ void __launch_bounds__(kPermuteThreads)
    unpermute_combine(const uint16_t* y_sorted, const int32_t* route_to_row, const float* topk_w,
                      RowShape s, uint16_t* out) {
  for_each_token_pack(s, gridDim.x, [&](int64_t t, int64_t v) {
    float acc[kVec];
    combine_pack<kVec>(y_sorted, route_to_row, topk_w, s, t, v, acc);
    store_bf16<kVec>(out + t * s.d + v * kVec, acc);
  });
}

// unpermute_combine with its output added into the residual stream instead of stored: acc [T, d]
// (FP32) += the combine rounded to BF16, acc_bf16 = bf16(acc) when not null: residual_add's
// operations on the value unpermute_combine would store, so the same bits without that tensor.
template <int kVec>
__global__ void __launch_bounds__(kPermuteThreads)
    unpermute_combine_add(const uint16_t* __restrict__ y_sorted, const int32_t* __restrict__ route_to_row,
                          const float* __restrict__ topk_w, RowShape s, float* __restrict__ acc,
                          uint16_t* __restrict__ acc_bf16) {
  for_each_token_pack(s, gridDim.x, [&](int64_t t, int64_t v) {
    float sum[kVec];
    combine_pack<kVec>(y_sorted, route_to_row, topk_w, s, t, v, sum);
    round_to_bf16<kVec>(sum);
    const int64_t at = t * s.d + v * kVec;
    residual_add_pack<kVec>(acc + at, sum, acc_bf16 != nullptr ? acc_bf16 + at : nullptr);
  });
}

// Warp i handles route i (dy_sorted row and dtopk_w) and row i (zeroed when it holds no route).
// Lane l takes packs l, l + 32, ... of the row, in whole steps of 32 packs on every lane (a lane
// past the row's end holds none), so that kFp8 (kVec = 8, d a multiple of 128: the FP8 experts'
// producer) can quantise each 128-column block by a half-warp as it stores it: q [R, d] codes and
// scales [R, d / 128] of the stored BF16 values, a row without a route as codes 0 with scale 1.
// dtopk_w sums in the same order either way.
template <int kVec, bool kFp8 = false, bool kMx = false>  // kMx: the MX rules (else rule is ignored)
__global__ void __launch_bounds__(kPermuteThreads)
    unpermute_backward_warp_per_route(const uint16_t* dout, const uint16_t* y_sorted,
                                      const int32_t* sorted_route, const int32_t* route_to_row,
                                      const float* topk_w, RowShape s, uint16_t* dy_sorted,
                                      float* dtopk_w, uint8_t* q = nullptr, float* scales = nullptr,
                                      Fp8Rule rule = Fp8Rule::kBlocks) {
  static_assert(!kFp8 || kVec == 8, "the FP8 producer stores 16-byte packs");
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kPermuteThreads / 32);
  [[maybe_unused]] const int64_t per_row = s.d / 128;
  // Quantises the pack v of row r (its 8 stored values; every lane calls it, the shuffles).
  [[maybe_unused]] const auto quantise = [&](const float (&v)[8], bool valid, int64_t r, int64_t pack) {
    if constexpr (kFp8) {
      fp8_quantize_half_warp_block(v, valid, Fp8Format::kE4M3, kMx ? rule : Fp8Rule::kBlocks, q + r * s.d + pack * 8,
                                   scales + r * per_row + pack / 16, nullptr);
    }
  };
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * kPermuteThreads + threadIdx.x) / 32; i < s.routes;
       i += warps) {
    const int32_t row = route_to_row[i];
    float dot = 0.f;
    if (in_rows(row, s)) {
      const uint16_t* g_row = dout + (i / s.top_k) * s.d;
      const uint16_t* y_row = y_sorted + row * s.d;
      uint16_t* dy_row = dy_sorted + row * s.d;
      const float w = topk_w[i];
      for (int64_t v0 = 0; v0 < s.packs_per_row; v0 += 32) {
        const int64_t v = v0 + lane;
        const bool valid = v < s.packs_per_row;
        float dy[kVec] = {};
        if (valid) {
          float g[kVec], y[kVec];
          load_bf16<kVec>(g_row + v * kVec, g);
          load_bf16<kVec>(y_row + v * kVec, y);
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            dot += g[j] * y[j];
            dy[j] = 0.f + w * g[j];  // +0 for a zero product, as the CPU op's 0 += w * g
          }
          store_bf16<kVec>(dy_row + v * kVec, dy);
        }
        if constexpr (kFp8) {
          round_to_bf16(dy);  // the stored values
          quantise(dy, valid, row, v);
        }
      }
    }
    dot = warp_sum(dot);
    if (lane == 0) dtopk_w[i] = dot;
    if (!in_rows(sorted_route[i], s)) {
      uint16_t* dy_row = dy_sorted + i * s.d;
      for (int64_t v0 = 0; v0 < s.packs_per_row; v0 += 32) {
        const int64_t v = v0 + lane;
        if (v < s.packs_per_row) store_zero_bf16<kVec>(dy_row + v * kVec);
        if constexpr (kFp8) {
          const float zero[8] = {};
          quantise(zero, v < s.packs_per_row, i, v);
        }
      }
    }
  }
}

// permute_scatter_rows with the quantisation fused in: a half-warp per 128-column block of a token
// row (lane l of the half its elements 8l .. 8l + 7), 16 blocks per CTA and grid-stride step, so
// every lane of a warp runs the same iterations (the block's amax is a shuffle within the half). The
// block's codes and scale are found once and stored, with its BF16 bits, into each kept route's row;
// the blocks from scatter_blocks on give the rows without a route zeros, codes 0 and scale 1 (the
// quantisation of a zero block).
constexpr int64_t kPermuteFp8BlocksPerCta = 2 * (kPermuteThreads / 32);

template <bool kMx>  // compiled for the MX rules, or for the block recipe (rule ignored)
__global__ void __launch_bounds__(kPermuteThreads)
    permute_scatter_rows_fp8(const uint16_t* __restrict__ x, const int32_t* __restrict__ sorted_route,
                             const int32_t* __restrict__ route_to_row, RowShape s, int64_t scatter_blocks,
                             uint16_t* __restrict__ x_sorted, uint8_t* __restrict__ q, float* __restrict__ scales,
                             Fp8Rule rule) {
  if constexpr (!kMx) rule = Fp8Rule::kBlocks;
  const int64_t per_row = s.d / 128;
  const int sub = threadIdx.x % 16;
  if (blockIdx.x >= scatter_blocks) {
    const int half = (threadIdx.x & 31) / 16;
    for_rows_without_route(sorted_route, s, scatter_blocks, [&](int64_t row) {
      for (int64_t c0 = 0; c0 < per_row; c0 += 2) {  // the warp's two halves take two blocks a step
        const int64_t c = c0 + half;
        const bool valid = c < per_row;
        const int64_t col = valid ? c * 128 + 8 * sub : 0;
        if (valid) store_zero_bf16<8>(x_sorted + row * s.d + col);
        const float zero[8] = {};
        fp8_quantize_half_warp_block(zero, valid, Fp8Format::kE4M3, rule, q + row * s.d + col,
                                     scales + row * per_row + (valid ? c : 0), nullptr);
      }
    });
    return;
  }
  const int64_t blocks = s.num_tokens * per_row;
  for (int64_t b0 = int64_t{blockIdx.x} * kPermuteFp8BlocksPerCta; b0 < blocks;
       b0 += scatter_blocks * kPermuteFp8BlocksPerCta) {
    const int64_t b = b0 + threadIdx.x / 16;
    const bool valid = b < blocks;
    const int64_t t = valid ? b / per_row : 0, c = valid ? b % per_row : 0, col = c * 128 + 8 * sub;
    uint4 bits = make_uint4(0, 0, 0, 0);
    float v[8] = {};
    if (valid) {
      bits = *reinterpret_cast<const uint4*>(x + t * s.d + col);
      bf16x8_to_f32(bits, v);
    }
    float scale;
    const uint2 codes = fp8_half_warp_block_codes(v, valid, Fp8Format::kE4M3, rule, scale, nullptr);
    if (!valid) continue;
    for (int64_t j = 0; j < s.top_k; ++j) {
      const int32_t row = route_to_row[t * s.top_k + j];
      if (!in_rows(row, s)) continue;
      *reinterpret_cast<uint4*>(x_sorted + row * s.d + col) = bits;  // the bits as they are (a NaN's payload too)
      *reinterpret_cast<uint2*>(q + row * s.d + col) = codes;
      if (sub == 0) scales[row * per_row + c] = scale;
    }
  }
}

}  // namespace moe::cuda::kernels
