// `moecore bench` on GPUs: CudaStepRunner steps (CUDA graph when the config allows it) on
// synthetic tokens, parameters initialised on the device (no host copy). Step time = wall clock
// from the first timed submit to the last collect, / steps (the slowest rank's); TFLOP/s =
// count_model flops/token x tokens/s; MFU against kGpuPeakTflops; phases from one extra eager
// step timed with CUDA events. Under `mpirun -np N`: data parallel over N GPUs (NCCL), each GPU
// running the one-GPU step's micro-batches (global batch x N); figures per GPU.
#pragma once

#include <cstdint>
#include <iosfwd>

#include <nlohmann/json.hpp>

#include "core/config.h"
#include "train/bench.h"

namespace moe {

class Comm;

// Dense BF16 tensor-core peak of an H100/H200 SXM (TFLOP/s), the MFU denominator.
constexpr double kGpuPeakTflops = 989.0;

// Device memory a one-GPU run needs, before anything is allocated: parameter state at 18 bytes
// per parameter (FP32 master 4, BF16 copy 2, FP32 gradient 4, two FP32 AdamW moments 8), plus
// activation_elements (model/layout.h) of one micro-batch at 2 bytes (BF16), the figure the dry
// run prints. With parallel.ep > 1 (dividing the experts): the state of one GPU's share (its experts
// only) and the expert-parallel exchange buffers. An estimate: the chunked LM head saves less, step
// buffers and the CUDA context add some.
struct GpuMemoryEstimate {
  int64_t total_params = 0;
  int64_t micro_batch_tokens = 0;
  double state_bytes = 0;
  double activation_bytes = 0;
  double total_bytes() const { return state_bytes + activation_bytes; }
};
GpuMemoryEstimate estimate_gpu_memory(const Config& cfg);

// Runs the benchmark and returns its JSON record (printed as a table to `out`, written as
// write_bench_record says with device "gpu"). world == nullptr or one rank: the current GPU.
// Several ranks (collective): each rank binds its GPU by local rank, the group is data parallel
// over NCCL with train.global_batch x world size sequences per step (parallel.dp must be 0 or the
// world size; parallel.ep may split the experts over ep groups of GPUs); rank 0 prints and writes, other ranks print nothing. Refuses, before
// allocating, a config whose estimate exceeds the free device memory. Builds without CUDA: throws.
nlohmann::json run_gpu_bench(const Config& cfg, const BenchOptions& opt, std::ostream& out, Comm* world = nullptr);

}  // namespace moe
