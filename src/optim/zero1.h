// ZeRO-1 distributed optimizer over flat FP32 buffers. A parameter group (the dense entries
// reduced over dp, or the expert entries reduced over ep-dp) is packed in layout order without
// alignment padding into [0, numel), padded to a multiple of the group size, and cut into equal
// contiguous shards: rank r owns [r * shard, (r + 1) * shard). Gradients are reduce-scattered
// (sum), each rank clips and updates its shard (AdamW moments live only for the shard; master
// weights are the FP32 parameters), then parameters are all-gathered into every rank's buffer.
#pragma once

#include <cstdint>
#include <vector>

#include "core/arena.h"
#include "core/config.h"
#include "parallel/comm.h"

namespace moe {

// Part of one layout entry inside a shard: entry elements [entry_offset, entry_offset + numel)
// sit at shard_offset within the shard.
struct ShardPiece {
  int entry = 0;
  int64_t entry_offset = 0, shard_offset = 0, numel = 0;
};

class ShardPlan {
 public:
  // `entries`: indices into layout.entries(), in layout order.
  ShardPlan(const ParamLayout& layout, std::vector<int> entries, int group_size, int group_rank);

  const std::vector<int>& entries() const { return entries_; }
  int group_size() const { return group_size_; }
  int group_rank() const { return group_rank_; }
  int64_t numel() const { return numel_; }                        // packed, without padding
  int64_t shard_numel() const { return shard_numel_; }            // per rank
  int64_t padded_numel() const { return shard_numel_ * group_size_; }
  // The pieces of rank r's shard, in packed order (every packed element in exactly one shard).
  std::vector<ShardPiece> pieces(int r) const;
  const std::vector<ShardPiece>& my_pieces() const { return mine_; }

  // Flat layout buffer <-> packed buffer of padded_numel() (padding written as zero by pack).
  void pack(const float* flat, float* packed) const;
  void unpack(const float* packed, float* flat) const;

 private:
  const ParamLayout& layout_;
  std::vector<int> entries_;
  std::vector<int64_t> packed_offsets_;  // per entry in entries_
  int group_size_, group_rank_;
  int64_t numel_ = 0, shard_numel_ = 0;
  std::vector<ShardPiece> mine_;
};

// Entry indices of the dense (expert = false) or expert entries of `layout`.
std::vector<int> entries_of_kind(const ParamLayout& layout, bool expert);

// The groups of a layout: one over dense_comm holding every entry when expert_comm is nullptr
// (ep = 1), else the dense entries over dense_comm and the expert entries over *expert_comm.
// This rank's plan in each. The distributed optimizer and the checkpoint writer share it.
struct ShardGroup {
  ShardPlan plan;
  Comm* comm;
};
std::vector<ShardGroup> make_shard_groups(const ParamLayout& layout, Comm& dense_comm, Comm* expert_comm);

// Sum of squares (double, in piece order) of a plan's owned elements of a flat layout buffer.
double owned_sum_squares(const ShardPlan& plan, const ParamLayout& layout, const float* flat);

// Sums gradients without sharding (replicated optimizer), in place: the dense flat ranges of the
// layout (flat_ranges(layout, false), model/layout.h) over dense_comm, the expert ranges over
// expert_comm (nullptr: the whole buffer over dense_comm, as with ep = 1).
void all_reduce_gradients(const ParamLayout& layout, float* grads, Comm& dense_comm, Comm* expert_comm);

class DistOptimizer {
 public:
  struct Group {
    ShardPlan plan;
    Comm* comm;
    std::vector<float> m, v, grad, param;  // shard_numel each
  };

  // expert_comm == nullptr: expert entries are sharded with the dense ones over dense_comm.
  DistOptimizer(const ParamLayout& layout, const OptimConfig& cfg, Comm& dense_comm, Comm* expert_comm);

  // Reduce-scatters (sums) the flat gradient buffer: this rank keeps its shard of every group.
  void reduce_gradients(const float* grads);
  // Sum of squares of this rank's gradient shards (double, piece order). Every element of the
  // model is owned by exactly one rank of the job, so its all-reduced sum over all ranks is the
  // exact squared global norm.
  double local_sum_squares() const;
  // Clips the shards by min(1, max_norm / (norm + 1e-6)) (clip_grads), takes one AdamW step on
  // them and all-gathers the parameters into `params` (flat layout buffer) on every rank.
  void step(float* params, double lr, double grad_norm);

  int64_t steps_taken() const { return t_; }
  void set_steps_taken(int64_t t) { t_ = t; }
  std::vector<Group>& groups() { return groups_; }
  const std::vector<Group>& groups() const { return groups_; }

 private:
  const ParamLayout& layout_;
  OptimConfig cfg_;
  std::vector<Group> groups_;
  std::vector<float> packed_;  // scratch: packed gradients, then gathered parameters
  int64_t t_ = 0;
};

}  // namespace moe
