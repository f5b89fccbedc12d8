// Read-only token source: one or more token files memory-mapped and concatenated in the given
// order (global token offset t lives in the file whose [start, start + count) contains t).
// A file is a real NumPy .npy (detected by its "\x93NUMPY" magic, any configured dtype) or a
// headerless little-endian array of the configured dtype ("uint16" | "uint32"), the OLMo/Dolma
// `.npy` convention. Ids are checked against vocab_size whenever they are read.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moe {

class TokenSource {
 public:
  // Maps `paths` (at least one) in order. token_dtype ("uint16" | "uint32") applies to the
  // headerless files; .npy files carry their own dtype. Throws moe::Error naming the file and
  // byte offset for a missing file, one that is not a regular file (a directory or FIFO, refused
  // without waiting on it), a size that is not a whole number of tokens, a malformed .npy, or an
  // llm.c file (its int32 magic 20240520, 20240801 or 20240522 first: a 1024-byte header that
  // would be read as tokens; the message says how to strip it). vocab_size must be in [1, 2^31].
  static TokenSource open(const std::vector<std::string>& paths, const std::string& token_dtype,
                          int64_t vocab_size);
  // Tokens held in memory; `name` stands for the file name in error messages.
  static TokenSource from_memory(std::vector<uint32_t> tokens, std::string name, int64_t vocab_size);

  int64_t num_tokens() const;
  int64_t vocab_size() const;
  // Copies tokens [offset, offset + n) of the concatenated stream into out[0, n). Throws if the
  // range leaves the stream, or if an id is negative or >= vocab_size (naming the file, the
  // token offset in that file and in the stream, and the byte offset).
  void read(int64_t offset, int64_t n, int32_t* out) const;
  // Reads every token once (in chunks) so a bad id fails now instead of mid-run.
  void validate_all() const;

  int64_t num_files() const;
  const std::string& file_name(int64_t i) const;
  int64_t file_num_tokens(int64_t i) const;
  // "uint16", "uint32" (headerless) or "npy <u2" etc.
  std::string file_format(int64_t i) const;

  struct State;  // mapped files and offsets; immutable once built, shared by copies

 private:
  explicit TokenSource(std::shared_ptr<const State> state) : state_(std::move(state)) {}
  std::shared_ptr<const State> state_;
};

// Bytes per token for a configured token_dtype; throws naming the value and the accepted names.
int64_t token_dtype_size(const std::string& token_dtype);

}  // namespace moe
