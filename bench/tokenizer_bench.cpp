// Tokenizer throughput: encodes a UTF-8 file with moe::Tokenizer on one thread, `repeats` times
// (the first pass fills the word cache), and prints MB/s of the best pass and ids per byte; with
// IDS_OUT, writes the ids as little-endian uint32 (so a caller can compare them).
// Usage: moecore_tokenizer_bench TOKENIZER_JSON TEXT_FILE [REPEATS] [IDS_OUT]
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "data/tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 3 || argc > 5) {
    std::fprintf(stderr, "usage: %s TOKENIZER_JSON TEXT_FILE [REPEATS] [IDS_OUT]\n", argv[0]);
    return 2;
  }
  try {
    const moe::Tokenizer tok = moe::Tokenizer::from_file(argv[1]);
    std::ifstream in(argv[2], std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    const int repeats = argc >= 4 ? std::stoi(argv[3]) : 3;
    std::vector<uint32_t> ids;
    double first = 0, best = 1e30;
    for (int r = 0; r < repeats; ++r) {
      ids.clear();
      const auto t0 = std::chrono::steady_clock::now();
      tok.encode(text, ids);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r == 0) first = s;
      best = std::min(best, s);
    }
    const double mb = static_cast<double>(text.size()) / 1e6;
    std::printf("moecore  %s: %.2f MB, %zu ids, first pass %.1f MB/s, best of %d %.1f MB/s\n", argv[1], mb,
                ids.size(), mb / first, repeats, mb / best);
    if (argc == 5) {
      std::ofstream out(argv[4], std::ios::binary);
      out.write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 4));
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
