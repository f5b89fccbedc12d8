// CudaModel: Model<float>'s forward/backward on the GPU ops, block by block in the same order.
// Residual stream x and its gradient dx are FP32; each update also writes the BF16 copy the
// next op reads (cuda::residual_add), which is what the norms save for their backward.
// Parameter gradients accumulate (+=) in FP32; activation gradients are overwritten. All buffers
// are sized in one place (ensure_capacity) so forward/backward never allocate once sized, except
// the received rows of expert parallelism, which grow right after the host read the counts.
// Expert parallelism per MoE layer: counts exchanged (NCCL all-to-all of L int32 per peer), read
// on the host with the router's counts, the exchange plan, rows out, regroup, local experts,
// ungroup, rows back; backward the same with dy and dx rows (cuda/ops/ep_exchange.h).
#ifdef MOECORE_HAS_CUDA

#include "model/cuda_model.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>

#include "core/error.h"
#include "cuda/event_timer.h"
#include "cuda/ops/attention.h"
#include "cuda/ops/cross_entropy.h"
#include "cuda/ops/embedding.h"
#include "cuda/ops/ep_exchange.h"
#include "cuda/ops/init.h"
#include "cuda/ops/nccl.h"
#include "cuda/ops/gemm.h"
#include "cuda/ops/grouped_gemm.h"
#include "cuda/ops/memory.h"
#include "cuda/ops/moe_routing.h"
#include "cuda/ops/rmsnorm.h"
#include "cuda/ops/rope.h"
#include "cuda/ops/step_stats.h"
#include "cuda/ops/swiglu.h"
#include "model/layout.h"

namespace moe {

using cuda::DeviceBuffer;

struct CudaModel::LayerState : LayerParams {
  // Saved activations (BF16 unless noted).
  DeviceBuffer x_in, norm1, rstd1 /*f32*/, q_raw, k_raw, q_rstd /*f32*/, k_rstd /*f32*/, q, k, v, attn,
      lse /*f32*/, x_mid, norm2, rstd2 /*f32*/, mlp_gate_up, mlp_h;
  cuda::RouterParams rp;
  DeviceBuffer logits /*f32*/, scores /*f32*/, topk_idx, topk_w /*f32*/, offsets, sorted_route, route_to_row,
      x_sorted, gate_up, h, y_sorted;
  // Expert parallelism: the last forward's exchange plan; regroup / ungroup maps [G] and local
  // expert offsets [L+1] on the device; received rows regrouped by local expert [G, D] (saved).
  cuda::EpHandle plan;
  DeviceBuffer regroup, ungroup, local_offsets, x_recv;
};

struct CudaModel::Impl {
  cuda::Stream stream = nullptr;
  std::unique_ptr<cuda::GemmHandle> gemm;
  DeviceBuffer params, params_bf16, grads, expert_bias;
  std::vector<std::unique_ptr<LayerState>> layers;
  int64_t emb = 0, fnorm = 0, head = 0;

  // Buffer reallocations so far; embedding_backward_workspace_bytes by token count (a device
  // query, so it is asked once per shape, never during capture).
  int64_t generation = 0;
  std::map<int64_t, size_t> emb_ws_bytes;

  // Last forward: shape and the device token ids backward reads.
  int64_t batch = 0, seq = 0;
  const int32_t* cur_inputs = nullptr;
  const int32_t* cur_targets = nullptr;
  int64_t host_num_targets = 0;  // targets of host-id forwards since reset_stats()
  int64_t num_forwards = 0, num_routes = 0;  // forwards and their routes since reset_stats()
  DeviceBuffer inputs, targets, final_in, final_norm, final_rstd, loss, lse, logits_chunk;
  // Per forward, written by the router per MoE layer: losses [M, 2] f32 and counts [M, E] i32.
  DeviceBuffer moe_losses, counts;
  // Statistics record (cuda::StepStatsRecord + int64 counts [M, E]); backward's bad id / target
  // counters (u32 [2], never read: the forward's counts are the ones reported).
  DeviceBuffer stats, bwd_bad;
  size_t stats_bytes = 0;
  // Device scalars (f32): backward's ce grad scale, dlb, dz; then 1 (forward's discarded CE gradient).
  DeviceBuffer scalars;
  float host_scalars[4] = {0, 0, 0, 1};
  // Expert parallelism: received counts [ep * L] (i32), peer-major row buffer and expert-side
  // work rows (each [Gmax, D] BF16), host copies of the counts, traffic counters.
  DeviceBuffer ep_recv_counts, ep_pm, ep_work;
  std::vector<int32_t> ep_host_counts;
  EpTraffic traffic;
  // Work buffers.
  DeviceBuffer x32, dx32, dx, branch, dtmp, dbranch, dnorm, dq, dk, dv, dattn, dq_raw, dk_raw, mlp_dh, mlp_dgu,
      dy_sorted, dtopk_w, dx_sorted, e_dh, e_dgu, dlogits32, dlogits16, ws_router, ws_dispatch, ws_rms, ws_attn,
      ws_emb;

  // Ensures `b` holds n elements of T (at least one). Growing while the stream is captured would
  // free memory a graph node may already point at, so it throws instead.
  template <typename T>
  void grow(DeviceBuffer& b, int64_t n, const char* what) {
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T);
    if (bytes <= b.bytes()) return;
    MOE_CHECK(!cuda::stream_is_capturing(stream), "CudaModel: buffer '", what, "' would grow from ", b.bytes(),
              " to ", bytes, " bytes during graph capture; call reserve(batch, seq) with the step's shape "
              "before capturing");
    b.reserve(bytes);
    ++generation;
  }
  void grow_bytes(DeviceBuffer& b, size_t bytes, const char* what) {
    grow<uint8_t>(b, static_cast<int64_t>(std::max<size_t>(bytes, 16)), what);
  }
};

namespace {

ExpertSlice ep_slice(const MoeConfig& moe, const CudaExpertParallel* ep) {
  if (ep == nullptr || ep->comm == nullptr || ep->comm->size() <= 1) return {};
  const int64_t n = ep->comm->size();
  MOE_CHECK(moe.num_experts >= n && moe.num_experts % n == 0, "CudaModel: expert parallelism over ", n,
            " GPUs needs moe.num_experts divisible by ", n, ", got ", moe.num_experts);
  const int64_t local = moe.num_experts / n;
  return {ep->comm->rank() * local, local};
}

}  // namespace

CudaModel::CudaModel(const ModelConfig& model, const MoeConfig& moe, const CudaExpertParallel* ep)
    : mcfg_(model),
      ecfg_(moe),
      ep_comm_(ep && ep->comm && ep->comm->size() > 1 ? ep->comm : nullptr),
      ep_size_(ep_comm_ ? ep_comm_->size() : 1),
      ep_rank_(ep_comm_ ? ep_comm_->rank() : 0),
      slice_(ep_slice(moe, ep)),
      layout_(build_param_layout(model, moe, slice_)),
      impl_(std::make_unique<Impl>()) {
  for (const ParamEntry& entry : layout_.entries()) placements_.push_back(global_placement(entry, ep_size_, ep_rank_));
  if (ep_comm_) {
    MOE_CHECK(ep_comm_->device() == cuda::current_device(), "CudaModel: the expert-parallel NCCL communicator was "
              "made on GPU ", ep_comm_->device(), " but the current GPU is ", cuda::current_device());
  }
  MOE_CHECK(ecfg_.capacity_factor == 0.0, "CudaModel: only dropless routing is implemented on the GPU; set "
            "moe.capacity_factor = 0 (got ", ecfg_.capacity_factor, ")");
  const cuda::AttentionBackend attention_backend = cuda::attention_resolve_backend();
  MOE_CHECK(cuda::attention_supports_head_dim(mcfg_.head_dim(), attention_backend),
            "CudaModel: head_dim = d_model / n_heads = ", mcfg_.head_dim(), " has no GPU attention kernel in the '",
            cuda::attention_backend_name(attention_backend),
            "' attention backend (own: 64 or 128; cudnn: multiples of 8 up to 256; MOECORE_ATTENTION chooses)");
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
  I.stream = stream_;
  I.gemm = std::make_unique<cuda::GemmHandle>();
  const int64_t total = layout_.total_numel();
  I.grow<float>(I.params, total, "params");
  I.grow<uint16_t>(I.params_bf16, total, "params_bf16");
  I.grow<float>(I.grads, total, "grads");
  cuda::device_memset(I.params.data(), 0, total * sizeof(float), stream_);
  cuda::device_memset(I.params_bf16.data(), 0, total * sizeof(uint16_t), stream_);
  cuda::device_memset(I.grads.data(), 0, total * sizeof(float), stream_);
  const int64_t e = ecfg_.num_experts, m = std::max<int64_t>(num_moe_layers_, 1);
  I.grow<float>(I.expert_bias, m * e, "expert_bias");
  cuda::device_memset(I.expert_bias.data(), 0, m * e * sizeof(float), stream_);
  I.grow<float>(I.moe_losses, 2 * m, "moe_losses");
  I.grow<int32_t>(I.counts, m * e, "counts");
  cuda::device_memset(I.moe_losses.data(), 0, 2 * m * sizeof(float), stream_);
  cuda::device_memset(I.counts.data(), 0, m * e * sizeof(int32_t), stream_);
  I.stats_bytes = cuda::step_stats_bytes(num_moe_layers_, e);
  I.grow_bytes(I.stats, I.stats_bytes, "stats");
  cuda::device_memset(I.stats.data(), 0, I.stats_bytes, stream_);
  I.grow<uint32_t>(I.bwd_bad, 2, "bwd_bad");
  cuda::device_memset(I.bwd_bad.data(), 0, 2 * sizeof(uint32_t), stream_);
  I.grow<float>(I.scalars, 4, "scalars");
  cuda::copy_h2d(I.scalars.data(), I.host_scalars, sizeof(I.host_scalars), stream_);

  I.emb = layout_.find("model.embed_tokens.weight").offset;
  I.fnorm = layout_.find("model.norm.weight").offset;
  I.head = layout_.find("lm_head.weight").offset;
  grads_ready_from_ = grad_group_starts(layout_, mcfg_.n_layers);
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
float* CudaModel::expert_bias() { return impl_->expert_bias.as<float>(); }
float* CudaModel::loss_scales_device() { return impl_->scalars.as<float>(); }
cuda::StepStatsRecord* CudaModel::stats_record() { return impl_->stats.as<cuda::StepStatsRecord>(); }
size_t CudaModel::stats_bytes() const { return impl_->stats_bytes; }
int64_t CudaModel::buffer_generation() const { return impl_->generation; }

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

void CudaModel::init_params_device(uint64_t seed, double std) {
  // Model<float>::init_params: 1-D tensors are norm weights (ones), the rest truncated normals
  // drawn at the tensor's offset in its global tensor.
  for (size_t i = 0; i < layout_.entries().size(); ++i) {
    const ParamEntry& e = layout_.entries()[i];
    if (e.shape.size() == 1) cuda::fill_value(params() + e.offset, e.numel, 1.0f, stream_);
    else cuda::fill_trunc_normal(params() + e.offset, e.numel, placements_[i].offset, seed, e.name, std, stream_);
  }
  refresh_bf16();
}

EpTraffic CudaModel::ep_traffic() const { return impl_->traffic; }
void CudaModel::reset_ep_traffic() { impl_->traffic = {}; }

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

std::vector<float> CudaModel::download_expert_bias() {
  std::vector<float> h(static_cast<size_t>(num_moe_layers_ * ecfg_.num_experts));
  cuda::copy_d2h(h.data(), expert_bias(), h.size() * sizeof(float), stream_);
  return h;
}

void CudaModel::zero_grads() { cuda::device_memset(grads(), 0, layout_.total_numel() * sizeof(float), stream_); }

void CudaModel::reset_stats() {
  impl_->host_num_targets = 0;
  impl_->num_forwards = 0;
  impl_->num_routes = 0;
  cuda::device_memset(impl_->stats.data(), 0, impl_->stats_bytes, stream_);
}

void CudaModel::reserve(int64_t batch, int64_t seq) {
  MOE_CHECK(batch > 0 && seq > 0, "CudaModel::reserve: batch and sequence must be positive, got batch=", batch,
            " seq=", seq);
  Impl& I = *impl_;
  const int64_t n = batch * seq, d = mcfg_.d_model, hd = mcfg_.head_dim();
  const int64_t hq = mcfg_.n_heads, hkv = mcfg_.n_kv_heads, q = hq * hd, kv = hkv * hd;
  const int64_t v = mcfg_.vocab_size, e = ecfg_.num_experts, k = ecfg_.top_k;
  const int64_t inner = ecfg_.expert_hidden, rows = n * k;
  const int64_t chunk = std::min(n, kHeadChunkRows);

  // Forward.
  I.grow<int32_t>(I.inputs, n, "inputs");
  I.grow<int32_t>(I.targets, n, "targets");
  I.grow<float>(I.x32, n * d, "x32");
  I.grow<uint16_t>(I.branch, n * d, "branch");
  int64_t widest_mlp = 0;
  bool any_moe = false;
  for (auto& sp : I.layers) {
    LayerState& s = *sp;
    I.grow<uint16_t>(s.x_in, n * d, "x_in");
    I.grow<uint16_t>(s.norm1, n * d, "norm1");
    I.grow<float>(s.rstd1, n, "rstd1");
    I.grow<uint16_t>(s.q, n * q, "q");
    I.grow<uint16_t>(s.k, n * kv, "k");
    I.grow<uint16_t>(s.v, n * kv, "v");
    if (mcfg_.qk_norm) {
      I.grow<uint16_t>(s.q_raw, n * q, "q_raw");
      I.grow<uint16_t>(s.k_raw, n * kv, "k_raw");
      I.grow<float>(s.q_rstd, n, "q_rstd");
      I.grow<float>(s.k_rstd, n, "k_rstd");
    }
    I.grow<uint16_t>(s.attn, n * q, "attn");
    I.grow<float>(s.lse, batch * hq * seq, "lse");
    I.grow<uint16_t>(s.x_mid, n * d, "x_mid");
    I.grow<uint16_t>(s.norm2, n * d, "norm2");
    I.grow<float>(s.rstd2, n, "rstd2");
    if (s.dense || s.shared) {
      I.grow<uint16_t>(s.mlp_gate_up, n * 2 * s.mlp_hidden, "mlp_gate_up");
      I.grow<uint16_t>(s.mlp_h, n * s.mlp_hidden, "mlp_h");
      widest_mlp = std::max(widest_mlp, s.mlp_hidden);
    }
    if (!s.dense) {
      any_moe = true;
      I.grow<float>(s.logits, n * e, "router logits");
      I.grow<float>(s.scores, n * e, "router scores");
      I.grow<int32_t>(s.topk_idx, n * k, "topk_idx");
      I.grow<float>(s.topk_w, n * k, "topk_w");
      I.grow<int32_t>(s.offsets, e + 1, "expert offsets");
      I.grow<int32_t>(s.sorted_route, rows, "sorted_route");
      I.grow<int32_t>(s.route_to_row, rows, "route_to_row");
      I.grow<uint16_t>(s.x_sorted, rows * d, "x_sorted");
      I.grow<uint16_t>(s.gate_up, rows * 2 * inner, "expert gate_up");
      I.grow<uint16_t>(s.h, rows * inner, "expert h");
      I.grow<uint16_t>(s.y_sorted, rows * d, "y_sorted");
      if (ep_comm_) {
        I.grow<uint16_t>(s.x_recv, rows * d, "received expert rows");
        I.grow<int32_t>(s.regroup, rows, "regroup map");
        I.grow<int32_t>(s.ungroup, rows, "ungroup map");
        I.grow<int32_t>(s.local_offsets, slice_.count + 1, "local expert offsets");
      }
    }
  }
  I.grow<uint16_t>(I.final_in, n * d, "final_in");
  I.grow<uint16_t>(I.final_norm, n * d, "final_norm");
  I.grow<float>(I.final_rstd, n, "final_rstd");
  I.grow<uint16_t>(I.logits_chunk, chunk * v, "logits_chunk");
  I.grow<float>(I.loss, n, "loss");
  I.grow<float>(I.lse, n, "lse");
  if (any_moe) {
    cuda::RouterParams rp;
    rp.num_tokens = n;
    rp.num_experts = e;
    rp.top_k = k;
    I.grow_bytes(I.ws_router, cuda::router_workspace_bytes(rp), "router workspace");
    I.grow_bytes(I.ws_dispatch, cuda::dispatch_map_workspace_bytes(n, k, e), "dispatch workspace");
    if (ep_comm_) {
      I.grow<int32_t>(I.ep_recv_counts, e, "received expert counts");
      I.grow<uint16_t>(I.ep_pm, rows * d, "exchanged rows");
      I.grow<uint16_t>(I.ep_work, rows * d, "expert work rows");
    }
  }

  // Backward.
  const int64_t widest = std::max({d, q, kv});
  I.grow_bytes(I.ws_rms, cuda::rmsnorm_backward_workspace_bytes(n, widest), "rmsnorm workspace");
  I.grow_bytes(I.ws_attn, cuda::attention_backward_workspace_bytes(batch, seq, hq), "attention workspace");
  // cuDNN attention builds its plans (and their workspaces) for this shape now, outside any capture.
  cuda::attention_prepare(batch, seq, hq, hkv, hd, stream_);
  auto emb_ws = I.emb_ws_bytes.find(n);
  if (emb_ws == I.emb_ws_bytes.end()) {
    MOE_CHECK(!cuda::stream_is_capturing(stream_), "CudaModel: a batch of ", n, " tokens was never seen before "
              "graph capture; call reserve(batch, seq) with the step's shape before capturing");
    emb_ws = I.emb_ws_bytes.emplace(n, cuda::embedding_backward_workspace_bytes(n, v)).first;
  }
  I.grow_bytes(I.ws_emb, emb_ws->second, "embedding workspace");
  I.grow<uint16_t>(I.dnorm, n * d, "dnorm");
  I.grow<uint16_t>(I.dtmp, n * d, "dtmp");
  I.grow<float>(I.dx32, n * d, "dx32");
  I.grow<uint16_t>(I.dx, n * d, "dx");
  I.grow<uint16_t>(I.dbranch, n * d, "dbranch");
  I.grow<uint16_t>(I.dq, n * q, "dq");
  I.grow<uint16_t>(I.dk, n * kv, "dk");
  I.grow<uint16_t>(I.dv, n * kv, "dv");
  I.grow<uint16_t>(I.dattn, n * q, "dattn");
  if (widest_mlp > 0) {
    I.grow<uint16_t>(I.mlp_dh, n * widest_mlp, "mlp_dh");
    I.grow<uint16_t>(I.mlp_dgu, n * 2 * widest_mlp, "mlp_dgu");
  }
  if (any_moe) {
    I.grow<uint16_t>(I.dy_sorted, rows * d, "dy_sorted");
    I.grow<float>(I.dtopk_w, n * k, "dtopk_w");
    I.grow<uint16_t>(I.e_dh, rows * inner, "expert dh");
    I.grow<uint16_t>(I.e_dgu, rows * 2 * inner, "expert dgate_up");
    I.grow<uint16_t>(I.dx_sorted, rows * d, "dx_sorted");
    I.grow<float>(I.dlogits32, n * e, "router dlogits32");
    I.grow<uint16_t>(I.dlogits16, n * e, "router dlogits16");
  }
  if (mcfg_.qk_norm) {
    I.grow<uint16_t>(I.dq_raw, n * q, "dq_raw");
    I.grow<uint16_t>(I.dk_raw, n * kv, "dk_raw");
  }
}

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
  const int64_t n = batch * seq;
  reserve(batch, seq);
  reset_stats();
  for (int64_t i = 0; i < n; ++i) I.host_num_targets += targets[i] >= 0 ? 1 : 0;
  cuda::copy_h2d(I.inputs.data(), inputs, n * sizeof(int32_t), stream_);
  cuda::copy_h2d(I.targets.data(), targets, n * sizeof(int32_t), stream_);
  forward_device(I.inputs.as<int32_t>(), I.targets.as<int32_t>(), batch, seq, routing_seed);
}

void CudaModel::forward_device(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                               uint64_t routing_seed) {
  MOE_CHECK(batch > 0 && seq > 0, "CudaModel::forward_device: batch and sequence must be positive, got batch=",
            batch, " seq=", seq);
  MOE_CHECK(inputs != nullptr && targets != nullptr, "CudaModel::forward_device: null token id pointer");
  Impl& I = *impl_;
  const int64_t n = batch * seq;
  reserve(batch, seq);  // host checks only once the shape was seen (buffers grow, never shrink)
  cuda::Stream st = stream_;
  cuda::GemmHandle& G = *I.gemm;
  const int64_t d = mcfg_.d_model, hd = mcfg_.head_dim();
  const int64_t hq = mcfg_.n_heads, hkv = mcfg_.n_kv_heads, q = hq * hd, kv = hkv * hd;
  const int64_t v = mcfg_.vocab_size, e = ecfg_.num_experts, k = ecfg_.top_k;
  const int64_t inner = ecfg_.expert_hidden, rows = n * k;
  const uint16_t* P = params_bf16();
  cuda::StepStatsRecord* rec = stats_record();
  I.batch = batch;
  I.seq = seq;
  I.num_forwards += 1;
  I.num_routes += num_moe_layers_ * rows;
  I.cur_inputs = inputs;
  I.cur_targets = targets;

  float* x32 = I.x32.as<float>();
  uint16_t* branch = I.branch.as<uint16_t>();
  // Embedding into the first saved BF16 residual copy, then x32 = float(x).
  if (timer_) timer_->mark(cuda::Phase::kEmbedding);
  LayerState* first = I.layers.empty() ? nullptr : I.layers[0].get();
  uint16_t* x16 = first ? first->x_in.as<uint16_t>() : I.final_in.as<uint16_t>();
  cuda::embedding_forward(inputs, P + I.emb, x16, n, v, d, &rec->bad_ids, st);
  cuda::device_memset(x32, 0, n * d * sizeof(float), st);
  cuda::residual_add(x32, x16, nullptr, n * d, st);

  for (int64_t l = 0; l < mcfg_.n_layers; ++l) {
    LayerState& s = *I.layers[l];
    const uint16_t* xin = s.x_in.as<uint16_t>();
    // Attention branch.
    if (timer_) timer_->mark(cuda::Phase::kAttention);
    uint16_t* norm1 = s.norm1.as<uint16_t>();
    float* rstd1 = s.rstd1.as<float>();
    cuda::rmsnorm_forward(xin, P + s.attn_norm, norm1, rstd1, n, d, mcfg_.norm_eps, st);
    uint16_t* qb = s.q.as<uint16_t>();
    uint16_t* kb = s.k.as<uint16_t>();
    uint16_t* vb = s.v.as<uint16_t>();
    if (mcfg_.qk_norm) {
      uint16_t* q_raw = s.q_raw.as<uint16_t>();
      uint16_t* k_raw = s.k_raw.as<uint16_t>();
      cuda::gemm(G, false, true, n, q, d, 1.f, norm1, d, P + s.q_proj, d, 0.f, q_raw, q, st);
      cuda::gemm(G, false, true, n, kv, d, 1.f, norm1, d, P + s.k_proj, d, 0.f, k_raw, kv, st);
      cuda::rmsnorm_forward(q_raw, P + s.q_norm, qb, s.q_rstd.as<float>(), n, q, mcfg_.norm_eps, st);
      cuda::rmsnorm_forward(k_raw, P + s.k_norm, kb, s.k_rstd.as<float>(), n, kv, mcfg_.norm_eps, st);
    } else {
      cuda::gemm(G, false, true, n, q, d, 1.f, norm1, d, P + s.q_proj, d, 0.f, qb, q, st);
      cuda::gemm(G, false, true, n, kv, d, 1.f, norm1, d, P + s.k_proj, d, 0.f, kb, kv, st);
    }
    cuda::gemm(G, false, true, n, kv, d, 1.f, norm1, d, P + s.v_proj, d, 0.f, vb, kv, st);
    cuda::rope_forward(qb, batch, seq, hq, hd, mcfg_.rope_theta, st);
    cuda::rope_forward(kb, batch, seq, hkv, hd, mcfg_.rope_theta, st);
    uint16_t* attn = s.attn.as<uint16_t>();
    cuda::attention_forward(qb, kb, vb, attn, s.lse.as<float>(), batch, seq, hq, hkv, hd, st);
    cuda::gemm(G, false, true, n, d, q, 1.f, attn, q, P + s.o_proj, q, 0.f, branch, d, st);
    uint16_t* xmid = s.x_mid.as<uint16_t>();
    cuda::residual_add(x32, branch, xmid, n * d, st);

    // MLP / MoE branch.
    if (timer_) timer_->mark(cuda::Phase::kMlp);
    uint16_t* norm2 = s.norm2.as<uint16_t>();
    cuda::rmsnorm_forward(xmid, P + s.mlp_norm, norm2, s.rstd2.as<float>(), n, d, mcfg_.norm_eps, st);
    if (s.dense) {
      mlp_forward_gpu(G, norm2, P + s.mlp_gate, P + s.mlp_up, P + s.mlp_down, n, d, s.mlp_hidden, s.mlp_gate_up.as<uint16_t>(),
                      s.mlp_h.as<uint16_t>(), branch, false, st);
    } else {
      if (timer_) timer_->mark(cuda::Phase::kRouter);
      s.rp.num_tokens = n;
      s.rp.num_experts = e;
      s.rp.top_k = k;
      s.rp.score = ecfg_.router == "sigmoid" ? cuda::ScoreFunc::kSigmoid : cuda::ScoreFunc::kSoftmax;
      s.rp.norm_topk = ecfg_.norm_topk_prob;
      s.rp.mode = ecfg_.routing == "random"    ? cuda::RoutingMode::kRandom
                  : ecfg_.routing == "uniform" ? cuda::RoutingMode::kUniform
                                               : cuda::RoutingMode::kLearned;
      s.rp.seed = layer_routing_seed(routing_seed, static_cast<uint64_t>(l));
      float* logits = s.logits.as<float>();
      cuda::gemm(G, false, true, n, e, d, 1.f, norm2, d, P + s.router, d, 0.f, logits, e, st);
      int32_t* counts = I.counts.as<int32_t>() + s.moe_index * e;
      int32_t* topk_idx = s.topk_idx.as<int32_t>();
      float* topk_w = s.topk_w.as<float>();
      cuda::router_forward(s.rp, logits, expert_bias() + s.moe_index * e, s.scores.as<float>(), topk_idx, topk_w,
                           counts, nullptr, I.moe_losses.as<float>() + 2 * s.moe_index, I.ws_router.data(),
                           I.ws_router.bytes(), st);
      if (timer_) timer_->mark(cuda::Phase::kDispatch);
      int32_t* offsets = s.offsets.as<int32_t>();
      int32_t* sorted_route = s.sorted_route.as<int32_t>();
      int32_t* route_to_row = s.route_to_row.as<int32_t>();
      cuda::build_dispatch_map(topk_idx, n, k, e, 0, counts, offsets, sorted_route, route_to_row, nullptr,
                               I.ws_dispatch.data(), I.ws_dispatch.bytes(), st);
      uint16_t* xs = s.x_sorted.as<uint16_t>();
      cuda::permute_forward(norm2, sorted_route, n, k, d, xs, st);
      uint16_t* ys = s.y_sorted.as<uint16_t>();
      if (ep_comm_) {
        ep_forward_layer(s.moe_index, counts, xs, ys);
      } else {
        if (timer_) timer_->mark(cuda::Phase::kExperts);
        uint16_t* gu = s.gate_up.as<uint16_t>();
        uint16_t* h = s.h.as<uint16_t>();
        cuda::grouped_gemm_forward(xs, P + s.experts_gate_up, offsets, gu, rows, e, 2 * inner, d, st);
        cuda::swiglu_forward(gu, h, rows, inner, st);
        cuda::grouped_gemm_forward(h, P + s.experts_down, offsets, ys, rows, e, d, inner, st);
      }
      if (timer_) timer_->mark(cuda::Phase::kCombine);
      cuda::unpermute_forward(ys, route_to_row, topk_w, n, k, d, branch, st);
      if (timer_) timer_->mark(cuda::Phase::kMlp);
      if (s.shared) {
        mlp_forward_gpu(G, norm2, P + s.mlp_gate, P + s.mlp_up, P + s.mlp_down, n, d, s.mlp_hidden, s.mlp_gate_up.as<uint16_t>(),
                        s.mlp_h.as<uint16_t>(), branch, true, st);
      }
    }
    uint16_t* next = l + 1 < mcfg_.n_layers ? I.layers[l + 1]->x_in.as<uint16_t>() : I.final_in.as<uint16_t>();
    cuda::residual_add(x32, branch, next, n * d, st);
  }

  // Final norm; LM head and cross-entropy chunk by chunk (losses only: backward recomputes).
  if (timer_) timer_->mark(cuda::Phase::kLmHead);
  uint16_t* fin = I.final_in.as<uint16_t>();
  uint16_t* fnorm = I.final_norm.as<uint16_t>();
  cuda::rmsnorm_forward(fin, P + I.fnorm, fnorm, I.final_rstd.as<float>(), n, d, mcfg_.norm_eps, st);
  const int64_t chunk = std::min(n, kHeadChunkRows);
  uint16_t* lg = I.logits_chunk.as<uint16_t>();
  float* loss = I.loss.as<float>();
  float* lse = I.lse.as<float>();
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t c = std::min(chunk, n - r0);
    cuda::gemm(G, false, true, c, v, d, 1.f, fnorm + r0 * d, d, P + I.head, d, 0.f, lg, v, st);
    cuda::cross_entropy_forward_backward(lg, lg, targets + r0, loss + r0, lse + r0, c, v, 0.0,
                                         I.scalars.as<float>() + 3, &rec->ce_sum, &rec->bad_targets, st);
  }
  if (num_moe_layers_ > 0) {
    if (timer_) timer_->mark(cuda::Phase::kRouter);
    cuda::step_stats_accumulate_router(I.moe_losses.as<float>(), I.counts.as<int32_t>(), num_moe_layers_, e, rec,
                                       st);
  }
  if (timer_) timer_->close();
}

void CudaModel::backward(const LossScales& scales) {
  Impl& I = *impl_;
  MOE_CHECK(I.batch > 0, "CudaModel::backward called before forward");
  // Device scalars: ce grad scale, dlb, dz (the per-layer share of the mean over MoE layers).
  I.host_scalars[0] = static_cast<float>(scales.ce_scale);
  I.host_scalars[1] = num_moe_layers_ ? static_cast<float>(scales.lb_scale / double(num_moe_layers_)) : 0.f;
  I.host_scalars[2] = num_moe_layers_ ? static_cast<float>(scales.z_scale / double(num_moe_layers_)) : 0.f;
  cuda::copy_h2d(I.scalars.data(), I.host_scalars, 3 * sizeof(float), stream_);
  backward();
}

void CudaModel::backward() {
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
  const float* ce_scale = I.scalars.as<float>();
  const float* dlb = ce_scale + 1;
  const float* dz = ce_scale + 2;
  uint32_t* bad_ids_bwd = I.bwd_bad.as<uint32_t>();
  uint32_t* bad_targets_bwd = bad_ids_bwd + 1;

  // LM head, chunk by chunk: logits again, fused CE gradient in place, dnorm and dW_head.
  if (timer_) timer_->mark(cuda::Phase::kLmHead);
  uint16_t* dnorm = I.dnorm.as<uint16_t>();
  const uint16_t* fnorm = I.final_norm.as<uint16_t>();
  const int64_t chunk = std::min(n, kHeadChunkRows);
  uint16_t* lg = I.logits_chunk.as<uint16_t>();
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t c = std::min(chunk, n - r0);
    cuda::gemm(G, false, true, c, v, d, 1.f, fnorm + r0 * d, d, P + I.head, d, 0.f, lg, v, st);
    cuda::cross_entropy_forward_backward(lg, lg, I.cur_targets + r0, I.loss.as<float>() + r0, I.lse.as<float>() + r0,
                                         c, v, 0.0, ce_scale, nullptr, bad_targets_bwd, st);
    cuda::gemm(G, false, false, c, d, v, 1.f, lg, v, P + I.head, d, 0.f, dnorm + r0 * d, d, st);
    cuda::gemm(G, true, false, v, d, c, 1.f, lg, v, fnorm + r0 * d, d, 1.f, Gr + I.head, d, st);
  }
  uint16_t* dtmp = I.dtmp.as<uint16_t>();
  float* dx32 = I.dx32.as<float>();
  uint16_t* dx = I.dx.as<uint16_t>();
  cuda::rmsnorm_backward(I.final_in.as<uint16_t>(), P + I.fnorm, I.final_rstd.as<float>(), dnorm, dtmp,
                         Gr + I.fnorm, n, d, I.ws_rms.data(), I.ws_rms.bytes(), st);
  cuda::device_memset(dx32, 0, n * d * sizeof(float), st);
  cuda::residual_add(dx32, dtmp, dx, n * d, st);
  if (grads_ready_) grads_ready_(grads_ready_from_[size_t(mcfg_.n_layers + 1)]);

  uint16_t* dbranch = I.dbranch.as<uint16_t>();
  uint16_t* dq = I.dq.as<uint16_t>();
  uint16_t* dk = I.dk.as<uint16_t>();
  uint16_t* dv = I.dv.as<uint16_t>();
  uint16_t* dattn = I.dattn.as<uint16_t>();
  for (int64_t l = mcfg_.n_layers - 1; l >= 0; --l) {
    LayerState& s = *I.layers[l];
    const uint16_t* norm2 = s.norm2.as<uint16_t>();
    // MLP / MoE branch: dbranch = d(branch)/d(norm2) applied to dx.
    if (timer_) timer_->mark(cuda::Phase::kMlp);
    if (s.dense || s.shared) {
      const int64_t f = s.mlp_hidden;
      mlp_backward_gpu(G, norm2, P + s.mlp_gate, P + s.mlp_up, P + s.mlp_down, s.mlp_gate_up.as<uint16_t>(), s.mlp_h.as<uint16_t>(),
                       dx, n, d, f, I.mlp_dh.as<uint16_t>(), I.mlp_dgu.as<uint16_t>(), dbranch, false, Gr + s.mlp_gate,
                       Gr + s.mlp_up, Gr + s.mlp_down, st);
    }
    if (!s.dense) {
      if (!s.shared) cuda::device_memset(dbranch, 0, n * d * sizeof(uint16_t), st);
      if (timer_) timer_->mark(cuda::Phase::kCombine);
      const int32_t* offsets = s.offsets.as<int32_t>();
      uint16_t* dys = I.dy_sorted.as<uint16_t>();
      float* dtopk_w = I.dtopk_w.as<float>();
      cuda::unpermute_backward(dx, s.y_sorted.as<uint16_t>(), s.sorted_route.as<int32_t>(),
                               s.route_to_row.as<int32_t>(), s.topk_w.as<float>(), n, k, d, dys, dtopk_w, st);
      uint16_t* dxs = I.dx_sorted.as<uint16_t>();
      if (ep_comm_) {
        ep_backward_layer(s.moe_index, dys, dxs);
      } else {
        if (timer_) timer_->mark(cuda::Phase::kExperts);
        uint16_t* edh = I.e_dh.as<uint16_t>();
        uint16_t* edgu = I.e_dgu.as<uint16_t>();
        cuda::grouped_gemm_dgrad(dys, P + s.experts_down, offsets, edh, rows, e, d, inner, st);
        cuda::grouped_gemm_wgrad(dys, s.h.as<uint16_t>(), offsets, Gr + s.experts_down, rows, e, d, inner, true, st);
        cuda::swiglu_backward(s.gate_up.as<uint16_t>(), edh, edgu, rows, inner, st);
        cuda::grouped_gemm_dgrad(edgu, P + s.experts_gate_up, offsets, dxs, rows, e, 2 * inner, d, st);
        cuda::grouped_gemm_wgrad(edgu, s.x_sorted.as<uint16_t>(), offsets, Gr + s.experts_gate_up, rows, e, 2 * inner, d,
                                 true, st);
      }
      if (timer_) timer_->mark(cuda::Phase::kDispatch);
      cuda::permute_backward(dxs, s.route_to_row.as<int32_t>(), n, k, d, dbranch, st);
      if (timer_) timer_->mark(cuda::Phase::kRouter);
      float* dl32 = I.dlogits32.as<float>();
      uint16_t* dl16 = I.dlogits16.as<uint16_t>();
      cuda::router_backward(s.rp, s.logits.as<float>(), s.scores.as<float>(), s.topk_idx.as<int32_t>(),
                            I.counts.as<int32_t>() + s.moe_index * e, dtopk_w, dlb, dz, dl32, st);
      cuda::cast_f32_to_bf16(dl32, dl16, n * e, st);
      cuda::gemm(G, false, false, n, d, e, 1.f, dl16, e, P + s.router, d, 1.f, dbranch, d, st);
      cuda::gemm(G, true, false, e, d, n, 1.f, dl16, e, norm2, d, 1.f, Gr + s.router, d, st);
      if (timer_) timer_->mark(cuda::Phase::kMlp);
    }
    cuda::rmsnorm_backward(s.x_mid.as<uint16_t>(), P + s.mlp_norm, s.rstd2.as<float>(), dbranch, dtmp, Gr + s.mlp_norm, n, d,
                           I.ws_rms.data(), I.ws_rms.bytes(), st);
    cuda::residual_add(dx32, dtmp, dx, n * d, st);

    // Attention branch.
    if (timer_) timer_->mark(cuda::Phase::kAttention);
    const uint16_t* attn = s.attn.as<uint16_t>();
    const uint16_t* norm1 = s.norm1.as<uint16_t>();
    cuda::gemm(G, false, false, n, q, d, 1.f, dx, d, P + s.o_proj, q, 0.f, dattn, q, st);
    cuda::gemm(G, true, false, d, q, n, 1.f, dx, d, attn, q, 1.f, Gr + s.o_proj, q, st);
    cuda::attention_backward(s.q.as<uint16_t>(), s.k.as<uint16_t>(), s.v.as<uint16_t>(), attn, s.lse.as<float>(),
                             dattn, dq, dk, dv, batch, seq, hq, hkv, hd, I.ws_attn.data(), I.ws_attn.bytes(), st);
    cuda::rope_backward(dq, batch, seq, hq, hd, mcfg_.rope_theta, st);
    cuda::rope_backward(dk, batch, seq, hkv, hd, mcfg_.rope_theta, st);
    const uint16_t* gq = dq;
    const uint16_t* gk = dk;
    if (mcfg_.qk_norm) {
      uint16_t* dq_raw = I.dq_raw.as<uint16_t>();
      uint16_t* dk_raw = I.dk_raw.as<uint16_t>();
      cuda::rmsnorm_backward(s.q_raw.as<uint16_t>(), P + s.q_norm, s.q_rstd.as<float>(), dq, dq_raw, Gr + s.q_norm, n, q,
                             I.ws_rms.data(), I.ws_rms.bytes(), st);
      cuda::rmsnorm_backward(s.k_raw.as<uint16_t>(), P + s.k_norm, s.k_rstd.as<float>(), dk, dk_raw, Gr + s.k_norm, n, kv,
                             I.ws_rms.data(), I.ws_rms.bytes(), st);
      gq = dq_raw;
      gk = dk_raw;
    }
    cuda::gemm(G, false, false, n, d, q, 1.f, gq, q, P + s.q_proj, d, 0.f, dbranch, d, st);
    cuda::gemm(G, false, false, n, d, kv, 1.f, gk, kv, P + s.k_proj, d, 1.f, dbranch, d, st);
    cuda::gemm(G, false, false, n, d, kv, 1.f, dv, kv, P + s.v_proj, d, 1.f, dbranch, d, st);
    cuda::gemm(G, true, false, q, d, n, 1.f, gq, q, norm1, d, 1.f, Gr + s.q_proj, d, st);
    cuda::gemm(G, true, false, kv, d, n, 1.f, gk, kv, norm1, d, 1.f, Gr + s.k_proj, d, st);
    cuda::gemm(G, true, false, kv, d, n, 1.f, dv, kv, norm1, d, 1.f, Gr + s.v_proj, d, st);
    cuda::rmsnorm_backward(s.x_in.as<uint16_t>(), P + s.attn_norm, s.rstd1.as<float>(), dbranch, dtmp, Gr + s.attn_norm, n, d,
                           I.ws_rms.data(), I.ws_rms.bytes(), st);
    cuda::residual_add(dx32, dtmp, dx, n * d, st);
    if (grads_ready_) grads_ready_(grads_ready_from_[size_t(l + 1)]);
  }
  if (timer_) timer_->mark(cuda::Phase::kEmbedding);
  cuda::embedding_backward(I.cur_inputs, dx, Gr + I.emb, n, v, d, bad_ids_bwd, I.ws_emb.data(), I.ws_emb.bytes(),
                           st);
  if (grads_ready_) grads_ready_(0);
  if (timer_) timer_->close();
}

// Expert parallelism, one MoE layer's forward after permute_forward: xs [T*k, D] rows sorted by
// global expert; ys [T*k, D] receives the expert outputs in the same order.
void CudaModel::ep_forward_layer(int64_t moe_index, const int32_t* counts, const uint16_t* xs, uint16_t* ys) {
  Impl& I = *impl_;
  LayerState* sp = nullptr;
  for (auto& l : I.layers)
    if (l->moe_index == moe_index) sp = l.get();
  LayerState& s = *sp;
  const cuda::Stream st = stream_;
  const int64_t d = mcfg_.d_model, e = ecfg_.num_experts, inner = ecfg_.expert_hidden, L = slice_.count;
  const int ep = int(ep_size_);
  const uint16_t* P = params_bf16();
  MOE_CHECK(!cuda::stream_is_capturing(st), "CudaModel: the expert-parallel forward reads expert counts on the "
            "host and cannot be captured in a CUDA graph");
  if (timer_) timer_->mark(cuda::Phase::kDispatch);
  // Counts: L per peer out of the router's [E] (peer p's experts are [p L, (p+1) L)), received
  // [ep * L] (peer-major); both read on the host.
  std::vector<int64_t> cnt(size_t(ep), L);
  std::vector<int64_t> off(size_t(ep), 0);
  for (int p = 0; p < ep; ++p) off[p] = p * L;
  int32_t* recv_counts = I.ep_recv_counts.as<int32_t>();
  ep_comm_->all_to_all_v(counts, cnt.data(), off.data(), recv_counts, cnt.data(), off.data(), cuda::NcclDType::kI32,
                         st);
  I.ep_host_counts.resize(size_t(2 * e));
  cuda::copy_d2h(I.ep_host_counts.data(), counts, size_t(e) * sizeof(int32_t), st);
  cuda::copy_d2h(I.ep_host_counts.data() + e, recv_counts, size_t(e) * sizeof(int32_t), st);
  s.plan = cuda::make_ep_handle(ep, int(ep_rank_), L, I.ep_host_counts.data(), I.ep_host_counts.data() + e);
  const cuda::EpHandle& plan = s.plan;
  const int64_t G = plan.total_recv;
  // Everything forward and backward of this layer needs for G rows, grown (with 1/8 headroom)
  // right after the stream was synchronised by the count read, so no pending work uses a buffer.
  const int64_t cap = G + G / 8;
  auto fits = [&](DeviceBuffer& b, int64_t elems, size_t es) { return b.bytes() >= size_t(std::max<int64_t>(G, 1) * elems) * es; };
  if (!fits(s.x_recv, d, 2)) I.grow<uint16_t>(s.x_recv, cap * d, "received expert rows");
  if (!fits(s.gate_up, 2 * inner, 2)) I.grow<uint16_t>(s.gate_up, cap * 2 * inner, "expert gate_up");
  if (!fits(s.h, inner, 2)) I.grow<uint16_t>(s.h, cap * inner, "expert h");
  if (!fits(s.regroup, 1, 4)) I.grow<int32_t>(s.regroup, cap, "regroup map");
  if (!fits(s.ungroup, 1, 4)) I.grow<int32_t>(s.ungroup, cap, "ungroup map");
  if (!fits(I.ep_pm, d, 2)) I.grow<uint16_t>(I.ep_pm, cap * d, "exchanged rows");
  if (!fits(I.ep_work, d, 2)) I.grow<uint16_t>(I.ep_work, cap * d, "expert work rows");
  if (!fits(I.e_dh, inner, 2)) I.grow<uint16_t>(I.e_dh, cap * inner, "expert dh");
  if (!fits(I.e_dgu, 2 * inner, 2)) I.grow<uint16_t>(I.e_dgu, cap * 2 * inner, "expert dgate_up");
  I.grow<int32_t>(s.local_offsets, L + 1, "local expert offsets");
  if (G > 0) {
    cuda::copy_h2d(s.regroup.data(), plan.regroup.data(), size_t(G) * sizeof(int32_t), st);
    cuda::copy_h2d(s.ungroup.data(), plan.ungroup.data(), size_t(G) * sizeof(int32_t), st);
  }
  cuda::copy_h2d(s.local_offsets.data(), plan.local_offsets.data(), size_t(L + 1) * sizeof(int32_t), st);
  cuda::stream_sync(st);  // the host plan's vectors may change at the next forward of this layer

  uint16_t* pm = I.ep_pm.as<uint16_t>();
  uint16_t* xr = s.x_recv.as<uint16_t>();
  cuda::ep_dispatch_rows(*ep_comm_, plan, xs, pm, d, st);
  cuda::ep_gather_rows(pm, s.regroup.as<int32_t>(), G, G, d, xr, st);
  count_ep_traffic(plan, d, 2);
  if (timer_) timer_->mark(cuda::Phase::kExperts);
  uint16_t* yr = I.ep_work.as<uint16_t>();
  if (G > 0) {
    const int32_t* loff = s.local_offsets.as<int32_t>();
    uint16_t* gu = s.gate_up.as<uint16_t>();
    uint16_t* h = s.h.as<uint16_t>();
    cuda::grouped_gemm_forward(xr, P + s.experts_gate_up, loff, gu, G, L, 2 * inner, d, st);
    cuda::swiglu_forward(gu, h, G, inner, st);
    cuda::grouped_gemm_forward(h, P + s.experts_down, loff, yr, G, L, d, inner, st);
  }
  if (timer_) timer_->mark(cuda::Phase::kCombine);
  cuda::ep_gather_rows(yr, s.ungroup.as<int32_t>(), G, G, d, pm, st);
  cuda::ep_combine_rows(*ep_comm_, plan, pm, ys, d, st);
}

// Expert parallelism, one MoE layer's backward: dys [T*k, D] (the unpermute gradient, sorted
// rows) to the experts' ranks, local expert dgrad and wgrad there, dxs [T*k, D] back.
void CudaModel::ep_backward_layer(int64_t moe_index, const uint16_t* dys, uint16_t* dxs) {
  Impl& I = *impl_;
  LayerState* sp = nullptr;
  for (auto& l : I.layers)
    if (l->moe_index == moe_index) sp = l.get();
  LayerState& s = *sp;
  const cuda::Stream st = stream_;
  const int64_t d = mcfg_.d_model, inner = ecfg_.expert_hidden, L = slice_.count;
  const uint16_t* P = params_bf16();
  float* Gr = grads();
  const cuda::EpHandle& plan = s.plan;
  const int64_t G = plan.total_recv;
  if (timer_) timer_->mark(cuda::Phase::kDispatch);
  uint16_t* pm = I.ep_pm.as<uint16_t>();
  uint16_t* work = I.ep_work.as<uint16_t>();
  cuda::ep_dispatch_rows(*ep_comm_, plan, dys, pm, d, st);
  cuda::ep_gather_rows(pm, s.regroup.as<int32_t>(), G, G, d, work, st);  // dy rows by local expert
  count_ep_traffic(plan, d, 2);
  if (timer_) timer_->mark(cuda::Phase::kExperts);
  if (G > 0) {
    const int32_t* loff = s.local_offsets.as<int32_t>();
    uint16_t* edh = I.e_dh.as<uint16_t>();
    uint16_t* edgu = I.e_dgu.as<uint16_t>();
    cuda::grouped_gemm_dgrad(work, P + s.experts_down, loff, edh, G, L, d, inner, st);
    cuda::grouped_gemm_wgrad(work, s.h.as<uint16_t>(), loff, Gr + s.experts_down, G, L, d, inner, true, st);
    cuda::swiglu_backward(s.gate_up.as<uint16_t>(), edh, edgu, G, inner, st);
    // dx rows by local expert overwrite the dy rows (their last reader ran above, in stream order).
    cuda::grouped_gemm_dgrad(edgu, P + s.experts_gate_up, loff, work, G, L, 2 * inner, d, st);
    cuda::grouped_gemm_wgrad(edgu, s.x_recv.as<uint16_t>(), loff, Gr + s.experts_gate_up, G, L, 2 * inner, d, true, st);
  }
  if (timer_) timer_->mark(cuda::Phase::kCombine);
  cuda::ep_gather_rows(work, s.ungroup.as<int32_t>(), G, G, d, pm, st);
  cuda::ep_combine_rows(*ep_comm_, plan, pm, dxs, d, st);
}

// Two row exchanges of `plan` (dispatch and combine): rows to and from the other ranks.
void CudaModel::count_ep_traffic(const cuda::EpHandle& plan, int64_t d, int64_t elem_bytes) {
  EpTraffic& t = impl_->traffic;
  int64_t out = 0, in = 0;
  for (int p = 0; p < plan.ep; ++p) {
    if (p == plan.rank) continue;
    out += plan.send_rows[p];
    in += plan.recv_rows[p];
  }
  // Dispatch sends `out` rows and receives `in`; combine returns them the other way.
  t.exchanges += 2;
  t.rows_sent += out + in;
  t.bytes_sent += (out + in) * d * elem_bytes;
  t.bytes_received += (in + out) * d * elem_bytes;
}

ForwardStats CudaModel::read_stats() {
  Impl& I = *impl_;
  const int64_t e = ecfg_.num_experts, m = num_moe_layers_;
  std::vector<uint8_t> raw(I.stats_bytes);
  cuda::copy_d2h(raw.data(), I.stats.data(), raw.size(), stream_);
  cuda::StepStatsRecord rec;
  std::memcpy(&rec, raw.data(), sizeof(rec));
  MOE_CHECK(rec.bad_ids == 0, "CudaModel: ", rec.bad_ids, " input token ids outside [0, vocab_size = ",
            mcfg_.vocab_size, "): check the data's token ids against model.vocab_size");
  MOE_CHECK(rec.bad_targets == 0, "CudaModel: ", rec.bad_targets, " targets >= vocab_size = ", mcfg_.vocab_size,
            ": check the data's token ids against model.vocab_size");
  ForwardStats s;
  s.ce_sum = rec.ce_sum;
  s.num_targets = I.host_num_targets;
  if (m > 0 && I.num_forwards > 0) {
    s.lb_loss = rec.lb_sum / double(m * I.num_forwards);
    s.z_loss = rec.z_sum / double(m * I.num_forwards);
  }
  for (int64_t l = 0; l < m; ++l) {
    std::vector<int32_t> c(static_cast<size_t>(e));
    for (int64_t i = 0; i < e; ++i) {
      int64_t v = 0;
      std::memcpy(&v, raw.data() + sizeof(rec) + (l * e + i) * sizeof(int64_t), sizeof(v));
      c[i] = static_cast<int32_t>(v);
    }
    s.tokens_per_expert.push_back(std::move(c));
  }
  s.num_routes = I.num_routes;
  s.num_dropped = 0;
  return s;
}

}  // namespace moe

#endif  // MOECORE_HAS_CUDA
