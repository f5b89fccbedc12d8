// The cuDNN backend of attention.h: cuDNN's fused SDPA (flash attention) through the cuDNN
// frontend graph API, on the same contract (BSHD BF16 tensors described by strides, lse [B, Hq, S]
// FP32 natural-log = cuDNN's softmax Stats, causal, GQA, scale 1/sqrt(D)). One execution plan
// per (device, B, S, Hq, Hkv, D, direction), built outside graph capture and cached for the
// process's lifetime with its device workspace. No cuDNN header here: CPU code may include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "cuda/device.h"

namespace moe::cuda {

// Whether this build holds the cuDNN backend (configured with cuDNN 9 and its frontend, compile
// definition MOECORE_HAS_CUDNN). When it is false, prepare / forward / backward throw moe::Error
// saying so, supports_head_dim answers false and cached_plans 0.
bool attention_cudnn_built();

// "cuDNN 9.14.0 (built against 9.19.0), frontend 1.16.0" (the runtime library first), or
// "not built" without cuDNN. Never throws.
std::string attention_cudnn_version();

// Head dims the cuDNN SDPA graphs accept on Hopper, forward and backward: multiples of 8 up to
// 256 (the frontend's support checks for sm_90, cuDNN 9).
bool attention_cudnn_supports_head_dim(int64_t head_dim);

enum class AttentionDirection { kForward, kBackward };

// Builds the plan of this shape and direction on the current device if it is not cached yet,
// with its workspace (cudaMalloc) and, for the backward, its sequence-length tensors. Throws
// when `stream` is being captured (naming the shape), or when cuDNN refuses the graph (naming
// the step and cuDNN's message). Returns the plan's workspace bytes.
size_t attention_cudnn_prepare(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                               AttentionDirection direction, Stream stream);

// The entry points of attention.h for this backend; shapes and pointers are checked there.
// The plan is built on the first call of a shape (never under capture: see prepare). Calls of
// one shape and direction on one device share the plan's workspace, so they must be ordered
// (one stream, or events), as every call of a training step is.
void attention_cudnn_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, float* lse,
                             int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                             Stream stream);
void attention_cudnn_backward(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* out,
                              const float* lse, const uint16_t* dout, uint16_t* dq, uint16_t* dk, uint16_t* dv,
                              int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                              Stream stream);

// Number of plans in the process-wide cache (all devices, both directions).
size_t attention_cudnn_cached_plans();

}  // namespace moe::cuda
