// The model of model.h on one GPU: same parameter layout, forward/backward semantics and
// gradient conventions as Model<float>, built from the ops of src/cuda/ops. FP32 master weights,
// a BF16 copy read by every op, FP32 gradients (accumulated, +=); BF16 activations with an FP32
// residual stream (and FP32 residual gradient), FP32 router logits, rstd and lse. The LM head and
// cross-entropy run in chunks of kHeadChunkRows rows, so [N, V] logits never exist; backward
// recomputes each chunk's logits (one extra N x V x D GEMM) and fuses the softmax gradient.
// Dropless routing only (capacity_factor = 0). No CUDA headers; defined only in CUDA builds
// (MOECORE_HAS_CUDA), so CPU-only code must not reference it. Loss sums, lb/z losses and expert counts stay on the device until
// read_stats(). Legend: B batch, S sequence, N = B*S, D width, V vocabulary, E experts.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/arena.h"
#include "core/config.h"
#include "cuda/device.h"
#include "model/model.h"

namespace moe {

class CudaModel {
 public:
  static constexpr int64_t kHeadChunkRows = 4096;

  // Allocates parameters (zero), gradients (zero) and the expert bias (zero) on the current device.
  CudaModel(const ModelConfig& model, const MoeConfig& moe);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const ModelConfig& model_config() const { return mcfg_; }
  const MoeConfig& moe_config() const { return ecfg_; }
  const ParamLayout& layout() const { return layout_; }
  int64_t num_moe_layers() const { return num_moe_layers_; }
  cuda::Stream stream() const { return stream_; }

  // Device buffers, layout().total_numel() elements each.
  float* params();          // FP32 master weights
  uint16_t* params_bf16();  // BF16 copy every op reads (adamw_step refreshes it)
  float* grads();           // FP32 gradients

  // Copies host FP32 parameters [total_numel] (e.g. Model<float>::params()) and refreshes the BF16 copy.
  void load_params(const float* host_params);
  // Expert bias [num_moe_layers * E] FP32 from the host.
  void load_expert_bias(const std::vector<float>& bias);
  // Recomputes the BF16 copy from the FP32 master weights.
  void refresh_bf16();
  std::vector<float> download_params();
  std::vector<float> download_grads();
  void zero_grads();

  // inputs/targets: host [B, S] token ids (targets < 0 do not count). Enqueues the forward on
  // stream() and saves what backward needs; the statistics stay on the device (read_stats()).
  void forward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
               uint64_t routing_seed = 0);
  // Accumulates (+=) the gradient of scales.objective(stats of the last forward) into grads().
  void backward(const LossScales& scales);
  // Waits for the stream and copies the last forward's statistics to the host. num_dropped is 0
  // (dropless); bad token ids or targets (counted on the device) throw here.
  ForwardStats read_stats();

 private:
  struct Impl;
  struct LayerState;
  ModelConfig mcfg_;
  MoeConfig ecfg_;
  ParamLayout layout_;
  int64_t num_moe_layers_ = 0;
  cuda::Stream stream_ = nullptr;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe
