// Torchrun-style jobs started the way users start them (run as one plain process; each test
// spawns N ranks with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): collectives that do not match,
// a rank that exits, a collective that times out, a missing MASTER_PORT, MASTER_PORT held by
// torchrun's agent, and `moecore train` on 2 TCP ranks: following a one-rank run of the same
// global batch, and stopping when a rank dies.
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "parallel/mpi_test_util.h"
#include "parallel/tcp_launch.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

namespace fs = std::filesystem;

// Same tolerance as tests/parallel/train_test.cpp (docs/numerics.md).
constexpr double kLossTolerance = 1e-6;

#define SKIP_INSIDE_A_JOB() \
  if (world_comm().size() > 1) GTEST_SKIP() << "spawns jobs: runs in the one-process entry of the suite"

// "[rank r] error after T s: ..." of a --tcp-probe rank; T, or -1 when absent.
double error_seconds(const std::string& out) {
  const size_t at = out.find("error after ");
  double s = -1;
  if (at != std::string::npos) std::sscanf(out.c_str() + at, "error after %lf", &s);
  return s;
}

TcpJob probe(int np, const std::string& mode, const fs::path& logs, const std::vector<std::string>& env) {
  return launch_tcp_job(np, {MOECORE_TEST_PARALLEL, "--tcp-probe", mode}, env, 120, logs);
}

TEST(TcpLaunch, MismatchedCollectivesNameBothCalls) {
  SKIP_INSIDE_A_JOB();
  const TempDir tmp("tcp_mismatch");
  const TcpJob job = probe(2, "mismatch", tmp.root(), {"MOECORE_COMM_TIMEOUT_S=20"});
  const std::string all = job.all_output();
  ASSERT_EQ(job.ranks.size(), 2u);
  EXPECT_EQ(job.ranks[0].status, 1) << all;
  EXPECT_EQ(job.ranks[1].status, 1) << all;
  EXPECT_CONTAINS(job.ranks[0].output,
                  "collective broadcast on rank 0 of group size 2: rank 1 called all_reduce(sum) of 16 int64 while "
                  "this rank called broadcast from root 0 of 16 int64");
  EXPECT_CONTAINS(job.ranks[1].output,
                  "collective all_reduce(sum) on rank 1 of group size 2: rank 0 called broadcast from root 0 of 16 "
                  "int64 while this rank called all_reduce(sum) of 16 int64");
  EXPECT_LT(job.seconds, 15) << "a mismatch fails at once, not at the timeout\n" << all;
}

TEST(TcpLaunch, RankThatExitsIsNamedByThePeers) {
  SKIP_INSIDE_A_JOB();
  const TempDir tmp("tcp_exit");
  const TcpJob job = probe(4, "exit", tmp.root(), {"MOECORE_COMM_TIMEOUT_S=30"});
  const std::string all = job.all_output();
  EXPECT_EQ(job.ranks[1].status, 3) << all;
  for (int r : {0, 2, 3}) {
    EXPECT_EQ(job.ranks[size_t(r)].status, 1) << r << "\n" << all;
    EXPECT_CONTAINS(job.ranks[size_t(r)].output, "collective all_reduce(sum) on rank " + std::to_string(r) +
                                                     " of group size 4 failed: rank 1 ")
        << "\n" << all;
    EXPECT_CONTAINS(job.ranks[size_t(r)].output, "its process exited or crashed)");
    const double s = error_seconds(job.ranks[size_t(r)].output);
    EXPECT_GE(s, 0) << all;
    EXPECT_LT(s, 10) << "the peers must not wait for the 30 s timeout\n" << all;
  }
}

// A pipeline stage that dies: the rank waiting in recv for it fails at once naming it, after
// taking the message it sent before dying; the other pair of the job finishes.
TEST(TcpLaunch, RecvFromARankThatExitsNamesIt) {
  SKIP_INSIDE_A_JOB();
  const TempDir tmp("tcp_recv_exit");
  const TcpJob job = probe(4, "recv-exit", tmp.root(), {"MOECORE_COMM_TIMEOUT_S=30"});
  const std::string all = job.all_output();
  EXPECT_EQ(job.ranks[1].status, 3) << all;
  EXPECT_EQ(job.ranks[0].status, 1) << all;
  EXPECT_CONTAINS(job.ranks[0].output,
                  "recv on rank 0 of a group of 2 from rank 1 (tag 2, 3 elements) failed: rank 1 of this group "
                  "(world rank 1) closed its connection (its process exited or crashed)");
  const double s = error_seconds(job.ranks[0].output);
  EXPECT_GE(s, 0) << all;
  EXPECT_LT(s, 10) << "rank 0 must not wait for the 30 s timeout\n" << all;
  EXPECT_EQ(job.ranks[2].status, 0) << all;
  EXPECT_EQ(job.ranks[3].status, 0) << all;
}

TEST(TcpLaunch, CollectiveTimesOut) {
  SKIP_INSIDE_A_JOB();
  const TempDir tmp("tcp_timeout");
  const TcpJob job = probe(2, "sleep", tmp.root(), {"MOECORE_COMM_TIMEOUT_S=1"});
  const std::string all = job.all_output();
  EXPECT_EQ(job.ranks[0].status, 1) << all;
  EXPECT_CONTAINS(job.ranks[0].output,
                  "collective all_reduce(sum) on rank 0 of group size 2 did not complete within 1 s (16 elements; "
                  "waiting for rank 1)");
  const double s = error_seconds(job.ranks[0].output);
  EXPECT_GE(s, 0.9) << all;
  EXPECT_LT(s, 3.5) << "rank 1 sleeps 4 s: the timeout must fire first\n" << all;
}

// Under torchrun the agent's own TCPStore listens on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=
// True); the rendezvous then takes MASTER_PORT + 1. Here this process plays the agent.
TEST(TcpLaunch, PortHeldByTorchrunAgent) {
  SKIP_INSIDE_A_JOB();
  const TempDir tmp("tcp_agent");
  int agent = -1, port = 0;
  for (int attempt = 0; attempt < 20 && agent < 0; ++attempt) {  // a free port whose next one is free
    port = free_tcp_port();
    const int probe = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(uint16_t(port + 1));
    const bool next_free = ::bind(probe, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(probe);
    if (!next_free) continue;
    agent = ::socket(AF_INET, SOCK_STREAM, 0);
    a.sin_port = htons(uint16_t(port));
    if (::bind(agent, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(agent, 4) != 0) {
      ::close(agent);
      agent = -1;
    }
  }
  ASSERT_GE(agent, 0) << "no free pair of ports";
  const std::string master_port = "MASTER_PORT=" + std::to_string(port);
  // Rank 1 reaches the "agent" and waits there for a table until its 2 s deadline.
  TcpJob job = probe(2, "sum", tmp.root(), {master_port, "MOECORE_COMM_TIMEOUT_S=2"});
  EXPECT_NE(job.ranks[0].status, 0) << "MASTER_PORT is taken: without the agent variable rank 0 cannot listen";
  EXPECT_CONTAINS(job.ranks[0].output, "rank 0 cannot listen on the rendezvous port " + std::to_string(port));
  EXPECT_NE(job.ranks[1].status, 0);
  job = probe(2, "sum", tmp.root(), {master_port, "MOECORE_COMM_TIMEOUT_S=20", "TORCHELASTIC_USE_AGENT_STORE=True"});
  EXPECT_EQ(job.worst(), 0) << job.all_output();
  EXPECT_CONTAINS(job.ranks[0].output, "[rank 0] the collective completed");
  ::close(agent);
}

// `moecore train` overrides of a two-layer model (as tests/parallel/launch_test.cpp).
std::vector<std::string> small_train(const fs::path& run_dir, int steps) {
  return {MOECORE_BINARY,
          "train",
          "--model.d_model=32",
          "--model.n_layers=2",
          "--model.dense_layers=",
          "--moe.num_experts=4",
          "--moe.expert_hidden=32",
          "--train.seq_len=16",
          "--train.micro_batch=2",
          "--train.global_batch=8",
          "--train.eval_interval=0",
          "--train.device=cpu",
          "--log.interval=1",
          "--train.steps=" + std::to_string(steps),
          "--run.dir=" + run_dir.string()};
}

std::string shell_join(const std::vector<std::string>& args) {
  std::string s;
  for (const std::string& a : args) s += (s.empty() ? "" : " ") + a;
  return s;
}

TEST(TcpLaunch, MissingMasterPortIsNamed) {
  SKIP_INSIDE_A_JOB();
  const TempDir tmp("tcp_port");
  const std::string train = shell_join(small_train(tmp / "run", 2));
  CommandResult r = run_command("env -u MASTER_PORT RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 " + train);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_CONTAINS(r.output, "error: ");
  EXPECT_CONTAINS(r.output, "MASTER_PORT is not set: a torchrun-style launch (RANK, WORLD_SIZE > 1) needs MASTER_PORT");
  r = run_command("env RANK=1 WORLD_SIZE=2 MASTER_PORT=port29500 " + train);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_CONTAINS(r.output, "MASTER_PORT must be a port number, where rank 0 listens for the rendezvous");
}

// Two TCP ranks train the same steps as one rank with the same global batch (the check that
// tests/parallel/train_test.cpp makes for MPI ranks), then rank 0's sliced checkpoint resumes
// on one process.
TEST(TcpLaunch, TrainFollowsOneRankLosses) {
  SKIP_INSIDE_A_JOB();
  const TempDir tmp("tcp_train");
  const TcpJob job =
      launch_tcp_job(2, small_train(tmp / "tcp", 4), {"OPENBLAS_NUM_THREADS=1", "MOECORE_COMM_TIMEOUT_S=120"}, 300,
                     tmp.root());
  const std::string all = job.all_output();
  ASSERT_EQ(job.worst(), 0) << all;
  EXPECT_CONTAINS(job.ranks[0].output, "parallel: 2 ranks (tcp), dp 2, ep 1");
  EXPECT_EQ(job.ranks[1].output.find("done:"), std::string::npos) << "only rank 0 prints\n" << all;
  const CommandResult one = run_command("env OPENBLAS_NUM_THREADS=1 timeout 300 " + shell_join(small_train(tmp / "one", 4)));
  ASSERT_EQ(one.status, 0) << one.output;
  const std::vector<double> a = train_losses(tmp / "tcp"), b = train_losses(tmp / "one");
  ASSERT_EQ(a.size(), 4u);
  const double worst = worst_relative_difference(a, b);
  std::printf("2 tcp ranks vs 1 rank: worst relative loss difference over %zu steps: %.3g\n", a.size(), worst);
  EXPECT_LT(worst, kLossTolerance);
  const fs::path step = tmp / "tcp" / "checkpoints" / "step_4";
  EXPECT_TRUE(fs::exists(step / "model-00000-of-00002.safetensors"));
  EXPECT_TRUE(fs::exists(step / "optim-00001-of-00002.safetensors"));
  // The same run with expert parallelism over the two TCP ranks.
  const TcpJob ep = launch_tcp_job(2, [&] {
    auto args = small_train(tmp / "tcp_ep", 4);
    args.push_back("--parallel.ep=2");
    return args;
  }(), {"OPENBLAS_NUM_THREADS=1", "MOECORE_COMM_TIMEOUT_S=120"}, 300, tmp.root());
  ASSERT_EQ(ep.worst(), 0) << ep.all_output();
  EXPECT_CONTAINS(ep.ranks[0].output, "parallel: 2 ranks (tcp), dp 2, ep 2");
  EXPECT_LT(worst_relative_difference(train_losses(tmp / "tcp_ep"), b), kLossTolerance);
  // The FP8 recipe with expert parallelism: the experts' rows travel as FP8 payloads. The first
  // step's loss (the forward on the initial weights) is the one-rank FP8 run's; later ones move
  // with the experts' weight gradients, which quantise their operands over both ranks' rows at
  // once (docs/expert_parallel.md), within FP8 rounding.
  const auto fp8_args = [&](const fs::path& dir, bool ep2) {
    auto args = small_train(dir, 4);
    args.push_back("--train.precision=fp8");
    if (ep2) args.push_back("--parallel.ep=2");
    return args;
  };
  const TcpJob ep8 = launch_tcp_job(2, fp8_args(tmp / "tcp_ep_fp8", true),
                                    {"OPENBLAS_NUM_THREADS=1", "MOECORE_COMM_TIMEOUT_S=120"}, 300, tmp.root());
  ASSERT_EQ(ep8.worst(), 0) << ep8.all_output();
  EXPECT_CONTAINS(ep8.ranks[0].output, "parallel: 2 ranks (tcp), dp 2, ep 2 (expert rows in FP8)");
  const CommandResult one8 =
      run_command("env OPENBLAS_NUM_THREADS=1 timeout 300 " + shell_join(fp8_args(tmp / "one_fp8", false)));
  ASSERT_EQ(one8.status, 0) << one8.output;
  const std::vector<double> a8 = train_losses(tmp / "tcp_ep_fp8"), b8 = train_losses(tmp / "one_fp8");
  ASSERT_EQ(a8.size(), 4u);
  ASSERT_EQ(b8.size(), 4u);
  EXPECT_LT(worst_relative_difference({a8[0]}, {b8[0]}), kLossTolerance);
  const double worst8 = worst_relative_difference(a8, b8);
  std::printf("2 tcp ranks, ep 2, FP8 vs 1 rank FP8: worst relative loss difference over 4 steps: %.3g\n", worst8);
  EXPECT_LT(worst8, 1e-3);  // measured 7.8e-6
}

// A training rank that dies mid-run (the trainer's fault injection): the other rank reports it
// ("[rank 0] error: ... rank 1 closed its connection") and exits instead of waiting.
TEST(TcpLaunch, TrainingRankThatExitsStopsTheJob) {
  SKIP_INSIDE_A_JOB();
  const TempDir tmp("tcp_fault");
  const TcpJob job = launch_tcp_job(2, small_train(tmp / "run", 20),
                                    {"OPENBLAS_NUM_THREADS=1", "MOECORE_COMM_TIMEOUT_S=60",
                                     "MOECORE_FAULT_EXIT_RANK=1", "MOECORE_FAULT_EXIT_STEP=3"},
                                    120, tmp.root());
  const std::string all = job.all_output();
  EXPECT_CONTAINS(job.ranks[1].output, "[rank 1] fault injection: exiting at step 3");
  EXPECT_EQ(job.ranks[0].status, 1) << all;
  EXPECT_CONTAINS(job.ranks[0].output, "[rank 0] error: collective ");
  EXPECT_CONTAINS(job.ranks[0].output, "rank 1 ");
  EXPECT_CONTAINS(job.ranks[0].output, "its process exited or crashed)");
  EXPECT_LT(job.seconds, 30) << "rank 0 must not wait for the 60 s timeout\n" << all;
  EXPECT_FALSE(fs::exists(tmp / "run" / "checkpoints" / "step_20"));
}

}  // namespace
}  // namespace moe::testing
