// SHA-256 after FIPS 180-4 section 6.2: eight 32-bit working variables, 64 rounds per
// 512-bit block with the constants K (cube roots of the first 64 primes) and the message
// schedule W[t] = s1(W[t-2]) + W[t-7] + s0(W[t-15]) + W[t-16]. The x86 SHA-extension path
// runs the same rounds two at a time on the state split as (A,B,E,F) and (C,D,G,H).
#include "checkpoint/sha256.h"

#include <fcntl.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace moe {

namespace {

constexpr uint32_t kRoundConstants[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

// Initial hash value H(0): fractional parts of the square roots of the first 8 primes.
constexpr uint32_t kInitialState[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                       0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }
inline uint32_t ch(uint32_t x, uint32_t y, uint32_t z) { return (x & y) ^ (~x & z); }
inline uint32_t maj(uint32_t x, uint32_t y, uint32_t z) { return (x & y) ^ (x & z) ^ (y & z); }
inline uint32_t big_sigma0(uint32_t x) { return rotr(x, 2) ^ rotr(x, 13) ^ rotr(x, 22); }
inline uint32_t big_sigma1(uint32_t x) { return rotr(x, 6) ^ rotr(x, 11) ^ rotr(x, 25); }
inline uint32_t small_sigma0(uint32_t x) { return rotr(x, 7) ^ rotr(x, 18) ^ (x >> 3); }
inline uint32_t small_sigma1(uint32_t x) { return rotr(x, 17) ^ rotr(x, 19) ^ (x >> 10); }

void compress_portable(uint32_t* state, const uint8_t* block) {
  uint32_t w[64];
  for (int t = 0; t < 16; ++t)
    w[t] = (uint32_t(block[4 * t]) << 24) | (uint32_t(block[4 * t + 1]) << 16) |
           (uint32_t(block[4 * t + 2]) << 8) | uint32_t(block[4 * t + 3]);
  for (int t = 16; t < 64; ++t)
    w[t] = small_sigma1(w[t - 2]) + w[t - 7] + small_sigma0(w[t - 15]) + w[t - 16];

  uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
  uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
  for (int t = 0; t < 64; ++t) {
    const uint32_t t1 = h + big_sigma1(e) + ch(e, f, g) + kRoundConstants[t] + w[t];
    const uint32_t t2 = big_sigma0(a) + maj(a, b, c);
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  state[0] += a;
  state[1] += b;
  state[2] += c;
  state[3] += d;
  state[4] += e;
  state[5] += f;
  state[6] += g;
  state[7] += h;
}

#if defined(__x86_64__)
bool cpu_has_sha_extensions() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool ssse3 = c & (1u << 9), sse41 = c & (1u << 19);
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return ssse3 && sse41 && (b & (1u << 29));
}

// Four rounds per step: WK = W[t..t+3] + K[t..t+3]; each sha256rnds2 does two rounds and
// returns the new (A,B,E,F), while the previous (A,B,E,F) becomes (C,D,G,H). Message words
// t >= 16 come from sha256msg1 (W[t-16] + s0(W[t-15])), + W[t-7], then sha256msg2 (+ s1(W[t-2])).
__attribute__((target("sha,sse4.1,ssse3"))) void compress_hardware(uint32_t* state, const uint8_t* blocks,
                                                                  size_t num_blocks) {
  const __m128i byte_swap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
  const __m128i cdab = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(state)), 0xB1);
  const __m128i efgh = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(state + 4)), 0x1B);
  __m128i abef = _mm_alignr_epi8(cdab, efgh, 8);
  __m128i cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);

  for (size_t blk = 0; blk < num_blocks; ++blk, blocks += 64) {
    const __m128i abef_in = abef, cdgh_in = cdgh;
    __m128i w[4];
    for (int i = 0; i < 4; ++i)
      w[i] = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks + 16 * i)), byte_swap);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      if (i >= 4) {  // w[i%4] holds W[4i-16..], w[(i+1)%4] W[4i-12..], w[(i+2)%4] W[4i-8..], w[(i+3)%4] W[4i-4..]
        __m128i t = _mm_sha256msg1_epu32(w[i % 4], w[(i + 1) % 4]);
        t = _mm_add_epi32(t, _mm_alignr_epi8(w[(i + 3) % 4], w[(i + 2) % 4], 4));
        w[i % 4] = _mm_sha256msg2_epu32(t, w[(i + 3) % 4]);
      }
      __m128i wk = _mm_add_epi32(w[i % 4], _mm_loadu_si128(reinterpret_cast<const __m128i*>(kRoundConstants + 4 * i)));
      cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);  // cdgh now holds (A,B,E,F) after 2 rounds
      wk = _mm_shuffle_epi32(wk, 0x0E);
      abef = _mm_sha256rnds2_epu32(abef, cdgh, wk);
    }
    abef = _mm_add_epi32(abef, abef_in);
    cdgh = _mm_add_epi32(cdgh, cdgh_in);
  }

  const __m128i abef_r = _mm_shuffle_epi32(abef, 0x1B);  // F E B A -> A B E F in lanes 0..3
  const __m128i cdgh_r = _mm_shuffle_epi32(cdgh, 0xB1);  // lanes 0..3: G H C D
  _mm_storeu_si128(reinterpret_cast<__m128i*>(state), _mm_blend_epi16(abef_r, cdgh_r, 0xF0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(state + 4), _mm_alignr_epi8(cdgh_r, abef_r, 8));
}
#endif

}  // namespace

Sha256::Sha256(bool allow_hardware) : use_hardware_(allow_hardware && hardware_available()) { reset(); }

bool Sha256::hardware_available() {
#if defined(__x86_64__)
  static const bool available = cpu_has_sha_extensions();
  return available;
#else
  return false;
#endif
}

void Sha256::compress_blocks(const uint8_t* blocks, size_t num_blocks) {
#if defined(__x86_64__)
  if (use_hardware_) {
    compress_hardware(state_.data(), blocks, num_blocks);
    return;
  }
#endif
  for (size_t i = 0; i < num_blocks; ++i) compress_portable(state_.data(), blocks + 64 * i);
}

void Sha256::reset() {
  for (int i = 0; i < 8; ++i) state_[i] = kInitialState[i];
  buffer_len_ = 0;
  total_len_ = 0;
}

void Sha256::update(const void* data, size_t n) {
  if (n == 0) return;  // data may be null (an empty buffer's)
  const auto* p = static_cast<const uint8_t*>(data);
  total_len_ += n;
  if (buffer_len_ > 0) {
    const size_t take = std::min(n, buffer_.size() - buffer_len_);
    std::memcpy(buffer_.data() + buffer_len_, p, take);
    buffer_len_ += take;
    p += take;
    n -= take;
    if (buffer_len_ < buffer_.size()) return;
    compress_blocks(buffer_.data(), 1);
    buffer_len_ = 0;
  }
  const size_t full = n / 64;
  compress_blocks(p, full);
  p += 64 * full;
  n -= 64 * full;
  if (n > 0) {
    std::memcpy(buffer_.data(), p, n);
    buffer_len_ = n;
  }
}

Sha256::Digest Sha256::final() {
  const uint64_t bit_len = total_len_ * 8;
  // 0x80, then zeros up to 56 mod 64, then the 64-bit big-endian length.
  uint8_t pad[72] = {0x80};
  const size_t pad_len = (buffer_len_ < 56 ? 56 : 120) - buffer_len_;
  for (int i = 0; i < 8; ++i) pad[pad_len + i] = uint8_t(bit_len >> (56 - 8 * i));
  update(pad, pad_len + 8);  // ends exactly on a block boundary
  Digest out;
  for (int i = 0; i < 8; ++i) {
    out[4 * i] = uint8_t(state_[i] >> 24);
    out[4 * i + 1] = uint8_t(state_[i] >> 16);
    out[4 * i + 2] = uint8_t(state_[i] >> 8);
    out[4 * i + 3] = uint8_t(state_[i]);
  }
  reset();
  return out;
}

std::string Sha256::hex(const Digest& d) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s(64, '0');
  for (size_t i = 0; i < d.size(); ++i) {
    s[2 * i] = kHex[d[i] >> 4];
    s[2 * i + 1] = kHex[d[i] & 15];
  }
  return s;
}

std::string sha256_hex(const void* data, size_t n) {
  Sha256 h;
  h.update(data, n);
  return Sha256::hex(h.final());
}

std::string sha256_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MOE_CHECK(fd >= 0, "cannot open '", path, "' to checksum it: ", std::strerror(errno));
  Sha256 h;
  std::vector<uint8_t> buf(size_t(1) << 20);
  for (;;) {
    const ssize_t got = ::read(fd, buf.data(), buf.size());
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int err = errno;
      ::close(fd);
      MOE_FAIL("read error in '", path, "' while checksumming: ", std::strerror(err));
    }
    if (got == 0) break;
    h.update(buf.data(), size_t(got));
  }
  ::close(fd);
  return Sha256::hex(h.final());
}

}  // namespace moe
