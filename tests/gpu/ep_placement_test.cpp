// cuda::ep_rowwise_placement against its CPU twin ep_rowwise_placement (parallel/expert_parallel.h):
// the same kept counts, row destinations, receive offsets and dropped count, exactly, for every
// rank of groups of 1 to 64 ranks, up to 256 experts, dropless and with capacities that drop.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/ops/ep_placement.h"
#include "gpu/gpu_test_util.h"
#include "parallel/expert_parallel.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

TEST(EpPlacementGpu, MatchesCpuForEveryRank) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream stream;
  std::mt19937_64 gen(7);
  struct Case {
    int64_t ep, experts, max_count, capacity;
  };
  for (const Case c : {Case{1, 8, 20, 0}, Case{2, 4, 5, 2}, Case{2, 64, 300, 0}, Case{4, 64, 300, 150},
                       Case{8, 256, 40, 30}, Case{64, 64, 9, 4}, Case{4, 8, 0, 3}}) {
    std::vector<int64_t> counts(c.ep * c.experts);
    for (int64_t& v : counts) v = c.max_count > 0 ? int64_t(gen() % uint64_t(c.max_count + 1)) : 0;
    const std::vector<int32_t> counts32(counts.begin(), counts.end());
    GuardedBuffer<int32_t> d_counts(counts32);
    for (int64_t rank = 0; rank < c.ep; ++rank) {
      const EpPlacement want = ep_rowwise_placement(counts, c.ep, rank, c.experts, c.capacity);
      const int64_t rows = static_cast<int64_t>(want.dest_row.size()), local = c.experts / c.ep;
      GuardedBuffer<int32_t> kept(c.ep * c.experts), dest(std::max<int64_t>(rows, 1)), off(local + 1), dropped(1);
      cuda::ep_rowwise_placement(d_counts.data(), c.ep, rank, c.experts, c.capacity, rows, kept.data(), dest.data(),
                                 off.data(), dropped.data(), stream.get());
      stream.sync();
      const std::string at = "ep " + std::to_string(c.ep) + " E " + std::to_string(c.experts) + " capacity " +
                             std::to_string(c.capacity) + " rank " + std::to_string(rank);
      EXPECT_EQ(kept.download(), std::vector<int32_t>(want.kept.begin(), want.kept.end())) << at;
      if (rows > 0) {
        EXPECT_EQ(dest.download(), want.dest_row) << at;
      }
      EXPECT_EQ(off.download(), want.local_offsets) << at;
      EXPECT_EQ(int64_t(dropped.download()[0]), want.num_dropped) << at;
      dest.expect_guards_intact(at + " dest_row");
      kept.expect_guards_intact(at + " kept");
    }
  }
}

TEST(EpPlacementGpu, RefusesBadGroups) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream stream;
  GuardedBuffer<int32_t> b(16);
  const std::string msg = error_of([&] {
    cuda::ep_rowwise_placement(b.data(), 3, 0, 8, 0, 0, b.data(), b.data(), b.data(), b.data(), stream.get());
  });
  EXPECT_NE(msg.find("must be in [1, 4096] and divisible by ep = 3"), std::string::npos) << msg;
  const std::string r = error_of([&] {
    cuda::ep_rowwise_placement(b.data(), 2, 2, 8, 0, 0, b.data(), b.data(), b.data(), b.data(), stream.get());
  });
  EXPECT_NE(r.find("rank 2 outside the group of 2"), std::string::npos) << r;
}

}  // namespace
}  // namespace moe::testing
