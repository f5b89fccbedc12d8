// The trainer and its data: a run of 6 steps resumed to 12 equals 12 straight steps bit for bit
// (the embedded corpus does not depend on train.steps), every source is checked and described
// before step 1, a run on a Megatron dataset and an llm.c shard equals one on the same tokens in
// headerless files, and `moecore tokenize` refuses to overwrite one of its inputs.
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
#include "data/embedded.h"
#include "support/test_util.h"
#include "support/token_formats.h"
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

// The same tokens as a multi-document Megatron dataset named by its prefix (train) and an llm.c
// shard (eval), or as headerless uint16 files: the same losses, step by step, and eval loss.
TEST(DataRun, MegatronAndLlmcFilesTrainLikeRawFiles) {
  const TempDir tmp("data_formats");
  const std::vector<uint32_t> train_ids = embedded_corpus("train", 200 * 17, 7);
  const std::vector<uint32_t> eval_ids = embedded_corpus("eval", 8 * 17, 7);
  const std::vector<uint64_t> train_u64(train_ids.begin(), train_ids.end()), eval_u64(eval_ids.begin(), eval_ids.end());
  // Documents end at EOS (0); each is stored as two sequences (the first 3 tokens, then the rest).
  std::vector<std::vector<std::vector<uint64_t>>> docs(1);
  for (uint64_t id : train_u64) {
    if (docs.back().empty()) docs.back().push_back({});
    if (docs.back().size() == 1 && docs.back()[0].size() == 3) docs.back().push_back({});
    docs.back().back().push_back(id);
    if (id == 0) docs.emplace_back();
  }
  if (docs.back().empty()) docs.pop_back();
  ASSERT_GT(docs.size(), 2u);
  const std::string prefix = write_megatron((tmp / "corpus_text_document").string(), docs, 8);
  const std::string shard = (tmp / "eval_000000.bin").string();
  write_bytes(shard, llmc_shard(eval_u64, false));
  const std::string raw_train = (tmp / "train.tokens").string(), raw_eval = (tmp / "eval.tokens").string();
  write_bytes(raw_train, le_array(train_u64, 2));
  write_bytes(raw_eval, le_array(eval_u64, 2));

  const auto run = [&](const std::string& name, const std::string& train_path, const std::string& eval_path,
                       std::ostringstream& log) {
    Config c = small_train_config(tmp / name, /*n_layers=*/2, /*global_batch=*/4, /*steps=*/6);
    c.data.source = "tokens";
    c.data.paths = {train_path};
    c.data.eval_paths = {eval_path};
    c.train.eval_batches = 2;
    return train(c, log);
  };
  std::ostringstream formats_log, raw_log;
  const TrainSummary formats = run("formats", prefix, shard, formats_log);
  const TrainSummary raw = run("raw", raw_train, raw_eval, raw_log);
  EXPECT_NE(formats_log.str().find("data train: 1 file '" + prefix + ".bin' (megatron uint16), 3400 tokens, 200 instances"),
            std::string::npos)
      << formats_log.str();
  EXPECT_NE(formats_log.str().find("data eval: 1 file '" + shard + "' (llm.c uint16), 136 tokens"), std::string::npos)
      << formats_log.str();
  EXPECT_NE(raw_log.str().find("data train: 1 file '" + raw_train + "' (raw uint16), 3400 tokens"), std::string::npos)
      << raw_log.str();
  const std::vector<double> a = train_losses(tmp / "formats"), b = train_losses(tmp / "raw");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "step " << i + 1;
  EXPECT_TRUE(std::isfinite(formats.final_eval_loss));
  EXPECT_EQ(formats.final_eval_loss, raw.final_eval_loss);
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

namespace moe::testing {
namespace {

// A weighted mix of two raw token files: the run describes each source, reports the realised
// shares (console and metrics.jsonl), resumes to the same losses as a straight run, and refuses
// to resume with another weight or another number of sources, naming the difference.
TEST(DataRun, WeightedMixTrainsReportsAndResumesExactly) {
  const TempDir tmp("data_mix");
  std::vector<uint64_t> a, b;
  for (int i = 0; i < 3000; ++i) a.push_back(uint64_t(i * 7 % 200));
  for (int i = 0; i < 900; ++i) b.push_back(uint64_t(200 + i % 50));
  write_bytes(tmp.sub("a.bin"), le_array(a, 2));
  write_bytes(tmp.sub("b.bin"), le_array(b, 2));
  auto config = [&](const std::string& dir, int64_t steps) {
    Config c = resume_config(tmp / dir, steps);
    c.data.source = "tokens";
    c.data.sources = {{{tmp.sub("a.bin")}, 3.0}, {{tmp.sub("b.bin")}, 1.0}};
    c.train.eval_interval = 0;
    return c;
  };
  std::ostringstream log;
  train(config("straight", 8), log);
  EXPECT_NE(log.str().find("data train: a mix of 2 sources (data.sources)"), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("data train source 1: weight 1 = 25.0% of instances, 1 file"), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("data mix through step 8: source 0 24 instances = 75.00% (weight 75.00%), 384 tokens; "
                           "source 1 8 instances = 25.00%"),
            std::string::npos)
      << log.str();
  const std::vector<nlohmann::json> records = read_metrics(tmp / "straight");
  ASSERT_FALSE(records.empty());
  ASSERT_TRUE(records.back().contains("data_mix")) << records.back().dump();
  EXPECT_EQ(records.back()["data_mix"][1]["instances"], 8);

  train(config("resumed", 5), log);
  Config more = config("resumed", 8);
  more.checkpoint.resume = "auto";
  const TrainSummary resumed = train(more, log);
  EXPECT_EQ(resumed.start_step, 5);
  const std::vector<double> x = train_losses(tmp / "straight"), y = train_losses(tmp / "resumed");
  ASSERT_EQ(x.size(), 8u);
  ASSERT_EQ(y.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(x[i], y[i]) << "step " << i + 1;

  Config reweighted = config("resumed", 10);
  reweighted.checkpoint.resume = "auto";
  reweighted.data.sources[1].weight = 2.0;
  const std::string msg = error_of([&] { train(reweighted, log); });
  EXPECT_NE(msg.find("with another data mix"), std::string::npos) << msg;
  EXPECT_NE(msg.find("data.sources[1].weight is 1 in the checkpoint, 2 in this run"), std::string::npos) << msg;
  Config one = config("resumed", 10);
  one.checkpoint.resume = "auto";
  one.data.sources.pop_back();
  EXPECT_NE(error_of([&] { train(one, log); }).find("the checkpoint mixes 2 data.sources, this run has one source"),
            std::string::npos);
  Config paths = config("resumed", 10);
  paths.checkpoint.resume = "auto";
  paths.data.sources.clear();
  paths.data.paths = {tmp.sub("a.bin")};
  EXPECT_NE(error_of([&] { train(paths, log); }).find("the checkpoint mixes 2 data.sources, this run has one source"),
            std::string::npos);
}

}  // namespace
}  // namespace moe::testing
