// DataLoader: instance order per epoch, global-batch indexing across epochs, data-parallel
// slicing and micro-batching. Only std::mt19937_64 (fully specified by the standard) and our
// own rejection sampling and Fisher-Yates are used, so the order is the same on every machine.
#include "data/dataset.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "core/error.h"

namespace moe {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t mix_seed(uint64_t a, uint64_t b) { return splitmix64(a ^ splitmix64(b + 0x632be59bd9b4e019ULL)); }

uint64_t uniform_below(std::mt19937_64& rng, uint64_t n) {
  MOE_CHECK(n >= 1, "uniform_below needs n >= 1, got ", n);
  // Accept x >= 2^64 mod n: the accepted range holds a whole number of copies of [0, n).
  const uint64_t threshold = (0 - n) % n;
  for (;;) {
    const uint64_t x = rng();
    if (x >= threshold) return x % n;
  }
}

std::vector<int64_t> instance_permutation(int64_t num_instances, uint64_t seed, int64_t epoch) {
  MOE_CHECK(num_instances >= 0 && epoch >= 0, "instance_permutation needs num_instances >= 0 and ",
            "epoch >= 0, got ", num_instances, " and ", epoch);
  std::vector<int64_t> p(static_cast<size_t>(num_instances));
  for (int64_t i = 0; i < num_instances; ++i) p[i] = i;
  std::mt19937_64 rng(mix_seed(seed, static_cast<uint64_t>(epoch)));
  for (int64_t i = num_instances - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(uniform_below(rng, static_cast<uint64_t>(i) + 1));
    std::swap(p[i], p[j]);
  }
  return p;
}

MixSchedule::MixSchedule(const std::vector<double>& weights) {
  MOE_CHECK(!weights.empty(), "a data mix needs at least one source");
  double sum = 0;
  for (size_t s = 0; s < weights.size(); ++s) {
    MOE_CHECK(std::isfinite(weights[s]) && weights[s] > 0, "data.sources[", s, "].weight must be a finite number > 0, got ",
              weights[s]);
    sum += weights[s];
  }
  for (const double w : weights) {
    const auto q = static_cast<uint64_t>(std::llround(std::ldexp(w / sum, 40)));
    q_.push_back(std::max<uint64_t>(q, 1));
    total_ += q_.back();
  }
}

int64_t MixSchedule::next(std::vector<int64_t>& draws) const {
  __int128 slot = 0;
  for (const int64_t c : draws) slot += c;
  int64_t best = 0;
  __int128 best_deficit = 0;
  for (size_t s = 0; s < q_.size(); ++s) {
    const __int128 deficit = (slot + 1) * __int128(q_[s]) - __int128(draws[s]) * __int128(total_);
    if (s == 0 || deficit > best_deficit) best_deficit = deficit, best = static_cast<int64_t>(s);
  }
  ++draws[size_t(best)];
  return best;
}

namespace {
std::vector<double> weights_of(const std::vector<WeightedSource>& sources) {
  std::vector<double> w;
  for (const WeightedSource& s : sources) w.push_back(s.weight);
  return w;
}
std::vector<WeightedSource> one_source(TokenSource source) {
  std::vector<WeightedSource> v;
  v.push_back({std::move(source), 1.0});
  return v;
}
}  // namespace

DataLoader::DataLoader(TokenSource source, int64_t seq_len, int64_t global_batch, int64_t micro_batch,
                       uint64_t seed, int64_t dp_rank, int64_t dp_size)
    : DataLoader(one_source(std::move(source)), seq_len, global_batch, micro_batch, seed, dp_rank, dp_size) {}

DataLoader::DataLoader(std::vector<WeightedSource> sources, int64_t seq_len, int64_t global_batch,
                       int64_t micro_batch, uint64_t seed, int64_t dp_rank, int64_t dp_size)
    : sources_(std::move(sources)),
      schedule_(weights_of(sources_)),
      seq_len_(seq_len),
      global_batch_(global_batch),
      micro_batch_(micro_batch),
      seed_(seed),
      dp_rank_(dp_rank),
      dp_size_(dp_size) {
  MOE_CHECK(seq_len > 0, "seq_len must be positive, got ", seq_len);
  MOE_CHECK(global_batch > 0, "global_batch must be positive, got ", global_batch);
  MOE_CHECK(micro_batch > 0, "micro_batch must be positive, got ", micro_batch);
  MOE_CHECK(dp_size > 0 && dp_rank >= 0 && dp_rank < dp_size, "dp_rank must be in [0, dp_size); got ",
            "dp_rank ", dp_rank, ", dp_size ", dp_size);
  MOE_CHECK(global_batch % dp_size == 0, "global_batch must divide evenly over data-parallel ranks: ",
            global_batch, " % ", dp_size, " = ", global_batch % dp_size,
            "; choose global_batch as a multiple of dp");
  const int64_t per_rank = global_batch / dp_size;
  MOE_CHECK(per_rank % micro_batch == 0, "sequences per rank must be a multiple of micro_batch: ",
            "global_batch / dp = ", global_batch, " / ", dp_size, " = ", per_rank, ", and ",
            per_rank, " % ", micro_batch, " = ", per_rank % micro_batch);
  int64_t tokens = 0;
  for (size_t s = 0; s < sources_.size(); ++s) {
    const int64_t n = sources_[s].source.num_tokens() / (seq_len + 1);
    MOE_CHECK(sources_.size() == 1 || n > 0, "data.sources[", s, "] holds ", sources_[s].source.num_tokens(),
              " tokens, less than one instance of seq_len + 1 = ", seq_len + 1, " tokens; add token files to it or ",
              "remove it from the mix");
    source_instances_.push_back(n);
    num_instances_ += n;
    tokens += sources_[s].source.num_tokens();
  }
  MOE_CHECK(num_instances_ >= global_batch, "not enough token data for one global batch: ",
            tokens, " tokens make ", num_instances_, " instances of seq_len + 1 = ",
            seq_len + 1, " tokens, but global_batch is ", global_batch, "; need at least ",
            global_batch, " x ", seq_len + 1, " = ", global_batch * (seq_len + 1), " tokens");
  batches_per_epoch_ = num_instances_ / global_batch;
  draws_.assign(sources_.size(), 0);
  mix_perm_epoch_.assign(sources_.size(), -1);
  mix_perm_.resize(sources_.size());
}

void DataLoader::set_position(int64_t batches_consumed) {
  MOE_CHECK(batches_consumed >= 0, "data position must be >= 0, got ", batches_consumed);
  position_ = batches_consumed;
  if (sources_.size() == 1) {
    draws_[0] = batches_consumed * global_batch_;
    return;
  }
  draws_.assign(sources_.size(), 0);
  for (int64_t k = 0; k < batches_consumed * global_batch_; ++k) schedule_.next(draws_);
}

void DataLoader::set_state(int64_t batches_consumed, const std::vector<int64_t>& source_draws) {
  MOE_CHECK(batches_consumed >= 0, "data position must be >= 0, got ", batches_consumed);
  MOE_CHECK(source_draws.size() == sources_.size(), "the data position names ", source_draws.size(),
            " sources, but the data has ", sources_.size());
  int64_t sum = 0;
  for (const int64_t d : source_draws) {
    MOE_CHECK(d >= 0, "a source's draw count must be >= 0, got ", d);
    sum += d;
  }
  MOE_CHECK(sum == batches_consumed * global_batch_, "the data position's draws sum to ", sum, " instances, but ",
            batches_consumed, " global batches of ", global_batch_, " are ", batches_consumed * global_batch_,
            " (another train.global_batch?)");
  position_ = batches_consumed;
  draws_ = source_draws;
}

const std::vector<int64_t>& DataLoader::permutation(int64_t epoch) {
  if (epoch != perm_epoch_) {
    perm_ = instance_permutation(num_instances_, seed_, epoch);
    perm_epoch_ = epoch;
  }
  return perm_;
}

int64_t DataLoader::mix_instance(int64_t source, int64_t draw) {
  const auto s = static_cast<size_t>(source);
  const int64_t n = source_instances_[s], epoch = draw / n;
  if (mix_perm_epoch_[s] != epoch) {
    mix_perm_[s] = instance_permutation(n, mix_seed(seed_, static_cast<uint64_t>(source) + 1), epoch);
    mix_perm_epoch_[s] = epoch;
  }
  return mix_perm_[s][static_cast<size_t>(draw % n)];
}

void DataLoader::read_instance(const TokenSource& source, int64_t instance, int32_t* inputs, int32_t* targets,
                               std::vector<int32_t>& scratch) const {
  scratch.resize(static_cast<size_t>(seq_len_ + 1));
  source.read(instance * (seq_len_ + 1), seq_len_ + 1, scratch.data());
  std::copy(scratch.begin(), scratch.end() - 1, inputs);
  std::copy(scratch.begin() + 1, scratch.end(), targets);
}

std::vector<Batch> DataLoader::next() {
  const int64_t b = position_;
  const int64_t per_rank = global_batch_ / dp_size_, mine = dp_rank_ * per_rank;
  // (source, instance) of this rank's sequences, in order.
  std::vector<std::pair<int64_t, int64_t>> picks(static_cast<size_t>(per_rank));
  if (sources_.size() == 1) {
    const std::vector<int64_t>& perm = permutation(b / batches_per_epoch_);
    const int64_t first = (b % batches_per_epoch_) * global_batch_ + mine;
    for (int64_t i = 0; i < per_rank; ++i) picks[size_t(i)] = {0, perm[size_t(first + i)]};
    draws_[0] += global_batch_;
  } else {
    // Every rank walks all G slots, so the draws stay the same everywhere.
    for (int64_t slot = 0; slot < global_batch_; ++slot) {
      const int64_t s = schedule_.next(draws_);
      if (slot >= mine && slot < mine + per_rank) picks[size_t(slot - mine)] = {s, mix_instance(s, draws_[size_t(s)] - 1)};
    }
  }
  std::vector<Batch> out(static_cast<size_t>(micro_steps_per_batch()));
  std::vector<int32_t> scratch;
  for (int64_t m = 0; m < micro_steps_per_batch(); ++m) {
    Batch& mb = out[m];
    mb.batch = b;
    mb.seq_len = seq_len_;
    mb.inputs.resize(static_cast<size_t>(micro_batch_ * seq_len_));
    mb.targets.resize(mb.inputs.size());
    for (int64_t s = 0; s < micro_batch_; ++s) {
      const auto& [src, inst] = picks[size_t(m * micro_batch_ + s)];
      read_instance(sources_[size_t(src)].source, inst, mb.inputs.data() + s * seq_len_,
                    mb.targets.data() + s * seq_len_, scratch);
    }
  }
  ++position_;
  return out;
}

int64_t DataLoader::num_eval_batches(int64_t sequences) const {
  MOE_CHECK(sequences > 0, "eval batch size must be positive, got ", sequences);
  MOE_CHECK(sources_.size() == 1, "eval batches come from one source, not a mix of ", sources_.size());
  return num_instances_ / sequences;
}

Batch DataLoader::eval_batch(int64_t index, int64_t sequences) const {
  const int64_t n = num_eval_batches(sequences);
  MOE_CHECK(index >= 0 && index < n, "eval batch ", index, " out of range: ", num_instances_,
            " instances make ", n, " eval batches of ", sequences, " sequences");
  Batch out;
  out.batch = index;
  out.seq_len = seq_len_;
  out.inputs.resize(static_cast<size_t>(sequences * seq_len_));
  out.targets.resize(out.inputs.size());
  std::vector<int32_t> scratch;
  for (int64_t s = 0; s < sequences; ++s)
    read_instance(sources_[0].source, index * sequences + s, out.inputs.data() + s * seq_len_,
                  out.targets.data() + s * seq_len_, scratch);
  return out;
}

}  // namespace moe
