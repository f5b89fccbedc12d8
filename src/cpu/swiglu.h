// SwiGLU on a fused gate/up projection: gate_up[N, 2I] holds gate in columns [0, I) and up in
// [I, 2I) (the fused HF layout, gate rows first); h[N, I] = silu(gate) * up,
// silu(g) = g * sigmoid(g).
#pragma once

#include <cstdint>

namespace moe::cpu {

template <typename T>
void swiglu_forward(const T* gate_up, T* h, int64_t n, int64_t inner);

// dgate_up (overwritten) from dh.
template <typename T>
void swiglu_backward(const T* gate_up, const T* dh, T* dgate_up, int64_t n, int64_t inner);

}  // namespace moe::cpu
