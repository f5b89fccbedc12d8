// FlatShardPlan: buckets of each span from its end down, chunks as large multiples of align as fit
// G of them, tails replicated; the moment state laid out bucket by bucket (chunk, then tail).
#include "optim/flat_shards.h"

#include <algorithm>

#include "core/error.h"

namespace moe {

namespace {

// Appends [begin, end) at `state` to `out`, merging with the last piece when the flat ranges
// touch (and, when `states_too`, the states as well).
void append_piece(std::vector<FlatPiece>& out, int64_t begin, int64_t end, int64_t state, bool states_too) {
  if (begin >= end) return;
  if (!out.empty()) {
    FlatPiece& last = out.back();
    if (last.end == begin && (!states_too || last.state + (last.end - last.begin) == state)) {
      last.end = end;
      return;
    }
  }
  out.push_back({begin, end, state});
}

}  // namespace

FlatShardPlan::FlatShardPlan(const std::vector<FlatSpan>& spans, const std::vector<int64_t>& group_sizes,
                             const std::vector<int64_t>& group_ranks, int64_t max_bucket, int64_t align) {
  const char* what = "FlatShardPlan";
  MOE_CHECK(align > 0 && max_bucket > 0 && max_bucket % align == 0, what, ": expected align > 0 and max_bucket a "
            "positive multiple of it, got align = ", align, ", max_bucket = ", max_bucket);
  MOE_CHECK(group_sizes.size() == group_ranks.size(), what, ": ", group_sizes.size(), " group sizes but ",
            group_ranks.size(), " group ranks");
  int64_t prev_end = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    const FlatSpan& s = spans[i];
    MOE_CHECK(s.begin >= prev_end && s.end > s.begin, what, ": span ", i, " [", s.begin, ", ", s.end,
              ") is empty or starts before the previous span's end ", prev_end, " (spans must be sorted and disjoint)");
    MOE_CHECK(s.group >= 0 && size_t(s.group) < group_sizes.size(), what, ": span ", i, " names group ", s.group,
              " but ", group_sizes.size(), " group(s) are given");
    const int64_t g = group_sizes[size_t(s.group)], r = group_ranks[size_t(s.group)];
    MOE_CHECK(g >= 1 && r >= 0 && r < g, what, ": rank ", r, " is not in group ", s.group, " of ", g, " rank(s)");
    prev_end = s.end;
    // Buckets from the span's end down (the order backward finishes gradients), stored ascending.
    std::vector<FlatBucket> cut;
    for (int64_t hi = s.end; hi > s.begin;) {
      const int64_t lo = std::max(s.begin, hi - max_bucket);
      FlatBucket b;
      b.begin = lo;
      b.end = hi;
      b.group = s.group;
      b.group_size = g;
      b.group_rank = r;
      b.chunk = (hi - lo) / (g * align) * align;
      cut.push_back(b);
      hi = lo;
    }
    buckets_.insert(buckets_.end(), cut.rbegin(), cut.rend());
  }
  for (FlatBucket& b : buckets_) {
    b.state_chunk = state_numel_;
    b.state_tail = b.state_chunk + b.chunk;
    state_numel_ = b.state_tail + b.tail_numel();
    max_bucket_numel_ = std::max(max_bucket_numel_, b.end - b.begin);
  }
}

std::vector<FlatPiece> FlatShardPlan::updated_pieces() const {
  std::vector<FlatPiece> out;
  for (const FlatBucket& b : buckets_) {
    append_piece(out, b.own_begin(), b.own_begin() + b.chunk, b.state_chunk, true);
    append_piece(out, b.scattered_end(), b.end, b.state_tail, true);
  }
  return out;
}

std::vector<FlatPiece> FlatShardPlan::norm_pieces() const {
  std::vector<FlatPiece> out;
  for (const FlatBucket& b : buckets_) {
    append_piece(out, b.own_begin(), b.own_begin() + b.chunk, b.state_chunk, false);
    if (b.group_rank == 0) append_piece(out, b.scattered_end(), b.end, b.state_tail, false);
  }
  return out;
}

std::vector<ShardSegment> FlatShardPlan::segments(const ParamLayout& layout) const {
  std::vector<ShardSegment> out;
  const std::vector<ParamEntry>& entries = layout.entries();
  size_t e = 0;
  for (const FlatPiece& p : updated_pieces()) {
    while (e < entries.size() && entries[e].offset + entries[e].numel <= p.begin) ++e;
    for (size_t k = e; k < entries.size() && entries[k].offset < p.end; ++k) {
      const int64_t lo = std::max(p.begin, entries[k].offset);
      const int64_t hi = std::min(p.end, entries[k].offset + entries[k].numel);
      if (lo < hi) out.push_back({lo, hi - lo, entries[k].decay, p.state + (lo - p.begin)});
    }
  }
  return out;
}

}  // namespace moe
