// Helpers of the multi-process suite: the world communicator, a directory every rank of a
// group shares, a small model config, and running a command (mpirun, moecore) with a time limit.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/config_io.h"
#include "parallel/comm.h"
#include "support/test_util.h"

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "missing: " << (part) << "\nin: " << (text)

namespace moe::testing {

// A temporary directory named by rank 0 of `comm` (its pid and a counter), created by rank 0
// before the constructor returns on any rank, removed by rank 0 when every rank is done with it.
class SharedDir {
 public:
  SharedDir(Comm& comm, const std::string& tag) : comm_(comm) {
    static int64_t counter = 0;
    int64_t id[2] = {int64_t(::getpid()), counter++};
    comm_.broadcast(id, 2, 0);
    counter = std::max(counter, id[1] + 1);
    path_ = std::filesystem::temp_directory_path() /
            ("moecore_mpi_" + tag + "_" + std::to_string(id[0]) + "_" + std::to_string(id[1]));
    if (comm_.rank() == 0) {
      std::filesystem::remove_all(path_);
      std::filesystem::create_directories(path_);
    }
    comm_.barrier();
  }
  ~SharedDir() {
    comm_.barrier();
    std::error_code ec;
    if (comm_.rank() == 0) std::filesystem::remove_all(path_, ec);
  }
  SharedDir(const SharedDir&) = delete;
  SharedDir& operator=(const SharedDir&) = delete;
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }
  const std::filesystem::path& root() const { return path_; }

 private:
  Comm& comm_;
  std::filesystem::path path_;
};

// Two layers (one dense, one MoE with 4 experts), global batch 8 of 16-token sequences in
// micro-batches of 2: 4 micro-batches per step on 1 rank, 2 on 2 ranks, 1 on 4.
inline Config small_parallel_config(const std::filesystem::path& run_dir, int64_t steps = 20) {
  Config c = small_train_config(run_dir, /*n_layers=*/2, /*global_batch=*/8, steps);
  c.train.eval_batches = 2;
  c.train.eval_interval = steps;  // at step 0 and at the end
  c.train.device = "cpu";
  c.parallel.timeout_s = 120;
  validate_config(c);
  return c;
}

// gtest output of a multi-rank test program: rank 0 prints the usual report, every other rank
// only its failures, prefixed with its rank.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                 r.line_number(), r.message());
  }

 private:
  int rank_;
};

inline void print_only_root_report(Comm& world) {
  if (world.rank() == 0) return;
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new RankFailurePrinter(world.rank()));
}

// The exit status of a multi-rank test program: the worst of RUN_ALL_TESTS over the ranks.
inline int worst_status_over_ranks(Comm& world, int run_all_tests_status) {
  int64_t failed = run_all_tests_status != 0 ? 1 : 0;
  world.all_reduce(&failed, 1, ReduceOp::kMax);
  if (world.rank() == 0 && world.size() > 1)
    std::printf("%d ranks: %s\n", world.size(), failed ? "a test failed on some rank" : "all ranks passed");
  return int(failed);
}

// Worst |a - b| / max(|b|, 1e-12) over two equally long series (fails when lengths differ).
inline double worst_relative_difference(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::max(std::abs(b[i]), 1e-12));
  return worst;
}

struct CommandResult {
  int status = -1;  // exit status, or 128 + signal
  std::string output;  // stdout and stderr
  double seconds = 0;
};

// Runs `command` through the shell with stderr joined to stdout.
inline CommandResult run_command(const std::string& command) {
  CommandResult r;
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = ::popen((command + " 2>&1").c_str(), "r");
  if (!p) {
    ADD_FAILURE() << "popen failed for " << command;
    return r;
  }
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// `mpirun -np N --oversubscribe` with the variables a root-run container needs and one BLAS
// thread per rank; `env` adds NAME=value pairs for every rank (-x).
inline std::string mpirun(int np, const std::vector<std::string>& env = {}) {
  std::string cmd = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1 ";
  for (const auto& e : env) cmd += e + " ";
  cmd += std::string(MOECORE_MPIEXEC) + " -np " + std::to_string(np) + " --oversubscribe";
  for (const auto& e : env) cmd += " -x " + e.substr(0, e.find('='));
  return cmd + " ";
}

}  // namespace moe::testing
