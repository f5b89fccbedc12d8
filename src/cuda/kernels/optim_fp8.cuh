// AdamW on the experts' weights with their FP8 codes written in the same pass: the FP8 recipe's
// weight cast after the optimizer step, without a second pass that reads the BF16 copy back.
#pragma once

#include <type_traits>

#include "cuda/kernels/fp8_codes.cuh"
#include "cuda/kernels/optim.cuh"

namespace moe::cuda::kernels {

// The block's updated BF16 copy between the two passes of adamw_update_fp8_weights, and the
// quantiser's shared memory after it (the values are in registers by then). Rows padded by 16 bytes.
union AdamWFp8WeightSmem {
  uint16_t w[128][128 + 8];
  Fp8WeightBlockSmem codes;
};
// Under an MX rule the tile stays: the column copy's codes read its columns.
struct AdamWMxWeightSmem {
  uint16_t w[128][128 + 8];
  Fp8BlockReduceSmem reduce;
};

// Weights [E, n, k] (n, k multiples of 128) at flat offset `offset` of p / g / p_bf16, moments at
// offset + shift of m / v (offset and shift multiples of 4, every FP32 buffer 16-byte aligned,
// p_bf16 and BF16 moments (M = uint16_t) 8-byte aligned). Block b = (e, bi, bj) of the 128 x 128
// blocks, two passes:
// - the update, coalesced: warp w takes rows w, w + 8, .., w + 120 of the block, a whole row of
//   128 elements per step, lane l elements 4l .. 4l + 3 through adamw_vec4 (the update of
//   adamw_update_segments, bit for bit: p, m, v and the BF16 copy stored), the BF16 values into a
//   shared tile;
// - the codes: thread t reads row t / 2, elements 64 (t % 2) .. + 63 of the tile and hands them to
//   fp8_weight_block_codes (the quantiser's codes of that BF16 copy, bit for bit), or under an MX
//   rule (kMx) to mx_weight_block_codes, the column copy read from the tile's columns.
// Nothing is written when the step is skipped or (deferred) nothing is pending.
template <bool kMx, typename M>
__global__ void __launch_bounds__(kFp8WeightThreads)
    adamw_update_fp8_weights(int64_t offset, int64_t shift, int64_t n, int64_t k, bool decay_on,
                             float* __restrict__ p, const float* __restrict__ g, M* __restrict__ m,
                             M* __restrict__ v, uint16_t* __restrict__ p_bf16, Fp8Format f, Fp8Rule rule,
                             uint8_t* __restrict__ q, float* __restrict__ s, uint8_t* __restrict__ qt,
                             float* __restrict__ st, uint32_t* num_nonfinite, const OptimStepScalars* __restrict__ sc,
                             AdamWConstants c, bool deferred) {
  static_assert(kFp8WeightThreads == 256, "eight warps, each a row of the block per step");
  if (sc->skipped != 0 || (deferred && sc->pending == 0)) return;
  __shared__ __align__(16) std::conditional_t<kMx, AdamWMxWeightSmem, AdamWFp8WeightSmem> sm;
  const AdamWCoefficients coef{sc->step_size, sc->inv_sqrt_bc2, sc->decay, sc->grad_scale};
  const float decay = decay_on ? coef.decay : 1.0f;
  const int64_t nb = n / 128, kb = k / 128;
  const int64_t b = blockIdx.x, e = b / (nb * kb), bi = b / kb % nb, bj = b % kb;
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const int64_t first = offset + e * n * k + bi * 128 * k + bj * 128 + 4 * lane;  // a multiple of 4
#pragma unroll 4
  for (int j = 0; j < 16; ++j) {
    const int row = 8 * j + warp;
    const int64_t at = first + row * k;
    const float4 pv = adamw_vec4(at / 4, (at + shift) / 4, p, g, m, v, p_bf16, decay, coef, c);
    *reinterpret_cast<uint2*>(&sm.w[row][4 * lane]) = pack_bf16x4(pv);
  }
  __syncthreads();
  const int r = t / 2, c0 = 64 * (t % 2);
  float w16[64];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint4 x = *reinterpret_cast<const uint4*>(&sm.w[r][c0 + 8 * i]);
    const uint32_t words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      w16[8 * i + 2 * h] = bf16_bits_to_f32(uint16_t(words[h] & 0xffffu));
      w16[8 * i + 2 * h + 1] = bf16_bits_to_f32(uint16_t(words[h] >> 16));
    }
  }
  if constexpr (kMx) {
    mx_weight_block_codes(w16, e, bi, bj, n, k, f, rule, q, s, qt, st, num_nonfinite, sm.reduce,
                          [&](int row, int col) { return bf16_bits_to_f32(sm.w[row][col]); });
  } else {
    __syncthreads();  // every thread holds its values before the quantiser's shared memory overlays the tile
    fp8_weight_block_codes(w16, e, bi, bj, n, k, f, q, s, qt, st, num_nonfinite, sm.codes);
  }
}

}  // namespace moe::cuda::kernels
