// Model<T>: forward saves every activation backward needs; backward walks the blocks in
// reverse. Gradient conventions: parameter gradients accumulate (+=); activation gradients
// are overwritten except the residual stream, which sums the block's branches. Under expert
// parallelism the MoE branch sends its sorted rows to the experts' ranks between dispatch and
// combine (forward) and the row gradients likewise (backward); the rest is unchanged.
#include "model/model.h"

#include <cmath>
#include <string>
#include <type_traits>

#include "core/error.h"
#include "core/rng.h"
#include "cpu/attention.h"
#include "cpu/capacity.h"
#include "cpu/cross_entropy.h"
#include "cpu/dispatch.h"
#include "cpu/embedding.h"
#include "cpu/experts.h"
#include "cpu/linear.h"
#include "cpu/rmsnorm.h"
#include "cpu/rope.h"
#include "cpu/router.h"
#include "model/ep_experts.h"
#include "model/layout.h"

namespace moe {

namespace {

cpu::RouterParams router_params(const MoeConfig& e, int64_t n, int64_t d, uint64_t seed) {
  cpu::RouterParams p;
  p.num_tokens = n;
  p.d_model = d;
  p.num_experts = e.num_experts;
  p.top_k = e.top_k;
  p.score = parse_score_func(e.router);
  p.norm_topk = e.norm_topk_prob;
  p.mode = parse_routing_mode(e.routing);
  p.seed = seed;
  return p;
}

}  // namespace

template <typename T>
struct Model<T>::LayerState : LayerParams {
  // Saved activations.
  std::vector<T> x_in_ND, norm1_ND, rstd1_N;
  std::vector<T> q_raw_NQ, k_raw_NK, q_rstd_N, k_rstd_N, q_NQ, k_NK, v_NK, attn_NQ, lse_BHS;
  std::vector<T> x_mid_ND, norm2_ND, rstd2_N;
  MlpSaved<T> mlp;  // dense MLP or shared expert
  // MoE
  cpu::RouterParams rp;
  std::vector<T> logits_NE, scores_NE, topk_w_NK;
  std::vector<int32_t> topk_idx_NK, counts_E, offsets_E1, sorted_route_R, route_to_row_R, kept_E;
  int64_t kept_rows = 0;  // rows the experts process (all routes when dropless)
  std::vector<T> x_sorted_RD, gate_up_R2I, h_RI, y_sorted_RD;  // under EP: y_sorted_RD only
  EpExpertsSaved ep;  // under EP: the exchange and the local experts' saved rows
};

template <typename T>
Model<T>::Model(const ModelConfig& model, const MoeConfig& moe, const ExpertParallel* ep)
    : mcfg_(model), ecfg_(moe) {
  slice_ = {0, moe.num_experts};
  if (ep != nullptr && ep->size() > 1) {
    MOE_CHECK((std::is_same_v<T, float>), "expert parallelism (ep = ", ep->size(),
              ") runs in Model<float> only; the double model is single-rank");
    MOE_CHECK(ep->num_experts == moe.num_experts, "expert parallelism: the EP context has ", ep->num_experts,
              " experts, moe.num_experts is ", moe.num_experts);
    MOE_CHECK(moe.num_experts % ep->size() == 0, "expert parallelism: parallel.ep = ", ep->size(),
              " must divide moe.num_experts = ", moe.num_experts);
    MOE_CHECK(moe.capacity_factor == 0, "expert parallelism is dropless only: moe.capacity_factor must be 0 with "
              "parallel.ep = ", ep->size(), ", got ", moe.capacity_factor);
    ep_ = *ep;
    slice_ = ep->slice();
  }
  layout_ = build_param_layout(model, moe, slice_);
  for (const ParamEntry& e : layout_.entries())
    placements_.push_back(global_placement(e, ep_ ? ep_->size() : 1, ep_ ? ep_->rank() : 0));
  params_.assign(layout_.total_numel(), T(0));
  grads_.assign(layout_.total_numel(), T(0));
  num_moe_layers_ = moe::num_moe_layers(model);
  expert_bias_.assign(num_moe_layers_ * moe.num_experts, 0.f);
  for (const LayerParams& p : layer_params(layout_, mcfg_, ecfg_)) {
    auto s = std::make_unique<LayerState>();
    static_cast<LayerParams&>(*s) = p;
    layers_.push_back(std::move(s));
  }
}

template <typename T>
Model<T>::~Model() = default;

template <typename T>
void Model<T>::init_params(uint64_t seed) {
  const auto& entries = layout_.entries();
  for (size_t i = 0; i < entries.size(); ++i) {
    const ParamEntry& e = entries[i];
    T* p = params_.data() + e.offset;
    if (e.shape.size() == 1) {  // norm weights
      for (int64_t j = 0; j < e.numel; ++j) p[j] = T(1);
    } else {
      // The global tensor's stream from the local tensor's offset in it.
      fill_trunc_normal(p, e.numel, placements_[i].offset, seed, e.name, mcfg_.init_std);
    }
  }
  std::fill(expert_bias_.begin(), expert_bias_.end(), 0.f);
}

template <typename T>
void Model<T>::zero_grads() {
  std::fill(grads_.begin(), grads_.end(), T(0));
}

template <typename T>
ForwardStats Model<T>::forward(const int32_t* inputs, const int32_t* targets, int64_t batch,
                               int64_t seq, uint64_t routing_seed) {
  MOE_CHECK(batch > 0 && seq > 0, "forward: batch and sequence must be positive, got batch=", batch,
            " seq=", seq);
  const int64_t n = batch * seq, d = mcfg_.d_model, hd = mcfg_.head_dim();
  const int64_t hq = mcfg_.n_heads, hkv = mcfg_.n_kv_heads, q = hq * hd, kv = hkv * hd;
  const int64_t v = mcfg_.vocab_size, e = ecfg_.num_experts, k = ecfg_.top_k;
  const int64_t inner = ecfg_.expert_hidden, rows = n * k;
  batch_ = batch;
  seq_ = seq;
  inputs_.assign(inputs, inputs + n);
  targets_.assign(targets, targets + n);
  const T* P = params_.data();

  ForwardStats stats;
  std::vector<T> x(n * d), branch(n * d);
  timer_.lap(Phase::kEmbedding);
  cpu::embedding_forward(inputs, P + layout_.find("model.embed_tokens.weight").offset, x.data(), n, v, d);

  for (int64_t l = 0; l < mcfg_.n_layers; ++l) {
    LayerState& s = *layers_[l];
    timer_.lap(Phase::kAttention);
    s.x_in_ND = x;
    // Attention branch.
    s.norm1_ND.resize(n * d);
    s.rstd1_N.resize(n);
    cpu::rmsnorm_forward(x.data(), P + s.attn_norm, s.norm1_ND.data(), s.rstd1_N.data(), n, d, mcfg_.norm_eps);
    s.q_raw_NQ.resize(n * q);
    s.k_raw_NK.resize(n * kv);
    s.v_NK.resize(n * kv);
    cpu::linear_forward(s.norm1_ND.data(), P + s.q_proj, s.q_raw_NQ.data(), n, d, q);
    cpu::linear_forward(s.norm1_ND.data(), P + s.k_proj, s.k_raw_NK.data(), n, d, kv);
    cpu::linear_forward(s.norm1_ND.data(), P + s.v_proj, s.v_NK.data(), n, d, kv);
    if (mcfg_.qk_norm) {
      s.q_NQ.resize(n * q);
      s.k_NK.resize(n * kv);
      s.q_rstd_N.resize(n);
      s.k_rstd_N.resize(n);
      cpu::rmsnorm_forward(s.q_raw_NQ.data(), P + s.q_norm, s.q_NQ.data(), s.q_rstd_N.data(), n, q, mcfg_.norm_eps);
      cpu::rmsnorm_forward(s.k_raw_NK.data(), P + s.k_norm, s.k_NK.data(), s.k_rstd_N.data(), n, kv, mcfg_.norm_eps);
    } else {
      s.q_NQ = s.q_raw_NQ;
      s.k_NK = s.k_raw_NK;
    }
    cpu::rope_forward(s.q_NQ.data(), batch, seq, hq, hd, mcfg_.rope_theta);
    cpu::rope_forward(s.k_NK.data(), batch, seq, hkv, hd, mcfg_.rope_theta);
    s.attn_NQ.resize(n * q);
    s.lse_BHS.resize(batch * hq * seq);
    cpu::attention_forward(s.q_NQ.data(), s.k_NK.data(), s.v_NK.data(), s.attn_NQ.data(), s.lse_BHS.data(),
                           batch, seq, hq, hkv, hd);
    cpu::linear_forward(s.attn_NQ.data(), P + s.o_proj, x.data(), n, q, d, /*accumulate=*/true);
    s.x_mid_ND = x;

    // MLP / MoE branch.
    s.norm2_ND.resize(n * d);
    s.rstd2_N.resize(n);
    cpu::rmsnorm_forward(x.data(), P + s.mlp_norm, s.norm2_ND.data(), s.rstd2_N.data(), n, d, mcfg_.norm_eps);
    if (s.dense) {
      timer_.lap(Phase::kMlp);
      mlp_forward(s.norm2_ND.data(), P + s.mlp_gate, P + s.mlp_up, P + s.mlp_down, n, d, mcfg_.dense_hidden, s.mlp, x.data(),
                  /*accumulate=*/true);
      continue;
    }
    timer_.lap(Phase::kRouter);
    s.rp = router_params(ecfg_, n, d, layer_routing_seed(routing_seed, static_cast<uint64_t>(l)));
    s.logits_NE.resize(n * e);
    s.scores_NE.resize(n * e);
    s.topk_idx_NK.resize(n * k);
    s.topk_w_NK.resize(n * k);
    s.counts_E.resize(e);
    const cpu::RouterStats rs = cpu::router_forward(
        s.rp, s.norm2_ND.data(), P + s.router, expert_bias_.data() + s.moe_index * e, s.logits_NE.data(),
        s.scores_NE.data(), s.topk_idx_NK.data(), s.topk_w_NK.data(), s.counts_E.data());
    stats.lb_loss += rs.lb_loss;
    stats.z_loss += rs.z_loss;
    timer_.lap(Phase::kDispatch);
    s.offsets_E1.resize(e + 1);
    s.sorted_route_R.resize(rows);
    s.route_to_row_R.resize(rows);
    cpu::build_dispatch_map(s.topk_idx_NK.data(), n, k, e, s.counts_E.data(), s.offsets_E1.data(),
                            s.sorted_route_R.data(), s.route_to_row_R.data());
    stats.tokens_per_expert.push_back(s.counts_E);
    stats.num_routes += rows;
    s.kept_rows = rows;
    if (ecfg_.capacity_factor > 0) {
      s.kept_E.resize(e);
      const int64_t cap = cpu::expert_capacity(ecfg_.capacity_factor, n, k, e);
      stats.num_dropped += cpu::apply_capacity(cap, n, k, e, s.offsets_E1.data(), s.sorted_route_R.data(),
                                               s.route_to_row_R.data(), s.kept_E.data());
      s.kept_rows = s.offsets_E1[e];
    }
    const int64_t kept = s.kept_rows;
    if (ep_) {
      if constexpr (std::is_same_v<T, float>) {
        // Rows sorted by global expert travel to the experts' ranks and back.
        std::vector<float> x_send(kept * d);
        cpu::permute_forward(s.norm2_ND.data(), s.sorted_route_R.data(), kept, k, d, x_send.data());
        s.y_sorted_RD.resize(kept * d);
        ep_experts_forward(*ep_, x_send.data(), s.counts_E.data(), P + s.experts_gate_up, P + s.experts_down, d, inner, s.ep,
                           s.y_sorted_RD.data(), &timer_);
      }
    } else {
      s.x_sorted_RD.resize(kept * d);
      cpu::permute_forward(s.norm2_ND.data(), s.sorted_route_R.data(), kept, k, d, s.x_sorted_RD.data());
      timer_.lap(Phase::kExperts);
      s.gate_up_R2I.resize(kept * 2 * inner);
      s.h_RI.resize(kept * inner);
      s.y_sorted_RD.resize(kept * d);
      cpu::experts_forward(s.x_sorted_RD.data(), s.offsets_E1.data(), P + s.experts_gate_up, P + s.experts_down, e, d, inner,
                           s.gate_up_R2I.data(), s.h_RI.data(), s.y_sorted_RD.data());
    }
    timer_.lap(Phase::kCombine);
    cpu::unpermute_forward(s.y_sorted_RD.data(), s.route_to_row_R.data(), s.topk_w_NK.data(), n, k, d,
                           branch.data());
    if (s.shared) {
      timer_.lap(Phase::kMlp);
      mlp_forward(s.norm2_ND.data(), P + s.mlp_gate, P + s.mlp_up, P + s.mlp_down, n, d, ecfg_.shared_experts * inner, s.mlp,
                  branch.data(), /*accumulate=*/true);
    }
    for (int64_t i = 0; i < n * d; ++i) x[i] += branch[i];
  }
  if (num_moe_layers_ > 0) {
    stats.lb_loss /= double(num_moe_layers_);
    stats.z_loss /= double(num_moe_layers_);
  }

  // Final norm, LM head, cross-entropy.
  timer_.lap(Phase::kLmHead);
  final_in_ND_ = x;
  final_norm_ND_.resize(n * d);
  final_rstd_N_.resize(n);
  cpu::rmsnorm_forward(x.data(), P + layout_.find("model.norm.weight").offset, final_norm_ND_.data(),
                       final_rstd_N_.data(), n, d, mcfg_.norm_eps);
  logits_NV_.resize(n * v);
  cpu::linear_forward(final_norm_ND_.data(), P + layout_.find("lm_head.weight").offset, logits_NV_.data(), n, d, v);
  lse_N_.resize(n);
  loss_N_.resize(n);
  cpu::cross_entropy_forward(logits_NV_.data(), targets, loss_N_.data(), lse_N_.data(), n, v, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    if (targets[i] < 0) continue;
    stats.ce_sum += double(loss_N_[i]);
    stats.num_targets += 1;
  }
  timer_.stop();
  return stats;
}

template <typename T>
void Model<T>::backward(const LossScales& scales) {
  MOE_CHECK(batch_ > 0, "backward called before forward");
  const int64_t batch = batch_, seq = seq_;
  const int64_t n = batch * seq, d = mcfg_.d_model, hd = mcfg_.head_dim();
  const int64_t hq = mcfg_.n_heads, hkv = mcfg_.n_kv_heads, q = hq * hd, kv = hkv * hd;
  const int64_t v = mcfg_.vocab_size, e = ecfg_.num_experts, k = ecfg_.top_k;
  const int64_t inner = ecfg_.expert_hidden;
  const T* P = params_.data();
  T* G = grads_.data();
  const T dlb = num_moe_layers_ ? T(scales.lb_scale / double(num_moe_layers_)) : T(0);
  const T dz = num_moe_layers_ ? T(scales.z_scale / double(num_moe_layers_)) : T(0);

  // LM head and final norm.
  timer_.lap(Phase::kLmHead);
  std::vector<T> dlogits(n * v), dnorm(n * d), dx(n * d);
  cpu::cross_entropy_backward(logits_NV_.data(), targets_.data(), lse_N_.data(), dlogits.data(), n, v, 0.0,
                              T(scales.ce_scale));
  const int64_t head = layout_.find("lm_head.weight").offset;
  cpu::linear_backward(final_norm_ND_.data(), P + head, dlogits.data(), dnorm.data(), G + head, n, d, v);
  const int64_t fnorm = layout_.find("model.norm.weight").offset;
  cpu::rmsnorm_backward(final_in_ND_.data(), P + fnorm, final_rstd_N_.data(), dnorm.data(), dx.data(), G + fnorm, n, d);

  // dx is the gradient of the residual stream; blocks add their branches into it.
  std::vector<T> dbranch(n * d), dtmp(n * d);
  std::vector<T> dq(n * q), dk(n * kv), dv(n * kv), dattn(n * q), dq_raw, dk_raw;
  for (int64_t l = mcfg_.n_layers - 1; l >= 0; --l) {
    LayerState& s = *layers_[l];
    // MLP / MoE branch: dnorm2 = d(branch)/d(norm2) applied to dx.
    std::fill(dbranch.begin(), dbranch.end(), T(0));
    if (s.dense) {
      timer_.lap(Phase::kMlp);
      mlp_backward(s.norm2_ND.data(), P + s.mlp_gate, P + s.mlp_up, P + s.mlp_down, s.mlp, dx.data(), n, d, mcfg_.dense_hidden,
                   dbranch.data(), G + s.mlp_gate, G + s.mlp_up, G + s.mlp_down);
    } else {
      if (s.shared) {
        timer_.lap(Phase::kMlp);
        mlp_backward(s.norm2_ND.data(), P + s.mlp_gate, P + s.mlp_up, P + s.mlp_down, s.mlp, dx.data(), n, d,
                     ecfg_.shared_experts * inner, dbranch.data(), G + s.mlp_gate, G + s.mlp_up, G + s.mlp_down);
      }
      timer_.lap(Phase::kCombine);
      const int64_t kept = s.kept_rows;
      std::vector<T> dy_sorted(kept * d), dtopk_w(n * k), dx_sorted(kept * d);
      cpu::unpermute_backward(dx.data(), s.y_sorted_RD.data(), s.route_to_row_R.data(), s.topk_w_NK.data(), n, k, d,
                              kept, dy_sorted.data(), dtopk_w.data());
      if (ep_) {
        if constexpr (std::is_same_v<T, float>) {
          ep_experts_backward(*ep_, s.ep, P + s.experts_gate_up, P + s.experts_down, dy_sorted.data(), d, inner,
                              dx_sorted.data(), G + s.experts_gate_up, G + s.experts_down, &timer_);
        }
      } else {
        std::vector<T> scratch(kept * 3 * inner);
        timer_.lap(Phase::kExperts);
        cpu::experts_backward(s.x_sorted_RD.data(), s.offsets_E1.data(), P + s.experts_gate_up, P + s.experts_down,
                              s.gate_up_R2I.data(), s.h_RI.data(), dy_sorted.data(), e, d, inner, dx_sorted.data(),
                              G + s.experts_gate_up, G + s.experts_down, scratch.data());
      }
      timer_.lap(Phase::kDispatch);
      cpu::permute_backward(dx_sorted.data(), s.sorted_route_R.data(), kept, k, d, dbranch.data());
      timer_.lap(Phase::kRouter);
      cpu::router_backward(s.rp, s.norm2_ND.data(), P + s.router, s.logits_NE.data(), s.scores_NE.data(),
                           s.topk_idx_NK.data(), s.counts_E.data(), dtopk_w.data(), dlb, dz, dbranch.data(),
                           G + s.router);
    }
    timer_.lap(Phase::kAttention);
    cpu::rmsnorm_backward(s.x_mid_ND.data(), P + s.mlp_norm, s.rstd2_N.data(), dbranch.data(), dtmp.data(), G + s.mlp_norm, n, d);
    for (int64_t i = 0; i < n * d; ++i) dx[i] += dtmp[i];

    // Attention branch.
    cpu::linear_backward(s.attn_NQ.data(), P + s.o_proj, dx.data(), dattn.data(), G + s.o_proj, n, q, d);
    cpu::attention_backward(s.q_NQ.data(), s.k_NK.data(), s.v_NK.data(), s.attn_NQ.data(), s.lse_BHS.data(),
                            dattn.data(), dq.data(), dk.data(), dv.data(), batch, seq, hq, hkv, hd);
    cpu::rope_backward(dq.data(), batch, seq, hq, hd, mcfg_.rope_theta);
    cpu::rope_backward(dk.data(), batch, seq, hkv, hd, mcfg_.rope_theta);
    const T* gq = dq.data();
    const T* gk = dk.data();
    if (mcfg_.qk_norm) {
      dq_raw.resize(n * q);
      dk_raw.resize(n * kv);
      cpu::rmsnorm_backward(s.q_raw_NQ.data(), P + s.q_norm, s.q_rstd_N.data(), dq.data(), dq_raw.data(), G + s.q_norm, n, q);
      cpu::rmsnorm_backward(s.k_raw_NK.data(), P + s.k_norm, s.k_rstd_N.data(), dk.data(), dk_raw.data(), G + s.k_norm, n, kv);
      gq = dq_raw.data();
      gk = dk_raw.data();
    }
    cpu::linear_backward(s.norm1_ND.data(), P + s.q_proj, gq, dbranch.data(), G + s.q_proj, n, d, q);
    cpu::linear_backward(s.norm1_ND.data(), P + s.k_proj, gk, dbranch.data(), G + s.k_proj, n, d, kv, true);
    cpu::linear_backward(s.norm1_ND.data(), P + s.v_proj, dv.data(), dbranch.data(), G + s.v_proj, n, d, kv, true);
    cpu::rmsnorm_backward(s.x_in_ND.data(), P + s.attn_norm, s.rstd1_N.data(), dbranch.data(), dtmp.data(), G + s.attn_norm, n, d);
    for (int64_t i = 0; i < n * d; ++i) dx[i] += dtmp[i];
  }
  timer_.lap(Phase::kEmbedding);
  const int64_t emb = layout_.find("model.embed_tokens.weight").offset;
  cpu::embedding_backward(inputs_.data(), dx.data(), G + emb, n, v, d);
  timer_.stop();
}

template <typename T>
void Model<T>::update_expert_bias(const std::vector<std::vector<int64_t>>& counts, double rate) {
  MOE_CHECK(static_cast<int64_t>(counts.size()) == num_moe_layers_, "expert-bias update: expected counts for ",
            num_moe_layers_, " MoE layers, got ", counts.size());
  const int64_t e = ecfg_.num_experts;
  for (int64_t m = 0; m < num_moe_layers_; ++m) {
    MOE_CHECK(static_cast<int64_t>(counts[m].size()) == e, "expert-bias update: expected ", e, " counts");
    double mean = 0;
    for (int64_t c : counts[m]) mean += double(c);
    mean /= double(e);
    for (int64_t i = 0; i < e; ++i) {
      const double diff = mean - double(counts[m][i]);
      const double sign = diff > 0 ? 1.0 : (diff < 0 ? -1.0 : 0.0);
      expert_bias_[m * e + i] += static_cast<float>(rate * sign);
    }
  }
}

template class Model<float>;
template class Model<double>;

}  // namespace moe
