// ZeRO-1 over flat buffers in place (the GPU step): which elements of the flat gradient and
// parameter buffers (a ParamLayout's, alignment padding included) each data-parallel rank reduces,
// updates and gathers, and where its AdamW moments live. Unlike ShardPlan (zero1.h), nothing is
// packed: the flat buffer is cut into buckets (within one span of one reduction group, at most
// max_bucket elements each), and each bucket [begin, end) of a group of G ranks into
//   - a scattered part [begin, begin + G x chunk): G equal contiguous chunks of `chunk` elements
//     (chunk a multiple of `align`, as large as fits), reduce-scattered so that rank r holds the
//     sum of chunk r, then all-gathered after its update (NCCL's in-place reduce-scatter and
//     all-gather: chunk r sits at begin + r x chunk in every rank's buffer);
//   - a tail [begin + G x chunk, end) of fewer than G x align elements, all-reduced and updated
//     by every rank of the group alike (replicated, so nothing is gathered), because the flat
//     buffer cannot be padded to a multiple of G x align without reallocating it.
// A rank's moment state is its chunk and the tail of every bucket, in bucket order (ascending
// flat offset): state_numel() elements. A group of one rank (or a span not reduced at all) owns
// its buckets whole. Host only: the plan is built once and read by the step runner and its tests.
#pragma once

#include <cstdint>
#include <vector>

#include "core/arena.h"

namespace moe {

// A flat range reduced over one group: group 0 is the data-parallel group, 1 the ep-dp group.
struct FlatSpan {
  int64_t begin = 0, end = 0;
  int group = 0;
};

struct FlatBucket {
  int64_t begin = 0, end = 0;
  int group = 0;
  int64_t group_size = 1, group_rank = 0;
  int64_t chunk = 0;        // elements of each rank's chunk of the scattered part
  int64_t state_chunk = 0;  // where this rank's chunk sits in its moment state
  int64_t state_tail = 0;   // where the tail sits in its moment state (after the chunk)
  int64_t scattered_end() const { return begin + group_size * chunk; }  // the tail begins here
  int64_t own_begin() const { return begin + group_rank * chunk; }      // this rank's chunk
  int64_t tail_numel() const { return end - scattered_end(); }
};

// Flat elements [begin, end) with their moments at state index `state` onwards.
struct FlatPiece {
  int64_t begin = 0, end = 0, state = 0;
};

// An AdamW segment of the sharded step: layout elements [offset, offset + numel) with weight
// decay `decay`, moments at state index state_offset onwards.
struct ShardSegment {
  int64_t offset = 0, numel = 0;
  bool decay = true;
  int64_t state_offset = 0;
};

class FlatShardPlan {
 public:
  // spans: sorted, disjoint, non-empty; group_sizes[g] >= 1 and group_ranks[g] in [0, size) for
  // every group a span names; max_bucket and align > 0 with max_bucket a multiple of align.
  // Each span is cut from its end downwards into buckets of max_bucket elements (the last, at the
  // span's begin, holds the rest). Throws naming the offending argument.
  FlatShardPlan(const std::vector<FlatSpan>& spans, const std::vector<int64_t>& group_sizes,
                const std::vector<int64_t>& group_ranks, int64_t max_bucket, int64_t align);

  const std::vector<FlatBucket>& buckets() const { return buckets_; }  // ascending begin
  int64_t state_numel() const { return state_numel_; }
  int64_t max_bucket_numel() const { return max_bucket_numel_; }

  // What this rank updates with AdamW: its chunks and every tail, ascending, adjacent pieces
  // merged where their states are adjacent too.
  std::vector<FlatPiece> updated_pieces() const;
  // What this rank adds to the global squared gradient norm so that the sum over the
  // data-parallel ranks counts every element once: its chunks, and the tails where it is rank 0
  // of the bucket's group. Ascending, adjacent ranges merged (one range [0, n) on one rank).
  std::vector<FlatPiece> norm_pieces() const;
  // updated_pieces() cut at the layout's entries: the AdamW segments (padding between entries
  // left out), ascending.
  std::vector<ShardSegment> segments(const ParamLayout& layout) const;

 private:
  std::vector<FlatBucket> buckets_;
  int64_t state_numel_ = 0, max_bucket_numel_ = 0;
};

}  // namespace moe
