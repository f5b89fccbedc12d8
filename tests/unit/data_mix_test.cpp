// Weighted data mixes (data/dataset.h MixSchedule, DataLoader over several sources) and their
// config keys: realised shares within 1% of the weights over 10k instances, the same global
// sequence under dp = 1 and dp = 2, exact resumption from the draws (and by replay), and the
// config errors of [[data.sources]].
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/config_io.h"
#include "data/dataset.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

constexpr int64_t kLen = 4;  // seq_len; instances of 5 tokens

// Source s: `n` instances whose tokens are 1000 s + instance (every token of an instance the same),
// so a row tells its source and instance.
TokenSource tagged_source(int64_t s, int64_t n) {
  std::vector<uint32_t> t;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= kLen; ++j) t.push_back(static_cast<uint32_t>(10000 * s + i));
  return TokenSource::from_memory(std::move(t), "source" + std::to_string(s), 40000);
}

std::vector<WeightedSource> mix(const std::vector<double>& weights, const std::vector<int64_t>& sizes) {
  std::vector<WeightedSource> out;
  for (size_t s = 0; s < weights.size(); ++s) out.push_back({tagged_source(int64_t(s), sizes[s]), weights[s]});
  return out;
}

using Rows = std::vector<std::pair<int, int>>;

// (source, instance) of every row of a step's micro-batches.
std::vector<std::pair<int, int>> rows_of(const std::vector<Batch>& micro) {
  std::vector<std::pair<int, int>> out;
  for (const Batch& b : micro)
    for (int64_t r = 0; r < b.num_sequences(); ++r) {
      const int32_t tok = b.inputs[size_t(r * kLen)];
      out.emplace_back(tok / 10000, tok % 10000);
    }
  return out;
}

TEST(DataMix, ScheduleSharesFollowTheWeights) {
  for (const std::vector<double>& w : {std::vector<double>{0.7, 0.2, 0.1}, {1, 3}, {5, 1, 1, 1, 2}, {0.5, 0.5}}) {
    const MixSchedule sched(w);
    double sum = 0;
    for (double x : w) sum += x;
    std::vector<int64_t> draws(w.size(), 0);
    double worst_prefix = 0;
    for (int64_t k = 1; k <= 10000; ++k) {
      sched.next(draws);
      for (size_t s = 0; s < w.size(); ++s)
        worst_prefix = std::max(worst_prefix, std::abs(double(draws[s]) - double(k) * w[s] / sum));
    }
    for (size_t s = 0; s < w.size(); ++s)
      EXPECT_NEAR(double(draws[s]) / 10000.0, w[s] / sum, 0.01) << "source " << s << " of " << w.size();
    EXPECT_LT(worst_prefix, 2.0);  // every prefix stays within 2 instances of its exact share
  }
  // Deterministic: the same slots twice.
  const MixSchedule a({0.3, 0.7}), b({0.3, 0.7});
  std::vector<int64_t> da(2, 0), db(2, 0);
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(a.next(da), b.next(db));
  EXPECT_NE(error_of([] { MixSchedule({1.0, 0.0}); }).find("data.sources[1].weight must be a finite number > 0"),
            std::string::npos);
}

TEST(DataMix, LoaderRealisesTheWeightsOver10kInstances) {
  // Sources of different sizes: the small one is repeated (its epochs), the large one not used up.
  DataLoader dl(mix({0.6, 0.3, 0.1}, {50, 4000, 7}), kLen, 40, 10, 1234, 0, 1);
  std::vector<int64_t> rows(3, 0);
  for (int step = 0; step < 250; ++step)  // 10000 instances
    for (const auto& [s, i] : rows_of(dl.next())) {
      ++rows[size_t(s)];
      ASSERT_LT(i, (std::vector<int>{50, 4000, 7})[size_t(s)]);
    }
  EXPECT_EQ(rows, dl.source_draws());
  EXPECT_NEAR(rows[0] / 10000.0, 0.6, 0.01);
  EXPECT_NEAR(rows[1] / 10000.0, 0.3, 0.01);
  EXPECT_NEAR(rows[2] / 10000.0, 0.1, 0.01);
  // Within each global batch of 40 the counts are already the weights' (24, 12, 4).
  DataLoader fresh(mix({0.6, 0.3, 0.1}, {50, 4000, 7}), kLen, 40, 10, 1234, 0, 1);
  std::vector<int64_t> one(3, 0);
  for (const auto& [s, i] : rows_of(fresh.next())) ++one[size_t(s)];
  EXPECT_EQ(one, (std::vector<int64_t>{24, 12, 4}));
  // A source's epoch visits each of its instances once: the 7-instance source over 70 draws.
  DataLoader small(mix({1, 1}, {7, 100}), kLen, 14, 14, 5, 0, 1);
  std::vector<int> seen(7, 0);
  for (int step = 0; step < 10; ++step)
    for (const auto& [s, i] : rows_of(small.next()))
      if (s == 0) ++seen[size_t(i)];
  EXPECT_EQ(seen, std::vector<int>(7, 10));
}

TEST(DataMix, SameGlobalSequenceUnderEveryDpLayout) {
  const auto sources = [] { return mix({0.5, 0.25, 0.25}, {30, 11, 200}); };
  DataLoader one(sources(), kLen, 8, 2, 99, 0, 1);
  DataLoader r0(sources(), kLen, 8, 2, 99, 0, 2), r1(sources(), kLen, 8, 4, 99, 1, 2);
  DataLoader q0(sources(), kLen, 8, 1, 99, 0, 4), q3(sources(), kLen, 8, 1, 99, 3, 4);
  for (int step = 0; step < 40; ++step) {  // past several epochs of the 11-instance source
    const auto all = rows_of(one.next());
    auto halves = rows_of(r0.next());
    const auto second = rows_of(r1.next());
    halves.insert(halves.end(), second.begin(), second.end());
    ASSERT_EQ(all, halves) << "step " << step;
    const auto first_q = rows_of(q0.next()), last_q = rows_of(q3.next());
    ASSERT_EQ(first_q, Rows(all.begin(), all.begin() + 2)) << "step " << step;
    ASSERT_EQ(last_q, Rows(all.end() - 2, all.end())) << "step " << step;
    ASSERT_EQ(one.source_draws(), r1.source_draws());
  }
  // Another seed shuffles the sources' instances differently.
  DataLoader other(sources(), kLen, 8, 2, 100, 0, 1);
  DataLoader again(sources(), kLen, 8, 2, 99, 0, 1);
  bool differs = false;
  for (int step = 0; step < 5; ++step) differs |= rows_of(other.next()) != rows_of(again.next());
  EXPECT_TRUE(differs);
}

TEST(DataMix, ResumesExactlyFromTheDrawsOrByReplay) {
  const auto sources = [] { return mix({0.7, 0.3}, {13, 29}); };
  DataLoader straight(sources(), kLen, 6, 3, 7, 0, 1);
  std::vector<std::vector<std::pair<int, int>>> steps;
  std::vector<std::vector<int64_t>> draws_at;
  for (int s = 0; s < 30; ++s) {
    draws_at.push_back(straight.source_draws());
    steps.push_back(rows_of(straight.next()));
  }
  for (const int64_t at : {0, 1, 7, 17, 29}) {
    DataLoader resumed(sources(), kLen, 6, 3, 7, 1, 2);  // another layout: rank 1 of 2
    resumed.set_state(at, draws_at[size_t(at)]);
    DataLoader replayed(sources(), kLen, 6, 3, 7, 0, 2);
    replayed.set_position(at);
    EXPECT_EQ(replayed.source_draws(), draws_at[size_t(at)]);
    for (int64_t s = at; s < 30; ++s) {
      const auto tail = rows_of(resumed.next()), head = rows_of(replayed.next());
      ASSERT_EQ(head, Rows(steps[size_t(s)].begin(), steps[size_t(s)].begin() + 3));
      ASSERT_EQ(tail, Rows(steps[size_t(s)].begin() + 3, steps[size_t(s)].end()));
    }
  }
  DataLoader dl(sources(), kLen, 6, 3, 7, 0, 1);
  EXPECT_NE(error_of([&] { dl.set_state(2, {5, 5}); }).find("draws sum to 10 instances, but 2 global batches of 6"),
            std::string::npos);
  EXPECT_NE(error_of([&] { dl.set_state(1, {6}); }).find("names 1 sources, but the data has 2"), std::string::npos);
  EXPECT_NE(error_of([&] { DataLoader(mix({1, 1}, {3, 0}), kLen, 2, 1, 7, 0, 1); }).find("data.sources[1] holds 0 tokens"),
            std::string::npos);
}

TEST(DataMix, ConfigKeysParseRoundTripAndRefuseMistakes) {
  const Config c = parse_config_toml(R"(
[data]
source = "tokens"
[[data.sources]]
paths = ["a.npy", "b.npy"]
weight = 0.7
[[data.sources]]
paths = ["c.npy"]
weight = 3
)",
                                     "mix.toml");
  ASSERT_EQ(c.data.sources.size(), 2u);
  EXPECT_EQ(c.data.sources[0].paths, (std::vector<std::string>{"a.npy", "b.npy"}));
  EXPECT_EQ(c.data.sources[0].weight, 0.7);
  EXPECT_EQ(c.data.sources[1].weight, 3.0);
  EXPECT_NO_THROW(validate_config(c));
  const Config back = parse_config_toml(config_to_toml(c), "back.toml");
  EXPECT_EQ(back.data.sources, c.data.sources);
  EXPECT_NE(config_help().find("data.sources"), std::string::npos);

  Config o;
  apply_override(o, R"(--data.sources=[{paths = ["x.npy"], weight = 2}, {paths = ["y.npy"], weight = 1}])");
  ASSERT_EQ(o.data.sources.size(), 2u);
  EXPECT_EQ(o.data.sources[1].paths, (std::vector<std::string>{"y.npy"}));
  apply_override(o, "--data.sources=");
  EXPECT_TRUE(o.data.sources.empty());
  EXPECT_NE(error_of([&] { apply_override(o, "--data.sources=[1, 2]"); }).find("data.sources[0]: expected a table"),
            std::string::npos);

  auto parse_error = [](const std::string& text) { return error_of([&] { parse_config_toml(text, "m.toml"); }); };
  EXPECT_NE(parse_error("[[data.sources]]\npaths = [\"a\"]\n").find("data.sources[0]: missing key 'weight'"),
            std::string::npos);
  EXPECT_NE(parse_error("[[data.sources]]\nweight = 1\n").find("data.sources[0]: missing key 'paths'"), std::string::npos);
  EXPECT_NE(parse_error("[[data.sources]]\npaths = [\"a\"]\nwieght = 1\n").find("unknown key 'wieght'"),
            std::string::npos);
  EXPECT_NE(parse_error("[[data.sources]]\npaths = [\"a\"]\nwieght = 1\n").find("did you mean 'weight'"),
            std::string::npos);
  EXPECT_NE(parse_error("[[data.sources]]\npaths = \"a\"\nweight = 1\n").find("data.sources[0].paths: expected an array"),
            std::string::npos);
  EXPECT_NE(parse_error("[[data.sources]]\npaths = [\"a\"]\nweight = \"x\"\n").find("data.sources[0].weight: expected a number"),
            std::string::npos);

  auto invalid = [](const std::function<void(Config&)>& edit) {
    Config v;
    v.data.source = "tokens";
    v.data.sources = {{{"a.npy"}, 1.0}, {{"b.npy"}, 2.0}};
    edit(v);
    return error_of([&] { validate_config(v); });
  };
  EXPECT_NE(invalid([](Config& v) { v.data.paths = {"c.npy"}; }).find("data.paths and data.sources are both set"),
            std::string::npos);
  EXPECT_NE(invalid([](Config& v) { v.data.sources[1].weight = 0; }).find("data.sources[1].weight must be a finite number > 0, got 0.0"),
            std::string::npos);
  EXPECT_NE(invalid([](Config& v) { v.data.sources[0].weight = -1; }).find("data.sources[0].weight"), std::string::npos);
  EXPECT_NE(invalid([](Config& v) { v.data.sources[0].paths.clear(); }).find("data.sources[0].paths must name"),
            std::string::npos);
  EXPECT_NE(invalid([](Config& v) { v.data.source = "embedded"; }).find("data.source = \"embedded\" ignores them"),
            std::string::npos);
}

}  // namespace
}  // namespace moe::testing
