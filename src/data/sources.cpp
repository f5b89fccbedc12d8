// open_data: the embedded corpus at its fixed size or the configured token files, then the checks
// every source passes before step 1 (a full pass over the ids, enough instances, a headerless
// uint16 file that is really uint32) and its summary line. Instances are seq_len + 1 tokens;
// global batch b of the loader is perm_e[(b mod B) G, +G) with B = floor(instances / G), so the
// run covers train.steps / B epochs.
#include "data/sources.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <cstdio>
#include <map>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/embedded.h"

namespace moe {
namespace {

// "embedded:train (generated, seed 1234)", "1 file 'a.bin' (raw uint16)",
// "3 files (2 megatron int32, 1 npy <u4)": the format of every file, counted by format.
std::string describe_files(const TokenSource& s, const Config& cfg) {
  if (cfg.data.source == "embedded")
    return s.file_name(0) + " (generated, seed " + std::to_string(cfg.train.seed) + ")";
  std::map<std::string, int64_t> formats;
  for (int64_t i = 0; i < s.num_files(); ++i) ++formats[s.file_format(i)];
  if (s.num_files() == 1) return "1 file '" + s.file_name(0) + "' (" + s.file_format(0) + ")";
  std::string fmt;
  for (const auto& [f, count] : formats) {
    if (!fmt.empty()) fmt += ", ";
    if (formats.size() > 1) fmt += std::to_string(count) + " ";
    fmt += f;
  }
  return std::to_string(s.num_files()) + " files (" + fmt + ")";
}

std::string format_double(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

// Same file (device and inode) named twice, e.g. through a link or another relative path.
bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {}, sb {};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
         sa.st_ino == sb.st_ino;
}

TokenSource open_embedded(const Config& cfg, const std::string& split) {
  return TokenSource::from_memory(embedded_corpus(split, embedded_num_tokens(cfg, split), cfg.train.seed),
                                  "embedded:" + split, cfg.model.vocab_size);
}

}  // namespace

static void open_eval(const Config& cfg, DataSources& d, std::ostream& out);
static DataSources open_mix(const Config& cfg, std::ostream& out);

int64_t embedded_num_tokens(const Config& cfg, const std::string& split) {
  const int64_t inst = cfg.train.seq_len + 1;
  if (split == "train") return std::max(kEmbeddedTrainTokens, cfg.train.global_batch * inst);
  MOE_CHECK(split == "eval", "embedded corpus split must be \"train\" or \"eval\", got \"", split, "\"");
  return std::max(kEmbeddedEvalTokens, std::max<int64_t>(1, cfg.train.eval_batches) * cfg.train.micro_batch * inst);
}

void validate_tokens(const TokenSource& source) {
  constexpr int64_t kChunk = int64_t{1} << 20;
  constexpr int64_t kMinTokensForDtypeCheck = 256;
  std::vector<int32_t> buf(static_cast<size_t>(std::min(kChunk, std::max<int64_t>(source.num_tokens(), 1))));
  int64_t start = 0;
  for (int64_t f = 0; f < source.num_files(); ++f) {
    const int64_t n = source.file_num_tokens(f);
    const bool raw_u16 = source.file_format(f) == "raw uint16";
    int32_t odd_bits = 0, even_bits = 0;
    for (int64_t local = 0; local < n; local += kChunk) {
      const int64_t take = std::min(kChunk, n - local);
      source.read(start + local, take, buf.data());  // throws on an id outside the vocabulary
      if (!raw_u16) continue;
      for (int64_t i = 0; i < take; ++i) ((local + i) % 2 ? odd_bits : even_bits) |= buf[i];
    }
    MOE_CHECK(!(raw_u16 && n >= kMinTokensForDtypeCheck && odd_bits == 0 && even_bits != 0), "token file '",
              source.file_name(f), "' read as uint16 has 0 at every odd position (", n,
              " tokens): it looks like uint32 tokens read with [data] token_dtype = \"uint16\"; set token_dtype "
              "= \"uint32\"");
    start += n;
  }
}

DataSources open_data(const Config& cfg, std::ostream& out) {
  using Clock = std::chrono::steady_clock;
  const int64_t inst = cfg.train.seq_len + 1;
  DataSources d;
  if (cfg.data.source == "embedded") {
    MOE_CHECK(cfg.model.vocab_size >= kEmbeddedVocabSize, "data.source = \"embedded\" is a byte-level corpus: ",
              "model.vocab_size must be >= ", kEmbeddedVocabSize, ", got ", cfg.model.vocab_size);
    MOE_CHECK(cfg.data.paths.empty() && cfg.data.eval_paths.empty(), "data.paths or data.eval_paths names files, ",
              "but data.source = \"embedded\" ignores them: set data.source = \"tokens\" to train on the files, ",
              "or clear the paths");
    d.train = open_embedded(cfg, "train");
    d.eval = open_embedded(cfg, "eval");
  } else {
    MOE_CHECK(cfg.data.source == "tokens", "data.source must be \"embedded\" or \"tokens\", got \"", cfg.data.source,
              "\"");
    if (!cfg.data.sources.empty()) return open_mix(cfg, out);
    d.train = TokenSource::open(cfg.data.paths, cfg.data.token_dtype, cfg.model.vocab_size);
    if (!cfg.data.eval_paths.empty())
      d.eval = TokenSource::open(cfg.data.eval_paths, cfg.data.token_dtype, cfg.model.vocab_size);
  }

  d.train_sources.push_back({*d.train, 1.0});
  const auto t0 = Clock::now();
  validate_tokens(*d.train);
  const double train_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const int64_t train_inst = d.train->num_tokens() / inst;
  MOE_CHECK(train_inst >= cfg.train.global_batch, "not enough train data (", describe_files(*d.train, cfg), ") for ",
            "one global batch: ", d.train->num_tokens(), " tokens make ", train_inst, " instances of seq_len + 1 = ",
            inst, " tokens, but train.global_batch is ", cfg.train.global_batch, "; need at least ",
            cfg.train.global_batch, " x ", inst, " = ", cfg.train.global_batch * inst, " tokens in data.paths");
  const int64_t batches_per_epoch = train_inst / cfg.train.global_batch;
  out << "data train: " << describe_files(*d.train, cfg) << ", " << d.train->num_tokens() << " tokens, " << train_inst
      << " instances of " << inst << " tokens, " << cfg.train.steps << " steps x " << cfg.train.global_batch
      << " sequences = " << format_double("%.3g", double(cfg.train.steps) / double(batches_per_epoch))
      << " epochs of " << batches_per_epoch << " batches; ids checked in " << format_double("%.2f", train_s)
      << " s\n";

  open_eval(cfg, d, out);
  return d;
}

std::string recorded_tokenizer(const Config& cfg) {
  namespace fs = std::filesystem;
  if (!cfg.data.tokenizer.empty()) {
    MOE_CHECK(fs::is_regular_file(cfg.data.tokenizer), "data.tokenizer = '", cfg.data.tokenizer,
              "' is not a file: expected the tokenizer.json the token files were made with");
    return cfg.data.tokenizer;
  }
  std::vector<std::string> files = cfg.data.paths;
  for (const DataSourceConfig& s : cfg.data.sources) files.insert(files.end(), s.paths.begin(), s.paths.end());
  files.insert(files.end(), cfg.data.eval_paths.begin(), cfg.data.eval_paths.end());
  if (cfg.data.source != "tokens" || files.empty()) return "";
  const fs::path dir = fs::path(files[0]).parent_path();
  const fs::path summary = dir / "summary.json";
  if (!fs::is_regular_file(summary)) return "";
  std::ifstream in(summary);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("tokenizer") || !j["tokenizer"].is_object() || !j["tokenizer"].contains("path") ||
      !j["tokenizer"]["path"].is_string())
    return "";
  const fs::path p = j["tokenizer"]["path"].get<std::string>();
  for (const fs::path& c : {p, dir / p})
    if (!p.empty() && fs::is_regular_file(c)) return c.lexically_normal().string();
  return "";
}

std::optional<TokenSource> open_eval_data(const Config& cfg, std::ostream& out) {
  DataSources d;
  if (!cfg.data.eval_paths.empty()) {
    d.eval = TokenSource::open(cfg.data.eval_paths, cfg.data.token_dtype, cfg.model.vocab_size);
  } else if (cfg.data.source == "embedded") {
    MOE_CHECK(cfg.model.vocab_size >= kEmbeddedVocabSize, "data.source = \"embedded\" is a byte-level corpus: ",
              "model.vocab_size must be >= ", kEmbeddedVocabSize, ", got ", cfg.model.vocab_size);
    d.eval = open_embedded(cfg, "eval");
  }
  open_eval(cfg, d, out);
  return d.eval;
}

void open_eval(const Config& cfg, DataSources& d, std::ostream& out) {
  using Clock = std::chrono::steady_clock;
  const int64_t inst = cfg.train.seq_len + 1;
  if (!d.eval) {
    out << "data eval: none (data.eval_paths is empty)\n" << std::flush;
    return;
  }
  const auto t1 = Clock::now();
  validate_tokens(*d.eval);
  const double eval_s = std::chrono::duration<double>(Clock::now() - t1).count();
  const int64_t eval_inst = d.eval->num_tokens() / inst;
  MOE_CHECK(eval_inst >= cfg.train.micro_batch, "not enough eval data (", describe_files(*d.eval, cfg), ") for one ",
            "eval batch: ", d.eval->num_tokens(), " tokens make ", eval_inst, " instances of seq_len + 1 = ", inst,
            " tokens, but an eval batch is train.micro_batch = ", cfg.train.micro_batch, " sequences; need at least ",
            cfg.train.micro_batch * inst, " tokens in data.eval_paths");
  const int64_t eval_batches = std::min(cfg.train.eval_batches, eval_inst / cfg.train.micro_batch);
  out << "data eval: " << describe_files(*d.eval, cfg) << ", " << d.eval->num_tokens() << " tokens, " << eval_inst
      << " instances of " << inst << " tokens, " << eval_batches << " batches x " << cfg.train.micro_batch
      << " sequences per evaluation";
  if (eval_batches < cfg.train.eval_batches) out << " (train.eval_batches = " << cfg.train.eval_batches << ")";
  out << "; ids checked in " << format_double("%.2f", eval_s) << " s\n";
  for (int64_t e = 0; cfg.data.source == "tokens" && e < d.eval->num_files(); ++e)
    for (const WeightedSource& src : d.train_sources)
      for (int64_t t = 0; t < src.source.num_files(); ++t)
        if (same_file(d.eval->file_name(e), src.source.file_name(t)))
          out << "data warning: eval file '" << d.eval->file_name(e) << "' is also the train file '"
              << src.source.file_name(t) << "': the eval loss is measured on training data\n";
  out << std::flush;
}

// data.sources: each source opened and checked, one line per source.
DataSources open_mix(const Config& cfg, std::ostream& out) {
  using Clock = std::chrono::steady_clock;
  const int64_t inst = cfg.train.seq_len + 1;
  DataSources d;
  double weight_sum = 0;
  for (const DataSourceConfig& s : cfg.data.sources) weight_sum += s.weight;
  std::ostringstream lines;
  int64_t total_inst = 0;
  for (size_t i = 0; i < cfg.data.sources.size(); ++i) {
    const DataSourceConfig& sc = cfg.data.sources[i];
    TokenSource src = TokenSource::open(sc.paths, cfg.data.token_dtype, cfg.model.vocab_size);
    const auto t0 = Clock::now();
    validate_tokens(src);
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    const int64_t n = src.num_tokens() / inst;
    MOE_CHECK(n >= 1, "data.sources[", i, "] (", describe_files(src, cfg), ") holds ", src.num_tokens(),
              " tokens, less than one instance of seq_len + 1 = ", inst, " tokens; add token files to it or remove it ",
              "from the mix");
    total_inst += n;
    const double share = sc.weight / weight_sum;
    const double draws = double(cfg.train.steps) * double(cfg.train.global_batch) * share;
    lines << "data train source " << i << ": weight " << format_double("%g", sc.weight) << " = "
          << format_double("%.1f", 100 * share) << "% of instances, " << describe_files(src, cfg) << ", "
          << src.num_tokens() << " tokens, " << n << " instances; " << cfg.train.steps << " steps draw about "
          << format_double("%.0f", draws) << " of them = " << format_double("%.3g", draws / double(n))
          << " epochs of this source; ids checked in " << format_double("%.2f", secs) << " s\n";
    d.train_sources.push_back({std::move(src), sc.weight});
  }
  MOE_CHECK(total_inst >= cfg.train.global_batch, "not enough train data in data.sources for one global batch: ",
            total_inst, " instances of seq_len + 1 = ", inst, " tokens, but train.global_batch is ",
            cfg.train.global_batch);
  out << "data train: a mix of " << cfg.data.sources.size() << " sources (data.sources), " << total_inst
      << " instances of " << inst << " tokens, " << cfg.train.steps << " steps x " << cfg.train.global_batch
      << " sequences, each batch filled in proportion to the weights\n"
      << lines.str();
  if (!cfg.data.eval_paths.empty())
    d.eval = TokenSource::open(cfg.data.eval_paths, cfg.data.token_dtype, cfg.model.vocab_size);
  open_eval(cfg, d, out);
  return d;
}

}  // namespace moe
