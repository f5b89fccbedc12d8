// Load statistics of train/metrics.h on counts whose answers are obvious: max/mean per expert
// (balanced, one hot expert, all empty) and the sums per expert-parallel rank.
#include <gtest/gtest.h>

#include <vector>

#include "core/error.h"
#include "train/metrics.h"

namespace moe::testing {
namespace {

TEST(Metrics, MaxOverMean) {
  EXPECT_EQ(max_over_mean({5, 5, 5, 5}), 1.0);
  EXPECT_EQ(max_over_mean({8, 0, 0, 0}), 4.0);        // every route to one expert: E
  EXPECT_EQ(max_over_mean({3, 1, 2, 2}), 1.5);        // mean 2, max 3
  EXPECT_EQ(max_over_mean({0, 0, 0}), 1.0);           // no routes: balanced, as load_imbalance
  EXPECT_EQ(max_over_mean({}), 1.0);
  EXPECT_EQ(load_imbalance({{3, 1, 2, 2}, {8, 0, 0, 0}}), (1.5 + 4.0) / 2);
}

TEST(Metrics, TokensPerRankGroupsExpertsInOrder) {
  const std::vector<int64_t> counts = {1, 2, 3, 4, 5, 6, 7, 8};
  EXPECT_EQ(tokens_per_rank(counts, 1), (std::vector<int64_t>{36}));
  EXPECT_EQ(tokens_per_rank(counts, 2), (std::vector<int64_t>{10, 26}));  // experts 0-3, 4-7
  EXPECT_EQ(tokens_per_rank(counts, 4), (std::vector<int64_t>{3, 7, 11, 15}));
  EXPECT_EQ(tokens_per_rank(counts, 8), counts);
  // Imbalanced experts, balanced ranks: each rank's pair sums to 12.
  const std::vector<int64_t> hot = {12, 0, 3, 9, 6, 6};  // mean 6, max 12
  EXPECT_EQ(max_over_mean(hot), 2.0);
  EXPECT_EQ(tokens_per_rank(hot, 3), (std::vector<int64_t>{12, 12, 12}));
  EXPECT_EQ(max_over_mean(tokens_per_rank(hot, 3)), 1.0);
  EXPECT_EQ(max_over_mean(tokens_per_rank(hot, 2)), 21.0 / 18.0);  // ranks {15, 21}
  EXPECT_THROW(tokens_per_rank(counts, 3), Error);
}

}  // namespace
}  // namespace moe::testing
