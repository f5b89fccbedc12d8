// CudaLmHead: final RMSNorm, then per chunk of rows the head GEMM and the fused cross-entropy
// (forward: losses only; backward: logits again, CE gradient in place, dnorm and dW_head GEMMs;
// fused: the forward does the backward's chunk work at once), then the final norm's backward into
// a fresh residual gradient.
// Legend: N = B*S tokens, D model width, V vocabulary. BF16 unless noted.
#ifdef MOECORE_HAS_CUDA

#include "model/cuda_lm_head.h"

#include <algorithm>

#include "cuda/ops/cross_entropy.h"
#include "cuda/ops/gemm.h"
#include "cuda/ops/rmsnorm.h"

namespace moe {

CudaLmHead::CudaLmHead(const ModelConfig& m, int64_t norm, int64_t head, int64_t chunk_rows)
    : d_(m.d_model), v_(m.vocab_size), norm_(norm), head_(head), chunk_rows_(chunk_rows), norm_eps_(m.norm_eps) {}

void CudaLmHead::reserve(int64_t batch, int64_t seq, CudaBufferGrower& g) {
  const int64_t n = batch * seq, d = d_, v = v_;
  const int64_t chunk = std::min(n, chunk_rows_);
  g.grow<uint16_t>(saved_.x_ND, n * d, "final_in");
  g.grow<uint16_t>(saved_.norm_ND, n * d, "final_norm");
  g.grow<float>(saved_.rstd_N, n, "final_rstd");
  g.grow<uint16_t>(logits_chunk_, chunk * v, "logits_chunk");
  g.grow<float>(saved_.loss_N, n, "loss");
  g.grow<float>(saved_.lse_N, n, "lse");
  g.grow<uint16_t>(dnorm_ND_, n * d, "dnorm");
}

void CudaLmHead::chunk_backward(const CudaBlockContext& c, int64_t r0, int64_t rows, const int32_t* targets,
                                const float* ce_scale, double* ce_sum, uint32_t* bad_targets) {
  const cuda::Stream st = c.stream;
  cuda::GemmHandle& G = *c.gemm;
  const uint16_t* P = c.params;
  const int64_t d = d_, v = v_;
  const uint16_t* fnorm = saved_.norm_ND.as<uint16_t>();
  uint16_t* lg = logits_chunk_.as<uint16_t>();
  cuda::gemm(G, false, true, rows, v, d, 1.f, fnorm + r0 * d, d, P + head_, d, 0.f, lg, v, st);
  cuda::cross_entropy_forward_backward(lg, lg, targets + r0, saved_.loss_N.as<float>() + r0,
                                       saved_.lse_N.as<float>() + r0, rows, v, 0.0, ce_scale, ce_sum, bad_targets, st);
  cuda::gemm(G, false, false, rows, d, v, 1.f, lg, v, P + head_, d, 0.f, dnorm_ND_.as<uint16_t>() + r0 * d, d, st);
  cuda::gemm(G, true, false, v, d, rows, 1.f, lg, v, fnorm + r0 * d, d, r0 == 0 ? c.wgrad_beta() : 1.f,
             c.grads + head_, d, st);
}

void CudaLmHead::forward(const CudaBlockContext& c, const int32_t* targets, const float* grad_one, double* ce_sum,
                         uint32_t* bad_targets, const float* fused_ce_scale) {
  const cuda::Stream st = c.stream;
  cuda::GemmHandle& G = *c.gemm;
  const uint16_t* P = c.params;
  const int64_t n = c.tokens(), d = d_, v = v_;
  c.mark(cuda::Phase::kLmHead);
  uint16_t* fnorm = saved_.norm_ND.as<uint16_t>();
  cuda::rmsnorm_forward(saved_.x_ND.as<uint16_t>(), P + norm_, fnorm, saved_.rstd_N.as<float>(), n, d, norm_eps_, st);
  const int64_t chunk = std::min(n, chunk_rows_);
  uint16_t* lg = logits_chunk_.as<uint16_t>();
  float* loss = saved_.loss_N.as<float>();
  float* lse = saved_.lse_N.as<float>();
  fused_ = fused_ce_scale != nullptr;
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t rows = std::min(chunk, n - r0);
    if (fused_) {
      chunk_backward(c, r0, rows, targets, fused_ce_scale, ce_sum, bad_targets);
      continue;
    }
    cuda::gemm(G, false, true, rows, v, d, 1.f, fnorm + r0 * d, d, P + head_, d, 0.f, lg, v, st);
    cuda::cross_entropy_forward_backward(lg, lg, targets + r0, loss + r0, lse + r0, rows, v, 0.0, grad_one, ce_sum,
                                         bad_targets, st);
  }
}

void CudaLmHead::backward(const CudaBlockContext& c, const int32_t* targets, const float* ce_scale,
                          uint32_t* bad_targets, CudaResidual& res) {
  const cuda::Stream st = c.stream;
  const uint16_t* P = c.params;
  float* Gr = c.grads;
  const int64_t n = c.tokens(), d = d_;
  c.mark(cuda::Phase::kLmHead);
  uint16_t* dnorm = dnorm_ND_.as<uint16_t>();
  const int64_t chunk = std::min(n, chunk_rows_);
  if (!fused_) {
    for (int64_t r0 = 0; r0 < n; r0 += chunk)
      chunk_backward(c, r0, std::min(chunk, n - r0), targets, ce_scale, nullptr, bad_targets);
  }
  fused_ = false;
  // The residual gradient starts here: dx32 = 0 + bf16(dx) (and its BF16 copy), dx added as the
  // norm's backward computes it.
  float* dx32 = res.dx32();
  cuda::device_memset(dx32, 0, n * d * sizeof(float), st);
  cuda::rmsnorm_backward_add(saved_.x_ND.as<uint16_t>(), P + norm_, saved_.rstd_N.as<float>(), dnorm, dx32, res.dx(),
                             Gr + norm_, n, d, res.ws_rms.data(), res.ws_rms.bytes(), st);
}

}  // namespace moe

#endif  // MOECORE_HAS_CUDA
