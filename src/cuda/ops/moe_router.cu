// Router launchers and checked entry points (contract in cuda/ops/moe_routing.h). Forward is
// two launches (warp-per-token router, one-block loss finish); backward is one. Kernel choice
// by experts per lane (1, 2, 4 or 8); no launch depends on a device value.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common.h"
#include "cuda/kernels/moe_router.cuh"
#include "cuda/ops/launch.h"
#include "cuda/ops/moe_routing.h"

namespace moe::cuda {
namespace {

using kernels::kRouterThreads;
using kernels::kRouterWarps;

constexpr int64_t kRouterMaxBlocks = 1024;

int64_t router_blocks(int64_t num_tokens) {
  return std::min<int64_t>((num_tokens + kRouterWarps - 1) / kRouterWarps, kRouterMaxBlocks);
}

void check_router_params(const RouterParams& p, const char* fn) {
  MOE_CHECK(p.num_tokens >= 0, fn, ": num_tokens must be >= 0, got ", p.num_tokens);
  MOE_CHECK(p.num_experts >= 1 && p.num_experts <= kMaxRouterExperts, fn,
            ": num_experts must be in [1, ", kMaxRouterExperts, "] (one warp per token), got ",
            p.num_experts);
  MOE_CHECK(p.top_k >= 1 && p.top_k <= std::min(p.num_experts, kMaxRouterTopK), fn,
            ": top_k must be in [1, min(num_experts=", p.num_experts, ", ", kMaxRouterTopK,
            ")], got top_k=", p.top_k);
}

// Experts per lane, rounded up to a power of two: 1, 2, 4 or 8.
template <typename Launch>
void with_experts_per_lane(int64_t num_experts, Launch&& launch) {
  if (num_experts <= 32)
    launch.template operator()<1>();
  else if (num_experts <= 64)
    launch.template operator()<2>();
  else if (num_experts <= 128)
    launch.template operator()<4>();
  else
    launch.template operator()<8>();
}

}  // namespace

size_t router_workspace_bytes(const RouterParams& p) {
  check_router_params(p, "cuda::router_workspace_bytes");
  return static_cast<size_t>(router_blocks(p.num_tokens) * (2 * p.num_experts + 1)) * sizeof(float);
}

void router_forward(const RouterParams& p, const float* logits, const float* expert_bias,
                    float* scores, int32_t* topk_idx, float* topk_w,
                    int32_t* num_tokens_per_expert, float* score_sum, float* losses,
                    void* workspace, size_t workspace_bytes, Stream stream) {
  constexpr const char* kOp = "cuda::router_forward";
  check_router_params(p, kOp);
  detail::check_ptrs(kOp, {{"num_tokens_per_expert", num_tokens_per_expert}, {"losses", losses}}, 4);
  const int64_t blocks = router_blocks(p.num_tokens);
  const size_t need = router_workspace_bytes(p);
  MOE_CHECK(workspace_bytes >= need, kOp, ": workspace of ", workspace_bytes,
            " bytes is too small, need ", need, " (router_workspace_bytes with num_tokens=",
            p.num_tokens, ", num_experts=", p.num_experts, ")");
  auto* score_partial = static_cast<float*>(workspace);
  auto* count_partial = reinterpret_cast<int32_t*>(score_partial + blocks * (p.num_experts + 1));
  if (p.num_tokens > 0) {
    detail::check_ptrs(kOp,
                       {{"logits", logits}, {"scores", scores}, {"topk_idx", topk_idx},
                        {"topk_w", topk_w}, {"workspace", workspace}},
                       4);
    const kernels::ForwardArgs a{logits,        expert_bias,
                                 scores,        topk_idx,
                                 topk_w,        score_partial,
                                 count_partial, p.num_tokens,
                                 static_cast<int>(p.num_experts), static_cast<int>(p.top_k),
                                 p.score == ScoreFunc::kSoftmax,  p.norm_topk,
                                 p.mode,        p.seed,
                                 p.seed_device, p.seed_layer};
    with_experts_per_lane(p.num_experts, [&]<int kPerLane>() {
      kernels::router_forward_warp_per_token<kPerLane>
          <<<static_cast<unsigned>(blocks), kRouterThreads, 0, stream>>>(a);
    });
    check_launch("router_forward_warp_per_token");
  }
  kernels::router_finish_losses<<<1, kernels::kFinishThreads, 0, stream>>>(
      score_partial, count_partial, static_cast<int>(blocks), p.num_tokens,
      static_cast<int>(p.num_experts), static_cast<int>(p.top_k), num_tokens_per_expert, score_sum,
      losses);
  check_launch("router_finish_losses");
}

void router_backward(const RouterParams& p, const float* logits, const float* scores,
                     const int32_t* topk_idx, const int32_t* num_tokens_per_expert,
                     const float* dtopk_w, const float* dlb, const float* dz, float* dlogits,
                     Stream stream) {
  constexpr const char* kOp = "cuda::router_backward";
  check_router_params(p, kOp);
  if (p.num_tokens == 0) return;
  detail::check_ptrs(kOp,
                     {{"logits", logits}, {"scores", scores}, {"topk_idx", topk_idx},
                      {"num_tokens_per_expert", num_tokens_per_expert}, {"dtopk_w", dtopk_w},
                      {"dlogits", dlogits}},
                     4);
  const kernels::BackwardArgs a{logits,  scores,      topk_idx,
                                num_tokens_per_expert, dtopk_w, dlb, dz, dlogits,
                                p.num_tokens, static_cast<int>(p.num_experts),
                                static_cast<int>(p.top_k), p.score == ScoreFunc::kSoftmax,
                                p.norm_topk};
  with_experts_per_lane(p.num_experts, [&]<int kPerLane>() {
    kernels::router_backward_warp_per_token<kPerLane>
        <<<static_cast<unsigned>(router_blocks(p.num_tokens)), kRouterThreads, 0, stream>>>(a);
  });
  check_launch("router_backward_warp_per_token");
}

}  // namespace moe::cuda
