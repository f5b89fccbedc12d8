// Text generation over a KV-cached decoder (Model<float>::decode on the CPU, CudaModel::decode on a
// GPU: generate() takes the decoder as a DecodeStep): the prompt runs
// once (one decode of all its positions), then each new token costs one position. The next token
// is the argmax of the last logits at temperature 0 (the lowest id among equal maxima), else a
// draw from softmax(logits / temperature) cut to its top-p nucleus: ids sorted by probability
// (descending, ties by id), the shortest prefix whose probability reaches top_p, renormalised.
// Draw k (0-based over the run) takes its uniform number from bits_at(seed, 0, 2k) and
// bits_at(seed, 0, 2k + 1) (core/rng.h: counter-based Philox), so a seed gives the same tokens on
// every machine and thread count.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "model/model.h"

namespace moe {

struct SamplingOptions {
  double temperature = 0;  // 0: greedy; > 0: sampling
  double top_p = 1;        // in (0, 1]; 1: the whole distribution
  uint64_t seed = 0;
};

// The next token of logits [v] under `o`; `draw` is the draw's index in the run (see above).
// Throws naming the option on a temperature < 0, a top_p outside (0, 1] or non-finite logits.
int32_t sample_token(const float* logits, int64_t v, const SamplingOptions& o, int64_t draw);

struct Generation {
  std::vector<int32_t> ids;   // the new tokens (the EOS that ended the run included)
  std::vector<float> logits;  // [ids.size(), V]: the logits each new token was chosen from
  bool hit_eos = false;       // ended on eos_id before max_new tokens
};

// One step of a decoder with its own KV cache: runs n new tokens after those it ran before and
// returns the logits [V] of the last one.
using DecodeStep = std::function<std::vector<float>(const int32_t* tokens, int64_t n)>;

// Up to max_new tokens after `prompt` (non-empty) from `step` (vocabulary v); stops after eos_id
// (< 0: never). Keeps every step's logits when keep_logits.
Generation generate(const DecodeStep& step, int64_t v, const std::vector<int32_t>& prompt, int64_t max_new,
                    int64_t eos_id, const SamplingOptions& o, bool keep_logits);
// A DecodeStep on the current GPU: a CudaModel (BF16 weights) holding a copy of `model`'s
// parameters and expert bias, made now, with its own KV cache (CudaModel::decode). Throws in a
// build without CUDA, or without a GPU.
DecodeStep cuda_decoder(const Model<float>& model);

// The same on the CPU model (its decode with a fresh KvCache).
Generation generate(Model<float>& model, const std::vector<int32_t>& prompt, int64_t max_new, int64_t eos_id,
                    const SamplingOptions& o, bool keep_logits);

}  // namespace moe
