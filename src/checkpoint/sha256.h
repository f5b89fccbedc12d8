// SHA-256 (FIPS 180-4): streaming digest over bytes and a file helper. Big-endian message
// schedule of 64 rounds on 512-bit blocks; the message is padded with 0x80, zeros and the
// 64-bit big-endian bit length. Digests print as 64 lowercase hex characters. On x86-64 CPUs
// with the SHA extensions the block function uses them (about 5x faster); results are identical.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace moe {

class Sha256 {
 public:
  using Digest = std::array<uint8_t, 32>;

  // allow_hardware = false keeps the portable block function (tests compare the two).
  explicit Sha256(bool allow_hardware = true);
  // Feeds `n` bytes; may be called any number of times before final().
  void update(const void* data, size_t n);
  // Pads, returns the digest and resets the object for a new message.
  Digest final();

  static std::string hex(const Digest& d);
  // Whether this CPU has the x86 SHA extensions used by the accelerated block function.
  static bool hardware_available();

 private:
  void compress_blocks(const uint8_t* blocks, size_t num_blocks);
  void reset();

  bool use_hardware_ = false;
  std::array<uint32_t, 8> state_{};
  std::array<uint8_t, 64> buffer_{};
  size_t buffer_len_ = 0;
  uint64_t total_len_ = 0;  // bytes fed so far
};

// Lowercase hex digest of a byte range.
std::string sha256_hex(const void* data, size_t n);
// Lowercase hex digest of a file's contents; throws moe::Error naming the path on I/O errors.
std::string sha256_file(const std::string& path);

}  // namespace moe
