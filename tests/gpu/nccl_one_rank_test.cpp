// The data-parallel machinery on one GPU (part of test_gpu; the two-GPU tests are nccl_test.cpp):
// the local-rank rule of the launcher variables; a one-rank NCCL communicator whose all-reduce is
// the identity, so that CudaStepRunner with it (gradient buckets, statistics all-reduce, NCCL calls
// captured in the step's CUDA graph) reproduces the runner without one bitwise, and so does ZeRO-1
// over it (forced on) against the replicated optimizer, FP32 and BF16 reduction; NcclComm::wait
// failing after its deadline and aborting the communicator; ep > 1 refused without an ep group.
#include <chrono>
#include <cstdlib>
#include <map>
#include <thread>

#include "cuda/event_timer.h"
#include "cuda/ops/memory.h"
#include "cuda/ops/nccl.h"
#include "gpu/dp_test_util.h"
#include "gpu/gpu_test_util.h"
#include "parallel/nccl_comm.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

TEST(LocalRank, LauncherVariablesInOrder) {
  std::map<std::string, std::string> env;
  auto getenv_fn = [&](const char* n) -> const char* {
    const auto it = env.find(n);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  std::string name;
  EXPECT_EQ(local_rank_from_env(getenv_fn, &name), -1);
  env["LOCAL_RANK"] = "3";
  EXPECT_EQ(local_rank_from_env(getenv_fn, &name), 3);
  EXPECT_EQ(name, "LOCAL_RANK");
  env["SLURM_LOCALID"] = "2";
  EXPECT_EQ(local_rank_from_env(getenv_fn, &name), 2);
  EXPECT_EQ(name, "SLURM_LOCALID");
  env["MPI_LOCALRANKID"] = "5";
  EXPECT_EQ(local_rank_from_env(getenv_fn, &name), 5);
  env["OMPI_COMM_WORLD_LOCAL_RANK"] = "1";
  EXPECT_EQ(local_rank_from_env(getenv_fn, &name), 1);
  EXPECT_EQ(name, "OMPI_COMM_WORLD_LOCAL_RANK");
  env["OMPI_COMM_WORLD_LOCAL_RANK"] = "";  // empty: the next variable
  EXPECT_EQ(local_rank_from_env(getenv_fn, &name), 5);
  env["MPI_LOCALRANKID"] = "x1";
  const std::string msg = error_of([&] { local_rank_from_env(getenv_fn); });
  EXPECT_NE(msg.find("MPI_LOCALRANKID"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'x1'"), std::string::npos) << msg;
  env["MPI_LOCALRANKID"] = "-1";
  EXPECT_NE(error_of([&] { local_rank_from_env(getenv_fn); }).find("non-negative"), std::string::npos);
}

TEST(LocalRank, OneProcessIsLocalRankZeroOfItsHost) {
  if (local_rank_from_env([](const char* n) -> const char* { return std::getenv(n); }) > 0)
    GTEST_SKIP() << "a launcher variable names a local rank above 0 for this process";
  auto self = make_self_comm();
  const LocalRank lr = local_rank(*self);
  EXPECT_EQ(lr.size, 1);
  EXPECT_FALSE(lr.host.empty());
  // A launcher variable may name the rank; without one the hostname split gives 0.
  if (lr.source == "hostname split") {
    EXPECT_EQ(lr.rank, 0);
  }
}

TEST(EventTimer, GradReducePhaseName) {
  EXPECT_STREQ(cuda::phase_name(cuda::Phase::kGradReduce), "grad_reduce");
  EXPECT_LT(int(cuda::Phase::kGradReduce), int(cuda::Phase::kOptimizer));
}

std::unique_ptr<cuda::NcclComm> one_rank_comm(double timeout_s = 120) {
  return std::make_unique<cuda::NcclComm>(cuda::nccl_make_id(), 1, 0, timeout_s);
}

TEST(NcclOneRank, AllReduceIsIdentityAndCommunicatorDescribesItself) {
  MOE_SKIP_WITHOUT_GPU();
  auto comm = one_rank_comm();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->device(), cuda::current_device());
  EXPECT_FALSE(cuda::nccl_version().empty());
  const std::vector<float> host = random_f32(4097, 5);
  GuardedBuffer<float> buf(host);
  TestStream stream;
  cuda::Event done = cuda::event_create();
  comm->all_reduce_sum(buf.data(), buf.size(), cuda::NcclDType::kF32, stream.get());
  cuda::event_record(done, stream.get());
  comm->wait(done, "one-rank all-reduce");
  EXPECT_TRUE(same_bits(buf.download(), host));
  buf.expect_guards_intact("one-rank all-reduce");
  cuda::event_destroy(done);
  EXPECT_NE(error_of([&] { comm->all_reduce_sum(buf.data(), -1, cuda::NcclDType::kF32, stream.get()); })
                .find(">= 0"),
            std::string::npos);
}

// The step with a one-rank communicator runs every data-parallel call (gradient buckets, on the
// second stream during backward with overlap or after it without, the statistics all-reduce in a
// group, all captured in the graph from step 2) and must change nothing.
TEST(NcclOneRank, StepWithCommunicatorMatchesStepWithoutBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  const Config c = dp_step_config();
  auto comm = one_rank_comm();
  for (const bool graph : {true, false}) {
    for (const bool overlap : {true, false}) {
      Config cc = c;
      cc.parallel.overlap_grad_reduce = overlap;
      const std::string what = std::string(graph ? "graph on" : "graph off") + (overlap ? ", overlap" : ", no overlap");
      CudaStepRunner plain(c), with_comm(cc, comm.get());
      EXPECT_EQ(with_comm.dp_size(), 1);
      const DpRun a = dp_run(c, plain, graph, 4), b = dp_run(cc, with_comm, graph, 4);
      expect_same_steps(a, b, what);
      EXPECT_TRUE(same_bits(a.bias_after_step1, b.bias_after_step1)) << what;
      EXPECT_EQ(b.graph_launches, graph ? 3 : 0) << what;
    }
  }
}

// ZeRO-1 over a one-rank group (plan.zero forced on): the sharded path (reduce-scatter bucket by
// bucket, the norm from the owned pieces and an FP64 all-reduce, AdamW on the shard's segments
// with compact moments, the FP32 all-gather and the BF16 refresh) must reproduce the replicated
// step bitwise: parameters, moments (downloaded whole), losses and every statistic, graph on
// (captured from step 2) and off, overlap on and off. With BF16 reduction both round the same
// gradients alike (still bitwise), and the loss stays within BF16 tolerance of FP32's.
TEST(NcclOneRank, ZeroStepMatchesReplicatedStepBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  const Config c = dp_step_config();
  auto comm = one_rank_comm();
  std::map<std::string, DpRun> fp32_runs;
  for (const std::string dtype : {"fp32", "bf16"}) {
    for (const bool graph : {true, false}) {
      for (const bool overlap : {true, false}) {
        Config cc = c;
        cc.parallel.overlap_grad_reduce = overlap;
        cc.parallel.grad_reduce_dtype = dtype;
        const std::string what = dtype + (graph ? ", graph on" : ", graph off") + (overlap ? ", overlap" : ", no overlap");
        const RunPlan plan = make_run_plan(cc, 1, "cuda");
        ASSERT_FALSE(plan.zero);  // nothing to shard over one rank unless forced
        RunPlan sharded_plan = plan;
        sharded_plan.zero = true;
        DpRun a, b;
        {
          CudaStepRunner replicated(cc, plan, comm.get(), nullptr, nullptr);
          EXPECT_FALSE(replicated.zero());
          a = dp_run(cc, replicated, graph, 4);
        }
        {
          CudaStepRunner sharded(cc, sharded_plan, comm.get(), nullptr, nullptr);
          EXPECT_TRUE(sharded.zero());
          b = dp_run(cc, sharded, graph, 4);
        }
        expect_same_steps(a, b, what + ": ZeRO-1 vs replicated");
        EXPECT_TRUE(same_bits(a.bias_after_step1, b.bias_after_step1)) << what;
        EXPECT_EQ(b.graph_launches, graph ? 3 : 0) << what;
        const std::string key = std::string(graph ? "g" : "e") + (overlap ? "o" : "n");
        if (dtype == "fp32") {
          fp32_runs[key] = b;
        } else {
          const DpRun& f = fp32_runs[key];
          ASSERT_EQ(f.steps.size(), b.steps.size()) << what;
          for (size_t i = 0; i < b.steps.size(); ++i)
            EXPECT_NEAR(dp_loss(b.steps[i]), dp_loss(f.steps[i]), 2e-2 * dp_loss(f.steps[i])) << what << ", step " << i + 1;
          EXPECT_EQ(dp_loss(b.steps[0]), dp_loss(f.steps[0])) << what << ": step 1's forward precedes any reduction";
          EXPECT_FALSE(same_bits(b.params, f.params)) << what << ": BF16 reduction changed nothing";
        }
      }
    }
  }
}

// BF16 moments (optim.moment_dtype = "bf16") under ZeRO-1 over a one-rank group: the shard's compact
// BF16 moments (2-byte elements at the buckets' state offsets), their BF16 all-gather on download,
// and the loaded state's rounding give the replicated BF16-moment step bitwise, graph on and off;
// and the run is not the FP32 moments' run.
TEST(NcclOneRank, ZeroStepWithBf16MomentsMatchesReplicatedBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  Config c = dp_step_config();
  c.optim.moment_dtype = "bf16";
  auto comm = one_rank_comm();
  for (const bool graph : {true, false}) {
    const std::string what = std::string("bf16 moments, ") + (graph ? "graph on" : "graph off");
    const RunPlan plan = make_run_plan(c, 1, "cuda");
    RunPlan sharded_plan = plan;
    sharded_plan.zero = true;
    DpRun a, b, f;
    {
      CudaStepRunner replicated(c, plan, comm.get(), nullptr, nullptr);
      a = dp_run(c, replicated, graph, 4);
    }
    {
      CudaStepRunner sharded(c, sharded_plan, comm.get(), nullptr, nullptr);
      EXPECT_TRUE(sharded.zero());
      b = dp_run(c, sharded, graph, 4);
    }
    expect_same_steps(a, b, what + ": ZeRO-1 vs replicated");
    Config c32 = c;
    c32.optim.moment_dtype = "fp32";
    {
      CudaStepRunner fp32(c32, make_run_plan(c32, 1, "cuda"), comm.get(), nullptr, nullptr);
      f = dp_run(c32, fp32, graph, 4);
    }
    EXPECT_FALSE(same_bits(a.params, f.params)) << what << ": optim.moment_dtype changed nothing";
  }
}

TEST(NcclOneRank, ZeroNeedsTheDataParallelGroup) {
  MOE_SKIP_WITHOUT_GPU();
  const Config c = dp_step_config();
  RunPlan plan = make_run_plan(c, 1, "cuda");
  plan.zero = true;
  const std::string msg = error_of([&] { CudaStepRunner runner(c, plan, nullptr, nullptr, nullptr); });
  EXPECT_NE(msg.find("ZeRO-1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("no data-parallel NCCL group"), std::string::npos) << msg;
}

TEST(NcclOneRank, WaitFailsAfterItsDeadlineAndAbortsTheCommunicator) {
  MOE_SKIP_WITHOUT_GPU();
  auto comm = one_rank_comm(/*timeout_s=*/0.3);
  TestStream stream;
  // A host function holds the stream for 2 s: the event recorded after it is late.
  MOE_CUDA_CHECK(cudaLaunchHostFunc(
      stream.get(), [](void*) { std::this_thread::sleep_for(std::chrono::seconds(2)); }, nullptr));
  cuda::Event late = cuda::event_create();
  cuda::event_record(late, stream.get());
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg = error_of([&] { comm->wait(late, "the late step"); });
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(msg.find("the late step"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did not complete within"), std::string::npos) << msg;
  EXPECT_NE(msg.find("parallel.timeout_s"), std::string::npos) << msg;
  // The wait gives up at its deadline (0.3 s) and aborts the communicator; the abort frees NCCL's
  // device memory, which waits for the work in flight on the GPU (here the host function's 2 s, in a
  // real hang NCCL kernels that the abort ends). An error at all proves the wait did not see the event.
  EXPECT_GE(waited, 0.3);
  EXPECT_LT(waited, 2.0 + 1.5);
  EXPECT_TRUE(comm->aborted());
  EXPECT_NE(error_of([&] { comm->all_reduce_sum(nullptr, 1, cuda::NcclDType::kF32, stream.get()); }).find("aborted"),
            std::string::npos);
  stream.sync();
  cuda::event_destroy(late);
}

TEST(NcclOneRank, StepRunnerRefusesExpertParallelismWithoutItsGroup) {
  MOE_SKIP_WITHOUT_GPU();
  Config c = dp_step_config();
  c.parallel.ep = 2;
  const std::string msg = error_of([&] { CudaStepRunner runner(c); });
  EXPECT_NE(msg.find("parallel.ep = 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expert-parallel NCCL group has 1 rank"), std::string::npos) << msg;
}

}  // namespace
}  // namespace moe::testing
