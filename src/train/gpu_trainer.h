// The GPU side of a training step for train(): a CudaModel (BF16 compute, FP32 master weights)
// plus the device AdamW state. The host Model<float> and AdamW stay the checkpoint mirror:
// weights and moments are uploaded at start and downloaded before each save. Each step still
// reads its statistics and grad norm back to the host (not yet sync-free; graph capture of
// the whole step is later work). In a build without CUDA, make_gpu_trainer throws.
#pragma once

#include <memory>
#include <vector>

#include "core/config.h"
#include "data/dataset.h"
#include "model/model.h"
#include "optim/adamw.h"

namespace moe {

class GpuTrainer {
 public:
  virtual ~GpuTrainer() = default;
  virtual void zero_grads() = 0;
  // forward + backward of one micro-batch (gradients +=); returns its statistics.
  virtual ForwardStats forward_backward(const Batch& b, const LossScales& scales, uint64_t routing_seed) = 0;
  virtual ForwardStats forward_only(const Batch& b, uint64_t routing_seed) = 0;
  struct StepResult {
    double grad_norm = 0;
    bool skipped = false;
  };
  // Global grad norm, clip, AdamW at `lr` (skipped on the device when the norm is not finite).
  virtual StepResult optimizer_step(double lr) = 0;
  virtual void upload_expert_bias(const std::vector<float>& bias) = 0;
  // Copies master weights, moments and the AdamW step count into the host mirror.
  virtual void download(Model<float>& host, AdamW& host_opt) = 0;
};

// True when this build has the CUDA backend and a GPU is visible.
bool gpu_available();
// "cpu" or "cuda" for train.device and train.precision ("auto": cuda when a GPU is available
// and precision is bf16). Throws naming the keys when the combination cannot run.
std::string resolve_device(const TrainConfig& t);
std::unique_ptr<GpuTrainer> make_gpu_trainer(const Config& cfg, Model<float>& host, AdamW& host_opt);

}  // namespace moe
