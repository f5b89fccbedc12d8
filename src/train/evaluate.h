// Held-out evaluation: the trainer's (every eval_interval steps) and `moecore eval` on a
// checkpoint share one function, so the two give the same loss for the same weights and data.
// Eval batch i (of min(train.eval_batches, the batches the data holds), each train.micro_batch
// sequences of train.seq_len, sequential and unshuffled) routes with routing_seed(train.seed, -1, i).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>

#include "core/config.h"

namespace moe {

class Comm;
class DataLoader;
class Step;

struct EvalResult {
  double ce_sum = 0;       // summed over every counted token, in batch order
  int64_t tokens = 0;      // targets counted
  int64_t batches = 0;     // eval batches run
  double loss() const;     // ce_sum / tokens (NaN when no token counted)
  double perplexity() const;  // exp(loss())
};

// Eval batches are dealt round-robin over the ranks of `comm` (batch i to rank i % W); sums are
// all-reduced. When forward is a collective (expert parallelism), every rank runs the same number
// of forwards: in the last round a rank without a batch of its own runs one again (i % nb) and
// discards the result.
EvalResult evaluate_held_out(Step& step, const DataLoader& eval, const Config& cfg, Comm& comm);

// `moecore eval`: the model of the checkpoint at `step_dir` (a checkpoint of any layout, loaded
// whole on this one rank: parallel.dp = parallel.ep = 1) on cfg's held-out data (data/sources.h:
// open_eval_data), on cfg.train.device (cpu, or cuda: the GPU step's eager evaluation forward).
// cfg is the checkpoint's own config with the caller's overrides applied; its model.* and moe.*
// must rebuild the checkpoint's model (check_resume_config). Prints the data line to `out`.
// Throws naming the checkpoint or the key when there is no held-out data.
EvalResult evaluate_checkpoint(const std::string& step_dir, const Config& cfg, std::ostream& out);

}  // namespace moe
