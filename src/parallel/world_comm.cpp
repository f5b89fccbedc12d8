// The job's communicator (world_comm, comm.h), made once per process on first use and chosen by
// the launcher that started it (detect_launcher): the MPI world, the TCP world of a torchrun-style
// launch (comm_tcp.h) or the one-rank communicator. Its timeout_s() starts at
// MOECORE_COMM_TIMEOUT_S when that is set, else kDefaultCommTimeoutS.
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "core/error.h"
#include "parallel/comm.h"
#include "parallel/comm_mpi.h"
#include "parallel/comm_self.h"
#include "parallel/comm_tcp.h"

namespace moe {
namespace {

double env_timeout() {
  const char* v = std::getenv("MOECORE_COMM_TIMEOUT_S");
  if (!v || !*v) return kDefaultCommTimeoutS;
  char* end = nullptr;
  const double t = std::strtod(v, &end);
  MOE_CHECK(end && *end == '\0' && t > 0, "MOECORE_COMM_TIMEOUT_S must be a positive number of seconds, got '", v,
            "'");
  return t;
}

std::unique_ptr<Comm> make_world() {
  const std::string launcher = detect_launcher([](const char* n) -> const char* { return std::getenv(n); });
  const double timeout = env_timeout();
  if (launcher == "torchrun") {
    const TcpLaunchEnv env = tcp_launch_env([](const char* n) -> const char* { return std::getenv(n); });
    return make_tcp_world(env.rank, env.world_size, env.master_addr, env.master_port, timeout);
  }
  if (launcher == "none") return make_self_comm(timeout);
  return make_mpi_world(timeout);
}

std::mutex g_world_mutex;
std::unique_ptr<Comm> g_world;

}  // namespace

void Comm::send(const float*, int64_t, int dst, int) {
  MOE_FAIL("point-to-point send to rank ", dst, " on rank ", rank(), ": the ", backend(), " communicator has no ",
           "send/recv; pipeline parallelism (parallel.pp > 1) needs an MPI (mpirun) or torchrun-style (TCP) launch");
}

void Comm::recv(float*, int64_t, int src, int) {
  MOE_FAIL("point-to-point recv from rank ", src, " on rank ", rank(), ": the ", backend(), " communicator has no ",
           "send/recv; pipeline parallelism (parallel.pp > 1) needs an MPI (mpirun) or torchrun-style (TCP) launch");
}

Comm& world_comm() {
  std::lock_guard<std::mutex> lock(g_world_mutex);
  if (!g_world) g_world = make_world();
  return *g_world;
}

bool world_comm_started() {
  std::lock_guard<std::mutex> lock(g_world_mutex);
  return g_world != nullptr;
}

}  // namespace moe
