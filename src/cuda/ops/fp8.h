// Block-scaled FP8 and MXFP8 quantisation on the GPU, the contract of cpu/fp8.h (its CPU twin:
// the same codes and scales, bitwise, for the same finite inputs): Hopper-style blocks (1 x 128
// activations and gradients, 128 x 128 weights) with one FP32 scale amax / fp8_max each, and MX
// blocks of 1 x 32 with one E8M0 scale (the OCP floor rule or the no-saturation rule). The input
// is FP32 or BF16 (bit patterns as uint16_t; BF16 values are exact in FP32, so a BF16 tensor
// quantises as its FP32 copy would). Inputs that are not finite never trap: they are counted into
// *num_nonfinite (when non-null, atomically added; a caller checks it later, off the hot path) and
// the codes and scale of their block are then unspecified. Rows x cols of any size >= 0; one CTA
// per scaling block, or a half-warp per block for 1 x 128 blocks when cols is a multiple of 128 (x
// 16-byte and q 8-byte aligned: vector loads, several blocks per warp in flight);
// no host synchronisation (capturable in a CUDA graph).
#pragma once

#include <cstdint>

#include "core/fp8_types.h"
#include "cuda/device.h"

namespace moe::cuda {

// x [rows, cols] -> q [rows, cols] (FP8 codes) and scales [ceil(rows / block.rows), ceil(cols /
// block.cols)] (FP32, row-major). The rule (core/fp8_types.h) picks each block's scale and codes:
// the MX rules (cpu::fp8_quantize_blocks with the rule, bitwise) take whole 1 x 128 blocks only
// (cols a multiple of 128, x 16-byte and q 8-byte aligned; anything else is refused).
void fp8_quantize_blocks(const float* x, int64_t rows, int64_t cols, Fp8Block block, Fp8Format f, uint8_t* q,
                         float* scales, uint32_t* num_nonfinite, Stream stream, Fp8Rule rule = Fp8Rule::kBlocks);
void fp8_quantize_blocks(const uint16_t* x_bf16, int64_t rows, int64_t cols, Fp8Block block, Fp8Format f, uint8_t* q,
                         float* scales, uint32_t* num_nonfinite, Stream stream, Fp8Rule rule = Fp8Rule::kBlocks);
// fp8_quantize_blocks of x_bf16 [rows, cols] in 1 x 128 blocks, its codes written into columns
// [0, cols) of a wider code matrix whose rows are ldq apart (ldq >= cols, a multiple of 8): so that
// several tensors' codes sit side by side along K as one GEMM operand. Scales [rows, cols / 128]
// row-major, as fp8_quantize_blocks writes them. cols a positive multiple of 128, x 16-byte and q
// 8-byte aligned; codes outside the columns are not touched.
void fp8_quantize_rows_into(const uint16_t* x_bf16, int64_t rows, int64_t cols, int64_t ldq, Fp8Format f, uint8_t* q,
                            float* scales, uint32_t* num_nonfinite, Stream stream, Fp8Rule rule = Fp8Rule::kBlocks);
// x = decode(q) * scale of its block (FP32).
void fp8_dequantize_blocks(const uint8_t* q, const float* scales, int64_t rows, int64_t cols, Fp8Block block,
                           Fp8Format f, float* x, Stream stream);

// x [rows, cols] -> q [rows, cols] and E8M0 scales [rows, ceil(cols / 32)].
void mx_quantize(const float* x, int64_t rows, int64_t cols, Fp8Format f, MxScale rule, uint8_t* q,
                 uint8_t* scales_e8m0, uint32_t* num_nonfinite, Stream stream);
void mx_quantize(const uint16_t* x_bf16, int64_t rows, int64_t cols, Fp8Format f, MxScale rule, uint8_t* q,
                 uint8_t* scales_e8m0, uint32_t* num_nonfinite, Stream stream);
// x = decode(q) * 2^(scale code - 127); a scale code 0xFF (E8M0 NaN) gives NaN.
void mx_dequantize(const uint8_t* q, const uint8_t* scales_e8m0, int64_t rows, int64_t cols, Fp8Format f, float* x,
                   Stream stream);

// MX codes q [rows, cols] with E8M0 scales [rows, ceil(cols / 32)] re-blocked into 1 x 128 blocks
// for the block-scaled GEMMs: q_out [rows, cols] and FP32 scales [rows, ceil(cols / 128)], each
// block at its largest MX scale and every code re-encoded at it (cpu::mx_to_blocks128's codes and
// scales, bitwise). The codes whose value changed (low bits lost to the coarser scale) are added to
// *changed and E8M0 NaN scales (0xFF, which the CPU twin refuses) to *nan_scales, each when not
// null; no host synchronisation.
void mx_to_blocks128(const uint8_t* q, const uint8_t* scales_e8m0, int64_t rows, int64_t cols, Fp8Format f,
                     uint8_t* q_out, float* scales_out, unsigned long long* changed, uint32_t* nan_scales,
                     Stream stream);

// MX scales [rows, cols] (cols = K / 32, as mx_quantize writes them) in the 128 x 4 tiles
// Blackwell's block-scaled GEMM reads (cuBLASLt's VEC32_UE8M0): out holds
// mx_scales_tiled_bytes(rows, cols) bytes (core/fp8_types.h), cpu::mx_scales_tiled's bit for bit.
void mx_scales_tiled(const uint8_t* scales_e8m0, int64_t rows, int64_t cols, uint8_t* out, Stream stream);

// The experts' weights w [E, n, k] (FP32 or BF16) in 128 x 128 blocks per expert, the contract of
// cpu::fp8_quantize_weights: q [E, n, k] with scales s [E, ceil(n/128), ceil(k/128)] and, when qt
// is not null, the transposed codes qt [E, k, n] with st [E, ceil(k/128), ceil(n/128)], in one pass.
// Under the MX rules (whole blocks only: n and k multiples of 128, w, q, qt 16-byte aligned) q
// re-blocks the 1 x 32 sub-blocks of w's rows and qt those of w's columns, each copy quantised
// along the contraction of the GEMM that reads it (cpu::fp8_quantize_blocks with the rule of w
// and of w^T in 128 x 128 blocks, bitwise); s and st are equal either way.
void fp8_quantize_weights(const float* w, int64_t experts, int64_t n, int64_t k, Fp8Format f, uint8_t* q, float* s,
                          uint8_t* qt, float* st, uint32_t* num_nonfinite, Stream stream,
                          Fp8Rule rule = Fp8Rule::kBlocks);
void fp8_quantize_weights(const uint16_t* w_bf16, int64_t experts, int64_t n, int64_t k, Fp8Format f, uint8_t* q,
                          float* s, uint8_t* qt, float* st, uint32_t* num_nonfinite, Stream stream,
                          Fp8Rule rule = Fp8Rule::kBlocks);
// fp8_quantize_weights of the BF16 rounding of FP32 weights w (cpu::fp8_quantize_weights_bf16_rounded):
// bit for bit the codes and scales of fp8_quantize_weights(cast_f32_to_bf16(w)), without the BF16 copy.
void fp8_quantize_weights_bf16_rounded(const float* w, int64_t experts, int64_t n, int64_t k, Fp8Format f, uint8_t* q,
                                       float* s, uint8_t* qt, float* st, uint32_t* num_nonfinite, Stream stream,
                                       Fp8Rule rule = Fp8Rule::kBlocks);

// The FP8 GEMM's layout of 1 x 128 scales (cuda::fp8_gemm): s [rows, kb] as the quantiser writes
// them (row-major) -> out [kb, ld] (K-block-major, rows contiguous), ld >= rows, entries
// [rows, ld) of each K block zero. Bitwise copies.
void fp8_scales_k_major(const float* s, int64_t rows, int64_t kb, int64_t ld, float* out, Stream stream);

// The weight gradient's operands of the experts, quantised down each expert's rows. Expert e's
// rows (offsets[e] .. offsets[e + 1], device offsets clamped to [0, max_rows]) take the padded
// columns padded[e] .. padded[e + 1] of the output, padded[e] = sum over e' < e of ceil(rows of
// e' / 128) * 128 (written to padded_offsets [E + 1], device int32): x [max_rows, width] (BF16) ->
// q_t [width, capacity] (codes of x^T, row-major, rows `capacity` bytes apart) with scales_t
// [capacity / 128, width] (K-block-major: block b, column j), each 128-row block of an expert and
// column one 1 x 128 block of the quantiser (scale amax / fp8_max, 1 for all zeros; rows past the
// expert's end count as zeros and get code 0). Columns of q_t past padded[E] are not written.
// capacity >= fp8_expert_columns_capacity(max_rows, E), a multiple of 16; the twin is
// cpu::fp8_quantize_expert_columns. No host synchronisation.
int64_t fp8_expert_columns_capacity(int64_t max_rows, int64_t num_experts);
void fp8_quantize_expert_columns(const uint16_t* x_bf16, const int32_t* offsets, int64_t max_rows,
                                 int64_t num_experts, int64_t width, int64_t capacity, Fp8Format f, uint8_t* q_t,
                                 float* scales_t, int32_t* padded_offsets, uint32_t* num_nonfinite, Stream stream);

// The expert exchange's FP8 rows (1 x 128 blocks by the rule; the twins cpu::fp8_pack_rows /
// fp8_unpack_rows with the "blocks" recipe, the MX rules cpu::fp8_quantize_blocks' codes and
// scales): fp8_row_payload_bytes(cols) = cols + 4 cols / 128 bytes a row, its
// codes then its 1 x 128 FP32 scales. fp8_pack_rows: x [rows, cols] (BF16, cols a multiple of 128)
// -> payload [rows, per] (the row quantiser's codes and scales bit for bit; non-finite elements
// added to *num_nonfinite when not null). fp8_unpack_rows: payload -> codes [rows, cols] and scales
// [rows, cols / 128] (the experts' FP8 input rows, cuda::Fp8Rows) and the dequantised rows as
// BF16 (bf16 of cpu::fp8_unpack_rows' FP32 values), each output optional (null: not written).
// Payload rows `stride` bytes apart (0: fp8_row_payload_bytes(cols); else at least that, a multiple
// of 4: an exchange that moves 16-byte words pads its rows); payload 16-byte aligned; no host
// synchronisation.
int64_t fp8_row_payload_bytes(int64_t cols);
void fp8_pack_rows(const uint16_t* x_bf16, int64_t rows, int64_t cols, Fp8Format f, uint8_t* payload,
                   uint32_t* num_nonfinite, Stream stream, int64_t stride = 0, Fp8Rule rule = Fp8Rule::kBlocks);
void fp8_unpack_rows(const uint8_t* payload, int64_t rows, int64_t cols, Fp8Format f, uint8_t* codes, float* scales,
                     uint16_t* out_bf16, Stream stream, int64_t stride = 0);

}  // namespace moe::cuda
