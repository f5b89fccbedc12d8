// Philox4x32-10 known-answer vectors (Random123 KAT), determinism, layout independence of
// slice fills, moment checks (N(0,1): mean 0, var 1; truncated at +-3: var 0.97334; uniform:
// mean 1/2, var 1/12) over 1e5 samples with 5-sigma bounds, and stream separation.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <set>
#include <vector>

#include "core/error.h"
#include "core/rng.h"

namespace moe {
namespace {

using Block = std::array<uint32_t, 4>;

TEST(Philox, KnownAnswerVectors) {
  EXPECT_EQ(Philox::block({0, 0, 0, 0}, {0, 0}), (Block{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(Philox::block({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
            (Block{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  // Random123 kat_vectors: the digits of pi as counter and key.
  EXPECT_EQ(Philox::block({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (Block{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(Philox, CounterAndKeySensitivity) {
  const Block base = Philox::block({1, 2, 3, 4}, {5, 6});
  EXPECT_EQ(Philox::block({1, 2, 3, 4}, {5, 6}), base);
  for (int word = 0; word < 4; ++word) {
    Block c = {1, 2, 3, 4};
    c[word] ^= 1;
    const Block out = Philox::block(c, {5, 6});
    int flipped = 0;
    for (int i = 0; i < 4; ++i) flipped += std::popcount(out[i] ^ base[i]);
    EXPECT_GT(flipped, 40) << "one counter bit (word " << word << ") should flip about 64 output bits";
  }
  EXPECT_NE(Philox::block({1, 2, 3, 4}, {5, 7}), base);
}

TEST(Rng, NameKeyIsFnv1a) {
  EXPECT_EQ(name_key(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(name_key("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(name_key("foobar"), 0x85944171f73967e8ull);
}

TEST(Rng, DeterministicAndSeedSensitive) {
  for (uint64_t i : {0ull, 1ull, 12345ull, (1ull << 32) + 7, ~0ull}) {
    EXPECT_EQ(normal_at(42, "w", i), normal_at(42, "w", i));
    EXPECT_EQ(uniform_at(42, "w", i), uniform_at(42, "w", i));
    EXPECT_EQ(bits_at(42, 9, i), bits_at(42, 9, i));
    EXPECT_NE(normal_at(42, "w", i), normal_at(43, "w", i));
    EXPECT_NE(bits_at(42, 9, i), bits_at(42, 10, i));
  }
  // The high half of the index matters.
  EXPECT_NE(normal_at(1, "w", 5), normal_at(1, "w", (1ull << 32) + 5));
  // normal_at is the float rounding of the double fill.
  double d[3];
  fill_normal(d, 3, 100, 7, "layers.0.mlp.w1", 1.0);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(normal_at(7, "layers.0.mlp.w1", 100 + i), static_cast<float>(d[i]));
}

TEST(Rng, SliceFillEqualsWholeFill) {
  const int64_t n = 1000;
  const double std = 0.02;
  std::vector<float> whole(n);
  fill_normal(whole.data(), n, 0, 1234, "model.embed_tokens.weight", std);
  std::vector<double> whole_d(n);
  fill_normal(whole_d.data(), n, 0, 1234, "model.embed_tokens.weight", std);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(whole[i], static_cast<float>(whole_d[i])) << i;
  // Any split into shards (uneven, empty ones included) reproduces the whole tensor.
  for (const std::vector<int64_t>& cuts :
       {std::vector<int64_t>{0, 500, 1000}, {0, 1, 333, 333, 999, 1000}, {0, 7, 64, 65, 1000}}) {
    std::vector<float> pieces(n, -100.0f);
    std::vector<float> pieces_t(n, -100.0f), whole_t(n);
    fill_trunc_normal(whole_t.data(), n, 0, 1234, "x", std);
    for (size_t s = 0; s + 1 < cuts.size(); ++s) {
      fill_normal(pieces.data() + cuts[s], cuts[s + 1] - cuts[s], cuts[s], 1234, "model.embed_tokens.weight", std);
      fill_trunc_normal(pieces_t.data() + cuts[s], cuts[s + 1] - cuts[s], cuts[s], 1234, "x", std);
    }
    EXPECT_EQ(pieces, whole);
    EXPECT_EQ(pieces_t, whole_t);
  }
  // A slice far into a large tensor (offset past 2^32) equals the per-element values.
  std::vector<float> far(16);
  const int64_t off = (int64_t{1} << 33) + 5;
  fill_normal(far.data(), 16, off, 1234, "big", 1.0);
  for (int64_t i = 0; i < 16; ++i) EXPECT_EQ(far[i], normal_at(1234, "big", uint64_t(off + i)));
}

struct Moments {
  double mean, var, min, max;
};
template <typename T>
Moments moments(const std::vector<T>& v) {
  double s = 0, s2 = 0;
  for (T x : v) s += x;
  const double mean = s / double(v.size());
  for (T x : v) s2 += (x - mean) * (x - mean);
  auto [mn, mx] = std::minmax_element(v.begin(), v.end());
  return {mean, s2 / double(v.size() - 1), double(*mn), double(*mx)};
}

TEST(Rng, NormalMoments) {
  const int64_t n = 100000;
  std::vector<double> v(n);
  fill_normal(v.data(), n, 0, 2024, "moments", 1.0);
  const Moments m = moments(v);
  // 5-sigma bounds: sd(mean) = 1/sqrt(n), sd(var) = sqrt(2/n).
  EXPECT_NEAR(m.mean, 0.0, 5.0 / std::sqrt(double(n)));
  EXPECT_NEAR(m.var, 1.0, 5.0 * std::sqrt(2.0 / n));
  EXPECT_LT(m.min, -3.5);  // P(no sample beyond 3.5 sigma in 1e5) ~ e^-23
  EXPECT_GT(m.max, 3.5);
  // Fraction within 1 sigma: 0.682689, sd sqrt(p(1-p)/n) ~ 0.00147.
  const double within = double(std::count_if(v.begin(), v.end(), [](double x) { return std::abs(x) < 1; })) / n;
  EXPECT_NEAR(within, 0.682689, 5 * 0.00147);
  // Scaling by std.
  std::vector<float> w(n);
  fill_normal(w.data(), n, 0, 2024, "moments", 0.02);
  EXPECT_NEAR(moments(w).var, 0.02 * 0.02, 0.02 * 0.02 * 5.0 * std::sqrt(2.0 / n));
  // Neighbouring elements are uncorrelated.
  double c = 0;
  for (int64_t i = 0; i + 1 < n; ++i) c += v[i] * v[i + 1];
  EXPECT_NEAR(c / double(n - 1), 0.0, 5.0 / std::sqrt(double(n)));
}

TEST(Rng, TruncatedNormalBoundAndMoments) {
  const int64_t n = 100000;
  const double std = 0.5;
  std::vector<double> v(n);
  fill_trunc_normal(v.data(), n, 0, 99, "trunc", std);
  std::vector<float> vf(n);
  fill_trunc_normal(vf.data(), n, 0, 99, "trunc", std);
  std::vector<double> plain(n);
  fill_normal(plain.data(), n, 0, 99, "trunc", std);
  int64_t resampled = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_LE(std::abs(v[i]), 3 * std) << i;
    ASSERT_LE(std::abs(vf[i]), float(3 * std)) << i;
    ASSERT_EQ(vf[i], static_cast<float>(v[i])) << i;
    if (std::abs(plain[i]) <= 3 * std)
      ASSERT_EQ(v[i], plain[i]) << i;  // inside the bound: the first attempt is kept
    else
      ++resampled;
  }
  // P(|z| > 3) = 0.0026998: about 270 of 1e5 (sd ~16).
  EXPECT_GT(resampled, 190);
  EXPECT_LT(resampled, 350);
  // Variance of N(0,1) truncated at +-3: 1 - 6 phi(3) / (2 Phi(3) - 1) = 0.973336.
  const Moments m = moments(v);
  EXPECT_NEAR(m.mean, 0.0, 5.0 * std / std::sqrt(double(n)));
  EXPECT_NEAR(m.var / (std * std), 0.973336, 5.0 * std::sqrt(2.0 / n));
  EXPECT_GT(m.max / std, 2.9);
  EXPECT_LT(m.min / std, -2.9);
}

TEST(Rng, UniformMomentsAndRange) {
  const int64_t n = 100000;
  std::vector<double> v(n);
  for (int64_t i = 0; i < n; ++i) {
    const float u = uniform_at(5, "uniform", uint64_t(i));
    ASSERT_GT(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    v[i] = u;
  }
  const Moments m = moments(v);
  // sd(mean) = sqrt(1/12/n); sd(var) = sqrt((1/80 - 1/144)/n).
  EXPECT_NEAR(m.mean, 0.5, 5.0 * std::sqrt(1.0 / 12 / n));
  EXPECT_NEAR(m.var, 1.0 / 12, 5.0 * std::sqrt((1.0 / 80 - 1.0 / 144) / n));
  EXPECT_LT(m.min, 1e-3);
  EXPECT_GT(m.max, 1 - 1e-3);
}

TEST(Rng, BitsAreBalanced) {
  const int64_t n = 100000;
  std::array<int64_t, 32> ones{};
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = bits_at(77, 3, uint64_t(i));
    for (int k = 0; k < 32; ++k) ones[k] += (b >> k) & 1u;
  }
  // Each bit is 1 with p = 1/2: sd of the count sqrt(n)/2 ~ 158; 5 sigma ~ 791.
  for (int k = 0; k < 32; ++k) EXPECT_NEAR(double(ones[k]), n / 2.0, 5 * std::sqrt(double(n)) / 2) << "bit " << k;
}

TEST(Rng, DifferentNamesGiveDifferentStreams) {
  const int64_t n = 4096;
  const char* names[] = {"layers.0.attn.wq", "layers.0.attn.wk", "layers.1.attn.wq", "a", "b", ""};
  std::vector<std::vector<float>> streams;
  for (const char* name : names) {
    std::vector<float> v(n);
    fill_normal(v.data(), n, 0, 1, name, 1.0);
    streams.push_back(v);
  }
  for (size_t a = 0; a < streams.size(); ++a)
    for (size_t b = a + 1; b < streams.size(); ++b) {
      int64_t equal = 0;
      double c = 0;
      for (int64_t i = 0; i < n; ++i) {
        equal += streams[a][i] == streams[b][i];
        c += double(streams[a][i]) * streams[b][i];
      }
      EXPECT_EQ(equal, 0) << names[a] << " vs " << names[b];
      EXPECT_NEAR(c / n, 0.0, 5.0 / std::sqrt(double(n))) << names[a] << " vs " << names[b];
    }
  // Different kinds (normal, uniform, bits) of the same name are separate streams too.
  const uint64_t stream = name_key("w");
  std::set<uint32_t> seen;
  for (uint64_t i = 0; i < 64; ++i) seen.insert(bits_at(3, stream, i));
  EXPECT_EQ(seen.size(), 64u);
  EXPECT_NE(bits_at(3, stream, 0), Philox::block({0, 0, 0, 0}, philox_key(3, stream))[0]);
  EXPECT_NE(bits_at(3, stream, 0), Philox::block({0, 0, 0, 1}, philox_key(3, stream))[0]);
  EXPECT_EQ(bits_at(3, stream, 0), Philox::block({0, 0, 0, 2}, philox_key(3, stream))[0]);
}

TEST(Rng, RejectsBadArguments) {
  float x[2];
  EXPECT_THROW(fill_normal(x, -1, 0, 1, "w", 1.0), Error);
  EXPECT_THROW(fill_normal(x, 2, -1, 1, "w", 1.0), Error);
  EXPECT_THROW(fill_trunc_normal(x, 2, 0, 1, "w", -0.1), Error);
  EXPECT_THROW(fill_normal(x, 2, 0, 1, "w", std::nan("")), Error);
  fill_normal(x, 2, 0, 1, "w", 0.0);
  EXPECT_EQ(x[0], 0.0f);
  EXPECT_EQ(x[1], 0.0f);
}

}  // namespace
}  // namespace moe
