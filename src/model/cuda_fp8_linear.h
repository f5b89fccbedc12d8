// The FP8 recipe's dense linear layers on the GPU (train.precision = "fp8"): a weight's E4M3 codes
// in 128 x 128 blocks with the transposed copy its data gradient reads, the model's one set of
// activation codes (1 x 128 blocks along K, FP32 scales in cuda::fp8_gemm's K-block-major
// layout), and the GEMM y = A W^T on cuBLASLt's block-scaled FP8 (cuda::fp8_gemm). Used by the
// attention projections, the dense MLP blocks and the shared experts. CUDA builds only
// (MOECORE_HAS_CUDA); no CUDA headers.
// Legend: N tokens, K the GEMM's contraction width, M its output width.
#pragma once

#include <cstdint>

#include "core/fp8_types.h"
#include "cuda/device.h"
#include "cuda/ops/memory.h"
#include "model/cuda_block.h"

namespace moe {

// The model's FP8 activation operand (one per model, grown to the widest GEMM input): codes q
// [N, width], their 1 x 128 scales row-major (s, as the quantisers write them) and K-block-major
// (s_t, cuda::fp8_gemm's A layout), and the scale re-layout scratch of a weight refresh (w_tmp).
struct CudaFp8Scratch {
  cuda::DeviceBuffer q, s, s_t, w_tmp;
  // The rule of every code the dense FP8 layers write, weights' and activations' (train.fp8_scaling,
  // core/fp8_types.h; CudaModel::set_fp8).
  Fp8Rule rule = Fp8Rule::kBlocks;
  // Grows only: n tokens of `width` codes, and a refresh of weights up to `weight_elems` elements.
  void reserve(int64_t n, int64_t width, int64_t weight_elems, CudaBufferGrower& g);
};

// One BF16 weight W [rows, cols] (both multiples of 128) as E4M3 codes in 128 x 128 blocks: q
// [rows, cols] with scales s [rows/128, pad4(cols/128)] and the transposed copy qt [cols, rows]
// with st [cols/128, pad4(rows/128)] (cuda::fp8_gemm's B layout, rows of block scales padded to a
// multiple of 4 with zeros).
struct CudaFp8Weight {
  cuda::DeviceBuffer q, s, qt, st;
  int64_t rows = 0, cols = 0;
  void reserve(int64_t rows, int64_t cols, CudaBufferGrower& g, const char* what);
  // The codes of w [rows, cols] (BF16, the parameters' copy) by the scratch's rule, on st.
  void quantize(const uint16_t* w, CudaFp8Scratch& scratch, cuda::Stream st);
};

// x [n, k] (BF16, k a multiple of 128) -> the scratch's codes [n, k] and both scale layouts.
void fp8_quantize_operand(const uint16_t* x, int64_t n, int64_t k, CudaFp8Scratch& sc, cuda::Stream st);
// The RMSNorm of x [n, k] (weight w, BF16) into y (BF16) and rstd [n], and y's codes and both scale
// layouts in the scratch as fp8_quantize_operand(y) leaves them: in one pass where
// cuda::rmsnorm_forward_fp8_fuses, else the norm then the quantiser (the same bits either way).
void fp8_rmsnorm_operand(const uint16_t* x, const uint16_t* w, uint16_t* y, float* rstd, int64_t n, int64_t k,
                         double eps, CudaFp8Scratch& sc, cuda::Stream st);
// Several tensors side by side along K as one operand: x [n, k_part] -> columns [col, col + k_part)
// of the scratch's codes [n, ld] and K blocks [col/128, (col + k_part)/128) of its K-block-major
// scales (col and k_part multiples of 128, col + k_part <= ld).
void fp8_quantize_operand_part(const uint16_t* x, int64_t n, int64_t k_part, int64_t ld, int64_t col,
                               CudaFp8Scratch& sc, cuda::Stream st);

// out [n, m] (BF16, overwritten) = A W_r^T, A the scratch's codes of [n, k]; W_r rows [r0, r0 + m)
// of w [., k] (transposed: of w's transposed copy, [cols, rows]), r0 a multiple of 128. n a
// multiple of 4, m of 16.
void fp8_linear(cuda::GemmHandle& g, const CudaFp8Scratch& sc, const CudaFp8Weight& w, bool transposed, int64_t r0,
                int64_t n, int64_t m, int64_t k, uint16_t* out, cuda::Stream st);

}  // namespace moe
