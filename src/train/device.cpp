// Device resolution for the trainer: gpu_available() asks the CUDA backend (when built) for a
// device count; resolve_device() turns train.device/train.precision into the backend to use.
#include "train/device.h"

#include "core/error.h"

#ifdef MOECORE_HAS_CUDA
#include "cuda/device.h"
#include "cuda/ops/device_info.h"
#endif

namespace moe {

bool gpu_available() {
#ifdef MOECORE_HAS_CUDA
  return cuda::cuda_device_count() > 0;
#else
  return false;
#endif
}

std::string visible_gpu_name() {
#ifdef MOECORE_HAS_CUDA
  if (gpu_available()) return cuda::device_info().name;
#endif
  return "";
}

std::string visible_gpu_pci_bus_id() {
#ifdef MOECORE_HAS_CUDA
  if (gpu_available()) return cuda::device_pci_bus_id();
#endif
  return "";
}

std::string resolve_device(const TrainConfig& t) {
  if (t.device == "cpu") {
    MOE_CHECK(t.precision == "fp32" || t.precision == "fp8", "train.precision = \"", t.precision,
              "\" is not available on the cpu backend (train.device = \"cpu\"): use \"fp32\" (or \"fp8\", the "
              "FP8 recipe emulated on FP32)");
    return "cpu";
  }
  if (t.device == "auto") {
    if (gpu_available() && (t.precision == "bf16" || t.precision == "fp8")) return "cuda";
    MOE_CHECK(t.precision == "fp32" || t.precision == "fp8", "train.precision = \"", t.precision,
              "\" needs a GPU, and train.device = \"auto\" found none (",
              gpu_available() ? "" : "no CUDA device in this build or machine",
              "): set --train.precision=fp32 to train on the cpu backend");
    return "cpu";
  }
  MOE_CHECK(t.device == "cuda", "train.device: expected auto, cpu or cuda, got \"", t.device, "\"");
#ifndef MOECORE_HAS_CUDA
  MOE_FAIL("train.device = \"cuda\" needs a build with the CUDA backend (cmake --preset cuda)");
#else
  MOE_CHECK(gpu_available(), "train.device = \"cuda\" but no CUDA device is visible");
  MOE_CHECK(t.precision == "bf16" || t.precision == "fp8", "train.precision = \"", t.precision,
            "\" is not available on cuda: use \"bf16\" or \"fp8\" (fp32 runs on train.device = \"cpu\")");
  return "cuda";
#endif
}

}  // namespace moe
