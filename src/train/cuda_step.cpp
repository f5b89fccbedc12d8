// CudaStepRunner: host staging in pinned memory (two slots, each guarded by an event), the step
// body (forwards, backwards, grad norm, loss guard, AdamW, expert bias, record finish) enqueued
// eagerly or captured once into a CUDA graph and replayed, and a ring of pinned stats slots each
// filled by asynchronous copies (the record, then the expert bias after the step's update) and an
// event. Per submit, the host enqueues three copies (token ids, loss scales, lr), the step (one
// graph launch when captured) and the stats copies.
// Data parallel: the step sums, over the NCCL group, the FP32 gradients (buckets of at most
// kGradBucketElements) and the statistics record's CE/lb/z sums, bad-id counters, expert counts
// and per-layer drops and losses before the grad norm, so the rest of the step is the one-GPU step on global figures.
// With parallel.overlap_grad_reduce (the default; no ep) the gradients of each block are summed on
// a second stream as soon as the last micro-batch's backward has finished them (LM head first,
// embedding last), overlapping the backward of the blocks below; otherwise all after backward.
// Expert parallel: dense flat ranges are summed over dp, expert ranges over ep-dp; the grad norm
// is sqrt(dense squares + expert squares summed over the ep group), from per-range norms.
// ZeRO-1 (plan.zero): FlatShardPlan buckets instead of ranges, each reduce-scattered (chunks)
// and all-reduced (tail) in one NCCL group where the all-reduce would run; the norm from this
// rank's pieces (one FP64 slot each, all-reduced over dp); AdamW on the shard's segments into
// compact moments; one group of in-place FP32 all-gathers, then the BF16 copy from the master.
// grad_reduce_dtype = "bf16": every reduced range passes through a BF16 staging buffer.
#ifdef MOECORE_HAS_CUDA

#include "train/cuda_step.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/recompute.h"
#include "cpu/fp8.h"
#include "cuda/event_timer.h"
#include "cuda/ops/device_info.h"
#include "cuda/ops/ep_exchange.h"
#include "cuda/ops/grouped_gemm.h"
#include "cuda/ops/memory.h"
#include "cuda/ops/nccl.h"
#include "cuda/ops/nvshmem_world.h"
#include "cuda/ops/optim.h"
#include "cuda/ops/step_stats.h"
#include "cuda/sm_reserve.h"
#include "model/cuda_experts.h"
#include "model/layout.h"
#include "optim/flat_shards.h"
#include "train/routing_seed.h"

namespace moe {

namespace {

constexpr int kStagingSlots = 2;

// Scalars staged with each step's token ids (pinned), copied to the device before the step.
struct StagedScalars {
  double lr = 0;
  float loss_scales[3] = {0, 0, 0};  // CE gradient scale, per-layer lb and z factors
  float reserved = 0;
};

// The record's fields that are summed over data-parallel ranks, as contiguous runs.
static_assert(offsetof(cuda::StepStatsRecord, lb_sum) == offsetof(cuda::StepStatsRecord, ce_sum) + sizeof(double) &&
                  offsetof(cuda::StepStatsRecord, z_sum) == offsetof(cuda::StepStatsRecord, ce_sum) + 2 * sizeof(double),
              "ce_sum, lb_sum, z_sum must be three adjacent doubles");
static_assert(offsetof(cuda::StepStatsRecord, bad_targets) == offsetof(cuda::StepStatsRecord, bad_ids) + sizeof(uint32_t) &&
                  offsetof(cuda::StepStatsRecord, num_dropped) == offsetof(cuda::StepStatsRecord, bad_ids) + 2 * sizeof(uint32_t),
              "bad_ids, bad_targets, num_dropped must be three adjacent uint32");

// Checks that need no allocation, before the model is built.
// The groups against the config (the batch arithmetic is the run plan's: make_run_plan).
const Config& checked_config(const Config& cfg, cuda::NcclComm* dp, cuda::NcclComm* ep, cuda::NcclComm* ep_dp) {
  const int64_t ep_size = ep ? ep->size() : 1;
  MOE_CHECK(cfg.parallel.ep == ep_size, "CudaStepRunner: parallel.ep = ", cfg.parallel.ep, " but the expert-parallel "
            "NCCL group has ", ep_size, " rank(s); make it over Topology::ep_comm (make_nccl_comm)");
  if (ep_size > 1) {
    MOE_CHECK(dp != nullptr && dp->size() % ep_size == 0, "CudaStepRunner: parallel.ep = ", ep_size,
              " needs the data-parallel group (dp divisible by ep)");
    const int64_t ep_dp_size = ep_dp ? ep_dp->size() : 1;
    MOE_CHECK(ep_dp_size * ep_size == dp->size(), "CudaStepRunner: the ep-dp group has ", ep_dp_size,
              " rank(s) but dp / ep = ", dp->size(), " / ", ep_size, " = ", dp->size() / ep_size);
    MOE_CHECK(cfg.moe.capacity_factor == 0.0, "moe.capacity_factor = ", cfg.moe.capacity_factor,
              ": expert parallelism is dropless only; set moe.capacity_factor = 0");
  }
  if (dp) {
    MOE_CHECK(!dp->aborted(), "CudaStepRunner: the data-parallel NCCL communicator was aborted");
    MOE_CHECK(dp->device() == cuda::current_device(), "CudaStepRunner: the NCCL communicator of rank ", dp->rank(),
              " was made on GPU ", dp->device(), " but the current GPU is ", cuda::current_device(),
              "; bind the process to its GPU (bind_local_gpu) before making either");
  }
  return cfg;
}

struct StepShape {
  int64_t micro = 0, batch = 0, seq = 0;
  int64_t tokens() const { return batch * seq; }
  bool operator==(const StepShape&) const = default;
};

// The flat spans of the ZeRO-1 plan: without ep the gradient groups of the grads-ready hook (so a
// bucket is reduced as soon as backward finished it), all over the dp group (0); with ep the dense
// ranges over dp (0) and the expert ranges over ep-dp (1).
std::vector<FlatSpan> zero_spans(const ParamLayout& layout, int64_t n_layers, bool expert_parallel) {
  std::vector<FlatSpan> spans;
  if (!expert_parallel) {
    const std::vector<int64_t> starts = grad_group_starts(layout, n_layers);
    for (size_t g = 0; g < starts.size(); ++g) {
      const int64_t end = g + 1 < starts.size() ? starts[g + 1] : layout.total_numel();
      if (end > starts[g]) spans.push_back({starts[g], end, 0});
    }
    return spans;
  }
  for (const FlatRange& r : flat_ranges(layout, false)) spans.push_back({r.begin, r.end, 0});
  for (const FlatRange& r : flat_ranges(layout, true)) spans.push_back({r.begin, r.end, 1});
  std::sort(spans.begin(), spans.end(), [](const FlatSpan& a, const FlatSpan& b) { return a.begin < b.begin; });
  return spans;
}

}  // namespace

struct CudaStepRunner::Impl {
  Config cfg;
  cuda::NcclComm* dp = nullptr;  // not owned; null: one GPU
  int64_t dp_size = 1, dp_rank = 0;
  cuda::NcclComm* ep = nullptr;
  cuda::NcclComm* ep_dp = nullptr;
  CudaExpertParallel ep_ctx;
  CudaModel model;
  // ZeRO-1 (plan.zero): the flat shard plan over dp (and ep-dp for experts), the communicator of
  // each of its groups (null: not reduced, the experts when ep = dp), and the pieces whose
  // squares this rank adds to the norm. exp_avg and exp_avg_sq then hold shards->state_numel()
  // elements, and `segments` maps this rank's updated pieces to them.
  bool zero = false;
  std::unique_ptr<FlatShardPlan> shards;
  std::vector<cuda::NcclComm*> group_comms;
  std::vector<FlatPiece> norm_pieces;
  int64_t norm_slots = 0;      // FP64 entries of shard_squares: 2 per bucket, the same on every rank
  cuda::DeviceBuffer shard_squares;
  size_t next_bucket = 0;      // overlap: buckets [0, next_bucket) are not reduced yet
  // parallel.grad_reduce_dtype = "bf16": each reduced range goes through a BF16 staging buffer.
  bool bf16_reduce = false;
  cuda::DeviceBuffer reduce_stage;
  std::unique_ptr<cuda::ParamSegmentTable> segments;
  // train.precision = "fp8" with the experts' codes in their BF16 copy's place (the run plan's
  // fp8_codes_in_bf16_copy: the update at the end of the step): the routed experts' weight
  // tensors, updated by cuda::adamw_apply_fp8_weights, which writes their FP8 codes in the same
  // pass (`segments` then leaves them out), so no forward quantises them again; empty otherwise.
  std::vector<CudaFp8ExpertTensor> fp8_tensors;
  std::vector<cuda::ParamSegment> fp8_segments;  // [fp8_tensors]
  // The AdamW moments: FP32, or BF16 bits under optim.moment_dtype = "bf16" (bf16_moments).
  cuda::DeviceBuffer exp_avg, exp_avg_sq, norm_ws, opt_scalars;
  bool bf16_moments = false;
  size_t norm_ws_bytes = 0;
  // Token ids of the step on the device: inputs [micro * n] then targets [micro * n], int32.
  cuda::DeviceBuffer tokens;
  int64_t token_reallocations = 0;

  struct Staging {
    cuda::PinnedBuffer scalars;  // StagedScalars
    cuda::PinnedBuffer tokens;   // the layout of `tokens` above
    cuda::Event copied = nullptr;  // recorded after the copies that read this slot
    bool used = false;
  };
  std::array<Staging, kStagingSlots> staging;
  int64_t num_submitted = 0;
  int64_t last_step = 0;

  struct StatsSlot {
    cuda::PinnedBuffer host;  // model.stats_bytes(), then the expert bias [M, E] FP32 after the step
    cuda::Event ready = nullptr;
    int64_t step = 0, num_targets = 0, num_forwards = 0, num_routes = 0;
  };
  std::array<StatsSlot, kMaxPending> ring;
  int64_t ring_head = 0, num_pending = 0;

  bool use_graph = true;
  cuda::EventTimer* timer = nullptr;
  cuda::StreamGraph graph;
  StepShape graph_shape;
  int64_t graph_generation = -1;
  int64_t launches = 0;
  // The last step run eagerly, and the buffer generation after it: a step of this shape may be
  // captured once nothing has been reallocated since (every buffer sized, every GEMM planned).
  StepShape eager_shape;
  int64_t eager_generation = -1;

  // The gradient norm from the experts' block square sums (CudaModel::set_expert_grad_squares),
  // where the run plan says so (RunPlan::norm_from_expert_squares: one GPU, one micro-batch a step,
  // MOECORE_GRAD_NORM not "separate"): the root of the sums of squares of the other tensors' ranges
  // (norm_rest, read as ever) and of the experts' sums, norm_parts [norm_rest.size() + 1].
  bool expert_squares = false;
  std::vector<FlatRange> norm_rest;
  cuda::DeviceBuffer norm_parts;

  // Expert parallelism (null: none): groups, the layout's dense and expert flat ranges, and
  // device FP64 scratch for the per-range norms [ranges] and the two squared norms [2].
  std::vector<FlatRange> dense_ranges, expert_ranges;
  cuda::DeviceBuffer range_norms, squares;

  // Deferred update (optim.deferred_update): each step ends with adamw_prepare; the next step
  // applies the update group by group (the gradient groups of grad_group_starts: embedding, each
  // block, head) on opt_stream, zeroing the group's accumulating gradients after it, while the
  // first micro-batch's forward waits for each group's event before that group's forward.
  bool deferred = false;
  cuda::Stream opt_stream = nullptr;
  cuda::Event opt_fork = nullptr;
  std::vector<cuda::Event> group_updated;
  std::vector<FlatRange> groups;  // flat range of each group
  std::vector<std::unique_ptr<cuda::ParamSegmentTable>> group_segments;
  bool wait_for_updates = false;  // set while the first micro-batch's forward is enqueued
  // optim.deferred_update_sms: the groups after the first block's run on that many multiprocessors,
  // and the blocks' forward GEMMs beside them leave those free (cuda/sm_reserve.h); 0: neither.
  int update_sms = 0;

  // Data parallel with overlap (parallel.overlap_grad_reduce, no ep): during the last micro-batch's
  // backward, each group of gradients that became final (CudaModel's hook) is all-reduced on
  // comm_stream after an event of the model's stream; `reduced` joins the streams after backward.
  cuda::Stream comm_stream = nullptr;
  std::vector<cuda::Event> ready_events;
  cuda::Event reduced = nullptr;
  int64_t reduced_from = 0;  // gradients at offsets >= this are reduced (or enqueued)
  size_t next_ready_event = 0;

  // The experts' exchange: NCCL all-to-all over ep, or the rowwise exchange over the ep group's
  // NVSHMEM world (this process's one-PE world at ep = 1).
  static CudaExpertParallel make_ctx(const Config& c, cuda::NcclComm* e, cuda::NvshmemWorld* rowwise) {
    CudaExpertParallel x;
    x.comm = e;
    if (c.parallel.ep_backend == "rowwise") {
      MOE_CHECK(rowwise != nullptr || e == nullptr, "CudaStepRunner: parallel.ep_backend = \"rowwise\" over ",
                e ? e->size() : 1, " GPUs needs the ep group's NVSHMEM world");
      const int64_t rows = c.train.micro_batch * c.train.seq_len * c.moe.top_k;
      x.rowwise = rowwise ? rowwise
                          : &cuda::NvshmemWorld::one_pe(size_t(CudaRowwiseExperts::symmetric_bytes(
                                c.moe, c.model.d_model, num_moe_layers(c.model), 1, 0.0, rows,
                                c.train.precision == "fp8")) + (size_t(64) << 20));
      x.capacity_factor = c.parallel.ep_capacity_factor;
    }
    return x;
  }

  Impl(const Config& c, bool use_zero, bool norm_from_expert_squares, cuda::NcclComm* d, cuda::NcclComm* e,
       cuda::NcclComm* edp, cuda::NvshmemWorld* rowwise)
      : cfg(c), dp(d), dp_size(d ? d->size() : 1), dp_rank(d ? d->rank() : 0),
        ep(e && e->size() > 1 ? e : nullptr), ep_dp(ep && edp && edp->size() > 1 ? edp : nullptr),
        ep_ctx(make_ctx(c, ep, rowwise)), model(c.model, c.moe, ep || ep_ctx.rowwise ? &ep_ctx : nullptr) {
    model.set_recompute(parse_recompute(cfg.train.recompute));
    // The experts refuse shapes their FP8 path cannot take.
    model.set_fp8(cfg.train.precision == "fp8", cpu::fp8_rule_named(cfg.train.fp8_scaling));
    model.set_fuse_head_backward(true);  // every step's forward is followed by its backward
    zero = use_zero;
    MOE_CHECK(!(zero && cfg.optim.deferred_update), "optim.deferred_update = true: the deferred update needs "
              "replicated AdamW moments; it does not run with ZeRO-1 (set parallel.zero = false, or "
              "optim.deferred_update = false)");
    bf16_reduce = dp != nullptr && cfg.parallel.grad_reduce_dtype == "bf16";
    const ParamLayout& layout = model.layout();
    if (zero) {
      MOE_CHECK(dp != nullptr, "CudaStepRunner: the run plan asks for ZeRO-1 (parallel.zero) but no data-parallel "
                "NCCL group was given");
      shards = std::make_unique<FlatShardPlan>(
          zero_spans(layout, cfg.model.n_layers, ep != nullptr),
          std::vector<int64_t>{dp_size, ep_dp ? ep_dp->size() : 1}, std::vector<int64_t>{dp_rank, ep_dp ? ep_dp->rank() : 0},
          kGradBucketElements, ParamLayout::kAlign);
      group_comms = {dp, ep_dp};
      norm_pieces = shards->norm_pieces();
      norm_slots = int64_t(2 * shards->buckets().size());
      MOE_CHECK(int64_t(norm_pieces.size()) <= norm_slots, "CudaStepRunner: ", norm_pieces.size(),
                " norm pieces for ", shards->buckets().size(), " buckets");
      shard_squares.reserve(size_t(std::max<int64_t>(1, norm_slots)) * sizeof(double));
      std::vector<cuda::ParamSegment> segs;
      for (const ShardSegment& z : shards->segments(layout))
        segs.push_back({z.offset, z.numel, z.decay ? 1 : 0, 0, z.state_offset});
      segments = std::make_unique<cuda::ParamSegmentTable>(std::move(segs), layout.total_numel(), shards->state_numel());
    } else {
      segments = std::make_unique<cuda::ParamSegmentTable>(layout);
    }
    if (cfg.optim.deferred_update) {
      deferred = true;
      const std::vector<int64_t> starts = grad_group_starts(layout, cfg.model.n_layers);
      for (size_t g = 0; g < starts.size(); ++g)
        groups.push_back({starts[g], g + 1 < starts.size() ? starts[g + 1] : layout.total_numel()});
      for (const FlatRange& r : groups) {
        std::vector<cuda::ParamSegment> segs;
        for (const cuda::ParamSegment& x : segments->segments())
          if (x.offset >= r.begin && x.offset < r.end) segs.push_back(x);
        group_segments.push_back(std::make_unique<cuda::ParamSegmentTable>(std::move(segs), layout.total_numel()));
      }
      opt_stream = cuda::stream_create();
      opt_fork = cuda::event_create();
      group_updated.resize(groups.size());
      for (cuda::Event& e : group_updated) e = cuda::event_create();
      update_sms = static_cast<int>(cfg.optim.deferred_update_sms);
      if (update_sms > 0) {
        const int device_sms = cuda::device_info().sm_count;
        MOE_CHECK(update_sms < device_sms, "optim.deferred_update_sms = ", update_sms, " leaves none of the ",
                  device_sms, " multiprocessors of this GPU to the forward; expected fewer than ", device_sms);
      }
      model.set_forward_hook([this](int64_t g) {
        if (!wait_for_updates) return;
        // A profiled step books the wait for the group's update as optimizer time (the model marks
        // the group's own phase after the hook).
        if (timer) timer->mark(cuda::Phase::kOptimizer);
        cuda::stream_wait_event(stream(), group_updated[size_t(g)]);
        // The update of group g + 1 runs beside the forward of group g: keep its multiprocessors free.
        if (update_sms > 0) cuda::set_reserved_sms(reserved_update_sms(size_t(g) + 1));
      });
    }
    if (bf16_reduce) {
      const int64_t stage = zero ? shards->max_bucket_numel() : std::min(kGradBucketElements, layout.total_numel());
      reduce_stage.reserve(size_t(std::max<int64_t>(1, stage)) * sizeof(uint16_t));
    }
    if (dp && ep == nullptr && cfg.parallel.overlap_grad_reduce) {
      comm_stream = cuda::stream_create();
      ready_events.resize(size_t(cfg.model.n_layers + 2));
      for (cuda::Event& e : ready_events) e = cuda::event_create();
      reduced = cuda::event_create();
      model.set_grads_ready_hook([this](int64_t ready_from) { reduce_ready_grads(ready_from); });
    }
    if (norm_from_expert_squares) {
      expert_squares = true;
      model.set_expert_grad_squares(true);  // refuses expert parallelism and the rowwise exchange
      // The other tensors' ranges; the expert ranges' padding, which the sums skip, holds zeros.
      norm_rest = flat_ranges(layout, false);
      norm_parts.reserve((norm_rest.size() + 1) * sizeof(double));
    }
    if (ep) {
      dense_ranges = flat_ranges(model.layout(), false);
      expert_ranges = flat_ranges(model.layout(), true);
      range_norms.reserve(std::max<size_t>(8, (dense_ranges.size() + expert_ranges.size()) * sizeof(double)));
      squares.reserve(2 * sizeof(double));
    }
  }

  // After model.reserve (the experts' code buffers exist): the FP8 experts' fused update, where the
  // run plan keeps their codes in their BF16 copy's place (the update at the end of each step, whole
  // 128 x 128 blocks); elsewhere the forward quantises them.
  void setup_fp8_update() {
    if (!model.fp8_codes_in_bf16_copy()) return;
    fp8_tensors = model.fp8_expert_tensors();
    MOE_CHECK(!fp8_tensors.empty() &&
                  std::none_of(fp8_tensors.begin(), fp8_tensors.end(),
                               [](const CudaFp8ExpertTensor& t) { return t.n % 128 != 0 || t.k % 128 != 0; }),
              "CudaStepRunner: the experts' FP8 codes are in their BF16 copy's place, so the update must write ",
              "them, but the experts have no whole 128 x 128 block codes for it");
    // Both lists in offset order: each expert tensor is the next segment of the layout that starts there.
    std::sort(fp8_tensors.begin(), fp8_tensors.end(),
              [](const CudaFp8ExpertTensor& a, const CudaFp8ExpertTensor& b) { return a.offset < b.offset; });
    std::vector<cuda::ParamSegment> rest;
    for (const cuda::ParamSegment& x : segments->segments()) {
      const size_t t = fp8_segments.size();
      if (t == fp8_tensors.size() || x.offset != fp8_tensors[t].offset) {
        rest.push_back(x);
        continue;
      }
      const CudaFp8ExpertTensor& e = fp8_tensors[t];
      MOE_CHECK(x.numel == e.experts * e.n * e.k, "CudaStepRunner: the FP8 expert tensor at ", x.offset, " holds ",
                x.numel, " parameters, its codes are for ", e.experts, " x ", e.n, " x ", e.k);
      fp8_segments.push_back(x);
    }
    MOE_CHECK(fp8_segments.size() == fp8_tensors.size(), "CudaStepRunner: ",
              fp8_tensors.size() - fp8_segments.size(), " FP8 expert tensors are not segments of the layout");
    segments = std::make_unique<cuda::ParamSegmentTable>(std::move(rest), model.layout().total_numel());
  }
  bool fp8_update() const { return !fp8_tensors.empty(); }
  // The parameters changed (the last update, or this step's): the experts' codes follow when the
  // update wrote them.
  void mark_params_changed() {
    if (fp8_update()) model.mark_params_changed_with_expert_codes();
    else model.mark_params_changed();
  }

  cuda::Stream stream() const { return model.stream(); }
  int64_t generation() const { return model.buffer_generation() + token_reallocations; }
  cuda::OptimStepScalars* opt() const { return opt_scalars.as<cuda::OptimStepScalars>(); }
  // Elements of each moment buffer: this rank's shard state under ZeRO-1, else the whole layout.
  int64_t moment_numel() const { return zero ? shards->state_numel() : model.layout().total_numel(); }
  size_t moment_elem_bytes() const { return bf16_moments ? 2 : 4; }
  // fn(m, v) with the moment buffers as what they hold: float* (FP32) or uint16_t* (BF16 bits).
  template <typename Fn>
  void with_moments(Fn&& fn) const {
    if (bf16_moments) {
      fn(exp_avg.as<uint16_t>(), exp_avg_sq.as<uint16_t>());
    } else {
      fn(exp_avg.as<float>(), exp_avg_sq.as<float>());
    }
  }
  bool overlap_grad_reduce() const { return comm_stream != nullptr; }
  bool graph_allowed() const {
    return use_graph && timer == nullptr && (ep == nullptr || model.rowwise());
  }

  // Waits for work recorded before `e`; with a data-parallel group, fails instead of hanging.
  void wait(cuda::Event e, const std::string& what) {
    if (dp) dp->wait(e, what.c_str());
    else cuda::event_sync(e);
  }

  // Sums the FP32 gradients at flat offsets [begin, end) over `group` in pieces of at most
  // kGradBucketElements (bf16_reduce: each piece cast to BF16, summed in BF16, cast back); only
  // enqueues work on `st`.
  void all_reduce_range(cuda::NcclComm* group, int64_t begin, int64_t end, cuda::Stream st) {
    float* grads = model.grads();
    for (int64_t at = begin; at < end; at += kGradBucketElements) {
      const int64_t n = std::min(kGradBucketElements, end - at);
      if (!bf16_reduce) {
        group->all_reduce_sum(grads + at, n, cuda::NcclDType::kF32, st);
      } else {
        uint16_t* stage = reduce_stage.as<uint16_t>();
        cuda::cast_f32_to_bf16(grads + at, stage, n, st);
        group->all_reduce_sum(stage, n, cuda::NcclDType::kBF16, st);
        cuda::cast_bf16_to_f32(stage, grads + at, n, st);
      }
    }
  }

  // ZeRO-1: one bucket's gradients over its group, in one NCCL group: the scattered part
  // reduce-scattered in place (this rank's chunk then holds the sum), the tail all-reduced
  // (bf16_reduce: through the BF16 stage, only the chunk and tail cast back). Only enqueues work.
  void reduce_scatter_bucket(const FlatBucket& b, cuda::Stream st) {
    cuda::NcclComm* comm = group_comms[size_t(b.group)];
    if (comm == nullptr) return;  // experts with ep = dp: already whole on their rank
    float* grads = model.grads();
    const int64_t scattered = b.scattered_end() - b.begin;
    if (!bf16_reduce) {
      comm->group_start();
      comm->reduce_scatter_sum(grads + b.begin, b.chunk, cuda::NcclDType::kF32, st);
      comm->all_reduce_sum(grads + b.scattered_end(), b.tail_numel(), cuda::NcclDType::kF32, st);
      comm->group_end();
      return;
    }
    uint16_t* stage = reduce_stage.as<uint16_t>();
    cuda::cast_f32_to_bf16(grads + b.begin, stage, b.end - b.begin, st);
    comm->group_start();
    comm->reduce_scatter_sum(stage, b.chunk, cuda::NcclDType::kBF16, st);
    comm->all_reduce_sum(stage + scattered, b.tail_numel(), cuda::NcclDType::kBF16, st);
    comm->group_end();
    cuda::cast_bf16_to_f32(stage + b.group_rank * b.chunk, grads + b.own_begin(), b.chunk, st);
    cuda::cast_bf16_to_f32(stage + scattered, grads + b.scattered_end(), b.tail_numel(), st);
  }

  // ZeRO-1 overlap: reduce-scatters, highest first, every bucket not yet reduced that lies at
  // offsets >= ready_from.
  void reduce_scatter_buckets_from(int64_t ready_from, cuda::Stream st) {
    const std::vector<FlatBucket>& buckets = shards->buckets();
    while (next_bucket > 0 && buckets[next_bucket - 1].begin >= ready_from) reduce_scatter_bucket(buckets[--next_bucket], st);
    MOE_CHECK(next_bucket == 0 || buckets[next_bucket - 1].end <= ready_from, "CudaStepRunner: ZeRO-1 bucket [",
              buckets[next_bucket - 1].begin, ", ", buckets[next_bucket - 1].end, ") straddles the gradient group "
              "starting at ", ready_from);
  }

  // ZeRO-1 after AdamW: every bucket's updated chunks all-gathered in place in the FP32 master
  // weights (tails were updated alike on every rank), then the BF16 copy refreshed from them.
  void all_gather_params(cuda::Stream st) {
    float* params = model.params();
    dp->group_start();
    for (const FlatBucket& b : shards->buckets()) {
      cuda::NcclComm* comm = group_comms[size_t(b.group)];
      if (comm != nullptr) comm->all_gather(params + b.begin, b.chunk, cuda::NcclDType::kF32, st);
    }
    dp->group_end();
    cuda::cast_f32_to_bf16(params, model.params_bf16(), model.layout().total_numel(), st);
  }

  // parts[i] = the sum of the squares of the gradients in ranges[i] (FlatRange or FlatPiece).
  template <typename Range>
  void range_sum_squares(const std::vector<Range>& ranges, double* parts, cuda::Stream st) {
    for (size_t i = 0; i < ranges.size(); ++i)
      cuda::grad_sum_squares(model.grads() + ranges[i].begin, ranges[i].end - ranges[i].begin, parts + i,
                             norm_ws.data(), norm_ws_bytes, st);
  }

  // ZeRO-1: *norm = sqrt(sum over ranks of this rank's norm pieces' squares), each element once.
  void sharded_grad_norm(cuda::Stream st) {
    double* parts = shard_squares.as<double>();
    cuda::device_memset(parts, 0, size_t(norm_slots) * sizeof(double), st);
    range_sum_squares(norm_pieces, parts, st);
    dp->all_reduce_sum(parts, norm_slots, cuda::NcclDType::kF64, st);
    cuda::sqrt_of_sum(parts, norm_slots, &opt()->grad_norm, st);
  }

  // CudaModel's hook (overlap): enqueues the all-reduce of the gradients at [ready_from,
  // reduced_from) on comm_stream once the model's stream has produced them. Outside the last
  // micro-batch's backward (reduced_from < 0) it does nothing.
  void reduce_ready_grads(int64_t ready_from) {
    if (reduced_from < 0 || ready_from >= reduced_from) return;
    MOE_CHECK(next_ready_event < ready_events.size(), "CudaStepRunner: more gradient groups than blocks + 2");
    const cuda::Event e = ready_events[next_ready_event++];
    cuda::event_record(e, stream());
    cuda::stream_wait_event(comm_stream, e);
    if (zero) reduce_scatter_buckets_from(ready_from, comm_stream);
    else all_reduce_range(dp, ready_from, reduced_from, comm_stream);
    reduced_from = ready_from;
  }

  // The step statistics' CE/lb/z sums, bad-id and dropped-route counters and expert counts over the data-parallel
  // group, in one NCCL group; only enqueues work.
  void all_reduce_stats(cuda::Stream st) {
    cuda::StepStatsRecord* rec = model.stats_record();
    auto* base = reinterpret_cast<unsigned char*>(rec);
    dp->group_start();
    dp->all_reduce_sum(base + offsetof(cuda::StepStatsRecord, ce_sum), 3, cuda::NcclDType::kF64, st);
    dp->all_reduce_sum(base + offsetof(cuda::StepStatsRecord, bad_ids), 3, cuda::NcclDType::kU32, st);
    const int64_t m = model.num_moe_layers(), e = cfg.moe.num_experts;
    if (m > 0) {
      // Counts and per-layer drops are one int64 run; the per-layer losses follow as FP64.
      dp->all_reduce_sum(cuda::step_stats_counts(rec), m * (e + 1), cuda::NcclDType::kI64, st);
      dp->all_reduce_sum(cuda::step_stats_layer_losses(rec, m, e), 2 * m, cuda::NcclDType::kF64, st);
    }
    dp->group_end();
  }

  // Sums the gradients (after backward) over the data-parallel group (ZeRO-1: reduce-scatters
  // every bucket, highest first); only enqueues work.
  void all_reduce_grads(cuda::Stream st) {
    if (zero) {
      next_bucket = shards->buckets().size();
      reduce_scatter_buckets_from(0, st);
    } else if (ep == nullptr) {
      all_reduce_range(dp, 0, model.layout().total_numel(), st);
    } else {
      // Dense tensors over every rank; local experts over the ranks holding the same experts
      // (nothing to do when ep = dp: each expert's gradient already holds every token of its
      // ep group, which travelled to it).
      for (const FlatRange& r : dense_ranges) all_reduce_range(dp, r.begin, r.end, st);
      if (ep_dp)
        for (const FlatRange& r : expert_ranges) all_reduce_range(ep_dp, r.begin, r.end, st);
    }
  }

  // Everything of one step after its inputs are on the device; only enqueues work.
  void enqueue_step(const StepShape& sh) {
    const cuda::Stream st = stream();
    const int64_t n = sh.tokens(), total = model.layout().total_numel();
    const int32_t* inputs = tokens.as<int32_t>();
    const int32_t* targets = inputs + sh.micro * n;
    const auto* seeds = reinterpret_cast<const uint64_t*>(inputs + 2 * sh.micro * n);  // staged after the ids
    model.reset_stats();
    mark_params_changed();  // the last step's update (or this step's deferred one) is in the BF16 copy
    if (deferred) {
      enqueue_deferred_update();
    } else {
      model.prepare_grads_for_step();  // the first backward writes the GEMM-produced gradients whole
    }
    reduced_from = -1;  // the overlap hook waits for the last micro-batch
    for (int64_t m = 0; m < sh.micro; ++m) {
      // The routing seed is read on the device (stage_inputs staged it with the ids), so a replayed
      // graph routes anew.
      wait_for_updates = deferred && m == 0;
      {
        const cuda::ScopedSmReserve reserve(0);  // set by the forward hook, group by group
        model.forward_device(inputs + m * n, targets + m * n, sh.batch, sh.seq, /*routing_seed=*/0, seeds + m);
      }
      wait_for_updates = false;
      if (m + 1 == sh.micro) {
        reduced_from = total;
        next_ready_event = 0;
        if (zero) next_bucket = shards->buckets().size();
      }
      model.backward();
    }
    if (dp) {
      if (timer) timer->mark(cuda::Phase::kGradReduce);
      if (overlap_grad_reduce()) {
        MOE_CHECK(reduced_from == 0, "CudaStepRunner: backward left gradients below offset ", reduced_from,
                  " out of the overlapped all-reduce");
        cuda::event_record(reduced, comm_stream);
        cuda::stream_wait_event(st, reduced);
        all_reduce_stats(st);
      } else {
        all_reduce_grads(st);
        all_reduce_stats(st);
      }
    }
    if (timer) timer->mark(cuda::Phase::kOptimizer);
    cuda::StepStatsRecord* rec = model.stats_record();
    if (zero) {
      sharded_grad_norm(st);
    } else if (expert_squares && model.expert_grad_squares() != nullptr) {
      double* parts = norm_parts.as<double>();
      range_sum_squares(norm_rest, parts, st);
      cuda::sum_f64(model.expert_grad_squares(), model.num_moe_layers() * model.expert_square_blocks_per_layer(),
                    parts + norm_rest.size(), norm_ws.data(), norm_ws_bytes, st);
      cuda::sqrt_of_sum(parts, int64_t(norm_rest.size()) + 1, &opt()->grad_norm, st);
    } else if (ep == nullptr) {
      cuda::global_grad_norm(model.grads(), total, &opt()->grad_norm, norm_ws.data(), norm_ws_bytes, st);
    } else {
      // Norm of each range (after the reductions), dense squares (the same on every rank) plus
      // the expert squares summed over the ep group (different experts on each ep rank).
      double* norms = range_norms.as<double>();
      double* sq = squares.as<double>();
      const size_t nd = dense_ranges.size(), ne = expert_ranges.size();
      for (size_t i = 0; i < nd; ++i)
        cuda::global_grad_norm(model.grads() + dense_ranges[i].begin, dense_ranges[i].end - dense_ranges[i].begin,
                               norms + i, norm_ws.data(), norm_ws_bytes, st);
      for (size_t i = 0; i < ne; ++i)
        cuda::global_grad_norm(model.grads() + expert_ranges[i].begin,
                               expert_ranges[i].end - expert_ranges[i].begin, norms + nd + i, norm_ws.data(),
                               norm_ws_bytes, st);
      cuda::sum_of_squares(norms, int64_t(nd), sq, st);
      cuda::sum_of_squares(norms + nd, int64_t(ne), sq + 1, st);
      ep->all_reduce_sum(sq + 1, 1, cuda::NcclDType::kF64, st);
      cuda::sqrt_of_sum(sq, 2, &opt()->grad_norm, st);
    }
    cuda::step_guard_nonfinite_loss(rec, opt(), st);
    if (deferred) {
      cuda::adamw_prepare(cfg.optim, opt(), st);  // the next step (or flush_update) applies it
    } else if (fp8_update()) {
      // adamw_step, with the experts' weights updated by the op that also writes their FP8 codes,
      // and no BF16 copy of them: the codes take its place (CudaModel::keep_fp8_codes_in_bf16_copy).
      float* p = model.params();
      const float* g = model.grads();
      uint16_t* bf16 = model.params_bf16();
      cuda::adamw_prepare(cfg.optim, opt(), st);
      with_moments([&](auto* m, auto* v) {
        cuda::adamw_apply(*segments, cfg.optim, p, g, m, v, bf16, opt(), /*deferred=*/false, st);
        for (size_t i = 0; i < fp8_tensors.size(); ++i) {
          const CudaFp8ExpertTensor& t = fp8_tensors[i];
          cuda::adamw_apply_fp8_weights(fp8_segments[i], t.experts, t.n, t.k, cfg.optim, p, g, m, v, nullptr,
                                        Fp8Format::kE4M3, t.q, t.s, t.qt, t.st, nullptr, opt(), /*deferred=*/false,
                                        st, t.rule);
        }
      });
      cuda::adamw_clear_pending(opt(), st);
    } else {
      // ZeRO-1: this rank's pieces only (moments of its shard), then the gather and the BF16 copy.
      with_moments([&](auto* m, auto* v) {
        cuda::adamw_step(*segments, cfg.optim, model.params(), model.grads(), m, v,
                         zero ? nullptr : model.params_bf16(), opt(), st);
      });
    }
    if (zero) all_gather_params(st);
    if (cfg.moe.bias_update_rate > 0 && model.num_moe_layers() > 0) {
      cuda::expert_bias_update(cuda::step_stats_counts(rec), model.num_moe_layers(), cfg.moe.num_experts,
                               cfg.moe.bias_update_rate, opt(), model.expert_bias(), st);
    }
    cuda::step_stats_finish(opt(), rec, st);
    if (timer) timer->close();
  }

  // The multiprocessors group g's deferred update keeps to (0: all of them). Group g's update runs
  // beside group g - 1's forward; the embedding's (0) and the first block's (1) have no forward
  // beside them, and past the last group (the head) there is none.
  int reserved_update_sms(size_t g) const { return g >= 2 && g < groups.size() ? update_sms : 0; }

  // The update prepared at the end of the previous step (a no-op when none is pending), group by
  // group on opt_stream, forked from the model's stream here; each group's accumulating gradients
  // are zeroed once its update read them, then its event lets that group's forward go. The last
  // group's event follows the pending flag's reset, so the first micro-batch's forward joins
  // every piece of opt_stream's work back into the model's stream.
  void enqueue_deferred_update() {
    const cuda::Stream st = stream();
    cuda::event_record(opt_fork, st);
    cuda::stream_wait_event(opt_stream, opt_fork);
    for (size_t g = 0; g < groups.size(); ++g) {
      with_moments([&](auto* m, auto* v) {
        cuda::adamw_apply(*group_segments[g], cfg.optim, model.params(), model.grads(), m, v, model.params_bf16(),
                          opt(), /*deferred=*/true, opt_stream, reserved_update_sms(g));
      });
      model.zero_accumulated_grads(groups[g].begin, groups[g].end, opt_stream);
      if (g + 1 == groups.size()) cuda::adamw_clear_pending(opt(), opt_stream);
      cuda::event_record(group_updated[g], opt_stream);
    }
    model.mark_grads_fresh();
  }

  // Applies a pending deferred update now, on the model's stream after the submitted steps (the
  // next step's update then finds nothing pending). Before anything reads the parameters or
  // moments, or overwrites the gradients outside a step.
  void flush_update() {
    if (!deferred || num_submitted == 0) return;
    const cuda::Stream st = stream();
    with_moments([&](auto* m, auto* v) {
      cuda::adamw_apply(*segments, cfg.optim, model.params(), model.grads(), m, v, model.params_bf16(), opt(),
                        /*deferred=*/true, st);
    });
    cuda::adamw_clear_pending(opt(), st);
    model.mark_params_changed();
  }

  // Checks the micro-batches, stages their ids and the step's scalars in pinned memory and copies
  // them to the device (before the step in stream order, outside any captured region). Returns
  // this rank's target count.
  int64_t stage_inputs(const StepShape& sh, int64_t step, const std::vector<Batch>& micro, int64_t global_targets,
                       double lr, uint64_t train_seed) {
    MOE_CHECK(sh.batch > 0 && sh.seq > 0, "CudaStepRunner::submit: step ", step, " micro-batch 0 is empty");
    const int64_t n = sh.tokens();
    int64_t num_targets = 0;
    for (size_t m = 0; m < micro.size(); ++m) {
      const Batch& b = micro[m];
      MOE_CHECK(b.num_sequences() == sh.batch && b.seq_len == sh.seq && static_cast<int64_t>(b.inputs.size()) == n &&
                    static_cast<int64_t>(b.targets.size()) == n,
                "CudaStepRunner::submit: micro-batch ", m, " of step ", step, " is ", b.num_sequences(), " x ",
                b.seq_len, " (", b.inputs.size(), " inputs, ", b.targets.size(), " targets); micro-batch 0 is ",
                sh.batch, " x ", sh.seq, ": every micro-batch of a step must have one shape");
      for (int32_t t : b.targets) num_targets += t >= 0 ? 1 : 0;
    }
    const cuda::Stream st = stream();
    // Input ids, target ids, then each micro-batch's routing seed (8-byte aligned: 2 * micro * n ids).
    const size_t id_bytes = size_t(2 * sh.micro * n) * sizeof(int32_t);
    const size_t token_bytes = id_bytes + size_t(sh.micro) * sizeof(uint64_t);
    Staging& stage = staging_slot(token_bytes);
    int32_t* host_tokens = stage.tokens.as<int32_t>();
    for (int64_t m = 0; m < sh.micro; ++m) {
      std::memcpy(host_tokens + m * n, micro[m].inputs.data(), size_t(n) * sizeof(int32_t));
      std::memcpy(host_tokens + (sh.micro + m) * n, micro[m].targets.data(), size_t(n) * sizeof(int32_t));
    }
    auto* host_seeds = reinterpret_cast<uint64_t*>(stage.tokens.as<uint8_t>() + id_bytes);
    // The micro-batch's index in the global batch, so random routing does not depend on dp.
    for (int64_t m = 0; m < sh.micro; ++m) host_seeds[m] = routing_seed(train_seed, step - 1, dp_rank * sh.micro + m);
    auto* scalars = stage.scalars.as<StagedScalars>();
    const int64_t layers = model.num_moe_layers();
    // Micro-batches of the global batch: the lb and z weights are per micro-batch of all ranks.
    const int64_t global_micro = sh.micro * dp_size;
    const double per_layer = layers > 0 ? 1.0 / (double(global_micro) * double(layers)) : 0.0;
    scalars->lr = lr;
    scalars->loss_scales[0] = static_cast<float>(1.0 / double(std::max<int64_t>(1, global_targets)));
    scalars->loss_scales[1] = static_cast<float>(cfg.moe.lb_loss_weight * per_layer);
    scalars->loss_scales[2] = static_cast<float>(cfg.moe.z_loss_weight * per_layer);
    // Device token buffer: grows (outside any capture) only for a larger step than configured.
    if (tokens.bytes() < token_bytes) {
      cuda::stream_sync(st);
      tokens.reserve(token_bytes);
      ++token_reallocations;
    }
    cuda::copy_h2d(tokens.data(), host_tokens, token_bytes, st);
    cuda::copy_h2d(model.loss_scales_device(), scalars->loss_scales, sizeof(scalars->loss_scales), st);
    cuda::copy_h2d(&opt()->lr, &scalars->lr, sizeof(double), st);
    cuda::event_record(stage.copied, st);
    stage.used = true;
    ++num_submitted;
    return num_targets;
  }

  // The step: a replay of the captured graph, its capture (the second eager-ready step of a
  // shape) then a replay, or an eager step.
  void run_step(const StepShape& sh) {
    const cuda::Stream st = stream();
    const bool allowed = graph_allowed();
    // The experts' codes follow each update; after any other change to the parameters (a loaded
    // state) they are quantised here, outside the graph, which holds no quantisation of them.
    if (fp8_update()) model.refresh_fp8_expert_codes();
    if (graph.ready() && graph_generation != generation()) {
      cuda::stream_sync(st);  // a buffer the graph points at was reallocated: drop it (rare)
      graph.reset();
    }
    if (allowed && graph.ready() && graph_shape == sh) {
      graph.launch(st);
      ++launches;
    } else if (allowed && !graph.ready() && eager_shape == sh && eager_generation == generation()) {
      graph.begin_capture(st);
      try {
        enqueue_step(sh);
        graph.end_capture(st);
      } catch (...) {
        graph.abort_capture(st);
        throw;
      }
      MOE_CHECK(generation() == eager_generation, "CudaStepRunner::submit: a buffer was reallocated during capture");
      graph_shape = sh;
      graph_generation = generation();
      graph.launch(st);
      ++launches;
    } else {
      enqueue_step(sh);
      eager_shape = sh;
      eager_generation = generation();
    }
    mark_params_changed();  // the step's update: a forward after it (evaluation) sees new weights
  }

  // The step's statistics into the next ring slot: one asynchronous copy and an event.
  void queue_stats(const StepShape& sh, int64_t step, int64_t slot_targets) {
    const cuda::Stream st = stream();
    const int64_t global_micro = sh.micro * dp_size;
    StatsSlot& slot = ring[(ring_head + num_pending) % kMaxPending];
    cuda::copy_d2h_async(slot.host.data(), model.stats_record(), model.stats_bytes(), st);
    // The bias after the step's update, behind the record in the same slot (no extra wait).
    if (bias_bytes() > 0)
      cuda::copy_d2h_async(slot.host.as<uint8_t>() + model.stats_bytes(), model.expert_bias(), bias_bytes(), st);
    cuda::event_record(slot.ready, st);
    slot.step = step;
    slot.num_targets = slot_targets;
    slot.num_forwards = global_micro;
    slot.num_routes = global_micro * model.num_moe_layers() * sh.tokens() * cfg.moe.top_k;
    ++num_pending;
    last_step = step;
  }

  // Bytes of the expert bias [M, E] FP32.
  size_t bias_bytes() const { return size_t(model.num_moe_layers() * cfg.moe.num_experts) * sizeof(float); }

  // Pinned staging for `bytes` of token ids; waits for the device to have copied out of the slot.
  Staging& staging_slot(size_t token_bytes) {
    Staging& s = staging[num_submitted % kStagingSlots];
    if (s.used) wait(s.copied, "the input copies of the step two submits ago");
    if (s.tokens.bytes() < token_bytes) s.tokens = cuda::PinnedBuffer(token_bytes);
    return s;
  }
};

CudaStepRunner::CudaStepRunner(const Config& cfg, cuda::NcclComm* dp, cuda::NcclComm* ep, cuda::NcclComm* ep_dp)
    : CudaStepRunner(cfg, make_run_plan(checked_config(cfg, dp, ep, ep_dp), dp ? dp->size() : 1, "cuda"), dp, ep,
                     ep_dp) {}

CudaStepRunner::CudaStepRunner(const Config& cfg, const RunPlan& plan, cuda::NcclComm* dp, cuda::NcclComm* ep,
                               cuda::NcclComm* ep_dp, cuda::NvshmemWorld* rowwise)
    : impl_(std::make_unique<Impl>(checked_config(cfg, dp, ep, ep_dp), plan.zero, plan.norm_from_expert_squares, dp,
                                   ep, ep_dp, rowwise)) {
  Impl& I = *impl_;
  MOE_CHECK(plan.sizes.dp == I.dp_size && plan.micro_steps > 0, "CudaStepRunner: the run plan is for dp = ",
            plan.sizes.dp, " but the data-parallel NCCL group has ", I.dp_size, " rank(s)");
  if (plan.fp8_codes_in_bf16_copy) {
    MOE_CHECK(!I.zero && !I.deferred, "CudaStepRunner: the run plan keeps the experts' FP8 codes in their BF16 ",
              "copy's place, which needs the update at the end of the step (no ZeRO-1, no deferred update)");
    I.model.keep_fp8_codes_in_bf16_copy();
  }
  const int64_t total = I.model.layout().total_numel();
  I.bf16_moments = plan.memory.bf16_moments();  // the run plan's storage of the moments
  const size_t bytes = size_t(std::max<int64_t>(1, I.moment_numel())) * I.moment_elem_bytes();
  I.exp_avg.reserve(bytes);
  I.exp_avg_sq.reserve(bytes);
  I.norm_ws_bytes = cuda::global_grad_norm_workspace_bytes(total);
  I.norm_ws.reserve(std::max<size_t>(I.norm_ws_bytes, 16));
  I.opt_scalars.reserve(sizeof(cuda::OptimStepScalars));
  const cuda::Stream st = I.stream();
  cuda::device_memset(I.exp_avg.data(), 0, bytes, st);
  cuda::device_memset(I.exp_avg_sq.data(), 0, bytes, st);
  const cuda::OptimStepScalars zero{};
  cuda::copy_h2d(I.opt_scalars.data(), &zero, sizeof(zero), st);

  // Static shapes of a step: every buffer at its final size before any capture.
  const int64_t micro = plan.micro_steps;
  const int64_t n = plan.tokens_per_micro_batch;
  I.model.reserve(cfg.train.micro_batch, cfg.train.seq_len);
  I.setup_fp8_update();
  const size_t staged_bytes = size_t(2 * micro * n) * sizeof(int32_t) + size_t(micro) * sizeof(uint64_t);
  I.tokens.reserve(staged_bytes);  // ids and routing seeds (stage_inputs)
  for (Impl::Staging& s : I.staging) {
    s.scalars = cuda::PinnedBuffer(sizeof(StagedScalars));
    s.tokens = cuda::PinnedBuffer(staged_bytes);
    s.copied = cuda::event_create();
  }
  for (Impl::StatsSlot& s : I.ring) {
    s.host = cuda::PinnedBuffer(I.model.stats_bytes() + I.bias_bytes());
    s.ready = cuda::event_create();
  }
  cuda::stream_sync(st);
}

CudaStepRunner::~CudaStepRunner() {
  Impl& I = *impl_;
  try {
    // With a group, pending collectives may wait for a rank that left: wait under the deadline
    // (which aborts the communicator, ending them) before the plain synchronisation.
    if (I.dp && !I.dp->aborted()) {
      cuda::event_record(I.staging[0].copied, I.stream());
      I.wait(I.staging[0].copied, "the last steps before the step runner is destroyed");
    }
  } catch (...) {
  }
  try {
    cuda::stream_sync(I.stream());
  } catch (...) {
  }
  I.graph.reset();
  if (I.comm_stream) {
    try {
      cuda::stream_sync(I.comm_stream);
    } catch (...) {
    }
    cuda::stream_destroy(I.comm_stream);
  }
  if (I.opt_stream) {
    try {
      cuda::stream_sync(I.opt_stream);
    } catch (...) {
    }
    cuda::stream_destroy(I.opt_stream);
  }
  cuda::event_destroy(I.opt_fork);
  for (cuda::Event e : I.group_updated) cuda::event_destroy(e);
  for (cuda::Event e : I.ready_events) cuda::event_destroy(e);
  cuda::event_destroy(I.reduced);
  for (Impl::Staging& s : I.staging) cuda::event_destroy(s.copied);
  for (Impl::StatsSlot& s : I.ring) cuda::event_destroy(s.ready);
}

double CudaStepRunner::time_grad_all_reduce(double* bytes) {
  Impl& I = *impl_;
  MOE_CHECK(I.dp != nullptr, "CudaStepRunner::time_grad_all_reduce: no data-parallel group");
  if (bytes) {
    int64_t elements = I.model.layout().total_numel();
    if (I.ep && !I.ep_dp)  // experts are not reduced when ep = dp
      for (const FlatRange& r : I.expert_ranges) elements -= r.end - r.begin;
    *bytes = (I.bf16_reduce ? 2.0 : 4.0) * double(elements);
  }
  while (I.num_pending > 0) collect();
  I.flush_update();  // the reduction overwrites the gradients a pending update would read
  cuda::EventTimer timer(I.stream());
  timer.mark(cuda::Phase::kGradReduce);
  I.all_reduce_grads(I.stream());
  timer.close();
  // Under the group's deadline first, so a dead rank fails the bench instead of hanging it.
  cuda::Event done = cuda::event_create();
  cuda::event_record(done, I.stream());
  try {
    I.wait(done, "the timed gradient all-reduce");
  } catch (...) {
    cuda::event_destroy(done);
    throw;
  }
  cuda::event_destroy(done);
  return timer.collect()[int(cuda::Phase::kGradReduce)];
}

double CudaStepRunner::time_ep_all_to_all(int64_t bytes_per_rank) {
  Impl& I = *impl_;
  MOE_CHECK(I.ep != nullptr, "CudaStepRunner::time_ep_all_to_all: no expert-parallel group (parallel.ep = 1)");
  while (I.num_pending > 0) collect();
  const int64_t n = I.ep->size();
  const int64_t each = std::max<int64_t>(1, bytes_per_rank / int64_t(sizeof(uint16_t)) / n);  // BF16 per peer
  cuda::DeviceBuffer send(size_t(each * n) * sizeof(uint16_t)), recv(size_t(each * n) * sizeof(uint16_t));
  std::vector<int64_t> counts(static_cast<size_t>(n), each), offsets(static_cast<size_t>(n));
  for (int64_t p = 0; p < n; ++p) offsets[size_t(p)] = p * each;
  cuda::device_memset(send.data(), 0, send.bytes(), I.stream());
  double ms = 0;
  for (int pass = 0; pass < 2; ++pass) {  // the first warms the connections up
    cuda::EventTimer timer(I.stream());
    timer.mark(cuda::Phase::kDispatch);
    I.ep->all_to_all_v(send.data(), counts.data(), offsets.data(), recv.data(), counts.data(), offsets.data(),
                       cuda::NcclDType::kBF16, I.stream());
    timer.close();
    cuda::Event done = cuda::event_create();
    cuda::event_record(done, I.stream());
    try {
      I.ep->wait(done, "the timed expert-parallel all-to-all");
    } catch (...) {
      cuda::event_destroy(done);
      throw;
    }
    cuda::event_destroy(done);
    ms = timer.collect()[int(cuda::Phase::kDispatch)];
  }
  return ms;
}

CudaModel& CudaStepRunner::model() { return impl_->model; }
void CudaStepRunner::flush_update() { impl_->flush_update(); }
bool CudaStepRunner::deferred_update() const { return impl_->deferred; }
int64_t CudaStepRunner::pending() const { return impl_->num_pending; }
int64_t CudaStepRunner::dp_size() const { return impl_->dp_size; }
int64_t CudaStepRunner::dp_rank() const { return impl_->dp_rank; }
bool CudaStepRunner::uses_graph() const {
  return impl_->use_graph && (impl_->ep == nullptr || impl_->model.rowwise());
}
int64_t CudaStepRunner::graph_launches() const { return impl_->launches; }

void CudaStepRunner::set_use_graph(bool on) {
  Impl& I = *impl_;
  I.use_graph = on;
  if (!on && I.graph.ready()) {
    cuda::stream_sync(I.stream());
    I.graph.reset();
  }
}

void CudaStepRunner::set_phase_timer(cuda::EventTimer* timer) {
  impl_->timer = timer;
  impl_->model.set_phase_timer(timer);
}

void CudaStepRunner::load_state(const float* params, const float* exp_avg, const float* exp_avg_sq,
                                int64_t optimizer_steps, const std::vector<float>& expert_bias) {
  Impl& I = *impl_;
  MOE_CHECK(params != nullptr, "CudaStepRunner::load_state: params must not be null");
  MOE_CHECK(optimizer_steps >= 0, "CudaStepRunner::load_state: optimizer_steps must be >= 0, got ", optimizer_steps);
  const cuda::Stream st = I.stream();
  cuda::stream_sync(st);
  I.model.load_params(params);
  // The moments this rank keeps: the whole layout, or (ZeRO-1) its chunks and the tails. BF16
  // moments are rounded to nearest even here (AdamW::step reads host moments the same way).
  auto upload = [&](char* dev, const float* host, int64_t n) {
    cuda::copy_h2d_f32_stored(dev, host, n, I.bf16_moments, st);
  };
  const size_t elem = I.moment_elem_bytes();
  auto load_moments = [&](const float* host, cuda::DeviceBuffer& dev) {
    char* state = static_cast<char*>(dev.data());
    if (host == nullptr) {
      cuda::device_memset(state, 0, size_t(I.moment_numel()) * elem, st);
    } else if (!I.zero) {
      upload(state, host, I.moment_numel());
    } else {
      for (const FlatBucket& b : I.shards->buckets()) {
        upload(state + size_t(b.state_chunk) * elem, host + b.own_begin(), b.chunk);
        upload(state + size_t(b.state_tail) * elem, host + b.scattered_end(), b.tail_numel());
      }
    }
  };
  load_moments(exp_avg, I.exp_avg);
  load_moments(exp_avg_sq, I.exp_avg_sq);
  cuda::OptimStepScalars s{};
  s.step = optimizer_steps;
  cuda::copy_h2d(I.opt_scalars.data(), &s, sizeof(s), st);
  I.model.load_expert_bias(expert_bias);  // waits for the stream
}

void CudaStepRunner::download_state(float* params, float* exp_avg, float* exp_avg_sq, int64_t* optimizer_steps,
                                    std::vector<float>* expert_bias) {
  Impl& I = *impl_;
  const cuda::Stream st = I.stream();
  const size_t bytes = size_t(I.model.layout().total_numel()) * sizeof(float);
  I.flush_update();  // the state after the last submitted step's update
  cuda::stream_sync(st);
  if (params != nullptr) cuda::copy_d2h(params, I.model.params(), bytes, st);
  // ZeRO-1: each bucket's chunks all-gathered into a device scratch bucket (the layout's order),
  // the replicated tail after them, then copied out; collective over the groups, so every rank
  // asks for the same moments (a null pointer on one rank must be null on all).
  const size_t elem = I.moment_elem_bytes();
  // n moments from the device (FP32, or BF16 widened exactly) into host[0, n).
  auto copy_out = [&](float* host, const void* dev, int64_t n) {
    cuda::copy_d2h_stored_to_f32(host, dev, n, I.bf16_moments, st);
  };
  auto download_moments = [&](float* host, const cuda::DeviceBuffer& dev) {
    if (host == nullptr) return;
    if (!I.zero) {
      copy_out(host, dev.data(), I.model.layout().total_numel());
      return;
    }
    cuda::DeviceBuffer scratch;
    scratch.reserve(size_t(std::max<int64_t>(1, I.shards->max_bucket_numel())) * elem);
    char* t = static_cast<char*>(scratch.data());
    const char* state = static_cast<const char*>(dev.data());
    cuda::Event gathered = cuda::event_create();
    try {
      for (const FlatBucket& b : I.shards->buckets()) {
        cuda::NcclComm* comm = I.group_comms[size_t(b.group)];
        const int64_t scattered = b.scattered_end() - b.begin;
        cuda::copy_d2d(t + size_t(b.group_rank * b.chunk) * elem, state + size_t(b.state_chunk) * elem,
                       size_t(b.chunk) * elem, st);
        if (comm != nullptr)
          comm->all_gather(t, b.chunk, I.bf16_moments ? cuda::NcclDType::kBF16 : cuda::NcclDType::kF32, st);
        cuda::copy_d2d(t + size_t(scattered) * elem, state + size_t(b.state_tail) * elem, size_t(b.tail_numel()) * elem,
                       st);
        cuda::event_record(gathered, st);
        I.wait(gathered, "the ZeRO-1 moment gather of a checkpoint download");
        copy_out(host + b.begin, t, b.end - b.begin);
      }
    } catch (...) {
      cuda::event_destroy(gathered);
      throw;
    }
    cuda::event_destroy(gathered);
  };
  download_moments(exp_avg, I.exp_avg);
  download_moments(exp_avg_sq, I.exp_avg_sq);
  if (optimizer_steps != nullptr) {
    cuda::OptimStepScalars s{};
    cuda::copy_d2h(&s, I.opt_scalars.data(), sizeof(s), st);
    *optimizer_steps = s.step;
  }
  if (expert_bias != nullptr) *expert_bias = I.model.download_expert_bias();
}

bool CudaStepRunner::zero() const { return impl_->zero; }

void CudaStepRunner::submit(int64_t step, const std::vector<Batch>& micro, int64_t global_targets, double lr,
                            uint64_t train_seed) {
  Impl& I = *impl_;
  MOE_CHECK(!micro.empty(), "CudaStepRunner::submit: step ", step, " has no micro-batches");
  MOE_CHECK(step > I.last_step, "CudaStepRunner::submit: steps must be submitted in increasing order; got step ", step,
            " after step ", I.last_step);
  MOE_CHECK(I.num_pending < kMaxPending, "CudaStepRunner::submit: ", I.num_pending,
            " steps are waiting to be collected (at most ", kMaxPending, "); call collect() before submitting step ",
            step);
  const StepShape sh{static_cast<int64_t>(micro.size()), micro[0].num_sequences(), micro[0].seq_len};
  const int64_t num_targets = I.stage_inputs(sh, step, micro, global_targets, lr, train_seed);
  I.run_step(sh);
  I.queue_stats(sh, step, I.dp ? global_targets : num_targets);  // the CE sum is global after the all-reduce
}

StepStats CudaStepRunner::collect() {
  Impl& I = *impl_;
  MOE_CHECK(I.num_pending > 0, "CudaStepRunner::collect: no submitted step is waiting to be collected");
  Impl::StatsSlot& slot = I.ring[I.ring_head];
  I.wait(slot.ready, "step " + std::to_string(slot.step));
  I.ring_head = (I.ring_head + 1) % kMaxPending;
  --I.num_pending;

  const auto* raw = slot.host.as<const uint8_t>();
  cuda::StepStatsRecord rec;
  std::memcpy(&rec, raw, sizeof(rec));
  const int64_t vocab = I.cfg.model.vocab_size;
  MOE_CHECK(rec.bad_ids == 0, "step ", slot.step, ": ", rec.bad_ids, " input token ids outside [0, vocab_size = ",
            vocab, "): check the data's token ids against model.vocab_size");
  MOE_CHECK(rec.bad_targets == 0, "step ", slot.step, ": ", rec.bad_targets, " targets >= vocab_size = ", vocab,
            ": check the data's token ids against model.vocab_size");
  StepStats s;
  s.step = slot.step;
  s.ce_sum = rec.ce_sum;
  s.num_targets = slot.num_targets;
  const int64_t layers = I.model.num_moe_layers(), e = I.cfg.moe.num_experts;
  if (layers > 0 && slot.num_forwards > 0) {
    s.lb_loss = rec.lb_sum / double(layers * slot.num_forwards);
    s.z_loss = rec.z_sum / double(layers * slot.num_forwards);
  }
  s.tokens_per_expert.assign(static_cast<size_t>(layers), std::vector<int64_t>(static_cast<size_t>(e)));
  for (int64_t l = 0; l < layers; ++l)
    std::memcpy(s.tokens_per_expert[l].data(), raw + sizeof(rec) + size_t(l * e) * sizeof(int64_t),
                size_t(e) * sizeof(int64_t));
  const auto* head = reinterpret_cast<const cuda::StepStatsRecord*>(raw);
  const int64_t* layer_dropped = cuda::step_stats_layer_dropped(head, layers, e);
  const double* layer_losses = cuda::step_stats_layer_losses(head, layers, e);
  const double forwards = double(std::max<int64_t>(1, slot.num_forwards));
  s.layer_lb_loss.resize(size_t(layers));
  s.layer_z_loss.resize(size_t(layers));
  s.layer_dropped.assign(layer_dropped, layer_dropped + layers);
  for (int64_t l = 0; l < layers; ++l) {
    s.layer_lb_loss[size_t(l)] = layer_losses[2 * l] / forwards;
    s.layer_z_loss[size_t(l)] = layer_losses[2 * l + 1] / forwards;
  }
  s.expert_bias.resize(size_t(layers * e));
  if (layers > 0) std::memcpy(s.expert_bias.data(), raw + I.model.stats_bytes(), I.bias_bytes());
  s.num_routes = slot.num_routes;
  s.num_dropped = rec.num_dropped;
  s.grad_norm = rec.grad_norm;
  s.skipped = rec.skipped != 0;
  s.optimizer_steps = rec.optimizer_steps;
  return s;
}

ForwardStats CudaStepRunner::evaluate(const Batch& b, uint64_t routing_seed) {
  CudaModel& m = impl_->model;
  impl_->flush_update();  // evaluate the weights after the last submitted step
  // A forward without backward: the LM head computes losses only (no gradient into dW_head).
  m.set_fuse_head_backward(false);
  try {
    m.forward(b.inputs.data(), b.targets.data(), b.num_sequences(), b.seq_len, routing_seed);
  } catch (...) {
    m.set_fuse_head_backward(true);
    throw;
  }
  m.set_fuse_head_backward(true);
  return m.read_stats();
}

nlohmann::json cuda_kernel_variants() {
  return {{"grouped_gemm", cuda::grouped_gemm_backend_name(cuda::grouped_gemm_resolve_backend())}};
}

}  // namespace moe

#endif  // MOECORE_HAS_CUDA
