// Block-scaled FP8: the CPU reference of the FP8 path (docs/numerics.md "FP8"). Quantisation
// and dequantisation in the two scaling modes, and the FP8 GEMM the tensor cores compute, on the
// host, so the GPU's FP8 results can be compared with a computation on the same quantised values.
//
// Hopper mode (DeepSeek-V3 / DeepGEMM style): a [rows, cols] row-major tensor is cut into blocks
// of block.rows x block.cols (1 x 128 for activations and gradients, 128 x 128 for weights; the
// last blocks of a row or column may be smaller). Each block b gets one FP32 scale
//   s_b = amax_b / fp8_max(format)      (s_b = 1 where amax_b == 0),
// and each element q = fp8(x / s_b), rounded to nearest even, saturating at +-fp8_max (so the
// block's largest magnitude maps to +-fp8_max exactly); x is approximately q * s_b.
// The division is an FP32 division (x / s_b), the one the GPU kernels compute.
//
// MX mode (OCP Microscaling v1.0, MXFP8): blocks of 1 x 32 along each row, one E8M0 scale each
// (a power of two 2^e, e in [-127, 127], code e + 127). The spec's rule is e = floor(log2 amax) -
// emax(format) (emax 8 for E4M3, 15 for E5M2), elements fp8(x / 2^e) rounded to nearest even and
// clamped to +-fp8_max (the block's largest element can exceed fp8_max by up to 2x, then
// saturates). MxScale::kNoSaturation rounds the scale up instead: the smallest 2^e with
// amax / 2^e <= fp8_max, so nothing saturates (one binade less resolution for small elements).
// amax == 0 gives e = -127 (code 0) and zero elements. Scale exponents are clamped to
// [-127, 127]. NaN inputs are refused (moe::Error), as are infinities.
//
// The FP8 GEMM: C[M, N] (+)= A[M, K] B[N, K]^T with A in 1 x 128 blocks and B in 128 x 128 blocks
// (K split into blocks of 128 on both sides, the same K blocks): for each K block the products of
// the decoded FP8 values are summed in FP32 in k order, then promoted: C += partial * sa * sb.
// That is the accumulation of the block-scaled kernels (FP32 accumulators promoted per K block);
// the result equals the dequantised product up to FP32 summation order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/fp8_types.h"

namespace moe::cpu {

using moe::Fp8Block;
using moe::Fp8Format;
using moe::Fp8Rule;
using moe::kFp8ActivationBlock;
using moe::kFp8WeightBlock;
using moe::kMxBlock;
using moe::MxScale;

// Largest finite value: 448 (E4M3, OCP "fn") and 57344 (E5M2).
float fp8_max(Fp8Format f);
// emax: the exponent of the largest normal binade, 8 (E4M3) and 15 (E5M2).
int fp8_emax(Fp8Format f);
// Scalar conversions, round to nearest even, saturating (core/dtype.h).
uint8_t fp8_encode(float x, Fp8Format f);
float fp8_decode(uint8_t q, Fp8Format f);


// Scales of a [rows, cols] tensor: ceil(rows / block.rows) x ceil(cols / block.cols), row-major.
int64_t fp8_scale_rows(int64_t rows, Fp8Block block);
int64_t fp8_scale_cols(int64_t cols, Fp8Block block);

// x [rows, cols] -> q [rows, cols] (FP8 codes) and scales [scale_rows, scale_cols] (FP32).
void fp8_quantize_blocks(const float* x, int64_t rows, int64_t cols, Fp8Block block, Fp8Format f, uint8_t* q,
                         float* scales);
// x = decode(q) * scale of its block.
void fp8_dequantize_blocks(const uint8_t* q, const float* scales, int64_t rows, int64_t cols, Fp8Block block,
                           Fp8Format f, float* x);


// The E8M0 scale exponent the rule picks for a block whose largest magnitude is amax.
int mx_scale_exponent(float amax, Fp8Format f, MxScale rule);
// x [rows, cols] -> q [rows, cols] and E8M0 scales [rows, ceil(cols / 32)].
void mx_quantize(const float* x, int64_t rows, int64_t cols, Fp8Format f, MxScale rule, uint8_t* q,
                 uint8_t* scales_e8m0);
void mx_dequantize(const uint8_t* q, const uint8_t* scales_e8m0, int64_t rows, int64_t cols, Fp8Format f, float* x);

// C [M, N] = A [M, K] B [N, K]^T (accumulate: C +=) from A's codes with 1 x 128 scales
// [M, ceil(K/128)] and B's codes with 128 x 128 scales [ceil(N/128), ceil(K/128)].
void fp8_gemm_block_scaled(const uint8_t* qa, const float* sa, Fp8Format fa, const uint8_t* qb, const float* sb,
                           Fp8Format fb, int64_t m, int64_t n, int64_t k, float* c, bool accumulate);
// The same with B's codes in 1 x 128 blocks too (scales [N, ceil(K/128)]): both operands scaled
// per row and K block, the weight-gradient GEMM of fp8_linear_wgrad.
void fp8_gemm_rowwise_scaled(const uint8_t* qa, const float* sa, Fp8Format fa, const uint8_t* qb, const float* sb,
                             Fp8Format fb, int64_t m, int64_t n, int64_t k, float* c, bool accumulate);

// The experts' weights w [E, n, k] in 128 x 128 blocks per expert: q [E, n, k] and scales
// s [E, ceil(n/128), ceil(k/128)] (fp8_quantize_blocks of each w[e]); when qt is not null also the
// transposed copy qt [E, k, n] (qt[e][c][r] = q[e][r][c]) with st [E, ceil(k/128), ceil(n/128)]
// (st[e][j][i] = s[e][i][j]): the B operand of the data-gradient GEMM dx = dy W_e. Under an MX
// rule (fp8_quantize_blocks with it) q quantises w[e]'s rows and qt those of w[e]^T, each copy
// along the contraction of the GEMM that reads it (MXFP8's row-wise and column-wise copies).
void fp8_quantize_weights(const float* w, int64_t experts, int64_t n, int64_t k, Fp8Format f, uint8_t* q, float* s,
                          uint8_t* qt, float* st, Fp8Rule rule = Fp8Rule::kBlocks);
// fp8_quantize_weights of the BF16 rounding of w (round-to-nearest-even): the codes of the BF16
// copy of FP32 weights, from the FP32 weights.
void fp8_quantize_weights_bf16_rounded(const float* w, int64_t experts, int64_t n, int64_t k, Fp8Format f, uint8_t* q,
                                       float* s, uint8_t* qt, float* st, Fp8Rule rule = Fp8Rule::kBlocks);

// The experts' weight-gradient operands quantised down each expert's rows (the layout of
// cuda::fp8_quantize_expert_columns): expert e's rows offsets[e] .. offsets[e + 1] (host offsets,
// clamped to [0, max_rows]) take columns padded[e] .. padded[e + 1] of q_t [width, capacity],
// padded[e] = sum over e' < e of ceil(rows of e' / 128) * 128 (padded [E + 1]); each column of an
// expert's 128-row block is one 1 x 128 block of fp8_quantize_blocks (rows past the expert's end
// as zeros), its scale at scales_t[padded[e] / 128 + block, column] (scales_t [capacity / 128,
// width]). Columns of q_t past padded[E] are not written. Refuses capacity < padded[E].
void fp8_quantize_expert_columns(const float* x, const int32_t* offsets, int64_t max_rows, int64_t experts,
                                 int64_t width, int64_t capacity, Fp8Format f, uint8_t* q_t, float* scales_t,
                                 int32_t* padded);

// The M-grouped block-scaled FP8 GEMM of the experts (cuda::grouped_gemm_fp8's contract, FP32 C):
// for the rows r of expert e (offsets[e] .. offsets[e+1], host offsets, clamped to [0, max_rows]),
//   c[r, :] = fp8_gemm_block_scaled(qa[r, :] with sa[r, :], qb[e] with sb[e]);
// qa [max_rows, k], sa [max_rows, ceil(k/128)], qb [E, n, k], sb [E, ceil(n/128), ceil(k/128)],
// c [max_rows, n]; rows outside the groups are not written.
void fp8_grouped_gemm_block_scaled(const uint8_t* qa, const float* sa, Fp8Format fa, const uint8_t* qb,
                                   const float* sb, Fp8Format fb, const int32_t* offsets, int64_t max_rows,
                                   int64_t experts, int64_t n, int64_t k, float* c);

// C [M, N] (+)= A [M, K] B [N, K]^T with both operands MX (1 x 32 blocks along K, E8M0 scales
// [rows, ceil(K/32)]): the products of each 32-wide K block summed in FP32, then promoted with the
// two power-of-two scales (exact). MXFP8's GEMM as Blackwell's tensor cores compute it, and what
// a Hopper kernel promoting every 32 K elements would: the reference for MX scaling on either.
void mx_gemm(const uint8_t* qa, const uint8_t* sa_e8m0, Fp8Format fa, const uint8_t* qb, const uint8_t* sb_e8m0,
             Fp8Format fb, int64_t m, int64_t n, int64_t k, float* c, bool accumulate);

// MX codes re-blocked into blocks (1 x 128, or 128 x 128) with FP32 scales, the other way to run
// MX-quantised tensors on Hopper's block-scaled GEMMs (cuBLASLt and moecore's grouped kernel have
// no 1 x 32 mode there): each block takes the largest MX scale 2^e_max of its sub-blocks as its
// scale, and every code of a sub-block with scale 2^e is re-encoded as its value times
// 2^(e - e_max), round to nearest even. That is exact only while the shifted values stay within
// the format's precision: a sub-block whose scale is 2^k below the block's loses up to k low bits
// of its codes (into subnormals, or to zero). Returns the number of codes whose value changed; 0
// means the block-scaled GEMM on the output equals mx_gemm up to FP32 summation order.
// block.cols a multiple of 32; scales_out [ceil(rows / block.rows), ceil(cols / block.cols)].
int64_t mx_to_blocks(const uint8_t* q, const uint8_t* scales_e8m0, int64_t rows, int64_t cols, Fp8Format f,
                     Fp8Block block, uint8_t* q_out, float* scales_out);
// mx_to_blocks into 1 x 128 blocks.
int64_t mx_to_blocks128(const uint8_t* q, const uint8_t* scales_e8m0, int64_t rows, int64_t cols, Fp8Format f,
                        uint8_t* q_out, float* scales_out);
// x quantised in `block` blocks by the GPU FP8 path's rule (core/fp8_types.h): kBlocks is
// fp8_quantize_blocks; the MX rules mx_quantize along the rows, then mx_to_blocks into `block`.
// Returns the codes the re-blocking changed (0 for kBlocks). What the GPU's quantisers write.
int64_t fp8_quantize_blocks(const float* x, int64_t rows, int64_t cols, Fp8Block block, Fp8Format f, Fp8Rule rule,
                            uint8_t* q, float* scales);

// MX scales as Blackwell's block-scaled GEMM reads them (cuBLASLt's VEC32_UE8M0 scale mode): the
// E8M0 scales [rows, cols] (cols = K / 32, row-major, as mx_quantize writes them) in tiles of 128
// rows x 4 columns, tile (rb, cb) at (rb * ceil(cols / 4) + cb) * 512 bytes, row-block-major; in a
// tile, scale (r, c) at (r % 32) * 16 + (r / 32) * 4 + c. Rows are padded to a multiple of 128 and
// columns to a multiple of 4 with 127 (the scale 2^0): mx_scales_tiled_bytes(rows, cols) bytes
// (core/fp8_types.h).
std::vector<uint8_t> mx_scales_tiled(const uint8_t* scales_e8m0, int64_t rows, int64_t cols);

// The FP8 recipe of a linear layer's three GEMMs, emulated on FP32 tensors (the CPU twin of the GPU
// FP8 path: the operands quantised as the GPU quantises them, then the block-scaled GEMM above):
//   forward  y [M, N]  = x [M, K] W [N, K]^T : x in `forward` format, 1 x 128 along K; W in
//            `forward` format, 128 x 128 blocks;
//   dgrad    dx [M, K] = dy [M, N] W [N, K]  : dy in `grad` format, 1 x 128 along N; W's 128 x 128
//            blocks read transposed (the same blocks and scales: a transposed copy of the codes);
//   wgrad    dW [N, K] += dy^T x             : dy^T in `grad` format and x^T in `forward` format,
//            both 1 x 128 along M (the transposed copies the GPU writes in the producers' pass).
// E4M3 for both by default: with one scale per 128 elements (or 128 x 128) E4M3's range is enough
// for gradients too (as DeepSeek-V3 trains), and its extra mantissa bit halves the rounding error
// of E5M2.
//
// MX scaling (scaling = kMx, train.fp8_scaling = "mx" / "mx_no_saturation"): every operand in
// 1 x 32 blocks with E8M0 scales (mx_rule) along its GEMM's contraction dimension, as MXFP8
// trains: x and W along K for the forward, dy and W's columns (a column-wise copy of W) along N
// for dgrad, dy^T and x^T along M for wgrad; the GEMMs promote every 32 K elements (mx_gemm).
enum class Fp8Scaling { kBlocks, kMx };
struct Fp8Recipe {
  Fp8Format forward = Fp8Format::kE4M3;
  Fp8Format grad = Fp8Format::kE4M3;
  Fp8Scaling scaling = Fp8Scaling::kBlocks;
  MxScale mx_rule = MxScale::kOcp;
};
// The recipe train.fp8_scaling names: "blocks" (1 x 128 / 128 x 128, FP32 scales), "mx" (1 x 32,
// E8M0, the OCP floor rule) or "mx_no_saturation" (1 x 32, E8M0 rounded up); anything else is refused.
Fp8Recipe fp8_recipe_named(const std::string& scaling);
// The GPU FP8 path's rule (core/fp8_types.h) for the scaling train.fp8_scaling names: the block
// recipe, or MX's sub-blocks re-blocked for Hopper's block-scaled GEMMs.
Fp8Rule fp8_rule_named(const std::string& scaling);
void fp8_linear_forward(const float* x, const float* w, int64_t m, int64_t n, int64_t k, const Fp8Recipe& r, float* y);
void fp8_linear_dgrad(const float* dy, const float* w, int64_t m, int64_t n, int64_t k, const Fp8Recipe& r, float* dx);
void fp8_linear_wgrad(const float* dy, const float* x, int64_t m, int64_t n, int64_t k, const Fp8Recipe& r,
                      float* dw);

// The recipe's linear passes as the CPU reference trains with them (train.precision = "fp8" on the
// cpu backend): each operand quantised as above and dequantised (fake quantisation), then the FP32
// GEMM of cpu::linear: the same values as fp8_linear_* up to FP32 summation order, at BLAS speed.
// y [n, m] (+)= x [n, k] W [m, k]^T; backward dx [n, k] (+)= dy W (dy along m, W in 128 x 128
// blocks) and dW += dy^T x (both along n, the token dimension); dx or dw may be null.
void fp8_emulated_linear_forward(const float* x, const float* w, float* y, int64_t n, int64_t k, int64_t m,
                                 bool accumulate, const Fp8Recipe& r);
void fp8_emulated_linear_backward(const float* x, const float* w, const float* dy, float* dx, float* dw, int64_t n,
                                  int64_t k, int64_t m, bool accumulate_dx, const Fp8Recipe& r);

// The row quantisation of the recipe's activations and gradients: x [rows, cols] in 1 x 128 blocks
// with FP32 scales (block scaling) or 1 x 32 blocks with E8M0 scales (MX) along each row, format f,
// dequantised into out (FP32). What an FP8 row exchange delivers: the experts' inputs that travel
// between expert-parallel ranks (x_sorted, dy) enter the experts as these values in every layout.
void fp8_quantised_rows(const float* x, int64_t rows, int64_t cols, Fp8Format f, const Fp8Recipe& r, float* out);

// Those rows as an exchange carries them: per row its cols codes, then its scales (block scaling:
// ceil(cols / 128) FP32; MX: ceil(cols / 32) E8M0 bytes), zero-padded to a multiple of 4 bytes,
// fp8_row_payload_bytes(cols, r) bytes in all (against 4 cols for the FP32 row). fp8_unpack_rows
// of fp8_pack_rows is fp8_quantised_rows, bit for bit.
int64_t fp8_row_payload_bytes(int64_t cols, const Fp8Recipe& r);
void fp8_pack_rows(const float* x, int64_t rows, int64_t cols, Fp8Format f, const Fp8Recipe& r, uint8_t* payload);
void fp8_unpack_rows(const uint8_t* payload, int64_t rows, int64_t cols, Fp8Format f, const Fp8Recipe& r, float* out);

}  // namespace moe::cpu
