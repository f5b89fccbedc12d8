// The CPU AdamW with optim.moment_dtype = "bf16" (the reference the GPU's BF16 moments are checked
// against bitwise, tests/gpu/optim_test.cpp): the moments it keeps are BF16 values, the update
// computes in FP32 (the first step from zero moments moves the parameters exactly as with FP32
// moments), and moments it is handed as FP32 values (a checkpoint of an FP32 run) are read as
// their BF16 rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/arena.h"
#include "core/config.h"
#include "core/dtype.h"
#include "core/error.h"
#include "optim/adamw.h"

namespace moe::testing {
namespace {

ParamLayout small_layout() {
  ParamLayout layout;
  layout.add("w", {300}, /*decay=*/true);
  layout.add("norm", {37}, /*decay=*/false);
  return layout;
}

OptimConfig config(const char* moment_dtype) {
  OptimConfig c;
  c.moment_dtype = moment_dtype;
  return c;
}

float bf16_value(float x) { return bf16_to_f32(f32_to_bf16(x)); }

bool bf16_representable(const std::vector<float>& x) {
  for (const float v : x) {
    const float r = bf16_value(v);
    if (std::memcmp(&v, &r, sizeof v) != 0) return false;
  }
  return true;
}

std::vector<float> draws(int64_t n, uint64_t seed, float scale) {
  std::vector<float> x(static_cast<size_t>(n));
  uint64_t s = seed;
  for (float& v : x) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    v = scale * (float(int64_t(s >> 40) - (int64_t{1} << 23)) / float(int64_t{1} << 23));
  }
  return x;
}

TEST(AdamWBf16Moments, KeepBf16ValuesAndComputeInFp32) {
  const ParamLayout layout = small_layout();
  const int64_t n = layout.total_numel();
  AdamW a(layout, config("fp32")), b(layout, config("bf16"));
  std::vector<float> pa = draws(n, 1, 1.0f), pb = pa;
  const std::vector<float> g1 = draws(n, 2, 0.1f), g2 = draws(n, 3, 0.1f);
  a.step(pa.data(), g1.data(), 1e-2);
  b.step(pb.data(), g1.data(), 1e-2);
  // Step 1 from zero moments: the same FP32 moments before rounding, so the same parameters.
  EXPECT_EQ(std::memcmp(pa.data(), pb.data(), size_t(n) * sizeof(float)), 0);
  ASSERT_TRUE(bf16_representable(b.exp_avg()));
  ASSERT_TRUE(bf16_representable(b.exp_avg_sq()));
  bool rounded = false;
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(b.exp_avg()[size_t(i)], bf16_value(a.exp_avg()[size_t(i)])) << i;
    EXPECT_EQ(b.exp_avg_sq()[size_t(i)], bf16_value(a.exp_avg_sq()[size_t(i)])) << i;
    rounded |= b.exp_avg()[size_t(i)] != a.exp_avg()[size_t(i)];
  }
  EXPECT_TRUE(rounded) << "no moment needed rounding: the test shows nothing";
  // Step 2 reads the rounded moments: the parameters part, by about the moments' rounding.
  a.step(pa.data(), g2.data(), 1e-2);
  b.step(pb.data(), g2.data(), 1e-2);
  EXPECT_NE(std::memcmp(pa.data(), pb.data(), size_t(n) * sizeof(float)), 0);
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(pb[size_t(i)], pa[size_t(i)], 1e-4) << i;
  EXPECT_TRUE(bf16_representable(b.exp_avg()));
  EXPECT_TRUE(bf16_representable(b.exp_avg_sq()));
}

// Moments handed over as FP32 values (an FP32 run's checkpoint resumed with BF16 moments) are read
// as their BF16 rounding: the same step as from the rounded moments, bit for bit.
TEST(AdamWBf16Moments, ReadMomentsAsTheirBf16Rounding) {
  const ParamLayout layout = small_layout();
  const int64_t n = layout.total_numel();
  const std::vector<float> p0 = draws(n, 4, 1.0f), g = draws(n, 5, 0.1f), m0 = draws(n, 6, 0.01f);
  std::vector<float> v0 = draws(n, 7, 1e-3f);
  for (float& x : v0) x = std::fabs(x);
  AdamW raw(layout, config("bf16")), rounded(layout, config("bf16"));
  raw.exp_avg() = m0;
  raw.exp_avg_sq() = v0;
  for (int64_t i = 0; i < n; ++i) {
    rounded.exp_avg()[size_t(i)] = bf16_value(m0[size_t(i)]);
    rounded.exp_avg_sq()[size_t(i)] = bf16_value(v0[size_t(i)]);
  }
  ASSERT_FALSE(bf16_representable(m0));
  raw.set_steps_taken(3);
  rounded.set_steps_taken(3);
  std::vector<float> pr = p0, pq = p0;
  raw.step(pr.data(), g.data(), 1e-2);
  rounded.step(pq.data(), g.data(), 1e-2);
  EXPECT_EQ(std::memcmp(pr.data(), pq.data(), size_t(n) * sizeof(float)), 0);
  for (const ParamEntry& e : layout.entries()) {  // the padding between entries is never read nor written
    for (int64_t i = e.offset; i < e.offset + e.numel; ++i) {
      EXPECT_EQ(raw.exp_avg()[size_t(i)], rounded.exp_avg()[size_t(i)]) << i;
      EXPECT_EQ(raw.exp_avg_sq()[size_t(i)], rounded.exp_avg_sq()[size_t(i)]) << i;
    }
  }
}

// Why beta2 is bounded with BF16 moments: at 0.999 a second moment under zero gradients would
// never decay (0.1% a step is below half its last place); at 0.95 it does, as in FP32.
TEST(AdamWBf16Moments, SecondMomentDecaysAtTheAcceptedBeta2) {
  ParamLayout layout;
  layout.add("w", {1}, /*decay=*/false);
  for (const double beta2 : {0.95, kMaxBeta2WithBf16Moments, 0.999}) {
    OptimConfig c = config("bf16");
    c.beta2 = beta2;
    AdamW opt(layout, c);
    opt.exp_avg_sq()[0] = 1.0f;
    std::vector<float> p(size_t(layout.total_numel()), 0.0f), g(p.size(), 0.0f);
    for (int step = 0; step < 10; ++step) opt.step(p.data(), g.data(), 1e-3);
    if (beta2 <= kMaxBeta2WithBf16Moments) {
      EXPECT_LT(opt.exp_avg_sq()[0], 0.97f) << "beta2 " << beta2;
    } else {
      EXPECT_EQ(opt.exp_avg_sq()[0], 1.0f) << "beta2 " << beta2 << ": the bound's reason no longer holds";
    }
  }
}

TEST(AdamWBf16Moments, UnknownDtypeIsRefused) {
  EXPECT_THROW(adamw_coefs(config("fp16"), 1, 1e-3), Error);
}

}  // namespace
}  // namespace moe::testing
