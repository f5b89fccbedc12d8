// PCRE2 regexes and the Split behaviours of Hugging Face `tokenizers`: the matches (or, inverted,
// the gaps) of a pattern mark the pieces; Isolated keeps every piece, Removed drops the matches,
// MergedWithPrevious/Next glue a match to its neighbour, Contiguous joins runs of the same kind.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "data/pretokenize.h"

#include <pcre2.h>

#include <algorithm>

#include "core/error.h"

namespace moe {

const char* const kGpt2SplitPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

namespace {
pcre2_code* code_of(void* p) { return static_cast<pcre2_code*>(p); }

std::string pcre2_message(int error_code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(error_code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

size_t utf8_char_length(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c >> 5) == 0x6) return 2;
  if ((c >> 4) == 0xE) return 3;
  return 4;
}

// Room for the whole match only (a return code of 0 still sets it).
struct MatchData {
  pcre2_match_data* data;
  MatchData() : data(pcre2_match_data_create(1, nullptr)) {
    MOE_CHECK(data != nullptr, "pcre2_match_data_create: out of memory");
  }
  ~MatchData() { pcre2_match_data_free(data); }
};

// One match from `start`: returns false when there is none.
bool match_once(const pcre2_code* code, bool jit, std::string_view text, size_t start, uint32_t options,
                pcre2_match_data* md, size_t& begin, size_t& end) {
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const int rc = jit ? pcre2_jit_match(code, subject, text.size(), start, options, md, nullptr)
                     : pcre2_match(code, subject, text.size(), start, options | PCRE2_NO_UTF_CHECK, md, nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  MOE_CHECK(rc >= 0, "regex match failed: ", pcre2_message(rc),
            " (text of ", text.size(), " bytes from offset ", start, ")");
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
  begin = ov[0];
  end = ov[1];
  return true;
}
}  // namespace

Regex::Regex(const std::string& pattern, const std::string& where) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
  MOE_CHECK(code != nullptr, where, ": regex does not compile with PCRE2: ", pcre2_message(error_code),
            " at offset ", error_offset, " of ", pattern);
  code_ = code;
  uint32_t jit_available = 0;
  pcre2_config(PCRE2_CONFIG_JIT, &jit_available);
  if (jit_available) jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() { pcre2_code_free(code_of(code_)); }

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const {
  matches.clear();
  const pcre2_code* code = code_of(code_);
  thread_local MatchData md;
  size_t start = 0, begin = 0, end = 0;
  while (start <= text.size() && match_once(code, jit_, text, start, 0, md.data, begin, end)) {
    matches.emplace_back(begin, end);
    if (end > begin) {
      start = end;
    } else {
      if (end >= text.size()) break;
      start = end + utf8_char_length(static_cast<unsigned char>(text[end]));
    }
  }
}

bool Regex::matches_at_start(std::string_view text) const {
  const pcre2_code* code = code_of(code_);
  MatchData md;
  size_t begin = 0, end = 0;
  return match_once(code, false, text, 0, PCRE2_ANCHORED, md.data, begin, end);
}

void SplitRule::apply(std::string_view piece, std::vector<std::string_view>& words) const {
  // (begin, end, is_match) covering the piece.
  struct Span {
    size_t begin, end;
    bool is_match;
  };
  thread_local std::vector<std::pair<size_t, size_t>> found;
  found.clear();
  if (regex) {
    regex->find_all(piece, found);
  } else if (!literal.empty()) {
    for (size_t at = piece.find(literal); at != std::string_view::npos; at = piece.find(literal, at + literal.size()))
      found.emplace_back(at, at + literal.size());
  }
  thread_local std::vector<Span> spans;
  spans.clear();
  size_t prev = 0;
  for (const auto& [b, e] : found) {
    if (prev != b) spans.push_back({prev, b, invert});
    spans.push_back({b, e, !invert});
    prev = e;
  }
  if (prev != piece.size()) spans.push_back({prev, piece.size(), invert});

  thread_local std::vector<Span> out;
  out.clear();
  switch (behavior) {
    case SplitBehavior::kIsolated:
      out = spans;
      break;
    case SplitBehavior::kRemoved:
      for (const Span& s : spans)
        if (!s.is_match) out.push_back(s);
      break;
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Span& s : spans) {
        if (s.is_match && !previous_match && !out.empty()) {
          out.back().end = s.end;
        } else {
          out.push_back(s);
        }
        previous_match = s.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous_match = false;
      for (size_t i = spans.size(); i-- > 0;) {
        const Span& s = spans[i];
        if (s.is_match && !previous_match && !out.empty()) {
          out.back().begin = s.begin;
        } else {
          out.push_back(s);
        }
        previous_match = s.is_match;
      }
      std::reverse(out.begin(), out.end());
      break;
    }
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      for (const Span& s : spans) {
        if (s.is_match == previous_match && !out.empty()) {
          out.back().end = s.end;
        } else {
          out.push_back(s);
        }
        previous_match = s.is_match;
      }
      break;
    }
  }
  for (const Span& s : out)
    if (s.end > s.begin) words.push_back(piece.substr(s.begin, s.end - s.begin));
}

}  // namespace moe
