// The model of model.h on one GPU: same parameter layout, forward/backward semantics and
// gradient conventions as Model<float>, built from the ops of src/cuda/ops. FP32 master weights,
// a BF16 copy read by every op, FP32 gradients (accumulated, +=); BF16 activations with an FP32
// residual stream (and FP32 residual gradient), FP32 router logits, rstd and lse. The LM head and
// cross-entropy run in chunks of kHeadChunkRows rows, so [N, V] logits never exist; backward
// recomputes each chunk's logits (one extra N x V x D GEMM) and fuses the softmax gradient.
// Dropless (capacity_factor = 0) or with a per-expert capacity (the CPU model's drop rule, one GPU
// or data parallel; expert parallelism is dropless). No CUDA headers; defined only in CUDA builds
// (MOECORE_HAS_CUDA), so CPU-only code must not reference it.
// The forward is a list of block calls (llm.c's gpt2_forward): embedding, then per layer an
// attention block (cuda_attention_block.h) and a dense MLP block (cuda_mlp_block.h) or a MoE layer
// (cuda_moe_layer.h: router -> dispatch handle -> experts -> combine, + shared expert), then the
// LM head (cuda_lm_head.h); backward the reverse. Each block keeps its saved activations and can
// be re-run from its saved input; a range of layers runs alone (forward_blocks, backward_blocks).
// Sync-free: forward_device/backward only enqueue work on stream(). Every buffer is sized by
// reserve(batch, seq) (or the first forward of a shape) and never grows while the stream is being
// captured, so a whole step is capturable in a CUDA graph. Statistics (CE sum, lb/z sums, expert
// counts, bad id/target counters) accumulate in a device record until reset_stats().
// Expert parallelism (optional CudaExpertParallel: the ep group's NCCL communicator): the layout
// holds experts [ep_rank L, (ep_rank + 1) L) of every MoE layer (L = E / ep, the CPU model's
// ExpertSlice and placements); each MoE layer sends its routed rows to the experts' ranks and back
// (dropless all-to-all; docs/parallel.md; CudaEpExperts of cuda_experts.h). That path reads the
// expert counts on the host, so it syncs the stream once per MoE layer per forward and cannot be
// captured in a CUDA graph; forward and backward are then collectives over the ep group.
// Legend: B batch, S sequence, N = B*S tokens, D model width, H query heads, Q = H*head_dim,
// C = n_kv_heads*head_dim (kv width), V vocabulary, E experts, K top_k, R routed rows (N*K),
// I expert hidden, F dense/shared MLP hidden, L local experts, G rows received by this rank's
// experts, M MoE layers.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/arena.h"
#include "core/config.h"
#include "core/recompute.h"
#include "cuda/device.h"
#include "cuda/ops/memory.h"
#include "model/cuda_experts.h"
#include "model/model.h"
#include "parallel/topology.h"

namespace moe {

namespace cuda {
class EventTimer;
class NcclComm;
class NvshmemWorld;
struct StepStatsRecord;
}  // namespace cuda

// Expert parallelism of a CudaModel: the ep group (comm->size() ranks, this rank comm->rank()),
// made on the model's device; it must outlive the model. E must be divisible by the group size.
// rowwise (parallel.ep_backend = "rowwise"): the NVSHMEM world of the ep group (one PE per rank,
// PE = ep rank; with one PE comm may be null and every expert is local), whose symmetric buffers
// carry the rows (CudaRowwiseExperts, cuda_experts.h) instead of the all-to-all: sync-free and
// capturable. capacity_factor: parallel.ep_capacity_factor (rowwise only; 0: dropless).
struct CudaExpertParallel {
  cuda::NcclComm* comm = nullptr;
  cuda::NvshmemWorld* rowwise = nullptr;
  double capacity_factor = 0.0;
};

// The keys and values CudaModel::decode has run: per layer k[l], v[l] BF16 [capacity, C] on the
// model's device, rows [0, length) filled. Grows (doubling, contents kept) as decode needs.
struct CudaKvCache {
  int64_t length = 0, capacity = 0;
  std::vector<cuda::DeviceBuffer> k, v;
};

class CudaModel {
 public:
  static constexpr int64_t kHeadChunkRows = 4096;

  // Allocates parameters (zero), gradients (zero) and the expert bias (zero) on the current device.
  // ep (may be null or of size 1: every expert here) splits the experts over the ep group;
  // refused with fewer experts than ranks or E not divisible by the group size.
  // part (model/layout.h): the tensors this model holds; a pipeline stage's model holds its layers
  // (and the embedding / the final norm and LM head when it is the first / last stage) and runs
  // only those pieces: forward_blocks / backward_blocks on held layers, the stage's input through
  // set_stage_input and its output gradient through set_stage_output_grad; forward(), backward()
  // and decode() need the whole model.
  CudaModel(const ModelConfig& model, const MoeConfig& moe, const CudaExpertParallel* ep = nullptr,
            const LayoutPart& part = {});
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const ModelConfig& model_config() const { return mcfg_; }
  const LayoutPart& part() const { return part_; }
  const MoeConfig& moe_config() const { return ecfg_; }
  const ParamLayout& layout() const { return layout_; }
  int64_t num_moe_layers() const { return num_moe_layers_; }
  cuda::Stream stream() const { return stream_; }
  // Expert parallelism: group size (1 without), this rank's index, its experts, and where each
  // layout entry sits in its global tensor (as Model<float>::placements(): global_placement of
  // parallel/topology.h; every entry whole at offset 0 without expert parallelism).
  int64_t ep_size() const { return ep_size_; }
  // Whether the experts exchange rows through the rowwise backend (no host reads: capturable).
  bool rowwise() const { return rowwise_; }
  int64_t ep_rank() const { return ep_rank_; }
  const ExpertSlice& expert_slice() const { return slice_; }
  const std::vector<GlobalPlacement>& placements() const { return placements_; }
  // Device initialisation with the values of Model<float>::init_params(seed) (init_std = std):
  // each local tensor gets its range of the global tensor's stream, so a local expert equals the
  // one-rank model's expert. Refreshes the BF16 copy; no host copy, no synchronisation.
  void init_params_device(uint64_t seed, double std);
  EpTraffic ep_traffic() const;
  void reset_ep_traffic();

  // Device buffers, layout().total_numel() elements each.
  float* params();          // FP32 master weights
  uint16_t* params_bf16();  // BF16 copy every op reads (adamw_step refreshes it)
  float* grads();           // FP32 gradients
  float* expert_bias();     // [M, E] FP32, selection only

  // Copies host FP32 parameters [total_numel] (e.g. Model<float>::params()) and refreshes the BF16 copy.
  void load_params(const float* host_params);
  // Expert bias [num_moe_layers * E] FP32 from the host.
  void load_expert_bias(const std::vector<float>& bias);
  // Recomputes the BF16 copy from the FP32 master weights.
  void refresh_bf16();
  std::vector<float> download_params();
  std::vector<float> download_grads();
  std::vector<float> download_expert_bias();  // [M * E]
  void zero_grads();
  // The step's gradients without a full zeroing pass: zeroes only the gradients that accumulate
  // (norm weights, embedding, alignment padding); the next backward() writes every other weight
  // gradient whole (a GEMM with beta 0, the grouped wgrad's overwrite) instead of adding to it, and
  // later backwards of the step accumulate. Afterwards the gradients equal those after zero_grads()
  // and the same backwards, up to the sign of zeros and FP32 subnormals (the accumulating grouped
  // wgrad flushes them). Saves a write and a read of 4 bytes per such parameter per step. Until
  // that backward ran, grads() holds stale values outside the zeroed ranges.
  void prepare_grads_for_step();

  // The step's gradient norm without a second read of the routed experts' weight gradients: with
  // this on, the first backward after prepare_grads_for_step also writes the sums of squares of
  // those gradients by 128 x 128 blocks, as their grouped GEMMs write them (cuda::grouped_gemm_wgrad's
  // squares, core/square_blocks.h), into expert_grad_squares(): MoE layer m's
  // expert_square_blocks_per_layer() values at m times that, gate_up's blocks then down's. They are
  // the squares of the gradients while nothing else changes those: one backward a step, no
  // gradient reduction. Local experts of a whole model only (refused under expert parallelism, the
  // rowwise exchange and pipeline stages). Before the first forward or reserve.
  void set_expert_grad_squares(bool on);
  // The sums, while they are current: the last backward ran first in its step and wrote them, and
  // no backward ran since; else null (e.g. after a step's second micro-batch).
  const double* expert_grad_squares() const;
  int64_t expert_square_blocks_per_layer() const;

  // Activation recomputation (core/recompute.h): which saved tensors every layer keeps; the others
  // live in one pool all layers share and backward_blocks recomputes them per layer before its
  // backward (under the phase `recompute`). Gradients equal those of Recompute::kNone bitwise (the
  // same kernels on the same inputs; routing is not decided again). Before the first forward or
  // reserve (refused after). Default kNone.
  void set_recompute(Recompute mode);

  // Training steps: the LM head's forward also does its backward's chunk work (the CE gradient
  // scaled by the loss scales already on the device, dnorm and dW_head) while each chunk's logits
  // are at hand, so backward() does not compute the logits again: one [N, D] x [D, V] GEMM fewer
  // per micro-batch, the same values bit for bit. Every forward must then be followed by its
  // backward (with the scales set before the forward); evaluation forwards run with it off.
  void set_fuse_head_backward(bool on) { fuse_head_backward_ = on; }

  // train.precision = "fp8": the routed experts' forward GEMMs and data gradients in block-scaled
  // FP8 (cuda::experts_forward_fp8 / _backward_fp8: E4M3 codes, 1 x 128 activation and gradient
  // blocks, 128 x 128 weight blocks, the weight gradients in BF16; docs/numerics.md), and so the
  // attention projections, dense MLPs and shared experts (cuBLASLt), everything else as in BF16.
  // `rule` (train.fp8_scaling) picks every block's scale and codes: the block recipe's, or MX's
  // 1 x 32 sub-blocks re-blocked (core/fp8_types.h; the MX rules need D, the expert and MLP hidden
  // sizes multiples of 128). Each MoE layer keeps the FP8 codes of its expert weights and their transposed
  // copy (2 bytes per expert parameter) and quantises them from the BF16 copy at its first forward
  // after the parameters changed (params_version()), so a captured step quantises once per step,
  // in its first micro-batch's forward, unless the update wrote the codes itself
  // (mark_params_changed_with_expert_codes). Under expert parallelism the experts' input rows and
  // row gradients travel as FP8 payload (D a multiple of 128, else refused; docs/expert_parallel.md).
  // Before the first forward or reserve (refused after).
  void set_fp8(bool on, Fp8Rule rule = Fp8Rule::kBlocks);
  bool fp8() const { return fp8_; }
  // Under set_fp8, for a step whose update writes the experts' codes (cuda::adamw_apply_fp8_weights,
  // the update at the end of the step: RunPlan::fp8_codes_in_bf16_copy): each MoE layer's expert
  // weight codes and their transposed copy (1 + 1 bytes per parameter) live where the experts'
  // BF16 copy was (2 bytes per parameter of params_bf16()), which is then not kept, and are
  // quantised from the FP32 weights' BF16 rounding when stale (after load_params, refresh_bf16,
  // init_params_device): the same codes, and the BF16 copy's 2 bytes per expert parameter saved.
  // Nothing may then read or write the experts' part of params_bf16() as BF16 but refresh_bf16
  // (whose codes it leaves stale), nor update their weights without writing their codes. Local or
  // rowwise experts. Once, before the first forward or reserve; FP8 stays on after it.
  void keep_fp8_codes_in_bf16_copy();
  bool fp8_codes_in_bf16_copy() const { return fp8_codes_in_bf16_copy_; }
  // Counts changes to the BF16 copy: load_params, refresh_bf16 and init_params_device bump it
  // themselves; whoever updates the BF16 copy on the device otherwise (the optimizer step) calls
  // mark_params_changed() once that update is enqueued, and before any forward that must see it.
  int64_t params_version() const { return params_version_; }
  void mark_params_changed() { ++params_version_; }
  // The routed experts' weight tensors with the buffers of their FP8 codes (train.precision =
  // "fp8" with local experts; empty otherwise), for an update that writes the codes in its own pass
  // over the weights (cuda::adamw_apply_fp8_weights). After reserve.
  std::vector<CudaFp8ExpertTensor> fp8_expert_tensors();
  // mark_params_changed for an update that wrote the codes of every fp8_expert_tensors() tensor
  // (from the BF16 rounding of the weights it wrote; in their BF16 copy's place,
  // keep_fp8_codes_in_bf16_copy): the experts' codes that were current stay current, so the next
  // forward does not quantise them again (the other FP8 weights are rebuilt as ever).
  void mark_params_changed_with_expert_codes();
  // Quantises the experts' stale FP8 codes now, on the model's stream: before a captured step, so
  // that its forward finds them current. Nothing without FP8 experts.
  void refresh_fp8_expert_codes();
  bool fuse_head_backward() const { return fuse_head_backward_; }
  Recompute recompute() const { return recompute_; }

  // Sizes every activation, work buffer and workspace for batches of `batch` x `seq` tokens
  // (dropless expert rows: N * top_k). Allocates only what is missing; call it outside capture.
  void reserve(int64_t batch, int64_t seq);
  // Counts buffer reallocations (reserve or a forward of a larger shape). A captured graph holds
  // the addresses it saw: it is stale once this number changes.
  int64_t buffer_generation() const;
  // Device bytes of the model's own buffers (parameters, gradients, activations, scratch; not the
  // GEMM and cuDNN libraries' workspaces), as sized now.
  int64_t device_bytes() const;

  // Incremental decoding (generation), as Model<float>::decode: runs n new tokens (host ids, one
  // sequence) at positions cache.length .., appending their keys and values to `cache`, and
  // returns the FP32 logits [V] of the last one (final norm and LM head on that row only). Every
  // MoE layer routes the new tokens on their own and keeps every route (no capacity); random
  // routing draws with seed 0, as the CPU decode. Eager (not for capture), synchronises the stream
  // to return the logits; one GPU (refused with expert parallelism). Sizes the forward buffers
  // for n tokens (nothing for backward) and leaves the statistics record as it was.
  std::vector<float> decode(const int32_t* tokens, int64_t n, CudaKvCache& cache);

  // inputs/targets: host [B, S] token ids (targets < 0 do not count). Resets the statistics, copies
  // the ids into the model's own device buffers, then runs forward_device. Not for capture.
  void forward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
               uint64_t routing_seed = 0);
  // inputs/targets: device [B, S] token ids, which must stay unchanged until backward() ran.
  // Enqueues the forward on stream() and saves what backward needs; the CE sum, the router's
  // lb/z losses and expert counts and the bad id/target counts add to the statistics record.
  // routing_seed_device (random routing under a CUDA graph): the seed is read there on the device
  // when the router runs, routing_seed is then not used; the buffer must hold it until backward().
  void forward_device(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                      uint64_t routing_seed = 0, const uint64_t* routing_seed_device = nullptr);
  // Accumulates (+=) the gradient of ce * ce_sum + lb * sum_l lb_l + z * sum_l z_l of the last
  // forward into grads(), with the three FP32 factors read on the device from
  // loss_scales_device() (write them there before the step; a graph replays with new values).
  void backward();
  // set_loss_scales(scales), then backward(). Not for capture.
  void backward(const LossScales& scales);
  // Writes scales into loss_scales_device() (ce_scale, lb_scale / M, z_scale / M: the gradient of
  // scales.objective(stats of the last forward)), ordered on stream(). Not for capture.
  void set_loss_scales(const LossScales& scales);
  float* loss_scales_device();  // device FP32 [3]: CE gradient scale, per-layer lb and z factors

  // forward_device and backward() in pieces (pipeline stages, activation recomputation), each
  // enqueuing on stream() what the whole call would at that point, phase marks and grads-ready
  // hook calls included:
  //   forward_device = begin_forward, embedding_forward, forward_blocks(0, n_layers),
  //                    lm_head_forward, end_forward;
  //   backward()     = lm_head_backward, backward_blocks(0, n_layers), embedding_backward (and the
  //                    phase timer closed).
  // begin_forward: host only (checks, reserve(batch, seq), the ids, the routing seed and the host
  // statistics counters; ids as in forward_device). Layer l's blocks read their saved input (the
  // BF16 copy of the residual, written by the block before) and residual_device(): re-running
  // forward_blocks(first, last) after residual_device() was restored to its value at `first`
  // rewrites the saved activations of layers [first, last) and the residual bitwise as before.
  // end_forward: the router statistics into the record (MoE layers), closes the phase timer.
  void begin_forward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                     uint64_t routing_seed = 0, const uint64_t* routing_seed_device = nullptr);
  void embedding_forward();
  void forward_blocks(int64_t first, int64_t last);  // layers [first, last), in order
  void lm_head_forward();
  void end_forward();
  void lm_head_backward();
  // Layers last - 1 down to first; with recomputation each layer's recomputed tensors first.
  void backward_blocks(int64_t first, int64_t last);
  void embedding_backward();
  // The FP32 residual stream [N, D] of the current forward (between forward_blocks calls: the
  // input of the next layer) and its gradient [N, D] (between backward_blocks calls: the gradient
  // at the output of the next layer down).
  float* residual_device();
  float* residual_grad_device();
  // Pipeline stages (after begin_forward of the micro-batch): the stage's input, the FP32 residual
  // stream [N, D] the stage before produced (device, ordered before this model's stream reaches
  // the copy: the caller synchronises or waits on an event), as the residual and as the BF16 input
  // of the first held layer; and before backward_blocks of a stage without the LM head, the FP32
  // gradient [N, D] at its output (the next stage's residual_grad_device()), as dx32 and its BF16
  // copy. residual_device() after the stage's last forward_blocks is its output.
  void set_stage_input(const float* x32_ND);
  void set_stage_output_grad(const float* dx32_ND);

  // Enqueues zeroing of the statistics record (stats_record(), stats_bytes() bytes: a
  // cuda::StepStatsRecord followed by int64 counts [M, E]).
  void reset_stats();
  cuda::StepStatsRecord* stats_record();
  size_t stats_bytes() const;
  // Waits for the stream and returns the statistics accumulated since the last reset_stats() (after
  // forward() with host ids: that forward's). lb_loss, z_loss: means over MoE layers and forwards;
  // num_targets counts the host-id forwards' targets; num_dropped the routes the capacity dropped
  // (0 when dropless). Bad token ids
  // or targets (counted on the device) throw here, naming vocab_size.
  ForwardStats read_stats();

  // While set, forward and backward mark their phases on the timer (profiling of eager steps; a
  // timer must not be set while the stream is captured). nullptr: off.
  void set_phase_timer(cuda::EventTimer* timer) { timer_ = timer; }

  // Called by backward() as gradients become final, in the order they do: after the final norm
  // and LM head, after each block from the last to the first, after the embedding. The argument
  // is a flat offset: every gradient at an offset >= it is final for this backward (the last call
  // gives 0). The hook only enqueues work (e.g. a data-parallel all-reduce on another stream after
  // an event recorded on stream()), so it is captured with the step. Empty: off.
  using GradsReadyHook = std::function<void(int64_t ready_from)>;
  void set_grads_ready_hook(GradsReadyHook hook) { grads_ready_ = std::move(hook); }
  // Called on the host before the forward of each gradient group is enqueued: group 0 the
  // embedding, l + 1 block l, n_layers + 1 the final norm and LM head (the groups of
  // grad_group_starts). E.g. the step runner makes the stream wait there for the deferred update
  // of that group's parameters (an event of a second stream, captured with the step). Empty: off.
  using ForwardHook = std::function<void(int64_t group)>;
  void set_forward_hook(ForwardHook hook) { forward_hook_ = std::move(hook); }
  // prepare_grads_for_step in pieces: zero the accumulating gradients at flat offsets [begin, end)
  // on `stream` (a group's, after its deferred update read them), then, once every range was
  // given, mark_grads_fresh() before the step's first backward.
  void zero_accumulated_grads(int64_t begin, int64_t end, cuda::Stream stream);
  void mark_grads_fresh();

 private:
  struct Impl;
  void check_forward(const char* op) const;  // a forward was begun
  void check_whole(const char* op) const;    // the model holds every tensor
  void check_layers(const char* op, int64_t first, int64_t last) const;  // [first, last) held
  void reserve_forward(int64_t batch, int64_t seq);  // reserve's forward buffers
  ModelConfig mcfg_;
  MoeConfig ecfg_;
  LayoutPart part_;
  cuda::NcclComm* ep_comm_ = nullptr;
  int64_t ep_size_ = 1, ep_rank_ = 0;
  bool rowwise_ = false;
  ExpertSlice slice_;
  ParamLayout layout_;
  std::vector<GlobalPlacement> placements_;
  int64_t num_moe_layers_ = 0;
  cuda::Stream stream_ = nullptr;
  cuda::EventTimer* timer_ = nullptr;
  GradsReadyHook grads_ready_;
  ForwardHook forward_hook_;
  Recompute recompute_ = Recompute::kNone;
  bool fuse_head_backward_ = false;
  bool fp8_ = false;
  bool fp8_codes_in_bf16_copy_ = false;
  bool expert_squares_on_ = false;
  int64_t params_version_ = 0;
  // Flat offsets where the gradients of the embedding [0], block l [l + 1] and the final norm and
  // LM head [n_layers + 1] begin (the layout holds them in this order).
  std::vector<int64_t> grads_ready_from_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe
