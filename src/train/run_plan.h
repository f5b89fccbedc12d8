// The run plan: every quantity a run derives from its config and its world, derived once and
// validated once. Layout (dp, ep, pp over the world), micro-steps per rank, tokens per step,
// FLOPs per step, and one rank's memory estimate on its backend (its expert shard, its optimizer
// shard under ZeRO-1, activations of one micro-batch under train.recompute, split into the tensors
// each layer keeps, the one recompute pool and the model-wide scratch (train/memory_plan.h),
// expert-exchange buffers). The trainer, the loader, the step runners, the bench, `moecore train
// --dry-run` and `moecore plan` all take it.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/recompute.h"
#include "model/layout.h"
#include "parallel/topology.h"
#include "train/memory_plan.h"

namespace moe {

// Dense BF16 tensor-core peak of an H100/H200 SXM (TFLOP/s), the MFU denominator.
constexpr double kGpuPeakTflops = 989.0;

// Bytes one rank holds on its backend's memory (host for cpu, device for cuda), by kind.
struct MemoryEstimate {
  int64_t local_params = 0;  // elements of this rank's parameter layout (its experts only under EP)
  int64_t dense_params = 0;  // of which outside the expert tensors (alignment padding included)
  int64_t expert_params = 0;  // of which in this rank's expert tensors
  double params = 0;         // FP32 master weights (cuda: plus the BF16 copy; fp8: plus fp8_codes)
  double fp8_codes = 0;      // of params under fp8 on cuda: the expert and FP8 MLP weights' codes and scales
                             // (the experts' scales only where the codes take their BF16 copy's place)
  double grads = 0;          // FP32 gradients
  double moments = 0;        // two AdamW moments (this rank's ZeRO-1 shard when plan.zero)
  double moments_replicated = 0;  // 8 per local parameter (4: BF16 moments on cuda)
  double moments_sharded = 0;     // ZeRO-1's shard: 8 (or 4) x (dense / dp + experts / ep-dp)
  double moment_bytes = 4;        // of one moment element: 2 for BF16 moments on cuda (optim.moment_dtype)
  bool bf16_moments() const { return moment_bytes == 2.0; }  // the moments stored as BF16 bits
  ActivationMemory activation;    // one micro-batch under train.recompute, buffer by buffer
  double activations_kept = 0;    // activation.kept_bytes(): saved per layer, all layers
  double activations_pool = 0;    // activation.pool_bytes(): the recompute pool (largest layer)
  double scratch = 0;             // activation.scratch_bytes(): model-wide buffers and workspaces
  double exchange = 0;       // expert-parallel exchange buffers (ep > 1)
  double host_mirror = 0;    // cuda: the host's FP32 copy of weights and moments (for checkpoints)
  double activations() const { return activations_kept + activations_pool + scratch; }
  double total() const { return params + grads + moments + activations() + exchange; }
};

struct RunPlan {
  std::string device;          // "cpu" | "cuda" (resolve_device)
  ParallelSizes sizes;         // world, dp, ep, pp
  int64_t ep_dp = 1;           // ranks holding the same experts: dp / ep
  bool zero = false;           // ZeRO-1 moment shards (dp > 1, parallel.zero; cpu and cuda)
  Recompute recompute = Recompute::kNone;  // train.recompute
  int64_t seq_len = 0, micro_batch = 0, global_batch = 0;  // tokens, sequences per rank, sequences
  int64_t micro_steps = 0;     // micro-batches per rank per step: global_batch / (dp x micro_batch)
  // The GPU step takes its gradient norm from the experts' block square sums that their
  // weight-gradient GEMMs write (docs/cuda.md), reading no expert gradient again: cuda on one GPU
  // (dp, ep, pp of 1, no rowwise exchange), one micro-step, MoE layers, and MOECORE_GRAD_NORM
  // unset, empty or "fused" ("separate": the norm's own pass over every gradient).
  bool norm_from_expert_squares = false;
  // FP8 on the GPU with the update at the end of each step (no ZeRO-1, no deferred update, one
  // stage, local or rowwise experts, D and the expert hidden size multiples of 128): that update
  // writes the experts' weight codes, which live in the place of the experts' BF16 copy
  // (CudaModel::keep_fp8_codes_in_bf16_copy), so the codes cost no memory beyond their scales.
  bool fp8_codes_in_bf16_copy = false;
  int64_t micro_batches = 0;   // micro-batches of the global batch: dp x micro_steps
  int64_t tokens_per_micro_batch = 0;
  int64_t tokens_per_step = 0;  // global_batch x seq_len, over every rank
  ModelCounts counts;
  double flops_per_step = 0;   // counts.flops_per_token x tokens_per_step (docs/architecture.md)
  MemoryEstimate memory;       // one rank's (pp > 1: a rank of the stage with the most parameters)
  int64_t virtual_stages = 1;  // parallel.virtual_stages
  std::vector<int64_t> stage_bounds;  // pp x virtual_stages + 1 layer boundaries (stage_bounds)
  // pp > 1: the most layer x micro-batch activations one stage holds at once under its schedule
  // (memory.activation's kept tensors are scaled to it from one micro-batch's whole model).
  int64_t pipeline_held_layers = 0;
};

// Resolves and checks the layout for `world_size` ranks (resolve_parallel: every problem in one
// message with its arithmetic) and derives the rest. device: "cpu" or "cuda". Every
// train.recompute mode is planned (core/recompute.h).
RunPlan make_run_plan(const Config& cfg, int64_t world_size, const std::string& device);

// What the GPU's FP8 recipe (train.precision = "fp8" on cuda, docs/numerics.md) runs in FP8: the
// routed experts; the attention projections where D, Q and C are multiples of 128; each MLP (a
// dense layer's, or a MoE layer's shared experts) whose D and F are: their forward and
// data-gradient GEMMs (the weight gradients stay BF16). All false under another precision.
struct Fp8Parts {
  bool any = false, experts = false, projections = false, dense_mlp = false, shared_mlp = false;
};
Fp8Parts fp8_parts(const Config& cfg);

// The plan as the dry run prints it: layout, batch arithmetic, FLOPs, one rank's memory by kind
// with the activations of the configured mode split into kept, pool and scratch; with pp > 1 the
// grid: each stage's ranks, layers, dp and ep groups, and the schedule's bubble fraction.
std::string describe_run_plan(const RunPlan& plan);

// Bytes AdamW's update moves a parameter: the FP32 weight and gradient read, the weight written,
// the two moments read and written (moment_bytes each: 4, or 2 in BF16), the BF16 copy written:
// 30, or 22 with BF16 moments.
inline double adamw_update_bytes(double moment_bytes) { return 14.0 + 4.0 * moment_bytes; }

// Bytes of one activation row of `width` values under the FP8 recipe: its E4M3 codes and an FP32
// scale per 1 x 128 block.
inline double fp8_block_row_bytes(double width) { return width + std::ceil(width / 128.0) * 4.0; }

// Bytes per rank that BF16 moments (optim.moment_dtype = "bf16") would save over these: half the
// moments where they are FP32 on the GPU, else 0.
inline double bf16_moment_saving(const MemoryEstimate& m) { return m.bf16_moments() ? 0.0 : m.moments / 2.0; }

// Why one rank of `plan` does not fit this machine's memory ("" when it does): the CPU step's
// whole estimate, or the GPU step's host mirror, against 90% of the physical memory.
std::string host_memory_problem(const RunPlan& plan);

}  // namespace moe
