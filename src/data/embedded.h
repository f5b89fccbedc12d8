// The embedded default corpus and the byte-level text tokenizer. The corpus is generated, not
// downloaded: documents of templated English (a small grammar with number agreement), arithmetic,
// counting, spelling, key-value recall and list repetition, as bytes (ids 10 and 32..126), each
// followed by EOS = 0. Document i of a split depends only on (split, seed, i).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe {

constexpr int64_t kEmbeddedVocabSize = 256;
constexpr uint32_t kEmbeddedEosId = 0;
// Tokens of each split used for a run (data/sources.h): a fixed prefix of the split's stream, the
// same whatever train.steps is, so a shorter, longer or resumed run sees the same data at every step.
constexpr int64_t kEmbeddedTrainTokens = int64_t{1} << 22;
constexpr int64_t kEmbeddedEvalTokens = int64_t{1} << 20;

// Text of document `index` of split "train" or "eval" (no EOS).
std::string embedded_document(const std::string& split, int64_t index, uint64_t seed = 0);
// The first num_tokens tokens of the split's stream: document 0, EOS, document 1, EOS, ...
// (the last document is cut at num_tokens). train and eval draw from disjoint document seeds.
std::vector<uint32_t> embedded_corpus(const std::string& split, int64_t num_tokens, uint64_t seed = 0);

// Byte-level tokenization: each input file is one document, its bytes are the ids (0..255),
// followed by eos_id. Writes a headerless little-endian uint16/uint32 array to `output` through
// a new temporary file beside it (`output`.tmp.<pid>.<n>), flushed to disk and renamed over
// `output` when complete, removed on any error (an existing `output` is then left as it was).
// Refused, naming the files: an output that is one of the inputs (same device and inode), an
// output that is a directory, an input that is a directory, an input byte equal to eos_id (with
// its byte offset), and an eos_id that does not fit token_dtype.
void tokenize_text_files(const std::vector<std::string>& inputs, const std::string& output,
                         const std::string& token_dtype, int64_t eos_id);

}  // namespace moe
