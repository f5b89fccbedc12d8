// The training loop: data -> micro-batches (gradient accumulation to train.global_batch) ->
// forward/backward -> global grad norm, clip, skip on non-finite -> AdamW -> expert-bias
// update -> metrics, eval and checkpoints, on the CPU or GPU step (train/step.h).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "core/config.h"

namespace moe {

struct TrainSummary {
  int64_t start_step = 0;       // first step run (after a resume)
  int64_t steps_done = 0;       // last step number completed
  double first_loss = 0, last_loss = 0;
  double initial_eval_loss = -1, final_eval_loss = -1;  // -1: no eval data
  double wall_s = 0;
  std::string run_dir, last_checkpoint;
  std::vector<double> losses;  // loss of every step run (global over ranks), in order
  int stopped_by = 0;          // the signal (SIGINT, SIGTERM) that stopped the run early, or 0
};

class Comm;

// Runs cfg (already validated) over world_comm(). Console lines go to `out`. A SIGINT or SIGTERM
// stops the run after the current step on every rank, with a checkpoint of that step (a second
// signal ends the process at once): the summary says which signal.
TrainSummary train(const Config& cfg, std::ostream& out);
// The same over the ranks of `world` (every rank calls it; rank 0 prints and writes the run's
// files; parallel.* is checked against world.size()). Sets world's timeout to parallel.timeout_s.
TrainSummary train(const Config& cfg, std::ostream& out, Comm& world);

// Checkpoint directory of a run: checkpoint.dir, or <run.dir>/checkpoints when empty
// (train/checkpointing.cpp).
std::string checkpoint_dir(const Config& cfg);

}  // namespace moe
