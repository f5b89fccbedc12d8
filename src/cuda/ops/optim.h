// The optimizer step on the GPU, same math as optim/adamw.h on flat FP32 buffers laid out by a
// ParamLayout: global_grad_norm (FP64 sum of squares, deterministic two-pass reduction), then
// adamw_step (clip factor, skip on a non-finite norm, bias corrections, the AdamW update of every
// segment in one launch, and the BF16 copy of the parameters). The moments may be a ZeRO-1
// shard's compact buffers (ParamSegment::state_offset); grad_sum_squares gives the shard's part
// of the squared norm. Every per-step scalar lives in
// device memory (OptimStepScalars), so a captured graph replays each step with new values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/fp8_types.h"
#include "cuda/device.h"
#include "cuda/optim_types.h"

namespace moe {
class ParamLayout;
struct OptimConfig;
}  // namespace moe

namespace moe::cuda {

// Bytes of device scratch (8-byte aligned) global_grad_norm needs: one FP64 partial per block, at most 8 KiB.
size_t global_grad_norm_workspace_bytes(int64_t n);

// *norm (device FP64) = sqrt(sum_i grads[i]^2), squares summed in FP64 (each square is exact). The
// partition into blocks depends only on n (not on the GPU or the pointer's alignment), and the
// partials are added in block order: bitwise reproducible. A NaN or Inf gradient gives a non-finite norm.
void global_grad_norm(const float* grads, int64_t n, double* norm, void* workspace, size_t workspace_bytes,
                      Stream stream);

// *sum (device FP64) = sum_i grads[i]^2: global_grad_norm without the square root, the same
// blocks, partials and order (so sqrt of it is bitwise global_grad_norm's result for the same n).
// The ZeRO-1 step adds these over the ranges a rank owns, all-reduced over the ranks. Same
// workspace as global_grad_norm.
void grad_sum_squares(const float* grads, int64_t n, double* sum, void* workspace, size_t workspace_bytes,
                      Stream stream);

// *sum (device FP64) = the sum of values[0, n) (FP64), by the block partition and partial order of
// grad_sum_squares (values instead of squares): deterministic, the same for the same n. Same
// workspace as global_grad_norm(n). The step adds the experts' block square sums with it
// (grouped_gemm_wgrad's squares).
void sum_f64(const double* values, int64_t n, double* sum, void* workspace, size_t workspace_bytes, Stream stream);

// The segments AdamW updates, validated on the host (sorted by offset, non-overlapping, inside
// [0, total_numel), decay 0 or 1; moments inside [0, state_numel), pairwise disjoint) and copied
// once to the device. Elements outside every segment (the layout's alignment padding, or what
// another ZeRO-1 rank updates) are never read or written.
class ParamSegmentTable {
 public:
  // Every entry of the layout, in layout order; total_numel = layout.total_numel().
  explicit ParamSegmentTable(const ParamLayout& layout);
  // state_numel: elements of the moment buffers (-1: total_numel, moments laid out like the
  // parameters); a segment's state_offset of -1 becomes its offset.
  ParamSegmentTable(std::vector<ParamSegment> segments, int64_t total_numel, int64_t state_numel = -1);
  ~ParamSegmentTable();
  ParamSegmentTable(const ParamSegmentTable&) = delete;
  ParamSegmentTable& operator=(const ParamSegmentTable&) = delete;

  const std::vector<ParamSegment>& segments() const { return host_; }
  const ParamSegment* device_segments() const { return device_; }
  // The runs of optimizer chunks the segments touch (sorted, disjoint, not adjacent) and their
  // chunk count: an update launches blocks for these chunks only, not for the gaps between them.
  const ChunkRun* device_chunk_runs() const { return device_runs_; }
  int num_chunk_runs() const { return static_cast<int>(runs_.size()); }
  int64_t num_chunks() const { return num_chunks_; }
  int64_t total_numel() const { return total_numel_; }  // extent of the flat buffers, in elements
  int64_t state_numel() const { return state_numel_; }  // extent of the moment buffers, in elements
  // True when every segment's state_offset - offset is a multiple of 4 (the float4 path may run).
  bool states_vec4() const { return states_vec4_; }
  // True when every segment's moments sit at its flat offset (no ZeRO-1 shard's compact buffers).
  bool states_at_offsets() const { return states_at_offsets_; }

 private:
  std::vector<ParamSegment> host_;
  int64_t total_numel_ = 0, state_numel_ = 0;
  bool states_vec4_ = true;
  bool states_at_offsets_ = true;
  ParamSegment* device_ = nullptr;
  std::vector<ChunkRun> runs_;
  int64_t num_chunks_ = 0;
  ChunkRun* device_runs_ = nullptr;  // inside the allocation of device_, after the segments
};

// One AdamW step of every segment, same update as AdamW::step after clip_grads (cfg: beta1, beta2,
// eps, weight_decay, grad_clip). On the device: a non-finite scalars->grad_norm skips the step
// (params, moments, BF16 copy and step unchanged; skipped = 1, num_skipped += 1); otherwise
// step += 1, clip factor = grad_clip / (norm + 1e-6) when grad_clip > 0 and norm > grad_clip (else
// 1), g = FP32(g * factor), then m, v, params. grads are read only (clip_grads scales them in place
// on the CPU). params_bf16 (may be null) receives bf16(params) of every updated element. params,
// grads and params_bf16 have segments.total_numel() elements, exp_avg and exp_avg_sq
// segments.state_numel() (element offset + i of a segment uses moment state_offset + i), FP32
// ones 4-byte and BF16 2-byte aligned (16 and 8, with states_vec4(), take the vector path). Three
// launches, no host synchronisation: capturable in a CUDA graph.
// The moments M are FP32 (float) or, under cfg.moment_dtype = "bf16", BF16 bits (uint16_t: read
// widened, the update in FP32, stored rounded to nearest even, as AdamW::step keeps them); M must
// match cfg.moment_dtype (else moe::Error). Every entry point below is instantiated for both.
template <typename M>
void adamw_step(const ParamSegmentTable& segments, const OptimConfig& cfg, float* params, const float* grads,
                M* exp_avg, M* exp_avg_sq, uint16_t* params_bf16, OptimStepScalars* scalars, Stream stream);

// adamw_step in parts, for an update deferred into the next step (optim.deferred_update): adamw_prepare
// is its first launch (skip or clip factor, step count, coefficients) and sets scalars->pending
// unless the step is skipped; adamw_apply is its update of the table's segments (only the chunks
// they touch, so one table per group of tensors costs what its tensors do), a no-op when skipped
// and, with deferred, when nothing is pending; adamw_clear_pending marks the update applied.
// adamw_step = prepare, apply (not deferred), clear: the same values bit for bit however the
// segments are split into tables.
void adamw_prepare(const OptimConfig& cfg, OptimStepScalars* scalars, Stream stream);
// sms > 0 keeps the update to that many multiprocessors (one resident block on each, walking the
// chunks), for an update beside GEMMs that leave them free (cuda/sm_reserve.h); 0 launches a block
// per chunk on every multiprocessor. The same values bit for bit either way.
template <typename M>
void adamw_apply(const ParamSegmentTable& segments, const OptimConfig& cfg, float* params, const float* grads,
                 M* exp_avg, M* exp_avg_sq, uint16_t* params_bf16, const OptimStepScalars* scalars, bool deferred,
                 Stream stream, int sms = 0);
void adamw_clear_pending(OptimStepScalars* scalars, Stream stream);

// adamw_apply of one segment that holds the experts' weights [experts, n, k] (segment.numel = experts
// * n * k), with the FP8 codes of its BF16 copy written in the same pass: q, s, qt, st and the
// non-finite count exactly as fp8_quantize_weights(params_bf16 + segment.offset, experts, n, k, f,
// ..., rule) writes them after the update (the weight cast of the FP8 recipe without a second pass over
// the BF16 copy; params_bf16 may be null, the codes are those of the BF16 rounding all the same).
// n and k positive multiples of 128; params, grads, FP32 exp_avg, exp_avg_sq 16-byte aligned, BF16
// ones and params_bf16 8-byte, q and qt 16-byte; state_offset - offset and offset multiples of 4; segment inside the
// flat buffers. A skipped step (or, deferred, nothing pending) writes nothing, codes included.
template <typename M>
void adamw_apply_fp8_weights(const ParamSegment& segment, int64_t experts, int64_t n, int64_t k,
                             const OptimConfig& cfg, float* params, const float* grads, M* exp_avg, M* exp_avg_sq,
                             uint16_t* params_bf16, Fp8Format f, uint8_t* q, float* s, uint8_t* qt, float* st,
                             uint32_t* num_nonfinite, const OptimStepScalars* scalars, bool deferred, Stream stream,
                             Fp8Rule rule = Fp8Rule::kBlocks);

}  // namespace moe::cuda
