// Held-out evaluation (see the header): the round-robin sum over ranks, and a checkpoint's model
// put into a one-rank host state and run through the same step as training.
#include "train/evaluate.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <ostream>

#include "checkpoint/checkpoint.h"
#include "core/config_io.h"
#include "core/error.h"
#include "data/dataset.h"
#include "data/sources.h"
#include "parallel/comm.h"
#include "parallel/topology.h"
#include "train/checkpointing.h"
#include "train/device.h"
#include "train/model_state.h"
#include "train/routing_seed.h"
#include "train/run_plan.h"
#include "train/step.h"

namespace moe {

double EvalResult::loss() const { return tokens ? ce_sum / double(tokens) : std::nan(""); }
double EvalResult::perplexity() const { return std::exp(loss()); }

EvalResult evaluate_held_out(Step& step, const DataLoader& eval, const Config& cfg, Comm& comm) {
  const int64_t seqs = cfg.train.micro_batch;
  const int64_t nb = std::min<int64_t>(cfg.train.eval_batches, eval.num_eval_batches(seqs));
  const int64_t w = comm.size(), rounds = (nb + w - 1) / w;
  const bool collective = step.eval_is_collective();
  EvalResult r;
  r.batches = nb;
  for (int64_t round = 0; round < rounds; ++round) {
    const int64_t i = round * w + comm.rank();
    if (i >= nb && !collective) continue;
    const ForwardStats s = step.evaluate(eval.eval_batch(i % nb, seqs), routing_seed(cfg.train.seed, -1, i % nb));
    if (i >= nb) continue;
    r.ce_sum += s.ce_sum;
    r.tokens += s.num_targets;
  }
  if (comm.size() > 1) {
    comm.all_reduce(&r.ce_sum, 1, ReduceOp::kSum);
    comm.all_reduce(&r.tokens, 1, ReduceOp::kSum);
  }
  return r;
}

EvalResult evaluate_checkpoint(const std::string& step_dir, const Config& run_cfg, std::ostream& out) {
  const LoadedCheckpoint ck = LoadedCheckpoint::open(step_dir);
  check_resume_config(ck, run_cfg);
  Config cfg = run_cfg;
  // One rank holds every expert; the eval batches do not depend on the layout.
  cfg.parallel.dp = 1;
  cfg.parallel.ep = 1;
  cfg.parallel.zero = false;
  validate_config(cfg);
  const std::optional<TokenSource> source = open_eval_data(cfg, out);
  MOE_CHECK(source.has_value(), "no held-out data for checkpoint '", step_dir, "': its run has data.source = \"",
            cfg.data.source, "\" and no data.eval_paths; give --data.eval_paths=FILE[,FILE...] (token files of the ",
            "model's vocabulary)");
  const std::unique_ptr<Comm> self = make_self_comm();
  const RunPlan plan = make_run_plan(cfg, 1, resolve_device(cfg.train));
  const Topology topo = make_topology(cfg, *self);
  HostState state(cfg, plan, topo);
  load_model_state(ck, state.model);
  const DataLoader eval(*source, plan.seq_len, plan.micro_batch, plan.micro_batch, cfg.train.seed, 0, 1);
  std::ostream null_out(nullptr);
  const std::unique_ptr<Step> step = make_step(cfg, plan, topo, &state, null_out);
  return evaluate_held_out(*step, eval, cfg, *self);
}

}  // namespace moe
