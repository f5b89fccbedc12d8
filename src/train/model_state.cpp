// Model tensors to and from a checkpoint; expert tensors under EP as dim-0 slices of the global
// tensors, each one contiguous flat range (Model::placements) read with read_model_range.
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

std::vector<GlobalPlacement> model_state_placements(const Model<float>& model) {
  std::vector<GlobalPlacement> out = model.placements();
  const int64_t ne = model.moe_config().num_experts;
  for (int64_t m = 0; m < model.num_moe_layers(); ++m) out.push_back({{ne}, 0});
  return out;
}

void load_model_state(const LoadedCheckpoint& ck, Model<float>& model) {
  const auto& entries = model.layout().entries();
  for (size_t i = 0; i < entries.size(); ++i) {
    const GlobalPlacement& g = model.placements()[i];
    ck.read_model_range(entries[i].name, g.global_shape, g.offset, entries[i].numel,
                        model.params() + entries[i].offset);
  }
  const int64_t ne = model.moe_config().num_experts;
  for (int64_t m = 0; m < model.num_moe_layers(); ++m) {
    const std::string name = expert_bias_name(model.model_config(), m);
    if (ck.has_model(name)) ck.read_model(name, {ne}, model.expert_bias().data() + m * ne);
  }
}

}  // namespace moe
