// Asynchronous copies global -> shared (cp.async, sm_80 instructions, run on sm_90a): 16 and 4 bytes,
// zero fill past the data, commit and wait by group. Each asm statement clobbers memory, so that no
// shared-memory access moves across it.
#pragma once

#include <cstdint>

namespace moe::cuda::kernels {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; when !valid nothing is read and the 16 shared bytes
// become zero (`gmem` must still be a valid address: callers pass the tensor's base).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(smem)), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
}

// 4 bytes global -> shared, asynchronously, zero when !valid (same rule as cp_async_16).
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(smem)), "l"(gmem),
               "r"(valid ? 4 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most `N` of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace moe::cuda::kernels
