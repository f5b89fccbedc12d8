// `moecore plan`: for a config and a layout (dp, ep, pp over N GPUs), per-GPU memory by part and
// by recompute mode, communication bytes per step by collective, and an estimated step time from
// the H200 figures of train/ceilings.h; or, given only N GPUs, every layout that fits, best first.
// Memory comes from make_run_plan (the same MemoryEstimate `moecore train --dry-run` prints) on
// the cuda backend, the AdamW moments ZeRO-1-sharded when parallel.zero and dp > 1 (dense over dp,
// experts over ep-dp = dp / ep), as the GPU step shards them. Formulas and their accuracy: docs/planning.md.
// Pipeline stages (pp > 1) are planned as the GPU pipeline step runs them (train/gpu_pipeline_step.cpp):
// one stage a rank, 1F1B, no expert parallelism inside a stage, no ZeRO-1, recompute none (the
// stage runs a micro-batch's forward again before a backward that does not follow it); the step
// is the makespan of the schedule with each stage's measured-rate costs (estimate below).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include <nlohmann/json.hpp>
#include "train/ceilings.h"
#include "train/run_plan.h"

namespace moe {

struct LayoutRequest {
  int64_t dp = 1, ep = 1, pp = 1;
};

// "dp=8,ep=4,pp=1" (any order, each key at most once, missing keys: dp = gpus / pp, ep 1, pp 1).
// Throws naming --layout, the value and what was expected.
LayoutRequest parse_layout(const std::string& text, int64_t gpus);

// Bytes one GPU sends per step, by collective (ring algorithms: an all-reduce sends 2(p-1)/p of
// its buffer, a reduce-scatter or all-gather (p-1)/p; the expert exchange (ep-1)/ep of its rows,
// uniform routing assumed).
struct CommVolume {
  double dp_allreduce_buffer = 0;  // gradients all-reduced (no ZeRO): dense over dp, experts over ep-dp
  double dp_allreduce_sent = 0;
  double zero_reduce_scatter_sent = 0;  // ZeRO-1: gradients reduce-scattered (parallel.grad_reduce_dtype)
  double zero_all_gather_sent = 0;      // ZeRO-1: FP32 parameters all-gathered after the update
  double ep_dispatch_fwd_micro = 0, ep_combine_fwd_micro = 0;  // per micro-step, BF16 rows
  double ep_dispatch_bwd_micro = 0, ep_combine_bwd_micro = 0;
  double ep_per_step = 0;  // the four exchanges x micro-steps
  // pp > 1: the FP32 residual stream [N, D] sent forward and its gradient sent back per micro-batch
  // by a middle stage (the first stage sends only forward, the last only back).
  double pp_send_per_micro = 0;  // one direction, one micro-batch
  double pp_per_step = 0;        // the most any stage sends in a step
  double total_per_step() const {
    return dp_allreduce_sent + zero_reduce_scatter_sent + zero_all_gather_sent + ep_per_step + pp_per_step;
  }
};

// Estimated milliseconds of one step on one GPU by phase (compute phases summed over micro-steps).
struct StepTime {
  double embedding = 0, attention = 0, mlp = 0, router = 0, dispatch = 0, experts = 0, combine = 0, lm_head = 0;
  double recompute = 0;       // the extra forward work of selective / full
  double ep_exchange = 0;     // all-to-all time not overlapped with compute
  double grad_reduce = 0;     // the part of the DP all-reduce or ZeRO collectives paid in the step
  double optimizer = 0;
  // pp > 1 (the phases above are then those of the busiest stage): its sends and receives on its
  // stream, and the rest of the schedule's makespan, where it waits for its neighbours (the bubble).
  double pipeline_sends = 0, pipeline_wait = 0;
  double step_ms() const {
    return embedding + attention + mlp + router + dispatch + experts + combine + lm_head + recompute + ep_exchange +
           grad_reduce + optimizer + pipeline_sends + pipeline_wait;
  }
};

struct ModePlan {
  Recompute mode = Recompute::kNone;
  ActivationMemory activations;
  double memory_total = 0;  // bytes per GPU in this mode
  bool fits = false;
  StepTime time;
  double tokens_per_s_per_gpu = 0, tflops_per_gpu = 0, mfu = 0;
  std::string refused;  // non-empty when the layout cannot run this mode (then fits is false): why
};

// pp > 1: each stage's layers and its time in one step of the schedule (ms).
struct StagePlan {
  int64_t first_layer = 0, end_layer = 0;
  double forward_ms = 0, backward_ms = 0;  // one micro-batch (the LM head's backward in the last forward)
  int64_t forwards_again = 0;              // the micro-batches it runs forward twice
  double busy_ms = 0, sends_ms = 0;        // its compute and its sends in the step
};

struct LayoutPlan {
  Config cfg;                 // the config as planned (layout and, where needed, the global batch set)
  std::string batch_note;     // non-empty when the global batch was raised for this layout
  RunPlan run;                // make_run_plan(cfg, world, "cuda")
  bool zero = false;          // ZeRO-1 moments (run.zero: parallel.zero, dp > 1)
  double moments = 0;         // bytes per GPU (run.memory.moments: sharded or replicated)
  CommVolume comm;
  std::array<ModePlan, 3> modes;  // none, selective, full
  double gpu_memory = 0;      // bytes per GPU the plan fits against
  std::vector<std::string> notes;  // what the plan set differently from the config (pp > 1), and why
  std::vector<StagePlan> stages;   // pp > 1
  int64_t busiest_stage = 0;       // pp > 1: the stage whose phases modes[0].time shows
  double makespan_ms = 0;          // pp > 1: the schedule's length (recompute none)
};

// One layout: world = dp x pp GPUs. Refuses every layout resolve_parallel refuses, and ep > 1 with
// pp > 1 (the GPU pipeline step runs none).
LayoutPlan plan_layout(const Config& cfg, const LayoutRequest& layout, double gpu_memory_gib,
                       const GpuCeilings& gpu = h200_ceilings());

// Every layout of `gpus` GPUs (pp dividing gpus and at most the layer count, dp = gpus / pp; ep
// dividing dp and moe.num_experts at pp = 1, ep 1 at pp > 1) x recompute mode it can run, split by
// whether it fits gpu_memory_gib, the fitting best first by estimated tokens/s/GPU (ties: less memory).
struct LayoutChoice {
  LayoutPlan plan;
  Recompute mode = Recompute::kNone;
  const ModePlan& mode_plan() const { return plan.modes[size_t(mode)]; }
};
struct Enumeration {
  std::vector<LayoutChoice> fitting;      // sorted
  std::vector<LayoutChoice> not_fitting;  // in layout order
};
Enumeration enumerate_layouts(const Config& cfg, int64_t gpus, double gpu_memory_gib,
                              const GpuCeilings& gpu = h200_ceilings());

// The text `moecore plan` prints, and its --json.
std::string describe_layout_plan(const LayoutPlan& p, const GpuCeilings& gpu = h200_ceilings());
std::string describe_enumeration(const Enumeration& e, int64_t gpus, double gpu_memory_gib,
                                 const GpuCeilings& gpu = h200_ceilings());
nlohmann::json layout_plan_json(const LayoutPlan& p);
nlohmann::json enumeration_json(const Enumeration& e, int64_t gpus, double gpu_memory_gib);

}  // namespace moe
