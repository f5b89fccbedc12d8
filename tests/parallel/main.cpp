// Entry point of the multi-process suite, run by CTest as `mpirun -np N test_parallel` (and as
// one plain process). Every rank runs every test; rank 0 prints the usual report, the others
// only their failures prefixed with their rank; the exit status is the worst over the ranks.
// `test_parallel --timeout-probe` instead lets rank 1 skip a collective (Launch tests use it).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "core/error.h"
#include "parallel/comm.h"
#include "parallel/mpi_test_util.h"

namespace {

// Rank 1 never joins the all-reduce: rank 0 must fail with the timeout error and abort the job.
int timeout_probe() {
  moe::Comm& world = moe::world_comm();
  try {
    if (world.rank() == 1) {
      ::sleep(60);
      return 0;
    }
    float x = 1;
    world.all_reduce(&x, 1, moe::ReduceOp::kSum);
    std::fprintf(stderr, "[rank %d] the all-reduce completed without rank 1\n", world.rank());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] error: %s\n", world.rank(), e.what());
    world.abort(1);
  }
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--timeout-probe") == 0) return timeout_probe();
  ::testing::InitGoogleTest(&argc, argv);
  moe::Comm& world = moe::world_comm();
  moe::testing::print_only_root_report(world);
  return moe::testing::worst_status_over_ranks(world, RUN_ALL_TESTS());
}
