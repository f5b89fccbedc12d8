// The routing seed of one micro-batch of one step, shared by the CPU and GPU training paths so
// that random routing draws the same experts on both: a mix of the run seed, the 0-based step
// (-1 for evaluation) and the micro-batch index (splitmix-style finaliser).
#pragma once

#include <cstdint>

namespace moe {

inline uint64_t routing_seed(uint64_t seed, int64_t step, int64_t micro) {
  uint64_t z = seed ^ (0x9E3779B97F4A7C15ull * uint64_t(step + 1)) ^ (0xC2B2AE3D27D4EB4Full * uint64_t(micro + 1));
  z = (z ^ (z >> 33)) * 0xFF51AFD7ED558CCDull;
  return z ^ (z >> 33);
}

}  // namespace moe
