// Capacity dropping on the CPU dispatch map (see capacity.h).
#include "cpu/capacity.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"

namespace moe::cpu {

int64_t expert_capacity(double capacity_factor, int64_t num_tokens, int64_t top_k, int64_t num_experts) {
  MOE_CHECK(capacity_factor >= 1.0, "moe.capacity_factor must be 0 (dropless) or >= 1, got ", capacity_factor);
  return static_cast<int64_t>(std::ceil(capacity_factor * double(num_tokens * top_k) / double(num_experts)));
}

int64_t apply_capacity(int64_t capacity, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                       int32_t* expert_offsets, int32_t* sorted_route, int32_t* route_to_row,
                       int32_t* num_rows_per_expert) {
  const int64_t routes = num_tokens * top_k;
  std::vector<int32_t> kept;
  kept.reserve(routes);
  std::vector<int32_t> new_offsets(num_experts + 1, 0);
  for (int64_t r = 0; r < routes; ++r) route_to_row[r] = -1;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t begin = expert_offsets[e], end = expert_offsets[e + 1];
    const int64_t keep = std::min<int64_t>(end - begin, capacity);
    for (int64_t i = begin; i < begin + keep; ++i) {
      route_to_row[sorted_route[i]] = static_cast<int32_t>(kept.size());
      kept.push_back(sorted_route[i]);
    }
    num_rows_per_expert[e] = static_cast<int32_t>(keep);
    new_offsets[e + 1] = static_cast<int32_t>(kept.size());
  }
  std::copy(new_offsets.begin(), new_offsets.end(), expert_offsets);
  std::copy(kept.begin(), kept.end(), sorted_route);
  for (int64_t r = static_cast<int64_t>(kept.size()); r < routes; ++r) sorted_route[r] = -1;
  return routes - static_cast<int64_t>(kept.size());
}

}  // namespace moe::cpu
