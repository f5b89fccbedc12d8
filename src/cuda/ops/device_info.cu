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
  return info;
}

size_t device_used_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  MOE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return total_bytes - free_bytes;
}

std::string device_pci_bus_id() {
  int device = 0;
  char bus_id[32] = {};
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, device) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it so later calls start clean
    return "";
  }
  return bus_id;
}

}  // namespace moe::cuda
