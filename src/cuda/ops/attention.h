// Causal grouped-query flash attention on the GPU, same contract as cpu/attention.h: q, out, dout,
// dq are [B, S, Hq, hd] and k, v, dk, dv are [B, S, Hkv, hd], BF16 (uint16_t bit patterns); query
// head h reads kv head h / (Hq / Hkv); scores scaled by 1/sqrt(hd); query i sees keys 0..i.
// lse [B, Hq, S] FP32 (natural log) is saved by the forward for the backward. Two backends on
// this one contract: own (mma.sync BF16 kernels, attention.cuh; hd 64 or 128; no atomics) and
// cudnn (cuDNN's fused SDPA, attention_cudnn.h; hd a multiple of 8 up to 256). Both deterministic.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/device.h"

namespace moe::cuda {

// Which kernels an entry point uses. kAuto: the environment variable MOECORE_ATTENTION ("own" or
// "cudnn") when set and not empty, else cudnn where the build holds it (2.5-2.8x the own kernels on
// an H200, docs/benchmarks.md) and own otherwise. No call is sent to the other backend.
enum class AttentionBackend { kAuto, kOwn, kCudnn };

// "auto", "own" or "cudnn".
const char* attention_backend_name(AttentionBackend backend);

// The backend `requested` runs on (never kAuto). Throws moe::Error when MOECORE_ATTENTION holds
// another value, or when cudnn is asked for (by argument or variable) in a build without cuDNN.
AttentionBackend attention_resolve_backend(AttentionBackend requested = AttentionBackend::kAuto);

// Whether this build holds the cuDNN backend (configured with cuDNN 9 and the cuDNN frontend).
bool attention_cudnn_available();

// Head dims the backend runs (own: 64 and 128; cudnn: multiples of 8 from 8 to 256); the entry
// points refuse any other value with moe::Error naming these. Resolves `backend` as above.
bool attention_supports_head_dim(int64_t head_dim, AttentionBackend backend = AttentionBackend::kAuto);

// Makes every later forward and backward call of this shape capturable into a CUDA graph: cudnn
// builds (once per shape and device) its forward and backward plans and their workspaces; own
// needs nothing. Never call it while `stream` is captured. The first eager call of a shape does
// the same implicitly; a cudnn call under capture whose plan is missing throws, naming the shape.
void attention_prepare(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                       Stream stream, AttentionBackend backend = AttentionBackend::kAuto);

// out (overwritten) and lse (overwritten). Every BF16 pointer 16-byte aligned, lse 4-byte.
void attention_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, float* lse,
                       int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                       Stream stream, AttentionBackend backend = AttentionBackend::kAuto);

// Bytes of device scratch the caller passes to the backward (either backend: the same contract):
// delta = rowsum(dout * out) of the own kernels, B * Hq * S FP32. The cudnn backend keeps its
// plan's own workspace (sized by the plan, allocated when the plan is built) and leaves this one
// unused.
size_t attention_backward_workspace_bytes(int64_t batch, int64_t seq, int64_t q_heads);

// dq, dk, dv overwritten (BF16); out and lse are the forward's (either backend's). dk / dv sum
// over the query heads of each group in FP32, in a fixed order (own: inside the kernel; cudnn:
// its deterministic algorithm). cudnn with seq = 1, which cuDNN refuses, runs a single-key kernel
// (dq = dk = 0, dv = the group's sum of dout).
void attention_backward(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* out,
                        const float* lse, const uint16_t* dout, uint16_t* dq, uint16_t* dk, uint16_t* dv,
                        int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                        void* workspace, size_t workspace_bytes, Stream stream,
                        AttentionBackend backend = AttentionBackend::kAuto);

// Decoding over a KV cache (as cpu::attention_decode): q and out [n, Hq, hd] are the new rows at
// positions pos0 .. pos0 + n - 1; k_cache and v_cache [pos0 + n, Hkv, hd] hold every position's
// keys (after RoPE) and values, the new rows' included; row i sees keys 0 .. pos0 + i. Any head_dim
// up to 256; own kernel (attention_decode.cuh) on every backend; out overwritten; deterministic.
void attention_decode(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, uint16_t* out, int64_t n,
                      int64_t pos0, int64_t q_heads, int64_t kv_heads, int64_t head_dim, Stream stream);

}  // namespace moe::cuda
