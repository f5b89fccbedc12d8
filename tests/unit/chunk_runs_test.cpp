// chunk_runs (the chunks the GPU's AdamW launches blocks for) against a bitmap of the chunks each
// segment touches: the runs cover exactly the touched chunks, in order, numbered compactly.
#include "core/chunk_runs.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "core/error.h"
#include "cuda/optim_types.h"

namespace moe {
namespace {

// The touched chunks in order, from the runs.
std::vector<int64_t> expand(const std::vector<cuda::ChunkRun>& runs, int64_t total) {
  std::vector<int64_t> out;
  for (size_t r = 0; r < runs.size(); ++r) {
    const int64_t end = r + 1 < runs.size() ? runs[r + 1].before : total;
    EXPECT_LT(runs[r].before, end) << "run " << r << " is empty";
    for (int64_t i = runs[r].before; i < end; ++i) out.push_back(runs[r].first + (i - runs[r].before));
  }
  return out;
}

std::vector<int64_t> touched(const std::vector<cuda::ParamSegment>& segs, int64_t chunk) {
  std::vector<int64_t> out;
  for (const cuda::ParamSegment& s : segs)
    for (int64_t e = s.offset; e < s.offset + s.numel; ++e)
      if (out.empty() || out.back() != e / chunk) out.push_back(e / chunk);
  return out;
}

TEST(ChunkRuns, CoverTheTouchedChunksOnce) {
  const std::vector<cuda::ParamSegment> segs = {{0, 10, 1, 0},         {4090, 10, 1, 0}, {100000, 5, 0, 0},
                                                {200000, 8192, 1, 0},  {208192, 0, 1, 0}, {208200, 4, 1, 0}};
  int64_t total = 0;
  const std::vector<cuda::ChunkRun> runs = chunk_runs(segs, 4096, &total);
  ASSERT_EQ(runs.size(), 3u);  // chunks 0-1, 24, 48-50: a shared chunk once, adjacent chunks one run
  EXPECT_EQ(total, 6);
  EXPECT_EQ(runs[0].first, 0);
  EXPECT_EQ(runs[1].first, 24);
  EXPECT_EQ(runs[1].before, 2);
  EXPECT_EQ(runs[2].first, 48);
  EXPECT_EQ(runs[2].before, 3);
  EXPECT_EQ(expand(runs, total), touched(segs, 4096));
  EXPECT_TRUE(chunk_runs(std::vector<cuda::ParamSegment>{}, 4096, &total).empty());
  EXPECT_EQ(total, 0);
  EXPECT_TRUE(chunk_runs(std::vector<cuda::ParamSegment>{{64, 0, 1, 0}}, 4096, &total).empty());
  EXPECT_EQ(total, 0);
  EXPECT_THROW(chunk_runs(segs, 0, &total), Error);
}

// Random sorted disjoint segments (gaps of 0 to 3 chunks, sizes from 1 element to several
// chunks, empty ones between): the runs expand to the bitmap's chunks.
TEST(ChunkRuns, MatchABitmapOnRandomSegments) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t chunk = int64_t{1} << (rng() % 6 + 2);  // 4 .. 128
    std::vector<cuda::ParamSegment> segs;
    int64_t at = int64_t(rng() % 50);
    for (int s = 0; s < 20; ++s) {
      const int64_t n = rng() % 5 == 0 ? 0 : int64_t(rng() % (3 * chunk)) + 1;
      segs.push_back({at, n, 1, 0});
      at += n + int64_t(rng() % (3 * chunk + 1));
    }
    int64_t total = 0;
    const std::vector<cuda::ChunkRun> runs = chunk_runs(segs, chunk, &total);
    const std::vector<int64_t> want = touched(segs, chunk);
    EXPECT_EQ(expand(runs, total), want) << "trial " << trial;
    EXPECT_EQ(total, int64_t(want.size())) << "trial " << trial;
    for (size_t r = 1; r < runs.size(); ++r)
      EXPECT_GT(runs[r].first, runs[r - 1].first + (runs[r].before - runs[r - 1].before))
          << "trial " << trial << ": adjacent runs not joined";
  }
}

}  // namespace
}  // namespace moe
