// Dense GEMM on the GPU through cuBLASLt, same contract as cpu::gemm: row-major
// C[m,n] = alpha * op(A)[m,k] @ op(B)[k,n] + beta * C, op = transpose when the flag is set.
// A and B are BF16 (uint16_t bit patterns), accumulation FP32, C either BF16 (activations) or
// FP32 (weight gradients: beta = 1 accumulates). k = 0 gives C = beta * C (0 when beta == 0).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/fp8_types.h"
#include "cuda/device.h"

namespace moe::cuda {

// Owns a cuBLASLt handle, a 32 MiB device workspace and a cache of matmul plans (descriptors,
// layouts and the heuristic's algorithm), one per distinct problem: (m, n, k, transposes, leading
// dims, batch and strides, C dtype, pointer alignments). The first call of a problem builds its
// plan (host work only); later calls are a map lookup and one cublasLtMatmul: no allocation, no
// synchronisation, so they can be captured in a CUDA graph. Make the first call of each problem
// outside capture. Create once per device (the current one at construction) and keep it for the
// run. Not thread-safe; calls sharing a handle share its workspace, so they must not overlap on
// different streams (use one handle per concurrent stream).
class GemmHandle {
 public:
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;

  GemmHandle();
  ~GemmHandle();
  GemmHandle(const GemmHandle&) = delete;
  GemmHandle& operator=(const GemmHandle&) = delete;

  // Distinct problems planned so far.
  size_t num_plans() const;

  struct Impl;  // CUDA-typed state, defined in gemm.cu
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// C (BF16) = alpha * op(A) @ op(B) + beta * C. Row-major with leading dimensions lda >= (trans_a ? m : k),
// ldb >= (trans_b ? k : n), ldc >= n, in elements. Pointers need only 2-byte alignment (16 is faster).
void gemm(GemmHandle& handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, uint16_t* c, int64_t ldc,
          Stream stream);

// The same with C in FP32 (4-byte aligned), e.g. dW += dY^T @ X with beta = 1.
void gemm(GemmHandle& handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc,
          Stream stream);

// `batch` independent problems of one shape: matrix i of A starts at a + i * stride_a (elements),
// likewise B and C. Strides may be 0 for A or B (one matrix shared by the batch), not for C.
void gemm_strided_batched(GemmHandle& handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                          float alpha, const uint16_t* a, int64_t lda, int64_t stride_a, const uint16_t* b,
                          int64_t ldb, int64_t stride_b, float beta, uint16_t* c, int64_t ldc, int64_t stride_c,
                          int64_t batch, Stream stream);

void gemm_strided_batched(GemmHandle& handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                          float alpha, const uint16_t* a, int64_t lda, int64_t stride_a, const uint16_t* b,
                          int64_t ldb, int64_t stride_b, float beta, float* c, int64_t ldc, int64_t stride_c,
                          int64_t batch, Stream stream);

// Block-scaled FP8 GEMM on Hopper's tensor cores through cuBLASLt (FP32 accumulation, each 128-wide
// K block's partial sum promoted by its two scales; no fast accumulation), the contract of
// cpu::fp8_gemm_block_scaled (b_scaling kBlock128x128) and cpu::fp8_gemm_rowwise_scaled (kRow1x128):
//   C[m, n] (=, or += with accumulate) A[m, k] B[n, k]^T
// qa, qb: FP8 codes (fa, fb: E4M3 or E5M2, not both E5M2), row-major, K contiguous.
// sa_t: A's 1 x 128 scales K-block-major: scale of A[i, 128 kb ...] at sa_t[kb * lds_a + i],
//   lds_a >= m and a multiple of 4 (fp8_scales_k_major writes it from the quantiser's [m, k/128]).
// sb: kBlock128x128: one scale per 128 x 128 block of B at sb[nb * lds_b + kb], lds_b >= k / 128
//   and a multiple of 4 (the quantiser's [ceil(n/128), k/128] when k/128 is a multiple of 4);
//   kRow1x128: one per 1 x 128 block, K-block-major as A's: sb[kb * lds_b + j], lds_b >= n, a
//   multiple of 4. Scales are dequantisation factors (x ~ code * scale), FP32, on the device.
// C: BF16 (overwritten) or FP32 (overwritten, or accumulate: C += the product). k a positive
// multiple of 128, n a multiple of 16, m of 4, every pointer 16-byte aligned. cuBLASLt takes no
// leading dimension for scales: lds_a must be m and lds_b k / 128 rounded up to a multiple of 4
// (128 x 128) or n (1 x 128); they are passed so that the call states the layout it hands over. Plans are cached in the
// handle like gemm's (first call of a shape outside capture).
enum class Fp8BScaling { kBlock128x128, kRow1x128 };
void fp8_gemm(GemmHandle& handle, const uint8_t* qa, const float* sa_t, int64_t lds_a, Fp8Format fa,
              const uint8_t* qb, const float* sb, int64_t lds_b, Fp8Format fb, Fp8BScaling b_scaling, int64_t m,
              int64_t n, int64_t k, uint16_t* c, Stream stream);
void fp8_gemm(GemmHandle& handle, const uint8_t* qa, const float* sa_t, int64_t lds_a, Fp8Format fa,
              const uint8_t* qb, const float* sb, int64_t lds_b, Fp8Format fb, Fp8BScaling b_scaling, int64_t m,
              int64_t n, int64_t k, float* c, bool accumulate, Stream stream);

// MXFP8's GEMM on Hopper: C [m, n] (=, or += with accumulate) A [m, k] B [n, k]^T with both
// operands MX (codes row-major, E8M0 scales [rows, k / 32] as mx_quantize writes them), each
// re-blocked into 1 x 128 blocks (mx_to_blocks128, into the workspace) and multiplied by fp8_gemm
// with 1 x 128 scales for both. That equals cpu::mx_gemm up to FP32 summation order while the
// re-blocking is exact, and always equals the CPU's re-blocking followed by
// cpu::fp8_gemm_rowwise_scaled within it; *changed (when not null) gets the codes the re-blocking
// altered, *nan_scales (when not null) any E8M0 NaN scale. k a multiple of 128, n of 16, m of 4,
// code and C pointers 16-byte aligned. On a Blackwell GPU (compute capability 10.0 or later) the
// scales are laid out in its tiles (mx_scales_tiled, into the workspace) and the GEMM is
// mx_gemm_tiled: nothing re-blocked, *changed untouched.
size_t mx_gemm_workspace_bytes(int64_t m, int64_t n, int64_t k);
void mx_gemm(GemmHandle& handle, const uint8_t* qa, const uint8_t* sa_e8m0, Fp8Format fa, const uint8_t* qb,
             const uint8_t* sb_e8m0, Fp8Format fb, int64_t m, int64_t n, int64_t k, float* c, bool accumulate,
             void* workspace, size_t workspace_bytes, unsigned long long* changed, uint32_t* nan_scales,
             Stream stream);
// MXFP8's GEMM on Blackwell's tensor cores through cuBLASLt (VEC32_UE8M0 scales for both operands:
// cpu::mx_gemm's arithmetic, promotion every 32 K elements): C [m, n] (=, or += with accumulate)
// A [m, k] B [n, k]^T, codes as mx_gemm's, scales in Blackwell's tiles (mx_scales_tiled of the
// [m, k / 32] and [n, k / 32] E8M0 scales). Refused, naming the compute capability, below 10.0
// (Hopper has no 1 x 32 scale mode); not tested on a Blackwell GPU here.
void mx_gemm_tiled(GemmHandle& handle, const uint8_t* qa, const uint8_t* sa_tiled, Fp8Format fa, const uint8_t* qb,
                   const uint8_t* sb_tiled, Fp8Format fb, int64_t m, int64_t n, int64_t k, float* c, bool accumulate,
                   Stream stream);

}  // namespace moe::cuda
