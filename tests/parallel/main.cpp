// Entry point of the multi-process suite, run by CTest as `mpirun -np N test_parallel` (and as
// one plain process). Every rank runs every test; rank 0 prints the usual report, the others
// only their failures prefixed with their rank; the exit status is the worst over the ranks.
// `test_parallel --timeout-probe` instead lets rank 1 skip a collective (Launch tests use it);
// `test_parallel --tcp-launch N PROGRAM ARGS...` starts N ranks of PROGRAM torchrun-style (CTest's
// tcp entries); `test_parallel --tcp-probe MODE` is one rank of a failing TCP job (TcpLaunch tests).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "parallel/comm.h"
#include "parallel/mpi_test_util.h"
#include "parallel/tcp_launch.h"

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

// Ranks of a TCP job that goes wrong on purpose; each prints "[rank r] error after T s: ..." and
// exits 1 when its collective fails. mismatch: rank 1 calls all_reduce while the others call
// broadcast; exit: rank 1 leaves after a barrier; recv-exit: rank 1 leaves while rank 0 waits
// in recv for it; sleep: rank 1 sleeps 4 s instead of joining;
// sum: a job that works (an all-reduce checked on every rank).
int tcp_probe(const std::string& mode) {
  moe::Comm& world = moe::world_comm();
  const int r = world.rank();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    world.barrier();
    int64_t words[16] = {};
    if (mode == "mismatch") {
      if (r == 1) {
        world.all_reduce(words, 16, moe::ReduceOp::kSum);
      } else {
        world.broadcast(words, 16, 0);
      }
    } else if (mode == "sum") {
      double x = 0.5 * (r + 1);
      world.all_reduce(&x, 1, moe::ReduceOp::kSum);
      const double want = 0.25 * world.size() * (world.size() + 1);
      if (x != want) {
        std::fprintf(stderr, "[rank %d] sum %g, expected %g\n", r, x, want);
        return 1;
      }
    } else if (mode == "exit") {
      if (r == 1) {
        std::fprintf(stderr, "[rank 1] exiting on purpose\n");
        std::fflush(stderr);
        std::_Exit(3);
      }
      world.all_reduce(words, 16, moe::ReduceOp::kSum);
    } else if (mode == "recv-exit") {
      // Pairs {0, 1} and {2, 3}: rank 1 sends once and exits; rank 0 takes that message, then
      // its next recv must name rank 1. Ranks 2 and 3 exchange and finish.
      std::unique_ptr<moe::Comm> pair = world.split(r / 2, r);
      float x[3] = {1, 2, 3};
      if (r == 1) {
        pair->send(x, 3, 0, 1);
        pair->flush_sends();
        std::fprintf(stderr, "[rank 1] exiting on purpose\n");
        std::fflush(stderr);
        std::_Exit(3);
      }
      if (r == 0) {
        pair->recv(x, 3, 1, 1);
        pair->recv(x, 3, 1, 2);
      } else if (r == 2) {
        pair->send(x, 3, 1, 1);
        pair->flush_sends();
      } else if (r == 3) {
        pair->recv(x, 3, 0, 1);
      }
    } else if (mode == "sleep") {
      if (r == 1) {
        ::sleep(4);
        return 0;
      }
      world.all_reduce(words, 16, moe::ReduceOp::kSum);
    } else {
      std::fprintf(stderr, "unknown --tcp-probe mode '%s'\n", mode.c_str());
      return 2;
    }
    std::fprintf(stderr, "[rank %d] the collective completed\n", r);
    return 0;
  } catch (const std::exception& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "[rank %d] error after %.2f s: %s\n", r, s, e.what());
    return 1;
  }
}

// Starts argv[0..] as N torchrun-style ranks sharing this process's stdout and stderr; the
// worst exit status wins. Ranks still running after 850 s are killed (CTest's limit is 900 s).
int tcp_launch(int np, char** argv) {
  std::vector<std::string> args;
  for (char** a = argv; *a != nullptr; ++a) args.emplace_back(*a);
  if (np < 1 || args.empty()) {
    std::fprintf(stderr, "usage: test_parallel --tcp-launch N PROGRAM [ARGS...]\n");
    return 2;
  }
  const moe::testing::TcpJob job = moe::testing::launch_tcp_job(np, args, {}, 850);
  for (size_t k = 0; k < job.ranks.size(); ++k)
    if (job.ranks[k].status != 0) std::fprintf(stderr, "tcp launch: rank %zu exited with status %d\n", k, job.ranks[k].status);
  return job.worst();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--timeout-probe") == 0) return timeout_probe();
  if (argc > 2 && std::strcmp(argv[1], "--tcp-probe") == 0) return tcp_probe(argv[2]);
  if (argc > 3 && std::strcmp(argv[1], "--tcp-launch") == 0) return tcp_launch(std::atoi(argv[2]), argv + 3);
  ::testing::InitGoogleTest(&argc, argv);
  moe::Comm& world = moe::world_comm();
  moe::testing::print_only_root_report(world);
  return moe::testing::worst_status_over_ranks(world, RUN_ALL_TESTS());
}
