// SwiGLU on the GPU, same contract as cpu/swiglu.h: gate_up[N, 2I] holds gate in columns
// [0, I) and up in [I, 2I); h[N, I] = silu(gate) * up. BF16 storage (uint16_t bit patterns),
// FP32 math; results within one BF16 rounding of the FP32 reference (docs/cuda.md).
// No CUDA headers: callable from code that never sees the CUDA runtime.
#pragma once

#include <cstdint>

#include "core/fp8_types.h"
#include "cuda/device.h"

namespace moe::cuda {

void swiglu_forward(const uint16_t* gate_up, uint16_t* h, int64_t n, int64_t inner, Stream stream);

// dgate_up[N, 2I] (overwritten) from dh[N, I].
void swiglu_backward(const uint16_t* gate_up, const uint16_t* dh, uint16_t* dgate_up, int64_t n,
                     int64_t inner, Stream stream);

// The same, with the E4M3 1 x 128 quantisation of the output fused in: h (bitwise swiglu_forward's)
// and its codes q_h [N, I] with scales s_h [N, I / 128], exactly what fp8_quantize_blocks(h, N, I,
// 1 x 128, E4M3) writes. inner a multiple of 128; every pointer 16-byte aligned (scales 4-byte).
void swiglu_forward_fp8(const uint16_t* gate_up, uint16_t* h, uint8_t* q_h, float* s_h, int64_t n, int64_t inner,
                        Stream stream, Fp8Rule rule = Fp8Rule::kBlocks);

// swiglu_backward's dgate_up (bitwise) and its codes q_dgu [N, 2I] with scales s_dgu [N, 2I / 128],
// exactly fp8_quantize_blocks(dgate_up, N, 2I, 1 x 128, E4M3). Same requirements.
void swiglu_backward_fp8(const uint16_t* gate_up, const uint16_t* dh, uint16_t* dgate_up, uint8_t* q_dgu,
                         float* s_dgu, int64_t n, int64_t inner, Stream stream, Fp8Rule rule = Fp8Rule::kBlocks);

}  // namespace moe::cuda
