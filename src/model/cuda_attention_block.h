// The attention block of the CUDA model (Model<float>'s attention branch, pre-norm):
// x += o_proj(attention(rope(qk_norm(q_proj(n))), rope(qk_norm(k_proj(n))), v_proj(n))), n = rmsnorm(x);
// QK-norm over the full projection width before RoPE, causal grouped-query attention.
// Tensors [B, S, heads, head_dim] row-major (= [N, Q] and [N, C]); lse [B, H, S] FP32.
// CUDA builds only (MOECORE_HAS_CUDA); no CUDA headers.
// Legend: B batch, S sequence, N = B*S tokens, D model width, H query heads, Q = H*head_dim,
// C = n_kv_heads*head_dim (kv width). BF16 unless noted.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/config.h"
#include "core/recompute.h"
#include "cuda/ops/memory.h"
#include "model/cuda_block.h"
#include "model/cuda_fp8_linear.h"
#include "model/layout.h"

namespace moe {

// What one attention block saves for backward (one per layer). With recomputation some of these
// live in one pool that every layer's block shares (bind(); core/recompute.h says which).
struct CudaAttentionSaved {
  cuda::DeviceBuffer x_ND;                  // input: BF16 copy of the residual stream
  cuda::DeviceBuffer x32_ND;                // full recompute: the FP32 residual stream at the input,
                                            // the only tensor each layer keeps
  cuda::DeviceBuffer norm_ND, rstd_N;       // attn_norm output, its rstd (FP32)
  cuda::DeviceBuffer q_raw_NQ, k_raw_NC;    // projections before QK-norm (qk_norm only)
  cuda::DeviceBuffer q_rstd_N, k_rstd_N;    // QK-norm rstd (FP32, qk_norm only)
  cuda::DeviceBuffer q_NQ, k_NC, v_NC;      // attention inputs (after QK-norm and RoPE)
  cuda::DeviceBuffer attn_NQ, lse_BHS;      // attention output, its log-sum-exp (FP32)
};

// Backward scratch every attention block uses (one per model): dattn [N, Q], dq [N, Q], dk and dv
// [N, C], with QK-norm dq_raw [N, Q] and dk_raw [N, C], and the attention backward's workspace,
// carved from one region: a borrowed one when it is large enough (the MoE layers' backward row
// buffer, which holds nothing between MoE backwards), else its own.
struct CudaAttentionScratch {
  cuda::DeviceBuffer own;
  uint16_t *dattn_NQ = nullptr, *dq_NQ = nullptr, *dk_NC = nullptr, *dv_NC = nullptr;
  uint16_t *dq_raw_NQ = nullptr, *dk_raw_NC = nullptr;
  void* ws_attn = nullptr;
  size_t ws_attn_bytes = 0;
  bool borrowed = false;
};

class CudaAttentionBlock {
 public:
  CudaAttentionBlock(const ModelConfig& m, const LayerParams& p);

  // Where the saved tensors live: all in this block (Recompute::kNone, the default), or the ones
  // the mode recomputes in `pool` (one per model, shared by every layer; it must outlive the
  // block). Call before reserve.
  void bind(Recompute mode, CudaAttentionSaved* pool);
  // Saved activations for batch x seq tokens; scratch: the shared backward buffers, in
  // `borrow` (borrow_bytes, nothing live in it during an attention backward) when it fits, else
  // in s.own. Call it after anything that could reallocate `borrow`.
  void reserve(int64_t batch, int64_t seq, CudaBufferGrower& g);
  static void reserve_scratch(const ModelConfig& m, int64_t batch, int64_t seq, CudaAttentionScratch& s,
                              CudaBufferGrower& g, void* borrow = nullptr, size_t borrow_bytes = 0);

  // Saved input x_ND: the block before writes it (embedding, or the previous layer's MLP / MoE).
  uint16_t* input() const { return slots_.x->as<uint16_t>(); }

  // res.x32 += the branch of the saved input; out_ND = BF16 copy of the new residual (the next
  // block's saved input). Re-running it from the same saved input and res.x32 gives the same bits.
  // Under full recompute it first keeps res.x32 (the layer's FP32 input) in x32_ND, except when
  // `recomputing` (the re-run after restore_residual, whose input is that copy).
  void forward(const CudaBlockContext& c, CudaResidual& res, uint16_t* out_ND, bool recomputing = false);
  // Decoding (CudaModel::decode): the branch for c.tokens() new tokens (batch 1) at positions
  // pos0 .., their keys and values written into rows [pos0, pos0 + n) of k_cache and v_cache
  // ([capacity, C]), attention over rows [0, pos0 + n) (cuda::attention_decode); res.x32 += the
  // branch, out_ND its BF16 copy. The saved activations serve as scratch (nothing for backward).
  void decode(const CudaBlockContext& c, CudaResidual& res, uint16_t* out_ND, uint16_t* k_cache, uint16_t* v_cache,
              int64_t pos0);
  // Full recompute: res.x32 = the FP32 residual this block's forward started from, and the saved
  // input (pooled under full recompute) its BF16 rounding again.
  void restore_residual(const CudaBlockContext& c, CudaResidual& res) const;
  // Selective recompute: the norm output and the q/k/v projections (QK-norm, RoPE) again from the
  // saved input, bitwise as the forward wrote them.
  void recompute_projections(const CudaBlockContext& c);
  // From res.dx (dL/dx of the output residual): parameter gradients +=, res.dx32 += dL/d(input)
  // through the branch, res.dx refreshed.
  void backward(const CudaBlockContext& c, CudaResidual& res, CudaAttentionScratch& s);
  // train.precision = "fp8": the Q/K/V and output projections' forward GEMMs and data gradients
  // in block-scaled FP8 (cuBLASLt, cuda_fp8_linear.h) when D, Q and C are multiples of 128 (else
  // BF16), with the model's FP8 scratch (which must outlive the block); before reserve. The
  // weights' codes: the q/k/v weights as one stacked [Q + 2C, D] matrix (adjacent in the layout)
  // and the output weight [D, Q], rebuilt when c.params_version moves. The data gradient of the
  // input projections is one GEMM over the three gradients' codes side by side along K; weight
  // gradients, QK-norm, RoPE and the attention core stay BF16; decoding runs BF16. fp8(): whether
  // this block runs them in FP8.
  void set_fp8(bool on, CudaFp8Scratch* scratch);
  bool fp8() const { return fp8_; }
  // The FP8 scratch this block needs: activation codes of width (fp8_width) and a weight refresh
  // of (fp8_weight_elems) elements.
  int64_t fp8_width() const { return std::max(d_, q_ + 2 * kv_); }
  int64_t fp8_weight_elems() const { return (q_ + 2 * kv_) * d_; }

 private:
  struct Slots {
    cuda::DeviceBuffer *x, *x32, *norm, *rstd, *q_raw, *k_raw, *q_rstd, *k_rstd, *q, *k, *v, *attn, *lse;
  };
  // Norm, projections, QK-norm and RoPE: the part of forward selective recompute re-runs. pos0 > 0
  // (decoding, batch 1): the rows sit at positions pos0 ...
  void project(const CudaBlockContext& c, int64_t pos0 = 0, bool fp8 = false);
  void refresh_fp8(const CudaBlockContext& c);

  LayerParams p_;
  int64_t d_, hq_, hkv_, hd_, q_, kv_;
  bool qk_norm_;
  double norm_eps_, rope_theta_;
  Recompute mode_ = Recompute::kNone;
  CudaAttentionSaved saved_;
  Slots slots_;
  bool fp8_ = false;
  CudaFp8Weight fp8_qkv_, fp8_o_;
  int64_t fp8_version_ = -1;
  CudaFp8Scratch* fp8_scratch_ = nullptr;
};

}  // namespace moe
