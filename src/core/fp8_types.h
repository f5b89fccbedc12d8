// FP8 formats, scaling blocks and the MX scale rule, shared by the CPU reference (cpu/fp8.h) and
// the GPU kernels (cuda/ops/fp8.h), which implement the same contract (described in cpu/fp8.h).
#pragma once

#include <cstdint>

#include "core/moe_types.h"  // MOE_HOST_DEVICE

namespace moe {

enum class Fp8Format { kE4M3, kE5M2 };

// A scaling block of rows x cols elements of a row-major tensor (the last blocks of a row or a
// column may be smaller).
struct Fp8Block {
  int64_t rows = 1, cols = 128;
};
inline constexpr Fp8Block kFp8ActivationBlock{1, 128};
inline constexpr Fp8Block kFp8WeightBlock{128, 128};

// MX (OCP Microscaling) scale rule: the spec's floor rule, or the scale rounded up so that no
// element saturates.
enum class MxScale { kOcp, kNoSaturation };
inline constexpr int64_t kMxBlock = 32;

// Largest finite value: 448 (E4M3, OCP "fn") and 57344 (E5M2); emax, the exponent of the largest
// normal binade: 8 and 15.
MOE_HOST_DEVICE inline constexpr float fp8_max_of(Fp8Format f) { return f == Fp8Format::kE4M3 ? 448.0f : 57344.0f; }
MOE_HOST_DEVICE inline constexpr int fp8_emax_of(Fp8Format f) { return f == Fp8Format::kE4M3 ? 8 : 15; }

}  // namespace moe
