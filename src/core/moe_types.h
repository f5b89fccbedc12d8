// Plain MoE types that the CPU ops, the CUDA ops, the expert exchange and the models share:
// router score function and routing mode (resolved from the config strings once, at model
// construction: moe_router_choice), and the slice of experts a rank holds.
#pragma once

#include <cstdint>
#include <string>

namespace moe {

enum class ScoreFunc { kSoftmax, kSigmoid };
enum class RoutingMode { kLearned, kRandom, kUniform };

// moe.router ("softmax" | "sigmoid") and moe.routing ("learned" | "random" | "uniform") as
// enums; throws naming the key and the accepted values for anything else.
ScoreFunc parse_score_func(const std::string& router);
RoutingMode parse_routing_mode(const std::string& routing);

// The experts a rank holds: global experts [first, first + count) of every MoE layer.
// count == 0 means all of them (no expert parallelism).
struct ExpertSlice {
  int64_t first = 0;
  int64_t count = 0;
};

}  // namespace moe
