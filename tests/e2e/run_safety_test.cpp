// A run directory is never lost by accident: training into one that holds checkpoints without
// checkpoint.resume is refused (config.toml and metrics.jsonl untouched); a finished run says so
// and changes nothing; a resume from an earlier checkpoint keeps metrics.jsonl up to that step and
// appends, so every step appears once; train.eval_interval = 0 evaluates nothing.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "core/config.h"
#include "core/error.h"
#include "support/test_util.h"
#include "train/trainer.h"

namespace moe::testing {
namespace {

namespace fs = std::filesystem;

Config run_config(const fs::path& run_dir, int64_t steps) {
  Config c = small_train_config(run_dir, /*n_layers=*/2, /*global_batch=*/4, steps);
  c.checkpoint.interval = 2;
  c.checkpoint.keep_last = 0;  // every checkpoint stays
  return c;
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST(RunSafety, UsedRunDirIsRefusedWithoutResume) {
  const TempDir tmp("used_dir");
  const fs::path run = tmp.root() / "run";
  std::ostringstream log;
  train(run_config(run, 4), log);
  const std::string config_before = read_file(run / "config.toml");
  const std::string metrics_before = read_file(run / "metrics.jsonl");
  Config again = run_config(run, 4);
  again.optim.lr = 1e-2;  // a different run into the same directory
  const std::string msg = error_of([&] { train(again, log); });
  EXPECT_NE(msg.find("already holds checkpoints up to step 4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--checkpoint.resume=auto"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--run.dir"), std::string::npos) << msg;
  EXPECT_EQ(read_file(run / "config.toml"), config_before);
  EXPECT_EQ(read_file(run / "metrics.jsonl"), metrics_before);
}

TEST(RunSafety, FinishedRunSaysSoAndChangesNothing) {
  const TempDir tmp("finished");
  const fs::path run = tmp.root() / "run";
  std::ostringstream log;
  train(run_config(run, 4), log);
  const std::string metrics_before = read_file(run / "metrics.jsonl");
  Config again = run_config(run, 4);
  again.checkpoint.resume = "auto";
  std::ostringstream out;
  const TrainSummary s = train(again, out);
  EXPECT_EQ(s.start_step, 4);
  EXPECT_EQ(s.steps_done, 4);
  EXPECT_TRUE(s.losses.empty());
  EXPECT_NE(out.str().find("already at step 4 of 4"), std::string::npos) << out.str();
  EXPECT_EQ(read_file(run / "metrics.jsonl"), metrics_before);
}

// What an interrupted save or prune leaves is removed when a run starts, even one that saves nothing.
TEST(RunSafety, StaleTemporariesAreRemovedAtStart) {
  const TempDir tmp("stale");
  const fs::path run = tmp.root() / "run";
  std::ostringstream log;
  train(run_config(run, 2), log);
  const fs::path ckpt = run / "checkpoints";
  fs::create_directories(ckpt / ".tmp-step_4-99999");
  fs::create_directories(ckpt / ".tmp-prune-step_2-99999");
  std::ofstream(ckpt / "latest.tmp") << "step_4\n";
  Config again = run_config(run, 2);
  again.checkpoint.resume = "auto";
  train(again, log);  // already at step 2: nothing saved
  EXPECT_FALSE(fs::exists(ckpt / ".tmp-step_4-99999"));
  EXPECT_FALSE(fs::exists(ckpt / ".tmp-prune-step_2-99999"));
  EXPECT_FALSE(fs::exists(ckpt / "latest.tmp"));
  EXPECT_TRUE(fs::exists(ckpt / "step_2"));
}

TEST(RunSafety, ResumeFromAnEarlierStepKeepsEachStepOnce) {
  const TempDir tmp("metrics_once");
  const fs::path run = tmp.root() / "run";
  std::ostringstream log;
  train(run_config(run, 6), log);
  const std::vector<double> straight = train_losses(run);
  ASSERT_EQ(straight.size(), 6u);
  // Back to the checkpoint of step 2 in the same directory: steps 3..6 are trained again.
  Config again = run_config(run, 6);
  again.checkpoint.resume = (run / "checkpoints" / "step_2").string();
  const TrainSummary s = train(again, log);
  EXPECT_EQ(s.start_step, 2);
  std::multiset<int64_t> steps;
  for (const auto& r : read_metrics(run))
    if (r.contains("loss")) steps.insert(r["step"].get<int64_t>());
  EXPECT_EQ(steps, (std::multiset<int64_t>{1, 2, 3, 4, 5, 6}));
  const std::vector<double> resumed = train_losses(run);
  ASSERT_EQ(resumed.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(resumed[i], straight[i]) << "step " << i + 1;  // bit-exact resume
}

TEST(RunSafety, EvalIntervalZeroEvaluatesNothing) {
  const TempDir tmp("no_eval");
  const fs::path run = tmp.root() / "run";
  Config c = run_config(run, 2);
  c.train.eval_interval = 0;
  std::ostringstream log;
  const TrainSummary s = train(c, log);
  EXPECT_LT(s.initial_eval_loss, 0);
  EXPECT_LT(s.final_eval_loss, 0);
  for (const auto& r : read_metrics(run)) EXPECT_FALSE(r.contains("eval_loss")) << r.dump();
  c.run.dir = (tmp.root() / "eval").string();
  c.train.eval_interval = 2;
  const TrainSummary e = train(c, log);
  EXPECT_GT(e.initial_eval_loss, 0);
  EXPECT_GT(e.final_eval_loss, 0);
}

}  // namespace
}  // namespace moe::testing
