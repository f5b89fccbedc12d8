// GpuTrainer on CudaModel and the device AdamW (CUDA builds); device resolution everywhere.
#include "train/gpu_trainer.h"

#include "core/error.h"

#ifdef MOECORE_HAS_CUDA
#include "cuda/device.h"
#include "cuda/ops/memory.h"
#include "cuda/ops/optim.h"
#include "model/cuda_model.h"
#endif

namespace moe {

bool gpu_available() {
#ifdef MOECORE_HAS_CUDA
  return cuda::cuda_device_count() > 0;
#else
  return false;
#endif
}

std::string resolve_device(const TrainConfig& t) {
  if (t.device == "cpu") {
    MOE_CHECK(t.precision == "fp32", "train.precision = \"", t.precision,
              "\" is not available on the cpu backend (train.device = \"cpu\"): use \"fp32\"");
    return "cpu";
  }
  if (t.device == "auto") {
    if (gpu_available() && t.precision == "bf16") return "cuda";
    MOE_CHECK(t.precision == "fp32", "train.precision = \"", t.precision,
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
  MOE_CHECK(t.precision == "bf16", "train.precision = \"", t.precision,
            "\" is not available on cuda yet: use \"bf16\" (fp32 runs on train.device = \"cpu\")");
  return "cuda";
#endif
}

#ifdef MOECORE_HAS_CUDA

namespace {

class CudaTrainer final : public GpuTrainer {
 public:
  CudaTrainer(const Config& cfg, Model<float>& host, AdamW& host_opt)
      : cfg_(cfg), model_(cfg.model, cfg.moe), segments_(model_.layout()) {
    const int64_t n = model_.layout().total_numel();
    const size_t bytes = size_t(n) * sizeof(float);
    exp_avg_.reserve(bytes);
    exp_avg_sq_.reserve(bytes);
    norm_ws_bytes_ = cuda::global_grad_norm_workspace_bytes(n);
    norm_ws_.reserve(norm_ws_bytes_);
    scalars_.reserve(sizeof(cuda::OptimStepScalars));
    model_.load_params(host.params());
    model_.load_expert_bias(host.expert_bias());
    cuda::copy_h2d(exp_avg_.data(), host_opt.exp_avg().data(), bytes, model_.stream());
    cuda::copy_h2d(exp_avg_sq_.data(), host_opt.exp_avg_sq().data(), bytes, model_.stream());
    cuda::OptimStepScalars s;
    s.step = host_opt.steps_taken();
    host_scalars_ = s;
    cuda::copy_h2d(scalars_.data(), &host_scalars_, sizeof(s), model_.stream());
    cuda::stream_sync(model_.stream());
  }

  void zero_grads() override { model_.zero_grads(); }

  ForwardStats forward_backward(const Batch& b, const LossScales& scales, uint64_t seed) override {
    model_.forward(b.inputs.data(), b.targets.data(), b.num_sequences(), b.seq_len, seed);
    model_.backward(scales);
    return model_.read_stats();
  }

  ForwardStats forward_only(const Batch& b, uint64_t seed) override {
    model_.forward(b.inputs.data(), b.targets.data(), b.num_sequences(), b.seq_len, seed);
    return model_.read_stats();
  }

  StepResult optimizer_step(double lr) override {
    auto* dev = scalars_.as<cuda::OptimStepScalars>();
    host_scalars_.lr = lr;
    // Only lr travels up; the step count and outputs live on the device.
    cuda::copy_h2d(&dev->lr, &host_scalars_.lr, sizeof(double), model_.stream());
    cuda::global_grad_norm(model_.grads(), model_.layout().total_numel(), &dev->grad_norm, norm_ws_.data(),
                           norm_ws_bytes_, model_.stream());
    cuda::adamw_step(segments_, cfg_.optim, model_.params(), model_.grads(), exp_avg_.as<float>(),
                     exp_avg_sq_.as<float>(), model_.params_bf16(), dev, model_.stream());
    cuda::copy_d2h(&host_scalars_, dev, sizeof(cuda::OptimStepScalars), model_.stream());
    return {host_scalars_.grad_norm, host_scalars_.skipped != 0};
  }

  void upload_expert_bias(const std::vector<float>& bias) override { model_.load_expert_bias(bias); }

  void download(Model<float>& host, AdamW& host_opt) override {
    const std::vector<float> p = model_.download_params();
    std::copy(p.begin(), p.end(), host.params());
    const size_t bytes = size_t(model_.layout().total_numel()) * sizeof(float);
    cuda::copy_d2h(host_opt.exp_avg().data(), exp_avg_.data(), bytes, model_.stream());
    cuda::copy_d2h(host_opt.exp_avg_sq().data(), exp_avg_sq_.data(), bytes, model_.stream());
    cuda::copy_d2h(&host_scalars_, scalars_.data(), sizeof(cuda::OptimStepScalars), model_.stream());
    host_opt.set_steps_taken(host_scalars_.step);
  }

 private:
  Config cfg_;
  CudaModel model_;
  cuda::ParamSegmentTable segments_;
  cuda::DeviceBuffer exp_avg_, exp_avg_sq_, norm_ws_, scalars_;
  size_t norm_ws_bytes_ = 0;
  cuda::OptimStepScalars host_scalars_;
};

}  // namespace

std::unique_ptr<GpuTrainer> make_gpu_trainer(const Config& cfg, Model<float>& host, AdamW& host_opt) {
  return std::make_unique<CudaTrainer>(cfg, host, host_opt);
}

#else

std::unique_ptr<GpuTrainer> make_gpu_trainer(const Config&, Model<float>&, AdamW&) {
  MOE_FAIL("train.device = \"cuda\" needs a build with the CUDA backend (cmake --preset cuda)");
}

#endif

}  // namespace moe
