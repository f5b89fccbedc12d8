// Attention block forward/backward: the CPU ops in the order of the math (see the header).
// Backward: o_proj, attention, RoPE, QK-norm and the q/k/v projections into d(norm input), then
// attn_norm's backward added to the residual gradient. Selective recomputation reruns the calls
// up to the attention kernel with the saved rstd.
#include "model/attention_block.h"

#include "core/error.h"
#include "cpu/attention.h"
#include "cpu/linear.h"
#include "cpu/linear_precision.h"
#include "cpu/rmsnorm.h"
#include "cpu/rope.h"

namespace moe {

AttentionConfig attention_config(const ModelConfig& m) {
  AttentionConfig c;
  c.d_model = m.d_model;
  c.n_heads = m.n_heads;
  c.n_kv_heads = m.n_kv_heads;
  c.head_dim = m.head_dim();
  c.qk_norm = m.qk_norm;
  c.norm_eps = m.norm_eps;
  c.rope_theta = m.rope_theta;
  return c;
}

template <typename T>
void attention_block_forward(const AttentionConfig& c, const AttentionTensors<const T*>& w, int64_t batch,
                             int64_t seq, T* x, AttentionSaved<T>& s, PhaseTimer* timer) {
  const int64_t n = batch * seq, d = c.d_model, hd = c.head_dim, hq = c.n_heads, hkv = c.n_kv_heads;
  const int64_t q = hq * hd, kv = hkv * hd;
  if (timer) timer->lap(Phase::kAttention);
  s.batch = batch;
  s.seq = seq;
  s.x_in_ND.assign(x, x + n * d);
  s.norm_ND.resize(n * d);
  s.rstd_N.resize(n);
  cpu::rmsnorm_forward(x, w.attn_norm, s.norm_ND.data(), s.rstd_N.data(), n, d, c.norm_eps);
  s.q_raw_NQ.resize(n * q);
  s.k_raw_NC.resize(n * kv);
  s.v_NC.resize(n * kv);
  cpu::linear_forward_at(c.fp8, s.norm_ND.data(), w.q_proj, s.q_raw_NQ.data(), n, d, q);
  cpu::linear_forward_at(c.fp8, s.norm_ND.data(), w.k_proj, s.k_raw_NC.data(), n, d, kv);
  cpu::linear_forward_at(c.fp8, s.norm_ND.data(), w.v_proj, s.v_NC.data(), n, d, kv);
  if (c.qk_norm) {
    s.q_NQ.resize(n * q);
    s.k_NC.resize(n * kv);
    s.q_rstd_N.resize(n);
    s.k_rstd_N.resize(n);
    cpu::rmsnorm_rope_forward(s.q_raw_NQ.data(), w.q_norm, s.q_NQ.data(), s.q_rstd_N.data(), batch, seq, 0, hq, hd,
                              c.norm_eps, c.rope_theta);
    cpu::rmsnorm_rope_forward(s.k_raw_NC.data(), w.k_norm, s.k_NC.data(), s.k_rstd_N.data(), batch, seq, 0, hkv, hd,
                              c.norm_eps, c.rope_theta);
  } else {
    s.q_NQ = s.q_raw_NQ;
    s.k_NC = s.k_raw_NC;
    cpu::rope_forward(s.q_NQ.data(), batch, seq, hq, hd, c.rope_theta);
    cpu::rope_forward(s.k_NC.data(), batch, seq, hkv, hd, c.rope_theta);
  }
  s.attn_NQ.resize(n * q);
  s.lse_BHS.resize(batch * hq * seq);
  cpu::attention_forward(s.q_NQ.data(), s.k_NC.data(), s.v_NC.data(), s.attn_NQ.data(), s.lse_BHS.data(), batch,
                         seq, hq, hkv, hd);
  cpu::linear_forward_at(c.fp8, s.attn_NQ.data(), w.o_proj, x, n, q, d, /*accumulate=*/true);
}

template <typename T>
void attention_block_backward(const AttentionConfig& c, const AttentionTensors<const T*>& w,
                              const AttentionSaved<T>& s, T* dx, const AttentionTensors<T*>& dw, PhaseTimer* timer) {
  const int64_t batch = s.batch, seq = s.seq, n = batch * seq, d = c.d_model, hd = c.head_dim;
  const int64_t hq = c.n_heads, hkv = c.n_kv_heads, q = hq * hd, kv = hkv * hd;
  if (timer) timer->lap(Phase::kAttention);
  std::vector<T> dattn(n * q), dq(n * q), dk(n * kv), dv(n * kv), dq_raw, dk_raw, dnorm(n * d);
  cpu::linear_backward_at(c.fp8, s.attn_NQ.data(), w.o_proj, dx, dattn.data(), dw.o_proj, n, q, d);
  cpu::attention_backward(s.q_NQ.data(), s.k_NC.data(), s.v_NC.data(), s.attn_NQ.data(), s.lse_BHS.data(),
                          dattn.data(), dq.data(), dk.data(), dv.data(), batch, seq, hq, hkv, hd);
  const T* gq = dq.data();
  const T* gk = dk.data();
  if (c.qk_norm) {
    dq_raw.resize(n * q);
    dk_raw.resize(n * kv);
    cpu::rope_rmsnorm_backward(s.q_raw_NQ.data(), w.q_norm, s.q_rstd_N.data(), dq.data(), dq_raw.data(), dw.q_norm,
                               batch, seq, hq, hd, c.rope_theta);
    cpu::rope_rmsnorm_backward(s.k_raw_NC.data(), w.k_norm, s.k_rstd_N.data(), dk.data(), dk_raw.data(), dw.k_norm,
                               batch, seq, hkv, hd, c.rope_theta);
    gq = dq_raw.data();
    gk = dk_raw.data();
  } else {
    cpu::rope_backward(dq.data(), batch, seq, hq, hd, c.rope_theta);
    cpu::rope_backward(dk.data(), batch, seq, hkv, hd, c.rope_theta);
  }
  cpu::linear_backward_at(c.fp8, s.norm_ND.data(), w.q_proj, gq, dnorm.data(), dw.q_proj, n, d, q);
  cpu::linear_backward_at(c.fp8, s.norm_ND.data(), w.k_proj, gk, dnorm.data(), dw.k_proj, n, d, kv, /*accumulate_dx=*/true);
  cpu::linear_backward_at(c.fp8, s.norm_ND.data(), w.v_proj, dv.data(), dnorm.data(), dw.v_proj, n, d, kv, /*accumulate_dx=*/true);
  cpu::rmsnorm_backward_add(s.x_in_ND.data(), w.attn_norm, s.rstd_N.data(), dnorm.data(), dx, dw.attn_norm, n, d);
}

template <typename T>
void attention_block_decode(const AttentionConfig& c, const AttentionTensors<const T*>& w, int64_t n, T* x,
                            std::vector<T>& k_cache, std::vector<T>& v_cache) {
  const int64_t d = c.d_model, hd = c.head_dim, hq = c.n_heads, hkv = c.n_kv_heads;
  const int64_t q = hq * hd, kv = hkv * hd;
  MOE_CHECK(n > 0 && int64_t(k_cache.size()) % kv == 0 && k_cache.size() == v_cache.size(),
            "attention_block_decode: expected n > 0 and a KV cache of whole positions, got n=", n, ", ",
            k_cache.size(), " keys and ", v_cache.size(), " values for kv width ", kv);
  const int64_t pos0 = int64_t(k_cache.size()) / kv;
  std::vector<T> norm(n * d), rstd(n), q_raw(n * q), k_raw(n * kv), v_new(n * kv), qv(n * q), kn(n * kv), rq(n), rk(n);
  cpu::rmsnorm_forward(x, w.attn_norm, norm.data(), rstd.data(), n, d, c.norm_eps);
  cpu::linear_forward_at(c.fp8, norm.data(), w.q_proj, q_raw.data(), n, d, q);
  cpu::linear_forward_at(c.fp8, norm.data(), w.k_proj, k_raw.data(), n, d, kv);
  cpu::linear_forward_at(c.fp8, norm.data(), w.v_proj, v_new.data(), n, d, kv);
  if (c.qk_norm) {
    cpu::rmsnorm_rope_forward(q_raw.data(), w.q_norm, qv.data(), rq.data(), 1, n, pos0, hq, hd, c.norm_eps,
                              c.rope_theta);
    cpu::rmsnorm_rope_forward(k_raw.data(), w.k_norm, kn.data(), rk.data(), 1, n, pos0, hkv, hd, c.norm_eps,
                              c.rope_theta);
  } else {
    qv = q_raw;
    kn = k_raw;
    cpu::rope_forward_at(qv.data(), n, pos0, hq, hd, c.rope_theta);
    cpu::rope_forward_at(kn.data(), n, pos0, hkv, hd, c.rope_theta);
  }
  k_cache.insert(k_cache.end(), kn.begin(), kn.end());
  v_cache.insert(v_cache.end(), v_new.begin(), v_new.end());
  std::vector<T> attn(n * q);
  cpu::attention_decode(qv.data(), k_cache.data(), v_cache.data(), attn.data(), n, pos0, hq, hkv, hd);
  cpu::linear_forward_at(c.fp8, attn.data(), w.o_proj, x, n, q, d, /*accumulate=*/true);
}

template <typename T>
int64_t saved_bytes(const AttentionSaved<T>& s) {
  return held_bytes(s.x_in_ND, s.norm_ND, s.rstd_N, s.q_raw_NQ, s.k_raw_NC, s.q_rstd_N, s.k_rstd_N, s.q_NQ, s.k_NC,
                    s.v_NC, s.attn_NQ, s.lse_BHS);
}

template <typename T>
void swap_recomputed(Recompute mode, AttentionSaved<T>& a, AttentionSaved<T>& b) {
  if (mode == Recompute::kNone) return;
  for (auto m : {&AttentionSaved<T>::norm_ND, &AttentionSaved<T>::q_raw_NQ, &AttentionSaved<T>::k_raw_NC,
                 &AttentionSaved<T>::q_NQ, &AttentionSaved<T>::k_NC, &AttentionSaved<T>::v_NC})
    (a.*m).swap(b.*m);
  if (mode != Recompute::kFull) return;
  for (auto m : {&AttentionSaved<T>::rstd_N, &AttentionSaved<T>::q_rstd_N, &AttentionSaved<T>::k_rstd_N,
                 &AttentionSaved<T>::attn_NQ, &AttentionSaved<T>::lse_BHS})
    (a.*m).swap(b.*m);
}

// The forward's calls between the input and the attention kernel, with the saved rstd in place of
// the norms' own.
template <typename T>
void attention_block_recompute(const AttentionConfig& c, const AttentionTensors<const T*>& w, AttentionSaved<T>& s,
                               PhaseTimer* timer) {
  const int64_t batch = s.batch, seq = s.seq, n = batch * seq, d = c.d_model, hd = c.head_dim;
  const int64_t hq = c.n_heads, hkv = c.n_kv_heads, q = hq * hd, kv = hkv * hd;
  MOE_CHECK(n > 0 && static_cast<int64_t>(s.x_in_ND.size()) == n * d && static_cast<int64_t>(s.rstd_N.size()) == n,
            "attention_block_recompute: no saved forward (input ", s.x_in_ND.size(), " values, rstd ", s.rstd_N.size(),
            ", expected ", n * d, " and ", n, ")");
  if (timer) timer->lap(Phase::kAttention);
  s.norm_ND.resize(n * d);
  cpu::rmsnorm_apply(s.x_in_ND.data(), w.attn_norm, s.rstd_N.data(), s.norm_ND.data(), n, d);
  s.q_raw_NQ.resize(n * q);
  s.k_raw_NC.resize(n * kv);
  s.v_NC.resize(n * kv);
  cpu::linear_forward_at(c.fp8, s.norm_ND.data(), w.q_proj, s.q_raw_NQ.data(), n, d, q);
  cpu::linear_forward_at(c.fp8, s.norm_ND.data(), w.k_proj, s.k_raw_NC.data(), n, d, kv);
  cpu::linear_forward_at(c.fp8, s.norm_ND.data(), w.v_proj, s.v_NC.data(), n, d, kv);
  if (c.qk_norm) {
    s.q_NQ.resize(n * q);
    s.k_NC.resize(n * kv);
    cpu::rmsnorm_apply(s.q_raw_NQ.data(), w.q_norm, s.q_rstd_N.data(), s.q_NQ.data(), n, q);
    cpu::rmsnorm_apply(s.k_raw_NC.data(), w.k_norm, s.k_rstd_N.data(), s.k_NC.data(), n, kv);
  } else {
    s.q_NQ = s.q_raw_NQ;
    s.k_NC = s.k_raw_NC;
  }
  cpu::rope_forward(s.q_NQ.data(), batch, seq, hq, hd, c.rope_theta);
  cpu::rope_forward(s.k_NC.data(), batch, seq, hkv, hd, c.rope_theta);
}

#define MOE_INSTANTIATE_ATTENTION_BLOCK(T)                                                                                  \
  template void attention_block_forward<T>(const AttentionConfig&, const AttentionTensors<const T*>&, int64_t,  \
                                           int64_t, T*, AttentionSaved<T>&, PhaseTimer*);                       \
  template void attention_block_backward<T>(const AttentionConfig&, const AttentionTensors<const T*>&,          \
                                            const AttentionSaved<T>&, T*, const AttentionTensors<T*>&, PhaseTimer*); \
  template void attention_block_decode<T>(const AttentionConfig&, const AttentionTensors<const T*>&, int64_t, T*,  \
                                          std::vector<T>&, std::vector<T>&);                                     \
  template int64_t saved_bytes<T>(const AttentionSaved<T>&);                                                    \
  template void swap_recomputed<T>(Recompute, AttentionSaved<T>&, AttentionSaved<T>&);                          \
  template void attention_block_recompute<T>(const AttentionConfig&, const AttentionTensors<const T*>&,         \
                                             AttentionSaved<T>&, PhaseTimer*);
MOE_INSTANTIATE_ATTENTION_BLOCK(float)
MOE_INSTANTIATE_ATTENTION_BLOCK(double)
#undef MOE_INSTANTIATE_ATTENTION_BLOCK

}  // namespace moe
