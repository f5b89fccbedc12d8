// metrics.jsonl writer and load-imbalance statistic.
#include "train/metrics.h"

#include <algorithm>
#include <filesystem>

#include "checkpoint/files.h"
#include "core/error.h"

namespace moe {

double load_imbalance(const std::vector<std::vector<int64_t>>& counts_per_layer) {
  if (counts_per_layer.empty()) return 1.0;
  double acc = 0;
  for (const auto& counts : counts_per_layer) acc += max_over_mean(counts);
  return acc / double(counts_per_layer.size());
}

double max_over_mean(const std::vector<int64_t>& counts) {
  double total = 0, mx = 0;
  for (int64_t c : counts) {
    total += double(c);
    mx = std::max(mx, double(c));
  }
  const double mean = counts.empty() ? 0 : total / double(counts.size());
  return mean > 0 ? mx / mean : 1.0;
}

std::vector<int64_t> tokens_per_rank(const std::vector<int64_t>& tokens_per_expert, int64_t ep) {
  const int64_t e = int64_t(tokens_per_expert.size());
  MOE_CHECK(ep >= 1 && e % ep == 0, "tokens_per_rank: ep = ", ep, " must divide the ", e, " experts");
  std::vector<int64_t> out(size_t(ep), 0);
  for (int64_t i = 0; i < e; ++i) out[size_t(i / (e / ep))] += tokens_per_expert[size_t(i)];
  return out;
}

namespace {

// The lines of `path` whose record's "step" is <= keep (records without a step, e.g. eval lines
// carry one too, and unparsable lines such as a torn last line are dropped); `wall_s` gets the
// largest wall_s among them.
std::string kept_records(const std::string& path, int64_t keep, double& wall_s) {
  std::ifstream in(path);
  std::string line, out;
  while (std::getline(in, line)) {
    const nlohmann::json rec = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!rec.is_object() || !rec.contains("step") || !rec["step"].is_number_integer()) continue;
    if (rec["step"].get<int64_t>() > keep) continue;
    out += line + "\n";
    if (rec.contains("wall_s") && rec["wall_s"].is_number()) wall_s = std::max(wall_s, rec["wall_s"].get<double>());
  }
  return out;
}

}  // namespace

MetricsWriter::MetricsWriter(const std::string& path, int64_t keep_through_step) : path_(path) {
  namespace fs = std::filesystem;
  if (keep_through_step > 0 && fs::exists(path)) write_file_atomic(path, kept_records(path, keep_through_step, kept_wall_s_));
  out_.open(path, keep_through_step > 0 ? std::ios::app : std::ios::trunc);
  MOE_CHECK(out_.good(), "cannot open metrics file '", path, "' for writing");
}

void MetricsWriter::write(const nlohmann::json& record) {
  out_ << record.dump() << '\n';
  out_.flush();
  MOE_CHECK(out_.good(), "writing '", path_, "' failed (disk full?)");
}

}  // namespace moe
