// Reading tokenizer.json and running byte-level BPE. Encoding: (1) split out added tokens that
// match the raw text, (2) NFC-normalise the rest when asked, split out the normalised added
// tokens, (3) pre-tokenize the rest into words, (4) BPE on each word's bytes: merge the adjacent
// pair of lowest rank (leftmost on ties) until no pair has a merge, as `tokenizers` does with its
// heap. Words of up to kCacheWordBytes bytes are cached. Vocabulary strings are kept as bytes.
#include "data/tokenizer.h"

#include <unicode/normalizer2.h>
#include <unicode/bytestream.h>
#include <unicode/stringpiece.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <queue>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/pretokenize.h"

namespace moe {

using json = nlohmann::json;

namespace {

constexpr size_t kCacheWordBytes = 64;
constexpr size_t kCacheMaxEntries = size_t{1} << 18;

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Decodes one code point of valid UTF-8 at text[i], advancing i.
uint32_t next_code_point(std::string_view text, size_t& i) {
  const auto c = static_cast<unsigned char>(text[i]);
  auto cont = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(text[i + k]) & 0x3F); };
  uint32_t cp;
  if (c < 0x80) {
    cp = c;
    i += 1;
  } else if ((c >> 5) == 0x6) {
    cp = ((c & 0x1Fu) << 6) | cont(1);
    i += 2;
  } else if ((c >> 4) == 0xE) {
    cp = ((c & 0x0Fu) << 12) | (cont(1) << 6) | cont(2);
    i += 3;
  } else {
    cp = ((c & 0x07u) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3);
    i += 4;
  }
  return cp;
}

// Rust's char::is_whitespace (Unicode White_Space), used by lstrip/rstrip.
bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), path, ": cannot open the tokenizer file");
  std::ostringstream ss;
  ss << in.rdbuf();
  MOE_CHECK(!in.bad(), path, ": read error");
  return ss.str();
}

// Reads JSON fields with messages naming the file and the field.
struct Reader {
  std::string file;

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    MOE_FAIL(file, ": ", field, ": ", what);
  }
  const json& at(const json& obj, const std::string& field, const char* key) const {
    auto it = obj.find(key);
    if (it == obj.end()) fail(field.empty() ? std::string(key) : field + "." + key, "missing");
    return *it;
  }
  bool flag(const json& obj, const std::string& field, const char* key, bool fallback) const {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return fallback;
    if (!it->is_boolean()) fail(field + "." + key, "expected true or false, got " + it->dump());
    return it->get<bool>();
  }
  std::string text(const json& obj, const std::string& field, const char* key) const {
    const json& v = at(obj, field, key);
    if (!v.is_string()) fail(field + "." + key, "expected a string, got " + v.dump());
    return v.get<std::string>();
  }
  std::string type(const json& obj, const std::string& field) const {
    if (!obj.is_object()) fail(field, "expected an object, got " + obj.dump());
    return text(obj, field, "type");
  }
};

}  // namespace

const std::array<std::string, 256>& byte_level_alphabet() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      append_utf8(t[b], printable ? b : next++);
    }
    return t;
  }();
  return table;
}

std::string bytes_to_byte_level(std::string_view bytes) {
  const auto& table = byte_level_alphabet();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) out += table[static_cast<unsigned char>(c)];
  return out;
}

std::optional<std::string> byte_level_to_bytes(std::string_view text) {
  static const std::unordered_map<uint32_t, uint8_t> inverse = [] {
    std::unordered_map<uint32_t, uint8_t> m;
    const auto& table = byte_level_alphabet();
    for (uint32_t b = 0; b < 256; ++b) {
      size_t i = 0;
      m[next_code_point(table[b], i)] = static_cast<uint8_t>(b);
    }
    return m;
  }();
  if (find_invalid_utf8(text)) return std::nullopt;
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    auto it = inverse.find(next_code_point(text, i));
    if (it == inverse.end()) return std::nullopt;
    out += static_cast<char>(it->second);
  }
  return out;
}

std::optional<size_t> find_invalid_utf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, s + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp, min;
    if ((c >> 5) == 0x6) {
      len = 2, cp = c & 0x1F, min = 0x80;
    } else if ((c >> 4) == 0xE) {
      len = 3, cp = c & 0x0F, min = 0x800;
    } else if ((c >> 3) == 0x1E) {
      len = 4, cp = c & 0x07, min = 0x10000;
    } else {
      return i;
    }
    if (i + len > n) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::nullopt;
}

struct Tokenizer::Impl {
  std::string file;
  // model
  std::unordered_map<std::string, uint32_t> vocab_bytes;  // byte form -> id (byte-level entries)
  std::unordered_map<std::string, uint32_t> vocab_text;   // as written in the file -> id
  std::vector<std::string> id_bytes;                      // id -> bytes for decode
  std::vector<uint8_t> id_known;
  std::array<int64_t, 256> byte_id{};                     // -1: the byte has no token
  std::unordered_map<uint64_t, uint64_t> merges;          // (left << 32 | right) -> (rank << 32 | merged)
  size_t num_merges = 0;
  bool ignore_merges = false;
  std::optional<uint32_t> unk_id;
  bool fuse_unk = false;
  // added tokens
  std::vector<AddedToken> added;
  std::unordered_map<std::string, uint32_t> added_by_content;
  // first byte -> indices into `added`, longest content first; one table per pass
  std::array<std::vector<uint32_t>, 256> raw_by_first, normalized_by_first;
  std::unique_ptr<Regex> word_at_start;  // \w, for single_word
  // normaliser, pre-tokenizer, decoder
  bool nfc = false;
  std::vector<SplitRule> splits;  // Split pre-tokenizers in order, before ByteLevel
  bool add_prefix_space = false;  // ByteLevel's
  std::optional<SplitRule> byte_level_split;  // ByteLevel's own regex (use_regex)
  bool has_decoder = false;
  std::string pre_tokenizer_text, normalizer_text;
  bool jit = false;
  // BPE cache
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<uint32_t>> cache;

  void read_model(const Reader& r, const json& model);
  void read_added_tokens(const Reader& r, const json& list);
  void read_normalizer(const Reader& r, const json& n, const std::string& field);
  void read_pre_tokenizer(const Reader& r, const json& p, const std::string& field, bool& seen_byte_level);
  void read_post_processor(const Reader& r, const json& p, const std::string& field) const;
  void read_decoder(const Reader& r, const json& d, const std::string& field);

  void split_added(std::string_view text, bool normalized_pass, std::vector<std::pair<std::string_view, int64_t>>& out) const;
  void bpe(std::string_view word, std::vector<uint32_t>& ids) const;
  void bpe_uncached(std::string_view word, std::vector<uint32_t>& ids) const;
};

void Tokenizer::Impl::read_model(const Reader& r, const json& model) {
  const std::string type = r.type(model, "model");
  if (type != "BPE")
    r.fail("model.type", "model type '" + type + "' is not supported (byte-level BPE only)");
  if (auto it = model.find("dropout"); it != model.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() != 0.0)
      r.fail("model.dropout", "BPE dropout " + it->dump() + " is not supported (null or 0 only)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    auto it = model.find(key);
    if (it != model.end() && !it->is_null() && !(it->is_string() && it->get<std::string>().empty()))
      r.fail(std::string("model.") + key, it->dump() + " is not supported (byte-level BPE has none)");
  }
  if (r.flag(model, "model", "byte_fallback", false))
    r.fail("model.byte_fallback", "true is not supported (byte-level BPE needs no byte fallback)");
  ignore_merges = r.flag(model, "model", "ignore_merges", false);
  fuse_unk = r.flag(model, "model", "fuse_unk", false);

  const json& vocab = r.at(model, "model", "vocab");
  if (!vocab.is_object()) r.fail("model.vocab", "expected an object {token: id}");
  int64_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it->is_number_unsigned() || it->get<uint64_t>() > 0xFFFFFFFEull)
      r.fail("model.vocab[\"" + it.key() + "\"]", "expected an id >= 0, got " + it->dump());
    max_id = std::max<int64_t>(max_id, it->get<int64_t>());
  }
  id_bytes.assign(static_cast<size_t>(max_id + 1), "");
  id_known.assign(static_cast<size_t>(max_id + 1), 0);
  byte_id.fill(-1);
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const auto id = it->get<uint32_t>();
    if (id_known[id])
      r.fail("model.vocab[\"" + it.key() + "\"]", "id " + std::to_string(id) + " is used twice");
    id_known[id] = 1;
    vocab_text.emplace(it.key(), id);
    std::optional<std::string> bytes = byte_level_to_bytes(it.key());
    if (bytes) {
      vocab_bytes.emplace(*bytes, id);
      if (bytes->size() == 1) byte_id[static_cast<unsigned char>((*bytes)[0])] = id;
      id_bytes[id] = std::move(*bytes);
    } else {
      id_bytes[id] = it.key();  // not reachable by BPE; decodes as written (as the ByteLevel decoder)
    }
  }

  const json& list = r.at(model, "model", "merges");
  if (!list.is_array()) r.fail("model.merges", "expected an array");
  num_merges = list.size();
  merges.reserve(list.size() * 2);
  for (size_t rank = 0; rank < list.size(); ++rank) {
    const json& m = list[rank];
    const std::string field = "model.merges[" + std::to_string(rank) + "]";
    std::string left, right;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        r.fail(field, "expected \"left right\" with one space, got " + m.dump());
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      r.fail(field, "expected \"left right\" or [left, right], got " + m.dump());
    }
    auto find = [&](const std::string& token) {
      auto it = vocab_text.find(token);
      if (it == vocab_text.end()) r.fail(field, "token \"" + token + "\" is not in model.vocab");
      return it->second;
    };
    const uint64_t key = (uint64_t{find(left)} << 32) | find(right);
    const uint64_t value = (uint64_t{rank} << 32) | find(left + right);
    merges.emplace(key, value);  // a repeated pair keeps its first (lowest) rank
  }

  if (auto it = model.find("unk_token"); it != model.end() && !it->is_null()) {
    if (!it->is_string()) r.fail("model.unk_token", "expected a string or null");
    auto v = vocab_text.find(it->get<std::string>());
    if (v == vocab_text.end()) r.fail("model.unk_token", it->dump() + " is not in model.vocab");
    unk_id = v->second;
  }
}

void Tokenizer::Impl::read_added_tokens(const Reader& r, const json& list) {
  if (list.is_null()) return;
  if (!list.is_array()) r.fail("added_tokens", "expected an array");
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string field = "added_tokens[" + std::to_string(i) + "]";
    const json& t = list[i];
    if (!t.is_object()) r.fail(field, "expected an object");
    AddedToken a;
    const json& id = r.at(t, field, "id");
    if (!id.is_number_unsigned() || id.get<uint64_t>() > 0xFFFFFFFEull) r.fail(field + ".id", "expected an id >= 0");
    a.id = id.get<uint32_t>();
    a.content = r.text(t, field, "content");
    if (a.content.empty()) r.fail(field + ".content", "empty");
    if (auto bad = find_invalid_utf8(a.content)) r.fail(field + ".content", "not valid UTF-8");
    a.single_word = r.flag(t, field, "single_word", false);
    a.lstrip = r.flag(t, field, "lstrip", false);
    a.rstrip = r.flag(t, field, "rstrip", false);
    a.special = r.flag(t, field, "special", false);
    a.normalized = r.flag(t, field, "normalized", !a.special);
    if (a.id >= id_bytes.size()) {
      id_bytes.resize(a.id + 1);
      id_known.resize(a.id + 1, 0);
    }
    id_bytes[a.id] = a.content;
    id_known[a.id] = 1;
    added_by_content[a.content] = a.id;
    added.push_back(std::move(a));
  }
  for (uint32_t i = 0; i < added.size(); ++i) {
    auto& table = added[i].normalized ? normalized_by_first : raw_by_first;
    table[static_cast<unsigned char>(added[i].content[0])].push_back(i);
  }
  for (auto* table : {&raw_by_first, &normalized_by_first})
    for (auto& v : *table)
      std::stable_sort(v.begin(), v.end(),
                       [&](uint32_t a, uint32_t b) { return added[a].content.size() > added[b].content.size(); });
  word_at_start = std::make_unique<Regex>("\\w", file);
}

void Tokenizer::Impl::read_normalizer(const Reader& r, const json& n, const std::string& field) {
  if (n.is_null()) return;
  const std::string type = r.type(n, field);
  if (type == "NFC") {
    nfc = true;
  } else if (type == "Sequence") {
    const json& list = r.at(n, field, "normalizers");
    if (!list.is_array()) r.fail(field + ".normalizers", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) read_normalizer(r, list[i], field + ".normalizers[" + std::to_string(i) + "]");
  } else {
    r.fail(field + ".type", "normalizer type '" + type + "' is not supported (none or NFC only)");
  }
}

void Tokenizer::Impl::read_pre_tokenizer(const Reader& r, const json& p, const std::string& field,
                                         bool& seen_byte_level) {
  const std::string type = r.type(p, field);
  if (type != "Sequence" && seen_byte_level)
    r.fail(field, "a " + type + " pre-tokenizer after ByteLevel is not supported (ByteLevel must be last)");
  if (type == "Sequence") {
    const json& list = r.at(p, field, "pretokenizers");
    if (!list.is_array()) r.fail(field + ".pretokenizers", "expected an array");
    for (size_t i = 0; i < list.size(); ++i)
      read_pre_tokenizer(r, list[i], field + ".pretokenizers[" + std::to_string(i) + "]", seen_byte_level);
  } else if (type == "ByteLevel") {
    seen_byte_level = true;
    add_prefix_space = r.flag(p, field, "add_prefix_space", true);
    if (r.flag(p, field, "use_regex", true)) {
      SplitRule rule;
      rule.regex = std::make_shared<Regex>(kGpt2SplitPattern, file + ": " + field);
      jit = rule.regex->jit();
      byte_level_split = std::move(rule);
      pre_tokenizer_text += "ByteLevel(GPT-2 regex) ";
    } else {
      pre_tokenizer_text += "ByteLevel ";
    }
  } else if (type == "Split") {
    SplitRule rule;
    const json& pattern = r.at(p, field, "pattern");
    if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
      rule.regex = std::make_shared<Regex>(pattern["Regex"].get<std::string>(), file + ": " + field + ".pattern.Regex");
      jit = rule.regex->jit();
    } else if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string()) {
      rule.literal = pattern["String"].get<std::string>();
    } else {
      r.fail(field + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}, got " + pattern.dump());
    }
    const std::string behavior = r.text(p, field, "behavior");
    if (behavior == "Isolated") rule.behavior = SplitBehavior::kIsolated;
    else if (behavior == "Removed") rule.behavior = SplitBehavior::kRemoved;
    else if (behavior == "MergedWithPrevious") rule.behavior = SplitBehavior::kMergedWithPrevious;
    else if (behavior == "MergedWithNext") rule.behavior = SplitBehavior::kMergedWithNext;
    else if (behavior == "Contiguous") rule.behavior = SplitBehavior::kContiguous;
    else r.fail(field + ".behavior", "expected Isolated, Removed, MergedWithPrevious, MergedWithNext or Contiguous, got '" + behavior + "'");
    rule.invert = r.flag(p, field, "invert", false);
    splits.push_back(std::move(rule));
    pre_tokenizer_text += "Split(" + behavior + ") ";
  } else {
    r.fail(field + ".type", "pre_tokenizer type '" + type + "' is not supported (ByteLevel, Split, Sequence only)");
  }
}

void Tokenizer::Impl::read_post_processor(const Reader& r, const json& p, const std::string& field) const {
  // Post-processors only add template tokens (BOS/EOS, which encode() leaves to the caller) and
  // adjust offsets (not computed here): the supported ones are accepted and ignored.
  if (p.is_null()) return;
  const std::string type = r.type(p, field);
  if (type == "Sequence") {
    const json& list = r.at(p, field, "processors");
    if (!list.is_array()) r.fail(field + ".processors", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) read_post_processor(r, list[i], field + ".processors[" + std::to_string(i) + "]");
  } else if (type != "ByteLevel" && type != "TemplateProcessing") {
    r.fail(field + ".type", "post_processor type '" + type +
                                "' is not supported (ByteLevel and TemplateProcessing, both ignored)");
  }
}

void Tokenizer::Impl::read_decoder(const Reader& r, const json& d, const std::string& field) {
  if (d.is_null()) return;
  const std::string type = r.type(d, field);
  if (type == "Sequence") {
    const json& list = r.at(d, field, "decoders");
    if (!list.is_array()) r.fail(field + ".decoders", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) read_decoder(r, list[i], field + ".decoders[" + std::to_string(i) + "]");
  } else if (type == "ByteLevel") {
    has_decoder = true;
  } else {
    r.fail(field + ".type", "decoder type '" + type + "' is not supported (ByteLevel only)");
  }
}

// Cuts `text` into pieces (id -1) and added tokens (their id): at each position the longest
// token of this pass that starts there, leftmost first; a single_word token touching a word
// character is skipped (the search goes on after it); lstrip/rstrip take the whitespace around.
void Tokenizer::Impl::split_added(std::string_view text, bool normalized_pass,
                                  std::vector<std::pair<std::string_view, int64_t>>& out) const {
  const auto& table = normalized_pass ? normalized_by_first : raw_by_first;
  size_t piece_start = 0;  // end of the last token taken
  size_t i = 0;
  while (i < text.size()) {
    const auto& candidates = table[static_cast<unsigned char>(text[i])];
    const AddedToken* hit = nullptr;
    for (uint32_t k : candidates) {
      const std::string& c = added[k].content;
      if (text.compare(i, c.size(), c) == 0) {
        hit = &added[k];
        break;
      }
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    size_t start = i, stop = i + hit->content.size();
    i = stop;
    if (hit->single_word) {
      size_t last = start;  // start of the character before the token
      while (last > 0 && (static_cast<unsigned char>(text[--last]) & 0xC0) == 0x80) {
      }
      const bool word_before = start > 0 && word_at_start->matches_at_start(text.substr(last, start - last));
      const bool word_after = stop < text.size() && word_at_start->matches_at_start(text.substr(stop));
      if (word_before || word_after) continue;
    }
    if (hit->lstrip) {
      size_t s = start;
      while (s > piece_start) {
        size_t b = s - 1;
        while (b > piece_start && (static_cast<unsigned char>(text[b]) & 0xC0) == 0x80) --b;
        size_t at = b;
        if (!is_white_space(next_code_point(text, at))) break;
        s = b;
      }
      start = s;
    }
    if (hit->rstrip) {
      while (stop < text.size()) {
        size_t at = stop;
        if (!is_white_space(next_code_point(text, at))) break;
        stop = at;
      }
      i = stop;
    }
    if (start > piece_start) out.emplace_back(text.substr(piece_start, start - piece_start), -1);
    out.emplace_back(text.substr(start, stop - start), hit->id);
    piece_start = stop;
  }
  if (piece_start < text.size()) out.emplace_back(text.substr(piece_start), -1);
}

void Tokenizer::Impl::bpe(std::string_view word, std::vector<uint32_t>& ids) const {
  if (ignore_merges) {
    if (auto it = vocab_bytes.find(std::string(word)); it != vocab_bytes.end()) {
      ids.push_back(it->second);
      return;
    }
  }
  if (word.size() == 1 && byte_id[static_cast<unsigned char>(word[0])] >= 0) {
    ids.push_back(static_cast<uint32_t>(byte_id[static_cast<unsigned char>(word[0])]));
    return;
  }
  if (word.size() > kCacheWordBytes) {
    bpe_uncached(word, ids);
    return;
  }
  const std::string key(word);
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (auto it = cache.find(key); it != cache.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t before = ids.size();
  bpe_uncached(word, ids);
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (cache.size() >= kCacheMaxEntries) cache.clear();
  cache.emplace(key, std::vector<uint32_t>(ids.begin() + static_cast<std::ptrdiff_t>(before), ids.end()));
}

void Tokenizer::Impl::bpe_uncached(std::string_view word, std::vector<uint32_t>& ids) const {
  struct Symbol {
    uint32_t id;
    int32_t prev, next;
    bool alive;
  };
  std::vector<Symbol> sym;
  sym.reserve(word.size());
  for (char c : word) {
    const int64_t id = byte_id[static_cast<unsigned char>(c)];
    if (id < 0) {
      if (!unk_id) continue;  // tokenizers drops a character without a token when there is no unk
      if (fuse_unk && !sym.empty() && sym.back().id == *unk_id) continue;
      sym.push_back({*unk_id, 0, 0, true});
    } else {
      sym.push_back({static_cast<uint32_t>(id), 0, 0, true});
    }
  }
  const auto n = static_cast<int32_t>(sym.size());
  for (int32_t k = 0; k < n; ++k) {
    sym[k].prev = k - 1;
    sym[k].next = k + 1 < n ? k + 1 : -1;
  }
  // (rank, position, merged id), smallest rank then position first.
  using Entry = std::tuple<uint32_t, int32_t, uint32_t>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  auto push = [&](int32_t left) {
    if (left < 0 || sym[left].next < 0) return;
    auto it = merges.find((uint64_t{sym[left].id} << 32) | sym[sym[left].next].id);
    if (it != merges.end())
      heap.emplace(static_cast<uint32_t>(it->second >> 32), left, static_cast<uint32_t>(it->second));
  };
  for (int32_t k = 0; k + 1 < n; ++k) push(k);
  while (!heap.empty()) {
    const auto [rank, left, merged] = heap.top();
    heap.pop();
    if (!sym[left].alive || sym[left].next < 0) continue;
    const int32_t right = sym[left].next;
    auto it = merges.find((uint64_t{sym[left].id} << 32) | sym[right].id);
    if (it == merges.end() || static_cast<uint32_t>(it->second) != merged ||
        static_cast<uint32_t>(it->second >> 32) != rank)
      continue;  // stale: a neighbour changed since this pair was queued
    sym[left].id = merged;
    sym[right].alive = false;
    sym[left].next = sym[right].next;
    if (sym[right].next >= 0) sym[sym[right].next].prev = left;
    push(sym[left].prev);
    push(left);
  }
  for (int32_t k = n > 0 ? 0 : -1; k >= 0; k = sym[k].next) ids.push_back(sym[k].id);
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_file(const std::string& path) { return from_json(read_file(path), path); }

Tokenizer Tokenizer::from_json(std::string_view json_text, const std::string& name) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::parse_error& e) {
    MOE_FAIL(name, ": not valid JSON: ", e.what());
  }
  MOE_CHECK(root.is_object(), name, ": expected a JSON object at the top level");
  auto impl = std::make_unique<Impl>();
  impl->file = name;
  const Reader r{name};
  impl->read_model(r, r.at(root, "", "model"));
  impl->read_added_tokens(r, root.value("added_tokens", json()));
  impl->read_normalizer(r, root.value("normalizer", json()), "normalizer");
  bool seen_byte_level = false;
  const json pre = root.value("pre_tokenizer", json());
  if (pre.is_null()) r.fail("pre_tokenizer", "null: byte-level BPE needs a ByteLevel pre-tokenizer");
  impl->read_pre_tokenizer(r, pre, "pre_tokenizer", seen_byte_level);
  if (!seen_byte_level)
    r.fail("pre_tokenizer", "no ByteLevel pre-tokenizer: only byte-level BPE is supported");
  impl->read_post_processor(r, root.value("post_processor", json()), "post_processor");
  impl->read_decoder(r, root.value("decoder", json()), "decoder");
  impl->normalizer_text = impl->nfc ? "NFC" : "none";
  return Tokenizer(std::move(impl));
}

void Tokenizer::encode(std::string_view text, std::vector<uint32_t>& ids) const {
  const Impl& m = *impl_;
  if (auto bad = find_invalid_utf8(text)) MOE_FAIL(m.file, ": encode: text is not valid UTF-8 at byte ", *bad);
  std::vector<std::pair<std::string_view, int64_t>> raw, pieces;
  m.split_added(text, false, raw);
  std::deque<std::string> owned;  // normalised or space-prefixed pieces (stable addresses)
  for (const auto& [piece, id] : raw) {
    if (id >= 0) {
      pieces.emplace_back(piece, id);
      continue;
    }
    std::string_view normalized = piece;
    if (m.nfc) {
      UErrorCode status = U_ZERO_ERROR;
      const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(status);
      MOE_CHECK(U_SUCCESS(status), "ICU: no NFC normaliser: ", u_errorName(status));
      const icu::StringPiece sp(piece.data(), static_cast<int32_t>(piece.size()));
      if (!nfc->isNormalizedUTF8(sp, status)) {
        status = U_ZERO_ERROR;
        std::string out;
        icu::StringByteSink<std::string> sink(&out);
        nfc->normalizeUTF8(0, sp, sink, nullptr, status);
        MOE_CHECK(U_SUCCESS(status), "ICU NFC normalisation failed: ", u_errorName(status));
        owned.push_back(std::move(out));
        normalized = owned.back();
      }
    }
    m.split_added(normalized, true, pieces);
  }
  std::vector<std::string_view> words, next;
  for (const auto& [piece, id] : pieces) {
    if (id >= 0) {
      ids.push_back(static_cast<uint32_t>(id));
      continue;
    }
    words.assign(1, piece);
    for (const SplitRule& rule : m.splits) {
      next.clear();
      for (std::string_view w : words) rule.apply(w, next);
      words.swap(next);
    }
    // ByteLevel: a space before each piece that lacks one, then its own regex if it has one.
    if (m.add_prefix_space) {
      for (std::string_view& w : words) {
        if (w.empty() || w[0] != ' ') {
          owned.push_back(" " + std::string(w));
          w = owned.back();
        }
      }
    }
    if (m.byte_level_split) {
      next.clear();
      for (std::string_view w : words) m.byte_level_split->apply(w, next);
      words.swap(next);
    }
    for (std::string_view w : words) m.bpe(w, ids);
  }
}

std::vector<uint32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> ids;
  encode(text, ids);
  return ids;
}

std::string Tokenizer::decode(std::span<const uint32_t> ids) const {
  const Impl& m = *impl_;
  MOE_CHECK(m.has_decoder, m.file, ": decoder is null: decode needs a ByteLevel decoder");
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    MOE_CHECK(ids[i] < m.id_known.size() && m.id_known[ids[i]], m.file, ": decode: id ", ids[i], " at position ", i,
              " is not in the vocabulary (size ", m.id_known.size(), ")");
    out += m.id_bytes[ids[i]];
  }
  return out;
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_known.size()); }

std::optional<uint32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(std::string(token)); it != impl_->added_by_content.end()) return it->second;
  if (auto it = impl_->vocab_text.find(std::string(token)); it != impl_->vocab_text.end()) return it->second;
  return std::nullopt;
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const { return impl_->added; }

std::string Tokenizer::describe() const {
  const Impl& m = *impl_;
  std::ostringstream os;
  os << m.file << ": byte-level BPE, vocabulary " << vocab_size() << ", " << m.num_merges << " merges, "
     << m.added.size() << " added tokens, normalizer " << m.normalizer_text << ", pre-tokenizer "
     << m.pre_tokenizer_text << "(PCRE2" << (m.jit ? " JIT" : "") << ")";
  return os.str();
}

}  // namespace moe
