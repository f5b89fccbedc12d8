// HF OLMoE interop on CPU: export then import is bit-exact (FP32), config.json carries the
// OLMoE fields, the fused transformers-5 layout imports, and bad inputs are refused by name
// (config.json and index fields of the wrong JSON type name the file and the field).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf.h"
#include "checkpoint/safetensors.h"
#include "core/config_io.h"
#include "core/dtype.h"
#include "model/layout.h"
#include "support/test_util.h"
#include "train/trainer.h"

namespace moe::testing {
namespace {

namespace fs = std::filesystem;

Config olmoe_like(const fs::path& run) {
  Config c;
  c.model.d_model = 32;
  c.model.n_layers = 2;
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.dense_layers = {};
  c.moe.num_experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 16;
  c.moe.norm_topk_prob = true;
  c.train.seq_len = 16;
  c.train.micro_batch = 2;
  c.train.global_batch = 2;
  c.train.steps = 2;
  c.train.eval_interval = 0;
  c.run.dir = run.string();
  return c;
}

TEST(HfInterop, ExportImportIsBitExact) {
  const TempDir tmp("roundtrip");
  const fs::path root = tmp.root();
  const Config c = olmoe_like(root / "run");
  std::ostringstream log;
  train(c, log);
  HfExportOptions opt;
  opt.dtype = "fp32";
  opt.max_shard_bytes = 40000;  // forces several shards
  const int shards = export_hf((root / "run" / "checkpoints").string(), (root / "hf").string(), opt);
  EXPECT_GT(shards, 1);
  EXPECT_TRUE(fs::exists(root / "hf" / "model.safetensors.index.json"));
  import_hf((root / "hf").string(), (root / "imported").string());

  const LoadedCheckpoint a = LoadedCheckpoint::open(*resolve_checkpoint((root / "run" / "checkpoints").string()));
  const LoadedCheckpoint b = LoadedCheckpoint::open(*resolve_checkpoint((root / "imported").string()));
  EXPECT_EQ(b.step(), 0);
  EXPECT_FALSE(b.has_optim());
  const ParamLayout layout = build_param_layout(c.model, c.moe);
  for (const ParamEntry& e : layout.entries()) {
    std::vector<float> x(e.numel), y(e.numel);
    a.read_model(e.name, e.shape, x.data());
    b.read_model(e.name, e.shape, y.data());
    EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * sizeof(float))) << e.name;
  }
  // The imported config.toml describes the same model.
  std::ifstream f(root / "imported" / "config.toml");
  std::stringstream ss;
  ss << f.rdbuf();
  const Config back = parse_config_toml(ss.str(), "config.toml");
  EXPECT_EQ(back.model.d_model, c.model.d_model);
  EXPECT_EQ(back.moe.top_k, c.moe.top_k);
  EXPECT_EQ(back.moe.norm_topk_prob, true);

  // Training continues from the imported checkpoint with a fresh optimizer.
  Config cont = back;
  cont.run.dir = (root / "continued").string();
  cont.checkpoint.resume = (root / "imported").string();
  cont.train.seq_len = 16;
  cont.train.micro_batch = 2;
  cont.train.global_batch = 2;
  cont.train.steps = 2;
  cont.train.eval_interval = 0;
  const TrainSummary s = train(cont, log);
  EXPECT_EQ(s.start_step, 0);
  EXPECT_EQ(s.steps_done, 2);
  EXPECT_NE(log.str().find("resumed from"), std::string::npos);
}

TEST(HfInterop, ConfigJsonFields) {
  Config c = olmoe_like("unused");
  c.model.rope_theta = 500000.0;
  const nlohmann::json j = olmoe_config_json(c, "bf16");
  EXPECT_EQ(j["model_type"], "olmoe");
  EXPECT_EQ(j["architectures"][0], "OlmoeForCausalLM");
  EXPECT_EQ(j["hidden_size"], 32);
  EXPECT_EQ(j["intermediate_size"], 16);
  EXPECT_EQ(j["num_hidden_layers"], 2);
  EXPECT_EQ(j["num_attention_heads"], 4);
  EXPECT_EQ(j["num_key_value_heads"], 2);
  EXPECT_EQ(j["num_experts"], 4);
  EXPECT_EQ(j["num_experts_per_tok"], 2);
  EXPECT_EQ(j["norm_topk_prob"], true);
  EXPECT_EQ(j["rope_theta"], 500000.0);
  EXPECT_EQ(j["rope_parameters"]["rope_theta"], 500000.0);
  EXPECT_EQ(j["tie_word_embeddings"], false);
  EXPECT_EQ(j["torch_dtype"], "bfloat16");
  const Config back = config_from_olmoe_json(j, "config.json");
  EXPECT_EQ(back.model.rope_theta, 500000.0);
}

TEST(HfInterop, RefusesWhatOlmoeCannotExpress) {
  Config c = olmoe_like("unused");
  c.moe.shared_experts = 1;
  EXPECT_NE(error_of([&] { check_olmoe_expressible(c); }).find("shared experts"), std::string::npos);
  c = olmoe_like("unused");
  c.model.dense_layers = {0};
  EXPECT_NE(error_of([&] { check_olmoe_expressible(c); }).find("dense"), std::string::npos);
  c = olmoe_like("unused");
  c.moe.router = "sigmoid";
  EXPECT_NE(error_of([&] { check_olmoe_expressible(c); }).find("sigmoid"), std::string::npos);
  nlohmann::json j = olmoe_config_json(olmoe_like("unused"), "fp32");
  j["hidden_act"] = "gelu";
  EXPECT_NE(error_of([&] { config_from_olmoe_json(j, "config.json"); }).find("hidden_act"), std::string::npos);
  j = olmoe_config_json(olmoe_like("unused"), "fp32");
  j.erase("num_experts");
  EXPECT_NE(error_of([&] { config_from_olmoe_json(j, "config.json"); }).find("num_experts"), std::string::npos);
}

// Writes an HF directory with the fused transformers-5 expert layout in BF16.
void write_fused_hf(const fs::path& dir, const Config& c, bool drop_one, bool bad_shape) {
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << olmoe_config_json(c, "bf16").dump();
  const ParamLayout layout = build_param_layout(c.model, c.moe);
  std::vector<std::vector<uint16_t>> data;
  std::vector<TensorRef> refs;
  data.reserve(layout.entries().size());
  for (const ParamEntry& e : layout.entries()) {
    if (drop_one && e.name == "model.layers.1.self_attn.k_norm.weight") continue;
    Shape shape = e.shape;
    if (bad_shape && e.name == "lm_head.weight") shape[0] += 1;
    std::vector<uint16_t> v(shape_numel(shape));
    for (size_t i = 0; i < v.size(); ++i) v[i] = f32_to_bf16(0.001f * float((i * 37 + e.offset) % 101) - 0.05f);
    data.push_back(std::move(v));
    refs.push_back({e.name, DType::kBF16, shape, data.back().data()});
  }
  write_safetensors((dir / "model.safetensors").string(), refs, {{"format", "pt"}});
}

TEST(HfInterop, ImportsFusedBf16Layout) {
  const TempDir tmp("fused");
  const fs::path root = tmp.root();
  const Config c = olmoe_like("unused");
  write_fused_hf(root / "hf", c, false, false);
  import_hf((root / "hf").string(), (root / "ck").string());
  const LoadedCheckpoint b = LoadedCheckpoint::open(*resolve_checkpoint((root / "ck").string()));
  const ParamLayout layout = build_param_layout(c.model, c.moe);
  const ParamEntry& e = layout.find("model.layers.0.mlp.experts.gate_up_proj");
  std::vector<float> y(e.numel);
  b.read_model(e.name, e.shape, y.data());
  for (int64_t i = 0; i < e.numel; i += 97)
    EXPECT_EQ(y[i], bf16_to_f32(f32_to_bf16(0.001f * float((i * 37 + e.offset) % 101) - 0.05f)));
}

TEST(HfInterop, RefusesMissingAndMismatchedTensors) {
  const TempDir tmp("bad");
  const fs::path root = tmp.root();
  const Config c = olmoe_like("unused");
  write_fused_hf(root / "missing", c, true, false);
  EXPECT_NE(error_of([&] { import_hf((root / "missing").string(), (root / "ck1").string()); })
                .find("model.layers.1.self_attn.k_norm.weight"),
            std::string::npos);
  write_fused_hf(root / "shape", c, false, true);
  const std::string m = error_of([&] { import_hf((root / "shape").string(), (root / "ck2").string()); });
  EXPECT_NE(m.find("lm_head.weight"), std::string::npos) << m;
  EXPECT_NE(m.find("shape"), std::string::npos) << m;
  EXPECT_FALSE(fs::exists(root / "ck1" / "latest"));
}

}  // namespace
}  // namespace moe::testing

namespace moe::testing {
namespace {

// The refusal lists everything OLMoE cannot express at once, each with the key to train with
// (before: only the first, as "model.dense_layers is not empty").
TEST(HfInterop, RefusalNamesEveryKeyToSet) {
  Config c;  // the embedded default: a dense layer 0
  EXPECT_NE(error_of([&] { check_olmoe_expressible(c); }).find("set model.dense_layers = []"), std::string::npos);
  c.moe.shared_experts = 2;
  c.moe.router = "sigmoid";
  c.model.qk_norm = false;
  c.moe.routing = "uniform";
  const std::string m = error_of([&] { check_olmoe_expressible(c); });
  for (const char* part : {"cannot be exported as OLMoE:", "model.dense_layers = [0]", "set model.dense_layers = []",
                           "set moe.shared_experts = 0", "set moe.router = \"softmax\"", "set model.qk_norm = true",
                           "set moe.routing = \"learned\"", "train a model with them set"})
    EXPECT_NE(m.find(part), std::string::npos) << part << "\nin: " << m;
  c = olmoe_like("unused");
  EXPECT_NO_THROW(check_olmoe_expressible(c));
}

// config.json and the index are read with typed checks that name the file and the field
// (before: an array, a numeric model_type or a string rms_norm_eps ended in nlohmann's
// "[json.exception.type_error.302] ...").
TEST(HfInterop, ConfigJsonFieldsAreTyped) {
  const nlohmann::json good = olmoe_config_json(olmoe_like("unused"), "fp32");
  auto refused = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = good;
    edit(j);
    return error_of([&] { config_from_olmoe_json(j, "hf/config.json"); });
  };
  std::string m = error_of([] { config_from_olmoe_json(nlohmann::json::array({1, 2}), "hf/config.json"); });
  EXPECT_NE(m.find("'hf/config.json' must hold a JSON object, got an array"), std::string::npos) << m;
  m = refused([](nlohmann::json& j) { j["model_type"] = 5; });
  EXPECT_NE(m.find("'hf/config.json': 'model_type' must be a string, got the integer 5"), std::string::npos) << m;
  m = refused([](nlohmann::json& j) { j["hidden_act"] = 1.5; });
  EXPECT_NE(m.find("'hidden_act' must be a string, got the number 1.5"), std::string::npos) << m;
  m = refused([](nlohmann::json& j) { j["rms_norm_eps"] = "1e-5"; });
  EXPECT_NE(m.find("'rms_norm_eps' must be a finite number, got the string \"1e-5\""), std::string::npos) << m;
  m = refused([](nlohmann::json& j) { j["norm_topk_prob"] = "yes"; });
  EXPECT_NE(m.find("'norm_topk_prob' must be true or false"), std::string::npos) << m;
  m = refused([](nlohmann::json& j) { j["num_hidden_layers"] = "2"; });
  EXPECT_NE(m.find("'num_hidden_layers' must be an integer"), std::string::npos) << m;
  m = refused([](nlohmann::json& j) { j["num_hidden_layers"] = 1000000000; });
  EXPECT_NE(m.find("'hf/config.json' describes a model moecore cannot run"), std::string::npos) << m;
  EXPECT_NE(m.find("model.n_layers must be <= 16384"), std::string::npos) << m;
  m = refused([](nlohmann::json& j) { j["rope_parameters"] = {{"rope_type", 3}}; });
  EXPECT_NE(m.find("'rope_type' must be a string"), std::string::npos) << m;
  m = refused([](nlohmann::json& j) { j["rope_parameters"] = "default"; });
  EXPECT_NE(m.find("'rope_parameters' must be an object"), std::string::npos) << m;
  // What real HF configs carry stays accepted: an integer rope_theta, a null bos, a list of eos ids.
  nlohmann::json j = good;
  j["rope_theta"] = 10000;
  j.erase("rope_parameters");
  j["bos_token_id"] = nullptr;
  j["eos_token_id"] = {1, 2};
  EXPECT_EQ(config_from_olmoe_json(j, "hf/config.json").model.rope_theta, 10000.0);
}

TEST(HfInterop, IndexWeightMapIsTyped) {
  const TempDir tmp("index");
  const fs::path root = tmp.root();
  const Config c = olmoe_like("unused");
  write_fused_hf(root / "hf", c, false, false);
  const std::string index = (root / "hf" / "model.safetensors.index.json").string();
  auto import_with_index = [&](const nlohmann::json& idx) {
    std::ofstream(index) << idx.dump();
    return error_of([&] { import_hf((root / "hf").string(), (root / "ck").string()); });
  };
  std::string m = import_with_index(nlohmann::json::array());
  EXPECT_NE(m.find("'" + index + "' must hold a JSON object, got an array"), std::string::npos) << m;
  m = import_with_index({{"weight_map", {1, 2}}});
  EXPECT_NE(m.find("'weight_map' must be an object of tensor name -> file name, got an array"), std::string::npos) << m;
  m = import_with_index({{"weight_map", {{"lm_head.weight", 7}}}});
  EXPECT_NE(m.find("weight_map['lm_head.weight'] must be the name of a file beside the index, got the integer 7"),
            std::string::npos)
      << m;
  m = import_with_index({{"weight_map", {{"lm_head.weight", "../model.safetensors"}}}});
  EXPECT_NE(m.find("got the string \"../model.safetensors\""), std::string::npos) << m;
  std::ofstream(index) << "{\"weight_map\": ";
  m = error_of([&] { import_hf((root / "hf").string(), (root / "ck").string()); });
  EXPECT_NE(m.find("'" + index + "' is not valid JSON"), std::string::npos) << m;
  EXPECT_FALSE(fs::exists(root / "ck" / "latest"));
}

}  // namespace
}  // namespace moe::testing
