// Ctrl-C and SIGTERM: `moecore train` finishes the current step, writes its checkpoint, says how
// to continue and exits with 128 + the signal; the run then resumes from that step. A second
// signal ends the process at once by the signal, and the checkpoints written before stay complete.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

// `moecore train` of a small model for many steps into run_dir, stdout and stderr to `log`.
pid_t start_train(const fs::path& run_dir, const fs::path& log, int64_t steps, const std::string& resume = "none") {
  const std::vector<std::string> args = {
      MOECORE_BINARY, "train", "--run.dir=" + run_dir.string(), "--train.steps=" + std::to_string(steps),
      "--model.n_layers=2", "--model.d_model=32", "--model.n_heads=4", "--model.n_kv_heads=2",
      "--model.dense_hidden=64", "--moe.num_experts=4", "--moe.top_k=2", "--moe.expert_hidden=32",
      "--train.seq_len=16", "--train.micro_batch=2", "--train.global_batch=4", "--train.eval_interval=0",
      "--log.interval=1", "--checkpoint.interval=1000", "--checkpoint.resume=" + resume};
  const pid_t pid = fork();
  if (pid == 0) {
    FILE* f = std::fopen(log.c_str(), "w");
    dup2(fileno(f), STDOUT_FILENO);
    dup2(fileno(f), STDERR_FILENO);
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

// Waits until metrics.jsonl holds at least `n` records (or 60 s pass).
void wait_for_records(const fs::path& run_dir, size_t n) {
  for (int i = 0; i < 6000; ++i) {
    if (fs::exists(run_dir / "metrics.jsonl") && read_metrics(run_dir).size() >= n) return;
    std::this_thread::sleep_for(10ms);
  }
  FAIL() << "no " << n << " metrics records in 60 s";
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST(Signals, FirstStopFinishesTheStepAndSavesIt) {
  for (const int signo : {SIGINT, SIGTERM}) {
    const TempDir tmp("signal");
    const fs::path run = tmp.root() / "run", log = tmp.root() / "log.txt";
    const pid_t pid = start_train(run, log, 100000);
    wait_for_records(run, 2);
    ASSERT_EQ(kill(pid, signo), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    const std::string out = read_file(log);
    ASSERT_TRUE(WIFEXITED(status)) << out;
    EXPECT_EQ(WEXITSTATUS(status), 128 + signo) << out;
    EXPECT_NE(out.find(signo == SIGINT ? "stopped by SIGINT after step" : "stopped by SIGTERM after step"),
              std::string::npos)
        << out;
    EXPECT_NE(out.find("--checkpoint.resume=auto"), std::string::npos) << out;
    // The checkpoint is the last step logged.
    const std::vector<int64_t> steps = list_steps((run / "checkpoints").string());
    ASSERT_FALSE(steps.empty()) << out;
    const int64_t last_logged = read_metrics(run).back()["step"].get<int64_t>();
    EXPECT_EQ(steps.back(), last_logged) << out;
    // ... and the run continues from it.
    const pid_t again = start_train(run, tmp.root() / "log2.txt", last_logged + 2, "auto");
    ASSERT_EQ(waitpid(again, &status, 0), again);
    const std::string out2 = read_file(tmp.root() / "log2.txt");
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out2;
    EXPECT_NE(out2.find("at step " + std::to_string(last_logged)), std::string::npos) << out2;
  }
}

TEST(Signals, SecondStopEndsAtOnceAndEarlierCheckpointsStayComplete) {
  const TempDir tmp("signal2");
  const fs::path run = tmp.root() / "run", log = tmp.root() / "log.txt";
  const pid_t pid = start_train(run, log, 100000);
  wait_for_records(run, 2);
  ASSERT_EQ(kill(pid, SIGINT), 0);
  ASSERT_EQ(kill(pid, SIGINT), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  const std::string out = read_file(log);
  // Either the second signal ended it (by SIGINT), or the first had already finished and saved.
  if (WIFSIGNALED(status)) {
    EXPECT_EQ(WTERMSIG(status), SIGINT) << out;
  } else {
    EXPECT_EQ(WEXITSTATUS(status), 128 + SIGINT) << out;
  }
  // Whatever was written is whole: every listed step resolves as complete.
  const std::string ckpt = (run / "checkpoints").string();
  if (fs::exists(ckpt)) {
    for (const int64_t s : list_steps(ckpt)) {
      EXPECT_TRUE(resolve_checkpoint(ckpt + "/" + step_dir_name(s)).has_value()) << s;
    }
  }
}

// tokenize stops at a signal without leaving its output or a temporary behind. The input is a FIFO,
// so the signal arrives while the command is mid-file.
TEST(Signals, TokenizeLeavesNoPartialFile) {
  const TempDir tmp("signal_tok");
  const fs::path fifo = tmp.root() / "in.txt", out = tmp.root() / "out.bin", log = tmp.root() / "log.txt";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    FILE* f = std::fopen(log.c_str(), "w");
    dup2(fileno(f), STDOUT_FILENO);
    dup2(fileno(f), STDERR_FILENO);
    execl(MOECORE_BINARY, MOECORE_BINARY, "tokenize", "--out", out.c_str(), fifo.c_str(), (char*)nullptr);
    _exit(127);
  }
  std::this_thread::sleep_for(500ms);  // tokenize checks its input before it opens it for reading
  std::signal(SIGPIPE, SIG_IGN);       // the writes after tokenize stopped fail instead of killing the test
  FILE* w = std::fopen(fifo.c_str(), "w");  // opens once tokenize opened its end
  ASSERT_NE(w, nullptr);
  const std::string chunk(1 << 16, 'a');
  std::fwrite(chunk.data(), 1, chunk.size(), w);
  std::fflush(w);
  std::this_thread::sleep_for(200ms);
  ASSERT_EQ(kill(pid, SIGINT), 0);
  std::this_thread::sleep_for(100ms);
  for (int i = 0; i < 64; ++i) std::fwrite(chunk.data(), 1, chunk.size(), w);  // past one read chunk
  std::fclose(w);
  std::signal(SIGPIPE, SIG_DFL);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  const std::string text = read_file(log);
  ASSERT_TRUE(WIFEXITED(status)) << text;
  EXPECT_EQ(WEXITSTATUS(status), 1) << text;
  EXPECT_NE(text.find("stopped by SIGINT"), std::string::npos) << text;
  for (const auto& e : fs::directory_iterator(tmp.root()))
    EXPECT_TRUE(e.path() == fifo || e.path() == log) << "left behind: " << e.path();
}

}  // namespace
}  // namespace moe::testing
