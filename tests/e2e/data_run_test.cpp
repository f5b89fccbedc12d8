// The trainer and its data: a run of 6 steps resumed to 12 equals 12 straight steps bit for bit
// (the embedded corpus does not depend on train.steps), every source is checked and described
// before step 1, and `moecore tokenize` refuses to overwrite one of its inputs.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "core/config.h"
#include "support/test_util.h"
#include "train/trainer.h"

namespace moe::testing {
namespace {

namespace fs = std::filesystem;

// A constant learning rate after warm-up, so the schedule does not depend on train.steps either.
Config resume_config(const fs::path& run_dir, int64_t steps) {
  Config c = small_train_config(run_dir, /*n_layers=*/3, /*global_batch=*/4, steps);
  c.moe.shared_experts = 1;
  c.optim.schedule = "constant";
  c.checkpoint.interval = 3;
  c.train.eval_batches = 2;
  return c;
}

TEST(DataRun, SixStepsResumedToTwelveEqualTwelveStraight) {
  const TempDir tmp("data_resume");
  std::ostringstream log;
  const TrainSummary straight = train(resume_config(tmp / "straight", 12), log);
  EXPECT_NE(log.str().find("data train: embedded:train (generated, seed 1234), 4194304 tokens, 246723 instances of "
                           "17 tokens, 12 steps x 4 sequences"),
            std::string::npos)
      << log.str();
  EXPECT_NE(log.str().find("data eval: embedded:eval (generated, seed 1234)"), std::string::npos) << log.str();

  Config first = resume_config(tmp / "resumed", 6);
  train(first, log);
  Config second = resume_config(tmp / "resumed", 12);
  second.checkpoint.resume = "auto";
  const TrainSummary resumed = train(second, log);
  EXPECT_EQ(resumed.start_step, 6);
  EXPECT_EQ(resumed.steps_done, 12);

  const std::vector<double> a = train_losses(tmp / "straight"), b = train_losses(tmp / "resumed");
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), 12u);
  for (size_t i = 0; i < 12; ++i) EXPECT_EQ(a[i], b[i]) << "step " << i + 1;
  EXPECT_EQ(straight.final_eval_loss, resumed.final_eval_loss);
  EXPECT_TRUE(std::isfinite(straight.final_eval_loss));
}

// A bad id in the last tokens of a file (the dropped remainder: no step would ever read it) stops
// the run before step 1, naming the file; nothing is trained.
TEST(DataRun, BadTokenFileFailsBeforeStepOne) {
  const TempDir tmp("data_bad_id");
  const std::string path = (tmp / "tokens.bin").string();
  {
    std::ofstream f(path, std::ios::binary);
    const int64_t n = 64 * 17 + 5;
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t id = i == n - 1 ? 999 : static_cast<uint16_t>((i * 13) % 256);
      f.put(static_cast<char>(id & 0xff));
      f.put(static_cast<char>(id >> 8));
    }
  }
  Config c = resume_config(tmp / "run", 2);
  c.data.source = "tokens";
  c.data.paths = {path};
  std::ostringstream log;
  const std::string msg = error_of([&] { train(c, log); });
  EXPECT_NE(msg.find("token id 999 at token offset 1092 of '" + path + "'"), std::string::npos) << msg;
  EXPECT_TRUE(train_losses(tmp / "run").empty());
}

struct CmdResult {
  int status;
  std::string output;
};

CmdResult run_cli(const std::string& args) {
  const std::string cmd = std::string(MOECORE_BINARY) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int rc = pclose(p);
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, out};
}

TEST(DataRun, TokenizeRefusesToOverwriteAnInput) {
  const TempDir tmp("data_tokenize");
  const std::string a = (tmp / "a.txt").string(), b = (tmp / "b.txt").string();
  std::ofstream(a) << "first\n";
  std::ofstream(b) << "second\n";
  const CmdResult r = run_cli("tokenize --out " + b + " " + a + " " + b);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("output '" + b + "' is the input '" + b + "'"), std::string::npos) << r.output;
  std::ifstream f(b);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(f), {}), "second\n");
  const CmdResult ok = run_cli("tokenize --out " + (tmp / "ab.bin").string() + " " + a + " " + b);
  EXPECT_EQ(ok.status, 0) << ok.output;
  EXPECT_EQ(fs::file_size(tmp / "ab.bin"), 2u * (6 + 1 + 7 + 1));
  int entries = 0;
  for (const auto& e : fs::directory_iterator(tmp.root())) entries += e.is_regular_file();
  EXPECT_EQ(entries, 3);  // a.txt, b.txt, ab.bin: no temporary left
}

}  // namespace
}  // namespace moe::testing
