// The model part of a checkpoint: every parameter (global FP32, HF-style names) plus the
// selection-only expert bias of each MoE layer ("model.layers.L.mlp.gate.expert_bias").
#pragma once

#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "model/model.h"

namespace moe {

std::string expert_bias_name(const ModelConfig& m, int64_t moe_index);
// Views of the model's tensors for model.safetensors (valid while `model` lives).
std::vector<TensorRef> model_state_refs(Model<float>& model);
// Loads parameters (shape mismatches name the tensor and the file) and, when the checkpoint
// has them, the expert biases.
void load_model_state(const LoadedCheckpoint& ck, Model<float>& model);

}  // namespace moe
