// Error checks for the CUDA backend: MOE_CUDA_CHECK / MOE_CUBLAS_CHECK throw moe::Error with
// file:line, the call, the status name and its description; check_launch() after every kernel
// launch surfaces launch errors (bad configuration, missing sm_90a image) at the launch site.
// Included by .cu files and by host code that calls the CUDA runtime (tests); not by model code.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <source_location>

#include "core/error.h"
#include "cuda/device.h"

namespace moe::cuda::detail {
[[noreturn]] void throw_cuda_error(const char* file, int line, const char* call, cudaError_t err);
[[noreturn]] void throw_cublas_error(const char* file, int line, const char* call, cublasStatus_t st);
}  // namespace moe::cuda::detail

#define MOE_CUDA_CHECK(expr)                                                     \
  do {                                                                           \
    const cudaError_t moe_cuda_err_ = (expr);                                    \
    if (moe_cuda_err_ != cudaSuccess) [[unlikely]] {                             \
      ::moe::cuda::detail::throw_cuda_error(__FILE__, __LINE__, #expr, moe_cuda_err_); \
    }                                                                            \
  } while (0)

#define MOE_CUBLAS_CHECK(expr)                                                     \
  do {                                                                             \
    const cublasStatus_t moe_cublas_st_ = (expr);                                  \
    if (moe_cublas_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]] {                    \
      ::moe::cuda::detail::throw_cublas_error(__FILE__, __LINE__, #expr, moe_cublas_st_); \
    }                                                                              \
  } while (0)

namespace moe::cuda {

// Call right after a kernel launch: throws, naming `kernel` and the launch site, when the
// launch failed (cudaGetLastError). Asynchronous faults inside the kernel surface at the next
// synchronising call's MOE_CUDA_CHECK instead. Never synchronises, so it is legal during
// stream capture.
void check_launch(const char* kernel, std::source_location where = std::source_location::current());

// Raises `kernel`'s dynamic shared-memory limit to `bytes` (launches above 48 KiB need it). A
// host-only attribute call: legal during stream capture.
template <typename Kernel>
void set_dynamic_smem_limit(Kernel kernel, size_t bytes) {
  MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

}  // namespace moe::cuda
