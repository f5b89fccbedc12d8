// Activation memory of one micro-batch by recompute mode, buffer by buffer. On the GPU the figures
// follow CudaModel's buffers exactly (src/model/cuda_*.cpp reserve(): BF16 2 bytes, FP32 and int32
// 4); on the CPU they follow Model<float>'s saved tensors at 4 bytes per element, an approximation
// (its transient vectors are not listed). What a layer keeps per mode is core/recompute.h's
// contract:
//   kept   a layer's saved tensors that stay until its backward, summed over all layers;
//   pool   the tensors a recomputing backward rebuilds: one pool per block kind (attention blocks,
//          dense MLP blocks, MoE layers with their experts), each sized for the largest layer of
//          its kind and shared by all of them (CudaModel::set_recompute); empty for "none";
//   scratch the model-wide buffers every mode has once: residual stream and its gradient, backward
//          scratch and workspaces, the LM head's buffers, the step's token ids.
// Expert-parallel exchange buffers are not here (RunPlan's MemoryEstimate::exchange).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/recompute.h"

namespace moe {

// One named buffer (or group of same-named buffers summed over layers), in bytes.
struct MemoryItem {
  std::string name;  // "attention.q", "moe.x_sorted", "scratch.residual x32", ...
  double bytes = 0;
};

double sum_bytes(const std::vector<MemoryItem>& items);

struct ActivationMemory {
  Recompute mode = Recompute::kNone;
  std::vector<MemoryItem> kept;     // per-layer tensors, each summed over the layers holding it
  std::vector<MemoryItem> pool;     // recomputed tensors of the largest layer (once per model)
  std::vector<MemoryItem> scratch;  // model-wide, the same in every mode
  double kept_bytes() const { return sum_bytes(kept); }
  double pool_bytes() const { return sum_bytes(pool); }
  double scratch_bytes() const { return sum_bytes(scratch); }
  double total() const { return kept_bytes() + pool_bytes() + scratch_bytes(); }
};

// batch sequences of seq tokens per micro-batch; micro_steps: micro-batches per step (the step's
// token ids are on the device at once). gpu: CudaModel's buffers; else Model<float>'s (approximate).
// ep: the expert-parallel group size (ep > 1: selective keeps the experts' outputs per layer).
ActivationMemory activation_memory(const ModelConfig& m, const MoeConfig& e, int64_t batch, int64_t seq,
                                   int64_t micro_steps, bool gpu, Recompute mode, int64_t ep = 1);

// The three modes, in the order none, selective, full.
std::array<ActivationMemory, 3> activation_memory_all_modes(const ModelConfig& m, const MoeConfig& e, int64_t batch,
                                                             int64_t seq, int64_t micro_steps, bool gpu,
                                                             int64_t ep = 1);

// cuDNN's deterministic attention backward plan workspace (bytes) for batch x heads x seq: measured
// 2,148,532,480 bytes at B 4, S 4096, 16 heads, head_dim 128 (cuDNN 9.14; bench/results/
// gpu-check-20261201T230245Z/grouped_gemm.json, plan_workspace_bytes_backward) = B*H*S*(2S + 4)
// + 256; the own kernels need none. The same form is assumed for other head dims.
double cudnn_attention_workspace_bytes(int64_t batch, int64_t heads, int64_t seq);

}  // namespace moe
