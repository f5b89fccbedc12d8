// Counter-based random numbers: Philox4x32-10 (Salmon et al., SC'11, "Parallel random numbers:
// as easy as 1, 2, 3"). Every value is a pure function of (seed, tensor name or stream, element
// index), so a tensor gets the same values whichever slice a rank fills, in any layout.
// Normals: Box-Muller in double on the 4 words of one block; truncation by resampling.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace moe {

// Exact mapping (a GPU or other port must reproduce it bit for bit up to libm's log/cos):
//   name_key(name)  = FNV-1a 64 over the bytes of name (offset 0xCBF29CE484222325,
//                     prime 0x100000001B3); for bits_at the caller's `stream` takes its place.
//   seed_mix(seed)  = splitmix64 finaliser: z = seed + 0x9E3779B97F4A7C15;
//                     z = (z ^ z>>30) * 0xBF58476D1CE4E5B9; z = (z ^ z>>27) * 0x94D049BB133111EB;
//                     z ^ z>>31   (a bijection, so distinct seeds give distinct keys per name).
//   key64 = name_key ^ seed_mix(seed);   key     = {lo32(key64), hi32(key64)}
//   counter = {lo32(index), hi32(index), attempt, kind},
//             kind 0 = normal (fill_normal, fill_trunc_normal, normal_at), 1 = uniform_at,
//             2 = bits_at; attempt is 0 except for truncated-normal resamples.
//   From block words w0..w3:
//     normal : u1 = ((w0:w1 >> 12) + 0.5) * 2^-52, u2 = ((w2:w3 >> 12) + 0.5) * 2^-52 (w0, w2
//              the high halves; both in (0,1), exact doubles), z = sqrt(-2 ln u1) * cos(2 pi u2)
//              in double; |z| <= 8.6. The float fill is (float)(z * std), the double fill z * std.
//     uniform: ((w0 >> 9) + 0.5) * 2^-23, an exact float in [2^-24, 1 - 2^-24].
//     bits   : w0.
//   Truncated normal (at +-3 std): attempts 0, 1, 2, ... until |z| <= 3; attempt 0 is the
//   plain normal, so elements inside the bound equal fill_normal's values.
struct Philox {
  static constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  static constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  static constexpr int kRounds = 10;
  // Philox4x32-10 of one 128-bit counter under a 64-bit key.
  static std::array<uint32_t, 4> block(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);
};

// FNV-1a 64 of the name.
uint64_t name_key(std::string_view name);
// The Philox key for (seed, stream), stream = name_key(name) for named tensors.
std::array<uint32_t, 2> philox_key(uint64_t seed, uint64_t stream);

// Element `index` of tensor `name`: N(0,1) rounded to float.
float normal_at(uint64_t seed, std::string_view name, uint64_t index);
// Element `index` of tensor `name`: uniform in (0,1), strictly.
float uniform_at(uint64_t seed, std::string_view name, uint64_t index);
// Raw 32 bits for routing and shuffles.
uint32_t bits_at(uint64_t seed, uint64_t stream, uint64_t index);

// out[i] = std * z(global_offset + i) for i in [0, n): the slice [global_offset,
// global_offset + n) of the named tensor's N(0, std^2) values. std >= 0.
void fill_normal(float* out, int64_t n, int64_t global_offset, uint64_t seed, std::string_view name, double std);
void fill_normal(double* out, int64_t n, int64_t global_offset, uint64_t seed, std::string_view name, double std);
// The same, truncated to [-3 std, 3 std] by resampling out-of-range elements.
void fill_trunc_normal(float* out, int64_t n, int64_t global_offset, uint64_t seed, std::string_view name,
                       double std);
void fill_trunc_normal(double* out, int64_t n, int64_t global_offset, uint64_t seed, std::string_view name,
                       double std);

}  // namespace moe
