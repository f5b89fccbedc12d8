// RMSNorm on the GPU, same contract as cpu/rmsnorm.h: x[N, D], w[D], y[N, D] in BF16
// (uint16_t bit patterns), FP32 math; rstd[N] = 1 / sqrt(mean(x^2) + eps) saved in FP32 for the
// backward. dx is overwritten, dw (FP32) accumulates, deterministically (fixed chunking, no
// float atomics): the backward needs rmsnorm_backward_workspace_bytes(n, d) of device scratch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/fp8_types.h"
#include "cuda/device.h"

namespace moe::cuda {

void rmsnorm_forward(const uint16_t* x, const uint16_t* w, uint16_t* y, float* rstd, int64_t n, int64_t d,
                     double eps, Stream stream);

// rmsnorm_forward, then fp8_quantize_blocks(y, n, d, 1 x 128, E4M3) into q [n, d] and scales
// [n, d / 128] (row-major), in one pass with the same bits: the FP8 projections' operand written by
// the norm that produces it. Needs rmsnorm_forward_fp8_fuses (d a multiple of 128, x, w, y 16-byte
// and q 8-byte aligned). The CPU twin is cpu::rmsnorm_forward followed by cpu::fp8_quantize_blocks.
bool rmsnorm_forward_fp8_fuses(const uint16_t* x, const uint16_t* w, const uint16_t* y, const uint8_t* q, int64_t d);
void rmsnorm_forward_fp8(const uint16_t* x, const uint16_t* w, uint16_t* y, float* rstd, uint8_t* q, float* scales,
                         int64_t n, int64_t d, double eps, Stream stream, Fp8Rule rule = Fp8Rule::kBlocks);

// Bytes of 16-byte-aligned device scratch the backward needs: ceil(n / 32) * d * 4.
size_t rmsnorm_backward_workspace_bytes(int64_t n, int64_t d);

// dx (overwritten, BF16) and dw (+=, FP32) from dy, given the forward's x, w and rstd.
void rmsnorm_backward(const uint16_t* x, const uint16_t* w, const float* rstd, const uint16_t* dy,
                      uint16_t* dx, float* dw, int64_t n, int64_t d, void* workspace,
                      size_t workspace_bytes, Stream stream);

// rmsnorm_backward, then residual_add(acc, dx, acc_bf16, n * d) in the same pass: acc[n, d] (FP32)
// += bf16(dx), acc_bf16 (may be null) = bf16(acc); dw += as in rmsnorm_backward. The same bits as
// the two ops without dx in memory. The CPU twin is cpu::rmsnorm_backward_add.
void rmsnorm_backward_add(const uint16_t* x, const uint16_t* w, const float* rstd, const uint16_t* dy, float* acc,
                          uint16_t* acc_bf16, float* dw, int64_t n, int64_t d, void* workspace,
                          size_t workspace_bytes, Stream stream);

// QK-norm's backward after RoPE's: rope_backward(dy, batch, seq, heads, head_dim, theta) (on a
// copy: dy is not changed), then rmsnorm_backward(x, w, rstd, that, dx, dw, batch * seq, heads *
// head_dim, ...), in one pass that reads dy rotated back, with the same bits. Needs
// rope_rmsnorm_backward_fuses (head_dim / 2 a multiple of 8, heads * head_dim < 2^31, 16-byte
// aligned tensors); the workspace holds the partial dw rows and a (cos, sin) table of seq x
// head_dim / 2. The CPU twin is cpu::rope_backward followed by cpu::rmsnorm_backward.
size_t rope_rmsnorm_backward_workspace_bytes(int64_t n, int64_t d, int64_t seq, int64_t head_dim);
bool rope_rmsnorm_backward_fuses(const uint16_t* x, const uint16_t* w, const uint16_t* dy, const uint16_t* dx,
                                 int64_t heads, int64_t head_dim);
void rope_rmsnorm_backward(const uint16_t* x, const uint16_t* w, const float* rstd, const uint16_t* dy, uint16_t* dx,
                           float* dw, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double theta,
                           void* workspace, size_t workspace_bytes, Stream stream);

}  // namespace moe::cuda
