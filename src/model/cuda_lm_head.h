// The LM head of the CUDA model: final RMSNorm, logits = norm @ W_head^T and cross-entropy, in
// chunks of chunk_rows rows so that [N, V] logits never exist (one [chunk, V] BF16 buffer, the CE
// gradient written in place). Backward recomputes each chunk's logits (one extra N x V x D GEMM),
// fuses the softmax gradient, and starts the residual gradient (dx32 = dL/dx of the final norm's
// input); or, when the forward ran with its backward fused (training steps), the forward did the
// chunks' gradient GEMMs while their logits were at hand and backward only runs the norm's. CUDA builds only (MOECORE_HAS_CUDA); no CUDA headers.
// Legend: B batch, S sequence, N = B*S tokens, D model width, V vocabulary. BF16 unless noted.
#pragma once

#include <cstdint>

#include "core/config.h"
#include "cuda/ops/memory.h"
#include "model/cuda_block.h"

namespace moe {

// What the LM head saves for backward.
struct CudaLmHeadSaved {
  cuda::DeviceBuffer x_ND;             // input: BF16 copy of the final residual stream
  cuda::DeviceBuffer norm_ND, rstd_N;  // final norm output, its rstd (FP32)
  cuda::DeviceBuffer loss_N, lse_N;    // FP32 per-token CE loss and log-sum-exp
};

class CudaLmHead {
 public:
  // norm, head: flat offsets of model.norm.weight [D] and lm_head.weight [V, D].
  CudaLmHead(const ModelConfig& m, int64_t norm, int64_t head, int64_t chunk_rows);

  void reserve(int64_t batch, int64_t seq, CudaBufferGrower& g);
  // Saved input: written by the last block (or the embedding without blocks).
  uint16_t* input() const { return saved_.x_ND.as<uint16_t>(); }

  // targets_N: device int32 ids (< 0 ignored). Per-token loss and lse; the chunks' CE sum adds
  // into *ce_sum (device FP64) and targets >= V into *bad_targets. grad_one: a device FP32 1 (the
  // CE kernel's gradient scale; the forward's gradient is discarded).
  // fused_ce_scale (device FP32, or null): also the backward's GEMMs, chunk by chunk (CE gradient
  // in place with this scale, dnorm, dW_head as c.wgrad_beta() says), which the next backward then
  // skips: the same values bit for bit, one logits GEMM fewer.
  void forward(const CudaBlockContext& c, const int32_t* targets_N, const float* grad_one, double* ce_sum,
               uint32_t* bad_targets, const float* fused_ce_scale = nullptr);
  // dW_head and dW_norm +=; res.dx32 = the gradient at the final norm's input (overwritten),
  // res.dx its BF16 copy. ce_scale: device FP32; bad targets add into *bad_targets.
  void backward(const CudaBlockContext& c, const int32_t* targets_N, const float* ce_scale, uint32_t* bad_targets,
                CudaResidual& res);

 private:
  int64_t d_, v_, norm_, head_, chunk_rows_;
  double norm_eps_;
  CudaLmHeadSaved saved_;
  cuda::DeviceBuffer logits_chunk_;  // [min(N, chunk_rows), V]: one chunk of logits, then their gradient
  cuda::DeviceBuffer dnorm_ND_;   // gradient at the final norm's output
  bool fused_ = false;            // the last forward wrote dnorm and dW_head already

  // Chunk [r0, r0 + rows): logits, the CE gradient in place (scale ce_scale), dnorm and dW_head.
  void chunk_backward(const CudaBlockContext& c, int64_t r0, int64_t rows, const int32_t* targets_N,
                      const float* ce_scale, double* ce_sum, uint32_t* bad_targets);
};

}  // namespace moe
