// `moecore bench`: warm training steps on random tokens (system benchmark; data loading is
// not timed), reported as tokens/s, TFLOP/s (docs/architecture.md FLOP formula), MFU, step
// time by phase and peak memory; also written as JSON with machine, commit, command and date.
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
  std::string out_dir = "bench/results";  // empty: no JSON file
  std::string command;                    // as typed, recorded in the JSON
  std::string config_name = "default";
};

// Returns the JSON record (also printed as a table to `out`).
nlohmann::json run_bench(const Config& cfg, const BenchOptions& opt, std::ostream& out);

}  // namespace moe
