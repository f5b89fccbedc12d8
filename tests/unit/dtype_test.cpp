// Scalar dtype conversions: exact values, ties to even, subnormal boundaries, overflow, NaN/inf,
// round trips of every bf16 / fp8 code, and fp8 / bf16 rounding against a brute-force nearest-
// value search over all decoded codes (ties to the even code).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace moe {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

uint32_t bits_of(float x) { return std::bit_cast<uint32_t>(x); }
float from_bits(uint32_t b) { return std::bit_cast<float>(b); }

// ---------------------------------------------------------------------------------------------
// bf16

TEST(DTypeBF16, ExactValues) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(f32_to_bf16(-2.0f), 0xC000);
  EXPECT_EQ(f32_to_bf16(0.15625f), 0x3E20);
  EXPECT_EQ(f32_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_bf16(kInf), 0x7F80);
  EXPECT_EQ(f32_to_bf16(-kInf), 0xFF80);
  EXPECT_EQ(bf16_to_f32(0x3F80), 1.0f);
  EXPECT_EQ(bf16_to_f32(0x7F7F), from_bits(0x7F7F0000));  // largest finite bf16
  EXPECT_EQ(bits_of(bf16_to_f32(0x8000)), 0x80000000u);
  EXPECT_EQ(bf16_to_f32(0xFF80), -kInf);
}

TEST(DTypeBF16, TiesToEven) {
  // Spacing at 1 is 2^-7: 1 + 2^-8 is halfway between 1 (even) and 1 + 2^-7 (odd).
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f), 0x3F80);
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3F82);  // between 0x3F81 (odd) and 0x3F82 (even)
  EXPECT_EQ(f32_to_bf16(-(1.0f + 3 * 0x1p-8f)), 0xBF82);
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f + 0x1p-23f), 0x3F81);  // just above halfway: up
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f - 0x1p-23f), 0x3F80);  // just below: down
  EXPECT_EQ(f32_to_bf16(from_bits(0x3F818000)), 0x3F82);       // 0x3F81 odd + half -> up
}

TEST(DTypeBF16, SubnormalsAndOverflow) {
  EXPECT_EQ(f32_to_bf16(from_bits(0x00010000)), 0x0001);  // smallest bf16 subnormal, 2^-133
  EXPECT_EQ(f32_to_bf16(from_bits(0x00008000)), 0x0000);  // half of it: tie to even (0)
  EXPECT_EQ(f32_to_bf16(from_bits(0x00008001)), 0x0001);  // just above half: up
  EXPECT_EQ(f32_to_bf16(from_bits(0x00018000)), 0x0002);  // 1.5 quanta: tie to even (2)
  EXPECT_EQ(f32_to_bf16(from_bits(0x007FFFFF)), 0x0080);  // largest f32 subnormal -> min normal
  EXPECT_EQ(f32_to_bf16(from_bits(0x80000001)), 0x8000);  // tiny negative -> -0
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds past 0x7F7F
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::max()), 0xFF80);
  EXPECT_EQ(f32_to_bf16(from_bits(0x7F7F7FFF)), 0x7F7F);  // below the midpoint: stays finite
  EXPECT_EQ(f32_to_bf16(from_bits(0x7F7F8000)), 0x7F80);  // midpoint, 0x7F7F odd -> inf
}

TEST(DTypeBF16, NaNStaysNaN) {
  for (uint32_t b : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0x7F800100u, 0xFFFFFFFFu, 0x7FFFFFFFu}) {
    const uint16_t h = f32_to_bf16(from_bits(b));
    EXPECT_TRUE(std::isnan(bf16_to_f32(h))) << std::hex << b;
    EXPECT_EQ(h >> 15, b >> 31) << "sign kept for " << std::hex << b;
  }
}

TEST(DTypeBF16, AllPatternsRoundTrip) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float x = bf16_to_f32(static_cast<uint16_t>(b));
    EXPECT_EQ(bits_of(x), b << 16);
    if (std::isnan(x))
      EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(x)))) << std::hex << b;
    else
      EXPECT_EQ(f32_to_bf16(x), b) << std::hex << b;
  }
}

TEST(DTypeBF16, MatchesNearestNeighbour) {
  // The two bf16 neighbours of x are its truncation t and t + 1 (same sign); pick the nearer,
  // ties to the even pattern. Differences are exact in double. Every 4th input is an exact tie
  // and every 64th lies above the largest finite bf16, where rounding up gives inf.
  std::mt19937 gen(11);
  for (int i = 0; i < 200000; ++i) {
    uint32_t b = gen();
    if ((b & 0x7F800000u) == 0x7F800000u) continue;  // inf / NaN: covered above
    if (i % 4 == 0) b = (b & 0xFFFF0000u) | 0x8000u;  // exact ties
    if (i % 64 == 0) b = (b & 0x8000FFFFu) | 0x7F7F0000u;  // above the largest finite bf16
    const float x = from_bits(b);
    const uint32_t lo = b >> 16, hi = lo + 1;
    const double dlo = std::abs(double(x) - double(bf16_to_f32(uint16_t(lo))));
    // Past the largest finite value the next step up is 2^128 (the inf pattern): overflow.
    const double vhi = (hi & 0x7FFFu) == 0x7F80u ? std::copysign(0x1p128, x) : double(bf16_to_f32(uint16_t(hi)));
    const double dhi = std::abs(double(x) - vhi);
    const uint32_t want = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) ? hi : lo);
    ASSERT_EQ(f32_to_bf16(x), want) << std::hex << b;
  }
}

// ---------------------------------------------------------------------------------------------
// fp8

struct Fp8Case {
  const char* name;
  uint8_t (*encode)(float, bool);
  float (*decode)(uint8_t);
  float max_finite;
  float min_subnormal;
  float overflow_threshold;  // |x| at or above which (e5m2) / above which (e4m3) rounding overflows
  bool has_inf;
};

void PrintTo(const Fp8Case* f, std::ostream* os) { *os << f->name; }

const Fp8Case kE4M3 = {"e4m3", f32_to_fp8_e4m3, fp8_e4m3_to_f32, 448.0f, 0x1p-9f, 464.0f, false};
const Fp8Case kE5M2 = {"e5m2", f32_to_fp8_e5m2, fp8_e5m2_to_f32, 57344.0f, 0x1p-16f, 61440.0f, true};

// Brute-force reference: the nearest finite code of the same sign, ties to the even code.
// This is exactly the saturating conversion; the non-saturating one differs only past the
// overflow threshold.
uint8_t nearest_code(const Fp8Case& f, float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  int best = -1;
  double best_d = 0;
  for (int mag = 0; mag < 128; ++mag) {
    const float v = f.decode(static_cast<uint8_t>(sign | mag));
    if (!std::isfinite(v)) continue;
    const double d = std::abs(double(x) - double(v));
    if (best < 0 || d < best_d || (d == best_d && (mag & 1) == 0)) {
      best = mag;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(sign | best);
}

class Fp8Test : public ::testing::TestWithParam<const Fp8Case*> {};

TEST_P(Fp8Test, EveryCodeRoundTrips) {
  const Fp8Case& f = *GetParam();
  int num_nan = 0, num_inf = 0;
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const float x = f.decode(code);
    if (std::isnan(x)) {
      ++num_nan;
      EXPECT_TRUE(std::isnan(f.decode(f.encode(x, true)))) << f.name << " code " << c;
      EXPECT_TRUE(std::isnan(f.decode(f.encode(x, false)))) << f.name << " code " << c;
    } else if (std::isinf(x)) {
      ++num_inf;
      EXPECT_EQ(f.encode(x, false), code) << f.name << " code " << c;
      EXPECT_EQ(f.decode(f.encode(x, true)), std::copysign(f.max_finite, x)) << f.name;
    } else {
      EXPECT_EQ(f.encode(x, true), code) << f.name << " code " << c << " value " << x;
      EXPECT_EQ(f.encode(x, false), code) << f.name << " code " << c << " value " << x;
    }
  }
  EXPECT_EQ(num_nan, f.has_inf ? 6 : 2) << f.name;
  EXPECT_EQ(num_inf, f.has_inf ? 2 : 0) << f.name;
}

TEST_P(Fp8Test, SubnormalBoundaries) {
  const Fp8Case& f = *GetParam();
  const float s = f.min_subnormal;
  EXPECT_EQ(f.decode(0x01), s) << f.name;
  EXPECT_EQ(f.encode(s, true), 0x01) << f.name;
  EXPECT_EQ(f.encode(0.5f * s, true), 0x00) << f.name;                    // tie: to 0 (even)
  EXPECT_EQ(f.encode(-0.5f * s, true), 0x80) << f.name;                   // -0
  EXPECT_EQ(f.encode(std::nextafter(0.5f * s, 1.0f), true), 0x01) << f.name;  // just above half
  EXPECT_EQ(f.encode(std::nextafter(0.5f * s, 0.0f), true), 0x00) << f.name;
  EXPECT_EQ(f.encode(1.5f * s, true), 0x02) << f.name;                    // tie: to 2 (even)
  EXPECT_EQ(f.encode(2.5f * s, true), 0x02) << f.name;                    // tie: to 2 (even)
  EXPECT_EQ(f.encode(from_bits(1), true), 0x00) << f.name;                // f32 subnormal -> 0
  EXPECT_EQ(f.encode(0.0f, true), 0x00) << f.name;
  EXPECT_EQ(f.encode(-0.0f, true), 0x80) << f.name;
}

TEST_P(Fp8Test, SaturationAndOverflow) {
  const Fp8Case& f = *GetParam();
  const uint8_t max_code = f.encode(f.max_finite, false);
  EXPECT_EQ(f.decode(max_code), f.max_finite);
  const uint8_t overflow = f.has_inf ? 0x7C : 0x7F;  // inf (e5m2) or NaN (e4m3)
  // Just below the threshold rounds to max; at/after it overflows (e4m3's 464 is a tie that
  // goes to the even max code 0x7E; e5m2's 61440 is a tie that goes to the even 2^16 = inf).
  EXPECT_EQ(f.encode(std::nextafter(f.overflow_threshold, 0.0f), false), max_code) << f.name;
  EXPECT_EQ(f.encode(f.overflow_threshold, false), f.has_inf ? overflow : max_code) << f.name;
  EXPECT_EQ(f.encode(std::nextafter(f.overflow_threshold, kInf), false), overflow) << f.name;
  EXPECT_EQ(f.encode(-std::nextafter(f.overflow_threshold, kInf), false), 0x80 | overflow) << f.name;
  EXPECT_EQ(f.encode(1e30f, false), overflow) << f.name;
  EXPECT_EQ(f.encode(std::nextafter(f.overflow_threshold, kInf), true), max_code) << f.name;
  EXPECT_EQ(f.encode(-1e30f, true), 0x80 | max_code) << f.name;
  EXPECT_EQ(f.encode(std::numeric_limits<float>::max(), true), max_code) << f.name;
  // inf input: saturating clamps to max finite; non-saturating gives NaN (e4m3) / inf (e5m2).
  EXPECT_EQ(f.encode(kInf, true), max_code) << f.name;
  EXPECT_EQ(f.encode(-kInf, true), 0x80 | max_code) << f.name;
  EXPECT_EQ(f.encode(kInf, false), overflow) << f.name;
  EXPECT_EQ(f.encode(-kInf, false), 0x80 | overflow) << f.name;
  if (f.has_inf)
    EXPECT_EQ(f.decode(f.encode(-kInf, false)), -kInf);
  else
    EXPECT_TRUE(std::isnan(f.decode(f.encode(kInf, false))));
}

TEST_P(Fp8Test, NaNStaysNaN) {
  const Fp8Case& f = *GetParam();
  for (float x : {kNaN, -kNaN, from_bits(0x7F800001u), from_bits(0xFFC00001u)})
    for (bool sat : {true, false}) EXPECT_TRUE(std::isnan(f.decode(f.encode(x, sat)))) << f.name;
}

TEST_P(Fp8Test, MatchesBruteForceNearest) {
  const Fp8Case& f = *GetParam();
  std::vector<float> inputs;
  // Every midpoint between adjacent finite codes (exact ties), and its two float neighbours.
  for (int mag = 0; mag + 1 < 128; ++mag) {
    const float a = f.decode(uint8_t(mag)), b = f.decode(uint8_t(mag + 1));
    if (!std::isfinite(b)) break;
    const float mid = 0.5f * (a + b);  // exact: a and b are short fp8 values
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, kInf)}) {
      inputs.push_back(x);
      inputs.push_back(-x);
    }
  }
  // Log-uniform magnitudes from well below the smallest subnormal to past the largest value.
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> expo(std::log2(f.min_subnormal) - 4, std::log2(f.max_finite) + 1);
  std::uniform_int_distribution<int> coin(0, 1);
  for (int i = 0; i < 100000; ++i) {
    const float x = std::exp2(expo(gen));
    inputs.push_back(coin(gen) ? -x : x);
  }
  for (float x : inputs) {
    const uint8_t want = nearest_code(f, x);
    ASSERT_EQ(f.encode(x, true), want) << f.name << " x=" << x << " (bits " << std::hex << bits_of(x) << ")";
    const bool overflows = f.has_inf ? std::abs(x) >= f.overflow_threshold : std::abs(x) > f.overflow_threshold;
    const uint8_t want_nonsat =
        overflows ? uint8_t((std::signbit(x) ? 0x80 : 0x00) | (f.has_inf ? 0x7C : 0x7F)) : want;
    ASSERT_EQ(f.encode(x, false), want_nonsat) << f.name << " x=" << x;
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8Test, ::testing::Values(&kE4M3, &kE5M2),
                         [](const auto& info) { return std::string(info.param->name); });

TEST(DTypeFp8, KnownValues) {
  EXPECT_EQ(fp8_e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x08), 0x1p-6f);   // smallest normal
  EXPECT_EQ(fp8_e4m3_to_f32(0x07), 7 * 0x1p-9f);  // largest subnormal
  EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0xC4), -3.0f);  // 1 1000 100 = -1.5 * 2
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0x7F)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0xFF)));
  EXPECT_EQ(fp8_e4m3_to_f32(0x78), 256.0f);  // exponent 15 is a normal exponent in e4m3fn
  EXPECT_EQ(fp8_e5m2_to_f32(0x7B), 57344.0f);
  EXPECT_EQ(fp8_e5m2_to_f32(0x3C), 1.0f);
  EXPECT_EQ(fp8_e5m2_to_f32(0x04), 0x1p-14f);  // smallest normal
  EXPECT_EQ(fp8_e5m2_to_f32(0x7C), kInf);
  EXPECT_EQ(fp8_e5m2_to_f32(0xFC), -kInf);
  EXPECT_TRUE(std::isnan(fp8_e5m2_to_f32(0x7D)));
  // Ties to even in the normal range: 1 + 2^-4 between 0x38 (even) and 0x39 for e4m3;
  // 1 + 3 * 2^-4 between 0x39 (odd) and 0x3A (even).
  EXPECT_EQ(f32_to_fp8_e4m3(1.0f + 0x1p-4f), 0x38);
  EXPECT_EQ(f32_to_fp8_e4m3(1.0f + 3 * 0x1p-4f), 0x3A);
  EXPECT_EQ(f32_to_fp8_e5m2(1.0f + 0x1p-3f), 0x3C);
  EXPECT_EQ(f32_to_fp8_e5m2(1.0f + 3 * 0x1p-3f), 0x3E);
  EXPECT_EQ(f32_to_fp8_e5m2(-(1.0f + 3 * 0x1p-3f)), 0xBE);
  // Rounding up from the largest subnormal into the smallest normal.
  EXPECT_EQ(f32_to_fp8_e4m3(7.5f * 0x1p-9f), 0x08);
  EXPECT_EQ(f32_to_fp8_e5m2(3.5f * 0x1p-16f), 0x04);
}

// ---------------------------------------------------------------------------------------------
// e8m0

TEST(DTypeE8M0, PowersOfTwoAreExact) {
  for (int e = -127; e <= 127; ++e) {
    const float x = std::ldexp(1.0f, e);
    const uint8_t code = f32_to_e8m0(x);
    EXPECT_EQ(code, e + 127) << "2^" << e;
    EXPECT_EQ(e8m0_to_f32(code), x) << "2^" << e;
    EXPECT_EQ(f32_to_e8m0(-x), code) << "sign ignored, 2^" << e;
  }
}

TEST(DTypeE8M0, RoundsUp) {
  EXPECT_EQ(f32_to_e8m0(1.5f), 128);  // -> 2
  EXPECT_EQ(f32_to_e8m0(std::nextafter(1.0f, 2.0f)), 128);
  EXPECT_EQ(f32_to_e8m0(std::nextafter(1.0f, 0.0f)), 127);  // just below 1 -> 1
  EXPECT_EQ(f32_to_e8m0(448.0f), 127 + 9);                   // -> 512
  EXPECT_EQ(f32_to_e8m0(-3.0f), 129);                        // |x| -> 4
  EXPECT_EQ(f32_to_e8m0(0.0f), 0);                           // smallest code, 2^-127
  EXPECT_EQ(f32_to_e8m0(from_bits(1)), 0);                   // tiny subnormal -> 2^-127
  EXPECT_EQ(f32_to_e8m0(from_bits(0x00400001)), 1);          // just above 2^-127 -> 2^-126
  EXPECT_EQ(f32_to_e8m0(from_bits(0x007FFFFF)), 1);
  EXPECT_EQ(f32_to_e8m0(std::nextafter(0x1p127f, kInf)), 0xFF);  // needs 2^128: not representable
  EXPECT_EQ(f32_to_e8m0(std::numeric_limits<float>::max()), 0xFF);
  // Property: the result is the smallest power of two >= |x|.
  std::mt19937 gen(3);
  for (int i = 0; i < 10000; ++i) {
    const float x = from_bits(gen() & 0x7EFFFFFFu);  // finite, below 2^127
    const uint8_t c = f32_to_e8m0(x);
    ASSERT_LT(c, 0xFF);
    ASSERT_GE(e8m0_to_f32(c), x);
    if (c > 0) {
      ASSERT_LT(e8m0_to_f32(uint8_t(c - 1)), x);
    }
  }
}

TEST(DTypeE8M0, NaN) {
  EXPECT_TRUE(std::isnan(e8m0_to_f32(0xFF)));
  EXPECT_EQ(f32_to_e8m0(kNaN), 0xFF);
  EXPECT_EQ(f32_to_e8m0(kInf), 0xFF);
  EXPECT_EQ(f32_to_e8m0(-kInf), 0xFF);
  EXPECT_EQ(e8m0_to_f32(0x00), 0x1p-127f);
  EXPECT_EQ(e8m0_to_f32(0xFE), 0x1p127f);
}

// ---------------------------------------------------------------------------------------------
// bulk

TEST(DTypeBulk, MatchesScalarConversions) {
  std::vector<float> src = {0.0f, -0.0f, 1.0f, -1.5f, 3.14159f, 1e-6f, 1e5f, -1e30f, kInf, 448.0f, 1e-40f};
  {
    std::vector<unsigned char> raw(src.size() * 2 + 1);
    convert_from_f32(src.data(), raw.data() + 1, DType::kBF16, int64_t(src.size()));  // unaligned
    std::vector<float> back(src.size());
    convert_to_f32(raw.data() + 1, DType::kBF16, back.data(), int64_t(src.size()));
    for (size_t i = 0; i < src.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, raw.data() + 1 + 2 * i, 2);
      EXPECT_EQ(h, f32_to_bf16(src[i])) << i;
      EXPECT_EQ(bits_of(back[i]), bits_of(bf16_to_f32(h))) << i;
    }
  }
  for (DType t : {DType::kF8E4M3, DType::kF8E5M2}) {
    auto enc = t == DType::kF8E4M3 ? f32_to_fp8_e4m3 : f32_to_fp8_e5m2;
    auto dec = t == DType::kF8E4M3 ? fp8_e4m3_to_f32 : fp8_e5m2_to_f32;
    std::vector<uint8_t> raw(src.size());
    convert_from_f32(src.data(), raw.data(), t, int64_t(src.size()));
    std::vector<float> back(src.size());
    convert_to_f32(raw.data(), t, back.data(), int64_t(src.size()));
    for (size_t i = 0; i < src.size(); ++i) {
      EXPECT_EQ(raw[i], enc(src[i], true)) << dtype_name(t) << " " << i;  // bulk saturates
      EXPECT_EQ(bits_of(back[i]), bits_of(dec(raw[i]))) << dtype_name(t) << " " << i;
    }
  }
  std::vector<float> copy(src.size());
  convert_from_f32(src.data(), copy.data(), DType::kF32, int64_t(src.size()));
  std::vector<float> copy2(src.size());
  convert_to_f32(copy.data(), DType::kF32, copy2.data(), int64_t(src.size()));
  for (size_t i = 0; i < src.size(); ++i) EXPECT_EQ(bits_of(copy2[i]), bits_of(src[i]));
  convert_from_f32(nullptr, nullptr, DType::kBF16, 0);  // empty: no access
}

TEST(DTypeBulk, UnsupportedDTypesFailNamingTheType) {
  float x = 1.0f;
  int64_t out = 0;
  for (DType t : {DType::kF64, DType::kE8M0, DType::kI32, DType::kI64, DType::kU16, DType::kU32}) {
    try {
      convert_from_f32(&x, &out, t, 1);
      ADD_FAILURE() << "no error for " << dtype_name(t);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(dtype_name(t)), std::string::npos) << e.what();
    }
    try {
      convert_to_f32(&out, t, &x, 1);
      ADD_FAILURE() << "no error for " << dtype_name(t);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(dtype_name(t)), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(convert_to_f32(&out, DType::kBF16, &x, -1), Error);
}

}  // namespace
}  // namespace moe
