// Members and ids of the groups split from a TCP group (parallel/tcp/split.h).
#include "parallel/tcp/split.h"

#include <algorithm>
#include <utility>

#include "parallel/tcp/frame.h"

namespace moe::tcp {

std::vector<int> split_members(const std::vector<int64_t>& color_key_rank, int color,
                               const std::vector<int>& parent_members) {
  const std::vector<int64_t>& all = color_key_rank;
  std::vector<std::pair<int64_t, int>> order;  // (key, parent rank) of this color
  for (int p = 0; p < int(parent_members.size()); ++p)
    if (all[size_t(p) * 3] == color) order.emplace_back(all[size_t(p) * 3 + 1], p);
  std::sort(order.begin(), order.end());
  std::vector<int> members;
  for (const auto& [k, p] : order) members.push_back(parent_members[size_t(p)]);
  return members;
}

uint64_t split_group_id(uint64_t parent, uint64_t round, int color) {
  return mix64(parent ^ mix64(round + 1) ^ mix64(0x51ull + uint64_t(color)));
}

}  // namespace moe::tcp
