// The model part of a checkpoint: every parameter (global FP32, HF-style names) plus the
// selection-only expert bias of each MoE layer ("model.layers.L.mlp.gate.expert_bias").
// Under expert parallelism a rank holds a dim-0 slice of each expert tensor: the refs are the
// local tensors, the placements say where each sits in its global tensor, and loading reads this
// rank's range of every global tensor (so a checkpoint of any layout loads into any other).
#pragma once

#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "model/model.h"

namespace moe {

std::string expert_bias_name(const ModelConfig& m, int64_t moe_index);
// Views of the model's (local) tensors for model.safetensors (valid while `model` lives).
std::vector<TensorRef> model_state_refs(Model<float>& model);
// One GlobalPlacement per ref of model_state_refs, in the same order: Model::placements() for
// the parameters, then the expert biases (replicated: whole, offset 0).
std::vector<GlobalPlacement> model_state_placements(const Model<float>& model);
// Loads every parameter's range of its global tensor (shape mismatches name the tensor and the
// file) and, when the checkpoint has them, the expert biases.
void load_model_state(const LoadedCheckpoint& ck, Model<float>& model);

}  // namespace moe
