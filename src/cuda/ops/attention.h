// Causal grouped-query flash attention on the GPU, same contract as cpu/attention.h: q, out, dout,
// dq are [B, S, Hq, hd] and k, v, dk, dv are [B, S, Hkv, hd], BF16 (uint16_t bit patterns); query
// head h reads kv head h / (Hq / Hkv); scores scaled by 1/sqrt(hd); query i sees keys 0..i.
// lse [B, Hq, S] FP32 (natural log) is saved by the forward for the backward. Tensor cores
// (mma.sync BF16, FP32 accumulation); hd = 64 or 128; deterministic (no atomics).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/device.h"

namespace moe::cuda {

// Head dims with a kernel; any other value is refused with moe::Error naming these.
bool attention_supports_head_dim(int64_t head_dim);

// out (overwritten) and lse (overwritten). Every pointer 16-byte aligned.
void attention_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, float* lse,
                       int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                       Stream stream);

// Bytes of device scratch the backward needs: delta = rowsum(dout * out), B * Hq * S FP32.
size_t attention_backward_workspace_bytes(int64_t batch, int64_t seq, int64_t q_heads);

// dq, dk, dv overwritten (BF16); out and lse are the forward's. dk / dv sum over the query heads
// of each group inside the kernel, in FP32, in a fixed order.
void attention_backward(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* out,
                        const float* lse, const uint16_t* dout, uint16_t* dq, uint16_t* dk, uint16_t* dv,
                        int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                        void* workspace, size_t workspace_bytes, Stream stream);

}  // namespace moe::cuda
