// FlatShardPlan (the GPU step's ZeRO-1 plan): over every rank of a group, the chunks and tails
// tile each span exactly once; chunks are equal, multiples of align and as large as fit; each
// rank's moment state is dense and disjoint; the norm pieces of all ranks count every element
// once; one rank owns everything as one piece; the AdamW segments leave the layout's padding out
// and carry decay and state offsets; bad arguments are refused by name.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "optim/flat_shards.h"

namespace moe {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

struct Case {
  std::vector<FlatSpan> spans;
  int64_t group_size, max_bucket, align;
};

// For each rank r of a group of `g`: the plan, then checks across ranks.
void check_tiling(const Case& c) {
  const std::string what = "group " + std::to_string(c.group_size) + ", max_bucket " + std::to_string(c.max_bucket) +
                           ", align " + std::to_string(c.align);
  const int64_t g = c.group_size;
  std::vector<FlatShardPlan> plans;
  for (int64_t r = 0; r < g; ++r) plans.emplace_back(c.spans, std::vector<int64_t>{g}, std::vector<int64_t>{r}, c.max_bucket, c.align);
  const int64_t total = c.spans.back().end;
  std::vector<int> updated(size_t(total), 0), counted(size_t(total), 0), chunk_owner(size_t(total), -1);
  for (int64_t r = 0; r < g; ++r) {
    const FlatShardPlan& p = plans[size_t(r)];
    ASSERT_EQ(p.buckets().size(), plans[0].buckets().size()) << what;
    std::vector<int> state_used(size_t(p.state_numel()), 0);
    int64_t covered = 0;
    for (size_t k = 0; k < p.buckets().size(); ++k) {
      const FlatBucket& b = p.buckets()[k];
      const FlatBucket& b0 = plans[0].buckets()[k];
      EXPECT_EQ(b.begin, b0.begin) << what;  // the same buckets on every rank
      EXPECT_EQ(b.chunk, b0.chunk) << what;
      EXPECT_LE(b.end - b.begin, c.max_bucket) << what;
      EXPECT_EQ(b.chunk % c.align, 0) << what;
      EXPECT_GE(b.tail_numel(), 0) << what;
      EXPECT_LT(b.tail_numel(), g * c.align) << what << ": a larger chunk would fit";
      EXPECT_EQ(b.own_begin(), b.begin + r * b.chunk) << what;
      for (int64_t i = b.own_begin(); i < b.own_begin() + b.chunk; ++i) {
        EXPECT_EQ(chunk_owner[size_t(i)], -1) << what << ": element " << i << " in two chunks";
        chunk_owner[size_t(i)] = int(r);
      }
      for (int64_t i = 0; i < b.chunk; ++i) ++state_used[size_t(b.state_chunk + i)];
      for (int64_t i = 0; i < b.tail_numel(); ++i) ++state_used[size_t(b.state_tail + i)];
      covered += b.end - b.begin;
    }
    int64_t span_total = 0;
    for (const FlatSpan& s : c.spans) span_total += s.end - s.begin;
    EXPECT_EQ(covered, span_total) << what << ": buckets do not tile the spans";
    for (size_t i = 0; i < state_used.size(); ++i) EXPECT_EQ(state_used[i], 1) << what << ": state " << i;
    for (const FlatPiece& q : p.updated_pieces())
      for (int64_t i = q.begin; i < q.end; ++i) ++updated[size_t(i)];
    for (const FlatPiece& q : p.norm_pieces())
      for (int64_t i = q.begin; i < q.end; ++i) ++counted[size_t(i)];
  }
  for (const FlatSpan& s : c.spans) {
    for (int64_t i = s.begin; i < s.end; ++i) {
      EXPECT_EQ(counted[size_t(i)], 1) << what << ": element " << i << " counted in the norm " << counted[size_t(i)]
                                       << " times";
      // A chunk element is updated by its owner only; a tail element by every rank.
      EXPECT_EQ(updated[size_t(i)], chunk_owner[size_t(i)] >= 0 ? 1 : g) << what << ": element " << i;
    }
  }
}

TEST(FlatShardPlan, ChunksAndTailsTileEverySpanOnce) {
  // Spans of lengths that are and are not multiples of group x align, a gap between spans (a
  // span of another group), buckets cut by max_bucket.
  const std::vector<FlatSpan> spans = {{0, 640, 0}, {640, 1280 + 64, 0}, {2048, 2048 + 4096 + 192, 0}};
  for (int64_t g : {1, 2, 3, 4, 8})
    for (int64_t max_bucket : {int64_t(256), int64_t(1024), int64_t(1) << 20}) check_tiling({spans, g, max_bucket, 64});
  check_tiling({{{0, 100, 0}, {100, 101, 0}}, 3, 8, 4});  // small odd sizes, align 4
}

TEST(FlatShardPlan, ChunkIsTheLargestMultipleOfAlignThatFits) {
  const FlatShardPlan p({{0, 1000, 0}}, {3}, {1}, 1 << 20, 64);
  ASSERT_EQ(p.buckets().size(), 1u);
  const FlatBucket& b = p.buckets()[0];
  EXPECT_EQ(b.chunk, 320);  // 3 x 320 = 960 <= 1000 < 3 x 384
  EXPECT_EQ(b.own_begin(), 320);
  EXPECT_EQ(b.scattered_end(), 960);
  EXPECT_EQ(b.tail_numel(), 40);
  EXPECT_EQ(b.state_chunk, 0);
  EXPECT_EQ(b.state_tail, 320);
  EXPECT_EQ(p.state_numel(), 360);
  // Rank 1 updates its chunk and the tail; only rank 0 counts the tail in the norm.
  const std::vector<FlatPiece> up = p.updated_pieces();
  ASSERT_EQ(up.size(), 2u);
  EXPECT_EQ(up[0].begin, 320);
  EXPECT_EQ(up[0].end, 640);
  EXPECT_EQ(up[1].begin, 960);
  EXPECT_EQ(up[1].state, 320);
  ASSERT_EQ(p.norm_pieces().size(), 1u);
  EXPECT_EQ(p.norm_pieces()[0].end, 640);
  // A bucket shorter than group x align: all tail.
  const FlatShardPlan small({{0, 128, 0}}, {4}, {2}, 1 << 20, 64);
  EXPECT_EQ(small.buckets()[0].chunk, 0);
  EXPECT_EQ(small.buckets()[0].tail_numel(), 128);
  EXPECT_TRUE(small.norm_pieces().empty());
}

TEST(FlatShardPlan, BucketsAreCutFromTheSpanEndDown) {
  const FlatShardPlan p({{0, 1000, 0}}, {1}, {0}, 256, 64);
  ASSERT_EQ(p.buckets().size(), 4u);
  EXPECT_EQ(p.buckets()[0].begin, 0);
  EXPECT_EQ(p.buckets()[0].end, 232);  // the rest, at the span's begin
  EXPECT_EQ(p.buckets()[1].begin, 232);
  EXPECT_EQ(p.buckets()[3].end, 1000);
  EXPECT_EQ(p.max_bucket_numel(), 256);
}

TEST(FlatShardPlan, OneRankOwnsEverythingAsOnePiece) {
  const FlatShardPlan p({{0, 640, 0}, {640, 1280, 0}, {1280, 5000, 0}}, {1}, {0}, 1024, 64);
  EXPECT_EQ(p.state_numel(), 5000);
  for (const std::vector<FlatPiece>& v : {p.updated_pieces(), p.norm_pieces()}) {
    ASSERT_EQ(v.size(), 1u);
    EXPECT_EQ(v[0].begin, 0);
    EXPECT_EQ(v[0].end, 5000);
    EXPECT_EQ(v[0].state, 0);
  }
}

TEST(FlatShardPlan, TwoGroupsCountEachElementOnceOverTheDataParallelRanks) {
  // dp 4 = ep 2 x ep-dp 2: dense spans over the 4 dp ranks, expert spans over the 2 ranks of the
  // ep-dp group holding the same experts (dp rank d: ep rank d % 2, ep-dp rank d / 2). Different
  // ep ranks hold different experts, so an expert element is (expert, ep rank) here.
  const std::vector<FlatSpan> spans = {{0, 448, 0}, {448, 1600, 1}, {1600, 2000, 0}};
  const int64_t total = 2000;
  std::map<std::pair<int64_t, int64_t>, int> expert_counts;
  std::vector<int> dense(size_t(total), 0);
  for (int64_t d = 0; d < 4; ++d) {
    const FlatShardPlan p(spans, {4, 2}, {d, d / 2}, 256, 64);
    for (const FlatPiece& q : p.norm_pieces())
      for (int64_t i = q.begin; i < q.end; ++i) {
        if (i >= 448 && i < 1600) ++expert_counts[{i, d % 2}];
        else ++dense[size_t(i)];
      }
  }
  for (int64_t i = 0; i < total; ++i) {
    if (i >= 448 && i < 1600) {
      EXPECT_EQ((expert_counts[{i, 0}]), 1) << i;
      EXPECT_EQ((expert_counts[{i, 1}]), 1) << i;
    } else {
      EXPECT_EQ(dense[size_t(i)], 1) << i;
    }
  }
}

TEST(FlatShardPlan, SegmentsLeavePaddingOutAndCarryDecayAndState) {
  ParamLayout layout;
  layout.add("a", {100}, true);       // [0, 100), padding to 128
  layout.add("b", {64}, false);       // [128, 192)
  layout.add("c", {10, 30}, true);    // [192, 492), padding to 512
  ASSERT_EQ(layout.total_numel(), 512);
  // Two ranks, one bucket: chunk 256 each. Rank 1 owns [256, 512).
  const FlatShardPlan p1({{0, 512, 0}}, {2}, {1}, 1 << 20, 64);
  const std::vector<ShardSegment> s1 = p1.segments(layout);
  ASSERT_EQ(s1.size(), 1u);
  EXPECT_EQ(s1[0].offset, 256);
  EXPECT_EQ(s1[0].numel, 492 - 256);
  EXPECT_TRUE(s1[0].decay);
  EXPECT_EQ(s1[0].state_offset, 0);
  const FlatShardPlan p0({{0, 512, 0}}, {2}, {0}, 1 << 20, 64);
  const std::vector<ShardSegment> s0 = p0.segments(layout);
  ASSERT_EQ(s0.size(), 3u);
  EXPECT_EQ(s0[0].offset, 0);
  EXPECT_EQ(s0[0].numel, 100);
  EXPECT_EQ(s0[1].offset, 128);
  EXPECT_FALSE(s0[1].decay);
  EXPECT_EQ(s0[1].state_offset, 128);
  EXPECT_EQ(s0[2].offset, 192);
  EXPECT_EQ(s0[2].numel, 64);
  EXPECT_EQ(s0[2].state_offset, 192);
}

TEST(FlatShardPlan, RefusesBadArgumentsByName) {
  EXPECT_NE(error_of([] { FlatShardPlan({{0, 64, 0}}, {2}, {2}, 64, 64); }).find("rank 2 is not in group 0 of 2"),
            std::string::npos);
  EXPECT_NE(error_of([] { FlatShardPlan({{0, 64, 0}, {32, 128, 0}}, {1}, {0}, 64, 64); }).find("sorted and disjoint"),
            std::string::npos);
  EXPECT_NE(error_of([] { FlatShardPlan({{0, 64, 1}}, {1}, {0}, 64, 64); }).find("names group 1"), std::string::npos);
  EXPECT_NE(error_of([] { FlatShardPlan({{0, 64, 0}}, {1}, {0}, 100, 64); }).find("max_bucket"), std::string::npos);
}

}  // namespace
}  // namespace moe
