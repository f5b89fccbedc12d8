// `moecore bench` on one GPU: CudaStepRunner steps (CUDA graph when the config allows it) on
// synthetic tokens, parameters initialised on the device (no host copy). Step time = wall clock
// from the first timed submit to the last collect, / steps; TFLOP/s = count_model flops/token x
// tokens/s; MFU against kGpuPeakTflops; phases from one extra eager step timed with CUDA events.
#pragma once

#include <cstdint>
#include <iosfwd>

#include <nlohmann/json.hpp>

#include "core/config.h"
#include "train/bench.h"

namespace moe {

// Dense BF16 tensor-core peak of an H100/H200 SXM (TFLOP/s), the MFU denominator.
constexpr double kGpuPeakTflops = 989.0;

// Device memory a one-GPU run needs, before anything is allocated: parameter state at 18 bytes
// per parameter (FP32 master 4, BF16 copy 2, FP32 gradient 4, two FP32 AdamW moments 8), plus
// activation_elements (model/layout.h) of one micro-batch at 2 bytes (BF16), the figure the dry
// run prints. An estimate: the chunked LM head saves less, step buffers and the CUDA context add some.
struct GpuMemoryEstimate {
  int64_t total_params = 0;
  int64_t micro_batch_tokens = 0;
  double state_bytes = 0;
  double activation_bytes = 0;
  double total_bytes() const { return state_bytes + activation_bytes; }
};
GpuMemoryEstimate estimate_gpu_memory(const Config& cfg);

// Runs the benchmark on the current GPU and returns its JSON record (printed as a table to
// `out`, written as write_bench_record says with device "gpu"). Refuses, before allocating, a
// config whose estimate exceeds the free device memory. Builds without CUDA: throws.
nlohmann::json run_gpu_bench(const Config& cfg, const BenchOptions& opt, std::ostream& out);

}  // namespace moe
