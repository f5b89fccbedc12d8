// CudaMoeLayer: RMSNorm, gate GEMM and router, dispatch map and permute, the experts, weighted
// unpermute, shared expert, residual add; backward in reverse: shared expert (it starts dbranch),
// unpermute backward, experts, permute backward and the router backward through the gate GEMM,
// all adding into dbranch before the norm's backward.
// Legend: N = B*S tokens, D model width, E experts, K top_k, R routed rows (N*K), M MoE layers.
#ifdef MOECORE_HAS_CUDA

#include "model/cuda_moe_layer.h"

#include "core/error.h"
#include "cpu/capacity.h"
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
      capacity_factor_(e.capacity_factor),
      router_(router) {
  bind(Recompute::kNone, nullptr, false);
}

void CudaMoeLayer::bind(Recompute mode, CudaMoeSaved* pool, bool experts_recompute_outputs) {
  const CudaSavedSlots<CudaMoeSaved> at("CudaMoeLayer::bind", mode, saved_, pool);
  mode_ = mode;
  const bool sel = mode != Recompute::kNone, full = mode == Recompute::kFull;
  pooled_y_ = full || (sel && experts_recompute_outputs);
  Slots& s = slots_;
  s.x = at(&CudaMoeSaved::x_ND, full);
  s.norm = at(&CudaMoeSaved::norm_ND, sel);
  s.rstd = at(&CudaMoeSaved::rstd_N, full);
  s.x_sorted = at(&CudaMoeSaved::x_sorted_RD, sel);
  s.y_sorted = at(&CudaMoeSaved::y_sorted_RD, pooled_y_);
  s.shared_gate_up = at(&CudaMoeSaved::shared_gate_up_N2F, full);
  s.shared_h = at(&CudaMoeSaved::shared_h_NF, sel);
}

void CudaMoeLayer::reserve(int64_t batch, int64_t seq, CudaBufferGrower& g) {
  const int64_t n = batch * seq, d = d_, e = e_, k = k_, rows = n * k;
  CudaMoeSaved& s = saved_;
  const Slots& sl = slots_;
  g.grow<uint16_t>(*sl.x, n * d, "x_mid");
  g.grow<uint16_t>(*sl.norm, n * d, "norm2");
  g.grow<float>(*sl.rstd, n, "rstd2");
  if (fp8_shared_) shared_fp8_w_.reserve(d, p_.mlp_hidden, g);
  if (p_.shared) {
    g.grow<uint16_t>(*sl.shared_gate_up, n * 2 * p_.mlp_hidden, "shared_gate_up");
    g.grow<uint16_t>(*sl.shared_h, n * p_.mlp_hidden, "shared_h");
  }
  g.grow<float>(s.logits_NE, n * e, "router logits");
  g.grow<float>(s.scores_NE, n * e, "router scores");
  g.grow<int32_t>(s.topk_idx_NK, n * k, "topk_idx");
  g.grow<float>(s.topk_w_NK, n * k, "topk_w");
  g.grow<int32_t>(s.dispatch.offsets_E1, e + 1, "expert offsets");
  g.grow<int32_t>(s.dispatch.sorted_route_R, rows, "sorted_route");
  g.grow<int32_t>(s.dispatch.route_to_row_R, rows, "route_to_row");
  if (!token_rows_) g.grow<uint16_t>(*sl.x_sorted, rows * d, "x_sorted");
  g.grow<uint16_t>(*sl.y_sorted, rows * d, "y_sorted");
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
  g.grow<float>(s.dlogits32_NE, n * ne, "router dlogits32");
  g.grow<uint16_t>(s.dlogits16_NE, n * ne, "router dlogits16");
}

void CudaMoeLayer::forward(const CudaBlockContext& c, CudaResidual& res, CudaMoeShared& shared,
                           const CudaRoutingSeed& seed, uint16_t* out_ND, bool reuse_routing) {
  const cuda::Stream st = c.stream;
  cuda::GemmHandle& G = *c.gemm;
  const uint16_t* P = c.params;
  const int64_t n = c.tokens(), d = d_, e = e_, k = k_, rows = n * k, m = p_.moe_index;
  CudaMoeSaved& s = saved_;
  const Slots& sl = slots_;
  c.mark(cuda::Phase::kMlp);
  uint16_t* norm = sl.norm->as<uint16_t>();
  if (fp8_shared_) {  // the norm also writes the shared expert's FP8 input (nothing else uses that scratch)
    fp8_rmsnorm_operand(sl.x->as<uint16_t>(), P + p_.mlp_norm, norm, sl.rstd->as<float>(), n, d, norm_eps_,
                        fp8_scratch_->fp8, st);
  } else {
    cuda::rmsnorm_forward(sl.x->as<uint16_t>(), P + p_.mlp_norm, norm, sl.rstd->as<float>(), n, d, norm_eps_, st);
  }
  int32_t* counts = shared.counts_ME.as<int32_t>() + m * e;
  int32_t* offsets = s.dispatch.offsets_E1.as<int32_t>();
  int32_t* sorted_route = s.dispatch.sorted_route_R.as<int32_t>();
  int32_t* route_to_row = s.dispatch.route_to_row_R.as<int32_t>();
  float* topk_w = s.topk_w_NK.as<float>();
  if (!reuse_routing) route(c, shared, seed, norm);

  // The rows sorted by expert (or read by the experts from the token rows), the experts, combine,
  // shared expert.
  c.mark(cuda::Phase::kDispatch);
  uint16_t* ys = sl.y_sorted->as<uint16_t>();
  if (token_rows_) {
    shared.experts->forward_tokens(c, m, p_, counts, offsets, norm, sorted_route, k, rows, ys);
  } else {
    uint16_t* xs = sl.x_sorted->as<uint16_t>();
    const cuda::Fp8Rows xq = shared.experts->fp8_input_rows(rows);  // FP8 experts: codes in the same pass
    if (xq.codes != nullptr)
      cuda::permute_forward_fp8(norm, sorted_route, route_to_row, n, k, d, xs, xq.codes, xq.scales, st, xq.rule);
    else
      cuda::permute_forward(norm, sorted_route, route_to_row, n, k, d, xs, st);
    shared.experts->forward(c, m, p_, counts, offsets, xs, rows, ys, xq.codes != nullptr);
  }
  c.mark(cuda::Phase::kCombine);
  if (!p_.shared) {  // (fp8_shared_ implies p_.shared)
    // No shared expert: the combine adds its rows into the residual stream itself (the bits of
    // unpermute_forward then residual_add).
    cuda::unpermute_forward_add(ys, route_to_row, topk_w, n, k, d, res.x32(), out_ND, st);
    return;
  }
  uint16_t* branch = res.branch();
  cuda::unpermute_forward(ys, route_to_row, topk_w, n, k, d, branch, st);
  c.mark(cuda::Phase::kMlp);
  if (fp8_shared_) {
    // The FP8 GEMM overwrites its output: the shared expert's output and the routed one are added
    // into the residual stream one after the other.
    CudaMlpScratch& sc = *fp8_scratch_;
    shared_fp8_w_.refresh(c, P + p_.mlp_gate, P + p_.mlp_down, sc.fp8);
    uint16_t* shared_out = sc.fp8_out_ND.as<uint16_t>();
    mlp_forward_fp8(G, shared_fp8_w_, n, d, p_.mlp_hidden, sl.shared_gate_up->as<uint16_t>(),
                    sl.shared_h->as<uint16_t>(), shared_out, sc.fp8, st);  // its input's codes: the norm's
    cuda::residual_add(res.x32(), branch, nullptr, n * d, st);
    cuda::residual_add(res.x32(), shared_out, out_ND, n * d, st);
    return;
  }
  if (p_.shared) {
    mlp_forward_gpu(G, norm, P + p_.mlp_gate, P + p_.mlp_up, P + p_.mlp_down, n, d, p_.mlp_hidden,
                    sl.shared_gate_up->as<uint16_t>(), sl.shared_h->as<uint16_t>(), branch, true, st);
  }
  cuda::residual_add(res.x32(), branch, out_ND, n * d, st);
}

void CudaMoeLayer::route(const CudaBlockContext& c, CudaMoeShared& shared, const CudaRoutingSeed& seed,
                         const uint16_t* norm) {
  const cuda::Stream st = c.stream;
  const uint16_t* P = c.params;
  const int64_t n = c.tokens(), d = d_, e = e_, k = k_, m = p_.moe_index;
  CudaMoeSaved& s = saved_;
  c.mark(cuda::Phase::kRouter);
  s.rp.num_tokens = n;
  s.rp.num_experts = e;
  s.rp.top_k = k;
  s.rp.score = router_.score;
  s.rp.norm_topk = router_.norm_topk;
  s.rp.mode = router_.mode;
  s.rp.seed = layer_routing_seed(seed.value, static_cast<uint64_t>(layer_));
  s.rp.seed_device = seed.device;
  s.rp.seed_layer = static_cast<uint64_t>(layer_);
  float* logits = s.logits_NE.as<float>();
  cuda::gemm(*c.gemm, false, true, n, e, d, 1.f, norm, d, P + p_.router, d, 0.f, logits, e, st);
  int32_t* counts = shared.counts_ME.as<int32_t>() + m * e;
  int32_t* topk_idx = s.topk_idx_NK.as<int32_t>();
  cuda::router_forward(s.rp, logits, shared.expert_bias_ME.as<float>() + m * e, s.scores_NE.as<float>(), topk_idx,
                       s.topk_w_NK.as<float>(), counts, nullptr, shared.losses_M2.as<float>() + 2 * m,
                       shared.ws_router.data(), shared.ws_router.bytes(), st);
  // The dispatch map: expert offsets, the route of each sorted row, the row of each route.
  c.mark(cuda::Phase::kDispatch);
  // With a capacity the tail of each expert's routes is dropped (num_dropped into the statistics).
  const int64_t capacity = capacity_factor_ > 0 && !c.dropless ? cpu::expert_capacity(capacity_factor_, n, k, e) : 0;
  cuda::build_dispatch_map(topk_idx, n, k, e, capacity, counts, s.dispatch.offsets_E1.as<int32_t>(),
                           s.dispatch.sorted_route_R.as<int32_t>(), s.dispatch.route_to_row_R.as<int32_t>(),
                           shared.dropped_M.as<int32_t>() + m, shared.ws_dispatch.data(), shared.ws_dispatch.bytes(),
                           st);
}

void CudaMoeLayer::set_fp8(bool on, CudaMlpScratch* scratch) {
  fp8_shared_ = on && p_.shared && fp8_mlp_shapes(d_, p_.mlp_hidden);
  fp8_scratch_ = fp8_shared_ ? scratch : nullptr;
  MOE_CHECK(!fp8_shared_ || scratch != nullptr, "CudaMoeLayer::set_fp8: the FP8 shared expert needs the model's MLP "
            "scratch");
  MOE_CHECK(!fp8_shared_ || p_.mlp_up == p_.mlp_gate + p_.mlp_hidden * d_, "CudaMoeLayer::set_fp8: the FP8 shared "
            "expert reads the gate and up weights as one [2F, D] matrix, but the layout does not keep them adjacent");
}

void CudaMoeLayer::prepare_experts(const CudaBlockContext& c, CudaMoeShared& shared) {
  shared.experts->prepare(c, p_.moe_index, p_);
}

void CudaMoeLayer::recompute_selective(const CudaBlockContext& c, CudaMoeShared& shared) {
  MOE_CHECK(mode_ == Recompute::kSelective, "CudaMoeLayer::recompute_selective: only under selective recompute");
  const cuda::Stream st = c.stream;
  const int64_t n = c.tokens(), d = d_, k = k_, rows = n * k;
  const CudaMoeSaved& s = saved_;
  const Slots& sl = slots_;
  uint16_t* norm = sl.norm->as<uint16_t>();
  cuda::rmsnorm_forward(sl.x->as<uint16_t>(), c.params + p_.mlp_norm, norm, sl.rstd->as<float>(), n, d, norm_eps_, st);
  if (!token_rows_)
    cuda::permute_forward(norm, s.dispatch.sorted_route_R.as<int32_t>(), s.dispatch.route_to_row_R.as<int32_t>(), n,
                          k, d, sl.x_sorted->as<uint16_t>(), st);
  shared.experts->recompute(c, p_.moe_index, p_, s.dispatch.offsets_E1.as<int32_t>(), rows,
                            pooled_y_ ? sl.y_sorted->as<uint16_t>() : nullptr);
  if (p_.shared) mlp_recompute_h_gpu(sl.shared_gate_up->as<uint16_t>(), sl.shared_h->as<uint16_t>(), n, p_.mlp_hidden, st);
}

void CudaMoeLayer::backward(const CudaBlockContext& c, CudaResidual& res, CudaMoeShared& shared,
                            CudaMlpScratch& mlp, const float* dlb, const float* dz) {
  const cuda::Stream st = c.stream;
  cuda::GemmHandle& G = *c.gemm;
  const uint16_t* P = c.params;
  float* Gr = c.grads;
  const int64_t n = c.tokens(), d = d_, e = e_, k = k_, rows = n * k, m = p_.moe_index;
  const CudaMoeSaved& s = saved_;
  const Slots& sl = slots_;
  const uint16_t* norm = sl.norm->as<uint16_t>();
  const uint16_t* dx = res.dx();
  uint16_t* dbranch = res.dbranch();
  // dbranch = d(branch)/d(norm) applied to dx: the shared expert writes it, or it starts at 0.
  c.mark(cuda::Phase::kMlp);
  if (fp8_shared_) {
    mlp_backward_fp8(G, norm, shared_fp8_w_, sl.shared_gate_up->as<uint16_t>(), sl.shared_h->as<uint16_t>(), dx, n, d,
                     p_.mlp_hidden, mlp, dbranch, Gr + p_.mlp_gate, Gr + p_.mlp_up, Gr + p_.mlp_down, c.wgrad_beta(),
                     st);
  } else if (p_.shared) {
    mlp_backward_gpu(G, norm, P + p_.mlp_gate, P + p_.mlp_up, P + p_.mlp_down, sl.shared_gate_up->as<uint16_t>(),
                     sl.shared_h->as<uint16_t>(), dx, n, d, p_.mlp_hidden, mlp, dbranch, false, Gr + p_.mlp_gate,
                     Gr + p_.mlp_up, Gr + p_.mlp_down, c.wgrad_beta(), st);
  } else {
    cuda::device_memset(dbranch, 0, n * d * sizeof(uint16_t), st);
  }

  // Combine.
  c.mark(cuda::Phase::kCombine);
  const int32_t* offsets = s.dispatch.offsets_E1.as<int32_t>();
  const int32_t* route_to_row = s.dispatch.route_to_row_R.as<int32_t>();
  uint16_t* dys = shared.dy_sorted_RD.as<uint16_t>();
  float* dtopk_w = shared.dtopk_w_NK.as<float>();
  const cuda::Fp8Rows dyq = token_rows_ ? cuda::Fp8Rows{} : shared.experts->fp8_input_rows(rows);
  if (dyq.codes != nullptr) {  // FP8 experts: dy's codes in the same pass
    cuda::unpermute_backward_fp8(dx, sl.y_sorted->as<uint16_t>(), s.dispatch.sorted_route_R.as<int32_t>(),
                                 route_to_row, s.topk_w_NK.as<float>(), n, k, d, dys, dtopk_w, dyq.codes, dyq.scales,
                                 st, dyq.rule);
  } else {
    cuda::unpermute_backward(dx, sl.y_sorted->as<uint16_t>(), s.dispatch.sorted_route_R.as<int32_t>(),
                             route_to_row, s.topk_w_NK.as<float>(), n, k, d, dys, dtopk_w, st);
  }

  // Experts, dispatch.
  if (token_rows_) {
    shared.experts->backward_tokens(c, m, p_, offsets, dys, route_to_row, n, k, rows, dbranch);
  } else {
    uint16_t* dxs = dys;  // in place: the experts read dy in full before they write dx
    shared.experts->backward(c, m, p_, offsets, sl.x_sorted->as<uint16_t>(), dys, rows, dxs, dyq.codes != nullptr);
    c.mark(cuda::Phase::kDispatch);
    cuda::permute_backward(dxs, route_to_row, n, k, d, dbranch, st);
  }

  // Router, through the gate GEMM.
  c.mark(cuda::Phase::kRouter);
  float* dl32 = shared.dlogits32_NE.as<float>();
  uint16_t* dl16 = shared.dlogits16_NE.as<uint16_t>();
  cuda::router_backward(s.rp, s.logits_NE.as<float>(), s.scores_NE.as<float>(), s.topk_idx_NK.as<int32_t>(),
                        shared.counts_ME.as<int32_t>() + m * e, dtopk_w, dlb, dz, dl32, st);
  cuda::cast_f32_to_bf16(dl32, dl16, n * e, st);
  cuda::gemm(G, false, false, n, d, e, 1.f, dl16, e, P + p_.router, d, 1.f, dbranch, d, st);
  cuda::gemm(G, true, false, e, d, n, 1.f, dl16, e, norm, d, c.wgrad_beta(), Gr + p_.router, d, st);
  c.mark(cuda::Phase::kMlp);
  cuda::rmsnorm_backward_add(sl.x->as<uint16_t>(), P + p_.mlp_norm, sl.rstd->as<float>(), dbranch, res.dx32(),
                             res.dx(), Gr + p_.mlp_norm, n, d, res.ws_rms.data(), res.ws_rms.bytes(), st);
}

}  // namespace moe

#endif  // MOECORE_HAS_CUDA
