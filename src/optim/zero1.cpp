// ZeRO-1: packed shards, reduce-scatter of gradients, AdamW on the shard (optim/adamw.h math),
// all-gather of parameters. The same ShardPlan decides which rank writes which checkpoint slice.
#include "optim/zero1.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "model/layout.h"
#include "optim/adamw.h"

namespace moe {

ShardPlan::ShardPlan(const ParamLayout& layout, std::vector<int> entries, int group_size, int group_rank)
    : layout_(layout), entries_(std::move(entries)), group_size_(group_size), group_rank_(group_rank) {
  MOE_CHECK(group_size >= 1 && group_rank >= 0 && group_rank < group_size, "shard plan: rank ", group_rank,
            " is not in a group of ", group_size);
  for (int i : entries_) {
    packed_offsets_.push_back(numel_);
    numel_ += layout_.at(i).numel;
  }
  shard_numel_ = (numel_ + group_size - 1) / group_size;
  mine_ = pieces(group_rank);
}

std::vector<ShardPiece> ShardPlan::pieces(int r) const {
  std::vector<ShardPiece> out;
  const int64_t a = int64_t(r) * shard_numel_, b = std::min(numel_, a + shard_numel_);
  for (size_t k = 0; k < entries_.size(); ++k) {
    const int64_t lo = std::max(a, packed_offsets_[k]);
    const int64_t hi = std::min(b, packed_offsets_[k] + layout_.at(entries_[k]).numel);
    if (lo < hi) out.push_back({entries_[k], lo - packed_offsets_[k], lo - a, hi - lo});
  }
  return out;
}

void ShardPlan::pack(const float* flat, float* packed) const {
  for (size_t k = 0; k < entries_.size(); ++k) {
    const ParamEntry& e = layout_.at(entries_[k]);
    std::memcpy(packed + packed_offsets_[k], flat + e.offset, size_t(e.numel) * sizeof(float));
  }
  std::fill(packed + numel_, packed + padded_numel(), 0.f);
}

void ShardPlan::unpack(const float* packed, float* flat) const {
  for (size_t k = 0; k < entries_.size(); ++k) {
    const ParamEntry& e = layout_.at(entries_[k]);
    std::memcpy(flat + e.offset, packed + packed_offsets_[k], size_t(e.numel) * sizeof(float));
  }
}

std::vector<int> entries_of_kind(const ParamLayout& layout, bool expert) {
  std::vector<int> out;
  for (size_t i = 0; i < layout.entries().size(); ++i)
    if (layout.entries()[i].expert == expert) out.push_back(int(i));
  return out;
}

std::vector<ShardGroup> make_shard_groups(const ParamLayout& layout, Comm& dense_comm, Comm* expert_comm) {
  std::vector<ShardGroup> out;
  if (!expert_comm) {
    std::vector<int> all(layout.entries().size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = int(i);
    out.push_back({ShardPlan(layout, std::move(all), dense_comm.size(), dense_comm.rank()), &dense_comm});
  } else {
    out.push_back({ShardPlan(layout, entries_of_kind(layout, false), dense_comm.size(), dense_comm.rank()),
                   &dense_comm});
    out.push_back({ShardPlan(layout, entries_of_kind(layout, true), expert_comm->size(), expert_comm->rank()),
                   expert_comm});
  }
  return out;
}

double owned_sum_squares(const ShardPlan& plan, const ParamLayout& layout, const float* flat) {
  double s = 0;
  for (const ShardPiece& p : plan.my_pieces()) {
    const float* g = flat + layout.at(p.entry).offset + p.entry_offset;
    for (int64_t i = 0; i < p.numel; ++i) s += double(g[i]) * double(g[i]);
  }
  return s;
}

void all_reduce_gradients(const ParamLayout& layout, float* grads, Comm& dense_comm, Comm* expert_comm) {
  if (!expert_comm) {
    dense_comm.all_reduce(grads, layout.total_numel(), ReduceOp::kSum);  // padding is zero
    return;
  }
  // In place, range by range (padding included: zero on every rank).
  for (bool expert : {false, true}) {
    Comm& comm = expert ? *expert_comm : dense_comm;
    for (const FlatRange& r : flat_ranges(layout, expert))
      comm.all_reduce(grads + r.begin, r.end - r.begin, ReduceOp::kSum);
  }
}

DistOptimizer::DistOptimizer(const ParamLayout& layout, const OptimConfig& cfg, Comm& dense_comm, Comm* expert_comm)
    : layout_(layout), cfg_(cfg) {
  for (ShardGroup& sg : make_shard_groups(layout, dense_comm, expert_comm)) {
    const size_t n = size_t(sg.plan.shard_numel());
    groups_.push_back(Group{std::move(sg.plan), sg.comm, std::vector<float>(n, 0.f), std::vector<float>(n, 0.f),
                            std::vector<float>(n, 0.f), std::vector<float>(n, 0.f)});
  }
  int64_t scratch = 0;
  for (const Group& g : groups_) scratch = std::max(scratch, g.plan.padded_numel());
  packed_.assign(size_t(scratch), 0.f);
}

void DistOptimizer::reduce_gradients(const float* grads) {
  for (Group& g : groups_) {
    g.plan.pack(grads, packed_.data());
    g.comm->reduce_scatter(packed_.data(), g.grad.data(), g.plan.shard_numel());
  }
}

double DistOptimizer::local_sum_squares() const {
  double s = 0;
  for (const Group& g : groups_)
    for (const ShardPiece& p : g.plan.my_pieces()) {
      const float* x = g.grad.data() + p.shard_offset;
      for (int64_t i = 0; i < p.numel; ++i) s += double(x[i]) * double(x[i]);
    }
  return s;
}

void DistOptimizer::step(float* params, double lr, double grad_norm) {
  ++t_;
  const AdamWCoefs c = adamw_coefs(cfg_, t_, lr);
  for (Group& g : groups_) {
    clip_grads(g.grad.data(), g.plan.shard_numel(), grad_norm, cfg_.grad_clip);
    for (const ShardPiece& p : g.plan.my_pieces()) {
      const ParamEntry& e = layout_.at(p.entry);
      float* w = g.param.data() + p.shard_offset;
      std::memcpy(w, params + e.offset + p.entry_offset, size_t(p.numel) * sizeof(float));
      adamw_update(w, g.grad.data() + p.shard_offset, g.m.data() + p.shard_offset, g.v.data() + p.shard_offset,
                   p.numel, c, e.decay);
    }
    g.comm->all_gather(g.param.data(), packed_.data(), g.plan.shard_numel());
    g.plan.unpack(packed_.data(), params);
  }
}

}  // namespace moe
