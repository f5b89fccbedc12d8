// Pre-tokenization of byte-level BPE tokenizers (Hugging Face `tokenizers` semantics): a PCRE2
// regex compiled with UTF and UCP (JIT when the library has it), and the Split behaviours that cut
// a piece of text into words by the regex's matches. Pieces and words are views of UTF-8 text that
// the caller has already checked (matching runs with PCRE2_NO_UTF_CHECK).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace moe {

// A compiled pattern. Thread-safe: each match call uses its own match data.
class Regex {
 public:
  // Throws moe::Error with `where` (file and JSON field) and PCRE2's message and offset.
  Regex(const std::string& pattern, const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Non-overlapping matches [begin, end) of the pattern in `text`, left to right; after an empty
  // match the search goes on one character further (as Oniguruma's find_iter).
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const;
  // Whether the pattern matches at the start of `text` (anchored).
  bool matches_at_start(std::string_view text) const;
  bool jit() const { return jit_; }

 private:
  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
};

// tokenizers' SplitDelimiterBehavior.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// One Split pre-tokenizer: cuts `piece` by the matches of `regex` (or of the literal `literal`
// when regex is null), `invert` swapping matches and the text between them, and appends the
// non-empty resulting words to `words`.
struct SplitRule {
  std::shared_ptr<const Regex> regex;
  std::string literal;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;

  void apply(std::string_view piece, std::vector<std::string_view>& words) const;
};

// The regex that ByteLevel(use_regex = true) splits with (GPT-2's).
extern const char* const kGpt2SplitPattern;

}  // namespace moe
