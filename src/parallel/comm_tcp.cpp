// The TCP communicator's world (comm_tcp.h) from a torchrun-style environment: RANK, WORLD_SIZE,
// MASTER_ADDR and the rendezvous port read and checked, then the rendezvous builds the full mesh
// (parallel/tcp/rendezvous.h) and the world communicator runs over it. The parts live in
// parallel/tcp/: sockets, frames, the mesh, the rendezvous, the collectives and the group splits.
#include "parallel/comm_tcp.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "parallel/tcp/group_comm.h"
#include "parallel/tcp/mesh.h"
#include "parallel/tcp/rendezvous.h"
#include "parallel/tcp/socket.h"

namespace moe {
namespace {

int parse_int_env(const std::function<const char*(const char*)>& getenv_fn, const char* name, long lo, long hi,
                  const char* what) {
  const char* v = getenv_fn(name);
  MOE_CHECK(v != nullptr && *v != '\0', name, " is not set: a torchrun-style launch (RANK, WORLD_SIZE > 1) needs ",
            name, " (", what, ")");
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  MOE_CHECK(errno == 0 && end != v && *end == '\0' && x >= lo && x <= hi, name, " must be ", what, " (an integer in [",
            lo, ", ", hi, "]), got '", v, "'");
  return int(x);
}

}  // namespace

TcpLaunchEnv tcp_launch_env(const std::function<const char*(const char*)>& getenv_fn) {
  TcpLaunchEnv e;
  e.world_size = parse_int_env(getenv_fn, "WORLD_SIZE", 1, 1 << 20, "the number of ranks");
  e.rank = parse_int_env(getenv_fn, "RANK", 0, e.world_size - 1, "this process's rank, below WORLD_SIZE");
  const char* addr = getenv_fn("MASTER_ADDR");
  e.master_addr = addr && *addr ? addr : "127.0.0.1";
  e.master_port = parse_int_env(getenv_fn, "MASTER_PORT", 1, 65535,
                                "a port number, where rank 0 listens for the rendezvous");
  const char* own = getenv_fn("MOECORE_MASTER_PORT");
  const char* agent = getenv_fn("TORCHELASTIC_USE_AGENT_STORE");
  if (own != nullptr && *own != '\0') {
    e.master_port = parse_int_env(getenv_fn, "MOECORE_MASTER_PORT", 1, 65535,
                                  "a port number, where rank 0 listens for the rendezvous");
  } else if (agent != nullptr && std::strcmp(agent, "True") == 0) {
    // torchrun's agent serves its own TCPStore on MASTER_PORT: take the next port.
    MOE_CHECK(e.master_port < 65535, "MASTER_PORT = 65535 under torchrun (TORCHELASTIC_USE_AGENT_STORE=True): ",
              "the rendezvous would use MASTER_PORT + 1; set MOECORE_MASTER_PORT to a free port");
    e.master_port += 1;
  }
  return e;
}

std::unique_ptr<Comm> make_tcp_world(int rank, int world_size, const std::string& master_addr, int master_port,
                                     double timeout_s) {
  MOE_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "tcp world: rank ", rank,
            " is not in [0, WORLD_SIZE = ", world_size, ")");
  MOE_CHECK(master_port >= 1 && master_port <= 65535, "tcp world: MASTER_PORT must be in [1, 65535], got ",
            master_port);
  MOE_CHECK(timeout_s > 0, "tcp world: the timeout must be > 0 s, got ", timeout_s);
  auto mesh = std::make_shared<tcp::Mesh>();
  mesh->rank = rank;
  mesh->size = world_size;
  mesh->peers.resize(size_t(world_size));
  const auto deadline = tcp::deadline_after(timeout_s);
  if (world_size > 1) {
    if (rank == 0) {
      tcp::rendezvous_root(*mesh, master_port, timeout_s, deadline);
    } else {
      tcp::rendezvous_rank(*mesh, master_addr, master_port, timeout_s, deadline);
    }
  }
  std::vector<int> members(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) members[size_t(r)] = r;
  return tcp::make_group_comm(mesh, tcp::kWorldGroup, std::move(members), timeout_s);
}

}  // namespace moe
