// Attention block of a pre-norm decoder layer on the CPU ops: x += o_proj(Attn(q, k, v)) with
// h = RMSNorm(x), q = RoPE(QKNorm(q_proj h)), k = RoPE(QKNorm(k_proj h)), v = v_proj h. QK-norm
// (optional) is an RMSNorm over the full projection width (OLMoE), before RoPE; attention is
// causal with grouped-query heads (cpu/attention.h). Activations are row-major [N, width], token
// t = b*S + s; linear weights [out, in]. The residual add is the o_proj GEMM's accumulate.
// Legend: B batch, S sequence, N = B*S tokens, D model width, H query heads, Q = H*head_dim,
// C = n_kv_heads*head_dim (kv width).
#pragma once

#include <cstdint>
#include <vector>

#include "core/config.h"
#include "core/phase_timer.h"
#include "core/recompute.h"
#include "cpu/fp8.h"
#include "model/layout.h"

namespace moe {

struct AttentionConfig {
  int64_t d_model = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  bool qk_norm = true;
  double norm_eps = 1e-5, rope_theta = 10000.0;
  const cpu::Fp8Recipe* fp8 = nullptr;  // the Q/K/V/O projections in the FP8 recipe (emulated); null: FP32
};
AttentionConfig attention_config(const ModelConfig& m);

// The block's tensors in a flat buffer: P = const T* (weights) or T* (gradients). q_norm, k_norm
// are null without QK-norm.
template <typename P>
struct AttentionTensors {
  P attn_norm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm;  // [D], [Q,D], [C,D], [C,D], [D,Q], [Q], [C]
};
template <typename T>
AttentionTensors<T*> attention_tensors(T* base, const LayerParams& p) {
  return {tensor_at(base, p.attn_norm), tensor_at(base, p.q_proj), tensor_at(base, p.k_proj),
          tensor_at(base, p.v_proj),    tensor_at(base, p.o_proj), tensor_at(base, p.q_norm),
          tensor_at(base, p.k_norm)};
}

template <typename T>
struct AttentionSaved {
  int64_t batch = 0, seq = 0;
  std::vector<T> x_in_ND;                                  // block input (the residual stream)
  std::vector<T> norm_ND, rstd_N;                          // attn_norm output and its rstd
  std::vector<T> q_raw_NQ, k_raw_NC, q_rstd_N, k_rstd_N;   // projections before QK-norm, the norms' rstd
  std::vector<T> q_NQ, k_NC, v_NC;                         // attention inputs (after QK-norm and RoPE)
  std::vector<T> attn_NQ, lse_BHS;                         // attention output and row log-sum-exp
};

// x_ND [N, D] in place: x += branch. Saves what backward needs, x_in_ND included.
template <typename T>
void attention_block_forward(const AttentionConfig& c, const AttentionTensors<const T*>& w, int64_t batch,
                             int64_t seq, T* x_ND, AttentionSaved<T>& saved, PhaseTimer* timer = nullptr);

// dx_ND [N, D] in place: the gradient at the block's output in, at its input out (dx += the
// branch's backward). Parameter gradients dw accumulate (+=).
template <typename T>
void attention_block_backward(const AttentionConfig& c, const AttentionTensors<const T*>& w,
                              const AttentionSaved<T>& saved, T* dx_ND, const AttentionTensors<T*>& dw,
                              PhaseTimer* timer = nullptr);

// Incremental decoding of one sequence (generation with a KV cache): x_ND [n, D] holds the
// tokens at positions pos0 .. pos0 + n - 1, pos0 = k_cache_PC.size() / C, in place x += branch.
// k_cache_PC, v_cache_PC [pos0, C] are the earlier positions' keys (after QK-norm and RoPE) and
// values; the new positions' are appended. The same calls as the forward but RoPE at the
// tokens' own positions and attention over the cache (cpu::attention_decode); nothing is saved
// for backward. Equal to attention_block_forward of the whole sequence to rounding.
template <typename T>
void attention_block_decode(const AttentionConfig& c, const AttentionTensors<const T*>& w, int64_t n, T* x_ND,
                            std::vector<T>& k_cache_PC, std::vector<T>& v_cache_PC);

// Bytes the saved tensors hold (core/recompute.h: held_bytes).
template <typename T>
int64_t saved_bytes(const AttentionSaved<T>& s);

// Activation recomputation (core/recompute.h). Exchanges between a and b the tensors `mode` does
// not keep: selective norm_ND, q_raw_NQ, k_raw_NC, q_NQ, k_NC, v_NC; full every tensor but
// x_in_ND (and the shape). kNone exchanges nothing. The model swaps one pooled set of buffers in
// before a block's forward or recompute and out after, so all blocks share that storage.
template <typename T>
void swap_recomputed(Recompute mode, AttentionSaved<T>& a, AttentionSaved<T>& b);

// Selective recomputation: from what selective keeps (x_in_ND, rstd_N, q_rstd_N, k_rstd_N, attn_NQ,
// lse_BHS) the forward's norm output (with the saved rstd), q/k/v projections, QK-norm (saved rstd)
// and RoPE, bitwise its values; no attention kernel runs. (Full recomputation reruns
// attention_block_forward on x_in_ND.)
template <typename T>
void attention_block_recompute(const AttentionConfig& c, const AttentionTensors<const T*>& w, AttentionSaved<T>& saved,
                               PhaseTimer* timer = nullptr);

}  // namespace moe
