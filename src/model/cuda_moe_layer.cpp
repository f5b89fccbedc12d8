// CudaMoeLayer: RMSNorm, gate GEMM and router, dispatch map and permute, the experts, weighted
// unpermute, shared expert, residual add; backward in reverse: shared expert (it starts dbranch),
// unpermute backward, experts, permute backward and the router backward through the gate GEMM,
// all adding into dbranch before the norm's backward.
// Legend: N = B*S tokens, D model width, E experts, K top_k, R routed rows (N*K), M MoE layers.
#ifdef MOECORE_HAS_CUDA

#include "model/cuda_moe_layer.h"

#include "cuda/ops/gemm.h"
#include "cuda/ops/rmsnorm.h"

namespace moe {

CudaMoeLayer::CudaMoeLayer(const ModelConfig& m, const MoeConfig& e, const CudaRouterChoice& router,
                           const LayerParams& p, int64_t layer)
    : p_(p),
      layer_(layer),
      d_(m.d_model),
      e_(e.num_experts),
      k_(e.top_k),
      norm_eps_(m.norm_eps),
      router_(router) {}

void CudaMoeLayer::reserve(int64_t batch, int64_t seq, CudaBufferGrower& g) {
  const int64_t n = batch * seq, d = d_, e = e_, k = k_, rows = n * k;
  CudaMoeSaved& s = saved_;
  g.grow<uint16_t>(s.x_ND, n * d, "x_mid");
  g.grow<uint16_t>(s.norm_ND, n * d, "norm2");
  g.grow<float>(s.rstd_N, n, "rstd2");
  if (p_.shared) s.shared.reserve(n, p_.mlp_hidden, g);
  g.grow<float>(s.logits_NE, n * e, "router logits");
  g.grow<float>(s.scores_NE, n * e, "router scores");
  g.grow<int32_t>(s.topk_idx_NK, n * k, "topk_idx");
  g.grow<float>(s.topk_w_NK, n * k, "topk_w");
  g.grow<int32_t>(s.dispatch.offsets_E1, e + 1, "expert offsets");
  g.grow<int32_t>(s.dispatch.sorted_route_R, rows, "sorted_route");
  g.grow<int32_t>(s.dispatch.route_to_row_R, rows, "route_to_row");
  g.grow<uint16_t>(s.x_sorted_RD, rows * d, "x_sorted");
  g.grow<uint16_t>(s.y_sorted_RD, rows * d, "y_sorted");
}

void CudaMoeLayer::reserve_shared(const MoeConfig& e, int64_t d, int64_t batch, int64_t seq, CudaMoeShared& s,
                                  CudaBufferGrower& g) {
  const int64_t n = batch * seq, ne = e.num_experts, k = e.top_k, rows = n * k;
  cuda::RouterParams rp;
  rp.num_tokens = n;
  rp.num_experts = ne;
  rp.top_k = k;
  g.grow_bytes(s.ws_router, cuda::router_workspace_bytes(rp), "router workspace");
  g.grow_bytes(s.ws_dispatch, cuda::dispatch_map_workspace_bytes(n, k, ne), "dispatch workspace");
  g.grow<uint16_t>(s.dy_sorted_RD, rows * d, "dy_sorted");
  g.grow<float>(s.dtopk_w_NK, n * k, "dtopk_w");
  g.grow<uint16_t>(s.dx_sorted_RD, rows * d, "dx_sorted");
  g.grow<float>(s.dlogits32_NE, n * ne, "router dlogits32");
  g.grow<uint16_t>(s.dlogits16_NE, n * ne, "router dlogits16");
}

void CudaMoeLayer::forward(const CudaBlockContext& c, CudaResidual& res, CudaMoeShared& shared,
                           uint64_t routing_seed, uint16_t* out_ND) {
  const cuda::Stream st = c.stream;
  cuda::GemmHandle& G = *c.gemm;
  const uint16_t* P = c.params;
  const int64_t n = c.tokens(), d = d_, e = e_, k = k_, rows = n * k, m = p_.moe_index;
  CudaMoeSaved& s = saved_;
  c.mark(cuda::Phase::kMlp);
  uint16_t* norm = s.norm_ND.as<uint16_t>();
  cuda::rmsnorm_forward(s.x_ND.as<uint16_t>(), P + p_.mlp_norm, norm, s.rstd_N.as<float>(), n, d, norm_eps_, st);

  // Router.
  c.mark(cuda::Phase::kRouter);
  s.rp.num_tokens = n;
  s.rp.num_experts = e;
  s.rp.top_k = k;
  s.rp.score = router_.score;
  s.rp.norm_topk = router_.norm_topk;
  s.rp.mode = router_.mode;
  s.rp.seed = layer_routing_seed(routing_seed, static_cast<uint64_t>(layer_));
  float* logits = s.logits_NE.as<float>();
  cuda::gemm(G, false, true, n, e, d, 1.f, norm, d, P + p_.router, d, 0.f, logits, e, st);
  int32_t* counts = shared.counts_ME.as<int32_t>() + m * e;
  int32_t* topk_idx = s.topk_idx_NK.as<int32_t>();
  float* topk_w = s.topk_w_NK.as<float>();
  cuda::router_forward(s.rp, logits, shared.expert_bias_ME.as<float>() + m * e, s.scores_NE.as<float>(), topk_idx,
                       topk_w, counts, nullptr, shared.losses_M2.as<float>() + 2 * m, shared.ws_router.data(),
                       shared.ws_router.bytes(), st);

  // Dispatch: the handle, then the rows sorted by expert.
  c.mark(cuda::Phase::kDispatch);
  int32_t* offsets = s.dispatch.offsets_E1.as<int32_t>();
  int32_t* sorted_route = s.dispatch.sorted_route_R.as<int32_t>();
  int32_t* route_to_row = s.dispatch.route_to_row_R.as<int32_t>();
  cuda::build_dispatch_map(topk_idx, n, k, e, 0, counts, offsets, sorted_route, route_to_row, nullptr,
                           shared.ws_dispatch.data(), shared.ws_dispatch.bytes(), st);
  uint16_t* xs = s.x_sorted_RD.as<uint16_t>();
  cuda::permute_forward(norm, sorted_route, n, k, d, xs, st);

  // Experts, combine, shared expert.
  uint16_t* ys = s.y_sorted_RD.as<uint16_t>();
  shared.experts->forward(c, m, p_, counts, offsets, xs, rows, ys);
  c.mark(cuda::Phase::kCombine);
  uint16_t* branch = res.branch();
  cuda::unpermute_forward(ys, route_to_row, topk_w, n, k, d, branch, st);
  c.mark(cuda::Phase::kMlp);
  if (p_.shared) {
    mlp_forward_gpu(G, norm, P + p_.mlp_gate, P + p_.mlp_up, P + p_.mlp_down, n, d, p_.mlp_hidden, s.shared, branch,
                    true, st);
  }
  cuda::residual_add(res.x32(), branch, out_ND, n * d, st);
}

void CudaMoeLayer::backward(const CudaBlockContext& c, CudaResidual& res, CudaMoeShared& shared,
                            CudaMlpScratch& mlp, const float* dlb, const float* dz) {
  const cuda::Stream st = c.stream;
  cuda::GemmHandle& G = *c.gemm;
  const uint16_t* P = c.params;
  float* Gr = c.grads;
  const int64_t n = c.tokens(), d = d_, e = e_, k = k_, rows = n * k, m = p_.moe_index;
  const CudaMoeSaved& s = saved_;
  const uint16_t* norm = s.norm_ND.as<uint16_t>();
  const uint16_t* dx = res.dx();
  uint16_t* dbranch = res.dbranch();
  // dbranch = d(branch)/d(norm) applied to dx: the shared expert writes it, or it starts at 0.
  c.mark(cuda::Phase::kMlp);
  if (p_.shared) {
    mlp_backward_gpu(G, norm, P + p_.mlp_gate, P + p_.mlp_up, P + p_.mlp_down, s.shared, dx, n, d, p_.mlp_hidden, mlp,
                     dbranch, false, Gr + p_.mlp_gate, Gr + p_.mlp_up, Gr + p_.mlp_down, st);
  } else {
    cuda::device_memset(dbranch, 0, n * d * sizeof(uint16_t), st);
  }

  // Combine.
  c.mark(cuda::Phase::kCombine);
  const int32_t* offsets = s.dispatch.offsets_E1.as<int32_t>();
  const int32_t* route_to_row = s.dispatch.route_to_row_R.as<int32_t>();
  uint16_t* dys = shared.dy_sorted_RD.as<uint16_t>();
  float* dtopk_w = shared.dtopk_w_NK.as<float>();
  cuda::unpermute_backward(dx, s.y_sorted_RD.as<uint16_t>(), s.dispatch.sorted_route_R.as<int32_t>(), route_to_row,
                           s.topk_w_NK.as<float>(), n, k, d, dys, dtopk_w, st);

  // Experts, dispatch.
  uint16_t* dxs = shared.dx_sorted_RD.as<uint16_t>();
  shared.experts->backward(c, m, p_, offsets, s.x_sorted_RD.as<uint16_t>(), dys, rows, dxs);
  c.mark(cuda::Phase::kDispatch);
  cuda::permute_backward(dxs, route_to_row, n, k, d, dbranch, st);

  // Router, through the gate GEMM.
  c.mark(cuda::Phase::kRouter);
  float* dl32 = shared.dlogits32_NE.as<float>();
  uint16_t* dl16 = shared.dlogits16_NE.as<uint16_t>();
  cuda::router_backward(s.rp, s.logits_NE.as<float>(), s.scores_NE.as<float>(), s.topk_idx_NK.as<int32_t>(),
                        shared.counts_ME.as<int32_t>() + m * e, dtopk_w, dlb, dz, dl32, st);
  cuda::cast_f32_to_bf16(dl32, dl16, n * e, st);
  cuda::gemm(G, false, false, n, d, e, 1.f, dl16, e, P + p_.router, d, 1.f, dbranch, d, st);
  cuda::gemm(G, true, false, e, d, n, 1.f, dl16, e, norm, d, 1.f, Gr + p_.router, d, st);
  c.mark(cuda::Phase::kMlp);
  uint16_t* dtmp = res.dtmp();
  cuda::rmsnorm_backward(s.x_ND.as<uint16_t>(), P + p_.mlp_norm, s.rstd_N.as<float>(), dbranch, dtmp,
                         Gr + p_.mlp_norm, n, d, res.ws_rms.data(), res.ws_rms.bytes(), st);
  cuda::residual_add(res.dx32(), dtmp, res.dx(), n * d, st);
}

}  // namespace moe

#endif  // MOECORE_HAS_CUDA
