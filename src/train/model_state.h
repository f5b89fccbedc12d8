// The model part of a checkpoint: every parameter (global FP32, HF-style names) plus the
// selection-only expert bias of each MoE layer ("model.layers.L.mlp.gate.expert_bias").
// Under expert parallelism a rank holds a dim-0 slice of each expert tensor: the refs are the
// local slices, the shards say where each sits in its global tensor, and loading reads the
// global tensor and keeps this rank's rows (so any EP layout resumes any other).
#pragma once

#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "model/model.h"

namespace moe {

std::string expert_bias_name(const ModelConfig& m, int64_t moe_index);
// Views of the model's (local) tensors for model.safetensors (valid while `model` lives).
std::vector<TensorRef> model_state_refs(Model<float>& model);
// One TensorShard per ref of model_state_refs, in the same order: global shape and dim-0
// offset of each local tensor (expert biases and dense tensors: the whole tensor).
std::vector<TensorShard> model_state_shards(const Model<float>& model);
// Loads parameters (shape mismatches name the tensor and the file) and, when the checkpoint
// has them, the expert biases; sharded tensors take their rows of the global tensor.
void load_model_state(const LoadedCheckpoint& ck, Model<float>& model);

// Reads this rank's slice of global tensor `name` from model.safetensors (optim == false) or
// optim.safetensors (optim == true): checks the stored shape against shard.global_shape and
// copies rows [shard.dim0_offset, shard.dim0_offset + local_shape[0]) into out.
void read_tensor_shard(const LoadedCheckpoint& ck, bool optim, const std::string& name, const Shape& local_shape,
                       const TensorShard& shard, float* out);

}  // namespace moe
