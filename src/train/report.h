// The HTML pages of `moecore report` and `moecore plan --html`: one self-contained file each (inline
// CSS and a small inline script that draws SVG charts; nothing is fetched), the data embedded as
// JSON in <script type="application/json" id="moecore-data">. The report reads the metrics.jsonl
// of one or more run directories; the plan page holds the planner's figures (train/planner.h)
// for every layout it enumerates, computed here, so the page only looks them up. docs/report.md
// explains every chart.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config.h"
#include "train/ceilings.h"
#include "train/planner.h"

namespace moe {

// One run directory's records: every line of <dir>/metrics.jsonl in order.
struct RunMetrics {
  std::string dir;   // as given
  std::string name;  // the directory's name, the legend label
  nlohmann::json records = nlohmann::json::array();
  bool truncated = false;  // the last line was incomplete (a run still writing) and was left out
};

// Refuses a directory without metrics.jsonl, naming it, and a line other than the last that is
// not a JSON object (file and line named). An unparsable last line is left out and marked.
RunMetrics read_run_metrics(const std::string& dir);

// The report page of `runs` (several: overlaid, one colour each; names made unique).
std::string report_html(std::vector<RunMetrics> runs);

// The plan page of `cfg` (`config_name` shown): every GPU count 1..max_gpus, pp 1, 2, 4, 8
// dividing it and ep dividing dp = gpus / pp; each layout the planner's LayoutPlan JSON or the
// planner's refusal. The page opens at `start` when given, else with start_at_best at the best
// fitting layout of max_gpus, else at the config's layout.
nlohmann::json plan_page_data(const Config& cfg, const std::string& config_name, int64_t max_gpus,
                              double gpu_memory_gib, bool start_at_best, const LayoutRequest* start = nullptr,
                              const GpuCeilings& gpu = h200_ceilings());
std::string plan_html(const nlohmann::json& data);

// `j` as text that is safe inside a <script> element ("</" written "<\/").
std::string json_for_script(const nlohmann::json& j);

// The JSON embedded in a page written by report_html or plan_html; throws naming `what`.
nlohmann::json embedded_json(const std::string& html, const std::string& what);

}  // namespace moe
