// Pipeline schedules as pure functions: for P pipeline ranks, V virtual stages (model chunks) per
// rank and m micro-batches, the ordered list of operations (forward or backward of micro-batch
// mb on virtual stage v) each pipeline rank runs in one training step. Virtual stage v of rank s
// is model stage v * P + s (V = 1: stage s). Operations depend on each other only through the
// activation (forward, stage k-1 -> k) and its gradient (backward, stage k+1 -> k); the lists
// are deadlock-free when sends do not wait for their receiver (Comm::send).
//
// 1F1B (V = 1): rank s runs w = min(P - 1 - s, m) warm-up forwards, then m - w steady pairs
// (forward of micro-batch w + i, backward of micro-batch i), then the w cool-down backwards.
// Interleaved 1F1B (V > 1, m a multiple of P): the V * m forwards of a rank are ordered in
// groups of P micro-batches per virtual stage (forward k: virtual stage (k / P) % V, micro-batch
// (k / (P V)) P + k % P), backwards the same with the virtual stages reversed; warm-up
// min(2 (P - 1 - s) + (V - 1) P, V m) forwards, then 1F1B pairs, then the cool-down backwards.
//
// Idle time ("bubble"), in units of one virtual stage's forward + backward on one micro-batch
// with equal cost on every stage and free communication: each rank is busy V m units and the
// step lasts V m + P - 1 units, so the bubble fraction is (P - 1) / (V m + P - 1); for V = 1
// that is (P - 1) / (m + P - 1). simulate_schedule computes it from the lists themselves.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe {

struct PipelineOp {
  bool forward = true;
  int64_t micro_batch = 0;
  int64_t virtual_stage = 0;  // 0 .. V-1 on this rank; model stage virtual_stage * P + rank
  bool operator==(const PipelineOp&) const = default;
};

// The operations of pipeline rank `rank` in order. Throws naming parallel.pp,
// parallel.virtual_stages and train.global_batch (the micro-batch count) when P, V or m is out of
// range or when V > 1 and m is not a multiple of P.
std::vector<PipelineOp> pipeline_schedule(int64_t stages, int64_t virtual_stages, int64_t micro_batches, int64_t rank);

// "F0.0 F1.0 B0.0 ..." (F/B, micro-batch, '.', virtual stage): tests and the dry run.
std::string describe_schedule(const std::vector<PipelineOp>& ops);

// Runs every rank's list with unit-time forwards and backwards (fwd_cost, bwd_cost per op) and
// free communication, each op starting as soon as its rank is free and its input arrived. Throws
// when the lists deadlock (an op waits for one that never runs). Returns the makespan and the
// bubble fraction 1 - busy / (P x makespan).
struct ScheduleTiming {
  double makespan = 0;
  double bubble_fraction = 0;
};
ScheduleTiming simulate_schedule(int64_t stages, int64_t virtual_stages, int64_t micro_batches, double fwd_cost = 1,
                                 double bwd_cost = 2);

// (P - 1) / (V m + P - 1): the formula above.
double bubble_fraction_formula(int64_t stages, int64_t virtual_stages, int64_t micro_batches);

}  // namespace moe
