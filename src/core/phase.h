// The phases of a training step, in the order a step runs them (backward adds to the phase of its
// forward), and their names, the keys of `moecore bench`'s phase tables and JSON records. One enum
// for the CPU wall-clock timer (core/phase_timer.h) and the GPU event timer (cuda/event_timer.h):
// per-phase figures live in arrays of kNumPhases entries indexed by int(Phase).
#pragma once

namespace moe {

enum class Phase : int {
  kEmbedding,   // embedding forward/backward
  kAttention,   // norm1, QKV, QK-norm, RoPE, attention, output projection, residual
  kMlp,         // norm2, dense and shared-expert MLPs, residual
  kRouter,      // gate GEMM, scores, top-k, losses and their backward
  kDispatch,    // dispatch map, permute (forward) / permute backward; the expert-parallel exchange out
  kExperts,     // grouped GEMMs and SwiGLU of the routed experts
  kCombine,     // weighted unpermute and its backward; the expert-parallel exchange back
  kLmHead,      // final norm, LM head, cross-entropy
  kRecompute,   // activation recomputation in backward (train.recompute: selective, full)
  kGradReduce,  // data parallel: all-reduce of the gradients and step statistics (GPU step)
  kOptimizer,   // grad norm, clipping, AdamW (GPU: BF16 refresh, expert-bias update)
  kCount
};
inline constexpr int kNumPhases = static_cast<int>(Phase::kCount);

namespace detail {
[[noreturn]] void throw_bad_phase(int p);
}  // namespace detail

// "embedding", "attention", "mlp", "router", "dispatch", "experts", "combine", "lm_head",
// "recompute", "grad_reduce", "optimizer"; throws for a value outside [kEmbedding, kCount).
constexpr const char* phase_name(Phase p) {
  switch (p) {
    case Phase::kEmbedding: return "embedding";
    case Phase::kAttention: return "attention";
    case Phase::kMlp: return "mlp";
    case Phase::kRouter: return "router";
    case Phase::kDispatch: return "dispatch";
    case Phase::kExperts: return "experts";
    case Phase::kCombine: return "combine";
    case Phase::kLmHead: return "lm_head";
    case Phase::kRecompute: return "recompute";
    case Phase::kGradReduce: return "grad_reduce";
    case Phase::kOptimizer: return "optimizer";
    case Phase::kCount: break;
  }
  detail::throw_bad_phase(static_cast<int>(p));
}

}  // namespace moe
