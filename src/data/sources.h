// The run's token sources, opened and checked before step 1. data.source = "embedded": a fixed
// prefix of each split of the generated corpus (kEmbeddedTrainTokens / kEmbeddedEvalTokens, or one
// batch if that is larger), the same whatever train.steps is; "tokens": data.paths and
// data.eval_paths. Every source gets a full pass over its ids and a size check, and one summary
// line: files, tokens, instances of seq_len + 1, and the epochs (or eval batches) the run covers.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

#include "core/config.h"
#include "data/dataset.h"
#include "data/token_file.h"

namespace moe {

struct DataSources {
  // The training data: one source (data.paths, or the embedded corpus) of weight 1, or the
  // [[data.sources]] of a mix with their weights. `train` is the source when there is one only.
  std::vector<WeightedSource> train_sources;
  std::optional<TokenSource> train, eval;  // no eval for "tokens" without data.eval_paths
};

// Opens and validates data.source's train and eval sources, writing one summary line per source to
// `out` (the trainer passes rank 0's console). Throws moe::Error, naming the file and what to do,
// for a file TokenSource::open refuses, an id outside [0, model.vocab_size), a headerless uint16
// file that holds uint32 data, too few tokens for one global batch (train) or one eval batch of
// train.micro_batch sequences (eval), or data.paths set while data.source = "embedded". A mix
// (data.sources) gets one line per source: its share, files, tokens, instances, and the epochs of
// that source the run's steps draw (steps x global_batch x share / instances); every source must
// hold at least one instance.
DataSources open_data(const Config& cfg, std::ostream& out);

// The held-out data of a run of `cfg` on its own (moecore eval): data.eval_paths when set,
// whatever data.source is; else the embedded corpus's eval split when data.source = "embedded";
// else none (std::nullopt, with a line saying so). Checked and summarised as open_data does (a
// full pass over the ids, at least one eval batch of train.micro_batch sequences).
std::optional<TokenSource> open_eval_data(const Config& cfg, std::ostream& out);

// The tokenizer.json a run's token files were made with: data.tokenizer when set (an error naming
// the key when that file does not exist); else the one named by the summary.json that `moecore
// data prepare` wrote beside the first token file of data.paths, data.sources or data.eval_paths
// (its "tokenizer.path": absolute, or relative to the working directory or to summary.json's
// directory), when that file exists; else "" (none recorded: the embedded corpus, or token files
// made otherwise).
std::string recorded_tokenizer(const Config& cfg);

// Tokens of embedded split "train" | "eval" that a run of `cfg` uses: the split's fixed size, or one
// global batch (train) / train.eval_batches eval batches (eval) of seq_len + 1 tokens if larger.
// Never depends on train.steps.
int64_t embedded_num_tokens(const Config& cfg, const std::string& split);

// The full pass over a source, in chunks: every id is read (TokenSource::read checks the
// vocabulary), and a headerless uint16 file of at least 256 tokens whose odd-position tokens are all
// 0 while some even-position token is not (little-endian uint32 data read as uint16) is refused.
void validate_tokens(const TokenSource& source);

}  // namespace moe
