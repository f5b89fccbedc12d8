// Hugging Face OLMoE interop (OlmoeForCausalLM, model_type "olmoe").
// export: a moecore checkpoint -> config.json + sharded safetensors with per-expert names
//   (model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight) and an index file.
// import: an HF directory (single-file or sharded; per-expert or the fused transformers-5
//   layout experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I]; F32/BF16/F16)
//   -> a moecore checkpoint (step 0, no optimizer state) plus the matching config.toml.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "core/config.h"

namespace moe {

struct HfExportOptions {
  std::string dtype = "bf16";                 // "bf16" | "fp32"
  int64_t max_shard_bytes = 5'000'000'000;    // per safetensors shard
  std::string tokenizer;                      // a tokenizer.json to export; "": none (checkpoint/hf_tokenizer.h)
};

// Throws naming the feature when OLMoE cannot express the model (shared experts, dense
// layers, sigmoid router, a non-zero expert bias, no QK-norm, non-learned routing).
void check_olmoe_expressible(const Config& cfg);
nlohmann::json olmoe_config_json(const Config& cfg, const std::string& dtype);
// Model and MoE sections from an OLMoE config.json; refuses values moecore cannot run.
Config config_from_olmoe_json(const nlohmann::json& j, const std::string& source);

// Returns the number of shards written. The tokenizer files (checkpoint/hf_tokenizer.h) are
// written before the index and config.json; tokenizer_note (optional) receives the line saying
// which tokenizer was exported.
int export_hf(const std::string& checkpoint, const std::string& out_dir, const HfExportOptions& opt,
              std::string* tokenizer_note = nullptr);
// Returns the step directory written.
std::string import_hf(const std::string& hf_dir, const std::string& out_checkpoint_dir);

}  // namespace moe
