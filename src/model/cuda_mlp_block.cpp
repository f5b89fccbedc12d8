// SwiGLU MLP on cuBLASLt GEMMs and the SwiGLU kernels (forward: gate, up, SwiGLU, down; backward:
// down data and weight gradients, SwiGLU backward, gate and up weight gradients, then the two data
// gradients into dx), and the dense MLP block around it: RMSNorm, MLP, residual add.
// Legend: N = B*S tokens, D model width, F MLP hidden. BF16 unless noted.
#ifdef MOECORE_HAS_CUDA

#include "model/cuda_mlp_block.h"

#include <algorithm>

#include "core/error.h"
#include "cuda/ops/fp8.h"
#include "cuda/ops/gemm.h"
#include "cuda/ops/rmsnorm.h"
#include "cuda/ops/swiglu.h"
#include "model/cuda_fp8_linear.h"

namespace moe {

void CudaMlpScratch::reserve(int64_t n, int64_t f, CudaBufferGrower& g) {
  g.grow<uint16_t>(dh_NF, n * f, "mlp_dh");
  g.grow<uint16_t>(dgate_up_N2F, n * 2 * f, "mlp_dgu");
}

void CudaMlpScratch::reserve_fp8(int64_t n, int64_t d, int64_t f, CudaBufferGrower& g) {
  fp8.reserve(n, std::max(d, 2 * f), 2 * f * d, g);
  g.grow<uint16_t>(fp8_out_ND, n * d, "mlp FP8 output");
}

void CudaFp8MlpWeights::reserve(int64_t d, int64_t f, CudaBufferGrower& g) {
  gu.reserve(2 * f, d, g, "mlp FP8 gate/up codes");
  down.reserve(d, f, g, "mlp FP8 down codes");
}

void CudaFp8MlpWeights::refresh(const CudaBlockContext& c, const uint16_t* w_gate_FD, const uint16_t* w_down_DF,
                                CudaFp8Scratch& scratch) {
  if (version == c.params_version) return;
  gu.quantize(w_gate_FD, scratch, c.stream);
  down.quantize(w_down_DF, scratch, c.stream);
  version = c.params_version;
}

void mlp_forward_fp8(cuda::GemmHandle& g, const CudaFp8MlpWeights& w, int64_t n, int64_t d, int64_t f, uint16_t* gu,
                     uint16_t* h, uint16_t* out, CudaFp8Scratch& sc, cuda::Stream st) {
  MOE_CHECK(fp8_mlp_shapes(d, f) && n % 4 == 0, "mlp_forward_fp8: D (", d, ") and F (", f,
            ") must be multiples of 128 and the tokens (", n, ") of 4");
  fp8_linear(g, sc, w.gu, false, 0, n, 2 * f, d, gu, st);
  cuda::swiglu_forward_fp8(gu, h, sc.q.as<uint8_t>(), sc.s.as<float>(), n, f, st, sc.rule);
  cuda::fp8_scales_k_major(sc.s.as<float>(), n, f / 128, n, sc.s_t.as<float>(), st);
  fp8_linear(g, sc, w.down, false, 0, n, d, f, out, st);
}

void mlp_backward_fp8(cuda::GemmHandle& g, const uint16_t* x, const CudaFp8MlpWeights& w, const uint16_t* gu,
                      const uint16_t* h, const uint16_t* dout, int64_t n, int64_t d, int64_t f, CudaMlpScratch& sc,
                      uint16_t* dx, float* dwg, float* dwu, float* dwd, float dw_beta, cuda::Stream st) {
  uint16_t* dh = sc.dh_NF.as<uint16_t>();
  uint16_t* dgu = sc.dgate_up_N2F.as<uint16_t>();
  CudaFp8Scratch& q8 = sc.fp8;
  fp8_quantize_operand(dout, n, d, q8, st);
  fp8_linear(g, q8, w.down, true, 0, n, f, d, dh, st);  // dh = dout Wd
  cuda::gemm(g, true, false, d, f, n, 1.f, dout, d, h, f, dw_beta, dwd, f, st);
  cuda::swiglu_backward_fp8(gu, dh, dgu, q8.q.as<uint8_t>(), q8.s.as<float>(), n, f, st, q8.rule);
  cuda::fp8_scales_k_major(q8.s.as<float>(), n, 2 * f / 128, n, q8.s_t.as<float>(), st);
  cuda::gemm(g, true, false, f, d, n, 1.f, dgu, 2 * f, x, d, dw_beta, dwg, d, st);
  cuda::gemm(g, true, false, f, d, n, 1.f, dgu + f, 2 * f, x, d, dw_beta, dwu, d, st);
  fp8_linear(g, q8, w.gu, true, 0, n, d, 2 * f, dx, st);  // dx = dgu Wgu
}

void mlp_forward_gpu(cuda::GemmHandle& g, const uint16_t* x, const uint16_t* wg, const uint16_t* wu,
                     const uint16_t* wd, int64_t n, int64_t d, int64_t f, uint16_t* gu, uint16_t* h, uint16_t* out,
                     bool accumulate, cuda::Stream st) {
  cuda::gemm(g, false, true, n, f, d, 1.f, x, d, wg, d, 0.f, gu, 2 * f, st);
  cuda::gemm(g, false, true, n, f, d, 1.f, x, d, wu, d, 0.f, gu + f, 2 * f, st);
  cuda::swiglu_forward(gu, h, n, f, st);
  cuda::gemm(g, false, true, n, d, f, 1.f, h, f, wd, f, accumulate ? 1.f : 0.f, out, d, st);
}

void mlp_recompute_h_gpu(const uint16_t* gu, uint16_t* h, int64_t n, int64_t f, cuda::Stream st) {
  cuda::swiglu_forward(gu, h, n, f, st);
}

void mlp_backward_gpu(cuda::GemmHandle& g, const uint16_t* x, const uint16_t* wg, const uint16_t* wu,
                      const uint16_t* wd, const uint16_t* gu, const uint16_t* h, const uint16_t* dout, int64_t n,
                      int64_t d, int64_t f, CudaMlpScratch& scratch, uint16_t* dx, bool accumulate_dx, float* dwg,
                      float* dwu, float* dwd, float dw_beta, cuda::Stream st) {
  uint16_t* dh = scratch.dh_NF.as<uint16_t>();
  uint16_t* dgu = scratch.dgate_up_N2F.as<uint16_t>();
  cuda::gemm(g, false, false, n, f, d, 1.f, dout, d, wd, f, 0.f, dh, f, st);
  cuda::gemm(g, true, false, d, f, n, 1.f, dout, d, h, f, dw_beta, dwd, f, st);
  cuda::swiglu_backward(gu, dh, dgu, n, f, st);
  cuda::gemm(g, true, false, f, d, n, 1.f, dgu, 2 * f, x, d, dw_beta, dwg, d, st);
  cuda::gemm(g, true, false, f, d, n, 1.f, dgu + f, 2 * f, x, d, dw_beta, dwu, d, st);
  cuda::gemm(g, false, false, n, d, f, 1.f, dgu, 2 * f, wg, d, accumulate_dx ? 1.f : 0.f, dx, d, st);
  cuda::gemm(g, false, false, n, d, f, 1.f, dgu + f, 2 * f, wu, d, 1.f, dx, d, st);
}

CudaMlpBlock::CudaMlpBlock(const ModelConfig& m, const LayerParams& p)
    : p_(p), d_(m.d_model), norm_eps_(m.norm_eps) {
  bind(Recompute::kNone, nullptr);
}

void CudaMlpBlock::bind(Recompute mode, CudaMlpBlockSaved* pool) {
  const CudaSavedSlots<CudaMlpBlockSaved> at("CudaMlpBlock::bind", mode, saved_, pool);
  const bool sel = mode != Recompute::kNone, full = mode == Recompute::kFull;
  slots_.x = at(&CudaMlpBlockSaved::x_ND, full);
  slots_.norm = at(&CudaMlpBlockSaved::norm_ND, sel);
  slots_.rstd = at(&CudaMlpBlockSaved::rstd_N, full);
  slots_.gate_up = at(&CudaMlpBlockSaved::gate_up_N2F, full);
  slots_.h = at(&CudaMlpBlockSaved::h_NF, sel);
}

void CudaMlpBlock::set_fp8(bool on, CudaMlpScratch* scratch) {
  fp8_ = on && fp8_mlp_shapes(d_, p_.mlp_hidden);
  fp8_scratch_ = fp8_ ? scratch : nullptr;
  MOE_CHECK(!fp8_ || scratch != nullptr, "CudaMlpBlock::set_fp8: the FP8 MLP needs the model's MLP scratch");
  MOE_CHECK(!fp8_ || p_.mlp_up == p_.mlp_gate + p_.mlp_hidden * d_, "CudaMlpBlock::set_fp8: the FP8 MLP reads the "
            "gate and up weights as one [2F, D] matrix, but the layout does not keep them adjacent");
}

void CudaMlpBlock::reserve(int64_t batch, int64_t seq, CudaBufferGrower& g) {
  const int64_t n = batch * seq, d = d_, f = p_.mlp_hidden;
  if (fp8_) fp8_w_.reserve(d, f, g);
  g.grow<uint16_t>(*slots_.x, n * d, "x_mid");
  g.grow<uint16_t>(*slots_.norm, n * d, "norm2");
  g.grow<float>(*slots_.rstd, n, "rstd2");
  g.grow<uint16_t>(*slots_.gate_up, n * 2 * f, "mlp_gate_up");
  g.grow<uint16_t>(*slots_.h, n * f, "mlp_h");
}

void CudaMlpBlock::forward(const CudaBlockContext& c, CudaResidual& res, uint16_t* out_ND) {
  const cuda::Stream st = c.stream;
  const uint16_t* P = c.params;
  const int64_t n = c.tokens(), d = d_;
  const Slots& s = slots_;
  c.mark(cuda::Phase::kMlp);
  uint16_t* norm = s.norm->as<uint16_t>();
  uint16_t* branch = res.branch();
  if (fp8_) {
    // The norm writes its output's codes for the gate/up GEMM.
    CudaFp8Scratch& sc = fp8_scratch_->fp8;
    fp8_w_.refresh(c, P + p_.mlp_gate, P + p_.mlp_down, sc);
    fp8_rmsnorm_operand(s.x->as<uint16_t>(), P + p_.mlp_norm, norm, s.rstd->as<float>(), n, d, norm_eps_, sc, st);
    mlp_forward_fp8(*c.gemm, fp8_w_, n, d, p_.mlp_hidden, s.gate_up->as<uint16_t>(), s.h->as<uint16_t>(), branch,
                    sc, st);
  } else {
    cuda::rmsnorm_forward(s.x->as<uint16_t>(), P + p_.mlp_norm, norm, s.rstd->as<float>(), n, d, norm_eps_, st);
    mlp_forward_gpu(*c.gemm, norm, P + p_.mlp_gate, P + p_.mlp_up, P + p_.mlp_down, n, d, p_.mlp_hidden,
                    s.gate_up->as<uint16_t>(), s.h->as<uint16_t>(), branch, false, st);
  }
  cuda::residual_add(res.x32(), branch, out_ND, n * d, st);
}

void CudaMlpBlock::recompute_selective(const CudaBlockContext& c) {
  const Slots& s = slots_;
  const int64_t n = c.tokens();
  cuda::rmsnorm_forward(s.x->as<uint16_t>(), c.params + p_.mlp_norm, s.norm->as<uint16_t>(), s.rstd->as<float>(), n,
                        d_, norm_eps_, c.stream);
  mlp_recompute_h_gpu(s.gate_up->as<uint16_t>(), s.h->as<uint16_t>(), n, p_.mlp_hidden, c.stream);
}

void CudaMlpBlock::backward(const CudaBlockContext& c, CudaResidual& res, CudaMlpScratch& w) {
  const cuda::Stream st = c.stream;
  const uint16_t* P = c.params;
  float* Gr = c.grads;
  const int64_t n = c.tokens(), d = d_;
  const Slots& s = slots_;
  uint16_t* dbranch = res.dbranch();
  c.mark(cuda::Phase::kMlp);
  if (fp8_) {
    mlp_backward_fp8(*c.gemm, s.norm->as<uint16_t>(), fp8_w_, s.gate_up->as<uint16_t>(), s.h->as<uint16_t>(), res.dx(),
                     n, d, p_.mlp_hidden, w, dbranch, Gr + p_.mlp_gate, Gr + p_.mlp_up, Gr + p_.mlp_down,
                     c.wgrad_beta(), st);
  } else {
    mlp_backward_gpu(*c.gemm, s.norm->as<uint16_t>(), P + p_.mlp_gate, P + p_.mlp_up, P + p_.mlp_down,
                     s.gate_up->as<uint16_t>(), s.h->as<uint16_t>(), res.dx(), n, d, p_.mlp_hidden, w, dbranch, false,
                     Gr + p_.mlp_gate, Gr + p_.mlp_up, Gr + p_.mlp_down, c.wgrad_beta(), st);
  }
  cuda::rmsnorm_backward_add(s.x->as<uint16_t>(), P + p_.mlp_norm, s.rstd->as<float>(), dbranch, res.dx32(), res.dx(),
                             Gr + p_.mlp_norm, n, d, res.ws_rms.data(), res.ws_rms.bytes(), st);
}

}  // namespace moe

#endif  // MOECORE_HAS_CUDA
