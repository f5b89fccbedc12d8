// OLMoE <-> moecore conversion. moecore stacks experts (gate_up_proj [E, 2I, D], gate rows
// first; down_proj [E, D, I]); HF's per-expert layout splits them into experts.E.gate_proj
// [I, D], up_proj [I, D], down_proj [D, I]. Every other tensor keeps its name and shape.
#include "checkpoint/hf.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>

#include "checkpoint/checkpoint.h"
#include "checkpoint/files.h"
#include "checkpoint/hf_tokenizer.h"
#include "checkpoint/json_fields.h"
#include "checkpoint/safetensors.h"
#include "core/config_io.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/signals.h"
#include "model/layout.h"

namespace moe {

namespace fs = std::filesystem;

namespace {

std::string expert_name(int64_t l, int64_t e, const char* proj) {
  return layer_prefix(l) + "mlp.experts." + std::to_string(e) + "." + proj + ".weight";
}

// The JSON object in file `p` (a regular file: a FIFO or directory is refused at once).
nlohmann::json read_json(const fs::path& p) {
  const nlohmann::json j = parse_json_text(read_regular_file(p.string()), p.string());
  require_json_object(j, p.string());
  return j;
}

// A file name from the index's weight_map: a plain name in the model's directory.
bool plain_file_name(const std::string& f) {
  return !f.empty() && f != "." && f != ".." && f.find('/') == std::string::npos;
}

// Removes what an interrupted export left in `out_dir`: staged files (files.h's
// ".<name>.tmp-<pid>") of the names export writes.
void remove_stale_staging(const std::string& out_dir) {
  static const std::regex staged(R"(^\.(model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json|config\.json)\.tmp-\d+$)");
  std::error_code ec;
  std::vector<fs::path> stale;
  for (const auto& e : fs::directory_iterator(out_dir, ec))
    if (std::regex_match(e.path().filename().string(), staged)) stale.push_back(e.path());
  for (const fs::path& p : stale) {
    fs::remove(p, ec);
    MOE_CHECK(!ec, "cannot remove the stale '", p.string(), "' of an interrupted export: ", ec.message());
  }
}

}  // namespace

void check_olmoe_expressible(const Config& cfg) {
  std::vector<std::string> problems;
  if (cfg.moe.shared_experts > 0)
    problems.push_back("it has shared experts (moe.shared_experts = " + std::to_string(cfg.moe.shared_experts) +
                       "; OLMoE has none): set moe.shared_experts = 0");
  if (!cfg.model.dense_layers.empty()) {
    std::string layers;
    for (int64_t l : cfg.model.dense_layers) layers += (layers.empty() ? "" : ", ") + std::to_string(l);
    problems.push_back("it has dense MLP layers (model.dense_layers = [" + layers +
                       "]; OLMoE has an MoE layer in every block): set model.dense_layers = [] "
                       "(on the command line: --model.dense_layers=)");
  }
  if (cfg.moe.router != "softmax")
    problems.push_back("its router uses " + cfg.moe.router + " scores (OLMoE: softmax): set moe.router = \"softmax\"");
  if (!cfg.model.qk_norm)
    problems.push_back("it has no QK-norm (model.qk_norm = false; OLMoE normalises q and k): set model.qk_norm = true");
  if (cfg.moe.routing != "learned")
    problems.push_back("its routing is \"" + cfg.moe.routing +
                       "\" (OLMoE: learned by the router): set moe.routing = \"learned\"");
  if (problems.empty()) return;
  std::string list;
  for (const std::string& p : problems) list += "\n  - " + p;
  MOE_FAIL("this model cannot be exported as OLMoE:", list,
           "\nthese keys shape the trained weights, so train a model with them set and export that one");
}

nlohmann::json olmoe_config_json(const Config& cfg, const std::string& dtype) {
  const ModelConfig& m = cfg.model;
  const MoeConfig& e = cfg.moe;
  nlohmann::json j;
  j["architectures"] = {"OlmoeForCausalLM"};
  j["model_type"] = "olmoe";
  j["vocab_size"] = m.vocab_size;
  j["hidden_size"] = m.d_model;
  j["intermediate_size"] = e.expert_hidden;
  j["num_hidden_layers"] = m.n_layers;
  j["num_attention_heads"] = m.n_heads;
  j["num_key_value_heads"] = m.n_kv_heads;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = std::max<int64_t>(cfg.train.seq_len, 4096);
  j["initializer_range"] = m.init_std;
  j["rms_norm_eps"] = m.norm_eps;
  j["use_cache"] = true;
  j["rope_theta"] = m.rope_theta;
  j["rope_scaling"] = nullptr;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", m.rope_theta}};
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["clip_qkv"] = nullptr;
  j["num_experts"] = e.num_experts;
  j["num_experts_per_tok"] = e.top_k;
  j["norm_topk_prob"] = e.norm_topk_prob;
  j["output_router_logits"] = false;
  j["router_aux_loss_coef"] = e.lb_loss_weight;
  j["tie_word_embeddings"] = false;
  j["eos_token_id"] = cfg.data.eos_id;
  j["pad_token_id"] = cfg.data.eos_id;
  j["bos_token_id"] = nullptr;
  j["torch_dtype"] = dtype == "bf16" ? "bfloat16" : "float32";
  j["dtype"] = j["torch_dtype"];
  return j;
}

Config config_from_olmoe_json(const nlohmann::json& j, const std::string& source) {
  require_json_object(j, source);
  auto get_int = [&](const char* key) { return json_int_required(j, key, source, 1); };
  const std::optional<std::string> type = json_string(j, "model_type", source);
  MOE_CHECK(type == "olmoe", "'", source, "': 'model_type' must be \"olmoe\", got ",
            type ? describe_json(*type) : std::string("nothing"));
  const std::string act = json_string(j, "hidden_act", source).value_or("silu");
  MOE_CHECK(act == "silu", "'", source, "': 'hidden_act' must be \"silu\", got ", describe_json(act));
  MOE_CHECK(!json_bool(j, "attention_bias", source).value_or(false), "'", source,
            "': attention_bias = true is not supported");
  MOE_CHECK(!j.contains("clip_qkv") || j["clip_qkv"].is_null(), "'", source, "': 'clip_qkv' = ",
            describe_json(j["clip_qkv"]), " is not supported (expected null)");
  MOE_CHECK(!json_bool(j, "tie_word_embeddings", source).value_or(false), "'", source,
            "': tie_word_embeddings = true is not supported (moecore's embedding and LM head are separate)");
  MOE_CHECK(!j.contains("rope_scaling") || j["rope_scaling"].is_null(), "'", source, "': 'rope_scaling' = ",
            describe_json(j["rope_scaling"]), " is not supported (expected null)");
  double theta = json_number(j, "rope_theta", source).value_or(10000.0);
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    const nlohmann::json& rp = j["rope_parameters"];
    const std::string where = source + "' field 'rope_parameters";
    MOE_CHECK(rp.is_object(), "'", source, "': 'rope_parameters' must be an object, got ", describe_json(rp));
    const std::string rt = json_string(rp, "rope_type", where).value_or("default");
    MOE_CHECK(rt == "default", "'", source, "': rope_parameters.rope_type = \"", rt,
              "\" is not supported (expected \"default\")");
    theta = json_number(rp, "rope_theta", where).value_or(theta);
  }
  Config c;
  c.model.vocab_size = get_int("vocab_size");
  c.model.d_model = get_int("hidden_size");
  c.model.n_layers = get_int("num_hidden_layers");
  c.model.n_heads = get_int("num_attention_heads");
  c.model.n_kv_heads = json_int(j, "num_key_value_heads", source, 1).value_or(c.model.n_heads);
  c.model.qk_norm = true;
  c.model.rope_theta = theta;
  c.model.norm_eps = json_number(j, "rms_norm_eps", source).value_or(1e-5);
  c.model.dense_layers = {};
  c.model.init_std = json_number(j, "initializer_range", source).value_or(c.model.init_std);
  c.moe.num_experts = get_int("num_experts");
  c.moe.top_k = get_int("num_experts_per_tok");
  c.moe.expert_hidden = get_int("intermediate_size");
  c.moe.shared_experts = 0;
  c.moe.router = "softmax";
  c.moe.routing = "learned";
  c.moe.norm_topk_prob = json_bool(j, "norm_topk_prob", source).value_or(false);
  c.moe.lb_loss_weight = json_number(j, "router_aux_loss_coef", source).value_or(c.moe.lb_loss_weight);
  // eos_token_id may also be a list in HF configs; only a single id carries over.
  if (j.contains("eos_token_id") && j["eos_token_id"].is_number_integer()) c.data.eos_id = j["eos_token_id"].get<int64_t>();
  try {
    validate_config(c);
  } catch (const Error& e) {
    MOE_FAIL("'", source, "' describes a model moecore cannot run: ", e.what());
  }
  return c;
}

int export_hf(const std::string& checkpoint, const std::string& out_dir, const HfExportOptions& opt,
              std::string* tokenizer_note) {
  MOE_CHECK(opt.dtype == "bf16" || opt.dtype == "fp32", "export-hf --dtype: expected bf16 or fp32, got '", opt.dtype, "'");
  const auto step_dir = resolve_checkpoint(checkpoint);
  MOE_CHECK(step_dir.has_value(), "no complete checkpoint at '", checkpoint, "'");
  const LoadedCheckpoint ck = LoadedCheckpoint::open(*step_dir);
  const Config cfg = checkpoint_config(ck);
  check_olmoe_expressible(cfg);

  const ParamLayout layout = build_param_layout(cfg.model, cfg.moe);
  std::vector<float> params(layout.total_numel());
  for (const ParamEntry& e : layout.entries()) ck.read_model(e.name, e.shape, params.data() + e.offset);
  for (int64_t l = 0; l < cfg.model.n_layers; ++l) {
    const std::string bias = layer_prefix(l) + "mlp.gate.expert_bias";
    if (!ck.has_model(bias)) continue;
    std::vector<float> b(cfg.moe.num_experts);
    ck.read_model(bias, {cfg.moe.num_experts}, b.data());
    for (float x : b)
      MOE_CHECK(x == 0.f, "this model cannot be exported as OLMoE: it uses an expert bias for routing (", bias,
                " is non-zero; OLMoE's router has none): train it with moe.bias_update_rate = 0");
  }

  // HF tensors as (name, shape, pointer into params).
  struct Out { std::string name; Shape shape; const float* data; };
  std::vector<Out> outs;
  const int64_t d = cfg.model.d_model, inner = cfg.moe.expert_hidden;
  for (const ParamEntry& e : layout.entries()) {
    const float* p = params.data() + e.offset;
    if (e.name.ends_with("mlp.experts.gate_up_proj") || e.name.ends_with("mlp.experts.down_proj")) continue;
    outs.push_back({e.name, e.shape, p});
    if (e.name.ends_with("mlp.gate.weight")) {
      const int64_t l = std::stoll(e.name.substr(std::string("model.layers.").size()));
      const float* gu = params.data() + layout.find(layer_prefix(l) + "mlp.experts.gate_up_proj").offset;
      const float* dn = params.data() + layout.find(layer_prefix(l) + "mlp.experts.down_proj").offset;
      for (int64_t x = 0; x < cfg.moe.num_experts; ++x) {
        outs.push_back({expert_name(l, x, "gate_proj"), {inner, d}, gu + x * 2 * inner * d});
        outs.push_back({expert_name(l, x, "up_proj"), {inner, d}, gu + x * 2 * inner * d + inner * d});
        outs.push_back({expert_name(l, x, "down_proj"), {d, inner}, dn + x * d * inner});
      }
    }
  }

  // Convert and shard.
  const bool bf16 = opt.dtype == "bf16";
  const DType dt = bf16 ? DType::kBF16 : DType::kF32;
  std::vector<std::vector<uint16_t>> converted(outs.size());
  std::vector<std::vector<size_t>> shards(1);
  int64_t shard_bytes = 0, total_bytes = 0;
  for (size_t i = 0; i < outs.size(); ++i) {
    const int64_t n = shape_numel(outs[i].shape), bytes = n * dtype_size(dt);
    if (bf16) {
      converted[i].resize(n);
      for (int64_t k = 0; k < n; ++k) converted[i][k] = f32_to_bf16(outs[i].data[k]);
    }
    if (shard_bytes > 0 && shard_bytes + bytes > opt.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += bytes;
    total_bytes += bytes;
  }
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  MOE_CHECK(!ec, "cannot create the output directory '", out_dir, "': ", ec.message());
  remove_stale_staging(out_dir);
  // Every file is staged under a temporary name and renamed; config.json, which makes the
  // directory a model for HF readers, comes last.
  nlohmann::json weight_map = nlohmann::json::object();
  const int num = static_cast<int>(shards.size());
  for (int s = 0; s < num; ++s) {
    // Ctrl-C / SIGTERM (under the command's StopSignals): stop between shards. The export is
    // incomplete without its index and config.json, which are written last.
    MOE_CHECK(StopSignals::requested() == 0, "export-hf: stopped by ", StopSignals::name(StopSignals::requested()),
              " after ", s, " of ", num, " shards; '", out_dir, "' holds no index or config.json (run it again)");
    char fname[64];
    std::snprintf(fname, sizeof fname, "model-%05d-of-%05d.safetensors", s + 1, num);
    std::vector<TensorRef> refs;
    for (size_t i : shards[s]) {
      refs.push_back({outs[i].name, dt, outs[i].shape, bf16 ? static_cast<const void*>(converted[i].data())
                                                            : static_cast<const void*>(outs[i].data)});
      weight_map[outs[i].name] = fname;
    }
    const std::string path = (fs::path(out_dir) / fname).string(), tmp = staging_path(path);
    try {
      write_safetensors(tmp, refs, {{"format", "pt"}});
    } catch (...) {
      fs::remove(tmp, ec);
      throw;
    }
    publish_file(tmp, path);
  }
  const std::string note = export_hf_tokenizer(cfg, opt.tokenizer, out_dir);
  if (tokenizer_note) *tokenizer_note = note;
  nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  write_file_atomic((fs::path(out_dir) / "model.safetensors.index.json").string(), index.dump(2) + "\n");
  write_file_atomic((fs::path(out_dir) / "config.json").string(), olmoe_config_json(cfg, opt.dtype).dump(2) + "\n");
  return num;
}

std::string import_hf(const std::string& hf_dir, const std::string& out_checkpoint_dir) {
  const fs::path dir(hf_dir);
  const Config cfg = config_from_olmoe_json(read_json(dir / "config.json"), (dir / "config.json").string());

  // name -> file
  std::map<std::string, std::string> where;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> opened;
  const std::string index_path = (dir / "model.safetensors.index.json").string();
  std::error_code ec;
  if (fs::exists(fs::symlink_status(index_path, ec))) {
    const nlohmann::json idx = read_json(index_path);
    const auto map = idx.find("weight_map");
    MOE_CHECK(map != idx.end() && map->is_object(), "'", index_path,
              "': 'weight_map' must be an object of tensor name -> file name, got ",
              map == idx.end() ? std::string("nothing") : describe_json(*map));
    for (auto it = map->begin(); it != map->end(); ++it) {
      MOE_CHECK(it.value().is_string() && plain_file_name(it.value().get<std::string>()), "'", index_path,
                "': weight_map['", it.key(), "'] must be the name of a file beside the index, got ",
                describe_json(it.value()));
      where[it.key()] = it.value().get<std::string>();
    }
  } else {
    MOE_CHECK(fs::exists(fs::symlink_status(dir / "model.safetensors", ec)), hf_dir,
              ": neither model.safetensors.index.json nor model.safetensors exists");
    const SafetensorsFile f = SafetensorsFile::open((dir / "model.safetensors").string());
    for (const auto& t : f.tensors()) where[t.name] = "model.safetensors";
  }
  std::set<std::string> unused;
  for (const auto& [name, file] : where) unused.insert(name);
  auto info = [&](const std::string& name) -> std::pair<const SafetensorsFile*, const TensorInfo*> {
    auto it = where.find(name);
    if (it == where.end()) return {nullptr, nullptr};
    auto& f = opened[it->second];
    if (!f) f = std::make_unique<SafetensorsFile>(SafetensorsFile::open((dir / it->second).string()));
    const TensorInfo* t = f->find(name);
    MOE_CHECK(t, (dir / it->second).string(), " does not hold '", name, "' although the index says so");
    return {f.get(), t};
  };
  auto read = [&](const std::string& name, const Shape& shape, float* out) {
    auto [f, t] = info(name);
    MOE_CHECK(f, hf_dir, ": missing tensor '", name, "'");
    MOE_CHECK(t->shape == shape, hf_dir, ": tensor '", name, "' has shape ", shape_str(t->shape), ", expected ",
              shape_str(shape), " from config.json");
    f->read_f32(name, out, shape_numel(shape));
    unused.erase(name);
  };

  const ParamLayout layout = build_param_layout(cfg.model, cfg.moe);
  std::vector<float> params(layout.total_numel(), 0.f);
  const int64_t d = cfg.model.d_model, inner = cfg.moe.expert_hidden, ne = cfg.moe.num_experts;
  for (const ParamEntry& e : layout.entries()) {
    float* p = params.data() + e.offset;
    const bool gate_up = e.name.ends_with("mlp.experts.gate_up_proj");
    const bool down = e.name.ends_with("mlp.experts.down_proj");
    if (!gate_up && !down) {
      read(e.name, e.shape, p);
      continue;
    }
    if (info(e.name).first) {  // fused transformers-5 layout: same name and shape as ours
      read(e.name, e.shape, p);
      continue;
    }
    const int64_t l = std::stoll(e.name.substr(std::string("model.layers.").size()));
    for (int64_t x = 0; x < ne; ++x) {
      if (gate_up) {
        read(expert_name(l, x, "gate_proj"), {inner, d}, p + x * 2 * inner * d);
        read(expert_name(l, x, "up_proj"), {inner, d}, p + x * 2 * inner * d + inner * d);
      } else {
        read(expert_name(l, x, "down_proj"), {d, inner}, p + x * d * inner);
      }
    }
  }
  for (auto it = unused.begin(); it != unused.end();) {
    if (it->ends_with("rotary_emb.inv_freq")) it = unused.erase(it);  // a derived buffer some exports carry
    else ++it;
  }
  if (!unused.empty()) {
    std::string names;
    int shown = 0;
    for (const auto& n : unused) {
      if (shown++ == 5) { names += ", ..."; break; }
      names += (names.empty() ? "" : ", ") + n;
    }
    MOE_FAIL(hf_dir, ": ", unused.size(), " tensors do not belong to an OLMoE model of this config: ", names);
  }

  CheckpointFiles files;
  for (const ParamEntry& e : layout.entries()) files.model.push_back({e.name, DType::kF32, e.shape, params.data() + e.offset});
  const std::string toml = config_to_toml(cfg);
  files.train_state = {{"step", 0}, {"data_position", 0}, {"optimizer_steps", 0}, {"config", toml},
                       {"imported_from", fs::absolute(dir).string()}};
  MOE_CHECK(StopSignals::requested() == 0, "import-hf: stopped by ", StopSignals::name(StopSignals::requested()),
            " before writing '", out_checkpoint_dir, "'; nothing was written");
  const std::string step_dir = save_checkpoint(out_checkpoint_dir, 0, files, /*keep_last=*/0);
  write_file_atomic((fs::path(out_checkpoint_dir) / "config.toml").string(), toml);
  return step_dir;
}

}  // namespace moe
