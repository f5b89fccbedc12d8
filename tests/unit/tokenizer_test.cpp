// Byte-level BPE tokenizer without Python: the GPT-2 byte alphabet, merges by rank on small
// hand-written tokenizer.json files, added tokens, the Split behaviours, refusal of what is not
// supported (naming the file and the field), and decode(encode(x)) == x.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/pretokenize.h"
#include "data/tokenizer.h"

namespace moe::testing {
namespace {

using json = nlohmann::json;
using Ids = std::vector<uint32_t>;

// A GPT-2 style file: ids 0..255 are the bytes (in byte order), then one id per merge.
json byte_level_file(const std::vector<std::pair<std::string, std::string>>& merges) {
  json vocab = json::object();
  const auto& alphabet = byte_level_alphabet();
  for (int b = 0; b < 256; ++b) vocab[alphabet[b]] = b;
  json list = json::array();
  for (const auto& [l, r] : merges) {
    const std::string a = bytes_to_byte_level(l), c = bytes_to_byte_level(r);
    if (!vocab.contains(a + c)) vocab[a + c] = static_cast<int>(vocab.size());
    list.push_back(json::array({a, c}));
  }
  return {{"version", "1.0"},
          {"added_tokens", json::array({{{"id", 300}, {"content", "<|endoftext|>"}, {"special", true},
                                          {"normalized", false}, {"lstrip", false}, {"rstrip", false},
                                          {"single_word", false}}})},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
          {"post_processor", {{"type", "ByteLevel"}}},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"vocab", vocab}, {"merges", list}}}};
}

uint32_t byte(char c) { return static_cast<unsigned char>(c); }

std::string error_of(const json& file) {
  try {
    Tokenizer::from_json(file.dump(), "tok/tokenizer.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ByteLevel, AlphabetIsABijectionAndKeepsPrintableBytes) {
  const auto& a = byte_level_alphabet();
  std::set<std::string> seen(a.begin(), a.end());
  EXPECT_EQ(seen.size(), 256u);
  EXPECT_EQ(a['A'], "A");
  EXPECT_EQ(a['~'], "~");
  EXPECT_EQ(a[' '], "\xC4\xA0");   // U+0120 'Ġ'
  EXPECT_EQ(a['\n'], "\xC4\x8A");  // U+010A 'Ċ'
  EXPECT_EQ(a[0], "\xC4\x80");     // U+0100
  EXPECT_EQ(a[0xAD], "\xC5\x83");  // U+0143, the last of the 68 moved bytes
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  EXPECT_EQ(byte_level_to_bytes(bytes_to_byte_level(all)), all);
  EXPECT_EQ(byte_level_to_bytes("\xE4\xB8\xAD"), std::nullopt);  // U+4E2D is not in the alphabet
  EXPECT_EQ(byte_level_to_bytes("\xC4"), std::nullopt);          // cut UTF-8
}

TEST(ByteLevel, FindsInvalidUtf8) {
  EXPECT_EQ(find_invalid_utf8("plain ascii text, long enough for the fast path"), std::nullopt);
  EXPECT_EQ(find_invalid_utf8("caf\xC3\xA9 \xF0\x9F\x98\x80"), std::nullopt);
  EXPECT_EQ(find_invalid_utf8("abc\xC3"), 3u);              // truncated
  EXPECT_EQ(find_invalid_utf8("ab\xC0\xAF"), 2u);           // overlong '/'
  EXPECT_EQ(find_invalid_utf8("a\xED\xA0\x80"), 1u);        // surrogate
  EXPECT_EQ(find_invalid_utf8("0123456789\xFF"), 10u);
}

TEST(Tokenizer, MergesApplyByRankNotPosition) {
  // "b c" has the lower rank, so "abc" becomes a + bc although "a b" is leftmost.
  const Tokenizer t = Tokenizer::from_json(byte_level_file({{"b", "c"}, {"a", "b"}}).dump(), "t.json");
  const uint32_t bc = *t.token_to_id("bc"), ab = *t.token_to_id("ab");
  EXPECT_EQ(t.encode("abc"), (Ids{byte('a'), bc}));
  EXPECT_EQ(t.encode("abab"), (Ids{ab, ab}));
  EXPECT_EQ(t.vocab_size(), 301);
}

TEST(Tokenizer, MergesChainAcrossPreTokenizedWords) {
  const Tokenizer t = Tokenizer::from_json(
      byte_level_file({{"a", "b"}, {"ab", "c"}, {" ", "ab"}, {"a", "a"}}).dump(), "t.json");
  const uint32_t abc = *t.token_to_id("abc"), sp_ab = *t.token_to_id("\xC4\xA0" "ab"), aa = *t.token_to_id("aa");
  // Words "abc", " ab", " c": the last has no merge.
  EXPECT_EQ(t.encode("abc ab c"), (Ids{abc, sp_ab, byte(' '), byte('c')}));
  EXPECT_EQ(t.encode("aaaaa"), (Ids{aa, aa, byte('a')}));  // leftmost first among equal ranks
  EXPECT_EQ(t.encode(""), Ids{});
}

TEST(Tokenizer, MergesInStringFormEqualPairForm) {
  json pairs = byte_level_file({{"a", "b"}, {"ab", "c"}});
  json strings = pairs;
  strings["model"]["merges"] = json::array({"a b", "ab c"});
  const Tokenizer p = Tokenizer::from_json(pairs.dump(), "p.json"), s = Tokenizer::from_json(strings.dump(), "s.json");
  EXPECT_EQ(p.encode("abcab abc"), s.encode("abcab abc"));
  EXPECT_EQ(s.encode("abc"), Ids{*s.token_to_id("abc")});
}

TEST(Tokenizer, SplitsSpecialTokensBeforePreTokenization) {
  const Tokenizer t = Tokenizer::from_json(byte_level_file({{"a", "b"}}).dump(), "t.json");
  const uint32_t ab = *t.token_to_id("ab");
  EXPECT_EQ(t.encode("ab<|endoftext|>ab"), (Ids{ab, 300, ab}));
  EXPECT_EQ(t.encode("<|endoftext|><|endoftext|>"), (Ids{300, 300}));
  EXPECT_EQ(t.encode("<|endoftext|"), (Ids{byte('<'), byte('|'), byte('e'), byte('n'), byte('d'), byte('o'),
                                            byte('f'), byte('t'), byte('e'), byte('x'), byte('t'), byte('|')}));
  EXPECT_EQ(t.decode(Ids{ab, 300, byte(' ')}), "ab<|endoftext|> ");
}

TEST(Tokenizer, LongestAddedTokenWinsAndStripFlagsTakeWhitespace) {
  json f = byte_level_file({});
  f["added_tokens"] = json::array({{{"id", 400}, {"content", "<a>"}, {"special", true}, {"normalized", false}},
                                   {{"id", 401}, {"content", "<a><b>"}, {"special", true}, {"normalized", false}},
                                   {{"id", 402}, {"content", "<m>"}, {"special", true}, {"normalized", false},
                                    {"lstrip", true}, {"rstrip", true}}});
  const Tokenizer t = Tokenizer::from_json(f.dump(), "t.json");
  EXPECT_EQ(t.encode("<a><b><a>"), (Ids{401, 400}));
  EXPECT_EQ(t.encode("x  <m>  y"), (Ids{byte('x'), 402, byte('y')}));
}

TEST(Tokenizer, DecodeOfEncodeIsTheText) {
  const Tokenizer t = Tokenizer::from_json(
      byte_level_file({{"t", "h"}, {"th", "e"}, {" ", "the"}, {"\xE6", "\x97"}, {" ", " "}}).dump(), "t.json");
  for (const std::string text : {"the the theme", "", " ", "  \n\n\t x", "日本語 😀 café", "<|endoftext|>the",
                                 "numbers 12345, 3.14", "\x01\x7F control"}) {
    EXPECT_EQ(t.decode(t.encode(text)), text) << text;
  }
}

TEST(Tokenizer, RefusesInvalidUtf8AndUnknownIds) {
  const Tokenizer t = Tokenizer::from_json(byte_level_file({}).dump(), "t.json");
  try {
    t.encode("ok\xFFno");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not valid UTF-8 at byte 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(t.decode(Ids{301}), Error);
}

TEST(Tokenizer, RefusesUnsupportedPartsByName) {
  json f = byte_level_file({});
  auto refused = [&](json file, const std::string& part) {
    const std::string message = error_of(file);
    EXPECT_NE(message.find("tok/tokenizer.json"), std::string::npos) << message;
    EXPECT_NE(message.find(part), std::string::npos) << message;
  };
  json g = f;
  g["model"] = {{"type", "Unigram"}, {"vocab", json::array()}};
  refused(g, "model.type: model type 'Unigram' is not supported (byte-level BPE only)");
  g = f;
  g["model"]["type"] = "WordPiece";
  refused(g, "model type 'WordPiece' is not supported");
  g = f;
  g["normalizer"] = {{"type", "Lowercase"}};
  refused(g, "normalizer.type: normalizer type 'Lowercase' is not supported");
  g = f;
  g["normalizer"] = {{"type", "Sequence"}, {"normalizers", json::array({{{"type", "NFC"}}, {{"type", "NFKC"}}})}};
  refused(g, "normalizer.normalizers[1].type: normalizer type 'NFKC'");
  g = f;
  g["pre_tokenizer"] = {{"type", "Whitespace"}};
  refused(g, "pre_tokenizer.type: pre_tokenizer type 'Whitespace' is not supported");
  g = f;
  g["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", " "}}}, {"behavior", "Isolated"}};
  refused(g, "no ByteLevel pre-tokenizer");
  g = f;
  g["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  refused(g, "pre_tokenizer.pattern.Regex: regex does not compile with PCRE2");
  g = f;
  g["decoder"] = {{"type", "WordPiece"}};
  refused(g, "decoder.type: decoder type 'WordPiece' is not supported");
  g = f;
  g["post_processor"] = {{"type", "BertProcessing"}};
  refused(g, "post_processor.type: post_processor type 'BertProcessing'");
  g = f;
  g["model"]["dropout"] = 0.1;
  refused(g, "model.dropout");
  g = f;
  g["model"]["byte_fallback"] = true;
  refused(g, "model.byte_fallback");
  g = f;
  g["model"]["merges"] = json::array({"a zz"});
  refused(g, "model.merges[0]: token \"zz\" is not in model.vocab");
  refused(json::array(), "expected a JSON object");
  refused(json::object(), "model: missing");
  try {
    Tokenizer::from_json("{not json", "bad.json");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.json: not valid JSON"), std::string::npos) << e.what();
  }
}

TEST(Tokenizer, NullDecoderEncodesButRefusesDecode) {
  json f = byte_level_file({});
  f["decoder"] = nullptr;
  const Tokenizer t = Tokenizer::from_json(f.dump(), "t.json");
  EXPECT_EQ(t.encode("a"), Ids{byte('a')});
  EXPECT_THROW(t.decode(Ids{1}), Error);
}

// The examples of tokenizers' SplitDelimiterBehavior documentation.
TEST(SplitRule, Behaviours) {
  auto split = [](SplitBehavior b, bool invert = false) {
    SplitRule rule;
    rule.literal = "-";
    rule.behavior = b;
    rule.invert = invert;
    std::vector<std::string_view> words;
    rule.apply("the-final--countdown", words);
    return std::vector<std::string>(words.begin(), words.end());
  };
  using S = std::vector<std::string>;
  EXPECT_EQ(split(SplitBehavior::kRemoved), (S{"the", "final", "countdown"}));
  EXPECT_EQ(split(SplitBehavior::kIsolated), (S{"the", "-", "final", "-", "-", "countdown"}));
  EXPECT_EQ(split(SplitBehavior::kMergedWithPrevious), (S{"the-", "final-", "-", "countdown"}));
  EXPECT_EQ(split(SplitBehavior::kMergedWithNext), (S{"the", "-final", "-", "-countdown"}));
  EXPECT_EQ(split(SplitBehavior::kContiguous), (S{"the", "-", "final", "--", "countdown"}));
  EXPECT_EQ(split(SplitBehavior::kRemoved, true), (S{"-", "-", "-"}));
}

TEST(SplitRule, RegexSeesOnlyThePiece) {
  SplitRule rule;
  rule.regex = std::make_shared<Regex>(kGpt2SplitPattern, "test");
  std::vector<std::string_view> words;
  rule.apply("Hello  world's 123!!", words);
  EXPECT_EQ(std::vector<std::string>(words.begin(), words.end()),
            (std::vector<std::string>{"Hello", " ", " world", "'s", " 123", "!!"}));
}

}  // namespace
}  // namespace moe::testing
