// `moecore bench`: warm training steps on synthetic tokens (a system benchmark; no data loading)
// through the same step interface as `moecore train` (train/step.h) on either backend, reported
// as tokens/s (per GPU), TFLOP/s (docs/architecture.md FLOP formula), MFU on GPUs, step time by
// phase, peak memory and the backend's details (graph, collectives, expert exchange), and
// written as JSON with machine, commit, command, date and every setting that changes the figures.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config.h"

namespace moe {

class Comm;

struct BenchOptions {
  int64_t warmup = 2;
  int64_t steps = 5;
  std::string out_dir = "bench/results";  // empty: no JSON file (unless json_path is set)
  std::string json_path;                  // non-empty: write the JSON record here instead
  std::string command;                    // as typed, recorded in the JSON
  std::string config_name = "default";
  // What the step computes on (same shapes): "random" (splitmix64 token ids, weights from
  // model.init_std), "zeros" (token ids 0 and every weight matrix 0, norms 1) or "corpus" (the
  // data config's tokens, the embedded corpus by default, through the trainer's loader).
  std::string inputs = "random";
};

// Runs the benchmark on train.device and returns its JSON record (printed as a table to `out` on
// rank 0, written as write_bench_record says). Collective over `world`: several ranks run on GPUs
// only, one GPU per rank, data parallel with train.global_batch x world size sequences per step
// (each GPU runs the one-GPU step's micro-batches; parallel.dp must be 0 or the world size;
// parallel.ep may split the experts over ep groups of GPUs). GPU parameters are initialised on the
// device; a run whose estimate exceeds the free device memory is refused before allocating.
nlohmann::json run_bench(const Config& cfg, const BenchOptions& opt, std::ostream& out, Comm& world);

// `moecore sweep`: run_bench on each config in turn (one GPU job, the same options), after asking
// whether its run plan fits this GPU (gpu_fit_problem; on the cpu: 90% of the host's memory); a
// config that does not fit is listed with the reason instead of run. Prints tokens/s/GPU and
// TFLOP/s/GPU of each relative to the first that ran, and returns (and writes, as
// write_bench_record says, named "sweep-<first config>") {"sweep": [record or {"config",
// "skipped": true, "reason"}...], "command", "commit", "date"}.
nlohmann::json run_sweep(const std::vector<std::pair<std::string, Config>>& configs, const BenchOptions& opt,
                         std::ostream& out, Comm& world);

// $MOECORE_COMMIT when set and non-empty, else `git rev-parse --short HEAD`, else "unknown".
std::string bench_commit();
// The current UTC time as "2026-11-30T12:13:05Z".
std::string utc_date();
// Writes `rec` to opt.json_path, or else to opt.out_dir/bench-<config>-<device>-<date without
// ':'>.json; does nothing when both are empty. Prints "wrote PATH" to `out`; returns the path
// ("" when nothing was written). Throws naming the path when it cannot be written.
std::string write_bench_record(const nlohmann::json& rec, const BenchOptions& opt, const std::string& device,
                               const std::string& date, std::ostream& out);

}  // namespace moe
