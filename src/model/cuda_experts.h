// The routed experts of the CUDA model's MoE layers behind one interface, in two implementations:
// local (every expert on this GPU: cuda::experts_forward / _backward on the dispatched rows) and
// expert-parallel (the experts split over an NCCL ep group: counts and rows exchanged by
// all-to-all, cuda::experts_* on this rank's L local experts, rows back; the CPU's
// ep_experts_forward / _backward). Both take this rank's rows sorted by global expert and return
// each row's expert output in the same order; each keeps its own saved rows per MoE layer.
// CUDA builds only (MOECORE_HAS_CUDA); no CUDA headers.
// Legend: D model width, E experts, I expert hidden, R routed rows (N*K), L local experts,
// G rows received by this rank's experts. BF16 unless noted.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/config.h"
#include "core/recompute.h"
#include "cuda/ops/ep_exchange.h"
#include "cuda/ops/experts.h"
#include "cuda/ops/memory.h"
#include "model/cuda_block.h"
#include "model/layout.h"

namespace moe {

namespace cuda {
class NcclComm;
class NvshmemWorld;
}

// Rows and bytes the all-to-all exchanges moved since reset_ep_traffic() (forward and backward,
// dispatch and combine). "Remote" leaves out the block a rank keeps for itself.
struct EpTraffic {
  int64_t exchanges = 0;          // row exchanges (4 per MoE layer per forward + backward)
  int64_t rows_sent = 0;          // rows sent to other ranks
  int64_t bytes_sent = 0;         // row bytes sent to other ranks (BF16, or FP8 payload)
  int64_t bytes_received = 0;     // row bytes received from other ranks
};

// One routed-expert weight tensor [experts, n, k] in the flat parameters and the buffers of its FP8
// codes (what cuda::fp8_quantize_weights writes: codes, scales, transposed codes and their scales).
struct CudaFp8ExpertTensor {
  int64_t offset = 0;  // of the tensor in the flat parameters
  int64_t experts = 0, n = 0, k = 0;
  uint8_t* q = nullptr;
  float* s = nullptr;
  uint8_t* qt = nullptr;
  float* st = nullptr;
  Fp8Rule rule = Fp8Rule::kBlocks;  // the rule its codes are written by
};

class CudaExperts {
 public:
  virtual ~CudaExperts() = default;

  // Recomputation (core/recompute.h): selective keeps each layer's gate/up output and pools h
  // (one buffer for every MoE layer); full pools both. Call before reserve.
  virtual void bind(Recompute mode) = 0;
  // Whether recompute() also gives the experts' outputs again (local experts: yes; expert-parallel
  // ones would need the exchange again, so the MoE layer keeps their outputs).
  virtual bool recomputes_outputs() const = 0;
  // Selective recompute of layer moe_index: h from the saved gate/up output and, when
  // recomputes_outputs() and y_sorted_RD is not null, y_sorted_RD [R, D] again; bitwise as forward.
  virtual void recompute(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p,
                         const int32_t* offsets_E1, int64_t rows, uint16_t* y_sorted_RD) = 0;

  // train.precision = "fp8" (CudaModel::set_fp8): the forward GEMMs and data gradients in
  // block-scaled FP8, codes and scales by `rule` (train.fp8_scaling, core/fp8_types.h), the weight
  // codes rebuilt at a layer's first forward under a new CudaBlockContext::params_version. Call
  // before reserve. Refused by experts without an FP8 path.
  virtual void set_fp8(bool on, Fp8Rule rule);

  // What layer moe_index's forward needs that can start before it, enqueued where the layer's block
  // begins (before its attention block): the FP8 weight codes when they are stale, quantised on a
  // side stream forked from c.stream here, so that the memory-bound pass runs beside the attention
  // block's GEMMs; the layer's forward joins it. Optional: without it the forward quantises on
  // c.stream itself. Nothing by default.
  virtual void prepare(const CudaBlockContext& /*c*/, int64_t /*moe_index*/, const LayerParams& /*p*/) {}

  // Under set_fp8, after reserve: every expert weight tensor of the MoE layers `layers` with the
  // buffers of its codes, so that the optimizer update can write the codes in its own pass over the
  // weights (cuda::adamw_apply_fp8_weights). Empty (the default) for experts that keep no such codes.
  virtual std::vector<CudaFp8ExpertTensor> fp8_weight_tensors(const std::vector<LayerParams>& /*layers*/) {
    return {};
  }
  // Each layer's codes that are current at parameters version `from` become current at `to`: the
  // change between the two versions wrote them (an update through fp8_weight_tensors). Nothing by default.
  virtual void fp8_codes_follow(int64_t /*from*/, int64_t /*to*/) {}
  // Quantises each of `layers`' codes that is stale at c.params_version, on c.stream. Nothing by default.
  virtual void refresh_fp8(const CudaBlockContext& /*c*/, const std::vector<LayerParams>& /*layers*/) {}
  // Under set_fp8, before reserve: the weight codes of `layers` kept in the place of those weights'
  // BF16 copy in the flat BF16 parameters bf16 and quantised from the FP32 ones at f32
  // (CudaFp8ExpertCodeSet::place). Refused by experts that keep no such codes.
  virtual void place_fp8_codes(const std::vector<LayerParams>& layers, uint16_t* bf16, const float* f32);

  // Saved rows of every MoE layer and the scratch for `rows` (R = N*K) routed rows per layer.
  virtual void reserve(int64_t rows, CudaBufferGrower& g) = 0;

  // MoE layer `moe_index` (weights at p.experts_gate_up [E or L, 2I, D], p.experts_down
  // [E or L, D, I]): x_sorted_RD [R, D] sorted by global expert, expert e's rows at
  // [offsets_E1[e], offsets_E1[e+1]), counts_E [E] its row counts (both int32 on the device)
  // -> y_sorted_RD [R, D] (overwritten). Saves what backward needs for this layer.
  // input_quantised: x_sorted_RD's FP8 codes are where fp8_input_rows(rows) says (written by its
  // producer, cuda::permute_forward_fp8); only where that is not null.
  virtual void forward(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p, const int32_t* counts_E,
                       const int32_t* offsets_E1, const uint16_t* x_sorted_RD, int64_t rows, uint16_t* y_sorted_RD,
                       bool input_quantised) = 0;
  // dy_sorted_RD [R, D] -> dx_sorted_RD [R, D] (overwritten; may be dy_sorted_RD itself: dy is
  // read in full before dx is written); the experts' weight gradients +=. x_sorted_RD and
  // offsets_E1 are the forward's. input_quantised: dy_sorted_RD's FP8 codes are at
  // fp8_input_rows(rows) (cuda::unpermute_backward_fp8 wrote them).
  virtual void backward(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p,
                        const int32_t* offsets_E1, const uint16_t* x_sorted_RD, const uint16_t* dy_sorted_RD,
                        int64_t rows, uint16_t* dx_sorted_RD, bool input_quantised) = 0;
  // Where FP8 experts read the 1 x 128 codes and scales of their first GEMM's input (x_sorted in
  // forward, dy in backward), for the producer of those rows to write them in the same pass and
  // call forward / backward with input_quantised (no quantisation pass over rows just written):
  // null unless these experts run FP8 with D a multiple of 128 (the local experts).
  virtual cuda::Fp8Rows fp8_input_rows(int64_t /*rows*/) { return {}; }

  // Whether forward_tokens and backward_tokens run: the experts read the token rows through the
  // dispatch map themselves and add the input gradients into the tokens' rows, so the MoE layer
  // runs neither permute pass nor keeps x_sorted (the rowwise exchange: rows stored from the token
  // rows and loaded back into them).
  virtual bool takes_token_rows() const { return false; }
  // forward with x_sorted row r = tokens_TD[sorted_route_R[r] / top_k].
  virtual void forward_tokens(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p,
                              const int32_t* counts_E, const int32_t* offsets_E1, const uint16_t* tokens_TD,
                              const int32_t* sorted_route_R, int64_t top_k, int64_t rows, uint16_t* y_sorted_RD);
  // backward, the input gradients added into dx_TD [T, D] (dx_TD[t] += the sum over the token's
  // routes, as cuda::permute_backward) instead of written as dx_sorted.
  virtual void backward_tokens(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p,
                               const int32_t* offsets_E1, const uint16_t* dy_sorted_RD, const int32_t* route_to_row,
                               int64_t num_tokens, int64_t top_k, int64_t rows, uint16_t* dx_TD);

  virtual EpTraffic traffic() const { return {}; }
  virtual void reset_traffic() {}
};

// What the experts of one MoE layer save for backward: the fused gate/up and SwiGLU outputs of
// their rows (R rows locally; under expert parallelism G rows, grown to the received count).
struct CudaExpertsSaved {
  cuda::DeviceBuffer gate_up_R2I, h_RI;
};

// One MoE layer's expert weights in FP8 (cuda::Fp8ExpertWeights): gate_up [E, 2I, D] and down
// [E, D, I] as E4M3 codes with their 128 x 128 block scales, and their transposed copies (the
// data gradients' B), quantised from the BF16 copy at parameter version `version` (-1: never).
// The codes are at the q_* pointers: in the buffers here, or where CudaFp8ExpertCodeSet::place
// put them (the buffers then stay empty).
struct CudaFp8ExpertCodes {
  cuda::DeviceBuffer gate_up, s_gate_up, gate_up_t, s_gate_up_t, down, s_down, down_t, s_down_t;
  uint8_t *q_gate_up = nullptr, *q_gate_up_t = nullptr, *q_down = nullptr, *q_down_t = nullptr;
  int64_t version = -1;
};

// The FP8 codes of every MoE layer's experts on this GPU (E experts, gate_up [E, 2I, D] and down
// [E, D, I] each), as the FP8 experts (local or behind the rowwise exchange) keep them: grown by
// reserve (or placed in the weights' BF16 copy), quantised from the BF16 weights when the
// parameters' version moves, and handed to the update that writes them itself
// (CudaExperts::fp8_weight_tensors).
class CudaFp8ExpertCodeSet {
 public:
  // Before reserve: each layer's codes and transposed codes (1 + 1 bytes per parameter) in the
  // place of its weights' BF16 copy (2 bytes per parameter at bf16 + the tensor's offset), which
  // is then not kept, and quantised from the FP32 weights at f32 (their BF16 rounding: the same
  // codes). For an update that writes the codes and no BF16 copy of these tensors
  // (CudaModel::keep_fp8_codes_in_bf16_copy). Offsets 8-element aligned; once only.
  void place(const std::vector<LayerParams>& layers, uint16_t* bf16, const float* f32);
  bool placed() const { return f32_ != nullptr; }
  // Codes for `layers` MoE layers of `experts` experts (D = d, I = inner).
  void reserve(int64_t layers, int64_t experts, int64_t d, int64_t inner, CudaBufferGrower& g);
  int64_t layers() const { return int64_t(codes_.size()); }
  // Whether layer m's codes are those of the parameters at `version`.
  bool current(int64_t m, int64_t version) const { return codes_[size_t(m)].version == version; }
  // Layer m's codes from the BF16 weights at p (c.params; placed: the BF16 rounding of the FP32
  // weights), on `stream`, when stale at c.params_version.
  void refresh(const CudaBlockContext& c, int64_t m, const LayerParams& p, cuda::Stream stream);
  cuda::Fp8ExpertWeights view(int64_t m) const;
  // The weight tensors of `layers` with their code buffers (CudaExperts::fp8_weight_tensors).
  std::vector<CudaFp8ExpertTensor> tensors(const std::vector<LayerParams>& layers);
  // Codes current at version `from` become current at `to` (CudaExperts::fp8_codes_follow).
  void follow(int64_t from, int64_t to);
  // The rule the codes are written by and the experts quantise their activations by (set_fp8).
  void set_rule(Fp8Rule rule) { rule_ = rule; }
  Fp8Rule rule() const { return rule_; }

 private:
  CudaFp8ExpertCodes& at(int64_t m, const char* what);
  int64_t experts_ = 0, d_ = 0, inner_ = 0;
  Fp8Rule rule_ = Fp8Rule::kBlocks;
  std::vector<CudaFp8ExpertCodes> codes_;
  const float* f32_ = nullptr;  // place: the FP32 weights the placed codes are quantised from
};

// Every expert on this GPU: cuda::experts_* on the dispatched rows, sync-free and capturable;
// under set_fp8, cuda::experts_*_fp8 with each layer's CudaFp8ExpertCodes.
class CudaLocalExperts final : public CudaExperts {
 public:
  CudaLocalExperts(const MoeConfig& e, int64_t d, int64_t num_moe_layers);
  ~CudaLocalExperts() override;
  CudaLocalExperts(const CudaLocalExperts&) = delete;
  CudaLocalExperts& operator=(const CudaLocalExperts&) = delete;
  void bind(Recompute mode) override { mode_ = mode; }
  void prepare(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p) override;
  void set_fp8(bool on, Fp8Rule rule) override;
  std::vector<CudaFp8ExpertTensor> fp8_weight_tensors(const std::vector<LayerParams>& layers) override;
  void fp8_codes_follow(int64_t from, int64_t to) override;
  void refresh_fp8(const CudaBlockContext& c, const std::vector<LayerParams>& layers) override;
  void place_fp8_codes(const std::vector<LayerParams>& layers, uint16_t* bf16, const float* f32) override;
  cuda::Fp8Rows fp8_input_rows(int64_t rows) override;
  bool recomputes_outputs() const override { return true; }
  void recompute(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p, const int32_t* offsets_E1,
                 int64_t rows, uint16_t* y_sorted_RD) override;
  void reserve(int64_t rows, CudaBufferGrower& g) override;
  void forward(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p, const int32_t* counts_E,
               const int32_t* offsets_E1, const uint16_t* x_sorted_RD, int64_t rows, uint16_t* y_sorted_RD,
               bool input_quantised) override;
  void backward(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p, const int32_t* offsets_E1,
                const uint16_t* x_sorted_RD, const uint16_t* dy_sorted_RD, int64_t rows, uint16_t* dx_sorted_RD,
                bool input_quantised) override;

 private:
  cuda::DeviceBuffer& gate_up_rows(int64_t m) {
    return mode_ == Recompute::kFull ? pool_.gate_up_R2I : saved_[size_t(m)].gate_up_R2I;
  }
  cuda::DeviceBuffer& h_rows(int64_t m) { return mode_ != Recompute::kNone ? pool_.h_RI : saved_[size_t(m)].h_RI; }

  int64_t d_, e_, inner_;
  Recompute mode_ = Recompute::kNone;
  bool fp8_on_ = false;
  std::vector<CudaExpertsSaved> saved_;  // [M]
  CudaExpertsSaved pool_;                // the recomputed rows of every layer
  cuda::DeviceBuffer ws_;                // experts_backward workspace (shared by the layers)
  CudaFp8ExpertCodeSet fp8_;             // [M] layers under set_fp8
  cuda::DeviceBuffer fp8_ws_;            // experts_fp8_workspace_bytes (shared by the layers)
  // prepare's side stream, its fork event and each layer's codes-ready event (made by reserve
  // under set_fp8, outside any capture); pending_[m]: layer m's forward is to wait for ready_[m].
  cuda::Stream side_ = nullptr;
  cuda::Event fork_ = nullptr;
  std::vector<cuda::Event> ready_;
  std::vector<char> pending_;
};

// What the expert-parallel experts save per MoE layer: the exchange handle, the received rows
// regrouped by local expert and their gate/up and SwiGLU outputs, the regroup / ungroup maps [G]
// and the local expert offsets [L + 1] on the device.
struct CudaEpExpertsSaved {
  cuda::EpHandle handle;
  CudaExpertsSaved experts;
  cuda::DeviceBuffer x_GD, regroup_G, ungroup_G, local_offsets_L1;
};

// The experts split over the ep group of `comm` (L = E / ep per rank, this rank's at [rank L,
// (rank + 1) L)). Per MoE layer and forward: counts by all-to-all, read on the host (one stream
// sync: not sync-free, refused under graph capture), the handle, rows out (dispatch), regroup,
// cuda::experts_* on the L local experts, ungroup, rows back (combine); backward the same with the
// gradient rows and the forward's handle. Forward and backward are collectives over the group.
// Buffers for G received rows grow (1/8 headroom) right after the count read, while the stream is
// idle, through `grower` (which must outlive this object).
class CudaEpExperts final : public CudaExperts {
 public:
  CudaEpExperts(const MoeConfig& e, int64_t d, int64_t num_moe_layers, cuda::NcclComm& comm,
                int64_t local_experts, CudaBufferGrower& grower);
  void bind(Recompute mode) override { mode_ = mode; }
  bool recomputes_outputs() const override { return false; }
  void recompute(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p, const int32_t* offsets_E1,
                 int64_t rows, uint16_t* y_sorted_RD) override;
  void reserve(int64_t rows, CudaBufferGrower& g) override;
  void forward(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p, const int32_t* counts_E,
               const int32_t* offsets_E1, const uint16_t* x_sorted_RD, int64_t rows, uint16_t* y_sorted_RD,
               bool input_quantised) override;
  void backward(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p, const int32_t* offsets_E1,
                const uint16_t* x_sorted_RD, const uint16_t* dy_sorted_RD, int64_t rows, uint16_t* dx_sorted_RD,
                bool input_quantised) override;
  EpTraffic traffic() const override { return traffic_; }
  void reset_traffic() override { traffic_ = {}; }
  // train.precision = "fp8" (D a multiple of 128): the rows that feed an FP8 GEMM on the expert's
  // rank (x_sorted forward, dy_sorted backward) travel as their FP8 payload (cuda::fp8_pack_rows:
  // codes and 1 x 128 scales, D + D / 32 bytes a row against 2 D), unpacked on arrival into the
  // experts' FP8 input rows and their dequantised BF16 values (what the experts save and their
  // weight gradients read, as the CPU reference's FP8 exchange delivers); the outputs and input
  // gradients travel in BF16. The local experts' weight codes follow the parameters' version at
  // each forward (no fused update).
  void set_fp8(bool on, Fp8Rule rule) override;

 private:
  // Two row exchanges of `h` (dispatch of dispatch_bytes a row, combine of combine_bytes): rows
  // to and from the other ranks.
  void count_traffic(const cuda::EpHandle& h, int64_t dispatch_bytes, int64_t combine_bytes);
  // The G received rows' FP8 buffers, grown (like the row buffers) right after the count read.
  void grow_fp8(int64_t rows);
  // Rows [R, D] (BF16) to their experts' ranks as FP8 payload: pm (peer-major) then `grouped`
  // [G, per] by local expert, unpacked into the FP8 input rows and `values` [G, D] (BF16).
  void dispatch_fp8(const cuda::EpHandle& h, const CudaEpExpertsSaved& s, const uint16_t* rows_RD, int64_t rows,
                    uint16_t* values, cuda::Stream st);
  cuda::DeviceBuffer& gate_up_rows(int64_t m) {
    return mode_ == Recompute::kFull ? pool_.gate_up_R2I : saved_[size_t(m)].experts.gate_up_R2I;
  }
  cuda::DeviceBuffer& h_rows(int64_t m) { return mode_ != Recompute::kNone ? pool_.h_RI : saved_[size_t(m)].experts.h_RI; }

  int64_t d_, e_, inner_, local_;
  Recompute mode_ = Recompute::kNone;
  CudaExpertsSaved pool_;  // the recomputed rows of every layer
  cuda::NcclComm& comm_;
  CudaBufferGrower& grower_;
  std::vector<CudaEpExpertsSaved> saved_;  // [M]
  // Received counts [ep * L] (int32), peer-major exchanged rows and expert-side work rows (each
  // [G, D]), the backward workspace; host copies of the counts; traffic counters.
  cuda::DeviceBuffer recv_counts_E, pm_GD, work_GD, ws_;
  std::vector<int32_t> host_counts_;
  EpTraffic traffic_;
  // FP8 (set_fp8): the local experts' weight codes, the packed rows this rank sends [R, per] and the
  // experts' FP8 input rows for G rows (experts_fp8_workspace_bytes).
  bool fp8_on_ = false;
  CudaFp8ExpertCodeSet fp8_;
  cuda::DeviceBuffer send_RP, fp8_ws_;
};

// What the rowwise experts keep per MoE layer: the rows this rank's experts received (symmetric:
// every rank of the group writes into it), their gate/up and SwiGLU outputs, this rank's rows'
// places in their expert ranks' buffers [R] and its local expert offsets [L + 1].
struct CudaRowwiseExpertsSaved {
  void* x_GD = nullptr;  // symmetric [G, D]
  CudaExpertsSaved experts;
  cuda::DeviceBuffer dest_row_R, local_offsets_L1;
};

// The rowwise exchange (parallel.ep_backend = "rowwise", docs/expert_parallel.md): the experts
// split over the PEs of `world` (L = E / ep, this rank's at [pe L, (pe + 1) L); one PE: all of them,
// the exchange local). Per MoE layer: counts stored into every PE's symmetric [ep, E] table, a
// barrier, every rank computes the same placement (cuda::ep_rowwise_placement: each row's row in
// its expert rank's receive buffer, grouped by local expert, under the static per-expert capacity
// ceil(capacity_factor x R x ep / E), 0: dropless), each row stored straight into that buffer
// (cuda::ep_rowwise_scatter), a barrier, the grouped GEMMs on the received rows with the device
// offsets, a barrier, each rank loads its rows' outputs back (ep_rowwise_gather); backward pushes
// the output gradients the same way and loads the input gradients back. No host read anywhere:
// forward and backward are capturable (collectives over the world's PEs, in the same order on every
// rank). Dropped rows give zero output and zero input gradient; their count per layer goes to
// dropped_M (set_dropped_counter). Receive buffers are sized for the worst case (every row of
// every rank, or L x capacity) when reserve runs (collective: the same sizes on every PE).
class CudaRowwiseExperts final : public CudaExperts {
 public:
  CudaRowwiseExperts(const MoeConfig& e, int64_t d, int64_t num_moe_layers, cuda::NvshmemWorld& world,
                     double capacity_factor);
  ~CudaRowwiseExperts() override;
  void bind(Recompute mode) override { mode_ = mode; }
  bool recomputes_outputs() const override { return false; }
  void recompute(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p, const int32_t* offsets_E1,
                 int64_t rows, uint16_t* y_sorted_RD) override;
  void reserve(int64_t rows, CudaBufferGrower& g) override;
  void forward(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p, const int32_t* counts_E,
               const int32_t* offsets_E1, const uint16_t* x_sorted_RD, int64_t rows, uint16_t* y_sorted_RD,
               bool input_quantised) override;
  void backward(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p, const int32_t* offsets_E1,
                const uint16_t* x_sorted_RD, const uint16_t* dy_sorted_RD, int64_t rows, uint16_t* dx_sorted_RD,
                bool input_quantised) override;
  bool takes_token_rows() const override { return true; }
  void forward_tokens(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p, const int32_t* counts_E,
                      const int32_t* offsets_E1, const uint16_t* tokens_TD, const int32_t* sorted_route_R,
                      int64_t top_k, int64_t rows, uint16_t* y_sorted_RD) override;
  void backward_tokens(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p, const int32_t* offsets_E1,
                       const uint16_t* dy_sorted_RD, const int32_t* route_to_row, int64_t num_tokens, int64_t top_k,
                       int64_t rows, uint16_t* dx_TD) override;
  // Where layer m's dropped rows are written (device int32 [M]; the MoE layers' counter).
  void set_dropped_counter(int32_t* dropped_M) { dropped_M_ = dropped_M; }
  // Rows and bytes crossing to and from the other PEs since reset_traffic (counted on the device
  // per exchange; reading them waits for the model's stream): dispatch and combine of every
  // forward and backward, as CudaEpExperts counts them.
  EpTraffic traffic() const override;
  void reset_traffic() override;
  // Received rows each expert rank's buffer holds at most, for R rows per rank.
  int64_t receive_rows(int64_t rows) const;
  // Per-expert capacity for R rows per rank (0: dropless).
  int64_t capacity(int64_t rows) const;
  // Symmetric heap bytes reserve(rows) allocates (fp8: with the FP8 payload buffer).
  static int64_t symmetric_bytes(const MoeConfig& e, int64_t d, int64_t num_moe_layers, int64_t ep, double cf,
                                 int64_t rows, bool fp8 = false);
  // train.precision = "fp8" (D a multiple of 128): the rows scattered into the experts' buffers
  // (x forward, dy backward) go as FP8 payload rows (cuda::fp8_pack_rows, padded to 16-byte
  // words) into one symmetric payload buffer every layer and pass shares, and the expert rank
  // unpacks them into the experts' FP8 input rows and their dequantised BF16 values, written
  // straight into the layer's received rows (forward: what the experts save and the weight
  // gradients read) or the gradient rows (backward); outputs and input gradients stay BF16. The
  // weight codes as the local experts keep them (the step's update writes them; capturable).
  void set_fp8(bool on, Fp8Rule rule) override;
  std::vector<CudaFp8ExpertTensor> fp8_weight_tensors(const std::vector<LayerParams>& layers) override;
  void fp8_codes_follow(int64_t from, int64_t to) override;
  void refresh_fp8(const CudaBlockContext& c, const std::vector<LayerParams>& layers) override;
  void place_fp8_codes(const std::vector<LayerParams>& layers, uint16_t* bf16, const float* f32) override;

 private:
  cuda::DeviceBuffer& gate_up_rows(int64_t m) {
    return mode_ == Recompute::kFull ? pool_.gate_up_R2I : saved_[size_t(m)].experts.gate_up_R2I;
  }
  cuda::DeviceBuffer& h_rows(int64_t m) { return mode_ != Recompute::kNone ? pool_.h_RI : saved_[size_t(m)].experts.h_RI; }
  uint16_t* const* peers(size_t slot) const { return peer_table_.as<uint16_t* const>() + slot * size_t(ep_); }
  // Forward from x (rows, or token rows through sorted_route); backward's exchange and experts,
  // the input gradients left in the symmetric gradient buffer.
  void forward_rows(const CudaBlockContext& c, int64_t m, const LayerParams& p, const int32_t* counts_E,
                    const int32_t* offsets_E1, const uint16_t* x, const int32_t* sorted_route, int64_t top_k,
                    int64_t rows, uint16_t* y_sorted_RD);
  void backward_experts(const CudaBlockContext& c, int64_t m, const LayerParams& p, const int32_t* offsets_E1,
                        const uint16_t* dy_sorted_RD, int64_t rows);
  void free_symmetric();
  // FP8: n rows of `rows` (BF16 [n, D]) packed into pack_RP_ as payload rows of fp8_stride(D) bytes,
  // the width in 16-bit words the scatter moves; and the G payload rows received in payload_GP_
  // unpacked into the experts' FP8 input rows and their dequantised values into `values` [G, D].
  // The payload buffer's slot in the peer table.
  static int64_t fp8_stride(int64_t d);
  const uint16_t* pack_fp8(const uint16_t* rows, int64_t n, cuda::Stream st);
  void unpack_fp8(uint16_t* values, int64_t G, cuda::Stream st);
  size_t payload_slot() const { return 3 + saved_.size(); }

  int64_t d_, e_, inner_, local_, ep_, rank_;
  double capacity_factor_;
  cuda::NvshmemWorld& world_;
  Recompute mode_ = Recompute::kNone;
  CudaExpertsSaved pool_;
  std::vector<CudaRowwiseExpertsSaved> saved_;  // [M]
  int64_t reserved_rows_ = 0;                   // R the buffers are sized for
  // Symmetric: the counts table [ep, E] int32, the expert outputs [G, D] and the gradient rows
  // [G, D] (dy in, dx out in place) every layer shares, and under FP8 the received payload rows
  // [G, stride]; the peers' addresses of each symmetric buffer (slot 0 counts, 1 outputs, 2
  // gradients, 3 + m layer m's received rows, 3 + M the payload), ep each.
  void* counts_all_ = nullptr;
  void* y_GD_ = nullptr;
  void* dy_GD_ = nullptr;
  void* payload_GP_ = nullptr;
  cuda::DeviceBuffer peer_table_, kept_PE_, dropped_scratch_, ws_;
  int32_t* dropped_M_ = nullptr;
  // Traffic: per layer {rows out, rows in} of its last forward [M, 2] and the running totals [2]
  // (int64), the exchanges counted on the host, the stream they were counted on.
  cuda::DeviceBuffer traffic_slots_, traffic_total_;
  int64_t exchanges_ = 0;
  cuda::Stream traffic_stream_ = nullptr;
  // FP8 (set_fp8): the local experts' weight codes, the packed rows [R, stride], the experts' FP8
  // input rows.
  bool fp8_on_ = false;
  CudaFp8ExpertCodeSet fp8_;
  cuda::DeviceBuffer pack_RP_, fp8_ws_;
};

}  // namespace moe
