// Model tensors to and from a checkpoint; expert tensors under EP as dim-0 slices of the global
// tensors, read as one flat range each.
#include "train/model_state.h"

#include "core/error.h"
#include "model/layout.h"

namespace moe {

std::string expert_bias_name(const ModelConfig& m, int64_t moe_index) {
  int64_t seen = 0;
  for (int64_t l = 0; l < m.n_layers; ++l) {
    if (is_dense_layer(m, l)) continue;
    if (seen++ == moe_index) return layer_prefix(l) + "mlp.gate.expert_bias";
  }
  MOE_FAIL("MoE layer index ", moe_index, " out of range (", num_moe_layers(m), " MoE layers)");
}

std::vector<TensorRef> model_state_refs(Model<float>& model) {
  std::vector<TensorRef> refs;
  for (const ParamEntry& e : model.layout().entries())
    refs.push_back({e.name, DType::kF32, e.shape, model.params() + e.offset});
  const int64_t ne = model.moe_config().num_experts;
  for (int64_t m = 0; m < model.num_moe_layers(); ++m)
    refs.push_back({expert_bias_name(model.model_config(), m), DType::kF32, {ne},
                    model.expert_bias().data() + m * ne});
  return refs;
}

std::vector<TensorShard> model_state_shards(const Model<float>& model) {
  std::vector<TensorShard> shards = model.shards();
  const int64_t ne = model.moe_config().num_experts;
  for (int64_t m = 0; m < model.num_moe_layers(); ++m) shards.push_back({{ne}, 0, false});
  return shards;
}

void read_tensor_shard(const LoadedCheckpoint& ck, bool optim, const std::string& name, const Shape& local_shape,
                       const TensorShard& shard, float* out) {
  if (!shard.sharded) {
    if (optim) {
      ck.read_optim(name, local_shape, out);
    } else {
      ck.read_model(name, local_shape, out);
    }
    return;
  }
  MOE_CHECK(!local_shape.empty() && local_shape.size() == shard.global_shape.size() &&
                shard.dim0_offset >= 0 && shard.dim0_offset + local_shape[0] <= shard.global_shape[0],
            "tensor '", name, "': local slice of ", local_shape.empty() ? 0 : local_shape[0], " rows at ",
            shard.dim0_offset, " does not fit its global shape of ", shard.global_shape.empty() ? 0 : shard.global_shape[0],
            " rows");
  // A dim-0 slice is one contiguous flat range of the global tensor.
  const int64_t numel = shape_numel(local_shape), offset = shard.dim0_offset * (numel / local_shape[0]);
  if (optim) {
    ck.read_optim_range(name, shard.global_shape, offset, numel, out);
  } else {
    ck.read_model_range(name, shard.global_shape, offset, numel, out);
  }
}

void load_model_state(const LoadedCheckpoint& ck, Model<float>& model) {
  const auto& entries = model.layout().entries();
  for (size_t i = 0; i < entries.size(); ++i)
    read_tensor_shard(ck, false, entries[i].name, entries[i].shape, model.shards()[i],
                      model.params() + entries[i].offset);
  const int64_t ne = model.moe_config().num_experts;
  for (int64_t m = 0; m < model.num_moe_layers(); ++m) {
    const std::string name = expert_bias_name(model.model_config(), m);
    if (ck.has_model(name)) ck.read_model(name, {ne}, model.expert_bias().data() + m * ne);
  }
}

}  // namespace moe
