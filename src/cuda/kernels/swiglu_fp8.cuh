// SwiGLU with the 1 x 128 FP8 quantisation of its output fused in (the FP8 experts' producers):
// the BF16 outputs of swiglu.cuh's kernels, bitwise, plus the E4M3 codes and FP32 scales that
// fp8_quantize_blocks would write by the FP8 rule for those BF16 outputs (fp8_quantize_half_warp_block of the
// rounded values, the quantiser's own block step), so the next grouped FP8 GEMM needs no
// quantisation pass. A half-warp per 128-column block of h (inner a multiple of 128), lane l of the half its
// elements 8l .. 8l + 7 (16-byte loads and stores); 8 warps, 16 blocks per CTA.
#pragma once

#include "cuda/kernels/fp8_codes.cuh"
#include "cuda/kernels/swiglu.cuh"
#include "cuda/kernels/vec.cuh"

namespace moe::cuda::kernels {

constexpr int kSwigluFp8Warps = 8;
constexpr int64_t kSwigluFp8BlocksPerCta = 2 * kSwigluFp8Warps;

// h [n, inner] = silu(gate) * up, and its codes q_h [n, inner] with scales s_h [n, inner / 128].
// kMx (both kernels): compiled for the MX rules, or for the block recipe (rule ignored).
template <bool kMx>
__global__ void __launch_bounds__(32 * kSwigluFp8Warps)
    swiglu_forward_fp8_rows(const uint16_t* __restrict__ gate_up, uint16_t* __restrict__ h, uint8_t* __restrict__ q_h,
                            float* __restrict__ s_h, int64_t n, int64_t inner, Fp8Rule rule) {
  if constexpr (!kMx) rule = Fp8Rule::kBlocks;
  const int64_t per_row = inner / 128, blocks = n * per_row;
  const int sub = threadIdx.x % 16;
  const int64_t b = int64_t{blockIdx.x} * kSwigluFp8BlocksPerCta + threadIdx.x / 16;
  const bool valid = b < blocks;
  float out[8] = {};
  const int64_t row = valid ? b / per_row : 0, col = valid ? (b % per_row) * 128 + 8 * sub : 0;
  if (valid) {
    float g[8], u[8];
    load_bf16<8>(gate_up + row * 2 * inner + col, g);
    load_bf16<8>(gate_up + row * 2 * inner + inner + col, u);
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = swiglu_value(g[j], u[j]);
    round_to_bf16(out);
    store_bf16<8>(h + row * inner + col, out);
  }
  fp8_quantize_half_warp_block(out, valid, Fp8Format::kE4M3, rule, q_h + row * inner + col, s_h + b, nullptr);
}

// dgate_up [n, 2 inner] from dh, and its codes q_dgu [n, 2 inner] with scales s_dgu [n, 2 inner / 128]
// (the gate half's blocks first, then the up half's, as fp8_quantize_blocks lays out the row).
template <bool kMx>
__global__ void __launch_bounds__(32 * kSwigluFp8Warps)
    swiglu_backward_fp8_rows(const uint16_t* __restrict__ gate_up, const uint16_t* __restrict__ dh,
                             uint16_t* __restrict__ dgate_up, uint8_t* __restrict__ q_dgu, float* __restrict__ s_dgu,
                             int64_t n, int64_t inner, Fp8Rule rule) {
  if constexpr (!kMx) rule = Fp8Rule::kBlocks;
  const int64_t per_row = inner / 128, blocks = n * per_row;
  const int sub = threadIdx.x % 16;
  const int64_t b = int64_t{blockIdx.x} * kSwigluFp8BlocksPerCta + threadIdx.x / 16;
  const bool valid = b < blocks;
  float dg[8] = {}, du[8] = {};
  const int64_t row = valid ? b / per_row : 0, cb = valid ? b % per_row : 0, col = cb * 128 + 8 * sub;
  const int64_t at = row * 2 * inner + col;
  if (valid) {
    float g[8], u[8], d[8];
    load_bf16<8>(gate_up + at, g);
    load_bf16<8>(gate_up + at + inner, u);
    load_bf16<8>(dh + row * inner + col, d);
#pragma unroll
    for (int j = 0; j < 8; ++j) swiglu_grads(g[j], u[j], d[j], dg[j], du[j]);
    round_to_bf16(dg);
    round_to_bf16(du);
    store_bf16<8>(dgate_up + at, dg);
    store_bf16<8>(dgate_up + at + inner, du);
  }
  float* srow = s_dgu + row * 2 * per_row;
  fp8_quantize_half_warp_block(dg, valid, Fp8Format::kE4M3, rule, q_dgu + at, srow + cb, nullptr);
  fp8_quantize_half_warp_block(du, valid, Fp8Format::kE4M3, rule, q_dgu + at + inner, srow + per_row + cb, nullptr);
}

}  // namespace moe::cuda::kernels
