// Read-only token source: one or more token files memory-mapped and concatenated in the given
// order (global token offset t lives in the file whose [start, start + count) contains t).
// A file is a NumPy .npy ("\x93NUMPY" magic, its own dtype), a Megatron-Core indexed dataset
// (PREFIX.bin + PREFIX.idx, named by prefix, .idx or .bin; the .idx's dtype), an llm.c token shard
// (int32 magic 20240520 or 20240801; the header's dtype), or a headerless little-endian array of
// the configured dtype ("uint16" | "uint32"), the OLMo/Dolma convention. Ids are checked against
// vocab_size whenever they are read. docs/data.md gives each layout and what is refused.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moe {

class TokenSource {
 public:
  // Maps `paths` (at least one) in order. token_dtype ("uint16" | "uint32") applies to the
  // headerless files; the other formats carry their own dtype. Every header is validated here.
  // Throws moe::Error naming the file, the field and its byte offset for a missing file, one that is
  // not a regular file (a directory or FIFO, refused without waiting on it), a size that is not a
  // whole number of tokens, a malformed .npy, a Megatron .idx with a bad magic, a version other than
  // 1, a float dtype, counts, lengths, pointers or document indices that do not agree with the .idx
  // and .bin sizes, an llm.c shard whose header count does not match its size, or an llm.c eval
  // file (magic 20240522: examples, not tokens). vocab_size must be in [1, 2^31].
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
  // "raw uint16" | "raw uint32" (headerless), "npy <u2", "megatron int32", "llm.c uint16", ...
  // For a Megatron dataset file_name is its .bin (byte offsets in errors are offsets in it).
  std::string file_format(int64_t i) const;

  struct State;  // mapped files and offsets; immutable once built, shared by copies

 private:
  explicit TokenSource(std::shared_ptr<const State> state) : state_(std::move(state)) {}
  std::shared_ptr<const State> state_;
};

// Bytes per token for a configured token_dtype; throws naming the value and the accepted names.
int64_t token_dtype_size(const std::string& token_dtype);

}  // namespace moe
