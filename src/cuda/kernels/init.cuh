// Parameter initialisation kernels: Philox4x32-10 and the truncated normal of core/rng.h on the
// device. Element i of a tensor takes counter {lo32(i), hi32(i), attempt, 0} under the tensor's
// key; Box-Muller in FP64 on the block's words (same expression order as the host), resampled
// with attempt + 1 while |z| > 3, then rounded to FP32 as float(z * std). One thread per element
// (grid-stride); no shared memory.
#pragma once

#include <cstdint>

namespace moe::cuda::kernels {

constexpr int kInitThreads = 256;
constexpr uint32_t kPhiloxMul0 = 0xD2511F53u, kPhiloxMul1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxWeyl0 = 0x9E3779B9u, kPhiloxWeyl1 = 0xBB67AE85u;
constexpr uint32_t kKindNormal = 0;        // counter word 3 of the normal draws (rng.h)
constexpr double kTruncBound = 3.0;        // truncation at +-3 std, as fill_trunc_normal
constexpr double kTwoPi = 2.0 * 3.141592653589793;  // the host's 2.0 * std::numbers::pi (exact doubling)

// Philox4x32-10 of counter c under key (k0, k1): 10 rounds, the key bumped by the Weyl constants
// between rounds; a round maps c to {hi(c2*M1) ^ c1 ^ k0, lo(c2*M1), hi(c0*M0) ^ c3 ^ k1, lo(c0*M0)}.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kPhiloxWeyl0;
      k1 += kPhiloxWeyl1;
    }
    const uint32_t hi0 = __umulhi(kPhiloxMul0, c.x), lo0 = kPhiloxMul0 * c.x;
    const uint32_t hi1 = __umulhi(kPhiloxMul1, c.z), lo1 = kPhiloxMul1 * c.z;
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
  }
  return c;
}

// (k + 0.5) * 2^-52 for the top 52 bits k of hi:lo: an exact double in (0, 1).
__device__ __forceinline__ double open_unit(uint32_t hi, uint32_t lo) {
  const uint64_t k = ((static_cast<uint64_t>(hi) << 32) | lo) >> 12;
  return (static_cast<double>(k) + 0.5) * 0x1p-52;
}

// The truncated standard normal of element `index` (first attempt inside +-3).
__device__ __forceinline__ double trunc_standard_normal(uint32_t k0, uint32_t k1, uint64_t index) {
  for (uint32_t attempt = 0;; ++attempt) {
    const uint4 w = philox4x32_10(
        make_uint4(static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32), attempt, kKindNormal), k0, k1);
    const double u1 = open_unit(w.x, w.y);
    const double u2 = open_unit(w.z, w.w);
    const double r = sqrt(-2.0 * log(u1));
    const double z = __dmul_rn(r, cos(kTwoPi * u2));  // no contraction: the host multiplies once
    if (fabs(z) <= kTruncBound) return z;
  }
}

// out[i] = float(trunc_standard_normal(first_index + i) * std), i < n.
__global__ void __launch_bounds__(kInitThreads)
    fill_trunc_normal_kernel(float* __restrict__ out, int64_t n, uint64_t first_index, uint32_t k0, uint32_t k1,
                             double std) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const double z = trunc_standard_normal(k0, k1, first_index + static_cast<uint64_t>(i));
    out[i] = __double2float_rn(__dmul_rn(z, std));
  }
}

// out[i] = value, i < n.
__global__ void __launch_bounds__(kInitThreads) fill_value_kernel(float* __restrict__ out, int64_t n, float value) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = value;
  }
}

}  // namespace moe::cuda::kernels
