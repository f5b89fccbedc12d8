// `moecore report` and `moecore plan --html` through the real binary: the metrics record's wall
// time, tokens and per-layer load; the page embeds every record of metrics.jsonl (parsed back),
// overlays several runs named by their directories, tolerates a torn last line and says so,
// refuses a directory without metrics.jsonl or with a broken line inside, and is written
// atomically (a refused report leaves an earlier page as it was, no temporary left); the plan page
// holds the planner's own figures (compared with `moecore plan --json`) and its pp refusal.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "e2e/cli_util.h"
#include "support/test_util.h"
#include "train/report.h"

namespace moe::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "missing: " << (part) << "\nin: " << (text)

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<json> lines_of(const fs::path& p) {
  std::vector<json> out;
  std::ifstream in(p);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(json::parse(line));
  return out;
}

// One short run of the default model shared by the tests: 6 steps, a record every 2, evals at
// 0, 3 and 6.
class Report : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir("report");
    const CmdResult r = run_cli("train --train.steps=6 --log.interval=2 --train.eval_interval=3 --run.dir=" +
                                dir_->sub("run_a"));
    ASSERT_EQ(r.status, 0) << r.output;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string run_a() { return dir_->sub("run_a"); }
  static TempDir* dir_;
};
TempDir* Report::dir_ = nullptr;

TEST_F(Report, RecordsCarryWallTimeTokensAndPerLayerLoad) {
  const std::vector<json> recs = lines_of(fs::path(run_a()) / "metrics.jsonl");
  ASSERT_EQ(recs.size(), 6u);  // evals 0, 3, 6 and steps 2, 4, 6
  double last_wall = -1;
  int64_t per_step = 0;
  for (const json& r : recs) {
    ASSERT_TRUE(r.contains("wall_s") && r.contains("time") && r.contains("tokens")) << r.dump();
    EXPECT_GE(r["wall_s"].get<double>(), last_wall) << r.dump();
    last_wall = r["wall_s"].get<double>();
    const std::string t = r["time"].get<std::string>();
    EXPECT_EQ(t.size(), 24u) << t;
    EXPECT_EQ(t.back(), 'Z') << t;
    const int64_t step = r["step"].get<int64_t>(), tokens = r["tokens"].get<int64_t>();
    if (step > 0 && per_step == 0) per_step = tokens / step;
    EXPECT_EQ(tokens, step * per_step) << r.dump();
    if (r.contains("loss")) {
      const json& layers = r["layer_load_imbalance"];
      ASSERT_TRUE(layers.is_array() && !layers.empty()) << r.dump();
      double mean = 0;
      for (const json& v : layers) {
        EXPECT_GE(v.get<double>(), 1.0);
        mean += v.get<double>();
      }
      EXPECT_NEAR(mean / double(layers.size()), r["load_imbalance"].get<double>(), 1e-9) << r.dump();
    }
  }
  EXPECT_GT(per_step, 0);
}

TEST_F(Report, EmbedsEveryRecordOfMetricsJsonl) {
  const std::string out = dir_->sub("one.html");
  const CmdResult r = run_cli("report " + run_a() + " -o " + out);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_CONTAINS(r.output, "wrote " + out);
  const std::string html = slurp(out);
  EXPECT_EQ(html.find("http://"), html.find("http://www.w3.org/2000/svg"));  // nothing fetched: only the SVG namespace
  EXPECT_EQ(html.find("https://"), std::string::npos);
  EXPECT_EQ(html.find("<script src"), std::string::npos);
  const json data = embedded_json(html, out);
  ASSERT_EQ(data["runs"].size(), 1u);
  EXPECT_EQ(data["runs"][0]["name"], "run_a");
  EXPECT_EQ(data["runs"][0]["truncated"], false);
  const std::vector<json> recs = lines_of(fs::path(run_a()) / "metrics.jsonl");
  ASSERT_EQ(data["runs"][0]["records"].size(), recs.size());
  for (size_t i = 0; i < recs.size(); ++i) EXPECT_EQ(data["runs"][0]["records"][i], recs[i]) << i;
  for (const auto& e : fs::directory_iterator(dir_->root()))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
}

TEST_F(Report, OverlaysRunsNamedByTheirDirectories) {
  TempDir tmp("report_overlay");
  fs::create_directories(tmp / "run_b");
  std::ofstream(tmp / "run_b" / "metrics.jsonl") << R"({"step":1,"loss":3.5,"tokens":10,"wall_s":0.5})" << "\n";
  const std::string out = tmp.sub("both.html");
  const CmdResult r = run_cli("report " + run_a() + " " + tmp.sub("run_b") + "/ --out=" + out);
  ASSERT_EQ(r.status, 0) << r.output;
  const json data = embedded_json(slurp(out), out);
  ASSERT_EQ(data["runs"].size(), 2u);
  EXPECT_EQ(data["runs"][0]["name"], "run_a");
  EXPECT_EQ(data["runs"][1]["name"], "run_b");
  EXPECT_EQ(data["runs"][1]["records"], json::array({{{"step", 1}, {"loss", 3.5}, {"tokens", 10}, {"wall_s", 0.5}}}));
}

TEST_F(Report, ToleratesATornLastLineAndSaysSo) {
  TempDir tmp("report_torn");
  fs::create_directories(tmp / "live");
  std::ofstream(tmp / "live" / "metrics.jsonl") << R"({"step":2,"loss":4.0})" << "\n" << R"({"step":4,"lo)";
  const std::string out = tmp.sub("live.html");
  const CmdResult r = run_cli("report " + tmp.sub("live") + " -o " + out);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_CONTAINS(r.output, "metrics.jsonl is incomplete");
  const json data = embedded_json(slurp(out), out);
  EXPECT_EQ(data["runs"][0]["truncated"], true);
  EXPECT_EQ(data["runs"][0]["records"].size(), 1u);
}

TEST_F(Report, RefusesBadDirectoriesAndKeepsAnEarlierPage) {
  TempDir tmp("report_bad");
  const std::string out = tmp.sub("report.html");
  std::ofstream(out) << "earlier page";
  fs::create_directories(tmp / "empty_dir");
  CmdResult r = run_cli("report " + run_a() + " " + tmp.sub("empty_dir") + " -o " + out);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_CONTAINS(r.output, "'" + tmp.sub("empty_dir") + "' has no metrics.jsonl");
  r = run_cli("report " + tmp.sub("missing") + " -o " + out);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_CONTAINS(r.output, "'" + tmp.sub("missing") + "' is not a directory");
  fs::create_directories(tmp / "broken");
  std::ofstream(tmp / "broken" / "metrics.jsonl") << "{\"step\":1}\nnot json\n{\"step\":2}\n";
  r = run_cli("report " + tmp.sub("broken") + " -o " + out);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_CONTAINS(r.output, "metrics.jsonl line 2 is not a JSON object");
  r = run_cli("report -o " + out);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_CONTAINS(r.output, "missing RUN_DIR...");
  r = run_cli("report " + run_a() + " -o " + tmp.sub("no/such/dir/r.html"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_CONTAINS(r.output, tmp.sub("no/such/dir/r.html"));
  EXPECT_EQ(slurp(out), "earlier page");
  for (const auto& e : fs::directory_iterator(tmp.root()))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
}

TEST(PlanHtml, HoldsThePlannersFiguresForEveryLayout) {
  TempDir tmp("plan_html");
  const std::string cfg = std::string(MOECORE_SOURCE_DIR) + "/configs/olmoe-8l.toml";
  const std::string out = tmp.sub("plan.html");
  CmdResult r = run_cli("plan " + cfg + " --html --gpus 4 -o " + out);
  ASSERT_EQ(r.status, 0) << r.output;
  const json data = embedded_json(slurp(out), out);
  EXPECT_EQ(data["max_gpus"], 4);
  EXPECT_EQ(data["model"]["n_layers"], 8);
  int plans = 0, pp_plans = 0, ep_refusals = 0;
  for (const json& l : data["layouts"]) {
    if (l["pp"].get<int64_t>() > 1) {  // the GPU pipeline step's layouts: ep 1, the planner's plan
      ++pp_plans;
      ASSERT_TRUE(l.contains("plan")) << l.dump();
      EXPECT_EQ(l["ep"], 1) << l.dump();
      const std::string layout =
          "dp=" + std::to_string(l["dp"].get<int64_t>()) + ",pp=" + std::to_string(l["pp"].get<int64_t>());
      const CmdResult j = run_cli("plan " + cfg + " --layout " + layout + " --json");
      ASSERT_EQ(j.status, 0) << j.output;
      EXPECT_EQ(l["plan"], json::parse(j.output)) << layout;
      continue;
    }
    if (l["ep"] == 3) {  // 64 experts over 3 ranks: the planner's refusal, kept
      ++ep_refusals;
      EXPECT_NE(l.value("error", "").find("must be divisible by parallel.ep (3)"), std::string::npos) << l.dump();
      continue;
    }
    ASSERT_TRUE(l.contains("plan")) << l.dump();
    ++plans;
    const std::string layout = "dp=" + std::to_string(l["dp"].get<int64_t>()) + ",ep=" + std::to_string(l["ep"].get<int64_t>());
    const CmdResult j = run_cli("plan " + cfg + " --layout " + layout + " --json");
    ASSERT_EQ(j.status, 0) << j.output;
    EXPECT_EQ(l["plan"], json::parse(j.output)) << layout;
  }
  EXPECT_EQ(plans, 1 + 2 + 1 + 3);       // ep dividing dp and the 64 experts, 1..4 GPUs
  EXPECT_EQ(ep_refusals, 1);
  EXPECT_EQ(pp_plans, 1 + 1 + 1);        // 2 GPUs pp 2; 4 GPUs pp 2 and pp 4
  const CmdResult e = run_cli("plan " + cfg + " --gpus 4 --json");
  ASSERT_EQ(e.status, 0) << e.output;
  EXPECT_EQ(data["rankings"]["4"], json::parse(e.output));
  r = run_cli("plan " + cfg + " --html --json");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("--html and --json"), std::string::npos) << r.output;
  r = run_cli("plan " + cfg + " -o " + out);
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("--out FILE goes with --html"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace moe::testing
