// CudaModel: Model<float>'s forward/backward on the GPU ops, block by block in the same order.
// Residual stream x and its gradient dx are FP32; each update also writes the BF16 copy the
// next op reads (cuda::residual_add), which is what the norms save for their backward.
// Parameter gradients accumulate (+=) in FP32; activation gradients are overwritten.
#ifdef MOECORE_HAS_CUDA

#include "model/cuda_model.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "cuda/ops/attention.h"
#include "cuda/ops/cross_entropy.h"
#include "cuda/ops/embedding.h"
#include "cuda/ops/gemm.h"
#include "cuda/ops/grouped_gemm.h"
#include "cuda/ops/memory.h"
#include "cuda/ops/moe_routing.h"
#include "cuda/ops/rmsnorm.h"
#include "cuda/ops/rope.h"
#include "cuda/ops/swiglu.h"
#include "model/layout.h"

namespace moe {

using cuda::DeviceBuffer;

namespace {

// Same per-layer routing seed as Model<T> (model.cpp).
uint64_t mix_seed(uint64_t seed, uint64_t layer) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (layer + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

template <typename T>
T* grow(DeviceBuffer& b, int64_t n) {
  b.reserve(static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T));
  return b.as<T>();
}

}  // namespace

struct CudaModel::LayerState : LayerParams {
  // Saved activations (BF16 unless noted).
  DeviceBuffer x_in, norm1, rstd1 /*f32*/, q_raw, k_raw, q_rstd /*f32*/, k_rstd /*f32*/, q, k, v, attn,
      lse /*f32*/, x_mid, norm2, rstd2 /*f32*/, mlp_gate_up, mlp_h;
  cuda::RouterParams rp;
  DeviceBuffer logits /*f32*/, scores /*f32*/, topk_idx, topk_w /*f32*/, offsets, sorted_route, route_to_row,
      x_sorted, gate_up, h, y_sorted;
};

struct CudaModel::Impl {
  std::unique_ptr<cuda::GemmHandle> gemm;
  DeviceBuffer params, params_bf16, grads, expert_bias;
  std::vector<std::unique_ptr<LayerState>> layers;
  int64_t emb = 0, fnorm = 0, head = 0;

  // Last forward.
  int64_t batch = 0, seq = 0, num_targets = 0;
  DeviceBuffer inputs, targets, final_in, final_norm, final_rstd, loss, lse, logits_chunk;
  // Device statistics: ce_sum (f64), per-MoE-layer losses [M, 2] f32 and counts [M, E] i32,
  // bad id / bad target counters (u32 each).
  DeviceBuffer ce_sum, moe_losses, counts, bad_ids, bad_targets;
  // Device scalars (f32): backward's ce grad scale, dlb, dz; then 1 (forward's discarded CE gradient).
  DeviceBuffer scalars;
  float host_scalars[4] = {0, 0, 0, 1};
  // Work buffers.
  DeviceBuffer x32, dx32, dx, branch, dtmp, dbranch, dnorm, dq, dk, dv, dattn, dq_raw, dk_raw, mlp_dh, mlp_dgu,
      dy_sorted, dtopk_w, dx_sorted, e_dh, e_dgu, dlogits32, dlogits16, ws_router, ws_dispatch, ws_rms, ws_attn,
      ws_emb;
  size_t ws_router_bytes = 0, ws_dispatch_bytes = 0, ws_rms_bytes = 0, ws_attn_bytes = 0, ws_emb_bytes = 0;
};

CudaModel::CudaModel(const ModelConfig& model, const MoeConfig& moe)
    : mcfg_(model), ecfg_(moe), layout_(build_param_layout(model, moe)), impl_(std::make_unique<Impl>()) {
  MOE_CHECK(ecfg_.capacity_factor == 0.0, "CudaModel: only dropless routing is implemented on the GPU; set "
            "moe.capacity_factor = 0 (got ", ecfg_.capacity_factor, ")");
  MOE_CHECK(cuda::attention_supports_head_dim(mcfg_.head_dim()), "CudaModel: head_dim = d_model / n_heads = ",
            mcfg_.head_dim(), " has no GPU attention kernel (64 or 128)");
  MOE_CHECK(mcfg_.n_heads % mcfg_.n_kv_heads == 0, "CudaModel: n_heads (", mcfg_.n_heads,
            ") must be a multiple of n_kv_heads (", mcfg_.n_kv_heads, ")");
  num_moe_layers_ = moe::num_moe_layers(mcfg_);
  if (num_moe_layers_ > 0) {
    MOE_CHECK(ecfg_.num_experts <= cuda::kMaxRouterExperts && ecfg_.top_k <= cuda::kMaxRouterTopK,
              "CudaModel: the GPU router takes at most ", cuda::kMaxRouterExperts, " experts and top_k <= ",
              cuda::kMaxRouterTopK, ", got E=", ecfg_.num_experts, " top_k=", ecfg_.top_k);
    MOE_CHECK(mcfg_.d_model % 8 == 0 && ecfg_.expert_hidden % 8 == 0,
              "CudaModel: grouped expert GEMMs need d_model and expert_hidden multiples of 8, got ", mcfg_.d_model,
              " and ", ecfg_.expert_hidden);
  }
  Impl& I = *impl_;
  stream_ = cuda::stream_create();
  I.gemm = std::make_unique<cuda::GemmHandle>();
  const int64_t total = layout_.total_numel();
  grow<float>(I.params, total);
  grow<uint16_t>(I.params_bf16, total);
  grow<float>(I.grads, total);
  cuda::device_memset(I.params.data(), 0, total * sizeof(float), stream_);
  cuda::device_memset(I.params_bf16.data(), 0, total * sizeof(uint16_t), stream_);
  cuda::device_memset(I.grads.data(), 0, total * sizeof(float), stream_);
  const int64_t e = ecfg_.num_experts, m = std::max<int64_t>(num_moe_layers_, 1);
  grow<float>(I.expert_bias, m * e);
  cuda::device_memset(I.expert_bias.data(), 0, m * e * sizeof(float), stream_);
  grow<double>(I.ce_sum, 1);
  grow<float>(I.moe_losses, 2 * m);
  grow<int32_t>(I.counts, m * e);
  grow<uint32_t>(I.bad_ids, 1);
  grow<uint32_t>(I.bad_targets, 1);
  grow<float>(I.scalars, 4);
  cuda::copy_h2d(I.scalars.data(), I.host_scalars, sizeof(I.host_scalars), stream_);
  cuda::device_memset(I.moe_losses.data(), 0, 2 * m * sizeof(float), stream_);
  cuda::device_memset(I.counts.data(), 0, m * e * sizeof(int32_t), stream_);
  cuda::device_memset(I.ce_sum.data(), 0, sizeof(double), stream_);

  I.emb = layout_.find("model.embed_tokens.weight").offset;
  I.fnorm = layout_.find("model.norm.weight").offset;
  I.head = layout_.find("lm_head.weight").offset;
  for (const LayerParams& p : layer_params(layout_, mcfg_, ecfg_)) {
    auto s = std::make_unique<LayerState>();
    static_cast<LayerParams&>(*s) = p;
    I.layers.push_back(std::move(s));
  }
  cuda::stream_sync(stream_);
}

CudaModel::~CudaModel() {
  if (stream_ != nullptr) {
    try {
      cuda::stream_sync(stream_);
    } catch (...) {
    }
  }
  impl_.reset();
  cuda::stream_destroy(stream_);
}

float* CudaModel::params() { return impl_->params.as<float>(); }
uint16_t* CudaModel::params_bf16() { return impl_->params_bf16.as<uint16_t>(); }
float* CudaModel::grads() { return impl_->grads.as<float>(); }

void CudaModel::load_params(const float* host_params) {
  const int64_t total = layout_.total_numel();
  cuda::copy_h2d(params(), host_params, total * sizeof(float), stream_);
  refresh_bf16();
  cuda::stream_sync(stream_);
}

void CudaModel::load_expert_bias(const std::vector<float>& bias) {
  const int64_t want = num_moe_layers_ * ecfg_.num_experts;
  MOE_CHECK(static_cast<int64_t>(bias.size()) == want, "CudaModel::load_expert_bias: expected ", want,
            " values (MoE layers x experts), got ", bias.size());
  cuda::copy_h2d(impl_->expert_bias.data(), bias.data(), want * sizeof(float), stream_);
  cuda::stream_sync(stream_);
}

void CudaModel::refresh_bf16() { cuda::cast_f32_to_bf16(params(), params_bf16(), layout_.total_numel(), stream_); }

std::vector<float> CudaModel::download_params() {
  std::vector<float> h(static_cast<size_t>(layout_.total_numel()));
  cuda::copy_d2h(h.data(), params(), h.size() * sizeof(float), stream_);
  return h;
}

std::vector<float> CudaModel::download_grads() {
  std::vector<float> h(static_cast<size_t>(layout_.total_numel()));
  cuda::copy_d2h(h.data(), grads(), h.size() * sizeof(float), stream_);
  return h;
}

void CudaModel::zero_grads() { cuda::device_memset(grads(), 0, layout_.total_numel() * sizeof(float), stream_); }

namespace {

// SwiGLU MLP (dense layers, shared expert) on the GPU, as mlp.cpp: gate/up GEMMs write the
// halves of one [N, 2F] buffer. out (BF16) = MLP(x) (+= when accumulate).
void mlp_forward_gpu(cuda::GemmHandle& g, const uint16_t* x, const uint16_t* wg, const uint16_t* wu,
                     const uint16_t* wd, int64_t n, int64_t d, int64_t f, uint16_t* gu, uint16_t* h, uint16_t* out,
                     bool accumulate, cuda::Stream st) {
  cuda::gemm(g, false, true, n, f, d, 1.f, x, d, wg, d, 0.f, gu, 2 * f, st);
  cuda::gemm(g, false, true, n, f, d, 1.f, x, d, wu, d, 0.f, gu + f, 2 * f, st);
  cuda::swiglu_forward(gu, h, n, f, st);
  cuda::gemm(g, false, true, n, d, f, 1.f, h, f, wd, f, accumulate ? 1.f : 0.f, out, d, st);
}

// dx (BF16, overwritten unless accumulate_dx), weight gradients (FP32) +=.
void mlp_backward_gpu(cuda::GemmHandle& g, const uint16_t* x, const uint16_t* wg, const uint16_t* wu,
                      const uint16_t* wd, const uint16_t* gu, const uint16_t* h, const uint16_t* dout, int64_t n,
                      int64_t d, int64_t f, uint16_t* dh, uint16_t* dgu, uint16_t* dx, bool accumulate_dx,
                      float* dwg, float* dwu, float* dwd, cuda::Stream st) {
  cuda::gemm(g, false, false, n, f, d, 1.f, dout, d, wd, f, 0.f, dh, f, st);
  cuda::gemm(g, true, false, d, f, n, 1.f, dout, d, h, f, 1.f, dwd, f, st);
  cuda::swiglu_backward(gu, dh, dgu, n, f, st);
  cuda::gemm(g, true, false, f, d, n, 1.f, dgu, 2 * f, x, d, 1.f, dwg, d, st);
  cuda::gemm(g, true, false, f, d, n, 1.f, dgu + f, 2 * f, x, d, 1.f, dwu, d, st);
  cuda::gemm(g, false, false, n, d, f, 1.f, dgu, 2 * f, wg, d, accumulate_dx ? 1.f : 0.f, dx, d, st);
  cuda::gemm(g, false, false, n, d, f, 1.f, dgu + f, 2 * f, wu, d, 1.f, dx, d, st);
}

}  // namespace

void CudaModel::forward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                        uint64_t routing_seed) {
  MOE_CHECK(batch > 0 && seq > 0, "CudaModel::forward: batch and sequence must be positive, got batch=", batch,
            " seq=", seq);
  Impl& I = *impl_;
  cuda::Stream st = stream_;
  cuda::GemmHandle& G = *I.gemm;
  const int64_t n = batch * seq, d = mcfg_.d_model, hd = mcfg_.head_dim();
  const int64_t hq = mcfg_.n_heads, hkv = mcfg_.n_kv_heads, q = hq * hd, kv = hkv * hd;
  const int64_t v = mcfg_.vocab_size, e = ecfg_.num_experts, k = ecfg_.top_k;
  const int64_t inner = ecfg_.expert_hidden, rows = n * k;
  const uint16_t* P = params_bf16();
  I.batch = batch;
  I.seq = seq;
  I.num_targets = 0;
  for (int64_t i = 0; i < n; ++i) I.num_targets += targets[i] >= 0 ? 1 : 0;

  cuda::copy_h2d(grow<int32_t>(I.inputs, n), inputs, n * sizeof(int32_t), st);
  cuda::copy_h2d(grow<int32_t>(I.targets, n), targets, n * sizeof(int32_t), st);
  cuda::device_memset(I.ce_sum.data(), 0, sizeof(double), st);
  cuda::device_memset(I.bad_ids.data(), 0, sizeof(uint32_t), st);
  cuda::device_memset(I.bad_targets.data(), 0, sizeof(uint32_t), st);

  float* x32 = grow<float>(I.x32, n * d);
  uint16_t* branch = grow<uint16_t>(I.branch, n * d);
  // Embedding into the first saved BF16 residual copy, then x32 = float(x).
  LayerState* first = I.layers.empty() ? nullptr : I.layers[0].get();
  uint16_t* x16 = first ? grow<uint16_t>(first->x_in, n * d) : grow<uint16_t>(I.final_in, n * d);
  cuda::embedding_forward(I.inputs.as<int32_t>(), P + I.emb, x16, n, v, d, I.bad_ids.as<uint32_t>(), st);
  cuda::device_memset(x32, 0, n * d * sizeof(float), st);
  cuda::residual_add(x32, x16, nullptr, n * d, st);

  for (int64_t l = 0; l < mcfg_.n_layers; ++l) {
    LayerState& s = *I.layers[l];
    const uint16_t* xin = s.x_in.as<uint16_t>();
    // Attention branch.
    uint16_t* norm1 = grow<uint16_t>(s.norm1, n * d);
    float* rstd1 = grow<float>(s.rstd1, n);
    cuda::rmsnorm_forward(xin, P + s.ln1, norm1, rstd1, n, d, mcfg_.norm_eps, st);
    uint16_t* qb = grow<uint16_t>(s.q, n * q);
    uint16_t* kb = grow<uint16_t>(s.k, n * kv);
    uint16_t* vb = grow<uint16_t>(s.v, n * kv);
    if (mcfg_.qk_norm) {
      uint16_t* q_raw = grow<uint16_t>(s.q_raw, n * q);
      uint16_t* k_raw = grow<uint16_t>(s.k_raw, n * kv);
      cuda::gemm(G, false, true, n, q, d, 1.f, norm1, d, P + s.wq, d, 0.f, q_raw, q, st);
      cuda::gemm(G, false, true, n, kv, d, 1.f, norm1, d, P + s.wk, d, 0.f, k_raw, kv, st);
      cuda::rmsnorm_forward(q_raw, P + s.qn, qb, grow<float>(s.q_rstd, n), n, q, mcfg_.norm_eps, st);
      cuda::rmsnorm_forward(k_raw, P + s.kn, kb, grow<float>(s.k_rstd, n), n, kv, mcfg_.norm_eps, st);
    } else {
      cuda::gemm(G, false, true, n, q, d, 1.f, norm1, d, P + s.wq, d, 0.f, qb, q, st);
      cuda::gemm(G, false, true, n, kv, d, 1.f, norm1, d, P + s.wk, d, 0.f, kb, kv, st);
    }
    cuda::gemm(G, false, true, n, kv, d, 1.f, norm1, d, P + s.wv, d, 0.f, vb, kv, st);
    cuda::rope_forward(qb, batch, seq, hq, hd, mcfg_.rope_theta, st);
    cuda::rope_forward(kb, batch, seq, hkv, hd, mcfg_.rope_theta, st);
    uint16_t* attn = grow<uint16_t>(s.attn, n * q);
    cuda::attention_forward(qb, kb, vb, attn, grow<float>(s.lse, batch * hq * seq), batch, seq, hq, hkv, hd, st);
    cuda::gemm(G, false, true, n, d, q, 1.f, attn, q, P + s.wo, q, 0.f, branch, d, st);
    uint16_t* xmid = grow<uint16_t>(s.x_mid, n * d);
    cuda::residual_add(x32, branch, xmid, n * d, st);

    // MLP / MoE branch.
    uint16_t* norm2 = grow<uint16_t>(s.norm2, n * d);
    cuda::rmsnorm_forward(xmid, P + s.ln2, norm2, grow<float>(s.rstd2, n), n, d, mcfg_.norm_eps, st);
    if (s.dense || s.shared) {
      uint16_t* gu = grow<uint16_t>(s.mlp_gate_up, n * 2 * s.mlp_hidden);
      uint16_t* h = grow<uint16_t>(s.mlp_h, n * s.mlp_hidden);
      if (s.dense) {
        mlp_forward_gpu(G, norm2, P + s.mg, P + s.mu, P + s.md, n, d, s.mlp_hidden, gu, h, branch, false, st);
      }
    }
    if (!s.dense) {
      s.rp.num_tokens = n;
      s.rp.num_experts = e;
      s.rp.top_k = k;
      s.rp.score = ecfg_.router == "sigmoid" ? cuda::ScoreFunc::kSigmoid : cuda::ScoreFunc::kSoftmax;
      s.rp.norm_topk = ecfg_.norm_topk_prob;
      s.rp.mode = ecfg_.routing == "random"    ? cuda::RoutingMode::kRandom
                  : ecfg_.routing == "uniform" ? cuda::RoutingMode::kUniform
                                               : cuda::RoutingMode::kLearned;
      s.rp.seed = mix_seed(routing_seed, static_cast<uint64_t>(l));
      float* logits = grow<float>(s.logits, n * e);
      cuda::gemm(G, false, true, n, e, d, 1.f, norm2, d, P + s.gate, d, 0.f, logits, e, st);
      const size_t rws = cuda::router_workspace_bytes(s.rp);
      I.ws_router.reserve(rws);
      int32_t* counts = I.counts.as<int32_t>() + s.moe_index * e;
      int32_t* topk_idx = grow<int32_t>(s.topk_idx, n * k);
      float* topk_w = grow<float>(s.topk_w, n * k);
      cuda::router_forward(s.rp, logits, I.expert_bias.as<float>() + s.moe_index * e, grow<float>(s.scores, n * e),
                           topk_idx, topk_w, counts, nullptr, I.moe_losses.as<float>() + 2 * s.moe_index,
                           I.ws_router.data(), I.ws_router.bytes(), st);
      const size_t dws = cuda::dispatch_map_workspace_bytes(n, k, e);
      I.ws_dispatch.reserve(dws);
      int32_t* offsets = grow<int32_t>(s.offsets, e + 1);
      int32_t* sorted_route = grow<int32_t>(s.sorted_route, rows);
      int32_t* route_to_row = grow<int32_t>(s.route_to_row, rows);
      cuda::build_dispatch_map(topk_idx, n, k, e, 0, counts, offsets, sorted_route, route_to_row, nullptr,
                               I.ws_dispatch.data(), I.ws_dispatch.bytes(), st);
      uint16_t* xs = grow<uint16_t>(s.x_sorted, rows * d);
      cuda::permute_forward(norm2, sorted_route, n, k, d, xs, st);
      uint16_t* gu = grow<uint16_t>(s.gate_up, rows * 2 * inner);
      uint16_t* h = grow<uint16_t>(s.h, rows * inner);
      uint16_t* ys = grow<uint16_t>(s.y_sorted, rows * d);
      cuda::grouped_gemm_forward(xs, P + s.e_gate_up, offsets, gu, rows, e, 2 * inner, d, st);
      cuda::swiglu_forward(gu, h, rows, inner, st);
      cuda::grouped_gemm_forward(h, P + s.e_down, offsets, ys, rows, e, d, inner, st);
      cuda::unpermute_forward(ys, route_to_row, topk_w, n, k, d, branch, st);
      if (s.shared) {
        mlp_forward_gpu(G, norm2, P + s.mg, P + s.mu, P + s.md, n, d, s.mlp_hidden, s.mlp_gate_up.as<uint16_t>(),
                        s.mlp_h.as<uint16_t>(), branch, true, st);
      }
    }
    uint16_t* next = l + 1 < mcfg_.n_layers ? grow<uint16_t>(I.layers[l + 1]->x_in, n * d)
                                            : grow<uint16_t>(I.final_in, n * d);
    cuda::residual_add(x32, branch, next, n * d, st);
  }

  // Final norm; LM head and cross-entropy chunk by chunk (losses only: backward recomputes).
  uint16_t* fin = grow<uint16_t>(I.final_in, n * d);
  uint16_t* fnorm = grow<uint16_t>(I.final_norm, n * d);
  cuda::rmsnorm_forward(fin, P + I.fnorm, fnorm, grow<float>(I.final_rstd, n), n, d, mcfg_.norm_eps, st);
  const int64_t chunk = std::min(n, kHeadChunkRows);
  uint16_t* lg = grow<uint16_t>(I.logits_chunk, chunk * v);
  float* loss = grow<float>(I.loss, n);
  float* lse = grow<float>(I.lse, n);
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t c = std::min(chunk, n - r0);
    cuda::gemm(G, false, true, c, v, d, 1.f, fnorm + r0 * d, d, P + I.head, d, 0.f, lg, v, st);
    cuda::cross_entropy_forward_backward(lg, lg, I.targets.as<int32_t>() + r0, loss + r0, lse + r0, c, v, 0.0,
                                         I.scalars.as<float>() + 3, I.ce_sum.as<double>(),
                                         I.bad_targets.as<uint32_t>(), st);
  }
}

void CudaModel::backward(const LossScales& scales) {
  Impl& I = *impl_;
  MOE_CHECK(I.batch > 0, "CudaModel::backward called before forward");
  cuda::Stream st = stream_;
  cuda::GemmHandle& G = *I.gemm;
  const int64_t batch = I.batch, seq = I.seq;
  const int64_t n = batch * seq, d = mcfg_.d_model, hd = mcfg_.head_dim();
  const int64_t hq = mcfg_.n_heads, hkv = mcfg_.n_kv_heads, q = hq * hd, kv = hkv * hd;
  const int64_t v = mcfg_.vocab_size, e = ecfg_.num_experts, k = ecfg_.top_k;
  const int64_t inner = ecfg_.expert_hidden, rows = n * k;
  const uint16_t* P = params_bf16();
  float* Gr = grads();

  // Device scalars: ce grad scale, dlb, dz (the per-layer share of the mean over MoE layers).
  I.host_scalars[0] = static_cast<float>(scales.ce_scale);
  I.host_scalars[1] = num_moe_layers_ ? static_cast<float>(scales.lb_scale / double(num_moe_layers_)) : 0.f;
  I.host_scalars[2] = num_moe_layers_ ? static_cast<float>(scales.z_scale / double(num_moe_layers_)) : 0.f;
  cuda::copy_h2d(I.scalars.data(), I.host_scalars, 3 * sizeof(float), st);
  const float* ce_scale = I.scalars.as<float>();
  const float* dlb = ce_scale + 1;
  const float* dz = ce_scale + 2;

  // Workspaces.
  const int64_t widest = std::max({d, q, kv});
  I.ws_rms.reserve(std::max<size_t>(cuda::rmsnorm_backward_workspace_bytes(n, widest), 16));
  I.ws_attn.reserve(std::max<size_t>(cuda::attention_backward_workspace_bytes(batch, seq, hq), 16));
  I.ws_emb.reserve(std::max<size_t>(cuda::embedding_backward_workspace_bytes(n, v), 16));

  // LM head, chunk by chunk: logits again, fused CE gradient in place, dnorm and dW_head.
  uint16_t* dnorm = grow<uint16_t>(I.dnorm, n * d);
  const uint16_t* fnorm = I.final_norm.as<uint16_t>();
  const int64_t chunk = std::min(n, kHeadChunkRows);
  uint16_t* lg = grow<uint16_t>(I.logits_chunk, chunk * v);
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t c = std::min(chunk, n - r0);
    cuda::gemm(G, false, true, c, v, d, 1.f, fnorm + r0 * d, d, P + I.head, d, 0.f, lg, v, st);
    cuda::cross_entropy_forward_backward(lg, lg, I.targets.as<int32_t>() + r0, I.loss.as<float>() + r0,
                                         I.lse.as<float>() + r0, c, v, 0.0, ce_scale, nullptr,
                                         I.bad_targets.as<uint32_t>(), st);
    cuda::gemm(G, false, false, c, d, v, 1.f, lg, v, P + I.head, d, 0.f, dnorm + r0 * d, d, st);
    cuda::gemm(G, true, false, v, d, c, 1.f, lg, v, fnorm + r0 * d, d, 1.f, Gr + I.head, d, st);
  }
  uint16_t* dtmp = grow<uint16_t>(I.dtmp, n * d);
  float* dx32 = grow<float>(I.dx32, n * d);
  uint16_t* dx = grow<uint16_t>(I.dx, n * d);
  cuda::rmsnorm_backward(I.final_in.as<uint16_t>(), P + I.fnorm, I.final_rstd.as<float>(), dnorm, dtmp,
                         Gr + I.fnorm, n, d, I.ws_rms.data(), I.ws_rms.bytes(), st);
  cuda::device_memset(dx32, 0, n * d * sizeof(float), st);
  cuda::residual_add(dx32, dtmp, dx, n * d, st);

  uint16_t* dbranch = grow<uint16_t>(I.dbranch, n * d);
  uint16_t* dq = grow<uint16_t>(I.dq, n * q);
  uint16_t* dk = grow<uint16_t>(I.dk, n * kv);
  uint16_t* dv = grow<uint16_t>(I.dv, n * kv);
  uint16_t* dattn = grow<uint16_t>(I.dattn, n * q);
  for (int64_t l = mcfg_.n_layers - 1; l >= 0; --l) {
    LayerState& s = *I.layers[l];
    const uint16_t* norm2 = s.norm2.as<uint16_t>();
    // MLP / MoE branch: dbranch = d(branch)/d(norm2) applied to dx.
    if (s.dense || s.shared) {
      const int64_t f = s.mlp_hidden;
      mlp_backward_gpu(G, norm2, P + s.mg, P + s.mu, P + s.md, s.mlp_gate_up.as<uint16_t>(), s.mlp_h.as<uint16_t>(),
                       dx, n, d, f, grow<uint16_t>(I.mlp_dh, n * f), grow<uint16_t>(I.mlp_dgu, n * 2 * f), dbranch,
                       false, Gr + s.mg, Gr + s.mu, Gr + s.md, st);
    }
    if (!s.dense) {
      if (!s.shared) cuda::device_memset(dbranch, 0, n * d * sizeof(uint16_t), st);
      const int32_t* offsets = s.offsets.as<int32_t>();
      uint16_t* dys = grow<uint16_t>(I.dy_sorted, rows * d);
      float* dtopk_w = grow<float>(I.dtopk_w, n * k);
      cuda::unpermute_backward(dx, s.y_sorted.as<uint16_t>(), s.sorted_route.as<int32_t>(),
                               s.route_to_row.as<int32_t>(), s.topk_w.as<float>(), n, k, d, dys, dtopk_w, st);
      uint16_t* edh = grow<uint16_t>(I.e_dh, rows * inner);
      uint16_t* edgu = grow<uint16_t>(I.e_dgu, rows * 2 * inner);
      uint16_t* dxs = grow<uint16_t>(I.dx_sorted, rows * d);
      cuda::grouped_gemm_dgrad(dys, P + s.e_down, offsets, edh, rows, e, d, inner, st);
      cuda::grouped_gemm_wgrad(dys, s.h.as<uint16_t>(), offsets, Gr + s.e_down, rows, e, d, inner, true, st);
      cuda::swiglu_backward(s.gate_up.as<uint16_t>(), edh, edgu, rows, inner, st);
      cuda::grouped_gemm_dgrad(edgu, P + s.e_gate_up, offsets, dxs, rows, e, 2 * inner, d, st);
      cuda::grouped_gemm_wgrad(edgu, s.x_sorted.as<uint16_t>(), offsets, Gr + s.e_gate_up, rows, e, 2 * inner, d,
                               true, st);
      cuda::permute_backward(dxs, s.route_to_row.as<int32_t>(), n, k, d, dbranch, st);
      float* dl32 = grow<float>(I.dlogits32, n * e);
      uint16_t* dl16 = grow<uint16_t>(I.dlogits16, n * e);
      cuda::router_backward(s.rp, s.logits.as<float>(), s.scores.as<float>(), s.topk_idx.as<int32_t>(),
                            I.counts.as<int32_t>() + s.moe_index * e, dtopk_w, dlb, dz, dl32, st);
      cuda::cast_f32_to_bf16(dl32, dl16, n * e, st);
      cuda::gemm(G, false, false, n, d, e, 1.f, dl16, e, P + s.gate, d, 1.f, dbranch, d, st);
      cuda::gemm(G, true, false, e, d, n, 1.f, dl16, e, norm2, d, 1.f, Gr + s.gate, d, st);
    }
    cuda::rmsnorm_backward(s.x_mid.as<uint16_t>(), P + s.ln2, s.rstd2.as<float>(), dbranch, dtmp, Gr + s.ln2, n, d,
                           I.ws_rms.data(), I.ws_rms.bytes(), st);
    cuda::residual_add(dx32, dtmp, dx, n * d, st);

    // Attention branch.
    const uint16_t* attn = s.attn.as<uint16_t>();
    const uint16_t* norm1 = s.norm1.as<uint16_t>();
    cuda::gemm(G, false, false, n, q, d, 1.f, dx, d, P + s.wo, q, 0.f, dattn, q, st);
    cuda::gemm(G, true, false, d, q, n, 1.f, dx, d, attn, q, 1.f, Gr + s.wo, q, st);
    cuda::attention_backward(s.q.as<uint16_t>(), s.k.as<uint16_t>(), s.v.as<uint16_t>(), attn, s.lse.as<float>(),
                             dattn, dq, dk, dv, batch, seq, hq, hkv, hd, I.ws_attn.data(), I.ws_attn.bytes(), st);
    cuda::rope_backward(dq, batch, seq, hq, hd, mcfg_.rope_theta, st);
    cuda::rope_backward(dk, batch, seq, hkv, hd, mcfg_.rope_theta, st);
    const uint16_t* gq = dq;
    const uint16_t* gk = dk;
    if (mcfg_.qk_norm) {
      uint16_t* dq_raw = grow<uint16_t>(I.dq_raw, n * q);
      uint16_t* dk_raw = grow<uint16_t>(I.dk_raw, n * kv);
      cuda::rmsnorm_backward(s.q_raw.as<uint16_t>(), P + s.qn, s.q_rstd.as<float>(), dq, dq_raw, Gr + s.qn, n, q,
                             I.ws_rms.data(), I.ws_rms.bytes(), st);
      cuda::rmsnorm_backward(s.k_raw.as<uint16_t>(), P + s.kn, s.k_rstd.as<float>(), dk, dk_raw, Gr + s.kn, n, kv,
                             I.ws_rms.data(), I.ws_rms.bytes(), st);
      gq = dq_raw;
      gk = dk_raw;
    }
    cuda::gemm(G, false, false, n, d, q, 1.f, gq, q, P + s.wq, d, 0.f, dbranch, d, st);
    cuda::gemm(G, false, false, n, d, kv, 1.f, gk, kv, P + s.wk, d, 1.f, dbranch, d, st);
    cuda::gemm(G, false, false, n, d, kv, 1.f, dv, kv, P + s.wv, d, 1.f, dbranch, d, st);
    cuda::gemm(G, true, false, q, d, n, 1.f, gq, q, norm1, d, 1.f, Gr + s.wq, d, st);
    cuda::gemm(G, true, false, kv, d, n, 1.f, gk, kv, norm1, d, 1.f, Gr + s.wk, d, st);
    cuda::gemm(G, true, false, kv, d, n, 1.f, dv, kv, norm1, d, 1.f, Gr + s.wv, d, st);
    cuda::rmsnorm_backward(s.x_in.as<uint16_t>(), P + s.ln1, s.rstd1.as<float>(), dbranch, dtmp, Gr + s.ln1, n, d,
                           I.ws_rms.data(), I.ws_rms.bytes(), st);
    cuda::residual_add(dx32, dtmp, dx, n * d, st);
  }
  cuda::embedding_backward(I.inputs.as<int32_t>(), dx, Gr + I.emb, n, v, d, I.bad_ids.as<uint32_t>(),
                           I.ws_emb.data(), I.ws_emb.bytes(), st);
}

ForwardStats CudaModel::read_stats() {
  Impl& I = *impl_;
  MOE_CHECK(I.batch > 0, "CudaModel::read_stats called before forward");
  const int64_t n = I.batch * I.seq, e = ecfg_.num_experts, m = num_moe_layers_;
  ForwardStats s;
  double ce = 0;
  uint32_t bad[2] = {0, 0};
  std::vector<float> losses(static_cast<size_t>(2 * std::max<int64_t>(m, 1)));
  std::vector<int32_t> counts(static_cast<size_t>(std::max<int64_t>(m, 1) * e));
  cuda::copy_d2h(&ce, I.ce_sum.data(), sizeof(double), stream_);
  cuda::copy_d2h(&bad[0], I.bad_ids.data(), sizeof(uint32_t), stream_);
  cuda::copy_d2h(&bad[1], I.bad_targets.data(), sizeof(uint32_t), stream_);
  cuda::copy_d2h(losses.data(), I.moe_losses.data(), losses.size() * sizeof(float), stream_);
  cuda::copy_d2h(counts.data(), I.counts.data(), counts.size() * sizeof(int32_t), stream_);
  MOE_CHECK(bad[0] == 0, "CudaModel: ", bad[0], " input token ids outside [0, vocab_size = ", mcfg_.vocab_size, ")");
  MOE_CHECK(bad[1] == 0, "CudaModel: ", bad[1], " targets >= vocab_size = ", mcfg_.vocab_size);
  s.ce_sum = ce;
  s.num_targets = I.num_targets;
  for (int64_t l = 0; l < m; ++l) {
    s.lb_loss += losses[2 * l];
    s.z_loss += losses[2 * l + 1];
    s.tokens_per_expert.emplace_back(counts.begin() + l * e, counts.begin() + (l + 1) * e);
  }
  if (m > 0) {
    s.lb_loss /= double(m);
    s.z_loss /= double(m);
  }
  s.num_routes = m * n * ecfg_.top_k;
  s.num_dropped = 0;
  return s;
}

}  // namespace moe

#endif  // MOECORE_HAS_CUDA
