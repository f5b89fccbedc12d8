// Process-group splits of the TCP communicator (Comm::split, MPI_Comm_split semantics). Every
// member of the parent group all-gathers (color, key, parent rank); the members of one color are
// ordered by (key, parent rank), and the child's group id hashes the parent's id, the split's
// round and the color: equal on every member, different for every color and every split, so the
// frames of sibling and nested groups never mix on the shared mesh.
#pragma once

#include <cstdint>
#include <vector>

namespace moe::tcp {

// World ranks of the members of `color`: color_key_rank holds (color, key, rank) per parent group
// rank, parent_members the world rank of each parent group rank.
std::vector<int> split_members(const std::vector<int64_t>& color_key_rank, int color,
                               const std::vector<int>& parent_members);
// The id of the group of `color` split from group `parent` in its round `round`.
uint64_t split_group_id(uint64_t parent, uint64_t round, int color);

}  // namespace moe::tcp
