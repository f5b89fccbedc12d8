// The SwiGLU MLP on the GPU (mlp.h's math: out = (silu(x Wg^T) * (x Wu^T)) Wd^T, weights [F, D],
// [F, D], [D, F]; the gate and up GEMMs write the halves of one [N, 2F] buffer, gate first), used
// by the dense MLP block below and by the MoE layer's shared expert; and the dense MLP block:
// x += MLP(rmsnorm(x)). CUDA builds only (MOECORE_HAS_CUDA); no CUDA headers.
// Legend: B batch, S sequence, N = B*S tokens, D model width, F dense / shared MLP hidden. BF16
// unless noted.
#pragma once

#include <cstdint>

#include "core/config.h"
#include "core/recompute.h"
#include "cuda/device.h"
#include "cuda/ops/memory.h"
#include "model/cuda_block.h"
#include "model/layout.h"

namespace moe {

// Backward scratch of every MLP (one per model, sized for the widest F).
struct CudaMlpScratch {
  cuda::DeviceBuffer dh_NF, dgate_up_N2F;
  void reserve(int64_t n, int64_t f, CudaBufferGrower& g);
};

// out_ND = MLP(x_ND) (+= when accumulate), saving gate_up_N2F and h_NF for backward.
void mlp_forward_gpu(cuda::GemmHandle& g, const uint16_t* x_ND, const uint16_t* w_gate_FD, const uint16_t* w_up_FD,
                     const uint16_t* w_down_DF, int64_t n, int64_t d, int64_t f, uint16_t* gate_up_N2F,
                     uint16_t* h_NF, uint16_t* out_ND, bool accumulate, cuda::Stream st);
// Selective recompute: h_NF = SwiGLU(gate_up_N2F) again, bitwise as the forward wrote it.
void mlp_recompute_h_gpu(const uint16_t* gate_up_N2F, uint16_t* h_NF, int64_t n, int64_t f, cuda::Stream st);

// dx_ND (overwritten unless accumulate_dx) and the weight gradients (FP32, dw = dw_beta * dw + the
// gradient: 1 accumulates, 0 writes) from dout_ND.
void mlp_backward_gpu(cuda::GemmHandle& g, const uint16_t* x_ND, const uint16_t* w_gate_FD, const uint16_t* w_up_FD,
                      const uint16_t* w_down_DF, const uint16_t* gate_up_N2F, const uint16_t* h_NF,
                      const uint16_t* dout_ND, int64_t n, int64_t d, int64_t f, CudaMlpScratch& scratch,
                      uint16_t* dx_ND, bool accumulate_dx, float* dw_gate, float* dw_up, float* dw_down,
                      float dw_beta, cuda::Stream st);

// What a dense MLP block saves (one per dense layer; with recomputation some of it in one pool
// that every dense block shares: bind()).
struct CudaMlpBlockSaved {
  cuda::DeviceBuffer x_ND;             // input: BF16 copy of the residual stream
  cuda::DeviceBuffer norm_ND, rstd_N;  // mlp_norm output, its rstd (FP32)
  cuda::DeviceBuffer gate_up_N2F, h_NF;
};

// Dense layer's MLP block: res.x32 += MLP(rmsnorm(x)).
class CudaMlpBlock {
 public:
  CudaMlpBlock(const ModelConfig& m, const LayerParams& p);

  // As CudaAttentionBlock::bind: selective pools the norm output and h, full everything.
  void bind(Recompute mode, CudaMlpBlockSaved* pool);
  void reserve(int64_t batch, int64_t seq, CudaBufferGrower& g);
  // Saved input: written by the attention block before it.
  uint16_t* input() const { return slots_.x->as<uint16_t>(); }
  int64_t hidden() const { return p_.mlp_hidden; }

  // As CudaAttentionBlock::forward / backward.
  void forward(const CudaBlockContext& c, CudaResidual& res, uint16_t* out_ND);
  // Selective recompute: the norm output and h again from the saved input and gate/up output.
  void recompute_selective(const CudaBlockContext& c);
  void backward(const CudaBlockContext& c, CudaResidual& res, CudaMlpScratch& s);

 private:
  struct Slots {
    cuda::DeviceBuffer *x, *norm, *rstd, *gate_up, *h;
  };
  LayerParams p_;
  int64_t d_;
  double norm_eps_;
  CudaMlpBlockSaved saved_;
  Slots slots_;
};

}  // namespace moe
