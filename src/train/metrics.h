// Per-step metrics: one JSON object per logged step appended to <run.dir>/metrics.jsonl
// (flushed each line; a resumed run keeps the records up to its step), and load statistics over
// per-expert token counts (per layer, per expert-parallel rank).
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace moe {

// max/mean tokens per expert, averaged over MoE layers (1.0 = perfectly balanced).
double load_imbalance(const std::vector<std::vector<int64_t>>& counts_per_layer);

// max/mean of `counts` (1.0 = balanced; 1.0 too when every count is 0, as load_imbalance).
double max_over_mean(const std::vector<int64_t>& counts);

// Tokens per expert-parallel rank: the E counts of one layer summed in `ep` contiguous groups of
// E / ep experts (rank r holds experts [r x E/ep, (r + 1) x E/ep)). ep must divide E.
std::vector<int64_t> tokens_per_rank(const std::vector<int64_t>& tokens_per_expert, int64_t ep);

class MetricsWriter {
 public:
  // keep_through_step <= 0: a new file. Otherwise (a resumed run) the records of steps up to
  // keep_through_step are kept and later ones (written after the checkpoint the run resumed
  // from, a part of the run that is trained again) are dropped, through a temporary file and a
  // rename; new records are appended.
  MetricsWriter(const std::string& path, int64_t keep_through_step);
  void write(const nlohmann::json& record);
  // The largest wall_s of the records kept from before a resume (0: none), where the resumed
  // run's wall clock continues.
  double kept_wall_s() const { return kept_wall_s_; }

 private:
  std::ofstream out_;
  std::string path_;
  double kept_wall_s_ = 0;
};

}  // namespace moe
