// The config key table and everything driven by it: TOML parsing (toml++), "--section.key=value"
// overrides, validation, serialisation and the --help listing. Key suggestions use the optimal
// string alignment distance (Levenshtein plus adjacent transpositions). Floats are written in
// the shortest form that reads back to the same double, so config_to_toml round-trips exactly.
#include "core/config_io.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>

#include "core/error.h"

namespace moe {
namespace {

template <typename T>
constexpr ConfigType type_of() {
  if constexpr (std::is_same_v<T, int64_t>)
    return ConfigType::kInt;
  else if constexpr (std::is_same_v<T, uint64_t>)
    return ConfigType::kUint;
  else if constexpr (std::is_same_v<T, double>)
    return ConfigType::kFloat;
  else if constexpr (std::is_same_v<T, bool>)
    return ConfigType::kBool;
  else if constexpr (std::is_same_v<T, std::string>)
    return ConfigType::kString;
  else if constexpr (std::is_same_v<T, std::vector<std::string>>)
    return ConfigType::kStringList;
  else if constexpr (std::is_same_v<T, std::vector<DataSourceConfig>>)
    return ConfigType::kSourceList;
  else {
    static_assert(std::is_same_v<T, std::vector<int64_t>>, "unsupported config field type");
    return ConfigType::kIntList;
  }
}

// One table entry; the type comes from the field itself so the two can never disagree.
template <typename S, typename T>
ConfigKey entry(std::string name, S Config::*section, T S::*member, std::string description,
                std::vector<std::string> choices = {}) {
  return ConfigKey{std::move(name), type_of<T>(), std::move(choices), std::move(description),
                   [section, member](Config& c) -> ConfigField { return &((c.*section).*member); }};
}

std::vector<ConfigKey> build_keys() {
  using C = Config;
  using M = ModelConfig;
  using E = MoeConfig;
  using T = TrainConfig;
  using O = OptimConfig;
  using D = DataConfig;
  using P = ParallelConfig;
  using K = CheckpointConfig;
  return {
      entry("model.vocab_size", &C::model, &M::vocab_size, "vocabulary size; token ids are in [0, vocab_size)"),
      entry("model.d_model", &C::model, &M::d_model, "hidden size of the residual stream"),
      entry("model.n_layers", &C::model, &M::n_layers, "number of transformer blocks"),
      entry("model.n_heads", &C::model, &M::n_heads, "attention query heads; head_dim = d_model / n_heads"),
      entry("model.n_kv_heads", &C::model, &M::n_kv_heads,
            "key/value heads (grouped-query attention); must divide n_heads"),
      entry("model.qk_norm", &C::model, &M::qk_norm, "RMSNorm on each head's queries and keys before RoPE"),
      entry("model.rope_theta", &C::model, &M::rope_theta, "RoPE base frequency"),
      entry("model.norm_eps", &C::model, &M::norm_eps, "epsilon inside every RMSNorm"),
      entry("model.dense_layers", &C::model, &M::dense_layers,
            "indices of layers with a dense MLP instead of an MoE layer"),
      entry("model.dense_hidden", &C::model, &M::dense_hidden, "hidden size of the dense SwiGLU MLP"),
      entry("model.init_std", &C::model, &M::init_std, "standard deviation of the normal weight init"),

      entry("moe.num_experts", &C::moe, &E::num_experts, "routed experts per MoE layer"),
      entry("moe.top_k", &C::moe, &E::top_k, "experts each token is routed to"),
      entry("moe.expert_hidden", &C::moe, &E::expert_hidden, "hidden size of each expert's SwiGLU MLP"),
      entry("moe.shared_experts", &C::moe, &E::shared_experts,
            "shared experts seen by every token, one MLP of hidden shared_experts * expert_hidden; 0: none"),
      entry("moe.router", &C::moe, &E::router, "router score function", {"softmax", "sigmoid"}),
      entry("moe.norm_topk_prob", &C::moe, &E::norm_topk_prob,
            "renormalise the top-k router weights to sum to 1"),
      entry("moe.lb_loss_weight", &C::moe, &E::lb_loss_weight,
            "weight of the load-balancing loss E * sum_i(f_i * P_i)"),
      entry("moe.z_loss_weight", &C::moe, &E::z_loss_weight,
            "weight of the router z-loss mean(logsumexp(logits)^2)"),
      entry("moe.bias_update_rate", &C::moe, &E::bias_update_rate,
            "step of the aux-loss-free expert bias (selection only, updated from real counts); 0 disables"),
      entry("moe.capacity_factor", &C::moe, &E::capacity_factor,
            "expert capacity = capacity_factor * tokens * top_k / num_experts; 0: dropless"),
      entry("moe.routing", &C::moe, &E::routing,
            "learned: the router chooses; random / uniform: fixed routing for system benchmarks",
            {"learned", "random", "uniform"}),

      entry("train.seq_len", &C::train, &T::seq_len, "tokens per sequence"),
      entry("train.micro_batch", &C::train, &T::micro_batch, "sequences per rank per micro-step"),
      entry("train.global_batch", &C::train, &T::global_batch,
            "sequences per optimizer step (micro-steps accumulate up to it)"),
      entry("train.steps", &C::train, &T::steps, "optimizer steps to run"),
      entry("train.seed", &C::train, &T::seed, "seed of initialisation, data order and random routing"),
      entry("train.precision", &C::train, &T::precision,
            "matmul precision (master weights stay fp32): fp32 (cpu), bf16 (cuda), fp8 (cuda: block-scaled FP8 GEMMs; cpu: the FP8 recipe emulated)",
            {"fp32", "bf16", "fp8"}),
      entry("train.fp8_scaling", &C::train, &T::fp8_scaling,
            "scaling of train.precision = \"fp8\": blocks (1 x 128 activations, 128 x 128 weights, FP32 scales), "
            "mx (MXFP8: 1 x 32 blocks, E8M0 scales, OCP floor rule; cuda: re-blocked for Hopper's GEMMs) or "
            "mx_no_saturation (E8M0 rounded up)",
            {"blocks", "mx", "mx_no_saturation"}),
      entry("train.recompute", &C::train, &T::recompute, "activation recomputation in backward",
            {"none", "selective", "full"}),
      entry("train.device", &C::train, &T::device, "where to run; auto: cuda when a GPU is present, else cpu",
            {"auto", "cpu", "cuda"}),
      entry("train.eval_interval", &C::train, &T::eval_interval, "steps between evaluations; 0: no evaluation"),
      entry("train.eval_batches", &C::train, &T::eval_batches, "micro-batches per evaluation"),

      entry("optim.lr", &C::optim, &O::lr, "peak learning rate, reached at the end of warmup"),
      entry("optim.min_lr", &C::optim, &O::min_lr, "learning rate at the end of the schedule"),
      entry("optim.warmup_steps", &C::optim, &O::warmup_steps, "steps of linear warmup from 0 to lr"),
      entry("optim.schedule", &C::optim, &O::schedule, "decay from lr to min_lr after warmup",
            {"cosine", "linear", "constant"}),
      entry("optim.beta1", &C::optim, &O::beta1, "AdamW first-moment decay"),
      entry("optim.beta2", &C::optim, &O::beta2, "AdamW second-moment decay"),
      entry("optim.eps", &C::optim, &O::eps, "AdamW epsilon added to the root of the second moment"),
      entry("optim.weight_decay", &C::optim, &O::weight_decay, "AdamW decoupled weight decay"),
      entry("optim.grad_clip", &C::optim, &O::grad_clip,
            "clip the global gradient norm to this; 0: no clipping"),
      entry("optim.moment_dtype", &C::optim, &O::moment_dtype,
            "storage of the two AdamW moments (the update computes in FP32); bf16 halves their memory and traffic",
            {"fp32", "bf16"}),
      entry("optim.deferred_update", &C::optim, &O::deferred_update,
            "GPU: apply each step's update in the next step, block by block on a second stream just before "
            "the block's forward (the same values); not with parallel.zero"),
      entry("optim.deferred_update_sms", &C::optim, &O::deferred_update_sms,
            "with optim.deferred_update: multiprocessors the blocks' update runs on while the forward's GEMMs "
            "leave them free; 0: the update shares every multiprocessor with the forward"),

      entry("data.source", &C::data, &D::source,
            "embedded: the built-in corpus; tokens: the token files in data.paths", {"embedded", "tokens"}),
      entry("data.sources", &C::data, &D::sources,
            "weighted mix: [[data.sources]] tables, each paths = [token files] and weight > 0 (instead of data.paths)"),
      entry("data.paths", &C::data, &D::paths,
            "token files (flat arrays of token_dtype) for source = \"tokens\""),
      entry("data.token_dtype", &C::data, &D::token_dtype, "integer type of the token files",
            {"uint16", "uint32"}),
      entry("data.eos_id", &C::data, &D::eos_id, "end-of-document token id"),
      entry("data.eval_paths", &C::data, &D::eval_paths, "held-out token files for evaluation"),
      entry("data.tokenizer", &C::data, &D::tokenizer,
            "the tokenizer.json the token files were made with (generate and export-hf use it); \"\": none"),

      entry("parallel.dp", &C::parallel, &P::dp, "data-parallel ranks; 0: world_size / pp"),
      entry("parallel.ep", &C::parallel, &P::ep,
            "expert-parallel group size: experts sharded over ep ranks, replicated over dp / ep groups"),
      entry("parallel.pp", &C::parallel, &P::pp,
            "pipeline stages: world = pp x dp, stage s holds a contiguous range of layers (CPU backend)"),
      entry("parallel.virtual_stages", &C::parallel, &P::virtual_stages,
            "model chunks per pipeline rank; > 1: interleaved 1F1B (micro-batches a multiple of pp)"),
      entry("parallel.pp_layers", &C::parallel, &P::pp_layers,
            "layers of each model stage (pp x virtual_stages counts summing to model.n_layers); empty: even split"),
      entry("parallel.ep_backend", &C::parallel, &P::ep_backend, "token exchange between expert-parallel ranks",
            {"alltoall", "rowwise"}),
      entry("parallel.ep_capacity_factor", &C::parallel, &P::ep_capacity_factor,
            "rowwise exchange: each expert takes at most ceil(factor x the ep group's routed rows / num_experts) "
            "rows, source rank by source rank; 0: dropless"),
      entry("parallel.zero", &C::parallel, &P::zero,
            "ZeRO-1 with dp > 1: AdamW moments sharded over data-parallel ranks (false: replicated)"),
      entry("parallel.timeout_s", &C::parallel, &P::timeout_s,
            "seconds a collective may wait for the other ranks before the job fails"),
      entry("parallel.overlap_grad_reduce", &C::parallel, &P::overlap_grad_reduce,
            "GPU data parallel: all-reduce each block's gradients on a second stream while backward goes on"),
      entry("parallel.grad_reduce_dtype", &C::parallel, &P::grad_reduce_dtype,
            "GPU data parallel: type of the gradient sums over ranks (all-reduce and ZeRO-1 reduce-scatter); bf16 "
            "halves the traffic and rounds every partial sum to BF16",
            {"fp32", "bf16"}),

      entry("checkpoint.dir", &C::checkpoint, &K::dir, "checkpoint directory; empty: <run.dir>/checkpoints"),
      entry("checkpoint.enabled", &C::checkpoint, &K::enabled,
            "false: no checkpoint is written, at intervals, at the end or on a stop signal"),
      entry("checkpoint.interval", &C::checkpoint, &K::interval,
            "steps between checkpoints; 0: only at the end"),
      entry("checkpoint.keep_last", &C::checkpoint, &K::keep_last, "newest checkpoints kept; 0: keep all"),
      entry("checkpoint.resume", &C::checkpoint, &K::resume,
            "auto: newest checkpoint in dir if any; none: fresh start; else a checkpoint path"),

      entry("run.dir", &C::run, &RunConfig::dir,
            "run directory: resolved config.toml, metrics.jsonl, checkpoints"),

      entry("log.interval", &C::log, &LogConfig::interval, "steps between metric lines"),
      entry("log.trace", &C::log, &LogConfig::trace,
            "steps A:B (or one step N) whose every phase goes to RUN_DIR/trace.json (Chrome trace events, "
            "Perfetto); GPU: those steps run eagerly, without the CUDA graph; empty: no trace"),
      entry("log.phase_times", &C::log, &LogConfig::phase_times,
            "GPU: per-phase times in metrics.jsonl from the last step of every log interval, run eagerly with CUDA "
            "events (the CPU step always records them)"),
  };
}

// Read access through the table's accessor (which only hands out a pointer into `c`).
ConfigField field_of(const ConfigKey& k, const Config& c) { return k.field(const_cast<Config&>(c)); }

template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;

// ---------------------------------------------------------------- text helpers

std::string to_lower(std::string_view s) {
  std::string out(s);
  for (char& ch : out) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return out;
}

std::string_view trim(std::string_view s) {
  const char* ws = " \t\r\n";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? sep : "") + parts[i];
  return out;
}

// Optimal string alignment distance: insertions, deletions, substitutions, adjacent swaps.
int edit_distance(std::string_view a, std::string_view b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<int>> d(n + 1, std::vector<int>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = static_cast<int>(i);
  for (size_t j = 0; j <= m; ++j) d[0][j] = static_cast<int>(j);
  for (size_t i = 1; i <= n; ++i) {
    for (size_t j = 1; j <= m; ++j) {
      const int cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[n][m];
}

// TOML basic string with escapes.
std::string quote(std::string_view s) {
  std::string out = "\"";
  for (char ch : s) {
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(ch)));
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

// Shortest round-trip form, always a TOML float: "0.003", "10000.0", "1e-8", "nan", "-inf".
std::string format_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, res.ptr);
  const size_t e = s.find('e');
  if (e == std::string::npos) {
    if (s.find('.') == std::string::npos) s += ".0";
    return s;
  }
  std::string mantissa = s.substr(0, e), exponent = s.substr(e + 1);
  std::string sign;
  if (!exponent.empty() && (exponent[0] == '-' || exponent[0] == '+')) {
    if (exponent[0] == '-') sign = "-";
    exponent.erase(0, 1);
  }
  exponent.erase(0, std::min(exponent.find_first_not_of('0'), exponent.size() - 1));
  return mantissa + "e" + sign + exponent;
}

std::string format_value(const ConfigField& f) {
  return std::visit(Overloaded{
                        [](const int64_t* p) { return std::to_string(*p); },
                        [](const uint64_t* p) { return std::to_string(*p); },
                        [](const double* p) { return format_float(*p); },
                        [](const bool* p) { return std::string(*p ? "true" : "false"); },
                        [](const std::string* p) { return quote(*p); },
                        [](const std::vector<std::string>* p) {
                          std::vector<std::string> parts;
                          for (const auto& s : *p) parts.push_back(quote(s));
                          return "[" + join(parts, ", ") + "]";
                        },
                        [](const std::vector<int64_t>* p) {
                          std::vector<std::string> parts;
                          for (int64_t v : *p) parts.push_back(std::to_string(v));
                          return "[" + join(parts, ", ") + "]";
                        },
                        [](const std::vector<DataSourceConfig>* p) {
                          std::vector<std::string> parts;
                          for (const DataSourceConfig& s : *p) {
                            std::vector<std::string> paths;
                            for (const auto& path : s.paths) paths.push_back(quote(path));
                            parts.push_back("{ paths = [" + join(paths, ", ") + "], weight = " + format_float(s.weight) +
                                            " }");
                          }
                          return "[" + join(parts, ", ") + "]";
                        },
                    },
                    f);
}

// ---------------------------------------------------------------- key and choice lookup

std::vector<std::string> section_names() {
  std::vector<std::string> out;
  for (const auto& k : config_keys())
    if (out.empty() || out.back() != k.section()) out.push_back(k.section());
  return out;
}

bool is_section(const std::string& s) {
  const auto names = section_names();
  return std::find(names.begin(), names.end(), s) != names.end();
}

std::string unknown_key_message(const std::string& key, const std::string& where) {
  std::string msg = "unknown key '" + key + "' in " + where;
  const std::string near = nearest_key(key);
  if (!near.empty()) return msg + "; did you mean '" + near + "'?";
  return msg + " (`moecore train --help` lists every key)";
}

// "" when `value` is allowed, else the message.
std::string check_choice(const ConfigKey& k, const std::string& value) {
  if (k.choices.empty() || std::find(k.choices.begin(), k.choices.end(), value) != k.choices.end()) return "";
  std::vector<std::string> quoted;
  const std::string* best = nullptr;
  int best_d = INT_MAX;
  for (const auto& ch : k.choices) {
    quoted.push_back(quote(ch));
    const int d = edit_distance(to_lower(value), ch);
    if (d < best_d) best_d = d, best = &ch;
  }
  std::string msg = k.name + ": expected one of " + join(quoted, ", ") + ", got " + quote(value);
  if (best && best_d <= 2) msg += "; did you mean " + quote(*best) + "?";
  return msg;
}

// ---------------------------------------------------------------- assignment from TOML nodes

std::string describe(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string:
      return "the string " + quote(n.as_string()->get());
    case toml::node_type::integer:
      return "the integer " + std::to_string(n.as_integer()->get());
    case toml::node_type::floating_point:
      return "the float " + format_float(n.as_floating_point()->get());
    case toml::node_type::boolean:
      return std::string("the boolean ") + (n.as_boolean()->get() ? "true" : "false");
    case toml::node_type::array:
      return "an array";
    case toml::node_type::table:
      return "a table";
    case toml::node_type::date:
      return "a date";
    case toml::node_type::time:
      return "a time";
    case toml::node_type::date_time:
      return "a date-time";
    default:
      return "nothing";
  }
}

const char* expected_phrase(ConfigType t) {
  switch (t) {
    case ConfigType::kInt:
      return "an integer";
    case ConfigType::kUint:
      return "a non-negative integer";
    case ConfigType::kFloat:
      return "a number";
    case ConfigType::kBool:
      return "a boolean (true or false)";
    case ConfigType::kString:
      return "a string";
    case ConfigType::kStringList:
      return "an array of strings";
    case ConfigType::kIntList:
      return "an array of integers";
    case ConfigType::kSourceList:
      return "an array of tables { paths = [\"file\", ...], weight = number }";
  }
  return "?";
}

// Writes node `n` into the field of `k`; returns "" or the error (naming the key, no location).
std::string assign_node(const ConfigKey& k, const toml::node& n, Config& c) {
  const std::string bad = k.name + ": expected " + expected_phrase(k.type) + ", got " + describe(n);
  return std::visit(Overloaded{
                        [&](int64_t* p) -> std::string {
                          if (!n.is_integer()) return bad;
                          *p = n.as_integer()->get();
                          return "";
                        },
                        [&](uint64_t* p) -> std::string {
                          if (!n.is_integer() || n.as_integer()->get() < 0) return bad;
                          *p = static_cast<uint64_t>(n.as_integer()->get());
                          return "";
                        },
                        [&](double* p) -> std::string {
                          if (n.is_integer())
                            *p = static_cast<double>(n.as_integer()->get());
                          else if (n.is_floating_point())
                            *p = n.as_floating_point()->get();
                          else
                            return bad;
                          return "";
                        },
                        [&](bool* p) -> std::string {
                          if (!n.is_boolean()) return bad;
                          *p = n.as_boolean()->get();
                          return "";
                        },
                        [&](std::string* p) -> std::string {
                          if (!n.is_string()) return bad;
                          const std::string v = n.as_string()->get();
                          std::string err = check_choice(k, v);
                          if (err.empty()) *p = v;
                          return err;
                        },
                        [&](std::vector<std::string>* p) -> std::string {
                          const toml::array* a = n.as_array();
                          if (!a) return bad;
                          std::vector<std::string> out;
                          for (size_t i = 0; i < a->size(); ++i) {
                            if (!(*a)[i].is_string())
                              return k.name + ": expected " + expected_phrase(k.type) + ", element " +
                                     std::to_string(i) + " is " + describe((*a)[i]);
                            out.push_back((*a)[i].as_string()->get());
                          }
                          *p = std::move(out);
                          return "";
                        },
                        [&](std::vector<int64_t>* p) -> std::string {
                          const toml::array* a = n.as_array();
                          if (!a) return bad;
                          std::vector<int64_t> out;
                          for (size_t i = 0; i < a->size(); ++i) {
                            if (!(*a)[i].is_integer())
                              return k.name + ": expected " + expected_phrase(k.type) + ", element " +
                                     std::to_string(i) + " is " + describe((*a)[i]);
                            out.push_back((*a)[i].as_integer()->get());
                          }
                          *p = std::move(out);
                          return "";
                        },
                        [&](std::vector<DataSourceConfig>* p) -> std::string {
                          const toml::array* a = n.as_array();
                          if (!a) return bad;
                          std::vector<DataSourceConfig> out;
                          for (size_t i = 0; i < a->size(); ++i) {
                            const std::string at = k.name + "[" + std::to_string(i) + "]";
                            const toml::table* t = (*a)[i].as_table();
                            if (!t) return at + ": expected a table { paths = [...], weight = w }, got " + describe((*a)[i]);
                            DataSourceConfig src;
                            bool has_paths = false, has_weight = false;
                            for (auto&& [key, node] : *t) {
                              const std::string name(key.str());
                              if (name == "paths") {
                                const toml::array* list = node.as_array();
                                if (!list) return at + ".paths: expected an array of strings, got " + describe(node);
                                for (size_t j = 0; j < list->size(); ++j) {
                                  if (!(*list)[j].is_string())
                                    return at + ".paths: expected an array of strings, element " + std::to_string(j) +
                                           " is " + describe((*list)[j]);
                                  src.paths.push_back((*list)[j].as_string()->get());
                                }
                                has_paths = true;
                              } else if (name == "weight") {
                                if (node.is_integer())
                                  src.weight = static_cast<double>(node.as_integer()->get());
                                else if (node.is_floating_point())
                                  src.weight = node.as_floating_point()->get();
                                else
                                  return at + ".weight: expected a number, got " + describe(node);
                                has_weight = true;
                              } else {
                                const bool near = edit_distance(to_lower(name), "paths") <= 2 ||
                                                  edit_distance(to_lower(name), "weight") <= 2;
                                return at + ": unknown key '" + name + "' (a source has the keys paths and weight)" +
                                       (near ? "; did you mean '" +
                                                   std::string(edit_distance(to_lower(name), "paths") <= 2 ? "paths" : "weight") +
                                                   "'?"
                                             : "");
                              }
                            }
                            if (!has_paths) return at + ": missing key 'paths' (the source's token files)";
                            if (!has_weight) return at + ": missing key 'weight' (its share of the instances, > 0)";
                            out.push_back(std::move(src));
                          }
                          *p = std::move(out);
                          return "";
                        },
                    },
                    k.field(c));
}

std::string location(const std::string& source, const toml::source_region& r) {
  if (r.begin.line == 0) return source;
  return source + ":" + std::to_string(r.begin.line);
}

// ---------------------------------------------------------------- assignment from override text

std::optional<int64_t> parse_int(std::string_view s) {
  if (!s.empty() && s[0] == '+') s.remove_prefix(1);
  int64_t v = 0;
  const auto res = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || res.ec != std::errc() || res.ptr != s.data() + s.size()) return std::nullopt;
  return v;
}

std::optional<double> parse_float(std::string_view s) {
  if (!s.empty() && s[0] == '+') s.remove_prefix(1);
  double v = 0;
  const auto res = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || res.ec != std::errc() || res.ptr != s.data() + s.size()) return std::nullopt;
  return v;
}

// Parses `text` as the TOML value of `v = text`; throws toml::parse_error.
toml::table parse_toml_value(std::string_view text) { return toml::parse("v = " + std::string(text)); }

// A string value may be bare, 'literal' or "basic with \escapes"; returns nullopt on a bad quote,
// including a quote at one end only (`--run.dir="abc` whose closing quote the shell ate).
std::optional<std::string> unquote(std::string_view s) {
  const auto is_quote = [](char c) { return c == '"' || c == '\''; };
  if (!s.empty() && (is_quote(s.front()) || is_quote(s.back())) &&
      (s.size() < 2 || s.front() != s.back()))
    return std::nullopt;
  if (s.size() >= 2 && s.front() == '\'' && s.back() == '\'') return std::string(s.substr(1, s.size() - 2));
  if (s.size() >= 2 && s.front() == '"' && s.back() == '"') {
    try {
      const toml::table t = parse_toml_value(s);
      if (const auto* v = t["v"].as_string()) return v->get();
    } catch (const toml::parse_error&) {
    }
    return std::nullopt;
  }
  return std::string(s);
}

std::string assign_text(const ConfigKey& k, std::string_view text, Config& c) {
  text = trim(text);
  const std::string bad = k.name + ": expected " + expected_phrase(k.type) + ", got " + quote(text);
  if (k.type == ConfigType::kSourceList) {  // a TOML array of inline tables; empty: no sources
    if (text.empty()) {
      std::get<std::vector<DataSourceConfig>*>(k.field(c))->clear();
      return "";
    }
    toml::table t;
    try {
      t = parse_toml_value(text);
    } catch (const toml::parse_error& e) {
      return bad + " (not a valid TOML array of inline tables, e.g. '[{paths = [\"a.npy\"], weight = 0.7}, "
                   "{paths = [\"b.npy\"], weight = 0.3}]': " + std::string(e.description()) + ")";
    }
    return assign_node(k, *t.get("v"), c);
  }
  const bool is_list = k.type == ConfigType::kIntList || k.type == ConfigType::kStringList;
  if (is_list && !text.empty() && text.front() == '[') {
    toml::table t;
    try {
      t = parse_toml_value(text);
    } catch (const toml::parse_error& e) {
      return bad + " (not a valid TOML array: " + std::string(e.description()) + ")";
    }
    return assign_node(k, *t.get("v"), c);
  }
  if (is_list) {  // comma-separated; an empty value is an empty list
    std::vector<std::string_view> items;
    if (!text.empty()) {
      size_t start = 0;
      while (true) {
        const size_t comma = text.find(',', start);
        items.push_back(trim(text.substr(start, comma == std::string_view::npos ? text.npos : comma - start)));
        if (comma == std::string_view::npos) break;
        start = comma + 1;
      }
    }
    std::vector<int64_t> ints;
    std::vector<std::string> strings;
    for (size_t i = 0; i < items.size(); ++i) {
      const std::string elem = k.name + ": expected " + expected_phrase(k.type) + ", element " +
                               std::to_string(i) + " of " + quote(text) + " is ";
      if (items[i].empty()) return elem + "empty";
      if (k.type == ConfigType::kIntList) {
        const auto v = parse_int(items[i]);
        if (!v) return elem + quote(items[i]);
        ints.push_back(*v);
      } else {
        const auto v = unquote(items[i]);
        if (!v) return elem + "a badly quoted string " + std::string(items[i]);
        strings.push_back(*v);
      }
    }
    std::visit(Overloaded{[&](std::vector<int64_t>* p) { *p = std::move(ints); },
                          [&](std::vector<std::string>* p) { *p = std::move(strings); }, [](auto*) {}},
               k.field(c));
    return "";
  }
  return std::visit(Overloaded{
                        [&](int64_t* p) -> std::string {
                          const auto v = parse_int(text);
                          if (!v) return bad;
                          *p = *v;
                          return "";
                        },
                        [&](uint64_t* p) -> std::string {
                          const auto v = parse_int(text);
                          if (!v || *v < 0) return bad;
                          *p = static_cast<uint64_t>(*v);
                          return "";
                        },
                        [&](double* p) -> std::string {
                          const auto v = parse_float(text);
                          if (!v) return bad;
                          *p = *v;
                          return "";
                        },
                        [&](bool* p) -> std::string {
                          if (text != "true" && text != "false") return bad;
                          *p = text == "true";
                          return "";
                        },
                        [&](std::string* p) -> std::string {
                          const auto v = unquote(text);
                          if (!v)
                            return bad + " (badly quoted: quote the whole value with \"...\" or '...', or "
                                         "neither end)";
                          std::string err = check_choice(k, *v);
                          if (err.empty()) *p = *v;
                          return err;
                        },
                        [&](auto*) -> std::string { return bad; },
                    },
                    k.field(c));
}

// Collects rule violations for validate_config.
struct Problems {
  std::vector<std::string> list;
  template <typename... Parts>
  void need(bool ok, const Parts&... parts) {
    if (!ok) list.push_back(detail::concat(parts...));
  }
};

std::string num(double v) { return format_float(v); }

// A bound as validate_config prints it: "16384 (2^14)" for a power of two, else the number.
std::string bound_text(int64_t v) {
  if (v > 0 && (v & (v - 1)) == 0) return std::to_string(v) + " (2^" + std::to_string(__builtin_ctzll(uint64_t(v))) + ")";
  return std::to_string(v);
}

// Upper estimates, in double (no overflow), of what the model and batch keys ask for; every
// term is at least the corresponding term of count_model (model/layout.h) or, in elements, of
// activation_memory (train/memory_plan.h).
double dense_hidden(const ModelConfig& m) {
  return m.dense_layers.empty() ? 0.0 : double(std::max<int64_t>(m.dense_hidden, 0));
}

double estimated_params(const ModelConfig& m, const MoeConfig& e) {
  const double d = double(m.d_model), experts = double(e.num_experts), hidden = double(e.expert_hidden);
  const double per_layer = 4.0 * d * d + 4.0 * d + d * experts + 3.0 * d * hidden * (experts + double(e.shared_experts)) +
                           3.0 * d * dense_hidden(m);
  return 2.0 * double(m.vocab_size) * d + double(m.n_layers) * per_layer + d;
}

double estimated_activations_per_token(const ModelConfig& m, const MoeConfig& e) {
  const double d = double(m.d_model), k = double(e.top_k), hidden = double(e.expert_hidden);
  const double per_layer = 16.0 * d + 4.0 + 3.0 * dense_hidden(m) +
                           2.0 * double(e.num_experts) + 2.0 * k + 2.0 * k * d + 3.0 * k * hidden +
                           3.0 * double(e.shared_experts) * hidden;
  return double(m.n_layers) * per_layer + 2.0 * double(m.vocab_size) + 3.0 * d + 2.0;
}

}  // namespace

// ---------------------------------------------------------------- public API

const std::vector<ConfigKey>& config_keys() {
  static const std::vector<ConfigKey> keys = build_keys();
  return keys;
}

const ConfigKey* find_config_key(std::string_view name) {
  for (const auto& k : config_keys())
    if (k.name == name) return &k;
  return nullptr;
}

const char* config_type_name(ConfigType t) {
  switch (t) {
    case ConfigType::kInt:
      return "int";
    case ConfigType::kUint:
      return "uint";
    case ConfigType::kFloat:
      return "float";
    case ConfigType::kBool:
      return "bool";
    case ConfigType::kString:
      return "string";
    case ConfigType::kStringList:
      return "string list";
    case ConfigType::kIntList:
      return "int list";
    case ConfigType::kSourceList:
      return "table list";
  }
  return "?";
}

std::string nearest_key(const std::string& key_in) {
  const std::string key = to_lower(key_in);
  const size_t dot = key.find('.');
  const std::string qsec = dot == std::string::npos ? "" : key.substr(0, dot);
  const std::string qleaf = dot == std::string::npos ? key : key.substr(dot + 1);
  const ConfigKey* best = nullptr;
  int best_score = INT_MAX;
  for (const auto& k : config_keys()) {
    const std::string leaf = k.leaf();
    const bool same_section = qsec == k.section();
    const bool contains = qleaf.size() >= 3 && leaf.find(qleaf) != std::string::npos;
    int score = edit_distance(key, k.name);                                        // whole dotted name
    score = std::min(score, edit_distance(qleaf, leaf) + (same_section ? 0 : 1));  // within / across sections
    if (contains) score = std::min(score, same_section ? 2 : 3);                   // a truncated name
    if (score < best_score) best_score = score, best = &k;
  }
  const int limit = std::max<int>(2, static_cast<int>(qleaf.size()) / 2);
  if (!best || best_score > limit || best->name == key_in) return "";
  return best->name;
}

Config parse_config_toml(std::string_view text, const std::string& source_name) {
  toml::table root;
  try {
    root = toml::parse(text, std::string_view(source_name));
  } catch (const toml::parse_error& e) {
    MOE_FAIL("invalid TOML in ", source_name, ":", e.source().begin.line, ":", e.source().begin.column, ": ",
             e.description());
  }
  Config c;
  std::vector<std::pair<uint32_t, std::string>> errors;  // (line, message), reported in line order
  for (auto&& [sec_key, sec_node] : root) {
    const std::string sec(sec_key.str());
    const toml::table* table = sec_node.as_table();
    if (!table) {
      const std::string where = location(source_name, sec_key.source());
      errors.emplace_back(sec_key.source().begin.line, is_section(sec)
                                                           ? "'" + sec + "' must be a table [" + sec +
                                                                 "], got " + describe(sec_node) + " in " + where
                                                           : unknown_key_message(sec, where));
      continue;
    }
    if (table->empty() && !is_section(sec)) {
      std::string msg = "unknown section [" + sec + "] in " + location(source_name, sec_key.source());
      int best_d = INT_MAX;
      std::string best;
      for (const auto& s : section_names())
        if (const int d = edit_distance(to_lower(sec), s); d < best_d) best_d = d, best = s;
      if (best_d <= 2) msg += "; did you mean [" + best + "]?";
      errors.emplace_back(sec_key.source().begin.line, msg);
      continue;
    }
    for (auto&& [k, node] : *table) {
      const std::string full = sec + "." + std::string(k.str());
      const ConfigKey* key = find_config_key(full);
      if (!key) {
        errors.emplace_back(k.source().begin.line,
                            unknown_key_message(full, location(source_name, k.source())));
        continue;
      }
      const std::string err = assign_node(*key, node, c);
      if (!err.empty())
        errors.emplace_back(node.source().begin.line,
                            err + " (in " + location(source_name, node.source()) + ")");
    }
  }
  if (!errors.empty()) {
    std::stable_sort(errors.begin(), errors.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<std::string> msgs;
    for (auto& e : errors) msgs.push_back(std::move(e.second));
    MOE_FAIL(join(msgs, "\n"));
  }
  return c;
}

void apply_override(Config& c, const std::string& arg) {
  std::string_view a = arg;
  if (a.substr(0, 2) == "--") a.remove_prefix(2);
  const size_t eq = a.find('=');
  MOE_CHECK(eq != std::string_view::npos && eq > 0, "override '", arg, "' must look like --section.key=value");
  const std::string name(trim(a.substr(0, eq)));
  const ConfigKey* key = find_config_key(name);
  if (!key) MOE_FAIL(unknown_key_message(name, "override '" + arg + "'"));
  const std::string err = assign_text(*key, a.substr(eq + 1), c);
  if (!err.empty()) MOE_FAIL(err, " (in override '", arg, "')");
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  Config c;
  if (!path.empty()) {
    MOE_CHECK(std::filesystem::is_regular_file(path), "config file '", path,
              "' does not exist or is not a regular file");
    std::ifstream in(path, std::ios::binary);
    MOE_CHECK(in.good(), "cannot open config file '", path, "'");
    std::ostringstream text;
    text << in.rdbuf();
    c = parse_config_toml(text.str(), path);
    // Data paths written in a config file are relative to that file (overrides typed on the
    // command line stay relative to the working directory).
    const std::filesystem::path base = std::filesystem::absolute(path).parent_path();
    std::vector<std::vector<std::string>*> lists = {&c.data.paths, &c.data.eval_paths};
    for (DataSourceConfig& src : c.data.sources) lists.push_back(&src.paths);
    for (std::vector<std::string>* list : lists)
      for (std::string& p : *list)
        if (!p.empty() && std::filesystem::path(p).is_relative()) p = (base / p).lexically_normal().string();
    std::string& tok = c.data.tokenizer;
    if (!tok.empty() && std::filesystem::path(tok).is_relative()) tok = (base / tok).lexically_normal().string();
  }
  for (const auto& o : overrides) apply_override(c, o);
  validate_config(c);
  return c;
}

void validate_config(const Config& c) {
  Problems p;
  // Rules every key of a kind follows: floats are finite, enum strings are one of their choices.
  for (const auto& k : config_keys()) {
    const ConfigField f = field_of(k, c);
    if (const auto* d = std::get_if<double*>(&f))
      p.need(std::isfinite(**d), k.name, " must be finite, got ", num(**d));
    if (const auto* s = std::get_if<std::string*>(&f)) {
      const std::string err = check_choice(k, **s);
      p.need(err.empty(), err);
    }
  }

  // Upper bounds on sizes (config_io.h, kMax*): far beyond any machine, and low enough that the
  // products derived from them (parameters, tokens, offsets) cannot leave int64.
  int sizes_out_of_range = 0;
  auto bounded = [&](const char* name, int64_t v, int64_t lo, int64_t hi, const char* why) {
    sizes_out_of_range += v < lo || v > hi;
    if (v < lo)
      p.need(false, name, lo == 1 ? " must be > 0" : " must be >= 0", ", got ", v);
    else
      p.need(v <= hi, name, " must be <= ", bound_text(hi), ", got ", v, " (", why, ")");
  };
  const ModelConfig& m = c.model;
  bounded("model.vocab_size", m.vocab_size, 1, kMaxVocabSize, "token ids are int32");
  bounded("model.d_model", m.d_model, 1, kMaxWidth, "no machine holds a wider model");
  bounded("model.n_layers", m.n_layers, 1, kMaxLayers, "no machine holds a deeper model");
  bounded("model.n_heads", m.n_heads, 1, kMaxWidth, "at most one head per model.d_model channel pair");
  bounded("model.n_kv_heads", m.n_kv_heads, 1, kMaxWidth, "at most model.n_heads");
  if (!m.dense_layers.empty())
    bounded("model.dense_hidden", m.dense_hidden, std::numeric_limits<int64_t>::min(), kMaxHidden,
            "no machine holds a wider MLP");  // > 0: below
  if (m.d_model > 0 && m.n_heads > 0) {
    p.need(m.d_model % m.n_heads == 0, "model.d_model (", m.d_model, ") must be divisible by model.n_heads (",
           m.n_heads, "): ", m.d_model, " % ", m.n_heads, " = ", m.d_model % m.n_heads);
    if (m.d_model % m.n_heads == 0)
      p.need(m.head_dim() % 2 == 0, "head_dim = model.d_model / model.n_heads = ", m.d_model, " / ", m.n_heads,
             " = ", m.head_dim(), " must be even for RoPE");
  }
  if (m.n_heads > 0 && m.n_kv_heads > 0)
    p.need(m.n_heads % m.n_kv_heads == 0, "model.n_heads (", m.n_heads,
           ") must be divisible by model.n_kv_heads (", m.n_kv_heads, "): ", m.n_heads, " % ", m.n_kv_heads,
           " = ", m.n_heads % m.n_kv_heads);
  p.need(m.rope_theta > 0, "model.rope_theta must be > 0, got ", num(m.rope_theta));
  p.need(m.norm_eps > 0, "model.norm_eps must be > 0, got ", num(m.norm_eps));
  p.need(m.init_std > 0, "model.init_std must be > 0, got ", num(m.init_std));
  std::set<int64_t> seen;
  for (size_t i = 0; i < m.dense_layers.size(); ++i) {
    const int64_t l = m.dense_layers[i];
    p.need(l >= 0 && l < m.n_layers, "model.dense_layers[", i, "] = ", l,
           " is not a layer index in [0, model.n_layers = ", m.n_layers, ")");
    p.need(seen.insert(l).second, "model.dense_layers lists layer ", l, " more than once");
  }
  if (!m.dense_layers.empty() && m.dense_hidden <= 0)
    p.need(false, "model.dense_hidden must be > 0 when model.dense_layers is not empty, got ", m.dense_hidden);

  const MoeConfig& e = c.moe;
  bounded("moe.num_experts", e.num_experts, 1, kMaxExperts, "no machine holds more experts per layer");
  p.need(e.top_k > 0, "moe.top_k must be > 0, got ", e.top_k);
  p.need(e.top_k <= e.num_experts, "moe.top_k (", e.top_k, ") must be <= moe.num_experts (", e.num_experts,
         ")");
  bounded("moe.expert_hidden", e.expert_hidden, 1, kMaxHidden, "no machine holds wider experts");
  bounded("moe.shared_experts", e.shared_experts, 0, kMaxSharedExperts, "no machine holds a wider shared MLP");
  p.need(e.lb_loss_weight >= 0, "moe.lb_loss_weight must be >= 0, got ", num(e.lb_loss_weight));
  p.need(e.z_loss_weight >= 0, "moe.z_loss_weight must be >= 0, got ", num(e.z_loss_weight));
  p.need(e.bias_update_rate >= 0, "moe.bias_update_rate must be >= 0, got ", num(e.bias_update_rate));
  p.need(e.capacity_factor == 0 || e.capacity_factor >= 1,
         "moe.capacity_factor must be 0 (dropless) or >= 1, got ", num(e.capacity_factor));

  const TrainConfig& t = c.train;
  bounded("train.seq_len", t.seq_len, 1, kMaxSeqLen, "no machine holds the activations of a longer sequence");
  bounded("train.micro_batch", t.micro_batch, 1, kMaxMicroBatch, "no rank holds a larger micro-batch");
  bounded("train.global_batch", t.global_batch, 1, kMaxGlobalBatch, "no job reads a larger batch per step");
  if (t.micro_batch > 0 && t.global_batch > 0)
    p.need(t.global_batch % t.micro_batch == 0, "train.global_batch (", t.global_batch,
           ") must be a multiple of train.micro_batch (", t.micro_batch, "): ", t.global_batch, " % ",
           t.micro_batch, " = ", t.global_batch % t.micro_batch);
  bounded("train.steps", t.steps, 0, kMaxSteps, "no run takes that many optimizer steps");
  p.need(t.seed <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
         "train.seed must be <= 9223372036854775807 (it is written as a TOML integer), got ", t.seed);
  p.need(t.fp8_scaling == "blocks" || t.precision == "fp8", "train.fp8_scaling = \"", t.fp8_scaling,
         "\" scales FP8 operands, so it needs train.precision = \"fp8\", got \"", t.precision,
         "\"; leave train.fp8_scaling = \"blocks\" for other precisions");
  p.need(t.eval_interval >= 0, "train.eval_interval must be >= 0 (0: no evaluation), got ", t.eval_interval);
  bounded("train.eval_batches", t.eval_batches, 0, kMaxEvalBatches, "no evaluation reads that many micro-batches");
  if (t.eval_interval > 0 && t.eval_batches == 0)
    p.need(false, "train.eval_batches must be >= 1 when train.eval_interval (", t.eval_interval,
           ") > 0; set train.eval_interval = 0 to turn evaluation off");

  // What the sizes multiply to, once each of them is in range: parameters of the model, tokens
  // and activations of one micro-batch, tokens of one step.
  if (sizes_out_of_range == 0 && e.top_k > 0 && e.top_k <= e.num_experts) {
    const double params = estimated_params(m, e);
    p.need(params <= double(kMaxParams), "the model has about ", num(params), " parameters, more than ",
           bound_text(kMaxParams), " (no machine holds them): reduce model.n_layers, model.d_model, ",
           "model.vocab_size, moe.num_experts or moe.expert_hidden");
    const double micro_tokens = double(t.micro_batch) * double(t.seq_len);
    p.need(micro_tokens <= double(kMaxTokensPerMicroBatch), "train.micro_batch x train.seq_len = ", t.micro_batch,
           " x ", t.seq_len, " = ", num(micro_tokens), " tokens per micro-batch, more than ",
           bound_text(kMaxTokensPerMicroBatch), ": reduce train.micro_batch or train.seq_len");
    const double step_tokens = double(t.global_batch) * double(t.seq_len);
    p.need(step_tokens <= double(kMaxTokensPerStep), "train.global_batch x train.seq_len = ", t.global_batch, " x ",
           t.seq_len, " = ", num(step_tokens), " tokens per step, more than ", bound_text(kMaxTokensPerStep),
           ": reduce train.global_batch or train.seq_len");
    const double act = estimated_activations_per_token(m, e) * micro_tokens;
    p.need(act <= double(kMaxActivationElements), "the activations of one micro-batch are about ", num(act),
           " elements, more than ", bound_text(kMaxActivationElements),
           " (no machine holds them): reduce train.micro_batch, train.seq_len or the model's sizes");
  }

  const OptimConfig& o = c.optim;
  p.need(o.min_lr >= 0, "optim.min_lr must be >= 0, got ", num(o.min_lr));
  p.need(o.lr >= o.min_lr, "optim.lr (", num(o.lr), ") must be >= optim.min_lr (", num(o.min_lr), ")");
  p.need(o.warmup_steps >= 0, "optim.warmup_steps must be >= 0, got ", o.warmup_steps);
  p.need(o.beta1 >= 0 && o.beta1 < 1, "optim.beta1 must be in [0, 1), got ", num(o.beta1));
  p.need(o.beta2 >= 0 && o.beta2 < 1, "optim.beta2 must be in [0, 1), got ", num(o.beta2));
  p.need(o.eps > 0, "optim.eps must be > 0, got ", num(o.eps));
  p.need(o.weight_decay >= 0, "optim.weight_decay must be >= 0, got ", num(o.weight_decay));
  p.need(o.grad_clip >= 0, "optim.grad_clip must be >= 0 (0: no clipping), got ", num(o.grad_clip));
  // A BF16 moment moves only by more than half its last place (2^-9 to 2^-8 of its value): with
  // 1 - beta2 below that a second moment could never decay, and close to it only large deviations move it.
  p.need(o.moment_dtype != "bf16" || o.beta2 <= kMaxBeta2WithBf16Moments, "optim.beta2 = ", num(o.beta2),
         " with optim.moment_dtype = \"bf16\": at most ", num(kMaxBeta2WithBf16Moments),
         " (a BF16 second moment keeps 8 significant bits, so a step that moves it by less than 0.4% "
         "rounds back to the old value); use optim.moment_dtype = \"fp32\" or a smaller beta2");
  p.need(o.deferred_update_sms >= 0 && o.deferred_update_sms <= 1024,
         "optim.deferred_update_sms must be in [0, 1024] (multiprocessors; 0: no reserve), got ", o.deferred_update_sms);
  p.need(o.deferred_update_sms == 0 || o.deferred_update,
         "optim.deferred_update_sms = ", o.deferred_update_sms, " needs optim.deferred_update = true (it sets how the "
         "deferred update shares the GPU)");

  const DataConfig& d = c.data;
  p.need(d.paths.empty() || d.sources.empty(), "data.paths and data.sources are both set: give the token files ",
         "either as data.paths (one source) or as [[data.sources]] tables (a weighted mix), not both");
  if (d.source == "tokens")
    p.need(!d.paths.empty() || !d.sources.empty(), "data.paths must name at least one token file when data.source = ",
           "\"tokens\" (or give a weighted mix as [[data.sources]] tables)");
  if (d.source == "embedded")
    p.need(d.sources.empty(), "data.sources names token files, but data.source = \"embedded\" ignores them: set ",
           "data.source = \"tokens\" to train on the mix, or remove the [[data.sources]] tables");
  for (size_t i = 0; i < d.sources.size(); ++i) {
    const DataSourceConfig& src = d.sources[i];
    p.need(std::isfinite(src.weight) && src.weight > 0, "data.sources[", i, "].weight must be a finite number > 0, got ",
           num(src.weight));
    p.need(!src.paths.empty(), "data.sources[", i, "].paths must name at least one token file");
    for (size_t j = 0; j < src.paths.size(); ++j)
      p.need(!src.paths[j].empty(), "data.sources[", i, "].paths[", j, "] is an empty string");
  }
  for (size_t i = 0; i < d.paths.size(); ++i)
    p.need(!d.paths[i].empty(), "data.paths[", i, "] is an empty string");
  for (size_t i = 0; i < d.eval_paths.size(); ++i)
    p.need(!d.eval_paths[i].empty(), "data.eval_paths[", i, "] is an empty string");
  p.need(d.eos_id >= 0 && d.eos_id < m.vocab_size, "data.eos_id (", d.eos_id,
         ") must be a token id in [0, model.vocab_size = ", m.vocab_size, ")");

  const ParallelConfig& q = c.parallel;
  p.need(q.ep_capacity_factor == 0.0 || q.ep_capacity_factor >= 1.0,
         "parallel.ep_capacity_factor must be 0 (dropless) or >= 1, got ", q.ep_capacity_factor);
  p.need(q.ep_capacity_factor == 0.0 || q.ep_backend == "rowwise", "parallel.ep_capacity_factor = ",
         q.ep_capacity_factor, " applies to parallel.ep_backend = \"rowwise\" only (the all-to-all exchange is "
         "dropless); set parallel.ep_backend = \"rowwise\" or drop the capacity");
  p.need(q.ep_capacity_factor == 0.0 || q.ep > 1, "parallel.ep_capacity_factor = ", q.ep_capacity_factor,
         " caps the expert-parallel exchange, but parallel.ep = ", q.ep, " exchanges nothing; on one expert-parallel "
         "rank use moe.capacity_factor");
  p.need(q.dp >= 0, "parallel.dp must be >= 0 (0: world_size / pp), got ", q.dp);
  p.need(q.dp <= kMaxRanks, "parallel.dp must be <= ", bound_text(kMaxRanks), ", got ", q.dp);
  p.need(q.ep >= 1, "parallel.ep must be >= 1, got ", q.ep);
  p.need(q.ep <= kMaxRanks, "parallel.ep must be <= ", bound_text(kMaxRanks), ", got ", q.ep);
  p.need(q.pp >= 1, "parallel.pp must be >= 1, got ", q.pp);
  p.need(q.pp <= kMaxRanks, "parallel.pp must be <= ", bound_text(kMaxRanks), ", got ", q.pp);
  p.need(q.virtual_stages >= 1 && q.virtual_stages <= kMaxRanks, "parallel.virtual_stages must be in [1, ",
         bound_text(kMaxRanks), "], got ", q.virtual_stages);
  if (q.pp >= 1 && q.virtual_stages >= 1 && q.pp <= kMaxRanks && q.virtual_stages <= kMaxRanks) {
    const int64_t stages = q.pp * q.virtual_stages;
    p.need(q.virtual_stages == 1 || q.pp > 1, "parallel.virtual_stages = ", q.virtual_stages,
           " needs parallel.pp > 1 (interleaving splits each pipeline rank's layers into chunks)");
    p.need(stages <= m.n_layers, "parallel.pp x parallel.virtual_stages = ", q.pp, " x ", q.virtual_stages, " = ",
           stages, " model stages, but model.n_layers is ", m.n_layers, ": every stage needs >= 1 layer");
    if (!q.pp_layers.empty()) {
      p.need(int64_t(q.pp_layers.size()) == stages, "parallel.pp_layers lists ", q.pp_layers.size(),
             " stages, expected parallel.pp x parallel.virtual_stages = ", stages, " (layers per model stage)");
      int64_t sum = 0;
      for (size_t i = 0; i < q.pp_layers.size(); ++i) {
        p.need(q.pp_layers[i] >= 1, "parallel.pp_layers[", i, "] = ", q.pp_layers[i], ": every stage needs >= 1 layer");
        sum += std::max<int64_t>(0, std::min<int64_t>(q.pp_layers[i], m.n_layers + 1));
      }
      p.need(sum == m.n_layers, "parallel.pp_layers must sum to model.n_layers = ", m.n_layers, ", got ", sum);
    }
  }
  p.need(q.timeout_s > 0, "parallel.timeout_s must be > 0 seconds, got ", num(q.timeout_s));
  p.need(q.timeout_s <= kMaxTimeoutSeconds, "parallel.timeout_s must be <= ", num(kMaxTimeoutSeconds),
         " seconds (a year), got ", num(q.timeout_s));
  if (q.dp > 0 && q.ep >= 1)
    p.need(q.dp % q.ep == 0, "parallel.ep (", q.ep, ") must divide parallel.dp (", q.dp, "): ", q.dp, " % ",
           q.ep, " = ", q.dp % q.ep);
  if (e.num_experts > 0 && q.ep >= 1)
    p.need(e.num_experts % q.ep == 0, "moe.num_experts (", e.num_experts,
           ") must be divisible by parallel.ep (", q.ep,
           ") so every expert-parallel rank holds the same number of experts: ", e.num_experts, " % ", q.ep,
           " = ", e.num_experts % q.ep);

  const CheckpointConfig& k = c.checkpoint;
  p.need(k.interval >= 0, "checkpoint.interval must be >= 0 (0: only at the end), got ", k.interval);
  p.need(k.keep_last >= 0, "checkpoint.keep_last must be >= 0 (0: keep all), got ", k.keep_last);
  p.need(k.enabled || k.interval == 0, "checkpoint.interval = ", k.interval,
         " asks for checkpoints, but checkpoint.enabled = false writes none: drop one of the two");
  p.need(!k.resume.empty(),
         "checkpoint.resume must be \"auto\", \"none\" or a checkpoint path, got an empty string");

  p.need(!c.run.dir.empty(), "run.dir must not be empty");
  p.need(c.log.interval >= 1, "log.interval must be >= 1, got ", c.log.interval);
  if (!c.log.trace.empty()) {
    int64_t first = 0, last = 0;
    const bool parsed = parse_step_range(c.log.trace, &first, &last);
    p.need(parsed, "log.trace must be a step range \"A:B\" (or one step \"N\"), got \"", c.log.trace, "\"");
    if (parsed)
      p.need(first >= 1 && first <= last && last <= t.steps, "log.trace = \"", c.log.trace,
             "\" must be steps 1 <= A <= B <= train.steps = ", t.steps);
  }

  if (!p.list.empty()) MOE_FAIL("invalid configuration:\n  ", join(p.list, "\n  "));
}

bool parse_step_range(std::string_view text, int64_t* first, int64_t* last) {
  const std::string_view s = trim(text);
  auto number = [](std::string_view d, int64_t* out) {
    if (d.empty() || d.size() > 15) return false;
    int64_t v = 0;
    for (const char ch : d) {
      if (ch < '0' || ch > '9') return false;
      v = v * 10 + (ch - '0');
    }
    *out = v;
    return true;
  };
  const size_t colon = s.find(':');
  if (colon == std::string_view::npos) return number(s, first) && number(s, last);
  return number(trim(s.substr(0, colon)), first) && number(trim(s.substr(colon + 1)), last);
}

std::string config_to_toml(const Config& c) {
  std::string out, section;
  for (const auto& k : config_keys()) {
    if (k.section() != section) {
      section = k.section();
      out += (out.empty() ? "[" : "\n[") + section + "]\n";
    }
    out += k.leaf() + " = " + format_value(field_of(k, c)) + "\n";
  }
  return out;
}

std::vector<ConfigDifference> config_differences(const Config& a, const Config& b,
                                                 const std::vector<std::string>& sections) {
  std::vector<ConfigDifference> out;
  for (const auto& k : config_keys()) {
    if (std::find(sections.begin(), sections.end(), k.section()) == sections.end()) continue;
    std::string va = format_value(field_of(k, a)), vb = format_value(field_of(k, b));
    if (va != vb) out.push_back({k.name, std::move(va), std::move(vb)});
  }
  return out;
}

std::string config_help() {
  const Config defaults;
  size_t name_w = 0, type_w = 0, default_w = 0;
  for (const auto& k : config_keys()) {
    name_w = std::max(name_w, k.name.size());
    type_w = std::max(type_w, std::string(config_type_name(k.type)).size());
    default_w = std::max(default_w, format_value(field_of(k, defaults)).size());
  }
  std::ostringstream os;
  os << "Configuration keys: set them in CONFIG.toml under [section], or on the command line as\n"
        "--section.key=value (lists: --model.dense_layers=0,1 or --model.dense_layers=[0,1]).\n";
  std::string section;
  auto pad = [](std::string s, size_t w) { return s + std::string(w > s.size() ? w - s.size() : 0, ' '); };
  for (const auto& k : config_keys()) {
    if (k.section() != section) {
      section = k.section();
      os << "\n[" << section << "]\n";
    }
    os << "  " << pad(k.name, name_w) << "  " << pad(config_type_name(k.type), type_w) << "  "
       << pad(format_value(field_of(k, defaults)), default_w) << "  " << k.description;
    if (!k.choices.empty()) os << "; one of: " << join(k.choices, ", ");
    os << "\n";
  }
  return os.str();
}

}  // namespace moe
