// Error formatting for MOE_CUDA_CHECK / MOE_CUBLAS_CHECK / check_launch and the device count.
// Messages read "CUDA error <name> (<description>) from <call>", then a hint for the errors a
// user can act on, then [file:line] as every moe::Error does.
#include "cuda/common.h"

#include <string>

namespace moe::cuda {
namespace {

const char* hint_for(cudaError_t err) {
  switch (err) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return "; no usable GPU or driver: check nvidia-smi and CUDA_VISIBLE_DEVICES";
    case cudaErrorMemoryAllocation:
      return "; out of device memory: lower micro_batch or seq_len, or turn on recompute";
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
      return "; this build holds sm_90a code only: run it on a Hopper GPU (H100/H200)";
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorMisalignedAddress:
      return "; a kernel faulted and the context is unusable: rerun under compute-sanitizer to find it";
    default:
      return "";
  }
}

}  // namespace

namespace detail {

void throw_cuda_error(const char* file, int line, const char* call, cudaError_t err) {
  ::moe::detail::throw_error(file, line, nullptr,
                             ::moe::detail::concat("CUDA error ", cudaGetErrorName(err), " (",
                                                   cudaGetErrorString(err), ") from ", call,
                                                   hint_for(err)));
}

void throw_cublas_error(const char* file, int line, const char* call, cublasStatus_t st) {
  ::moe::detail::throw_error(file, line, nullptr,
                             ::moe::detail::concat("cuBLAS error ", cublasLtGetStatusName(st),
                                                   " (", cublasLtGetStatusString(st), ") from ",
                                                   call));
}

}  // namespace detail

void check_launch(const char* kernel, std::source_location where) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) [[unlikely]] {
    const std::string call = std::string("launch of ") + kernel;
    detail::throw_cuda_error(where.file_name(), static_cast<int>(where.line()), call.c_str(), err);
  }
}

int cuda_device_count() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the (non-sticky) error so later calls start clean
    return 0;
  }
  return count;
}

}  // namespace moe::cuda
