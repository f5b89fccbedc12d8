// Which backend a run trains on: the CUDA device check and the resolution of train.device and
// train.precision into "cpu" or "cuda". Available in every build (a CPU-only build has no GPU).
#pragma once

#include <string>

#include "core/config.h"

namespace moe {

// True when this build has the CUDA backend and a GPU is visible.
bool gpu_available();
// The current GPU's name (cudaDeviceProp::name), "" when gpu_available() is false.
std::string visible_gpu_name();
// The current GPU's PCI bus id ("0000:1B:00.0"), "" when gpu_available() is false.
std::string visible_gpu_pci_bus_id();
// "cpu" or "cuda" for train.device and train.precision ("auto": cuda when a GPU is available
// and precision is bf16 or fp8, else cpu for fp32 or fp8 (the FP8 recipe emulated on FP32)).
// Throws naming the keys when the combination cannot run.
std::string resolve_device(const TrainConfig& t);

}  // namespace moe
