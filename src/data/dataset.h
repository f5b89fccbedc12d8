// Instances and batches over a TokenSource. The stream is cut into consecutive instances of
// seq_len + 1 tokens (inputs = first seq_len, targets = last seq_len; the remainder is dropped).
// Epoch e visits instances in a Fisher-Yates permutation seeded from (seed, e); global batch b
// is perm_e[(b mod B) * G, +G) with e = b / B, B = floor(num_instances / G). Rank r of dp takes
// sequences [r*G/dp, (r+1)*G/dp) of it, split into micro-batches. Rows are row-major [seq, L].
// A weighted mix of several sources (data.sources) fills the G slots of every global batch by
// MixSchedule (the source of each slot, from the draws so far) and takes the source's next
// instance in its own epochs (docs/data.md, "Weighted mixes"); one source is the order above.
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

// One source of the training data and its weight (> 0; shares are weight / sum of weights).
struct WeightedSource {
  TokenSource source;
  double weight = 1.0;
};

// The source of every slot of a weighted mix, deterministic and the same everywhere: weights are
// quantised to integers q_s = max(1, round(2^40 w_s / W)) (Q = sum q_s), and slot k (counted
// from 0 over the whole run) goes to the source with the largest deficit (k + 1) q_s - c_s Q,
// c_s its draws among slots [0, k), the lowest index on ties (exact 128-bit integer arithmetic).
// After any k slots every |c_s - k q_s / Q| stays below 1 for two sources and small for more.
class MixSchedule {
 public:
  explicit MixSchedule(const std::vector<double>& weights);  // every weight finite and > 0
  // The source of slot sum(draws); draws[source] is incremented.
  int64_t next(std::vector<int64_t>& draws) const;
  int64_t num_sources() const { return static_cast<int64_t>(q_.size()); }
  double share(int64_t s) const { return double(q_[size_t(s)]) / double(total_); }

 private:
  std::vector<uint64_t> q_;
  uint64_t total_ = 0;
};

class DataLoader {
 public:
  // Throws if global_batch % dp_size != 0, (global_batch / dp_size) % micro_batch != 0, or the
  // data holds fewer than global_batch instances (saying how many tokens are needed).
  DataLoader(TokenSource source, int64_t seq_len, int64_t global_batch, int64_t micro_batch,
             uint64_t seed, int64_t dp_rank, int64_t dp_size);
  // A weighted mix (one source: the same as the constructor above). Source s shuffles its
  // instances by instance_permutation(n_s, mix_seed(seed, s + 1), e) in its epoch e. Throws, naming
  // the source, when one holds no instance; the mix needs at least one instance per source, and
  // its sources together at least global_batch.
  DataLoader(std::vector<WeightedSource> sources, int64_t seq_len, int64_t global_batch, int64_t micro_batch,
             uint64_t seed, int64_t dp_rank, int64_t dp_size);

  int64_t micro_steps_per_batch() const { return global_batch_ / dp_size_ / micro_batch_; }
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  int64_t num_instances() const { return num_instances_; }
  int64_t seq_len() const { return seq_len_; }
  int64_t global_batch() const { return global_batch_; }
  const TokenSource& source() const { return sources_[0].source; }  // the first (or only) source
  int64_t num_sources() const { return static_cast<int64_t>(sources_.size()); }
  const WeightedSource& source(int64_t s) const { return sources_[size_t(s)]; }
  int64_t source_instances(int64_t s) const { return source_instances_[size_t(s)]; }
  double source_share(int64_t s) const { return schedule_.share(s); }

  // All micro-batches (micro_batch sequences each) of global batch number position() for this
  // rank, in order; then position() advances by one. One call per optimizer step.
  std::vector<Batch> next();
  // Global batches consumed so far; the same count on every rank and for every dp_size.
  int64_t position() const { return position_; }
  int64_t epoch() const { return position_ / batches_per_epoch_; }
  // Instances drawn from each source by the global batches consumed (every rank's, so the same on
  // every rank): the realised mix. One source: position() x global_batch.
  const std::vector<int64_t>& source_draws() const { return draws_; }
  // A mix replays its schedule from slot 0 to find the draws (O(position x G x sources));
  // set_state gives them directly (a checkpoint's) and checks that they sum to position x G.
  void set_position(int64_t batches_consumed);
  void set_state(int64_t batches_consumed, const std::vector<int64_t>& source_draws);

  // Sequential, unshuffled, not sliced by rank: eval batch `index` holds instances
  // [index * sequences, (index + 1) * sequences).
  Batch eval_batch(int64_t index, int64_t sequences) const;
  int64_t num_eval_batches(int64_t sequences) const;

 private:
  const std::vector<int64_t>& permutation(int64_t epoch);
  int64_t mix_instance(int64_t source, int64_t draw);  // instance of a source's draw-th draw
  void read_instance(const TokenSource& source, int64_t instance, int32_t* inputs, int32_t* targets,
                     std::vector<int32_t>& scratch) const;

  std::vector<WeightedSource> sources_;
  MixSchedule schedule_;
  int64_t seq_len_, global_batch_, micro_batch_;
  uint64_t seed_;
  int64_t dp_rank_, dp_size_;
  int64_t num_instances_ = 0, batches_per_epoch_ = 0;  // all sources together
  std::vector<int64_t> source_instances_;
  int64_t position_ = 0;
  std::vector<int64_t> draws_;
  int64_t perm_epoch_ = -1;  // epoch whose order perm_ holds (one source)
  std::vector<int64_t> perm_;
  std::vector<int64_t> mix_perm_epoch_;  // per source of a mix: the epoch whose order mix_perm_ holds
  std::vector<std::vector<int64_t>> mix_perm_;
};

}  // namespace moe
