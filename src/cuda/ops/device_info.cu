// device_info / device_used_bytes on the CUDA runtime (no kernels).
#include "cuda/ops/device_info.h"

#include "cuda/common.h"

namespace moe::cuda {

DeviceInfo device_info() {
  DeviceInfo info;
  MOE_CUDA_CHECK(cudaGetDevice(&info.device));
  cudaDeviceProp prop{};
  MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, info.device));
  info.name = prop.name;
  info.cc_major = prop.major;
  info.cc_minor = prop.minor;
  info.sm_count = prop.multiProcessorCount;
  MOE_CUDA_CHECK(cudaMemGetInfo(&info.free_bytes, &info.total_bytes));
  char bus_id[32] = {};
  MOE_CUDA_CHECK(cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, info.device));
  info.pci_bus_id = bus_id;
  return info;
}

size_t device_used_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  MOE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return total_bytes - free_bytes;
}

}  // namespace moe::cuda
