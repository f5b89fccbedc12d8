// Parameter initialisation on the GPU with the values of Model<float>::init_params: 1-D tensors
// (norm weights) = 1, every other tensor the truncated normal of core/rng.h (Philox4x32-10
// counters per (seed, tensor name, element index), Box-Muller in FP64, resampled outside +-3,
// times std, rounded to FP32). Values equal the host's up to libm vs CUDA log/cos (a few FP64 ulp
// before the FP32 rounding). No host copy of the parameters exists. No CUDA headers.
#pragma once

#include <cstdint>
#include <string_view>

#include "cuda/device.h"

namespace moe {
class ParamLayout;
}

namespace moe::cuda {

// params: device FP32 [layout.total_numel()], 4-byte aligned. Every tensor of the layout is
// written at its offset; the alignment padding between tensors is not written. Enqueued on
// `stream` (one launch per tensor); no host synchronisation.
void init_params(const ParamLayout& layout, float* params, uint64_t seed, double std, Stream stream);

// out[i] = element (global_offset + i) of tensor `name`'s truncated N(0, std^2) values, i < n:
// the device twin of fill_trunc_normal(float*, ...) in core/rng.h (any slice of a tensor).
void fill_trunc_normal(float* out, int64_t n, int64_t global_offset, uint64_t seed, std::string_view name,
                       double std, Stream stream);

// out[i] = value, i < n.
void fill_value(float* out, int64_t n, float value, Stream stream);

}  // namespace moe::cuda
