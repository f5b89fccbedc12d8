// Instances and batches over a TokenSource. The stream is cut into consecutive instances of
// seq_len + 1 tokens (inputs = first seq_len, targets = last seq_len; the remainder is dropped).
// Epoch e visits instances in a Fisher-Yates permutation seeded from (seed, e); global batch b
// is perm_e[(b mod B) * G, +G) with e = b / B, B = floor(num_instances / G). Rank r of dp takes
// sequences [r*G/dp, (r+1)*G/dp) of it, split into micro-batches. Rows are row-major [seq, L].
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "data/token_file.h"

namespace moe {

struct Batch {
  int64_t batch = 0, seq_len = 0;        // global batch (or eval batch) index, tokens per row
  std::vector<int32_t> inputs, targets;  // [num_sequences, seq_len]
  int64_t num_sequences() const {
    return seq_len ? static_cast<int64_t>(inputs.size()) / seq_len : 0;
  }
};

// splitmix64-style mix of two words into one seed (a bijection in `a` for fixed `b`).
uint64_t mix_seed(uint64_t a, uint64_t b);
// Uniform integer in [0, n) by rejection from rng() (portable: no std distributions). n >= 1.
uint64_t uniform_below(std::mt19937_64& rng, uint64_t n);
// The order of instances in one epoch: Fisher-Yates (i from n-1 down to 1 swaps p[i] with
// p[uniform_below(i + 1)]) over std::mt19937_64(mix_seed(seed, epoch)), identical everywhere.
std::vector<int64_t> instance_permutation(int64_t num_instances, uint64_t seed, int64_t epoch);

class DataLoader {
 public:
  // Throws if global_batch % dp_size != 0, (global_batch / dp_size) % micro_batch != 0, or the
  // data holds fewer than global_batch instances (saying how many tokens are needed).
  DataLoader(TokenSource source, int64_t seq_len, int64_t global_batch, int64_t micro_batch,
             uint64_t seed, int64_t dp_rank, int64_t dp_size);

  int64_t micro_steps_per_batch() const { return global_batch_ / dp_size_ / micro_batch_; }
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  int64_t num_instances() const { return num_instances_; }
  int64_t seq_len() const { return seq_len_; }
  const TokenSource& source() const { return source_; }

  // All micro-batches (micro_batch sequences each) of global batch number position() for this
  // rank, in order; then position() advances by one. One call per optimizer step.
  std::vector<Batch> next();
  // Global batches consumed so far; the same count on every rank and for every dp_size.
  int64_t position() const { return position_; }
  int64_t epoch() const { return position_ / batches_per_epoch_; }
  void set_position(int64_t batches_consumed);

  // Sequential, unshuffled, not sliced by rank: eval batch `index` holds instances
  // [index * sequences, (index + 1) * sequences).
  Batch eval_batch(int64_t index, int64_t sequences) const;
  int64_t num_eval_batches(int64_t sequences) const;

 private:
  const std::vector<int64_t>& permutation(int64_t epoch);
  void read_instance(int64_t instance, int32_t* inputs, int32_t* targets,
                     std::vector<int32_t>& scratch) const;

  TokenSource source_;
  int64_t seq_len_, global_batch_, micro_batch_;
  uint64_t seed_;
  int64_t dp_rank_, dp_size_;
  int64_t num_instances_ = 0, batches_per_epoch_ = 0;
  int64_t position_ = 0;
  int64_t perm_epoch_ = -1;  // epoch whose order perm_ holds
  std::vector<int64_t> perm_;
};

}  // namespace moe
