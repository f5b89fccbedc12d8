// Plain records of the GPU optimizer step that the entry header (ops/optim.h) and the device
// code (kernels/optim.cuh, kernels/step_stats.cuh) share: one tensor segment of the flat buffers
// and the step's scalars in device memory. No CUDA headers: host code and kernels read the same
// layout (ParamSegment 32 bytes, OptimStepScalars a 64-byte record, both 8-byte aligned).
#pragma once

#include <cstdint>

#include "core/chunk_run_types.h"

namespace moe::cuda {

// One tensor of the flat buffers: elements [offset, offset + numel); decay = 1 applies weight decay.
// Its AdamW moments sit at state_offset onwards of the moment buffers: state_offset = offset for
// moments laid out like the parameters (replicated), elsewhere for a ZeRO-1 shard's compact
// moments; -1 means "= offset" (ParamSegmentTable resolves it).
struct ParamSegment {
  int64_t offset = 0;
  int64_t numel = 0;
  int32_t decay = 1;
  int32_t reserved = 0;
  int64_t state_offset = -1;
};
static_assert(sizeof(ParamSegment) == 32, "ParamSegment is copied to the device as is");

// The runs of optimizer chunks a segment table touches (core/chunk_runs.h computes them).
using ChunkRun = moe::ChunkRun;

// Scalars of the optimizer step, in device memory (allocate one, zero it, set `step` when resuming).
// "in": written by the host before the step (cudaMemcpyAsync from pinned memory is captured as a
// node that reads the pinned value at every replay) or by a kernel; "out": written on the device,
// read by the host when it likes (copy the whole struct asynchronously with the step's metrics).
struct OptimStepScalars {
  double lr = 0.0;           // in: learning rate of this step (lr_at on the host)
  double grad_norm = 0.0;    // in: ||g||_2, e.g. written by global_grad_norm(..., &scalars->grad_norm, ...)
  double clip_factor = 1.0;  // out: the factor applied to the gradients (1: no clipping, or a skipped step)
  int64_t step = 0;          // in/out: AdamW steps taken (AdamW::steps_taken); +1 by every step not skipped
  int64_t num_skipped = 0;   // out: skipped steps so far (+1 per skip; no op resets it)
  int32_t skipped = 0;       // out: 1 when the last adamw_step was skipped (non-finite grad norm), else 0
  int32_t pending = 0;       // out: 1 from adamw_prepare (not skipped) until adamw_clear_pending (deferred update)
  // out: this step's coefficients, rounded to FP32 as AdamW::step rounds them (diagnostics; the
  // update kernel reads them).
  float step_size = 0.0f;     // lr / (1 - beta1^t)
  float inv_sqrt_bc2 = 0.0f;  // 1 / sqrt(1 - beta2^t)
  float decay = 0.0f;         // 1 - lr * weight_decay (decay segments)
  float grad_scale = 0.0f;    // FP32 clip_factor
};
static_assert(sizeof(OptimStepScalars) == 64 && alignof(OptimStepScalars) == 8,
              "OptimStepScalars is a 64-byte device record shared with the kernels");

}  // namespace moe::cuda
