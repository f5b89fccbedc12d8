// Tokenizer files of an HF export (see the header): the byte-level tokenizer.json built from
// GPT-2's alphabet, or a copy of the run's tokenizer.json, and the configs HF readers look for.
#include "checkpoint/hf_tokenizer.h"

#include <algorithm>
#include <filesystem>

#include "checkpoint/files.h"
#include "core/error.h"

namespace moe {

namespace fs = std::filesystem;

namespace {

constexpr const char* kEosToken = "<|endoftext|>";

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

nlohmann::json added_token(int64_t id, const std::string& content) {
  return {{"id", id},          {"content", content}, {"single_word", false}, {"lstrip", false},
          {"rstrip", false},   {"normalized", false}, {"special", true}};
}

// tokenizer_config.json for a tokenizer whose EOS is `eos` (content) at id eos_id.
nlohmann::json tokenizer_config(const Config& cfg, const std::string& eos) {
  nlohmann::json j = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                      {"model_max_length", cfg.train.seq_len},
                      {"clean_up_tokenization_spaces", false},
                      {"add_bos_token", false},
                      {"add_eos_token", false},
                      {"bos_token", nullptr},
                      {"eos_token", eos.empty() ? nlohmann::json(nullptr) : nlohmann::json(eos)},
                      {"pad_token", eos.empty() ? nlohmann::json(nullptr) : nlohmann::json(eos)},
                      {"unk_token", nullptr}};
  if (!eos.empty()) {
    nlohmann::json t = added_token(cfg.data.eos_id, eos);
    t.erase("id");
    j["added_tokens_decoder"] = {{std::to_string(cfg.data.eos_id), t}};
  }
  return j;
}

nlohmann::json special_tokens_map(const std::string& eos) {
  if (eos.empty()) return nlohmann::json::object();
  return {{"eos_token", eos}, {"pad_token", eos}};
}

// The content of id `id` in an HF tokenizer.json (an added token first, then model.vocab), or "".
std::string token_of_id(const nlohmann::json& tok, int64_t id) {
  if (tok.contains("added_tokens") && tok["added_tokens"].is_array())
    for (const auto& t : tok["added_tokens"])
      if (t.is_object() && t.value("id", int64_t(-1)) == id && t.contains("content") && t["content"].is_string())
        return t["content"].get<std::string>();
  for (const auto& [k, v] : tok["model"]["vocab"].items())
    if (v.is_number_integer() && v.get<int64_t>() == id) return k;
  return "";
}

}  // namespace

std::string gpt2_byte_char(int b) {
  MOE_CHECK(b >= 0 && b < 256, "gpt2_byte_char: expected a byte, got ", b);
  auto printable = [](int c) { return (c >= 33 && c <= 126) || (c >= 161 && c <= 172) || (c >= 174 && c <= 255); };
  if (printable(b)) return utf8(uint32_t(b));
  int n = 0;  // non-printable bytes before b
  for (int c = 0; c < b; ++c) n += !printable(c);
  return utf8(uint32_t(256 + n));
}

nlohmann::json byte_level_tokenizer_json(int64_t eos_id, int64_t vocab_size) {
  MOE_CHECK(vocab_size >= 256 && eos_id >= 0 && eos_id < vocab_size, "the byte-level tokenizer needs ",
            "model.vocab_size >= 256 and data.eos_id in [0, model.vocab_size), got vocab_size ", vocab_size,
            " and eos_id ", eos_id);
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b)
    if (b != eos_id) vocab[gpt2_byte_char(b)] = b;
  vocab[kEosToken] = eos_id;
  const nlohmann::json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", nlohmann::json::array({added_token(eos_id, kEosToken)})},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level},
          {"post_processor", nullptr},
          {"decoder", byte_level},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"ignore_merges", false},
            {"vocab", vocab},
            {"merges", nlohmann::json::array()}}}};
}

std::string export_hf_tokenizer(const Config& cfg, const std::string& tokenizer, const std::string& out_dir) {
  const fs::path out(out_dir);
  const std::string& src = tokenizer;
  if (src.empty()) {
    if (cfg.data.source != "embedded")
      return "tokenizer: none (the run records no tokenizer: give --tokenizer tokenizer.json, or set data.tokenizer)";
    const nlohmann::json tok = byte_level_tokenizer_json(cfg.data.eos_id, cfg.model.vocab_size);
    write_file_atomic((out / "tokenizer.json").string(), tok.dump(2) + "\n");
    write_file_atomic((out / "tokenizer_config.json").string(), tokenizer_config(cfg, kEosToken).dump(2) + "\n");
    write_file_atomic((out / "special_tokens_map.json").string(), special_tokens_map(kEosToken).dump(2) + "\n");
    return "tokenizer: the embedded corpus's byte-level vocabulary (id = byte, EOS " + std::to_string(cfg.data.eos_id) +
           " = <|endoftext|>)";
  }
  const std::string text = read_regular_file(src);
  const nlohmann::json tok = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  MOE_CHECK(!tok.is_discarded() && tok.is_object() && tok.contains("model") && tok["model"].is_object() &&
                tok["model"].contains("vocab") && tok["model"]["vocab"].is_object(),
            "tokenizer '", src, "' is not a Hugging Face tokenizer.json: expected a JSON object with a model.vocab object");
  int64_t max_id = -1;
  for (const auto& [k, v] : tok["model"]["vocab"].items())
    if (v.is_number_integer()) max_id = std::max(max_id, v.get<int64_t>());
  if (tok.contains("added_tokens") && tok["added_tokens"].is_array())
    for (const auto& t : tok["added_tokens"])
      if (t.is_object() && t.contains("id") && t["id"].is_number_integer())
        max_id = std::max(max_id, t["id"].get<int64_t>());
  MOE_CHECK(max_id < cfg.model.vocab_size, "tokenizer '", src, "' has ids up to ", max_id,
            " but the model's vocabulary is model.vocab_size = ", cfg.model.vocab_size,
            ": expected the tokenizer the model was trained with");
  write_file_atomic((out / "tokenizer.json").string(), text);
  const fs::path beside = fs::path(src).parent_path();
  const std::string eos = token_of_id(tok, cfg.data.eos_id);
  std::string from = "tokenizer: " + src;
  for (const auto& [name, made] : {std::pair<std::string, nlohmann::json>{"tokenizer_config.json", tokenizer_config(cfg, eos)},
                                   {"special_tokens_map.json", special_tokens_map(eos)}}) {
    const fs::path there = beside / name;
    if (fs::is_regular_file(there)) {
      write_file_atomic((out / name).string(), read_regular_file(there.string()));
      from += ", " + name + " copied";
    } else {
      write_file_atomic((out / name).string(), made.dump(2) + "\n");
      from += ", " + name + " written (eos " + (eos.empty() ? "none" : eos) + ")";
    }
  }
  return from;
}

}  // namespace moe
