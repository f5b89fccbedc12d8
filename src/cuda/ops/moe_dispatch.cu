// Dispatch-map launchers and checked entry point (contract in cuda/ops/moe_routing.h): three
// launches (tile histograms, one-block scan, stable scatter) whose grids depend only on T*k.
// Tiles hold kMapThreads * chunks_per_warp routes; chunks grow with R so there are <= 256
// tiles (the scan holds 8 tiles per lane), which also bounds the workspace to E * 256 int32.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "cuda/common.h"
#include "cuda/kernels/moe_dispatch.cuh"
#include "cuda/ops/launch.h"
#include "cuda/ops/moe_routing.h"

namespace moe::cuda {
namespace {

using kernels::kMapThreads;
using kernels::kMaxMapTiles;

struct MapTiling {
  int64_t chunks_per_warp = 1;  // 32-route chunks each warp walks in order
  int64_t routes_per_tile = kMapThreads;
  int64_t num_tiles = 0;
};

MapTiling map_tiling(int64_t routes) {
  MapTiling m;
  const int64_t max_routes_per_chunk_round = kMaxMapTiles * kMapThreads;
  m.chunks_per_warp =
      std::max<int64_t>(1, (routes + max_routes_per_chunk_round - 1) / max_routes_per_chunk_round);
  m.routes_per_tile = kMapThreads * m.chunks_per_warp;
  m.num_tiles = (routes + m.routes_per_tile - 1) / m.routes_per_tile;
  return m;
}

void check_map_params(int64_t num_tokens, int64_t top_k, int64_t num_experts, const char* op) {
  MOE_CHECK(num_tokens >= 0, op, ": num_tokens must be >= 0, got ", num_tokens);
  MOE_CHECK(num_experts >= 1 && num_experts <= kMaxRouterExperts, op,
            ": num_experts must be in [1, ", kMaxRouterExperts, "], got ", num_experts);
  MOE_CHECK(top_k >= 1 && top_k <= num_experts, op, ": top_k must be in [1, num_experts=",
            num_experts, "], got top_k=", top_k);
  MOE_CHECK(num_tokens * top_k <= INT32_MAX, op, ": T*k = ", num_tokens * top_k,
            " routes do not fit int32 row indices");
}

}  // namespace

size_t dispatch_map_workspace_bytes(int64_t num_tokens, int64_t top_k, int64_t num_experts) {
  check_map_params(num_tokens, top_k, num_experts, "cuda::dispatch_map_workspace_bytes");
  return static_cast<size_t>(num_experts * map_tiling(num_tokens * top_k).num_tiles) *
         sizeof(int32_t);
}

void build_dispatch_map(const int32_t* topk_idx, int64_t num_tokens, int64_t top_k,
                        int64_t num_experts, int64_t capacity, int32_t* num_tokens_per_expert,
                        int32_t* expert_offsets, int32_t* sorted_route, int32_t* route_to_row,
                        int32_t* num_dropped, void* workspace, size_t workspace_bytes,
                        Stream stream) {
  constexpr const char* kOp = "cuda::build_dispatch_map";
  check_map_params(num_tokens, top_k, num_experts, kOp);
  const size_t need = dispatch_map_workspace_bytes(num_tokens, top_k, num_experts);
  MOE_CHECK(workspace_bytes >= need, kOp, ": workspace of ", workspace_bytes,
            " bytes is too small, need ", need, " (dispatch_map_workspace_bytes(", num_tokens, ", ",
            top_k, ", ", num_experts, "))");
  detail::check_ptrs(
      kOp, {{"num_tokens_per_expert", num_tokens_per_expert}, {"expert_offsets", expert_offsets}},
      4);
  const int64_t routes = num_tokens * top_k;
  const MapTiling m = map_tiling(routes);
  const int num_exp = static_cast<int>(num_experts);
  const int tiles = static_cast<int>(m.num_tiles);
  auto* tile_counts = static_cast<int32_t*>(workspace);
  if (routes > 0) {
    detail::check_ptrs(kOp,
                       {{"topk_idx", topk_idx}, {"sorted_route", sorted_route},
                        {"route_to_row", route_to_row}, {"workspace", workspace}},
                       4);
    kernels::dispatch_count_per_tile<<<tiles, kMapThreads, 0, stream>>>(
        topk_idx, routes, num_exp, m.routes_per_tile, tiles, tile_counts);
    check_launch("dispatch_count_per_tile");
  }
  kernels::dispatch_scan_tiles<<<1, kernels::kScanThreads, 0, stream>>>(
      tile_counts, num_exp, tiles, routes, capacity, num_tokens_per_expert, expert_offsets,
      num_dropped);
  check_launch("dispatch_scan_tiles");
  if (routes > 0) {
    kernels::dispatch_scatter_stable<<<tiles, kMapThreads, 0, stream>>>(
        topk_idx, routes, num_exp, m.chunks_per_warp, m.routes_per_tile, tiles, tile_counts,
        expert_offsets, capacity, sorted_route, route_to_row);
    check_launch("dispatch_scatter_stable");
  }
}

}  // namespace moe::cuda
