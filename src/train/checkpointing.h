// The run's FP32 state on the host and its checkpoints. HostState holds the model (this rank's
// layout: its experts only under expert parallelism), AdamW (replicated moments) or the ZeRO-1
// shards, and the shard plans that say which ranges this rank writes. The CPU step trains it in
// place; the GPU step keeps it as the checkpoint mirror. Checkpoints are global FP32 tensors
// (docs/checkpoints.md): one rank writes the replicated state whole where every rank holds the
// same state in full (one rank; GPU data parallel without expert parallelism), otherwise every
// rank writes its slices; either resumes on any layout.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config.h"
#include "model/model.h"
#include "optim/adamw.h"
#include "optim/zero1.h"
#include "parallel/expert_parallel.h"

namespace moe {

struct RunPlan;
struct Topology;
class DataLoader;

struct HostState {
  // Model (initialised from train.seed unless `init` is false), optimizer and shard plans for this
  // rank of `topo`. With plan.zero on cpu the replicated moments are released (the shards hold
  // them); the GPU step's mirror keeps whole moments (CudaStepRunner gathers its ZeRO-1 shards into
  // them). The GPU trainer passes init = false: a fresh run initialises on the device (the same
  // values, cuda_model.h) and the mirror is filled by resume_run or by the step's download.
  HostState(const Config& cfg, const RunPlan& plan, const Topology& topo, bool init = true);
  HostState(const HostState&) = delete;
  HostState& operator=(const HostState&) = delete;

  std::optional<ExpertParallel> ep;  // this rank's expert-parallel context (ep > 1)
  Model<float> model;
  AdamW opt;
  std::vector<ShardGroup> owned;      // dp > 1: the ranges this rank owns (checkpoint slices, norms)
  std::unique_ptr<DistOptimizer> zero;  // ZeRO-1 shards (plan.zero on cpu), else null
  bool initialised = false;  // the model holds values: init_params or a resumed checkpoint
};

// Resumes from checkpoint.resume ("auto": the run's latest, if any; "none": nothing; a path):
// parameters, expert biases, the moments of the ranges this rank keeps, the optimizer step count
// and the loader's position. A mix resumes from the checkpoint's draws per source; a checkpoint
// written with another mix (number of sources, a weight, a source's tokens, train.seq_len or
// train.global_batch) is refused naming each difference. Returns the step to start after (0 when
// nothing was resumed).
int64_t resume_run(const Config& cfg, HostState& state, DataLoader& loader, std::ostream& out);

// True when rank 0 writes the state whole (see the header comment).
bool writes_replicated_checkpoint(const RunPlan& plan);

// Writes the checkpoint of step `done` (the state must be current: Step::sync_host_state first),
// collective over topo.world; returns the step directory. A failed save on the writing rank fails
// every rank with its message.
// train_state.json holds the loader's position and, for a mix of data.sources, "data_mix": the
// draws of every source (the exact position on any layout), its weight and its tokens.
std::string save_run_checkpoint(const Config& cfg, const RunPlan& plan, const Topology& topo, HostState& state,
                                int64_t done, const DataLoader& loader);

}  // namespace moe
