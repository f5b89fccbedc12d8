// The rendezvous of a TCP job (comm_tcp.h): rank 0 listens on the master port, takes one hello
// (rank, WORLD_SIZE, address and port of its peer listener) from every other rank, checks them and
// answers with the table of every rank's listener and a random job id, or with the problem. Rank r
// > 0 then connects to every lower rank and accepts every higher one (a handshake naming rank and
// job), so the mesh holds one socket per pair; the rank-0 connection is the mesh socket to rank 0.
#pragma once

#include <string>

#include "parallel/tcp/mesh.h"
#include "parallel/tcp/socket.h"

namespace moe::tcp {

// Rank 0: fills mesh.peers[r].fd for every r > 0. Throws naming the missing ranks, the port or
// the mismatch (and tells the other ranks) when the job does not assemble before the deadline.
void rendezvous_root(Mesh& mesh, int master_port, double timeout_s, Clock::time_point deadline);
// Rank mesh.rank > 0: joins at master_addr:master_port and fills mesh.peers[r].fd for every r.
void rendezvous_rank(Mesh& mesh, const std::string& master_addr, int master_port, double timeout_s,
                     Clock::time_point deadline);

}  // namespace moe::tcp
