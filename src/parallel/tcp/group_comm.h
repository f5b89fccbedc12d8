// The TCP communicator of one group (the world or a split) over the shared mesh
// (parallel/tcp/mesh.h): `members` holds the world rank of each group rank, `group` the id its
// frames carry. make_tcp_world (comm_tcp.h) makes the world's; Comm::split makes the others.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "parallel/comm.h"
#include "parallel/tcp/mesh.h"

namespace moe::tcp {

std::unique_ptr<Comm> make_group_comm(std::shared_ptr<Mesh> mesh, uint64_t group, std::vector<int> members,
                                      double timeout_s);

}  // namespace moe::tcp
