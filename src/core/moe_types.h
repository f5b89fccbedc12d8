// Plain MoE types that the CPU ops, the CUDA ops, the expert exchange and the models share:
// router score function and routing mode (resolved from the config strings once, at model
// construction: moe_router_choice), and the slice of experts a rank holds.
#pragma once

#include <cstdint>
#include <string>

// MOE_HOST_DEVICE: small inline functions shared by the CPU code and the CUDA kernels
// (__host__ __device__ under nvcc), defined here for every plain-type header (fp8_types.h too).
#ifndef MOE_HOST_DEVICE
#if defined(__CUDACC__)
#define MOE_HOST_DEVICE __host__ __device__
#else
#define MOE_HOST_DEVICE
#endif
#endif

namespace moe {

enum class ScoreFunc { kSoftmax, kSigmoid };
enum class RoutingMode { kLearned, kRandom, kUniform };

// moe.router ("softmax" | "sigmoid") and moe.routing ("learned" | "random" | "uniform") as
// enums; throws naming the key and the accepted values for anything else.
ScoreFunc parse_score_func(const std::string& router);
RoutingMode parse_routing_mode(const std::string& routing);

// Routing seed of MoE layer `layer` from a forward's routing seed (splitmix64 finaliser); the
// CPU model, the GPU model and the GPU router (from a seed in device memory, inside a CUDA graph)
// use it, so random routing draws the same experts on both.
MOE_HOST_DEVICE inline uint64_t layer_routing_seed(uint64_t seed, uint64_t layer) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (layer + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The experts a rank holds: global experts [first, first + count) of every MoE layer.
// count == 0 means all of them (no expert parallelism).
struct ExpertSlice {
  int64_t first = 0;
  int64_t count = 0;
};

}  // namespace moe
