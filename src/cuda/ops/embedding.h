// Token embedding on the GPU, same contract as cpu/embedding.h: out[i, :] = w[ids[i], :] with
// w[vocab, d] and out[n, d] in BF16 (uint16_t bit patterns); backward dw[vocab, d] (FP32) +=
// dout rows, deterministic and bit-identical to the CPU twin in float. Ids are validated on
// the device without a trap (graph-safe): a bad id writes a zero row in forward, contributes
// nothing in backward, and adds 1 to *num_bad_ids (a caller-owned device counter, never reset
// here) which the host reads when it likes, e.g. with the step's metrics.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/device.h"

namespace moe::cuda {

void embedding_forward(const int32_t* ids, const uint16_t* w, uint16_t* out, int64_t n, int64_t vocab,
                       int64_t d, uint32_t* num_bad_ids, Stream stream);

// Bytes of device scratch the backward needs (sort keys, positions and the radix sort's own
// temporary storage). Queries the current device; call it outside stream capture.
size_t embedding_backward_workspace_bytes(int64_t n, int64_t vocab);

void embedding_backward(const int32_t* ids, const uint16_t* dout, float* dw, int64_t n, int64_t vocab,
                        int64_t d, uint32_t* num_bad_ids, void* workspace, size_t workspace_bytes,
                        Stream stream);

}  // namespace moe::cuda
