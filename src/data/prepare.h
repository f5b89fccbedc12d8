// `moecore data prepare`: text to token files with a Hugging Face byte-level BPE tokenizer
// (data/tokenizer.h). Inputs are `.jsonl` / `.jsonl.gz` (one JSON object a line, the document in
// its text key) and `.txt` (the whole file one document, or one document a non-empty line with
// `lines`). Each input becomes OUT_DIR/<stem>.npy, a 1-D NumPy array of uint16 ids (vocabulary
// <= 65536) or uint32, every document followed by the EOS id; OUT_DIR/summary.json records the
// counts, the tokenizer and the dtype. The work is cut into batches of about 1 MiB of text read
// in input order; `jobs` worker threads tokenize them and the batches are written in input order,
// so the files are the same bytes for every `jobs`. Every file is written under a temporary name
// and renamed only when all inputs are done; a stop request (core/signals.h) or an error removes
// the temporaries, leaving nothing new and nothing partial in OUT_DIR. docs/data.md has the details.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

namespace moe {

struct PrepareOptions {
  std::string tokenizer;         // path of tokenizer.json
  std::string tokenizer_sha256;  // hex SHA-256 of that file, for summary.json (the caller computes it)
  std::string out_dir;           // created if missing
  std::string text_key = "text";  // the JSON key holding a .jsonl document
  bool lines = false;             // .txt: one document per non-empty line (else per file)
  int64_t jobs = 0;               // tokenizer threads; 0: std::thread::hardware_concurrency()
  std::optional<int64_t> eos_id;  // else found by name among the tokenizer's tokens (eos_token_names)
  bool progress = false;          // refresh a progress line on `log` (the caller: stderr is a terminal)
};

struct PreparedFile {
  std::string input, output;  // output: its final path
  int64_t documents = 0, tokens = 0, bytes = 0;  // bytes: of text (after decompression)
};

struct PrepareResult {
  std::vector<PreparedFile> files;
  int64_t documents = 0, tokens = 0, bytes = 0;
  std::string dtype;      // "uint16" | "uint32"
  int64_t eos_id = 0;
  std::string eos_token;  // its content, or "" when given by id and not a named token
  int64_t vocab_size = 0;
  int64_t jobs = 0;       // threads used
  double seconds = 0;
  int stopped_by = 0;     // the signal that stopped it (nothing written), else 0
};

// The EOS names tried, in order, when no eos_id is given: first among the added tokens, then in
// the vocabulary: <|endoftext|>, <|end_of_text|>, </s>, <eos>, <|eos|>, [EOS], <|im_end|>.
const std::vector<std::string>& eos_token_names();

// Runs the whole preparation (see the header comment). Throws moe::Error naming the file (and
// line, for .jsonl) and what was expected: an input with another suffix, a directory or a
// missing file; two inputs with the same stem; a line that is not a JSON object, lacks the text
// key or holds a non-string there; invalid UTF-8 (with its byte offset); a truncated or corrupt
// .gz; no EOS token found; an eos_id outside the vocabulary. In a build without the tokenizer
// (MOECORE_HAS_TOKENIZER == 0) it throws saying PCRE2/ICU were missing at configure time.
// A stop request returns with stopped_by set and nothing written.
PrepareResult prepare_data(const std::vector<std::string>& inputs, const PrepareOptions& opt, std::ostream& log);

}  // namespace moe
