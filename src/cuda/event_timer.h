// Step time by phase on the GPU, measured with CUDA events on one stream (no host wait while
// recording). mark(p) closes the open phase and opens p; close() closes the open one. Each
// closed interval adds to its phase; collect() waits for the recorded events and returns the
// milliseconds per phase since the last collect(). Forward and backward of a phase add to the
// same phase. Not for use inside CUDA graph capture: profile an eager step.
#pragma once

#include <array>
#include <memory>

#include "cuda/device.h"

namespace moe::cuda {

enum class Phase : int {
  kEmbedding,  // embedding forward/backward
  kAttention,  // norm1, QKV, QK-norm, RoPE, attention, output projection, residual
  kMlp,        // norm2, dense and shared-expert MLPs, residual
  kRouter,     // gate GEMM, scores, top-k, losses and their backward
  kDispatch,   // dispatch map, permute (forward) / permute backward
  kExperts,    // grouped GEMMs and SwiGLU of the routed experts
  kCombine,    // weighted unpermute and its backward
  kLmHead,     // final norm, LM head, cross-entropy
  kGradReduce, // data parallel: all-reduce of the gradients and step statistics over the GPUs
  kOptimizer,  // grad norm, clipping, AdamW, BF16 refresh, expert-bias update
  kCount
};
constexpr int kNumPhases = static_cast<int>(Phase::kCount);
// "embedding", "attention", "mlp", "router", "dispatch", "experts", "combine", "lm_head",
// "grad_reduce", "optimizer".
const char* phase_name(Phase p);

class EventTimer {
 public:
  explicit EventTimer(Stream stream);
  ~EventTimer();
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  void mark(Phase p);
  void close();
  std::array<double, kNumPhases> collect();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::cuda
