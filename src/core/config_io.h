// Reading, overriding, checking and writing the run configuration (core/config.h). One table
// of keys ("section.key", type, field accessor, allowed values, description) drives the TOML
// parser, command-line overrides, enum checks, serialisation and the --help listing.
// Errors are moe::Error naming the key, the source (file:line or the override) and the value.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "core/config.h"

namespace moe {

// kUint is a TOML integer that must be >= 0 (stored as uint64_t, e.g. train.seed). kSourceList is
// an array of tables { paths = [...], weight = w } (data.sources: `[[data.sources]]` in a file).
enum class ConfigType { kInt, kUint, kFloat, kBool, kString, kStringList, kIntList, kSourceList };

// Pointer to the Config field a key names; the alternative always matches the key's type.
using ConfigField = std::variant<int64_t*, uint64_t*, double*, bool*, std::string*, std::vector<std::string>*,
                                 std::vector<int64_t>*, std::vector<DataSourceConfig>*>;

struct ConfigKey {
  std::string name;  // "section.key"
  ConfigType type;
  std::vector<std::string> choices;  // allowed values of a string key; empty: any string
  std::string description;           // one line, for --help and docs
  std::function<ConfigField(Config&)> field;

  std::string section() const { return name.substr(0, name.find('.')); }
  std::string leaf() const { return name.substr(name.find('.') + 1); }
};

// Upper bounds validate_config puts on sizes, far beyond any machine and low enough that every
// product derived from them (parameters, offsets, tokens, activations) stays far from int64
// overflow. A config beyond them is refused naming the key and the bound.
inline constexpr int64_t kMaxVocabSize = 2147483647;          // model.vocab_size: token ids are int32
inline constexpr int64_t kMaxWidth = int64_t(1) << 16;         // model.d_model, n_heads, n_kv_heads
inline constexpr int64_t kMaxLayers = int64_t(1) << 14;        // model.n_layers
inline constexpr int64_t kMaxHidden = int64_t(1) << 20;        // model.dense_hidden, moe.expert_hidden
inline constexpr int64_t kMaxExperts = int64_t(1) << 16;       // moe.num_experts
inline constexpr int64_t kMaxSharedExperts = int64_t(1) << 10;  // moe.shared_experts
inline constexpr int64_t kMaxSeqLen = int64_t(1) << 24;        // train.seq_len
inline constexpr int64_t kMaxMicroBatch = int64_t(1) << 24;    // train.micro_batch
inline constexpr int64_t kMaxGlobalBatch = int64_t(1) << 32;   // train.global_batch
inline constexpr int64_t kMaxSteps = int64_t(1) << 40;         // train.steps (and a checkpoint's step)
inline constexpr int64_t kMaxEvalBatches = int64_t(1) << 20;   // train.eval_batches
inline constexpr int64_t kMaxRanks = int64_t(1) << 20;         // parallel.dp, parallel.ep
inline constexpr double kMaxTimeoutSeconds = 31536000.0;       // parallel.timeout_s: a year
// Bounds on what the keys multiply to (estimated from the keys, before any layout is built).
inline constexpr int64_t kMaxParams = int64_t(1) << 48;
inline constexpr int64_t kMaxTokensPerMicroBatch = int64_t(1) << 32;
inline constexpr int64_t kMaxTokensPerStep = int64_t(1) << 48;
inline constexpr int64_t kMaxActivationElements = int64_t(1) << 52;  // of one micro-batch

// "A:B" (or "N": A = B = N) as two step numbers; false when the text is not of that form
// (log.trace; validate_config checks the range against train.steps).
bool parse_step_range(std::string_view text, int64_t* first, int64_t* last);

// Every key, in section order (model, moe, train, optim, data, parallel, checkpoint, run, log).
const std::vector<ConfigKey>& config_keys();
// The key called `name` ("section.key"), or nullptr.
const ConfigKey* find_config_key(std::string_view name);
// Type name as shown in --help: "int", "uint", "float", "bool", "string", "string list", "int list",
// "table list".
const char* config_type_name(ConfigType t);

// The valid key nearest to `key` (edit distance over full dotted names, over names within the
// same section, and over key names in other sections), or "" when nothing is close.
std::string nearest_key(const std::string& key);

// Parses TOML text into a Config that starts from the defaults; keys not in the text keep
// their defaults. Unknown keys, wrong types and values outside an enum's choices throw (all
// problems of the text in one message, with line numbers). Does not run validate_config.
Config parse_config_toml(std::string_view text, const std::string& source_name);

// Applies "--section.key=value" (or "section.key=value"). The value is parsed by the key's
// type: integers, floats (1e-3), true/false, strings (bare or quoted), lists as a TOML array
// "[0, 1]" or comma-separated "0,1" (an empty value is an empty list); data.sources as a TOML
// array of inline tables '[{paths = ["a.npy"], weight = 0.7}, ...]' (empty: none).
void apply_override(Config& c, const std::string& arg);

// Defaults (empty path) or the file at `path` (its relative data.paths, data.sources paths, data.tokenizer and
// data.eval_paths taken relative to the file's directory), then `overrides` in order, then validate_config.
Config load_config(const std::string& path, const std::vector<std::string>& overrides);

// Throws moe::Error listing every rule the config breaks, each naming its key(s) and values.
void validate_config(const Config& c);

// Every key, grouped by [section], one `key = value` per line. parse_config_toml of the result
// gives back exactly `c` (floats in shortest round-trip form, always with '.' or an exponent).
std::string config_to_toml(const Config& c);

// A key whose value differs between two configs, with both values as TOML text.
struct ConfigDifference {
  std::string key, a, b;
};
// The keys of `sections` ("model", "moe", ...) whose values differ between `a` and `b`, in
// table order.
std::vector<ConfigDifference> config_differences(const Config& a, const Config& b,
                                                 const std::vector<std::string>& sections);

// All keys with type, default and description, grouped by section (for `moecore train --help`).
std::string config_help();

}  // namespace moe
