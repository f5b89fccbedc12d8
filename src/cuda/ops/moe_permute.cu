// Permute / unpermute launchers and checked entry points (contract in cuda/ops/moe_routing.h).
// The 16-byte path runs when d % 8 == 0 and every BF16 row buffer is 16-byte aligned (then each
// row is too); otherwise the 2-byte path. One kernel instantiation per pack width.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>

#include "cuda/common.h"
#include "cuda/kernels/moe_permute.cuh"
#include "cuda/ops/launch.h"
#include "cuda/ops/moe_routing.h"

namespace moe::cuda {
namespace {

using kernels::kPermuteThreads;
using kernels::kVecBf16;
using kernels::RowShape;

unsigned blocks_for(int64_t work_items, int64_t items_per_block) {
  return static_cast<unsigned>(std::clamp<int64_t>(
      (work_items + items_per_block - 1) / items_per_block, 1, detail::kMaxGridX));
}

RowShape check_rows(int64_t num_tokens, int64_t top_k, int64_t d, const char* op) {
  MOE_CHECK(num_tokens >= 0, op, ": num_tokens must be >= 0, got ", num_tokens);
  MOE_CHECK(top_k >= 1, op, ": top_k must be >= 1, got ", top_k);
  MOE_CHECK(d >= 1, op, ": d must be >= 1, got ", d);
  MOE_CHECK(num_tokens * top_k <= INT32_MAX, op, ": T*k = ", num_tokens * top_k,
            " rows do not fit int32 row indices");
  return {num_tokens, top_k, num_tokens * top_k, d, d};
}

// Calls launch.template operator()<kVec>(shape) with the widest usable pack.
template <typename Launch>
void with_pack_width(RowShape s, std::initializer_list<const void*> row_buffers, Launch&& launch) {
  bool wide = s.d % kVecBf16 == 0;
  for (const void* p : row_buffers) wide = wide && detail::aligned16(p);
  if (wide) {
    s.packs_per_row = s.d / kVecBf16;
    launch.template operator()<kVecBf16>(s);
  } else {
    s.packs_per_row = s.d;
    launch.template operator()<1>(s);
  }
}

// The scatter's grid: its blocks over the token rows' packs (items_per_block a block), then the blocks
// that look for rows without a route (32 rows a warp).
struct ScatterGrid {
  unsigned scatter_blocks, blocks;
};
ScatterGrid scatter_grid(const RowShape& s, int64_t items, int64_t items_per_block) {
  const unsigned scatter = blocks_for(items, items_per_block);
  const unsigned zero = blocks_for((s.routes + 31) / 32, kPermuteThreads / 32);
  return {scatter, scatter + zero};
}

}  // namespace

void permute_forward(const uint16_t* x, const int32_t* sorted_route, const int32_t* route_to_row,
                     int64_t num_tokens, int64_t top_k, int64_t d, uint16_t* x_sorted, Stream stream) {
  constexpr const char* kOp = "cuda::permute_forward";
  const RowShape s = check_rows(num_tokens, top_k, d, kOp);
  if (s.routes == 0) return;
  detail::check_ptrs(kOp, {{"x", x}, {"x_sorted", x_sorted}}, 2);
  detail::check_ptrs(kOp, {{"sorted_route", sorted_route}, {"route_to_row", route_to_row}}, 4);
  with_pack_width(s, {x, x_sorted}, [&]<int kVec>(RowShape sv) {
    const ScatterGrid g = scatter_grid(sv, sv.num_tokens * sv.packs_per_row, kPermuteThreads);
    kernels::permute_scatter_rows<kVec><<<g.blocks, kPermuteThreads, 0, stream>>>(
        x, sorted_route, route_to_row, sv, g.scatter_blocks, x_sorted);
  });
  check_launch("permute_scatter_rows");
}

void permute_backward(const uint16_t* dx_sorted, const int32_t* route_to_row, int64_t num_tokens,
                      int64_t top_k, int64_t d, uint16_t* dx, Stream stream) {
  constexpr const char* kOp = "cuda::permute_backward";
  const RowShape s = check_rows(num_tokens, top_k, d, kOp);
  if (s.routes == 0) return;
  detail::check_ptrs(kOp, {{"dx_sorted", dx_sorted}, {"dx", dx}}, 2);
  detail::check_ptrs(kOp, {{"route_to_row", route_to_row}}, 4);
  with_pack_width(s, {dx_sorted, dx}, [&]<int kVec>(RowShape sv) {
    kernels::permute_backward_gather<kVec>
        <<<blocks_for(sv.num_tokens * sv.packs_per_row, kPermuteThreads), kPermuteThreads, 0,
           stream>>>(dx_sorted, route_to_row, sv, dx);
  });
  check_launch("permute_backward_gather");
}

void unpermute_forward(const uint16_t* y_sorted, const int32_t* route_to_row, const float* topk_w,
                       int64_t num_tokens, int64_t top_k, int64_t d, uint16_t* out,
                       Stream stream) {
  constexpr const char* kOp = "cuda::unpermute_forward";
  const RowShape s = check_rows(num_tokens, top_k, d, kOp);
  if (s.routes == 0) return;
  detail::check_ptrs(kOp, {{"y_sorted", y_sorted}, {"out", out}}, 2);
  detail::check_ptrs(kOp, {{"route_to_row", route_to_row}, {"topk_w", topk_w}}, 4);
  with_pack_width(s, {y_sorted, out}, [&]<int kVec>(RowShape sv) {
    kernels::unpermute_combine<kVec>
        <<<blocks_for(sv.num_tokens * sv.packs_per_row, kPermuteThreads), kPermuteThreads, 0,
           stream>>>(y_sorted, route_to_row, topk_w, sv, out);
  });
  check_launch("unpermute_combine");
}

void unpermute_forward_add(const uint16_t* y_sorted, const int32_t* route_to_row, const float* topk_w,
                           int64_t num_tokens, int64_t top_k, int64_t d, float* acc, uint16_t* acc_bf16,
                           Stream stream) {
  constexpr const char* kOp = "cuda::unpermute_forward_add";
  const RowShape s = check_rows(num_tokens, top_k, d, kOp);
  if (s.routes == 0) return;
  detail::check_ptrs(kOp, {{"y_sorted", y_sorted}}, 2);
  if (acc_bf16 != nullptr) detail::check_ptrs(kOp, {{"acc_bf16", acc_bf16}}, 2);
  detail::check_ptrs(kOp, {{"route_to_row", route_to_row}, {"topk_w", topk_w}, {"acc", acc}}, 4);
  // The FP32 rows of acc are 16-byte aligned wherever its BF16 view's would be (d % 8 == 0).
  with_pack_width(s, {y_sorted, acc, acc_bf16}, [&]<int kVec>(RowShape sv) {
    kernels::unpermute_combine_add<kVec>
        <<<blocks_for(sv.num_tokens * sv.packs_per_row, kPermuteThreads), kPermuteThreads, 0,
           stream>>>(y_sorted, route_to_row, topk_w, sv, acc, acc_bf16);
  });
  check_launch("unpermute_combine_add");
}

void unpermute_backward(const uint16_t* dout, const uint16_t* y_sorted,
                        const int32_t* sorted_route, const int32_t* route_to_row,
                        const float* topk_w, int64_t num_tokens, int64_t top_k, int64_t d,
                        uint16_t* dy_sorted, float* dtopk_w, Stream stream) {
  constexpr const char* kOp = "cuda::unpermute_backward";
  const RowShape s = check_rows(num_tokens, top_k, d, kOp);
  if (s.routes == 0) return;
  detail::check_ptrs(kOp, {{"dout", dout}, {"y_sorted", y_sorted}, {"dy_sorted", dy_sorted}}, 2);
  detail::check_ptrs(kOp,
                     {{"sorted_route", sorted_route}, {"route_to_row", route_to_row},
                      {"topk_w", topk_w}, {"dtopk_w", dtopk_w}},
                     4);
  with_pack_width(s, {dout, y_sorted, dy_sorted}, [&]<int kVec>(RowShape sv) {
    kernels::unpermute_backward_warp_per_route<kVec>
        <<<blocks_for(sv.routes, kPermuteThreads / 32), kPermuteThreads, 0, stream>>>(
            dout, y_sorted, sorted_route, route_to_row, topk_w, sv, dy_sorted, dtopk_w);
  });
  check_launch("unpermute_backward_warp_per_route");
}

namespace {

// The FP8 producers' shapes: whole 1 x 128 blocks, 16-byte rows, 8-byte code rows.
RowShape check_rows_fp8(int64_t num_tokens, int64_t top_k, int64_t d, const char* op) {
  RowShape s = check_rows(num_tokens, top_k, d, op);
  MOE_CHECK(d % 128 == 0, op, ": d must be a multiple of 128 (whole 1 x 128 FP8 blocks), got ", d);
  s.packs_per_row = d / kVecBf16;
  return s;
}

}  // namespace

void permute_forward_fp8(const uint16_t* x, const int32_t* sorted_route, const int32_t* route_to_row,
                         int64_t num_tokens, int64_t top_k, int64_t d, uint16_t* x_sorted, uint8_t* q, float* scales,
                         Stream stream, Fp8Rule rule) {
  constexpr const char* kOp = "cuda::permute_forward_fp8";
  const RowShape s = check_rows_fp8(num_tokens, top_k, d, kOp);
  if (s.routes == 0) return;
  detail::check_ptrs(kOp, {{"x", x}, {"x_sorted", x_sorted}}, 16);
  detail::check_ptrs(kOp, {{"q", q}}, 8);
  detail::check_ptrs(kOp, {{"sorted_route", sorted_route}, {"route_to_row", route_to_row}, {"scales", scales}}, 4);
  const ScatterGrid g = scatter_grid(s, s.num_tokens * (d / 128), kernels::kPermuteFp8BlocksPerCta);
  const auto kernel =
      rule == Fp8Rule::kBlocks ? kernels::permute_scatter_rows_fp8<false> : kernels::permute_scatter_rows_fp8<true>;
  kernel<<<g.blocks, kPermuteThreads, 0, stream>>>(x, sorted_route, route_to_row, s, g.scatter_blocks, x_sorted, q,
                                                   scales, rule);
  check_launch("permute_scatter_rows_fp8");
}

void unpermute_backward_fp8(const uint16_t* dout, const uint16_t* y_sorted, const int32_t* sorted_route,
                            const int32_t* route_to_row, const float* topk_w, int64_t num_tokens, int64_t top_k,
                            int64_t d, uint16_t* dy_sorted, float* dtopk_w, uint8_t* q, float* scales,
                            Stream stream, Fp8Rule rule) {
  constexpr const char* kOp = "cuda::unpermute_backward_fp8";
  const RowShape s = check_rows_fp8(num_tokens, top_k, d, kOp);
  if (s.routes == 0) return;
  detail::check_ptrs(kOp, {{"dout", dout}, {"y_sorted", y_sorted}, {"dy_sorted", dy_sorted}}, 16);
  detail::check_ptrs(kOp, {{"q", q}}, 8);
  detail::check_ptrs(kOp,
                     {{"sorted_route", sorted_route}, {"route_to_row", route_to_row}, {"topk_w", topk_w},
                      {"dtopk_w", dtopk_w}, {"scales", scales}},
                     4);
  const auto kernel = rule == Fp8Rule::kBlocks ? kernels::unpermute_backward_warp_per_route<kVecBf16, true, false>
                                               : kernels::unpermute_backward_warp_per_route<kVecBf16, true, true>;
  kernel<<<blocks_for(s.routes, kPermuteThreads / 32), kPermuteThreads, 0, stream>>>(
      dout, y_sorted, sorted_route, route_to_row, topk_w, s, dy_sorted, dtopk_w, q, scales, rule);
  check_launch("unpermute_backward_warp_per_route (fp8)");
}

}  // namespace moe::cuda
