// DataLoader: instance order per epoch, global-batch indexing across epochs, data-parallel
// slicing and micro-batching. Only std::mt19937_64 (fully specified by the standard) and our
// own rejection sampling and Fisher-Yates are used, so the order is the same on every machine.
#include "data/dataset.h"

#include <algorithm>
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

DataLoader::DataLoader(TokenSource source, int64_t seq_len, int64_t global_batch,
                       int64_t micro_batch, uint64_t seed, int64_t dp_rank, int64_t dp_size)
    : source_(std::move(source)),
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
  num_instances_ = source_.num_tokens() / (seq_len + 1);
  MOE_CHECK(num_instances_ >= global_batch, "not enough token data for one global batch: ",
            source_.num_tokens(), " tokens make ", num_instances_, " instances of seq_len + 1 = ",
            seq_len + 1, " tokens, but global_batch is ", global_batch, "; need at least ",
            global_batch, " x ", seq_len + 1, " = ", global_batch * (seq_len + 1), " tokens");
  batches_per_epoch_ = num_instances_ / global_batch;
}

void DataLoader::set_position(int64_t batches_consumed) {
  MOE_CHECK(batches_consumed >= 0, "data position must be >= 0, got ", batches_consumed);
  position_ = batches_consumed;
}

const std::vector<int64_t>& DataLoader::permutation(int64_t epoch) {
  if (epoch != perm_epoch_) {
    perm_ = instance_permutation(num_instances_, seed_, epoch);
    perm_epoch_ = epoch;
  }
  return perm_;
}

void DataLoader::read_instance(int64_t instance, int32_t* inputs, int32_t* targets,
                               std::vector<int32_t>& scratch) const {
  scratch.resize(static_cast<size_t>(seq_len_ + 1));
  source_.read(instance * (seq_len_ + 1), seq_len_ + 1, scratch.data());
  std::copy(scratch.begin(), scratch.end() - 1, inputs);
  std::copy(scratch.begin() + 1, scratch.end(), targets);
}

std::vector<Batch> DataLoader::next() {
  const int64_t b = position_;
  const std::vector<int64_t>& perm = permutation(b / batches_per_epoch_);
  const int64_t first = (b % batches_per_epoch_) * global_batch_ + dp_rank_ * (global_batch_ / dp_size_);
  std::vector<Batch> out(static_cast<size_t>(micro_steps_per_batch()));
  std::vector<int32_t> scratch;
  for (int64_t m = 0; m < micro_steps_per_batch(); ++m) {
    Batch& mb = out[m];
    mb.batch = b;
    mb.seq_len = seq_len_;
    mb.inputs.resize(static_cast<size_t>(micro_batch_ * seq_len_));
    mb.targets.resize(mb.inputs.size());
    for (int64_t s = 0; s < micro_batch_; ++s)
      read_instance(perm[first + m * micro_batch_ + s], mb.inputs.data() + s * seq_len_,
                    mb.targets.data() + s * seq_len_, scratch);
  }
  ++position_;
  return out;
}

int64_t DataLoader::num_eval_batches(int64_t sequences) const {
  MOE_CHECK(sequences > 0, "eval batch size must be positive, got ", sequences);
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
    read_instance(index * sequences + s, out.inputs.data() + s * seq_len_,
                  out.targets.data() + s * seq_len_, scratch);
  return out;
}

}  // namespace moe
