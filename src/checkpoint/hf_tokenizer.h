// The tokenizer files of a Hugging Face export (export-hf): tokenizer.json, tokenizer_config.json
// and special_tokens_map.json, so that an HF reader (`tokenizers.Tokenizer.from_file`,
// `AutoTokenizer.from_pretrained(dir)`) gets the ids the model was trained on.
// Where they come from, first match:
//   1. the tokenizer.json given: export-hf --tokenizer PATH, else the run's recorded tokenizer
//      (the CLI resolves it with data/sources.h: recorded_tokenizer: data.tokenizer, or the
//      summary.json `moecore data prepare` wrote beside the token files);
//   2. data.source = "embedded": the embedded corpus's byte-level vocabulary (id = byte value, id
//      data.eos_id = EOS, written "<|endoftext|>") as a byte-level BPE tokenizer.json without merges
//      (byte_level_tokenizer_json);
//   3. none: the export holds no tokenizer (the note says so).
// A tokenizer.json given or recorded is copied byte for byte; tokenizer_config.json and
// special_tokens_map.json are copied from beside it when there, else written: eos_token (and
// pad_token) the token whose id is data.eos_id, bos_token null (moecore documents have no BOS),
// tokenizer_class PreTrainedTokenizerFast, model_max_length train.seq_len.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "core/config.h"

namespace moe {

// GPT-2's byte alphabet (printable bytes as themselves, the other 68 as U+0100.. in byte order),
// byte b's code point as UTF-8.
std::string gpt2_byte_char(int b);

// The byte-level vocabulary as an HF tokenizer.json: ByteLevel pre-tokenizer (no regex split,
// no prefix space) and decoder, BPE over the 256 byte characters with no merges; id b for byte b,
// except eos_id (< 256: that byte's entry is the EOS token instead; encode never yields it) which
// is the special added token "<|endoftext|>". vocab_size: the model's (>= 256, > eos_id).
nlohmann::json byte_level_tokenizer_json(int64_t eos_id, int64_t vocab_size);

// Writes the tokenizer files of `cfg`'s run into out_dir (each through write_file_atomic), from
// `tokenizer` (a tokenizer.json path, or "": the byte-level vocabulary or none; see the header). Returns one line
// saying what was written, and from where. Refused naming the file: a tokenizer.json that is not
// JSON or has no model.vocab object, or whose largest id is >= model.vocab_size.
std::string export_hf_tokenizer(const Config& cfg, const std::string& tokenizer, const std::string& out_dir);

}  // namespace moe
