// metrics.jsonl writer and load-imbalance statistic.
#include "train/metrics.h"

#include <algorithm>

#include "core/error.h"

namespace moe {

double load_imbalance(const std::vector<std::vector<int64_t>>& counts_per_layer) {
  if (counts_per_layer.empty()) return 1.0;
  double acc = 0;
  for (const auto& counts : counts_per_layer) {
    double total = 0, mx = 0;
    for (int64_t c : counts) {
      total += double(c);
      mx = std::max(mx, double(c));
    }
    const double mean = counts.empty() ? 0 : total / double(counts.size());
    acc += mean > 0 ? mx / mean : 1.0;
  }
  return acc / double(counts_per_layer.size());
}

MetricsWriter::MetricsWriter(const std::string& path, bool append)
    : out_(path, append ? std::ios::app : std::ios::trunc), path_(path) {
  MOE_CHECK(out_.good(), "cannot open metrics file '", path, "' for writing");
}

void MetricsWriter::write(const nlohmann::json& record) {
  out_ << record.dump() << '\n';
  out_.flush();
  MOE_CHECK(out_.good(), "writing '", path_, "' failed (disk full?)");
}

}  // namespace moe
