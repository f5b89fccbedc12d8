// SHA-256 against the FIPS 180-4 / NIST example vectors, lengths around the padding boundary
// (55, 56, 63, 64, 65, 119, 120, 128 bytes), streaming in uneven pieces, the portable and the
// SHA-extension block functions against each other, and the file helper.
#include "checkpoint/sha256.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <unistd.h>
#include <vector>

#include "core/error.h"

namespace moe::testing {
namespace {

std::string digest(const std::string& s) { return sha256_hex(s.data(), s.size()); }

std::string portable_digest(const void* data, size_t n) {
  Sha256 h(/*allow_hardware=*/false);
  h.update(data, n);
  return Sha256::hex(h.final());
}

TEST(Sha256, StandardVectors) {
  EXPECT_EQ(digest(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(digest("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(digest("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(digest("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopq"
                   "rsmnopqrstnopqrstu"),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  EXPECT_EQ(digest(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  const std::string million(1000000, 'a');
  EXPECT_EQ(portable_digest(million.data(), million.size()),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  EXPECT_EQ(portable_digest("abc", 3), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Sha256, HardwareAndPortablePathsAgree) {
  if (!Sha256::hardware_available()) GTEST_SKIP() << "no x86 SHA extensions on this CPU";
  std::mt19937_64 gen(11);
  std::vector<uint8_t> msg(70000);
  for (auto& b : msg) b = uint8_t(gen());
  for (size_t n : {size_t(0), size_t(1), size_t(64), size_t(65), size_t(1000), size_t(4096), size_t(70000)}) {
    EXPECT_EQ(sha256_hex(msg.data(), n), portable_digest(msg.data(), n)) << "length " << n;
  }
  for (int trial = 0; trial < 50; ++trial) {
    const size_t n = gen() % msg.size();
    EXPECT_EQ(sha256_hex(msg.data(), n), portable_digest(msg.data(), n)) << "length " << n;
  }
}

TEST(Sha256, PaddingBoundaries) {
  // bytes 0, 1, 2, ... (mod 256) of each length; digests from an independent implementation.
  const std::pair<size_t, const char*> cases[] = {
      {55, "463eb28e72f82e0a96c0a4cc53690c571281131f672aa229e0d45ae59b598b59"},
      {56, "da2ae4d6b36748f2a318f23e7ab1dfdf45acdc9d049bd80e59de82a60895f562"},
      {63, "29af2686fd53374a36b0846694cc342177e428d1647515f078784d69cdb9e488"},
      {64, "fdeab9acf3710362bd2658cdc9a29e8f9c757fcf9811603a8c447cd1d9151108"},
      {65, "4bfd2c8b6f1eec7a2afeb48b934ee4b2694182027e6d0fc075074f2fabb31781"},
      {119, "da18797ed7c3a777f0847f429724a2d8cd5138e6ed2895c3fa1a6d39d18f7ec6"},
      {120, "f52b23db1fbb6ded89ef42a23ce0c8922c45f25c50b568a93bf1c075420bbb7c"},
      {128, "471fb943aa23c511f6f72f8d1652d9c880cfa392ad80503120547703e56a2be5"},
  };
  for (const auto& [n, want] : cases) {
    std::vector<uint8_t> msg(n);
    for (size_t i = 0; i < n; ++i) msg[i] = uint8_t(i);
    EXPECT_EQ(sha256_hex(msg.data(), n), want) << "length " << n;
    EXPECT_EQ(portable_digest(msg.data(), n), want) << "length " << n;
  }
}

TEST(Sha256, StreamingInUnevenPiecesMatchesOneShot) {
  std::mt19937_64 gen(7);
  std::vector<uint8_t> msg(10007);
  for (auto& b : msg) b = uint8_t(gen());
  const std::string whole = sha256_hex(msg.data(), msg.size());
  for (int trial = 0; trial < 20; ++trial) {
    Sha256 h;
    size_t pos = 0;
    while (pos < msg.size()) {
      const size_t take = std::min<size_t>(msg.size() - pos, gen() % 200);  // includes 0-byte pieces
      h.update(msg.data() + pos, take);
      pos += take;
    }
    EXPECT_EQ(Sha256::hex(h.final()), whole) << "trial " << trial;
  }
  // final() resets: the same object hashes a new message from scratch.
  Sha256 h;
  h.update("xyz", 3);
  h.final();
  h.update("abc", 3);
  EXPECT_EQ(Sha256::hex(h.final()), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Sha256, FileHelper) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("moe_sha256_test_" + std::to_string(::getpid()))).string();
  {
    std::ofstream out(path, std::ios::binary);
    const std::string big(3 * 1024 * 1024 + 17, 'a');  // spans several read chunks
    out << big;
  }
  EXPECT_EQ(sha256_file(path), digest(std::string(3 * 1024 * 1024 + 17, 'a')));
  std::remove(path.c_str());
  try {
    sha256_file(path);
    FAIL() << "expected an error for a missing file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moe::testing
