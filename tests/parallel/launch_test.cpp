// Whole jobs started the way users start them (run as one plain process; each test spawns
// `mpirun` or `moecore` with a time limit): a 2-rank training run with inspect and export-hf
// of its sliced checkpoint, the same with expert parallelism (ep = 2), a rank that dies mid-run, a collective that times out, a layout
// that does not fit the job, and a torchrun-style environment without MASTER_PORT (TCP jobs:
// tcp_launch_test.cpp).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "checkpoint/checkpoint.h"
#include "parallel/mpi_test_util.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

namespace fs = std::filesystem;

// A short run of a two-layer model (overrides for `moecore train`).
std::string small_run(const fs::path& run_dir, int steps) {
  return std::string(MOECORE_BINARY) + " train --model.d_model=32 --model.n_layers=2 --model.dense_layers=" +
         " --moe.num_experts=4 --moe.expert_hidden=32 --train.seq_len=16 --train.micro_batch=2" +
         " --train.global_batch=8 --train.eval_interval=0 --train.device=cpu --log.interval=1" +
         " --train.steps=" + std::to_string(steps) + " --run.dir=" + run_dir.string();
}

bool in_mpi_job() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || world_comm().size() > 1; }

#define SKIP_INSIDE_MPI_JOB() \
  if (in_mpi_job()) GTEST_SKIP() << "spawns mpirun: runs in the one-process entry of the suite"

TEST(Launch, TwoRankRunThenInspectAndExport) {
  SKIP_INSIDE_MPI_JOB();
  const TempDir tmp("launch");
  const CommandResult r = run_command("timeout 300 " + mpirun(2) + small_run(tmp / "run", 6));
  ASSERT_EQ(r.status, 0) << r.output;
  size_t done_lines = 0;
  for (size_t at = r.output.find("done:"); at != std::string::npos; at = r.output.find("done:", at + 1)) ++done_lines;
  EXPECT_EQ(done_lines, 1u) << "only rank 0 prints\n" << r.output;
  EXPECT_EQ(train_losses(tmp / "run").size(), 6u);
  const fs::path step = tmp / "run" / "checkpoints" / "step_6";
  EXPECT_TRUE(fs::exists(step / "model-00000-of-00002.safetensors"));
  EXPECT_TRUE(fs::exists(step / "optim-00001-of-00002.safetensors"));
  EXPECT_FALSE(fs::exists(step / "part-0.json"));

  const CommandResult ins = run_command(std::string(MOECORE_BINARY) + " inspect " + (tmp / "run" / "checkpoints").string());
  ASSERT_EQ(ins.status, 0) << ins.output;
  EXPECT_CONTAINS(ins.output, "sliced over 2 ranks");
  EXPECT_CONTAINS(ins.output, "model.embed_tokens.weight");
  const CommandResult ex = run_command(std::string(MOECORE_BINARY) + " export-hf " + step.string() + " " +
                                       (tmp / "hf").string());
  ASSERT_EQ(ex.status, 0) << ex.output;
  EXPECT_TRUE(fs::exists(tmp / "hf" / "config.json"));
  // One process resumes the 2-rank checkpoint and continues.
  const CommandResult one = run_command("timeout 300 " + small_run(tmp / "run", 8) + " --checkpoint.resume=auto");
  ASSERT_EQ(one.status, 0) << one.output;
  EXPECT_CONTAINS(one.output, "resumed from");
  EXPECT_EQ(train_losses(tmp / "run").size(), 8u);
}

TEST(Launch, ExpertParallelRunThenInspectAndExport) {
  SKIP_INSIDE_MPI_JOB();
  const TempDir tmp("launch_ep");
  const CommandResult r = run_command("timeout 300 " + mpirun(2) + small_run(tmp / "run", 4) + " --parallel.ep=2");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_CONTAINS(r.output, "dp 2, ep 2");
  EXPECT_EQ(train_losses(tmp / "run").size(), 4u);
  const fs::path step = tmp / "run" / "checkpoints" / "step_4";

  // inspect shows the global expert tensors [E = 4, 2I, D], reassembled from both ranks' slices.
  const CommandResult ins = run_command(std::string(MOECORE_BINARY) + " inspect " + step.string());
  ASSERT_EQ(ins.status, 0) << ins.output;
  const size_t at = ins.output.find("model.layers.1.mlp.experts.gate_up_proj ");
  ASSERT_NE(at, std::string::npos) << ins.output;
  const std::string line = ins.output.substr(at, ins.output.find('\n', at) - at);
  EXPECT_CONTAINS(line, "[4, 64, 32]");
  EXPECT_CONTAINS(line, "2 slices");

  // export-hf writes every expert; expert 3 (rank 1's) equals its rows of the global tensors.
  const CommandResult ex = run_command(std::string(MOECORE_BINARY) + " export-hf " + step.string() + " " +
                                       (tmp / "hf").string() + " --dtype fp32");
  ASSERT_EQ(ex.status, 0) << ex.output;
  const SafetensorsFile hf = SafetensorsFile::open((tmp / "hf" / "model-00001-of-00001.safetensors").string());
  const LoadedCheckpoint ck = LoadedCheckpoint::open(step.string());
  std::vector<float> gate_up(4 * 64 * 32), down(4 * 32 * 32), gate(32 * 32), up(32 * 32), dn(32 * 32);
  ck.read_model("model.layers.1.mlp.experts.gate_up_proj", {4, 64, 32}, gate_up.data());
  ck.read_model("model.layers.1.mlp.experts.down_proj", {4, 32, 32}, down.data());
  hf.read_f32("model.layers.1.mlp.experts.3.gate_proj.weight", gate.data(), int64_t(gate.size()));
  hf.read_f32("model.layers.1.mlp.experts.3.up_proj.weight", up.data(), int64_t(up.size()));
  hf.read_f32("model.layers.1.mlp.experts.3.down_proj.weight", dn.data(), int64_t(dn.size()));
  const int64_t e3 = 3 * 64 * 32;
  EXPECT_EQ(gate, std::vector<float>(gate_up.begin() + e3, gate_up.begin() + e3 + 32 * 32));
  EXPECT_EQ(up, std::vector<float>(gate_up.begin() + e3 + 32 * 32, gate_up.begin() + e3 + 64 * 32));
  EXPECT_EQ(dn, std::vector<float>(down.begin() + 3 * 32 * 32, down.end()));
}

TEST(Launch, RankThatExitsFailsTheJob) {
  SKIP_INSIDE_MPI_JOB();
  const TempDir tmp("fault");
  const CommandResult r =
      run_command("timeout 300 " + mpirun(2, {"MOECORE_FAULT_EXIT_RANK=1", "MOECORE_FAULT_EXIT_STEP=3"}) +
                  small_run(tmp / "run", 20) + " --parallel.timeout_s=20");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.status, 124) << "the job hung until the outer time limit\n" << r.output;
  EXPECT_LT(r.seconds, 120) << r.output;
  EXPECT_CONTAINS(r.output, "[rank 1] fault injection: exiting at step 3");
  EXPECT_FALSE(fs::exists(tmp / "run" / "checkpoints" / "step_20"));
}

TEST(Launch, CollectiveTimeoutAbortsTheJob) {
  SKIP_INSIDE_MPI_JOB();
  const CommandResult r =
      run_command("timeout 300 " + mpirun(2, {"MOECORE_COMM_TIMEOUT_S=2"}) + MOECORE_TEST_PARALLEL + " --timeout-probe");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_LT(r.seconds, 50) << "rank 1 sleeps 60 s: the abort must end it first\n" << r.output;
  EXPECT_CONTAINS(r.output, "[rank 0] error: ");
  EXPECT_CONTAINS(r.output, "collective all_reduce(sum) (1 elements) timed out after 2 s on rank 0 of a group of 2");
}

TEST(Launch, LayoutThatDoesNotFitTheJob) {
  SKIP_INSIDE_MPI_JOB();
  const TempDir tmp("layout");
  CommandResult r = run_command("timeout 300 " + mpirun(2) + small_run(tmp / "a", 2) + " --parallel.dp=4");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_CONTAINS(r.output, "] error: invalid parallel layout for 2 rank(s):");
  EXPECT_CONTAINS(r.output, "parallel.dp x parallel.pp must equal the number of ranks: 4 x 1 = 4, but the job has 2 ranks");
  r = run_command("timeout 300 " + mpirun(2) + small_run(tmp / "b", 2) + " --parallel.ep=4");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_CONTAINS(r.output, "parallel.ep (4) must divide dp (2): 2 % 4 = 2");
  r = run_command("timeout 300 " + mpirun(2) + small_run(tmp / "c", 2) + " --parallel.ep=2 --moe.capacity_factor=1.25");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_CONTAINS(r.output, "expert parallelism is dropless only: moe.capacity_factor must be 0 with parallel.ep = 2");
  r = run_command("timeout 300 " + mpirun(2) + small_run(tmp / "d", 2) + " --parallel.ep=2 --parallel.ep_capacity_factor=2");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_CONTAINS(r.output, "parallel.ep_capacity_factor = 2 applies to parallel.ep_backend = \"rowwise\" only");
}

TEST(Launch, TorchrunEnvironmentWithoutPortIsRefused) {
  SKIP_INSIDE_MPI_JOB();
  const TempDir tmp("torchrun");
  const CommandResult r =
      run_command("env -u MASTER_PORT RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 " + small_run(tmp / "run", 2));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_CONTAINS(r.output, "error: ");
  EXPECT_CONTAINS(r.output, "MASTER_PORT is not set");
}

TEST(Launch, OneProcessWithoutLauncherStaysSingleRank) {
  SKIP_INSIDE_MPI_JOB();
  const TempDir tmp("single");
  const CommandResult r = run_command("timeout 300 " + small_run(tmp / "run", 2));
  ASSERT_EQ(r.status, 0) << r.output;
  const fs::path step = tmp / "run" / "checkpoints" / "step_2";
  EXPECT_TRUE(fs::exists(step / "model.safetensors")) << "one rank keeps the single-file layout";
  EXPECT_TRUE(fs::exists(step / "optim.safetensors"));
}

}  // namespace
}  // namespace moe::testing
