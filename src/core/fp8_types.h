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

// How the GPU's FP8 path (train.fp8_scaling) picks a 1 x 128 or 128 x 128 block's scale and codes:
// kBlocks, the block recipe's FP32 amax / fp8_max; kMx and kMxNoSaturation, MX scaling on Hopper:
// MX's 1 x 32 sub-blocks along the rows (E8M0 scales by MxScale::kOcp / kNoSaturation) re-blocked
// at the block's largest sub-block scale (cpu::mx_to_blocks), so that the block-scaled GEMMs
// compute the MX product, exactly while no re-blocked code loses bits (docs/numerics.md).
enum class Fp8Rule : uint8_t { kBlocks, kMx, kMxNoSaturation };
MOE_HOST_DEVICE inline constexpr MxScale mx_rule_of(Fp8Rule r) {
  return r == Fp8Rule::kMxNoSaturation ? MxScale::kNoSaturation : MxScale::kOcp;
}
// Bytes of MX scales [rows, cols] in the 128 x 4 tiles Blackwell's block-scaled GEMM reads
// (cpu::mx_scales_tiled, cuda::mx_scales_tiled): rows padded to 128, columns to 4.
inline constexpr int64_t mx_scales_tiled_bytes(int64_t rows, int64_t cols) {
  return (rows + 127) / 128 * ((cols + 3) / 4) * 512;
}

// Largest finite value: 448 (E4M3, OCP "fn") and 57344 (E5M2); emax, the exponent of the largest
// normal binade: 8 and 15.
MOE_HOST_DEVICE inline constexpr float fp8_max_of(Fp8Format f) { return f == Fp8Format::kE4M3 ? 448.0f : 57344.0f; }
MOE_HOST_DEVICE inline constexpr int fp8_emax_of(Fp8Format f) { return f == Fp8Format::kE4M3 ? 8 : 15; }

// The shapes the GPU's FP8 training path (train.precision = "fp8" on cuda) runs, one rule for the
// model and the run plan: the routed experts' grouped FP8 GEMMs read rows of 16 codes (D and the
// expert hidden I multiples of 16); a dense MLP or shared expert runs its GEMMs on cuBLASLt's
// block-scaled FP8 when D and its hidden F are whole 128-wide scaling blocks (else it stays BF16).
inline constexpr bool fp8_experts_shapes(int64_t d, int64_t inner) { return d % 16 == 0 && inner % 16 == 0; }
inline constexpr bool fp8_mlp_shapes(int64_t d, int64_t f) { return d > 0 && f > 0 && d % 128 == 0 && f % 128 == 0; }
// Under an MX rule the routed experts' codes are re-blocked into whole 1 x 128 and 128 x 128
// blocks: D and the expert hidden I multiples of 128.
inline constexpr bool fp8_mx_experts_shapes(int64_t d, int64_t inner) { return d % 128 == 0 && inner % 128 == 0; }

}  // namespace moe
