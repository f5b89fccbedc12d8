// Per-step metrics: one JSON object per logged step appended to <run.dir>/metrics.jsonl
// (flushed each line), and load statistics over per-expert token counts.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace moe {

// max/mean tokens per expert, averaged over MoE layers (1.0 = perfectly balanced).
double load_imbalance(const std::vector<std::vector<int64_t>>& counts_per_layer);

class MetricsWriter {
 public:
  explicit MetricsWriter(const std::string& path, bool append);
  void write(const nlohmann::json& record);

 private:
  std::ofstream out_;
  std::string path_;
};

}  // namespace moe
