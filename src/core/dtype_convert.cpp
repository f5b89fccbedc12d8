// Scalar and bulk conversions between f32 and bf16 / fp8 (e4m3, e5m2) / e8m0, on bit patterns.
// Narrowing rounds to nearest, ties to even, by an integer shift of the f32 bits (normal range)
// or of the f32 significand onto the target's subnormal quantum 2^(emin - mantissa_bits).
// A rounded result above the largest finite code, or an inf input, is an overflow: saturate ->
// +-max finite, else NaN (e4m3) / inf (e5m2). NaN keeps its sign, becomes the canonical quiet NaN.
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/dtype.h"
#include "core/error.h"

namespace moe {

namespace {

// v / 2^s rounded to nearest, ties to even; 1 <= s <= 31.
uint32_t rne_shift_right(uint32_t v, int s) {
  const uint32_t q = v >> s;
  const uint32_t rem = v & ((1u << s) - 1u);
  const uint32_t half = 1u << (s - 1);
  return (rem > half || (rem == half && (q & 1u))) ? q + 1u : q;
}

float quiet_nan(bool negative) { return std::bit_cast<float>(negative ? 0xFFC00000u : 0x7FC00000u); }

// An 8-bit float: 1 sign bit, exponent bits, `mant_bits` mantissa bits, exponent bias `bias`.
// Magnitude codes above `max_code` are special: `overflow_code` is inf when `has_inf`, else NaN.
struct Fp8Format {
  int mant_bits;
  int bias;
  uint32_t max_code;       // largest finite magnitude code
  uint32_t overflow_code;  // what a non-saturating overflow becomes (inf or NaN)
  uint32_t nan_code;       // canonical NaN magnitude code
  bool has_inf;
};
constexpr Fp8Format kE4M3{3, 7, 0x7E, 0x7F, 0x7F, false};  // max 1.75 * 2^8 = 448
constexpr Fp8Format kE5M2{2, 15, 0x7B, 0x7C, 0x7E, true};  // max 1.75 * 2^15 = 57344

uint8_t encode_fp8(float x, const Fp8Format& f, bool saturate) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t a = bits & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint8_t>(sign | f.nan_code);
  if (a == 0x7F800000u) return static_cast<uint8_t>(sign | (saturate ? f.max_code : f.overflow_code));
  const int min_exp = 1 - f.bias;               // exponent of the smallest normal
  const int exp = static_cast<int>(a >> 23) - 127;  // -127 for f32 zero / subnormal
  uint32_t code;
  if (exp >= min_exp) {
    // Normal in the target: drop mantissa bits (a carry moves into the exponent), then rebias.
    code = rne_shift_right(a, 23 - f.mant_bits) - (static_cast<uint32_t>(127 - f.bias) << f.mant_bits);
  } else {
    // Subnormal (or zero) in the target: count quanta of 2^(min_exp - mant_bits). A result of
    // 2^mant_bits is the smallest normal's code, so rounding up across the boundary is exact.
    const bool f32_normal = exp != -127;
    const uint32_t significand = (a & 0x7FFFFFu) | (f32_normal ? 0x800000u : 0u);
    const int eff_exp = f32_normal ? exp : -126;  // significand * 2^(eff_exp - 23) == |x|
    const int shift = 23 + min_exp - f.mant_bits - eff_exp;  // > 23 - mant_bits >= 20
    code = shift >= 32 ? 0u : rne_shift_right(significand, shift);
  }
  if (code > f.max_code) return static_cast<uint8_t>(sign | (saturate ? f.max_code : f.overflow_code));
  return static_cast<uint8_t>(sign | code);
}

float decode_fp8(uint8_t b, const Fp8Format& f) {
  const bool negative = (b & 0x80u) != 0;
  const uint32_t mag = b & 0x7Fu;
  if (mag > f.max_code) {
    if (f.has_inf && mag == f.overflow_code)
      return negative ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity();
    return quiet_nan(negative);
  }
  const uint32_t exp_field = mag >> f.mant_bits;
  const uint32_t mant = mag & ((1u << f.mant_bits) - 1u);
  float v;
  if (exp_field == 0) {
    v = std::ldexp(static_cast<float>(mant), 1 - f.bias - f.mant_bits);  // exact
  } else {
    const uint32_t f32_exp = exp_field - static_cast<uint32_t>(f.bias) + 127u;
    v = std::bit_cast<float>((f32_exp << 23) | (mant << (23 - f.mant_bits)));
  }
  return negative ? -v : v;
}

[[noreturn]] void unsupported(const char* what, DType t) {
  MOE_FAIL(what, ": unsupported dtype ", dtype_name(t), "; expected one of f32, bf16, fp8_e4m3, fp8_e5m2");
}

}  // namespace

uint16_t f32_to_bf16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN
  // bf16 shares f32's exponent range, so one shift rounds normals, subnormals and overflow
  // (a carry out of the largest finite value lands on the inf pattern). The sign bit is
  // untouched: rounding acts on the magnitude bits below it.
  return static_cast<uint16_t>(rne_shift_right(bits, 16));
}

float bf16_to_f32(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

uint8_t f32_to_fp8_e4m3(float x, bool saturate) { return encode_fp8(x, kE4M3, saturate); }
float fp8_e4m3_to_f32(uint8_t b) { return decode_fp8(b, kE4M3); }
uint8_t f32_to_fp8_e5m2(float x, bool saturate) { return encode_fp8(x, kE5M2, saturate); }
float fp8_e5m2_to_f32(uint8_t b) { return decode_fp8(b, kE5M2); }

uint8_t f32_to_e8m0(float x) {
  // Code c stands for 2^(c - 127), c in [0, 254]. Result: the smallest code with 2^(c-127) >= |x|
  // (0 for |x| <= 2^-127, zero included). NaN, inf and |x| > 2^127 have no such code: 0xFF (NaN).
  const uint32_t a = std::bit_cast<uint32_t>(x) & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return 0xFF;
  const uint32_t exp_field = a >> 23;
  const uint32_t mant = a & 0x7FFFFFu;
  if (exp_field == 0) return a <= 0x00400000u ? 0x00 : 0x01;  // f32 subnormal: <= 2^-127 or < 2^-126
  const uint32_t code = exp_field + (mant != 0 ? 1u : 0u);
  return code > 254u ? 0xFF : static_cast<uint8_t>(code);
}

float e8m0_to_f32(uint8_t b) {
  if (b == 0xFF) return quiet_nan(false);
  if (b == 0) return std::bit_cast<float>(0x00400000u);  // 2^-127, an f32 subnormal
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 23);
}

void convert_from_f32(const float* src, void* dst, DType dst_type, int64_t n) {
  MOE_CHECK(n >= 0, "convert_from_f32: element count must be >= 0, got ", n);
  auto* out = static_cast<unsigned char*>(dst);
  switch (dst_type) {
    case DType::kF32:
      if (n > 0) std::memmove(out, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t v = f32_to_bf16(src[i]);
        std::memcpy(out + 2 * i, &v, 2);  // raw bytes: no alignment assumed
      }
      return;
    case DType::kF8E4M3:
      for (int64_t i = 0; i < n; ++i) out[i] = f32_to_fp8_e4m3(src[i], /*saturate=*/true);
      return;
    case DType::kF8E5M2:
      for (int64_t i = 0; i < n; ++i) out[i] = f32_to_fp8_e5m2(src[i], /*saturate=*/true);
      return;
    default:
      unsupported("convert_from_f32", dst_type);
  }
}

void convert_to_f32(const void* src, DType src_type, float* dst, int64_t n) {
  MOE_CHECK(n >= 0, "convert_to_f32: element count must be >= 0, got ", n);
  const auto* in = static_cast<const unsigned char*>(src);
  switch (src_type) {
    case DType::kF32:
      if (n > 0) std::memmove(dst, in, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, in + 2 * i, 2);
        dst[i] = bf16_to_f32(v);
      }
      return;
    case DType::kF8E4M3:
      for (int64_t i = 0; i < n; ++i) dst[i] = fp8_e4m3_to_f32(in[i]);
      return;
    case DType::kF8E5M2:
      for (int64_t i = 0; i < n; ++i) dst[i] = fp8_e5m2_to_f32(in[i]);
      return;
    default:
      unsupported("convert_to_f32", src_type);
  }
}

}  // namespace moe
