// Compares moe::Tokenizer with ids written by the Python `tokenizers` library: reads a
// tokenizer.json and a cases file [{"text", "ids", "decoded"}], encodes and decodes every text,
// prints each mismatch (text, first differing position, expected and got ids) and exits 1 on any.
// Usage: tokenizer_golden_check TOKENIZER_JSON CASES_JSON
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"

namespace {
std::string shown(const std::string& text) {
  std::string s = nlohmann::json(text).dump();
  return s.size() > 160 ? s.substr(0, 160) + "...(" + std::to_string(text.size()) + " bytes)" : s;
}
std::string ids_around(const std::vector<uint32_t>& ids, size_t at) {
  std::ostringstream os;
  const size_t from = at > 3 ? at - 3 : 0;
  os << "[" << from << "..] ";
  for (size_t i = from; i < ids.size() && i < at + 6; ++i) os << ids[i] << (i == at ? "* " : " ");
  return os.str();
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s TOKENIZER_JSON CASES_JSON\n", argv[0]);
    return 2;
  }
  try {
    const moe::Tokenizer tok = moe::Tokenizer::from_file(argv[1]);
    std::ifstream in(argv[2]);
    const nlohmann::json cases = nlohmann::json::parse(in);
    int failures = 0;
    size_t num_ids = 0;
    for (const auto& c : cases) {
      const std::string text = c["text"].get<std::string>();
      const auto expected = c["ids"].get<std::vector<uint32_t>>();
      const std::vector<uint32_t> got = tok.encode(text);
      num_ids += expected.size();
      if (got != expected) {
        size_t at = 0;
        while (at < got.size() && at < expected.size() && got[at] == expected[at]) ++at;
        std::printf("MISMATCH encode %s: %zu ids expected, %zu got; first difference at %zu: expected %s got %s\n",
                    shown(text).c_str(), expected.size(), got.size(), at, ids_around(expected, at).c_str(),
                    ids_around(got, at).c_str());
        ++failures;
        continue;
      }
      const std::string decoded = tok.decode(got);
      if (decoded != c["decoded"].get<std::string>()) {
        std::printf("MISMATCH decode %s: expected %s got %s\n", shown(text).c_str(),
                    shown(c["decoded"].get<std::string>()).c_str(), shown(decoded).c_str());
        ++failures;
      }
    }
    std::printf("%s: %zu texts, %zu ids, %d mismatches (%s)\n", argv[1], cases.size(), num_ids, failures,
                tok.describe().c_str());
    return failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
