// CudaAttentionBlock: RMSNorm, Q/K/V projections (cuBLASLt, weights [out, in]), optional QK-norm,
// RoPE, causal GQA attention, output projection and the residual add, then the same in reverse.
// The Q/K/V weight gradients accumulate after the three data gradients into dbranch. Under
// train.precision = "fp8" the projections' forward GEMMs and data gradients run in block-scaled FP8.
// Legend: N = B*S tokens, D model width, Q = H*head_dim, C = n_kv_heads*head_dim. BF16 unless noted.
#ifdef MOECORE_HAS_CUDA

#include "model/cuda_attention_block.h"

#include <cstdint>

#include "core/error.h"
#include "core/fp8_types.h"
#include "cuda/ops/attention.h"
#include "cuda/ops/gemm.h"
#include "cuda/ops/rmsnorm.h"
#include "cuda/ops/rope.h"

namespace moe {

CudaAttentionBlock::CudaAttentionBlock(const ModelConfig& m, const LayerParams& p)
    : p_(p),
      d_(m.d_model),
      hq_(m.n_heads),
      hkv_(m.n_kv_heads),
      hd_(m.head_dim()),
      q_(m.n_heads * m.head_dim()),
      kv_(m.n_kv_heads * m.head_dim()),
      qk_norm_(m.qk_norm),
      norm_eps_(m.norm_eps),
      rope_theta_(m.rope_theta) {
  bind(Recompute::kNone, nullptr);
}

void CudaAttentionBlock::bind(Recompute mode, CudaAttentionSaved* pool) {
  const CudaSavedSlots<CudaAttentionSaved> at("CudaAttentionBlock::bind", mode, saved_, pool);
  mode_ = mode;
  CudaAttentionSaved& own = saved_;
  // selective: norm and projections pooled; full: everything but the FP32 copy of the input (its
  // BF16 copy is that copy rounded, as every residual add writes it: restore_residual redoes it).
  const bool sel = mode != Recompute::kNone, full = mode == Recompute::kFull;
  Slots& s = slots_;
  s.x = at(&CudaAttentionSaved::x_ND, full);
  s.x32 = &own.x32_ND;
  s.norm = at(&CudaAttentionSaved::norm_ND, sel);
  s.rstd = at(&CudaAttentionSaved::rstd_N, full);
  s.q_raw = at(&CudaAttentionSaved::q_raw_NQ, sel);
  s.k_raw = at(&CudaAttentionSaved::k_raw_NC, sel);
  s.q_rstd = at(&CudaAttentionSaved::q_rstd_N, full);
  s.k_rstd = at(&CudaAttentionSaved::k_rstd_N, full);
  s.q = at(&CudaAttentionSaved::q_NQ, sel);
  s.k = at(&CudaAttentionSaved::k_NC, sel);
  s.v = at(&CudaAttentionSaved::v_NC, sel);
  s.attn = at(&CudaAttentionSaved::attn_NQ, full);
  s.lse = at(&CudaAttentionSaved::lse_BHS, full);
}

void CudaAttentionBlock::set_fp8(bool on, CudaFp8Scratch* scratch) {
  fp8_ = on && fp8_mlp_shapes(d_, q_) && kv_ % 128 == 0;
  fp8_scratch_ = fp8_ ? scratch : nullptr;
  MOE_CHECK(!fp8_ || scratch != nullptr, "CudaAttentionBlock::set_fp8: the FP8 projections need the model's FP8 "
            "scratch");
  MOE_CHECK(!fp8_ || (p_.k_proj == p_.q_proj + q_ * d_ && p_.v_proj == p_.k_proj + kv_ * d_),
            "CudaAttentionBlock::set_fp8: the FP8 projections read the q, k and v weights as one [Q + 2C, D] "
            "matrix, but the layout does not keep them adjacent");
  fp8_version_ = -1;
}

void CudaAttentionBlock::refresh_fp8(const CudaBlockContext& c) {
  if (fp8_version_ == c.params_version) return;
  fp8_qkv_.quantize(c.params + p_.q_proj, *fp8_scratch_, c.stream);
  fp8_o_.quantize(c.params + p_.o_proj, *fp8_scratch_, c.stream);
  fp8_version_ = c.params_version;
}

void CudaAttentionBlock::reserve(int64_t batch, int64_t seq, CudaBufferGrower& g) {
  const int64_t n = batch * seq, d = d_, q = q_, kv = kv_;
  const Slots& s = slots_;
  if (fp8_) {
    fp8_qkv_.reserve(q + 2 * kv, d, g, "attention FP8 q/k/v weight codes");
    fp8_o_.reserve(d, q, g, "attention FP8 output weight codes");
  }
  g.grow<uint16_t>(*s.x, n * d, "x_in");
  if (mode_ == Recompute::kFull) g.grow<float>(*s.x32, n * d, "x32_in");
  g.grow<uint16_t>(*s.norm, n * d, "norm1");
  g.grow<float>(*s.rstd, n, "rstd1");
  g.grow<uint16_t>(*s.q, n * q, "q");
  g.grow<uint16_t>(*s.k, n * kv, "k");
  g.grow<uint16_t>(*s.v, n * kv, "v");
  if (qk_norm_) {
    g.grow<uint16_t>(*s.q_raw, n * q, "q_raw");
    g.grow<uint16_t>(*s.k_raw, n * kv, "k_raw");
    g.grow<float>(*s.q_rstd, n, "q_rstd");
    g.grow<float>(*s.k_rstd, n, "k_rstd");
  }
  g.grow<uint16_t>(*s.attn, n * q, "attn");
  g.grow<float>(*s.lse, batch * hq_ * seq, "lse");
}

void CudaAttentionBlock::reserve_scratch(const ModelConfig& m, int64_t batch, int64_t seq, CudaAttentionScratch& s,
                                         CudaBufferGrower& g, void* borrow, size_t borrow_bytes) {
  const int64_t n = batch * seq, hd = m.head_dim(), q = m.n_heads * hd, kv = m.n_kv_heads * hd;
  constexpr size_t kAlign = 256;
  auto up = [](size_t b) { return (b + kAlign - 1) / kAlign * kAlign; };
  const size_t bq = up(size_t(n * q) * 2), bkv = up(size_t(n * kv) * 2);
  const size_t ws = up(cuda::attention_backward_workspace_bytes(batch, seq, m.n_heads));
  const size_t total = 2 * bq + 2 * bkv + (m.qk_norm ? bq + bkv : 0) + ws;
  s.borrowed = borrow != nullptr && borrow_bytes >= total && reinterpret_cast<uintptr_t>(borrow) % kAlign == 0;
  if (!s.borrowed) g.grow_bytes(s.own, total, "attention backward scratch");
  char* p = static_cast<char*>(s.borrowed ? borrow : s.own.data());
  auto take = [&](size_t b) {
    char* at = p;
    p += b;
    return at;
  };
  s.dattn_NQ = reinterpret_cast<uint16_t*>(take(bq));
  s.dq_NQ = reinterpret_cast<uint16_t*>(take(bq));
  s.dk_NC = reinterpret_cast<uint16_t*>(take(bkv));
  s.dv_NC = reinterpret_cast<uint16_t*>(take(bkv));
  s.dq_raw_NQ = m.qk_norm ? reinterpret_cast<uint16_t*>(take(bq)) : nullptr;
  s.dk_raw_NC = m.qk_norm ? reinterpret_cast<uint16_t*>(take(bkv)) : nullptr;
  s.ws_attn = take(ws);
  s.ws_attn_bytes = ws;
}

void CudaAttentionBlock::project(const CudaBlockContext& c, int64_t pos0, bool fp8) {
  const cuda::Stream st = c.stream;
  cuda::GemmHandle& G = *c.gemm;
  const uint16_t* P = c.params;
  const int64_t batch = c.batch, seq = c.seq, n = c.tokens();
  const int64_t d = d_, hq = hq_, hkv = hkv_, hd = hd_, q = q_, kv = kv_;
  MOE_CHECK(pos0 == 0 || batch == 1, "CudaAttentionBlock: rows at a position offset are one sequence, got batch ",
            batch);
  const Slots& s = slots_;
  const uint16_t* x = s.x->as<uint16_t>();
  uint16_t* norm = s.norm->as<uint16_t>();
  uint16_t* qb = s.q->as<uint16_t>();
  uint16_t* kb = s.k->as<uint16_t>();
  uint16_t* vb = s.v->as<uint16_t>();
  if (fp8) {
    // The norm writes its output's codes (one quantisation), three GEMMs on the row blocks of the
    // stacked weight.
    CudaFp8Scratch& sc = *fp8_scratch_;
    refresh_fp8(c);
    fp8_rmsnorm_operand(x, P + p_.attn_norm, norm, s.rstd->as<float>(), n, d, norm_eps_, sc, st);
    fp8_linear(G, sc, fp8_qkv_, false, 0, n, q, d, qk_norm_ ? s.q_raw->as<uint16_t>() : qb, st);
    fp8_linear(G, sc, fp8_qkv_, false, q, n, kv, d, qk_norm_ ? s.k_raw->as<uint16_t>() : kb, st);
    fp8_linear(G, sc, fp8_qkv_, false, q + kv, n, kv, d, vb, st);
  } else {
    cuda::rmsnorm_forward(x, P + p_.attn_norm, norm, s.rstd->as<float>(), n, d, norm_eps_, st);
    cuda::gemm(G, false, true, n, q, d, 1.f, norm, d, P + p_.q_proj, d, 0.f, qk_norm_ ? s.q_raw->as<uint16_t>() : qb,
               q, st);
    cuda::gemm(G, false, true, n, kv, d, 1.f, norm, d, P + p_.k_proj, d, 0.f, qk_norm_ ? s.k_raw->as<uint16_t>() : kb,
               kv, st);
    cuda::gemm(G, false, true, n, kv, d, 1.f, norm, d, P + p_.v_proj, d, 0.f, vb, kv, st);
  }
  if (qk_norm_) {
    // QK-norm and RoPE in one pass over q and k (the same bits as the norm, then the rotation).
    cuda::rmsnorm_rope_forward(s.q_raw->as<uint16_t>(), P + p_.q_norm, qb, s.q_rstd->as<float>(), batch, seq, pos0, hq,
                               hd, norm_eps_, rope_theta_, st);
    cuda::rmsnorm_rope_forward(s.k_raw->as<uint16_t>(), P + p_.k_norm, kb, s.k_rstd->as<float>(), batch, seq, pos0,
                               hkv, hd, norm_eps_, rope_theta_, st);
  } else if (pos0 == 0) {
    cuda::rope_forward(qb, batch, seq, hq, hd, rope_theta_, st);
    cuda::rope_forward(kb, batch, seq, hkv, hd, rope_theta_, st);
  } else {
    cuda::rope_forward_at(qb, n, pos0, hq, hd, rope_theta_, st);
    cuda::rope_forward_at(kb, n, pos0, hkv, hd, rope_theta_, st);
  }
}

void CudaAttentionBlock::forward(const CudaBlockContext& c, CudaResidual& res, uint16_t* out_ND, bool recomputing) {
  const cuda::Stream st = c.stream;
  const int64_t batch = c.batch, seq = c.seq, n = c.tokens();
  const int64_t d = d_, hq = hq_, hkv = hkv_, hd = hd_, q = q_;
  const Slots& s = slots_;
  c.mark(cuda::Phase::kAttention);
  if (mode_ == Recompute::kFull && !recomputing) cuda::copy_d2d(s.x32->data(), res.x32(), size_t(n * d) * sizeof(float), st);
  project(c, 0, fp8_);
  uint16_t* attn = s.attn->as<uint16_t>();
  cuda::attention_forward(s.q->as<uint16_t>(), s.k->as<uint16_t>(), s.v->as<uint16_t>(), attn, s.lse->as<float>(),
                          batch, seq, hq, hkv, hd, st);
  uint16_t* branch = res.branch();
  if (fp8_) {
    fp8_quantize_operand(attn, n, q, *fp8_scratch_, st);
    fp8_linear(*c.gemm, *fp8_scratch_, fp8_o_, false, 0, n, d, q, branch, st);
  } else {
    cuda::gemm(*c.gemm, false, true, n, d, q, 1.f, attn, q, c.params + p_.o_proj, q, 0.f, branch, d, st);
  }
  cuda::residual_add(res.x32(), branch, out_ND, n * d, st);
}

void CudaAttentionBlock::decode(const CudaBlockContext& c, CudaResidual& res, uint16_t* out_ND, uint16_t* k_cache,
                                uint16_t* v_cache, int64_t pos0) {
  MOE_CHECK(c.batch == 1 && pos0 >= 0, "CudaAttentionBlock::decode: expected one sequence at a position >= 0, got "
            "batch ", c.batch, " pos0 ", pos0);
  const cuda::Stream st = c.stream;
  const int64_t n = c.tokens(), d = d_, q = q_, kv = kv_;
  const Slots& s = slots_;
  project(c, pos0);
  const size_t rows_bytes = size_t(n * kv) * sizeof(uint16_t);
  cuda::copy_d2d(k_cache + pos0 * kv, s.k->data(), rows_bytes, st);
  cuda::copy_d2d(v_cache + pos0 * kv, s.v->data(), rows_bytes, st);
  uint16_t* attn = s.attn->as<uint16_t>();
  cuda::attention_decode(s.q->as<uint16_t>(), k_cache, v_cache, attn, n, pos0, hq_, hkv_, hd_, st);
  uint16_t* branch = res.branch();
  cuda::gemm(*c.gemm, false, true, n, d, q, 1.f, attn, q, c.params + p_.o_proj, q, 0.f, branch, d, st);
  cuda::residual_add(res.x32(), branch, out_ND, n * d, st);
}

void CudaAttentionBlock::restore_residual(const CudaBlockContext& c, CudaResidual& res) const {
  MOE_CHECK(mode_ == Recompute::kFull, "CudaAttentionBlock::restore_residual: only under full recompute");
  const int64_t nd = c.tokens() * d_;
  cuda::copy_d2d(res.x32(), slots_.x32->data(), size_t(nd) * sizeof(float), c.stream);
  cuda::cast_f32_to_bf16(slots_.x32->as<float>(), slots_.x->as<uint16_t>(), nd, c.stream);
}

void CudaAttentionBlock::recompute_projections(const CudaBlockContext& c) { project(c, 0, fp8_); }

void CudaAttentionBlock::backward(const CudaBlockContext& c, CudaResidual& res, CudaAttentionScratch& w) {
  const cuda::Stream st = c.stream;
  cuda::GemmHandle& G = *c.gemm;
  const uint16_t* P = c.params;
  float* Gr = c.grads;
  const int64_t batch = c.batch, seq = c.seq, n = c.tokens();
  const int64_t d = d_, hq = hq_, hkv = hkv_, hd = hd_, q = q_, kv = kv_;
  const Slots& s = slots_;
  const uint16_t* dx = res.dx();
  uint16_t* dbranch = res.dbranch();
  uint16_t* dq = w.dq_NQ;
  uint16_t* dk = w.dk_NC;
  uint16_t* dv = w.dv_NC;
  uint16_t* dattn = w.dattn_NQ;
  c.mark(cuda::Phase::kAttention);
  const uint16_t* attn = s.attn->as<uint16_t>();
  const uint16_t* norm = s.norm->as<uint16_t>();
  if (fp8_) {
    fp8_quantize_operand(dx, n, d, *fp8_scratch_, st);
    fp8_linear(G, *fp8_scratch_, fp8_o_, true, 0, n, q, d, dattn, st);
  } else {
    cuda::gemm(G, false, false, n, q, d, 1.f, dx, d, P + p_.o_proj, q, 0.f, dattn, q, st);
  }
  cuda::gemm(G, true, false, d, q, n, 1.f, dx, d, attn, q, c.wgrad_beta(), Gr + p_.o_proj, q, st);
  cuda::attention_backward(s.q->as<uint16_t>(), s.k->as<uint16_t>(), s.v->as<uint16_t>(), attn,
                           s.lse->as<float>(), dattn, dq, dk, dv, batch, seq, hq, hkv, hd, w.ws_attn,
                           w.ws_attn_bytes, st);
  const uint16_t* gq = dq;
  const uint16_t* gk = dk;
  if (qk_norm_) {
    // QK-norm's backward reads RoPE's backward on the fly where the shapes allow (the same bits
    // as the two passes, one read of dq / dk fewer and no write).
    uint16_t* dq_raw = w.dq_raw_NQ;
    uint16_t* dk_raw = w.dk_raw_NC;
    const uint16_t* q_raw = s.q_raw->as<uint16_t>();
    const uint16_t* k_raw = s.k_raw->as<uint16_t>();
    if (cuda::rope_rmsnorm_backward_fuses(q_raw, P + p_.q_norm, dq, dq_raw, hq, hd) &&
        cuda::rope_rmsnorm_backward_fuses(k_raw, P + p_.k_norm, dk, dk_raw, hkv, hd)) {
      cuda::rope_rmsnorm_backward(q_raw, P + p_.q_norm, s.q_rstd->as<float>(), dq, dq_raw, Gr + p_.q_norm, batch,
                                  seq, hq, hd, rope_theta_, res.ws_rms.data(), res.ws_rms.bytes(), st);
      cuda::rope_rmsnorm_backward(k_raw, P + p_.k_norm, s.k_rstd->as<float>(), dk, dk_raw, Gr + p_.k_norm, batch,
                                  seq, hkv, hd, rope_theta_, res.ws_rms.data(), res.ws_rms.bytes(), st);
    } else {
      cuda::rope_backward(dq, batch, seq, hq, hd, rope_theta_, st);
      cuda::rope_backward(dk, batch, seq, hkv, hd, rope_theta_, st);
      cuda::rmsnorm_backward(q_raw, P + p_.q_norm, s.q_rstd->as<float>(), dq, dq_raw, Gr + p_.q_norm, n, q,
                             res.ws_rms.data(), res.ws_rms.bytes(), st);
      cuda::rmsnorm_backward(k_raw, P + p_.k_norm, s.k_rstd->as<float>(), dk, dk_raw, Gr + p_.k_norm, n, kv,
                             res.ws_rms.data(), res.ws_rms.bytes(), st);
    }
    gq = dq_raw;
    gk = dk_raw;
  } else {
    cuda::rope_backward(dq, batch, seq, hq, hd, rope_theta_, st);
    cuda::rope_backward(dk, batch, seq, hkv, hd, rope_theta_, st);
  }
  if (fp8_) {
    // dbranch = [gq | gk | dv] [Wq; Wk; Wv]: the three gradients' codes side by side along K.
    CudaFp8Scratch& sc = *fp8_scratch_;
    const int64_t w = q + 2 * kv;
    fp8_quantize_operand_part(gq, n, q, w, 0, sc, st);
    fp8_quantize_operand_part(gk, n, kv, w, q, sc, st);
    fp8_quantize_operand_part(dv, n, kv, w, q + kv, sc, st);
    fp8_linear(G, sc, fp8_qkv_, true, 0, n, d, w, dbranch, st);
  } else {
    cuda::gemm(G, false, false, n, d, q, 1.f, gq, q, P + p_.q_proj, d, 0.f, dbranch, d, st);
    cuda::gemm(G, false, false, n, d, kv, 1.f, gk, kv, P + p_.k_proj, d, 1.f, dbranch, d, st);
    cuda::gemm(G, false, false, n, d, kv, 1.f, dv, kv, P + p_.v_proj, d, 1.f, dbranch, d, st);
  }
  cuda::gemm(G, true, false, q, d, n, 1.f, gq, q, norm, d, c.wgrad_beta(), Gr + p_.q_proj, d, st);
  cuda::gemm(G, true, false, kv, d, n, 1.f, gk, kv, norm, d, c.wgrad_beta(), Gr + p_.k_proj, d, st);
  cuda::gemm(G, true, false, kv, d, n, 1.f, dv, kv, norm, d, c.wgrad_beta(), Gr + p_.v_proj, d, st);
  cuda::rmsnorm_backward_add(s.x->as<uint16_t>(), P + p_.attn_norm, s.rstd->as<float>(), dbranch, res.dx32(),
                             res.dx(), Gr + p_.attn_norm, n, d, res.ws_rms.data(), res.ws_rms.bytes(), st);
}

}  // namespace moe

#endif  // MOECORE_HAS_CUDA
