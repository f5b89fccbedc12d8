// Philox4x32-10 and the (seed, name, index) -> value maps documented in rng.h.
// A Philox round: (hi0, lo0) = c0 * M0, (hi1, lo1) = c2 * M1 (32x32 -> 64 bit products);
// c = {hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0}; the key gets the Weyl increments between rounds.
#include "core/rng.h"

#include <cmath>
#include <numbers>

#include "core/error.h"

namespace moe {

namespace {

constexpr uint32_t kKindNormal = 0, kKindUniform = 1, kKindBits = 2;
constexpr double kTruncBound = 3.0;

uint64_t seed_mix(uint64_t seed) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::array<uint32_t, 4> block_at(const std::array<uint32_t, 2>& key, uint64_t index, uint32_t attempt,
                                 uint32_t kind) {
  return Philox::block({static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32), attempt, kind}, key);
}

// (k + 0.5) * 2^-52 for the top 52 bits k of hi:lo: an exact double in (0, 1).
double open_unit(uint32_t hi, uint32_t lo) {
  const uint64_t k = ((static_cast<uint64_t>(hi) << 32) | lo) >> 12;
  return (static_cast<double>(k) + 0.5) * 0x1p-52;
}

double standard_normal(const std::array<uint32_t, 2>& key, uint64_t index, uint32_t attempt) {
  const auto w = block_at(key, index, attempt, kKindNormal);
  const double u1 = open_unit(w[0], w[1]);
  const double u2 = open_unit(w[2], w[3]);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

double trunc_standard_normal(const std::array<uint32_t, 2>& key, uint64_t index) {
  // Each attempt is accepted with probability 0.9973; the loop ends after a few attempts.
  for (uint32_t attempt = 0;; ++attempt) {
    const double z = standard_normal(key, index, attempt);
    if (std::abs(z) <= kTruncBound) return z;
  }
}

void check_fill_args(const char* what, int64_t n, int64_t global_offset, double std) {
  MOE_CHECK(n >= 0, what, ": element count must be >= 0, got ", n);
  MOE_CHECK(global_offset >= 0, what, ": global_offset must be >= 0, got ", global_offset);
  MOE_CHECK(std >= 0.0 && std::isfinite(std), what, ": std must be finite and >= 0, got ", std);
}

template <typename T>
void fill_normal_impl(T* out, int64_t n, int64_t global_offset, uint64_t seed, std::string_view name, double std,
                      bool truncated) {
  check_fill_args(truncated ? "fill_trunc_normal" : "fill_normal", n, global_offset, std);
  const auto key = philox_key(seed, name_key(name));
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t index = static_cast<uint64_t>(global_offset + i);
    const double z = truncated ? trunc_standard_normal(key, index) : standard_normal(key, index, 0);
    out[i] = static_cast<T>(z * std);
  }
}

}  // namespace

std::array<uint32_t, 4> Philox::block(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  for (int round = 0; round < kRounds; ++round) {
    if (round > 0) {
      k[0] += kWeyl0;
      k[1] += kWeyl1;
    }
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c[0];
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c = {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
  }
  return c;
}

uint64_t name_key(std::string_view name) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (const char ch : name) {
    h ^= static_cast<unsigned char>(ch);
    h *= 0x100000001B3ull;
  }
  return h;
}

std::array<uint32_t, 2> philox_key(uint64_t seed, uint64_t stream) {
  const uint64_t k = stream ^ seed_mix(seed);
  return {static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32)};
}

float normal_at(uint64_t seed, std::string_view name, uint64_t index) {
  return static_cast<float>(standard_normal(philox_key(seed, name_key(name)), index, 0));
}

float uniform_at(uint64_t seed, std::string_view name, uint64_t index) {
  const auto w = block_at(philox_key(seed, name_key(name)), index, 0, kKindUniform);
  return (static_cast<float>(w[0] >> 9) + 0.5f) * 0x1p-23f;  // exact: (2k + 1) * 2^-24
}

uint32_t bits_at(uint64_t seed, uint64_t stream, uint64_t index) {
  return block_at(philox_key(seed, stream), index, 0, kKindBits)[0];
}

void fill_normal(float* out, int64_t n, int64_t global_offset, uint64_t seed, std::string_view name, double std) {
  fill_normal_impl(out, n, global_offset, seed, name, std, false);
}
void fill_normal(double* out, int64_t n, int64_t global_offset, uint64_t seed, std::string_view name, double std) {
  fill_normal_impl(out, n, global_offset, seed, name, std, false);
}
void fill_trunc_normal(float* out, int64_t n, int64_t global_offset, uint64_t seed, std::string_view name,
                       double std) {
  fill_normal_impl(out, n, global_offset, seed, name, std, true);
}
void fill_trunc_normal(double* out, int64_t n, int64_t global_offset, uint64_t seed, std::string_view name,
                       double std) {
  fill_normal_impl(out, n, global_offset, seed, name, std, true);
}

}  // namespace moe
