// CudaModel: Model<float>'s forward/backward on the GPU as a list of block calls in the same order
// (embedding; per layer an attention block and a dense MLP block or a MoE layer; LM head).
// Residual stream x and its gradient dx are FP32; each block's residual add also writes the BF16
// copy the next block reads and saves (cuda::residual_add). Parameter gradients accumulate (+=) in
// FP32, except on a step's first backward after prepare_grads_for_step, which writes the
// GEMM-produced ones whole; activation gradients are overwritten. All buffers are sized in one place (reserve) so
// forward/backward never allocate once sized, except the received rows of expert parallelism,
// which grow right after the host read the counts (CudaEpExperts, cuda_experts.h).
// Legend: B batch, S sequence, N = B*S tokens, D model width, V vocabulary, E experts, K top_k,
// R routed rows (N*K), F dense/shared MLP hidden, M MoE layers. BF16 unless noted.
#ifdef MOECORE_HAS_CUDA

#include "model/cuda_model.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>

#include "core/error.h"
#include "core/moe_types.h"
#include "core/square_blocks.h"
#include "cuda/event_timer.h"
#include "cuda/ops/attention.h"
#include "cuda/ops/embedding.h"
#include "cuda/ops/gemm.h"
#include "cuda/ops/init.h"
#include "cuda/ops/memory.h"
#include "cuda/ops/moe_routing.h"
#include "cuda/ops/nccl.h"
#include "cuda/ops/nvshmem_world.h"
#include "cuda/ops/rmsnorm.h"
#include "cuda/ops/step_stats.h"
#include "model/cuda_attention_block.h"
#include "model/cuda_block.h"
#include "model/cuda_experts.h"
#include "model/cuda_lm_head.h"
#include "model/cuda_mlp_block.h"
#include "model/cuda_moe_layer.h"
#include "model/layout.h"

namespace moe {

using cuda::DeviceBuffer;

struct CudaModel::Impl {
  // Layer l: its attention block, then its dense MLP block or its MoE layer.
  struct Layer {
    std::unique_ptr<CudaAttentionBlock> attention;
    std::unique_ptr<CudaMlpBlock> mlp;
    std::unique_ptr<CudaMoeLayer> moe;
    uint16_t* mlp_input() const { return mlp ? mlp->input() : moe->input(); }
  };

  std::unique_ptr<cuda::GemmHandle> gemm;
  CudaBufferGrower grower;  // counts buffer reallocations
  DeviceBuffer params, params_bf16, grads;
  int64_t emb = 0;
  // prepare_grads_for_step: the flat ranges it zeroes (every gradient no single GEMM writes whole,
  // alignment padding included), and whether the next backward writes the others (cleared by backward()).
  std::vector<FlatRange> zeroed_ranges;
  bool grads_fresh = false;
  // embedding_backward_workspace_bytes by token count (a device query, so it is asked once per
  // shape, never during capture).
  std::map<int64_t, size_t> emb_ws_bytes;

  // Last forward: shape, routing seed and the device token ids backward reads.
  int64_t batch = 0, seq = 0;
  CudaRoutingSeed routing_seed;
  const int32_t* cur_inputs = nullptr;
  const int32_t* cur_targets = nullptr;
  int64_t host_num_targets = 0;  // targets of host-id forwards since reset_stats()
  int64_t num_forwards = 0, num_routes = 0;  // forwards and their routes since reset_stats()
  DeviceBuffer inputs_N, targets_N;  // int32: the ids of host-id forwards
  // Statistics record (cuda::StepStatsRecord + int64 counts [M, E]); backward's bad id / target
  // counters (u32 [2], never read: the forward's counts are the ones reported).
  DeviceBuffer stats, bwd_bad;
  size_t stats_bytes = 0;
  // Device scalars (f32): backward's ce grad scale, dlb, dz; then 1 (forward's discarded CE gradient).
  DeviceBuffer scalars;
  float host_scalars[4] = {0, 0, 0, 1};
  DeviceBuffer ws_emb;  // embedding_backward workspace
  DeviceBuffer stage_out_ND;  // a stage without the LM head: the BF16 copy of its output residual
  // decode(): the last row's final norm (BF16 [D]), its rstd and its FP32 logits [V]; the final
  // norm's and the LM head's flat offsets.
  DeviceBuffer decode_norm, decode_rstd, decode_logits;
  int64_t final_norm = 0, lm_head = 0;

  // The blocks, their shared buffers, the LM head.
  CudaResidual res;
  CudaAttentionScratch attention_scratch;
  CudaMlpScratch mlp_scratch;
  CudaMoeShared moe;  // router outputs [M, ...], MoE scratch, the experts
  // Recomputation: the recomputed tensors of every layer (one set per block kind).
  CudaAttentionSaved attention_pool;
  CudaMlpBlockSaved mlp_pool;
  CudaMoeSaved moe_pool;
  bool reserved = false;  // reserve ran (set_recompute is refused after)
  std::vector<Layer> layers;
  std::vector<LayerParams> moe_params;  // the present MoE layers' parameters, in layer order
  DeviceBuffer expert_squares;  // set_expert_grad_squares: [M * expert_square_blocks_per_layer()] FP64
  bool squares_current = false;  // the last backward wrote them (and none added to the gradients since)
  std::unique_ptr<CudaLmHead> head;

  // The BF16 input buffer of layer l (l == layers.size(): the LM head's), or the stage's output
  // buffer when this model does not hold that layer (or the head).
  uint16_t* input_of(size_t l) {
    if (l < layers.size()) return layers[l].attention ? layers[l].attention->input() : stage_out_ND.as<uint16_t>();
    return head ? head->input() : stage_out_ND.as<uint16_t>();
  }
  // The first held layer's input (the embedding writes it; a stage's input lands there).
  uint16_t* first_input() {
    for (size_t l = 0; l < layers.size(); ++l)
      if (layers[l].attention) return layers[l].attention->input();
    return input_of(layers.size());
  }
};

namespace {

// The ep group's size and this rank's index: the NCCL group's, or the NVSHMEM world's for a
// rowwise exchange without one (one PE).
int64_t ep_group_size(const CudaExpertParallel* ep) {
  if (ep == nullptr) return 1;
  if (ep->comm != nullptr) return ep->comm->size();
  return ep->rowwise != nullptr ? ep->rowwise->npes() : 1;
}

int64_t ep_group_rank(const CudaExpertParallel* ep) {
  if (ep == nullptr) return 0;
  if (ep->comm != nullptr) return ep->comm->rank();
  return ep->rowwise != nullptr ? ep->rowwise->pe() : 0;
}

ExpertSlice ep_slice(const MoeConfig& moe, const CudaExpertParallel* ep) {
  const int64_t n = ep_group_size(ep);
  if (n <= 1) return {};
  MOE_CHECK(moe.num_experts >= n && moe.num_experts % n == 0, "CudaModel: expert parallelism over ", n,
            " GPUs needs moe.num_experts divisible by ", n, ", got ", moe.num_experts);
  const int64_t local = moe.num_experts / n;
  return {ep_group_rank(ep) * local, local};
}

// grad_group_starts for any layout part: a group the part does not hold starts where the next held
// group does (its range is empty), the final group at the end of the layout when absent.
std::vector<int64_t> stage_group_starts(const ParamLayout& layout, int64_t n_layers) {
  const std::string block = "model.layers.";
  std::vector<int64_t> start(size_t(n_layers + 2), -1);
  for (const ParamEntry& e : layout.entries()) {
    int64_t g = n_layers + 1;
    if (e.name.rfind("model.embed_tokens.", 0) == 0) {
      g = 0;
    } else if (e.name.rfind(block, 0) == 0) {
      g = 1 + std::stoll(e.name.substr(block.size()));
    }
    if (start[size_t(g)] < 0) start[size_t(g)] = e.offset;
  }
  int64_t next = layout.total_numel();
  for (int64_t g = n_layers + 1; g >= 0; --g) {
    if (start[size_t(g)] < 0) start[size_t(g)] = next;
    next = start[size_t(g)];
  }
  return start;
}

}  // namespace

CudaModel::CudaModel(const ModelConfig& model, const MoeConfig& moe, const CudaExpertParallel* ep,
                     const LayoutPart& part)
    : mcfg_(model),
      ecfg_(moe),
      part_(part),
      ep_comm_(ep && ep->comm && ep->comm->size() > 1 ? ep->comm : nullptr),
      ep_size_(ep_group_size(ep)),
      ep_rank_(ep_group_rank(ep)),
      rowwise_(ep != nullptr && ep->rowwise != nullptr),
      slice_(ep_slice(moe, ep)),
      layout_(build_param_layout(model, moe, slice_, part)),
      impl_(std::make_unique<Impl>()) {
  for (const ParamEntry& entry : layout_.entries()) placements_.push_back(global_placement(entry, ep_size_, ep_rank_));
  if (rowwise_) {
    MOE_CHECK(ep->rowwise->npes() == ep_size_ && ep->rowwise->pe() == ep_rank_, "CudaModel: the rowwise exchange's ",
              "NVSHMEM world has ", ep->rowwise->npes(), " PEs (this one ", ep->rowwise->pe(), ") but the ep group ",
              ep_size_, " ranks (this one ", ep_rank_, "): one PE per ep rank, PE = ep rank");
  } else {
    MOE_CHECK(ep == nullptr || ep->capacity_factor == 0.0, "CudaModel: an expert capacity (parallel.ep_capacity_factor = ",
              ep ? ep->capacity_factor : 0.0, ") applies to the rowwise exchange only");
  }
  if (ep_comm_) {
    MOE_CHECK(ep_comm_->device() == cuda::current_device(), "CudaModel: the expert-parallel NCCL communicator was "
              "made on GPU ", ep_comm_->device(), " but the current GPU is ", cuda::current_device());
  }
  MOE_CHECK(ecfg_.capacity_factor == 0.0 || ecfg_.capacity_factor >= 1.0, "CudaModel: moe.capacity_factor must be "
            "0 (dropless) or >= 1, got ", ecfg_.capacity_factor);
  MOE_CHECK(ecfg_.capacity_factor == 0.0 || !rowwise_, "CudaModel: moe.capacity_factor = ", ecfg_.capacity_factor,
            " with the rowwise exchange: its capacity is parallel.ep_capacity_factor; set moe.capacity_factor = 0");
  MOE_CHECK(ecfg_.capacity_factor == 0.0 || ep_size_ == 1, "CudaModel: expert parallelism is dropless only; set "
            "moe.capacity_factor = 0 with parallel.ep = ", ep_size_, " (got ", ecfg_.capacity_factor, ")");
  const cuda::AttentionBackend attention_backend = cuda::attention_resolve_backend();
  MOE_CHECK(cuda::attention_supports_head_dim(mcfg_.head_dim(), attention_backend),
            "CudaModel: head_dim = d_model / n_heads = ", mcfg_.head_dim(), " has no GPU attention kernel in the '",
            cuda::attention_backend_name(attention_backend),
            "' attention backend (own: 64 or 128; cudnn: multiples of 8 up to 256; MOECORE_ATTENTION chooses)");
  MOE_CHECK(mcfg_.n_heads % mcfg_.n_kv_heads == 0, "CudaModel: n_heads (", mcfg_.n_heads,
            ") must be a multiple of n_kv_heads (", mcfg_.n_kv_heads, ")");
  num_moe_layers_ = moe::num_moe_layers(mcfg_);
  CudaRouterChoice router;  // the config strings, resolved once
  if (num_moe_layers_ > 0) {
    MOE_CHECK(ecfg_.num_experts <= cuda::kMaxRouterExperts && ecfg_.top_k <= cuda::kMaxRouterTopK,
              "CudaModel: the GPU router takes at most ", cuda::kMaxRouterExperts, " experts and top_k <= ",
              cuda::kMaxRouterTopK, ", got E=", ecfg_.num_experts, " top_k=", ecfg_.top_k);
    MOE_CHECK(mcfg_.d_model % 8 == 0 && ecfg_.expert_hidden % 8 == 0,
              "CudaModel: grouped expert GEMMs need d_model and expert_hidden multiples of 8, got ", mcfg_.d_model,
              " and ", ecfg_.expert_hidden);
    router.score = parse_score_func(ecfg_.router);
    router.mode = parse_routing_mode(ecfg_.routing);
    router.norm_topk = ecfg_.norm_topk_prob;
  }
  Impl& I = *impl_;
  stream_ = cuda::stream_create();
  I.grower.set_stream(stream_);
  CudaBufferGrower& g = I.grower;
  I.gemm = std::make_unique<cuda::GemmHandle>();
  const int64_t total = layout_.total_numel();
  g.grow<float>(I.params, total, "params");
  g.grow<uint16_t>(I.params_bf16, total, "params_bf16");
  g.grow<float>(I.grads, total, "grads");
  cuda::device_memset(I.params.data(), 0, total * sizeof(float), stream_);
  cuda::device_memset(I.params_bf16.data(), 0, total * sizeof(uint16_t), stream_);
  cuda::device_memset(I.grads.data(), 0, total * sizeof(float), stream_);
  const int64_t e = ecfg_.num_experts, m = std::max<int64_t>(num_moe_layers_, 1);
  g.grow<float>(I.moe.expert_bias_ME, m * e, "expert_bias");
  cuda::device_memset(I.moe.expert_bias_ME.data(), 0, m * e * sizeof(float), stream_);
  g.grow<float>(I.moe.losses_M2, 2 * m, "moe_losses");
  g.grow<int32_t>(I.moe.counts_ME, m * e, "counts");
  g.grow<int32_t>(I.moe.dropped_M, m, "dropped");
  cuda::device_memset(I.moe.dropped_M.data(), 0, m * sizeof(int32_t), stream_);
  cuda::device_memset(I.moe.losses_M2.data(), 0, 2 * m * sizeof(float), stream_);
  cuda::device_memset(I.moe.counts_ME.data(), 0, m * e * sizeof(int32_t), stream_);
  I.stats_bytes = cuda::step_stats_bytes(num_moe_layers_, e);
  g.grow_bytes(I.stats, I.stats_bytes, "stats");
  cuda::device_memset(I.stats.data(), 0, I.stats_bytes, stream_);
  g.grow<uint32_t>(I.bwd_bad, 2, "bwd_bad");
  cuda::device_memset(I.bwd_bad.data(), 0, 2 * sizeof(uint32_t), stream_);
  g.grow<float>(I.scalars, 4, "scalars");
  cuda::copy_h2d(I.scalars.data(), I.host_scalars, sizeof(I.host_scalars), stream_);

  MOE_CHECK(part_.layers.empty() || int64_t(part_.layers.size()) == mcfg_.n_layers, "CudaModel: the layout part "
            "names ", part_.layers.size(), " layers, the model has ", mcfg_.n_layers);
  I.emb = part_.embed ? layout_.find("model.embed_tokens.weight").offset : -1;
  grads_ready_from_ = stage_group_starts(layout_, mcfg_.n_layers);
  const std::vector<LayerParams> layer_list = layer_params(layout_, mcfg_, ecfg_);
  for (size_t l = 0; l < layer_list.size(); ++l) {
    const LayerParams& p = layer_list[l];
    Impl::Layer layer;
    if (!p.present) {  // another pipeline stage's layer
      I.layers.push_back(std::move(layer));
      continue;
    }
    layer.attention = std::make_unique<CudaAttentionBlock>(mcfg_, p);
    if (p.dense) {
      layer.mlp = std::make_unique<CudaMlpBlock>(mcfg_, p);
    } else {
      layer.moe = std::make_unique<CudaMoeLayer>(mcfg_, ecfg_, router, p, static_cast<int64_t>(l));
      I.moe_params.push_back(p);
    }
    I.layers.push_back(std::move(layer));
  }
  if (rowwise_) {
    auto rw = std::make_unique<CudaRowwiseExperts>(ecfg_, mcfg_.d_model, num_moe_layers_, *ep->rowwise,
                                                   ep->capacity_factor);
    rw->set_dropped_counter(I.moe.dropped_M.as<int32_t>());
    I.moe.experts = std::move(rw);
    for (Impl::Layer& layer : I.layers)
      if (layer.moe) layer.moe->set_token_rows(I.moe.experts->takes_token_rows());
  } else if (ep_comm_) {
    I.moe.experts = std::make_unique<CudaEpExperts>(ecfg_, mcfg_.d_model, num_moe_layers_, *ep_comm_, slice_.count,
                                                    I.grower);
  } else {
    I.moe.experts = std::make_unique<CudaLocalExperts>(ecfg_, mcfg_.d_model, num_moe_layers_);
  }
  if (part_.head) {
    I.final_norm = layout_.find("model.norm.weight").offset;
    I.lm_head = layout_.find("lm_head.weight").offset;
    I.head = std::make_unique<CudaLmHead>(mcfg_, I.final_norm, I.lm_head, kHeadChunkRows);
  }
  // The gradients a GEMM writes whole on the step's first backward (CudaBlockContext::overwrite_grads);
  // prepare_grads_for_step zeroes the rest, in runs between them.
  std::vector<int64_t> written;
  for (const LayerParams& p : layer_list) {
    if (!p.present) continue;
    for (int64_t o : {p.q_proj, p.k_proj, p.v_proj, p.o_proj, p.mlp_gate, p.mlp_up, p.mlp_down, p.router,
                      p.experts_gate_up, p.experts_down})
      if (o >= 0) written.push_back(o);
  }
  if (part_.head) written.push_back(layout_.find("lm_head.weight").offset);
  std::sort(written.begin(), written.end());
  int64_t from = 0;
  for (const ParamEntry& en : layout_.entries()) {  // layout order: increasing offsets
    if (!std::binary_search(written.begin(), written.end(), en.offset)) continue;
    if (en.offset > from) I.zeroed_ranges.push_back(FlatRange{from, en.offset});
    from = en.offset + en.numel;
  }
  if (total > from) I.zeroed_ranges.push_back(FlatRange{from, total});
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
float* CudaModel::expert_bias() { return impl_->moe.expert_bias_ME.as<float>(); }
float* CudaModel::loss_scales_device() { return impl_->scalars.as<float>(); }
cuda::StepStatsRecord* CudaModel::stats_record() { return impl_->stats.as<cuda::StepStatsRecord>(); }
size_t CudaModel::stats_bytes() const { return impl_->stats_bytes; }
int64_t CudaModel::buffer_generation() const { return impl_->grower.generation(); }
int64_t CudaModel::device_bytes() const { return impl_->grower.bytes(); }
float* CudaModel::residual_device() { return impl_->res.x32(); }
float* CudaModel::residual_grad_device() { return impl_->res.dx32(); }

void CudaModel::load_params(const float* host_params) {
  const int64_t total = layout_.total_numel();
  cuda::copy_h2d(params(), host_params, total * sizeof(float), stream_);
  refresh_bf16();
  cuda::stream_sync(stream_);
}

std::vector<CudaFp8ExpertTensor> CudaModel::fp8_expert_tensors() {
  Impl& I = *impl_;
  if (!fp8_ || !I.moe.experts || I.moe_params.empty()) return {};
  MOE_CHECK(I.reserved, "CudaModel::fp8_expert_tensors: the experts' FP8 codes exist after reserve");
  return I.moe.experts->fp8_weight_tensors(I.moe_params);
}

void CudaModel::mark_params_changed_with_expert_codes() {
  const int64_t from = params_version_++;
  if (impl_->moe.experts) impl_->moe.experts->fp8_codes_follow(from, params_version_);
}

void CudaModel::refresh_fp8_expert_codes() {
  Impl& I = *impl_;
  if (!fp8_ || !I.moe.experts || I.moe_params.empty()) return;
  CudaBlockContext c;
  c.stream = stream_;
  c.params = params_bf16();
  c.params_version = params_version_;
  I.moe.experts->refresh_fp8(c, I.moe_params);
}

void CudaModel::load_expert_bias(const std::vector<float>& bias) {
  const int64_t want = num_moe_layers_ * ecfg_.num_experts;
  MOE_CHECK(static_cast<int64_t>(bias.size()) == want, "CudaModel::load_expert_bias: expected ", want,
            " values (MoE layers x experts), got ", bias.size());
  cuda::copy_h2d(expert_bias(), bias.data(), want * sizeof(float), stream_);
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

EpTraffic CudaModel::ep_traffic() const { return impl_->moe.experts->traffic(); }
void CudaModel::reset_ep_traffic() { impl_->moe.experts->reset_traffic(); }

void CudaModel::refresh_bf16() {
  cuda::cast_f32_to_bf16(params(), params_bf16(), layout_.total_numel(), stream_);
  mark_params_changed();
}

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

void CudaModel::zero_grads() {
  impl_->grads_fresh = false;
  cuda::device_memset(grads(), 0, layout_.total_numel() * sizeof(float), stream_);
  impl_->squares_current = false;
}

void CudaModel::prepare_grads_for_step() {
  zero_accumulated_grads(0, layout_.total_numel(), stream_);
  mark_grads_fresh();
}

void CudaModel::zero_accumulated_grads(int64_t begin, int64_t end, cuda::Stream stream) {
  for (const FlatRange& r : impl_->zeroed_ranges) {
    const int64_t lo = std::max(r.begin, begin), hi = std::min(r.end, end);
    if (hi > lo) cuda::device_memset(grads() + lo, 0, size_t(hi - lo) * sizeof(float), stream);
  }
}

void CudaModel::mark_grads_fresh() { impl_->grads_fresh = true; }

void CudaModel::reset_stats() {
  impl_->host_num_targets = 0;
  impl_->num_forwards = 0;
  impl_->num_routes = 0;
  cuda::device_memset(impl_->stats.data(), 0, impl_->stats_bytes, stream_);
}

void CudaModel::set_recompute(Recompute mode) {
  Impl& I = *impl_;
  if (mode == recompute_) return;
  MOE_CHECK(!I.reserved, "CudaModel::set_recompute: the recompute mode is set before the first forward or reserve");
  recompute_ = mode;
  const bool pooled = mode != Recompute::kNone;
  const bool local_experts = I.moe.experts != nullptr && I.moe.experts->recomputes_outputs();
  for (Impl::Layer& layer : I.layers) {
    if (!layer.attention) continue;  // another stage's
    layer.attention->bind(mode, pooled ? &I.attention_pool : nullptr);
    if (layer.mlp) layer.mlp->bind(mode, pooled ? &I.mlp_pool : nullptr);
    if (layer.moe) layer.moe->bind(mode, pooled ? &I.moe_pool : nullptr, local_experts);
  }
  if (I.moe.experts) I.moe.experts->bind(mode);
}

void CudaModel::set_expert_grad_squares(bool on) {
  Impl& I = *impl_;
  if (on == expert_squares_on_) return;
  const char* op = "CudaModel::set_expert_grad_squares";
  MOE_CHECK(!I.reserved, op, ": set before the first forward or reserve");
  MOE_CHECK(!on || (ep_size_ == 1 && !rowwise_ && part_.whole()), op, ": the experts' square sums are written by "
            "the local experts of a whole model; this one runs expert parallelism, the rowwise exchange or one "
            "pipeline stage");
  expert_squares_on_ = on;
  if (on && num_moe_layers_ > 0)
    I.grower.grow<double>(I.expert_squares, num_moe_layers_ * expert_square_blocks_per_layer(), "expert_squares");
}

const double* CudaModel::expert_grad_squares() const {
  return impl_->squares_current && num_moe_layers_ > 0 ? impl_->expert_squares.as<double>() : nullptr;
}

int64_t CudaModel::expert_square_blocks_per_layer() const {
  return expert_square_blocks(ecfg_.num_experts, mcfg_.d_model, ecfg_.expert_hidden);
}

void CudaModel::set_fp8(bool on, Fp8Rule rule) {
  Impl& I = *impl_;
  if (on == fp8_ && rule == I.mlp_scratch.fp8.rule) return;
  MOE_CHECK(!I.reserved, "CudaModel::set_fp8: the precision is set before the first forward or reserve");
  MOE_CHECK(on || !fp8_codes_in_bf16_copy_, "CudaModel::set_fp8: the experts' FP8 codes are kept in their BF16 ",
            "copy's place (keep_fp8_codes_in_bf16_copy), so FP8 stays on");
  I.mlp_scratch.fp8.rule = rule;
  if (I.moe.experts) I.moe.experts->set_fp8(on, rule);
  for (Impl::Layer& layer : I.layers) {
    if (layer.attention) layer.attention->set_fp8(on, &I.mlp_scratch.fp8);
    if (layer.mlp) layer.mlp->set_fp8(on, &I.mlp_scratch);
    if (layer.moe) layer.moe->set_fp8(on, &I.mlp_scratch);
  }
  fp8_ = on;
}

void CudaModel::keep_fp8_codes_in_bf16_copy() {
  Impl& I = *impl_;
  MOE_CHECK(!I.reserved && !fp8_codes_in_bf16_copy_, "CudaModel::keep_fp8_codes_in_bf16_copy: once, before the ",
            "first forward or reserve");
  MOE_CHECK(fp8_ && I.moe.experts && !I.moe_params.empty(), "CudaModel::keep_fp8_codes_in_bf16_copy: the experts' ",
            "FP8 codes exist under train.precision = \"fp8\" in a model with MoE layers");
  I.moe.experts->place_fp8_codes(I.moe_params, params_bf16(), params());
  fp8_codes_in_bf16_copy_ = true;
}

void CudaModel::reserve_forward(int64_t batch, int64_t seq) {
  Impl& I = *impl_;
  I.reserved = true;
  CudaBufferGrower& g = I.grower;
  const int64_t n = batch * seq, d = mcfg_.d_model, rows = n * ecfg_.top_k;
  // Ids, residual stream, every block's saved activations, the MoE layers' shared buffers and the
  // experts' rows.
  g.grow<int32_t>(I.inputs_N, n, "inputs");
  g.grow<int32_t>(I.targets_N, n, "targets");
  g.grow<float>(I.res.x32_ND, n * d, "x32");
  g.grow<uint16_t>(I.res.branch_ND, n * d, "branch");
  for (Impl::Layer& layer : I.layers) {
    if (!layer.attention) continue;  // another stage's
    layer.attention->reserve(batch, seq, g);
    if (layer.mlp) {
      layer.mlp->reserve(batch, seq, g);
    } else {
      layer.moe->reserve(batch, seq, g);
    }
  }
  if (I.head) {
    I.head->reserve(batch, seq, g);
  } else {
    g.grow<uint16_t>(I.stage_out_ND, n * d, "stage output (BF16)");
  }
  if (num_moe_layers_ > 0) {
    CudaMoeLayer::reserve_shared(ecfg_, d, batch, seq, I.moe, g);
    I.moe.experts->reserve(rows, g);
  }
}

void CudaModel::reserve(int64_t batch, int64_t seq) {
  MOE_CHECK(batch > 0 && seq > 0, "CudaModel::reserve: batch and sequence must be positive, got batch=", batch,
            " seq=", seq);
  Impl& I = *impl_;
  reserve_forward(batch, seq);
  CudaBufferGrower& g = I.grower;
  const int64_t n = batch * seq, d = mcfg_.d_model, hd = mcfg_.head_dim();
  const int64_t hq = mcfg_.n_heads, hkv = mcfg_.n_kv_heads, q = hq * hd, kv = hkv * hd;
  const int64_t v = mcfg_.vocab_size;
  int64_t widest_mlp = 0;
  for (const Impl::Layer& layer : I.layers)
    if (layer.attention) widest_mlp = std::max(widest_mlp, layer.mlp ? layer.mlp->hidden() : layer.moe->shared_hidden());

  // Backward.
  const int64_t widest = std::max({d, q, kv});
  g.grow_bytes(I.res.ws_rms, cuda::rmsnorm_backward_workspace_bytes(n, widest), "rmsnorm workspace");
  if (mcfg_.qk_norm)  // QK-norm's backward with RoPE's backward read on the fly (rope_rmsnorm_backward)
    g.grow_bytes(I.res.ws_rms, cuda::rope_rmsnorm_backward_workspace_bytes(n, std::max(q, kv), seq, hd),
                 "rmsnorm workspace");
  // The attention blocks' backward scratch borrows the MoE layers' backward rows (free between
  // MoE backwards), sized above.
  void* borrow = num_moe_layers_ > 0 ? I.moe.dy_sorted_RD.data() : nullptr;
  const size_t borrow_bytes = num_moe_layers_ > 0 ? I.moe.dy_sorted_RD.bytes() : 0;
  CudaAttentionBlock::reserve_scratch(mcfg_, batch, seq, I.attention_scratch, g, borrow, borrow_bytes);
  // cuDNN attention builds its plans (and their workspaces) for this shape now, outside any capture.
  cuda::attention_prepare(batch, seq, hq, hkv, hd, stream_);
  auto emb_ws = I.emb_ws_bytes.find(n);
  if (emb_ws == I.emb_ws_bytes.end()) {
    MOE_CHECK(!cuda::stream_is_capturing(stream_), "CudaModel: a batch of ", n, " tokens was never seen before "
              "graph capture; call reserve(batch, seq) with the step's shape before capturing");
    emb_ws = I.emb_ws_bytes.emplace(n, cuda::embedding_backward_workspace_bytes(n, v)).first;
  }
  g.grow_bytes(I.ws_emb, emb_ws->second, "embedding workspace");
  g.grow<uint16_t>(I.res.dtmp_ND, n * d, "dtmp");
  g.grow<float>(I.res.dx32_ND, n * d, "dx32");
  g.grow<uint16_t>(I.res.dx_ND, n * d, "dx");
  g.grow<uint16_t>(I.res.dbranch_ND, n * d, "dbranch");
  if (widest_mlp > 0) I.mlp_scratch.reserve(n, widest_mlp, g);
  // The FP8 activation codes and scales of the MLPs (dense blocks and shared experts that run in
  // FP8) and of the attention projections.
  int64_t widest_fp8 = 0;
  bool fp8_attention = false;
  for (const Impl::Layer& layer : I.layers) {
    if (layer.mlp && layer.mlp->fp8()) widest_fp8 = std::max(widest_fp8, layer.mlp->hidden());
    if (layer.moe && layer.moe->shared_fp8()) widest_fp8 = std::max(widest_fp8, layer.moe->shared_hidden());
    if (layer.attention && layer.attention->fp8()) {
      fp8_attention = true;
      I.mlp_scratch.fp8.reserve(n, layer.attention->fp8_width(), layer.attention->fp8_weight_elems(), g);
    }
  }
  MOE_CHECK((widest_fp8 == 0 && !fp8_attention) || n % 4 == 0, "CudaModel: train.precision = \"fp8\" runs the "
            "projections' and MLPs' FP8 GEMMs on batches of a multiple of 4 tokens, got ", n);
  if (widest_fp8 > 0) I.mlp_scratch.reserve_fp8(n, d, widest_fp8, g);
}

void CudaModel::forward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                        uint64_t routing_seed) {
  MOE_CHECK(batch > 0 && seq > 0, "CudaModel::forward: batch and sequence must be positive, got batch=", batch,
            " seq=", seq);
  Impl& I = *impl_;
  const int64_t n = batch * seq;
  reserve(batch, seq);
  reset_stats();
  for (int64_t i = 0; i < n; ++i) I.host_num_targets += targets[i] >= 0 ? 1 : 0;
  cuda::copy_h2d(I.inputs_N.data(), inputs, n * sizeof(int32_t), stream_);
  cuda::copy_h2d(I.targets_N.data(), targets, n * sizeof(int32_t), stream_);
  forward_device(I.inputs_N.as<int32_t>(), I.targets_N.as<int32_t>(), batch, seq, routing_seed);
}

void CudaModel::forward_device(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                               uint64_t routing_seed, const uint64_t* routing_seed_device) {
  check_whole("CudaModel::forward");
  begin_forward(inputs, targets, batch, seq, routing_seed, routing_seed_device);
  embedding_forward();
  forward_blocks(0, mcfg_.n_layers);
  lm_head_forward();
  end_forward();
}

void CudaModel::backward(const LossScales& scales) {
  set_loss_scales(scales);
  backward();
}

void CudaModel::set_loss_scales(const LossScales& scales) {
  Impl& I = *impl_;
  // Device scalars: ce grad scale, dlb, dz (the per-layer share of the mean over MoE layers).
  I.host_scalars[0] = static_cast<float>(scales.ce_scale);
  I.host_scalars[1] = num_moe_layers_ ? static_cast<float>(scales.lb_scale / double(num_moe_layers_)) : 0.f;
  I.host_scalars[2] = num_moe_layers_ ? static_cast<float>(scales.z_scale / double(num_moe_layers_)) : 0.f;
  cuda::copy_h2d(I.scalars.data(), I.host_scalars, 3 * sizeof(float), stream_);
}

void CudaModel::backward() {
  check_forward("CudaModel::backward");
  check_whole("CudaModel::backward");
  lm_head_backward();
  backward_blocks(0, mcfg_.n_layers);
  embedding_backward();
  impl_->grads_fresh = false;  // the next backward of the step accumulates
  if (timer_) timer_->close();
}

// ---------------------------------------------------------------------------------------------
// The pieces.

namespace {

CudaBlockContext block_context(cuda::Stream stream, cuda::GemmHandle& gemm, const uint16_t* params, float* grads,
                               cuda::EventTimer* timer, int64_t batch, int64_t seq, bool overwrite_grads,
                               int64_t params_version) {
  CudaBlockContext c;
  c.params_version = params_version;
  c.overwrite_grads = overwrite_grads;
  c.stream = stream;
  c.gemm = &gemm;
  c.params = params;
  c.grads = grads;
  c.timer = timer;
  c.batch = batch;
  c.seq = seq;
  return c;
}

}  // namespace

void CudaModel::check_whole(const char* op) const {
  MOE_CHECK(part_.whole(), op, ": this model holds one pipeline stage's tensors; run its stage calls (forward_blocks, "
            "backward_blocks, set_stage_input, set_stage_output_grad) instead");
}

void CudaModel::check_layers(const char* op, int64_t first, int64_t last) const {
  for (int64_t l = first; l < last; ++l)
    MOE_CHECK(part_.holds(l), op, ": layer ", l, " belongs to another pipeline stage; this model's layers are those "
              "its layout part holds");
}

void CudaModel::set_stage_input(const float* x32_ND) {
  check_forward("CudaModel::set_stage_input");
  Impl& I = *impl_;
  const int64_t nd = I.batch * I.seq * mcfg_.d_model;
  cuda::copy_d2d(I.res.x32(), x32_ND, size_t(nd) * sizeof(float), stream_);
  cuda::cast_f32_to_bf16(I.res.x32(), I.first_input(), nd, stream_);
}

void CudaModel::set_stage_output_grad(const float* dx32_ND) {
  check_forward("CudaModel::set_stage_output_grad");
  Impl& I = *impl_;
  const int64_t nd = I.batch * I.seq * mcfg_.d_model;
  cuda::copy_d2d(I.res.dx32(), dx32_ND, size_t(nd) * sizeof(float), stream_);
  cuda::cast_f32_to_bf16(I.res.dx32(), I.res.dx(), nd, stream_);
}

void CudaModel::check_forward(const char* op) const {
  MOE_CHECK(impl_->batch > 0, op, " called before forward");
}

void CudaModel::begin_forward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                              uint64_t routing_seed, const uint64_t* routing_seed_device) {
  MOE_CHECK(batch > 0 && seq > 0, "CudaModel::forward_device / begin_forward: batch and sequence must be positive, "
            "got batch=", batch, " seq=", seq);
  MOE_CHECK(inputs != nullptr && targets != nullptr, "CudaModel::forward_device / begin_forward: null token id "
            "pointer");
  Impl& I = *impl_;
  reserve(batch, seq);  // host checks only once the shape was seen (buffers grow, never shrink)
  I.batch = batch;
  I.seq = seq;
  I.routing_seed = {routing_seed, routing_seed_device};
  I.num_forwards += 1;
  I.num_routes += num_moe_layers_ * batch * seq * ecfg_.top_k;
  I.cur_inputs = inputs;
  I.cur_targets = targets;
}

void CudaModel::embedding_forward() {
  check_forward("CudaModel::embedding_forward");
  Impl& I = *impl_;
  const CudaBlockContext c = block_context(stream_, *I.gemm, params_bf16(), grads(), timer_, I.batch, I.seq, I.grads_fresh, params_version_);
  const int64_t n = c.tokens(), d = mcfg_.d_model;
  // Embedding into the first block's saved input (BF16), then x32 = float(x).
  MOE_CHECK(I.emb >= 0, "CudaModel::embedding_forward: this pipeline stage's model does not hold the embedding");
  if (forward_hook_) forward_hook_(0);
  c.mark(cuda::Phase::kEmbedding);
  uint16_t* x16 = I.first_input();
  cuda::embedding_forward(I.cur_inputs, c.params + I.emb, x16, n, mcfg_.vocab_size, d, &stats_record()->bad_ids,
                          c.stream);
  float* x32 = I.res.x32();
  cuda::device_memset(x32, 0, n * d * sizeof(float), c.stream);
  cuda::residual_add(x32, x16, nullptr, n * d, c.stream);
}

void CudaModel::forward_blocks(int64_t first, int64_t last) {
  check_forward("CudaModel::forward_blocks");
  const int64_t layers = mcfg_.n_layers;
  MOE_CHECK(0 <= first && first <= last && last <= layers, "CudaModel::forward_blocks: layers [", first, ", ", last,
            ") are not a range of [0, ", layers, ")");
  check_layers("CudaModel::forward_blocks", first, last);
  Impl& I = *impl_;
  const CudaBlockContext c = block_context(stream_, *I.gemm, params_bf16(), grads(), timer_, I.batch, I.seq, I.grads_fresh, params_version_);
  for (int64_t l = first; l < last; ++l) {
    Impl::Layer& layer = I.layers[size_t(l)];
    uint16_t* next = I.input_of(size_t(l + 1));
    if (forward_hook_) forward_hook_(l + 1);
    if (layer.moe) layer.moe->prepare_experts(c, I.moe);  // FP8 codes beside the attention block
    layer.attention->forward(c, I.res, layer.mlp_input());
    if (layer.mlp) {
      layer.mlp->forward(c, I.res, next);
    } else {
      layer.moe->forward(c, I.res, I.moe, I.routing_seed, next);
    }
  }
}

void CudaModel::lm_head_forward() {
  check_forward("CudaModel::lm_head_forward");
  MOE_CHECK(impl_->head != nullptr, "CudaModel::lm_head_forward: this pipeline stage's model does not hold the LM head");
  Impl& I = *impl_;
  const CudaBlockContext c = block_context(stream_, *I.gemm, params_bf16(), grads(), timer_, I.batch, I.seq, I.grads_fresh, params_version_);
  cuda::StepStatsRecord* rec = stats_record();
  if (forward_hook_) forward_hook_(mcfg_.n_layers + 1);
  // Losses only, or (fused) the backward's chunk work as well.
  I.head->forward(c, I.cur_targets, I.scalars.as<float>() + 3, &rec->ce_sum, &rec->bad_targets,
                  fuse_head_backward_ ? I.scalars.as<float>() : nullptr);
}

void CudaModel::end_forward() {
  check_forward("CudaModel::end_forward");
  Impl& I = *impl_;
  if (num_moe_layers_ > 0) {
    if (timer_) timer_->mark(cuda::Phase::kRouter);
    cuda::step_stats_accumulate_router(I.moe.losses_M2.as<float>(), I.moe.counts_ME.as<int32_t>(),
                                       ecfg_.capacity_factor > 0 || rowwise_ ? I.moe.dropped_M.as<int32_t>() : nullptr,
                                       num_moe_layers_, ecfg_.num_experts, stats_record(), stream_);
  }
  if (timer_) timer_->close();
}

void CudaModel::lm_head_backward() {
  check_forward("CudaModel::lm_head_backward");
  MOE_CHECK(impl_->head != nullptr, "CudaModel::lm_head_backward: this pipeline stage's model does not hold the LM "
            "head; give the stage's output gradient with set_stage_output_grad");
  Impl& I = *impl_;
  const CudaBlockContext c = block_context(stream_, *I.gemm, params_bf16(), grads(), timer_, I.batch, I.seq, I.grads_fresh, params_version_);
  uint32_t* bad_targets_bwd = I.bwd_bad.as<uint32_t>() + 1;
  // Chunk by chunk: logits again, fused CE gradient in place, dnorm and dW_head; dx starts here.
  I.head->backward(c, I.cur_targets, I.scalars.as<float>(), bad_targets_bwd, I.res);
  if (grads_ready_) grads_ready_(grads_ready_from_[size_t(mcfg_.n_layers + 1)]);
}

void CudaModel::backward_blocks(int64_t first, int64_t last) {
  check_forward("CudaModel::backward_blocks");
  const int64_t layers = mcfg_.n_layers;
  MOE_CHECK(0 <= first && first <= last && last <= layers, "CudaModel::backward_blocks: layers [", first, ", ", last,
            ") are not a range of [0, ", layers, ")");
  check_layers("CudaModel::backward_blocks", first, last);
  Impl& I = *impl_;
  CudaBlockContext c =
      block_context(stream_, *I.gemm, params_bf16(), grads(), timer_, I.batch, I.seq, I.grads_fresh, params_version_);
  if (I.grads_fresh && expert_squares_on_) c.expert_grad_squares = I.expert_squares.as<double>();
  I.squares_current = c.expert_grad_squares != nullptr;
  const float* dlb = I.scalars.as<float>() + 1;
  const float* dz = I.scalars.as<float>() + 2;
  for (int64_t l = last - 1; l >= first; --l) {
    Impl::Layer& layer = I.layers[size_t(l)];
    if (recompute_ != Recompute::kNone) {
      // The layer's recomputed tensors, from what it kept (no phase marks inside: all of it is
      // the recompute phase).
      c.mark(cuda::Phase::kRecompute);
      CudaBlockContext rc = c;
      rc.timer = nullptr;
      if (recompute_ == Recompute::kFull) {
        // The whole forward again from the layer's FP32 input; the output (already in the next
        // layer's saved input) goes to scratch, the routing decision is the saved one.
        layer.attention->restore_residual(rc, I.res);
        layer.attention->forward(rc, I.res, layer.mlp_input(), true);
        if (layer.mlp) {
          layer.mlp->forward(rc, I.res, I.res.dtmp());
        } else {
          layer.moe->forward(rc, I.res, I.moe, I.routing_seed, I.res.dtmp(), true);
        }
      } else {
        layer.attention->recompute_projections(rc);
        if (layer.mlp) {
          layer.mlp->recompute_selective(rc);
        } else {
          layer.moe->recompute_selective(rc, I.moe);
        }
      }
    }
    if (layer.mlp) {
      layer.mlp->backward(c, I.res, I.mlp_scratch);
    } else {
      layer.moe->backward(c, I.res, I.moe, I.mlp_scratch, dlb, dz);
    }
    layer.attention->backward(c, I.res, I.attention_scratch);
    if (grads_ready_) grads_ready_(grads_ready_from_[size_t(l + 1)]);
  }
}

void CudaModel::embedding_backward() {
  check_forward("CudaModel::embedding_backward");
  MOE_CHECK(impl_->emb >= 0, "CudaModel::embedding_backward: this pipeline stage's model does not hold the embedding");
  Impl& I = *impl_;
  const CudaBlockContext c = block_context(stream_, *I.gemm, params_bf16(), grads(), timer_, I.batch, I.seq, I.grads_fresh, params_version_);
  uint32_t* bad_ids_bwd = I.bwd_bad.as<uint32_t>();
  c.mark(cuda::Phase::kEmbedding);
  cuda::embedding_backward(I.cur_inputs, I.res.dx(), c.grads + I.emb, c.tokens(), mcfg_.vocab_size, mcfg_.d_model,
                           bad_ids_bwd, I.ws_emb.data(), I.ws_emb.bytes(), c.stream);
  if (grads_ready_) grads_ready_(0);
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
  const auto* head = reinterpret_cast<const cuda::StepStatsRecord*>(raw.data());
  const int64_t* layer_dropped = cuda::step_stats_layer_dropped(head, m, e);
  const double* layer_losses = cuda::step_stats_layer_losses(head, m, e);
  const double forwards = double(std::max<int64_t>(1, I.num_forwards));
  for (int64_t l = 0; l < m; ++l) {
    s.layer_lb_loss.push_back(layer_losses[2 * l] / forwards);
    s.layer_z_loss.push_back(layer_losses[2 * l + 1] / forwards);
    s.layer_dropped.push_back(layer_dropped[l]);
  }
  s.num_routes = I.num_routes;
  s.num_dropped = rec.num_dropped;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Decoding.

std::vector<float> CudaModel::decode(const int32_t* tokens, int64_t n, CudaKvCache& cache) {
  check_whole("CudaModel::decode");
  MOE_CHECK(ep_size_ == 1, "CudaModel::decode: incremental decoding runs on one GPU; this model shards its experts "
            "over ", ep_size_, " expert-parallel ranks");
  MOE_CHECK(n > 0 && tokens != nullptr, "CudaModel::decode: expected at least one token, got ", n);
  MOE_CHECK(!cuda::stream_is_capturing(stream_), "CudaModel::decode: eager only (it reads the logits back)");
  Impl& I = *impl_;
  const int64_t d = mcfg_.d_model, v = mcfg_.vocab_size, nl = mcfg_.n_layers, kv = mcfg_.n_kv_heads * mcfg_.head_dim();
  for (int64_t i = 0; i < n; ++i)
    MOE_CHECK(tokens[i] >= 0 && tokens[i] < v, "decode: token ", i, " is ", tokens[i], ", not an id of this model: ",
              "expected [0, ", v, ") (model.vocab_size)");
  MOE_CHECK(cache.length >= 0 && cache.length <= cache.capacity && int64_t(cache.k.size()) == (cache.capacity ? nl : 0) &&
                cache.k.size() == cache.v.size(),
            "CudaModel::decode: a KV cache of length ", cache.length, " and capacity ", cache.capacity, " with ",
            cache.k.size(), " layers does not belong to this ", nl, "-layer model");
  const int64_t pos0 = cache.length;
  if (pos0 + n > cache.capacity) {  // grow: double, keep the rows held
    const int64_t cap = std::max({pos0 + n, 2 * cache.capacity, int64_t{256}});
    std::vector<DeviceBuffer> k(static_cast<size_t>(nl)), vb(static_cast<size_t>(nl));
    for (int64_t l = 0; l < nl; ++l) {
      k[size_t(l)].reserve(size_t(cap * kv) * sizeof(uint16_t));
      vb[size_t(l)].reserve(size_t(cap * kv) * sizeof(uint16_t));
      if (pos0 > 0) {
        cuda::copy_d2d(k[size_t(l)].data(), cache.k[size_t(l)].data(), size_t(pos0 * kv) * sizeof(uint16_t), stream_);
        cuda::copy_d2d(vb[size_t(l)].data(), cache.v[size_t(l)].data(), size_t(pos0 * kv) * sizeof(uint16_t), stream_);
      }
    }
    cuda::stream_sync(stream_);  // the old buffers are freed below
    cache.k = std::move(k);
    cache.v = std::move(vb);
    cache.capacity = cap;
  }
  reserve_forward(1, n);
  CudaBufferGrower& g = I.grower;
  g.grow<uint16_t>(I.decode_norm, d, "decode norm row");
  g.grow<float>(I.decode_rstd, 1, "decode rstd");
  g.grow<float>(I.decode_logits, v, "decode logits");
  cuda::copy_h2d(I.inputs_N.data(), tokens, size_t(n) * sizeof(int32_t), stream_);
  CudaBlockContext c = block_context(stream_, *I.gemm, params_bf16(), nullptr, nullptr, 1, n, false, params_version_);
  c.dropless = true;
  uint16_t* x16 = I.first_input();
  cuda::embedding_forward(I.inputs_N.as<int32_t>(), c.params + I.emb, x16, n, v, d, I.bwd_bad.as<uint32_t>(), stream_);
  float* x32 = I.res.x32();
  cuda::device_memset(x32, 0, size_t(n * d) * sizeof(float), stream_);
  cuda::residual_add(x32, x16, nullptr, n * d, stream_);
  const CudaRoutingSeed seed{0, nullptr};
  for (int64_t l = 0; l < nl; ++l) {
    Impl::Layer& layer = I.layers[size_t(l)];
    uint16_t* next = I.input_of(size_t(l + 1));
    layer.attention->decode(c, I.res, layer.mlp_input(), cache.k[size_t(l)].as<uint16_t>(),
                            cache.v[size_t(l)].as<uint16_t>(), pos0);
    if (layer.mlp) {
      layer.mlp->forward(c, I.res, next);
    } else {
      layer.moe->forward(c, I.res, I.moe, seed, next);
    }
  }
  // The final norm and the LM head on the last row, logits in FP32.
  const uint16_t* last = I.head->input() + (n - 1) * d;
  uint16_t* norm = I.decode_norm.as<uint16_t>();
  cuda::rmsnorm_forward(last, c.params + I.final_norm, norm, I.decode_rstd.as<float>(), 1, d, mcfg_.norm_eps, stream_);
  float* logits = I.decode_logits.as<float>();
  cuda::gemm(*I.gemm, false, true, 1, v, d, 1.f, norm, d, c.params + I.lm_head, d, 0.f, logits, v, stream_);
  std::vector<float> out(static_cast<size_t>(v));
  cuda::copy_d2h(out.data(), logits, size_t(v) * sizeof(float), stream_);
  cache.length = pos0 + n;
  return out;
}

}  // namespace moe

#endif  // MOECORE_HAS_CUDA
