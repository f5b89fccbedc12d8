// AdamW on the experts' weights with their FP8 codes written in the same pass: the FP8 recipe's
// weight cast after the optimizer step, without a second pass that reads the BF16 copy back.
#pragma once

#include "cuda/kernels/fp8_codes.cuh"
#include "cuda/kernels/optim.cuh"

namespace moe::cuda::kernels {

// Weights [E, n, k] (n, k multiples of 128) at flat offset `offset` of p / g / p_bf16, moments at
// offset + shift of m / v (shift a multiple of 4, every FP32 buffer 16-byte aligned, p_bf16
// 8-byte aligned). Block b = (e, bi, bj) of the 128 x 128 blocks: thread t takes row t / 2 of the
// block, elements 64 (t % 2) .. + 63, 4 at a time through adamw_vec4 (the update of
// adamw_update_segments, bit for bit: p, m, v and the BF16 copy stored), keeps the BF16 values,
// and hands them to fp8_weight_block_codes (the quantiser's codes of that BF16 copy, bit for bit).
// Nothing is written when the step is skipped or (deferred) nothing is pending.
__global__ void __launch_bounds__(kFp8WeightThreads)
    adamw_update_fp8_weights(int64_t offset, int64_t shift, int64_t n, int64_t k, bool decay_on,
                             float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                             float* __restrict__ v, uint16_t* __restrict__ p_bf16, Fp8Format f,
                             uint8_t* __restrict__ q, float* __restrict__ s, uint8_t* __restrict__ qt,
                             float* __restrict__ st, uint32_t* num_nonfinite, const OptimStepScalars* __restrict__ sc,
                             AdamWConstants c, bool deferred) {
  if (sc->skipped != 0 || (deferred && sc->pending == 0)) return;
  __shared__ __align__(16) Fp8WeightBlockSmem sm;
  const AdamWCoefficients coef{sc->step_size, sc->inv_sqrt_bc2, sc->decay, sc->grad_scale};
  const float decay = decay_on ? coef.decay : 1.0f;
  const int64_t nb = n / 128, kb = k / 128;
  const int64_t b = blockIdx.x, e = b / (nb * kb), bi = b / kb % nb, bj = b % kb;
  const int t = threadIdx.x, r = t / 2, c0 = 64 * (t % 2);
  const int64_t at = offset + e * n * k + (bi * 128 + r) * k + bj * 128 + c0;  // a multiple of 4
  float w16[64];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float4 pv = adamw_vec4(at / 4 + j, (at + shift) / 4 + j, p, g, m, v, p_bf16, decay, coef, c);
    w16[4 * j + 0] = bf16_bits_to_f32(f32_to_bf16_bits(pv.x));  // the BF16 copy's values
    w16[4 * j + 1] = bf16_bits_to_f32(f32_to_bf16_bits(pv.y));
    w16[4 * j + 2] = bf16_bits_to_f32(f32_to_bf16_bits(pv.z));
    w16[4 * j + 3] = bf16_bits_to_f32(f32_to_bf16_bits(pv.w));
  }
  fp8_weight_block_codes(w16, e, bi, bj, n, k, f, q, s, qt, st, num_nonfinite, sm);
}

}  // namespace moe::cuda::kernels
