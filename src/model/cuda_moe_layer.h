// The MoE layer of the CUDA model (Model<float>'s MoE branch, pre-norm): x += combine(experts(
// dispatch(router(n)))) + shared(n), n = rmsnorm(x). Router: FP32 gate logits, scores, top-k,
// weights, counts and lb/z losses; dispatch: the counting sort's handle (expert offsets, sorted
// routes, route rows) and the permute into rows sorted by expert; experts: a CudaExperts
// (local or expert-parallel); combine: the weighted unpermute; the optional shared expert adds
// its SwiGLU MLP. R = N*K rows, the static bound; with moe.capacity_factor > 0 expert e keeps
// its first min(count_e, capacity) routes in route order (token-major: the earliest tokens) and the
// dispatch map leaves the dropped tail of the rows unused (as cpu::apply_capacity). CUDA builds only (MOECORE_HAS_CUDA); no CUDA headers.
// Legend: B batch, S sequence, N = B*S tokens, D model width, E experts, K top_k, R routed rows
// (N*K), F shared MLP hidden, M MoE layers. BF16 unless noted.
#pragma once

#include <cstdint>
#include <memory>

#include "core/config.h"
#include "core/moe_types.h"
#include "core/recompute.h"
#include "cuda/ops/memory.h"
#include "cuda/ops/moe_routing.h"
#include "model/cuda_block.h"
#include "model/cuda_experts.h"
#include "model/cuda_mlp_block.h"
#include "model/layout.h"

namespace moe {

// A forward's routing seed (random routing): `value`, or when `device` is set the uint64 there,
// which the step writes before each replay so that a captured CUDA graph draws new experts.
struct CudaRoutingSeed {
  uint64_t value = 0;
  const uint64_t* device = nullptr;
};

// The dispatch map of one forward: combine and the backward of both reuse it.
struct CudaDispatchHandle {
  cuda::DeviceBuffer offsets_E1;      // int32 [E + 1]: expert e owns rows [offsets[e], offsets[e+1])
  cuda::DeviceBuffer sorted_route_R;  // int32: route id of each row
  cuda::DeviceBuffer route_to_row_R;  // int32: row of each route
};

// What one MoE layer saves for backward (one per MoE layer; the experts keep their own rows).
// With recomputation some of it lives in one pool every MoE layer shares (bind()); the router's
// outputs and the dispatch map (the routing decision) always stay per layer.
struct CudaMoeSaved {
  cuda::DeviceBuffer x_ND;             // input: BF16 copy of the residual stream
  cuda::DeviceBuffer norm_ND, rstd_N;  // mlp_norm output, its rstd (FP32)
  cuda::RouterParams rp;               // the forward's router call (shape, modes, seed)
  cuda::DeviceBuffer logits_NE, scores_NE;     // FP32
  cuda::DeviceBuffer topk_idx_NK, topk_w_NK;   // int32, FP32
  CudaDispatchHandle dispatch;
  cuda::DeviceBuffer x_sorted_RD, y_sorted_RD;  // experts' inputs and outputs, sorted by expert
  cuda::DeviceBuffer shared_gate_up_N2F, shared_h_NF;  // shared expert's MLP
};

// What every MoE layer shares (one per model): the per-forward router outputs of all layers, which
// the step statistics read after the forward, the backward scratch, and the experts.
struct CudaMoeShared {
  cuda::DeviceBuffer expert_bias_ME;  // FP32 [M, E], selection only
  cuda::DeviceBuffer losses_M2;       // FP32 [M, 2]: lb, z (written per forward)
  cuda::DeviceBuffer counts_ME;       // int32 [M, E]: routes per expert before dropping (per forward)
  cuda::DeviceBuffer dropped_M;       // int32 [M]: routes dropped by capacity (written per forward)
  // dy_sorted_RD: the unpermute gradient rows, which the experts' backward overwrites with their
  // input gradient rows in place; between MoE backwards the attention blocks borrow it as scratch.
  cuda::DeviceBuffer dy_sorted_RD, dtopk_w_NK /*f32*/, dlogits32_NE /*f32*/, dlogits16_NE;
  cuda::DeviceBuffer ws_router, ws_dispatch;
  std::unique_ptr<CudaExperts> experts;
};

// Router settings, resolved from the config strings once (core/moe_types.h).
struct CudaRouterChoice {
  ScoreFunc score = ScoreFunc::kSoftmax;
  RoutingMode mode = RoutingMode::kLearned;
  bool norm_topk = false;
};

class CudaMoeLayer {
 public:
  // layer: index among all layers (for the routing seed); p.moe_index: among MoE layers.
  CudaMoeLayer(const ModelConfig& m, const MoeConfig& e, const CudaRouterChoice& router, const LayerParams& p,
               int64_t layer);

  // As CudaAttentionBlock::bind. selective pools the norm output, the dispatched rows, the expert
  // outputs (when `experts_recompute_outputs`: local experts) and the shared expert's h; full also
  // the input, rstd and the shared expert's gate/up output. The experts bind their own rows.
  void bind(Recompute mode, CudaMoeSaved* pool, bool experts_recompute_outputs);
  // The experts read the token rows and add into the tokens' gradient themselves
  // (CudaExperts::takes_token_rows): no permute passes, no x_sorted. Call before reserve.
  void set_token_rows(bool on) { token_rows_ = on; }
  void reserve(int64_t batch, int64_t seq, CudaBufferGrower& g);
  // The shared buffers but the experts (sized by the caller: experts->reserve(N*K)).
  static void reserve_shared(const MoeConfig& e, int64_t d, int64_t batch, int64_t seq, CudaMoeShared& s,
                             CudaBufferGrower& g);
  // Saved input: written by the attention block before it.
  uint16_t* input() const { return slots_.x->as<uint16_t>(); }
  int64_t shared_hidden() const { return p_.shared ? p_.mlp_hidden : 0; }

  // As CudaAttentionBlock::forward; routing_seed is the forward's (mixed with the layer index).
  // Writes this layer's row of shared.counts_ME and shared.losses_M2. reuse_routing (full
  // recompute): the router and the dispatch map are not run; the saved routing decision, counts
  // and losses of this layer's last forward are used as they are.
  void forward(const CudaBlockContext& c, CudaResidual& res, CudaMoeShared& shared, const CudaRoutingSeed& seed,
               uint16_t* out_ND, bool reuse_routing = false);
  // train.precision = "fp8": the shared expert's GEMMs in FP8 when it has one and
  // fp8_mlp_shapes(D, F) (core/fp8_types.h; else BF16), with the model's MLP scratch (which must
  // outlive the layer); before reserve. The routed experts follow CudaExperts::set_fp8.
  void set_fp8(bool on, CudaMlpScratch* scratch);
  bool shared_fp8() const { return fp8_shared_; }
  // Where the layer's block begins (before its attention block): CudaExperts::prepare for this
  // layer (the FP8 weight codes on a side stream).
  void prepare_experts(const CudaBlockContext& c, CudaMoeShared& shared);
  // Selective recompute: the norm output, the dispatched rows, the experts' h (and outputs) and
  // the shared expert's h again, bitwise as the forward wrote them.
  void recompute_selective(const CudaBlockContext& c, CudaMoeShared& shared);
  // As CudaAttentionBlock::backward; dlb, dz: device FP32 scalars (the per-layer lb and z factors).
  void backward(const CudaBlockContext& c, CudaResidual& res, CudaMoeShared& shared, CudaMlpScratch& mlp,
                const float* dlb, const float* dz);

 private:
  struct Slots {
    cuda::DeviceBuffer *x, *norm, *rstd, *x_sorted, *y_sorted, *shared_gate_up, *shared_h;
  };
  // Gate GEMM, router (top-k, weights, counts, lb/z) and the dispatch map: the routing decision.
  void route(const CudaBlockContext& c, CudaMoeShared& shared, const CudaRoutingSeed& seed, const uint16_t* norm_ND);

  LayerParams p_;
  int64_t layer_, d_, e_, k_;
  double norm_eps_;
  double capacity_factor_;  // 0: dropless; else each expert keeps its first ceil(cf * N * K / E) rows
  CudaRouterChoice router_;
  Recompute mode_ = Recompute::kNone;
  bool pooled_y_ = false;
  bool token_rows_ = false;
  bool fp8_shared_ = false;
  CudaFp8MlpWeights shared_fp8_w_;
  CudaMlpScratch* fp8_scratch_ = nullptr;
  CudaMoeSaved saved_;
  Slots slots_;
};

}  // namespace moe
