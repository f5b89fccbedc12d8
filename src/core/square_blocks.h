// The 128 x 128 blocks of an experts' weight gradient [E, n, k] whose sums of squares the
// weight-gradient GEMM writes beside the gradient (cuda::grouped_gemm_wgrad's `squares`,
// cpu::block_square_sums): block (e, i, j) holds rows [128 i, 128 i + 128) and columns
// [128 j, 128 j + 128) of dw[e], clipped at n and k, at index (e * ceil(n / 128) + i) * ceil(k / 128) + j.
// Their sum is ||dw||^2, so the step's gradient norm need not read those gradients again.
#pragma once

#include <cstdint>

namespace moe {

constexpr int64_t kSquareBlock = 128;

constexpr int64_t square_blocks(int64_t num_experts, int64_t n, int64_t k) {
  return num_experts * ((n + kSquareBlock - 1) / kSquareBlock) * ((k + kSquareBlock - 1) / kSquareBlock);
}

// One MoE layer's: its experts' gate_up [E, 2I, D] blocks, then their down [E, D, I] blocks.
constexpr int64_t expert_square_blocks(int64_t num_experts, int64_t d, int64_t inner) {
  return square_blocks(num_experts, 2 * inner, d) + square_blocks(num_experts, d, inner);
}

}  // namespace moe
