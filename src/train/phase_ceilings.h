// How close each phase of a measured step came to the GPU's ceiling for its work: the bench's
// "achieved fraction of the phase's ceiling" line, so the next bottleneck shows in one line.
// Per phase, the work of one step on one rank (summed over its micro-steps) at the ceilings of
// train/ceilings.h (the GPU's measured rates): the GEMM phases at the dense BF16 GEMM rate (under
// the FP8 recipe, the FP8 GEMMs' forward and data gradient at the dense FP8 GEMM rate), the attention core at cuDNN's
// causal forward and backward rates, the experts' grouped GEMMs at the dense rate or, when
// larger, their weight traffic at the HBM rate, the optimizer's bytes at the HBM rate (only the
// gradient norm's when the update is deferred into the next forward), the dispatch's and combine's
// bytes on one GPU at the streaming rate of the step's fastest memory-bound kernel. The embedding,
// the router, recomputation, and the dispatch and combine of an expert exchange get none.
// Formulas: docs/benchmarks.md.
#pragma once

#include <string>
#include <vector>

#include "core/config.h"
#include "train/ceilings.h"
#include "train/run_plan.h"

namespace moe {

struct PhaseCeiling {
  std::string phase;      // core/phase.h name
  double flops = 0;       // FLOPs of the phase per step (0 for the optimizer)
  double bytes = 0;       // memory traffic the bound counts (optimizer, dispatch, combine; the experts' weights)
  double ideal_ms = 0;    // the phase at its ceiling
  std::string ceiling;    // what bounds it, e.g. "784 TFLOP/s dense BF16 GEMM"
};

// The phases above for `cfg` as `plan` runs it on one rank (dropless rows: tokens x top_k).
std::vector<PhaseCeiling> phase_ceilings(const Config& cfg, const RunPlan& plan,
                                         const GpuRates& gpu = h200_ceilings());

}  // namespace moe
