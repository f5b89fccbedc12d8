// SwiGLU on the GPU, same contract as cpu/swiglu.h: gate_up[N, 2I] holds gate in columns
// [0, I) and up in [I, 2I); h[N, I] = silu(gate) * up. BF16 storage (uint16_t bit patterns),
// FP32 math; results within one BF16 rounding of the FP32 reference (docs/cuda.md).
// No CUDA headers: callable from code that never sees the CUDA runtime.
#pragma once

#include <cstdint>

#include "cuda/device.h"

namespace moe::cuda {

void swiglu_forward(const uint16_t* gate_up, uint16_t* h, int64_t n, int64_t inner, Stream stream);

// dgate_up[N, 2I] (overwritten) from dh[N, I].
void swiglu_backward(const uint16_t* gate_up, const uint16_t* dh, uint16_t* dgate_up, int64_t n,
                     int64_t inner, Stream stream);

}  // namespace moe::cuda
