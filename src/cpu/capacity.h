// Per-expert capacity on a dispatch map (capacity_factor > 0): expert e keeps its first
// `capacity` rows in sorted order (stable, so the lowest token indices) and drops the tail.
// capacity = ceil(capacity_factor * T * k / E). Kept rows stay expert-contiguous; a dropped
// route gets route_to_row = -1 and contributes nothing to the combine.
#pragma once

#include <cstdint>

namespace moe::cpu {

int64_t expert_capacity(double capacity_factor, int64_t num_tokens, int64_t top_k, int64_t num_experts);

// Rewrites offsets [E+1], sorted_route [T*k] (kept rows first, compacted) and route_to_row in
// place; `num_rows_per_expert` [E] receives the kept counts. Returns the number of dropped routes.
int64_t apply_capacity(int64_t capacity, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                       int32_t* expert_offsets, int32_t* sorted_route, int32_t* route_to_row,
                       int32_t* num_rows_per_expert);

}  // namespace moe::cpu
