// The SwiGLU MLP on the GPU (mlp.h's math: out = (silu(x Wg^T) * (x Wu^T)) Wd^T, weights [F, D],
// [F, D], [D, F]; the gate and up GEMMs write the halves of one [N, 2F] buffer, gate first), used
// by the dense MLP block below and by the MoE layer's shared expert; and the dense MLP block:
// x += MLP(rmsnorm(x)). CUDA builds only (MOECORE_HAS_CUDA); no CUDA headers.
// Legend: B batch, S sequence, N = B*S tokens, D model width, F dense / shared MLP hidden. BF16
// unless noted.
#pragma once

#include <cstdint>

#include "core/config.h"
#include "core/fp8_types.h"
#include "core/recompute.h"
#include "cuda/device.h"
#include "cuda/ops/memory.h"
#include "model/cuda_block.h"
#include "model/cuda_fp8_linear.h"
#include "model/layout.h"

namespace moe {

// Backward scratch of every MLP (one per model, sized for the widest F); under the FP8 recipe also
// the model's FP8 activation operand (cuda_fp8_linear.h; the MLPs need [N, max(D, 2F)], the
// attention projections grow it to theirs) and an [N, D] output for an MLP whose output adds onto
// another (the shared expert).
struct CudaMlpScratch {
  cuda::DeviceBuffer dh_NF, dgate_up_N2F;
  CudaFp8Scratch fp8;
  cuda::DeviceBuffer fp8_out_ND;
  void reserve(int64_t n, int64_t f, CudaBufferGrower& g);
  // The FP8 buffers for N tokens of width D and hidden F (grows only).
  void reserve_fp8(int64_t n, int64_t d, int64_t f, CudaBufferGrower& g);
};

// The FP8 recipe of an MLP (train.precision = "fp8"), where D and F are multiples of 128
// (fp8_mlp_shapes, core/fp8_types.h): the gate and up weights as one stacked [2F, D] matrix
// (they are adjacent in the layout) and the down weight [D, F], each a CudaFp8Weight (E4M3 codes
// in 128 x 128 blocks with the transposed copy the data gradient reads). Rebuilt from the BF16
// copy when c.params_version moves (refresh, on c.stream). The forward GEMMs (gate/up, down) and the data
// gradients (dh, dx) run on cuBLASLt's block-scaled FP8 (cuda::fp8_gemm) with the activations and
// gradients quantised in 1 x 128 blocks (h and dgate_up by the SwiGLU kernels that write them); the
// weight gradients stay BF16.
struct CudaFp8MlpWeights {
  CudaFp8Weight gu, down;
  int64_t version = -1;
  void reserve(int64_t d, int64_t f, CudaBufferGrower& g);
  // w_gate_FD: the gate weight, the up weight right after it (checked by the caller's layout).
  void refresh(const CudaBlockContext& c, const uint16_t* w_gate_FD, const uint16_t* w_down_DF,
               CudaFp8Scratch& scratch);
};
// mlp_forward_gpu in FP8 on the input whose codes and scales the scratch holds (fp8_rmsnorm_operand
// wrote them with the norm): out_ND overwritten (no accumulate), gate_up_N2F and h_NF saved in BF16.
void mlp_forward_fp8(cuda::GemmHandle& g, const CudaFp8MlpWeights& w, int64_t n, int64_t d, int64_t f,
                     uint16_t* gate_up_N2F, uint16_t* h_NF, uint16_t* out_ND, CudaFp8Scratch& scratch,
                     cuda::Stream st);
// mlp_backward_gpu in FP8: dx_ND overwritten; the weight gradients as mlp_backward_gpu's (BF16 GEMMs).
void mlp_backward_fp8(cuda::GemmHandle& g, const uint16_t* x_ND, const CudaFp8MlpWeights& w,
                      const uint16_t* gate_up_N2F, const uint16_t* h_NF, const uint16_t* dout_ND, int64_t n, int64_t d,
                      int64_t f, CudaMlpScratch& scratch, uint16_t* dx_ND, float* dw_gate, float* dw_up, float* dw_down,
                      float dw_beta, cuda::Stream st);

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
  // train.precision = "fp8": the MLP's GEMMs in FP8 when fp8_mlp_shapes(D, F) (else BF16), with
  // the model's MLP scratch (which must outlive the block); before reserve. fp8(): whether this
  // block runs them in FP8.
  void set_fp8(bool on, CudaMlpScratch* scratch);
  bool fp8() const { return fp8_; }

 private:
  struct Slots {
    cuda::DeviceBuffer *x, *norm, *rstd, *gate_up, *h;
  };
  LayerParams p_;
  int64_t d_;
  double norm_eps_;
  CudaMlpBlockSaved saved_;
  Slots slots_;
  bool fp8_ = false;
  CudaFp8MlpWeights fp8_w_;
  CudaMlpScratch* fp8_scratch_ = nullptr;
};

}  // namespace moe
