// The current CUDA device as the benchmarks report it: name, compute capability, SM count and
// memory (cudaGetDeviceProperties, cudaMemGetInfo). "Used" memory is total - free: every
// allocation on the device, this process's CUDA context included (and other processes' memory).
// No CUDA headers.
#pragma once

#include <cstddef>
#include <string>

namespace moe::cuda {

struct DeviceInfo {
  int device = 0;        // ordinal of the current device
  std::string name;      // e.g. "NVIDIA H200"
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  size_t total_bytes = 0;  // device memory
  size_t free_bytes = 0;   // free at the time of the call
};

// The current device; throws (moe::Error naming the CUDA error) when there is none.
DeviceInfo device_info();

// total - free device memory now (cudaMemGetInfo).
size_t device_used_bytes();

// The current device's PCI bus id, e.g. "0000:1B:00.0" (cudaDeviceGetPCIBusId: how NVML finds the
// device); "" when the runtime cannot say (never throws).
std::string device_pci_bus_id();

}  // namespace moe::cuda
