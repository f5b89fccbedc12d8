// StepTrace: events kept in memory for the window's few steps, sorted by start on write.
#include "train/trace.h"

#include <algorithm>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "checkpoint/files.h"

namespace moe {

std::string trace_path(const std::string& run_dir, int rank, int world_size) {
  const std::string name = world_size > 1 ? "trace.rank" + std::to_string(rank) + ".json" : "trace.json";
  return (std::filesystem::path(run_dir) / name).string();
}

void StepTrace::add_step(int64_t step, const std::vector<PhaseInterval>& intervals, double start_s, double end_s) {
  const double measured_ms = 1e3 * std::max(0.0, end_s - start_s);
  if (!intervals.empty()) {
    // The step bar spans its phases: the loop collects a GPU step one submit later, so its
    // measured span lags the device's work by a step.
    start_s = intervals.front().start_s;
    end_s = intervals.front().end_s;
    for (const PhaseInterval& iv : intervals) {
      start_s = std::min(start_s, iv.start_s);
      end_s = std::max(end_s, iv.end_s);
    }
  }
  for (const PhaseInterval& iv : intervals)
    events_.push_back({phase_name(iv.phase), "phase", 1e6 * (iv.start_s - origin_s_),
                       std::max(0.0, 1e6 * (iv.end_s - iv.start_s)), 0, step, -1});
  events_.push_back({"step " + std::to_string(step), "step", 1e6 * (start_s - origin_s_),
                     std::max(0.0, 1e6 * (end_s - start_s)), 1, step, measured_ms});
}

int64_t StepTrace::write() const {
  std::vector<Event> sorted = events_;
  std::stable_sort(sorted.begin(), sorted.end(), [](const Event& a, const Event& b) { return a.ts_us < b.ts_us; });
  nlohmann::json events = nlohmann::json::array();
  const std::string rank_name = "rank " + std::to_string(rank_);
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank_}, {"tid", 0}, {"args", {{"name", rank_name}}}});
  events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", rank_}, {"tid", 0}, {"args", {{"sort_index", rank_}}}});
  events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank_}, {"tid", 0}, {"args", {{"name", "phases"}}}});
  events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank_}, {"tid", 1}, {"args", {{"name", "steps"}}}});
  int64_t phases = 0;
  for (const Event& e : sorted) {
    events.push_back({{"name", e.name},
                      {"cat", e.cat},
                      {"ph", "X"},
                      {"ts", e.ts_us},
                      {"dur", e.dur_us},
                      {"pid", rank_},
                      {"tid", e.tid},
                      {"args", e.measured_ms >= 0 ? nlohmann::json{{"step", e.step}, {"step_ms", e.measured_ms}}
                                                  : nlohmann::json{{"step", e.step}}}});
    phases += e.cat == "phase";
  }
  const nlohmann::json doc = {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
  write_file_atomic(path_, doc.dump() + "\n");
  return phases;
}

}  // namespace moe
