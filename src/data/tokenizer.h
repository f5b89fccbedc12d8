// Byte-level BPE tokenizers read from a Hugging Face `tokenizer.json` (GPT-2, GPT-NeoX / OLMo,
// cl100k / Dolma 2, Llama 3 style): added tokens split out first (leftmost, longest first), NFC
// when the file asks for it, Split / ByteLevel pre-tokenizers through PCRE2, every byte mapped to
// GPT-2's printable alphabet, BPE merges applied by rank. encode() gives the ids of the Python
// library's `encode(text, add_special_tokens=False)`; anything else in a file is refused by name.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moe {

// GPT-2's byte alphabet: byte b <-> one code point (printable bytes map to themselves, the other
// 68 to U+0100..U+0143 in byte order). byte_to_unicode(b) is that code point as UTF-8.
const std::array<std::string, 256>& byte_level_alphabet();
std::string bytes_to_byte_level(std::string_view bytes);
// The inverse; std::nullopt when `text` holds a code point outside the alphabet or bad UTF-8.
std::optional<std::string> byte_level_to_bytes(std::string_view text);

// Offset of the first byte that does not start/continue a valid UTF-8 sequence (overlong forms,
// surrogates and code points above U+10FFFF are invalid), or std::nullopt when all of it is valid.
std::optional<size_t> find_invalid_utf8(std::string_view text);

// An entry of `added_tokens`.
struct AddedToken {
  uint32_t id = 0;
  std::string content;
  bool single_word = false;  // only where no word character (\w) touches it on either side
  bool lstrip = false;       // takes the whitespace before it
  bool rstrip = false;       // takes the whitespace after it
  bool normalized = false;   // matched in the normalised text (else in the raw text, first)
  bool special = false;
};

class Tokenizer {
 public:
  // Reads and checks the file; moe::Error names the file and the JSON field on anything
  // malformed or not supported.
  static Tokenizer from_file(const std::string& path);
  // The same from JSON text; `name` stands for the file in messages.
  static Tokenizer from_json(std::string_view json_text, const std::string& name);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Appends the ids of UTF-8 `text` to `ids` (no template tokens: BOS/EOS are the caller's).
  // Invalid UTF-8 throws with its byte offset. Thread-safe.
  void encode(std::string_view text, std::vector<uint32_t>& ids) const;
  std::vector<uint32_t> encode(std::string_view text) const;
  // Bytes of the tokens, added and special tokens included as their content. The bytes of a
  // run of ids that cuts a character are returned as they are (not replaced by U+FFFD).
  // An id outside the vocabulary, or a file without a decoder, throws.
  std::string decode(std::span<const uint32_t> ids) const;

  // Largest id + 1 over model.vocab and added_tokens.
  int64_t vocab_size() const;
  // Id of an added token's content or of a vocabulary entry (byte-level form for the latter).
  std::optional<uint32_t> token_to_id(std::string_view token) const;
  const std::vector<AddedToken>& added_tokens() const;
  // One line: file, vocabulary, merges, pre-tokenizer, normaliser, regex engine.
  std::string describe() const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe
