// main() of the test programs that need two ranks on two GPUs (mpirun -np 2 PROGRAM): the skip
// reason when the job cannot run them, GPU binding by local rank, the NCCL groups made once, one
// report from rank 0 and the worst exit status over the ranks.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <exception>
#include <functional>
#include <string>

#include "cuda/common.h"
#include "parallel/comm.h"
#include "parallel/mpi_test_util.h"
#include "parallel/nccl_comm.h"

namespace moe::testing {

// Every rank runs every test; rank 0 prints the report, the others only their failures. With 2
// ranks and 2 visible GPUs each rank binds its GPU and calls `setup` (which makes the program's
// NCCL groups; an error there aborts the job); otherwise *skip_reason says why and the tests skip.
// `teardown` runs after the tests on every rank.
inline int run_two_gpu_tests(int argc, char** argv, const char* program, std::string* skip_reason,
                             const std::function<void(Comm&)>& setup, const std::function<void()>& teardown) {
  ::testing::InitGoogleTest(&argc, argv);
  Comm& world = world_comm();
  print_only_root_report(world);
  const int gpus = cuda::cuda_device_count();
  if (world.size() != 2) {
    *skip_reason = std::string("needs exactly 2 ranks (mpirun -np 2 ") + program + "); this job has " +
                   std::to_string(world.size());
  } else if (gpus < 2) {
    *skip_reason = "needs 2 visible GPUs, found " + std::to_string(gpus);
  } else {
    try {
      bind_local_gpu(world);
      setup(world);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[rank %d] error: %s\n", world.rank(), e.what());
      world.abort(1);
    }
  }
  const int status = RUN_ALL_TESTS();
  teardown();
  return worst_status_over_ranks(world, status);
}

}  // namespace moe::testing
