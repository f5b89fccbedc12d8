// Communicator over plain TCP sockets for torchrun-style launches (RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT; no MPI). Rank 0 runs the rendezvous on MASTER_ADDR:MASTER_PORT, then every pair of
// ranks holds one socket (full mesh). Sums are reduced in rank order (rank 0 + rank 1 + ...) by
// the rank that owns each chunk, so every rank ends with the same bits. Meant for small worlds
// (up to a few dozen ranks) and host collectives at socket speed.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "parallel/comm.h"

namespace moe {

// Joins the job of `world_size` ranks as `rank` (blocking until every rank has joined or
// timeout_s passes) and returns its world communicator, backend() "tcp". Rank 0 listens on
// master_port (all interfaces); the others reach it at master_addr:master_port, retrying until
// the deadline since rank 0 may start later.
std::unique_ptr<Comm> make_tcp_world(int rank, int world_size, const std::string& master_addr, int master_port,
                                     double timeout_s);

// What a torchrun-style environment says: RANK, WORLD_SIZE, MASTER_ADDR (default 127.0.0.1),
// MASTER_PORT (required). The rendezvous port is MOECORE_MASTER_PORT when set, else MASTER_PORT,
// or MASTER_PORT + 1 under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True: the agent
// itself listens on MASTER_PORT). Throws naming the variable when one is missing or malformed.
struct TcpLaunchEnv {
  int rank = 0;
  int world_size = 1;
  std::string master_addr;
  int master_port = 0;  // the rendezvous port (see above)
};
TcpLaunchEnv tcp_launch_env(const std::function<const char*(const char*)>& getenv_fn);

}  // namespace moe
