// MoE block forward/backward. Forward order: mlp_norm, router, dispatch map (+ capacity), permute,
// experts, combine into the branch, shared expert added to the branch, branch added to x.
// Backward: shared expert, combine, experts, permute and router gradients summed into d(norm
// output) in that order, then mlp_norm's backward added to the residual gradient. Recomputation:
// the forward's calls on the saved routing and dispatch map, up to the experts' and shared
// expert's saved outputs.
#include "model/moe_layer.h"

#include "core/error.h"
#include "cpu/capacity.h"
#include "cpu/dispatch.h"
#include "cpu/rmsnorm.h"

namespace moe {

MoeLayerConfig moe_layer_config(const ModelConfig& m, const MoeConfig& e) {
  MoeLayerConfig c;
  c.router.d_model = m.d_model;
  c.router.num_experts = e.num_experts;
  c.router.top_k = e.top_k;
  c.router.score = parse_score_func(e.router);
  c.router.norm_topk = e.norm_topk_prob;
  c.router.mode = parse_routing_mode(e.routing);
  c.expert_hidden = e.expert_hidden;
  c.shared_hidden = e.shared_experts * e.expert_hidden;
  c.capacity_factor = e.capacity_factor;
  c.norm_eps = m.norm_eps;
  return c;
}

template <typename T>
MoeLayerStats moe_layer_forward(const MoeLayerConfig& c, const MoeTensors<const T*>& w, const Experts<T>& experts,
                                const float* expert_bias_E, int64_t n, uint64_t routing_seed, T* x,
                                MoeLayerSaved<T>& s, PhaseTimer* timer) {
  const int64_t d = c.router.d_model, e = c.router.num_experts, k = c.router.top_k, rows = n * k;
  MoeLayerStats stats;
  if (timer) timer->lap(Phase::kRouter);
  s.x_in_ND.assign(x, x + n * d);
  s.norm_ND.resize(n * d);
  s.rstd_N.resize(n);
  cpu::rmsnorm_forward(x, w.mlp_norm, s.norm_ND.data(), s.rstd_N.data(), n, d, c.norm_eps);

  // Router.
  s.router = c.router;
  s.router.num_tokens = n;
  s.router.seed = routing_seed;
  DispatchHandle& h = s.dispatch;
  s.logits_NE.resize(n * e);
  s.scores_NE.resize(n * e);
  s.topk_idx_NK.resize(n * k);
  s.topk_w_NK.resize(n * k);
  h.counts_E.resize(e);
  const cpu::RouterStats rs =
      cpu::router_forward(s.router, s.norm_ND.data(), w.router, expert_bias_E, s.logits_NE.data(), s.scores_NE.data(),
                          s.topk_idx_NK.data(), s.topk_w_NK.data(), h.counts_E.data());
  stats.lb_loss = rs.lb_loss;
  stats.z_loss = rs.z_loss;

  // Dispatch handle.
  if (timer) timer->lap(Phase::kDispatch);
  h.offsets_E1.resize(e + 1);
  h.sorted_route_R.resize(rows);
  h.route_to_row_R.resize(rows);
  cpu::build_dispatch_map(s.topk_idx_NK.data(), n, k, e, h.counts_E.data(), h.offsets_E1.data(),
                          h.sorted_route_R.data(), h.route_to_row_R.data());
  stats.counts_E = h.counts_E;
  stats.num_routes = rows;
  h.num_rows = rows;
  if (c.capacity_factor > 0) {
    h.kept_E.resize(e);
    const int64_t cap = cpu::expert_capacity(c.capacity_factor, n, k, e);
    stats.num_dropped = cpu::apply_capacity(cap, n, k, e, h.offsets_E1.data(), h.sorted_route_R.data(),
                                            h.route_to_row_R.data(), h.kept_E.data());
    h.num_rows = h.offsets_E1[e];
  }

  // Experts on the sorted rows, then combine into the branch.
  const int64_t kept = h.num_rows;
  std::vector<T> x_sorted(kept * d), branch(n * d);
  cpu::permute_forward(s.norm_ND.data(), h.sorted_route_R.data(), kept, k, d, x_sorted.data());
  s.y_sorted_RD.resize(kept * d);
  experts.forward(x_sorted.data(), h.offsets_E1.data(), w.experts_gate_up, w.experts_down, s.experts,
                  s.y_sorted_RD.data(), timer);
  stats.num_dropped += s.experts.handle.num_dropped;  // the rowwise exchange's capacity
  if (timer) timer->lap(Phase::kCombine);
  cpu::unpermute_forward(s.y_sorted_RD.data(), h.route_to_row_R.data(), s.topk_w_NK.data(), n, k, d, branch.data());
  if (c.shared_hidden > 0) {
    if (timer) timer->lap(Phase::kMlp);
    mlp_forward(s.norm_ND.data(), w.mlp_gate, w.mlp_up, w.mlp_down, n, d, c.shared_hidden, s.shared, branch.data(),
                /*accumulate=*/true, c.fp8);
  }
  for (int64_t i = 0; i < n * d; ++i) x[i] += branch[i];
  return stats;
}

template <typename T>
void moe_layer_backward(const MoeLayerConfig& c, const MoeTensors<const T*>& w, const Experts<T>& experts,
                        const MoeLayerSaved<T>& s, T dlb, T dz, T* dx, const MoeTensors<T*>& dw, PhaseTimer* timer) {
  const DispatchHandle& h = s.dispatch;
  const int64_t n = s.router.num_tokens, d = c.router.d_model, k = c.router.top_k, kept = h.num_rows;
  std::vector<T> dnorm(n * d);  // accumulates from zero
  if (c.shared_hidden > 0) {
    if (timer) timer->lap(Phase::kMlp);
    mlp_backward(s.norm_ND.data(), w.mlp_gate, w.mlp_up, w.mlp_down, s.shared, dx, n, d, c.shared_hidden,
                 dnorm.data(), dw.mlp_gate, dw.mlp_up, dw.mlp_down, c.fp8);
  }
  if (timer) timer->lap(Phase::kCombine);
  std::vector<T> dy_sorted(kept * d), dtopk_w(n * k), dx_sorted(kept * d);
  cpu::unpermute_backward(dx, s.y_sorted_RD.data(), h.route_to_row_R.data(), s.topk_w_NK.data(), n, k, d, kept,
                          dy_sorted.data(), dtopk_w.data());
  experts.backward(s.experts, w.experts_gate_up, w.experts_down, dy_sorted.data(), dx_sorted.data(),
                   dw.experts_gate_up, dw.experts_down, timer);
  if (timer) timer->lap(Phase::kDispatch);
  cpu::permute_backward(dx_sorted.data(), h.sorted_route_R.data(), kept, k, d, dnorm.data());
  if (timer) timer->lap(Phase::kRouter);
  cpu::router_backward(s.router, s.norm_ND.data(), w.router, s.logits_NE.data(), s.scores_NE.data(),
                       s.topk_idx_NK.data(), h.counts_E.data(), dtopk_w.data(), dlb, dz, dnorm.data(), dw.router);
  cpu::rmsnorm_backward_add(s.x_in_ND.data(), w.mlp_norm, s.rstd_N.data(), dnorm.data(), dx, dw.mlp_norm, n, d);
}

template <typename T>
int64_t saved_bytes(const MoeLayerSaved<T>& s) {
  const DispatchHandle& h = s.dispatch;
  return held_bytes(s.x_in_ND, s.norm_ND, s.rstd_N, s.logits_NE, s.scores_NE, s.topk_w_NK, s.topk_idx_NK,
                    s.y_sorted_RD) +
         held_bytes(h.counts_E, h.offsets_E1, h.sorted_route_R, h.route_to_row_R, h.kept_E) + saved_bytes(s.experts) +
         saved_bytes(s.shared);
}

template <typename T>
void swap_recomputed(Recompute mode, MoeLayerSaved<T>& a, MoeLayerSaved<T>& b) {
  if (mode == Recompute::kNone) return;
  a.norm_ND.swap(b.norm_ND);
  a.experts.x_GD.swap(b.experts.x_GD);
  a.experts.h_GI.swap(b.experts.h_GI);
  a.y_sorted_RD.swap(b.y_sorted_RD);
  a.shared.h_NF.swap(b.shared.h_NF);
  if (mode != Recompute::kFull) return;
  a.x_in_ND.swap(b.x_in_ND);
  a.rstd_N.swap(b.rstd_N);
  a.experts.gate_up_G2I.swap(b.experts.gate_up_G2I);
  a.shared.gate_up_N2F.swap(b.shared.gate_up_N2F);
}

// The forward's calls with the saved routing in place of the router and the dispatch map.
template <typename T>
void moe_layer_recompute(const MoeLayerConfig& c, const MoeTensors<const T*>& w, const Experts<T>& experts,
                         Recompute mode, MoeLayerSaved<T>& s, PhaseTimer* timer) {
  const DispatchHandle& h = s.dispatch;
  const int64_t n = s.router.num_tokens, d = c.router.d_model, k = c.router.top_k, kept = h.num_rows;
  MOE_CHECK(mode != Recompute::kNone, "moe_layer_recompute: mode none recomputes nothing");
  MOE_CHECK(n > 0 && static_cast<int64_t>(s.x_in_ND.size()) == n * d &&
                static_cast<int64_t>(h.sorted_route_R.size()) == n * k,
            "moe_layer_recompute: no saved forward (input ", s.x_in_ND.size(), " values, ", h.sorted_route_R.size(),
            " routes; expected ", n * d, " and ", n * k, ")");
  if (timer) timer->lap(Phase::kRouter);
  s.norm_ND.resize(n * d);
  if (mode == Recompute::kFull) {
    s.rstd_N.resize(n);
    cpu::rmsnorm_forward(s.x_in_ND.data(), w.mlp_norm, s.norm_ND.data(), s.rstd_N.data(), n, d, c.norm_eps);
  } else {
    cpu::rmsnorm_apply(s.x_in_ND.data(), w.mlp_norm, s.rstd_N.data(), s.norm_ND.data(), n, d);
  }
  if (timer) timer->lap(Phase::kDispatch);
  std::vector<T> x_sorted(kept * d);
  cpu::permute_forward(s.norm_ND.data(), h.sorted_route_R.data(), kept, k, d, x_sorted.data());
  s.y_sorted_RD.resize(kept * d);
  experts.recompute(x_sorted.data(), w.experts_gate_up, w.experts_down, /*gate_up_kept=*/mode == Recompute::kSelective,
                    s.experts, s.y_sorted_RD.data(), timer);
  if (c.shared_hidden > 0) {
    if (timer) timer->lap(Phase::kMlp);
    mlp_recompute(s.norm_ND.data(), w.mlp_gate, w.mlp_up, n, d, c.shared_hidden,
                  /*gate_up_kept=*/mode == Recompute::kSelective, s.shared, c.fp8);
  }
}

#define MOE_INSTANTIATE_MOE_LAYER(T)                                                                                          \
  template MoeLayerStats moe_layer_forward<T>(const MoeLayerConfig&, const MoeTensors<const T*>&, const Experts<T>&, \
                                              const float*, int64_t, uint64_t, T*, MoeLayerSaved<T>&, PhaseTimer*); \
  template void moe_layer_backward<T>(const MoeLayerConfig&, const MoeTensors<const T*>&, const Experts<T>&,       \
                                      const MoeLayerSaved<T>&, T, T, T*, const MoeTensors<T*>&, PhaseTimer*); \
  template int64_t saved_bytes<T>(const MoeLayerSaved<T>&);                                                      \
  template void swap_recomputed<T>(Recompute, MoeLayerSaved<T>&, MoeLayerSaved<T>&);                             \
  template void moe_layer_recompute<T>(const MoeLayerConfig&, const MoeTensors<const T*>&, const Experts<T>&,   \
                                       Recompute, MoeLayerSaved<T>&, PhaseTimer*);
MOE_INSTANTIATE_MOE_LAYER(float)
MOE_INSTANTIATE_MOE_LAYER(double)
#undef MOE_INSTANTIATE_MOE_LAYER

}  // namespace moe
