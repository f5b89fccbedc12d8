// `moecore bench`: warm training steps on random tokens (system benchmark; data loading is
// not timed), reported as tokens/s, TFLOP/s (docs/architecture.md FLOP formula), MFU, step
// time by phase and peak memory; also written as JSON with machine, commit, command and date.
// This is the CPU reference backend's loop and the helpers both benches share; the GPU bench
// is train/gpu_bench.h.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>

#include <nlohmann/json.hpp>

#include "core/config.h"

namespace moe {

struct BenchOptions {
  int64_t warmup = 2;
  int64_t steps = 5;
  std::string out_dir = "bench/results";  // empty: no JSON file (unless json_path is set)
  std::string json_path;                  // non-empty: write the JSON record here instead
  std::string command;                    // as typed, recorded in the JSON
  std::string config_name = "default";
};

// Returns the JSON record (also printed as a table to `out`).
nlohmann::json run_bench(const Config& cfg, const BenchOptions& opt, std::ostream& out);

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
