// open_data (data/sources.h): the embedded corpus is the same whatever train.steps is; every
// source is checked before step 1 (ids over a full pass, uint32 data read as uint16, enough
// instances, paths the embedded source would ignore) and described by one summary line.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/config.h"
#include "data/dataset.h"
#include "data/embedded.h"
#include "data/sources.h"
#include "support/test_util.h"
#include "support/token_formats.h"

namespace moe::testing {
namespace {

namespace fs = std::filesystem;

#define EXPECT_HAS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << "'" << (part) << "' not in: " << (text)

std::vector<int32_t> read_all(const TokenSource& s) {
  std::vector<int32_t> out(static_cast<size_t>(s.num_tokens()));
  s.read(0, s.num_tokens(), out.data());
  return out;
}

// A headerless little-endian file of `width`-byte ids.
std::string write_ids(const fs::path& path, const std::vector<uint32_t>& ids, int width) {
  std::ofstream f(path, std::ios::binary);
  for (uint32_t v : ids)
    for (int b = 0; b < width; ++b) f.put(static_cast<char>(v >> (8 * b)));
  return path.string();
}

std::vector<uint32_t> ramp(int64_t n, uint32_t modulo) {
  std::vector<uint32_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<uint32_t>((i * 7 + 3) % modulo);
  return v;
}

Config small(int64_t steps) {
  Config c;
  c.train.seq_len = 16;
  c.train.micro_batch = 2;
  c.train.global_batch = 4;
  c.train.steps = steps;
  return c;
}

Config tokens_config(std::vector<std::string> paths, int64_t steps = 10) {
  Config c = small(steps);
  c.data.source = "tokens";
  c.data.paths = std::move(paths);
  return c;
}

// The embedded corpus was sized (train.steps + 1) x global_batch x (seq_len + 1): a 6-step and a
// 12-step run had other instance counts, hence other permutations, from the first batch on.
TEST(OpenData, EmbeddedCorpusDoesNotDependOnSteps) {
  std::ostringstream log;
  DataSources six = open_data(small(6), log), twelve = open_data(small(12), log), many = open_data(small(100000), log);
  ASSERT_EQ(six.train->num_tokens(), kEmbeddedTrainTokens);
  EXPECT_EQ(twelve.train->num_tokens(), kEmbeddedTrainTokens);
  EXPECT_EQ(many.train->num_tokens(), kEmbeddedTrainTokens);  // 100000 steps wrap to a second epoch
  EXPECT_EQ(read_all(*six.train), read_all(*twelve.train));
  EXPECT_EQ(six.eval->num_tokens(), kEmbeddedEvalTokens);
  EXPECT_EQ(read_all(*six.eval), read_all(*many.eval));
  DataLoader a(*six.train, 16, 4, 2, 1234, 0, 1), b(*twelve.train, 16, 4, 2, 1234, 0, 1);
  for (int step = 0; step < 12; ++step) {
    const std::vector<Batch> x = a.next(), y = b.next();
    ASSERT_EQ(x.size(), y.size());
    for (size_t m = 0; m < x.size(); ++m) EXPECT_EQ(x[m].inputs, y[m].inputs) << "step " << step + 1;
  }
  // The corpus is a prefix of the split's stream; only a batch larger than the fixed size grows it.
  const std::vector<int32_t> six_tokens = read_all(*six.train);
  const std::vector<uint32_t> prefix = embedded_corpus("train", 1000, 1234);
  EXPECT_TRUE(std::equal(prefix.begin(), prefix.end(), six_tokens.begin()));
  Config big = small(1);
  big.train.seq_len = 1 << 16;
  big.train.global_batch = 80;
  big.train.micro_batch = 80;
  EXPECT_EQ(embedded_num_tokens(big, "train"), 80 * ((1 << 16) + 1));
  EXPECT_EQ(embedded_num_tokens(big, "eval"), 4 * 80 * ((1 << 16) + 1));
  EXPECT_EQ(embedded_num_tokens(small(1), "train"), kEmbeddedTrainTokens);
  EXPECT_EQ(embedded_num_tokens(small(1), "eval"), kEmbeddedEvalTokens);
}

TEST(OpenData, SummaryLinePerSource) {
  const TempDir tmp("sources_summary");
  // 80 + 50 tokens = 130 = 7 instances of 17 (11 dropped); global batch 4: 1 batch per epoch.
  const std::string a = write_ids(tmp / "a.bin", ramp(80, 256), 2);
  const std::string b = write_ids(tmp / "b.bin", ramp(50, 256), 2);
  std::ostringstream log;
  open_data(tokens_config({a, b}, 10), log);
  EXPECT_HAS(log.str(), "data train: 2 files (raw uint16), 130 tokens, 7 instances of 17 tokens, 10 steps x 4 sequences = "
                        "10 epochs of 1 batches; ids checked in ");
  EXPECT_HAS(log.str(), "data eval: none (data.eval_paths is empty)\n");

  Config c = tokens_config({a}, 3);
  c.data.eval_paths = {b};
  std::ostringstream two;
  open_data(c, two);
  EXPECT_HAS(two.str(), "data train: 1 file '" + a + "' (raw uint16), 80 tokens, 4 instances");
  EXPECT_HAS(two.str(), "data eval: 1 file '" + b + "' (raw uint16), 50 tokens, 2 instances of 17 tokens, 1 batches x 2 "
                        "sequences per evaluation (train.eval_batches = 4)");
  EXPECT_EQ(two.str().find("warning"), std::string::npos);
  c.data.eval_paths = {(tmp / "." / "a.bin").string()};  // the train file under another name
  std::ostringstream same;
  open_data(c, same);
  EXPECT_HAS(same.str(), "data warning: eval file '" + c.data.eval_paths[0] + "' is also the train file '" + a + "'");

  std::ostringstream emb;
  open_data(small(2032), emb);
  EXPECT_HAS(emb.str(), "data train: embedded:train (generated, seed 1234), 4194304 tokens, 246723 instances of 17 "
                        "tokens, 2032 steps x 4 sequences = 0.0329 epochs of 61680 batches");
  EXPECT_HAS(emb.str(), "data eval: embedded:eval (generated, seed 1234), 1048576 tokens, 61680 instances of 17 "
                        "tokens, 4 batches x 2 sequences per evaluation;");
}

// The summary line says each file's format (counted by format when they differ), and a bad file of
// any format is refused before step 1; a Megatron prefix in both lists is the same file.
TEST(OpenData, SummaryLineNamesEveryFormat) {
  const TempDir tmp("sources_formats");
  std::vector<uint64_t> ids;
  for (uint32_t v : ramp(40, 256)) ids.push_back(v);
  const std::string raw = write_ids(tmp / "raw.bin", ramp(40, 256), 2);
  const std::string llmc = (tmp / "shard_000000.bin").string();
  write_bytes(llmc, llmc_shard(ids, false));
  const std::string empty = (tmp / "empty.tokens").string();
  write_bytes(empty, Bytes(0));  // an empty headerless file: 0 tokens
  const std::string mega = write_megatron((tmp / "corpus_text_document").string(), {{ids}, {ids}}, 4);
  const std::string mega2 = write_megatron((tmp / "second_text_document").string(), {{ids}}, 4);
  std::ostringstream log;
  open_data(tokens_config({mega, raw, llmc, mega2, empty}), log);
  EXPECT_HAS(log.str(), "data train: 5 files (1 llm.c uint16, 2 megatron int32, 2 raw uint16), 200 tokens, 11 "
                        "instances of 17 tokens");
  std::ostringstream one;
  open_data(tokens_config({mega}), one);
  EXPECT_HAS(one.str(), "data train: 1 file '" + mega + ".bin' (megatron int32), 80 tokens");
  std::ostringstream same_kind;
  open_data(tokens_config({mega, mega2}), same_kind);
  EXPECT_HAS(same_kind.str(), "data train: 2 files (megatron int32), 120 tokens");

  Config c = tokens_config({mega});
  c.data.eval_paths = {mega + ".idx"};
  std::ostringstream same;
  open_data(c, same);
  EXPECT_HAS(same.str(), "data warning: eval file '" + mega + ".bin' is also the train file '" + mega + ".bin'");

  Bytes idx = megatron_idx({{ids}}, 7);
  write_bytes((tmp / "float.idx").string(), idx);
  write_bytes((tmp / "float.bin").string(), Bytes(160));
  std::ostringstream none;
  EXPECT_HAS(error_of([&] { open_data(tokens_config({raw, (tmp / "float").string()}), none); }),
             "Megatron index '" + (tmp / "float.idx").string() + "' has dtype code 7 (float32)");
  EXPECT_EQ(none.str(), "");
}

// A bad id the run would read late, or never (in the dropped remainder), fails before step 1.
TEST(OpenData, EveryIdIsCheckedBeforeTraining) {
  const TempDir tmp("sources_ids");
  std::vector<uint32_t> ids = ramp(4 * 17 * 50 + 3, 256);
  ids.back() = 300;
  const std::string a = write_ids(tmp / "a.bin", ramp(40, 256), 2);
  const std::string b = write_ids(tmp / "b.bin", ids, 2);
  std::ostringstream log;
  const std::string msg = error_of([&] { open_data(tokens_config({a, b}), log); });
  EXPECT_HAS(msg, "token id 300 at token offset " + std::to_string(ids.size() - 1) + " of '" + b + "'");
  EXPECT_HAS(msg, "outside the vocabulary [0, 256)");
  EXPECT_EQ(log.str(), "");
  Config eval_bad = tokens_config({write_ids(tmp / "c.bin", ramp(200, 256), 2)});
  eval_bad.data.eval_paths = {b};
  EXPECT_HAS(error_of([&] { open_data(eval_bad, log); }), "of '" + b + "'");
  Config wide = tokens_config({a, b});
  wide.model.vocab_size = 301;
  EXPECT_NO_THROW(open_data(wide, log));
}

// uint32 ids below 65536 read as uint16 are the ids with a 0 after each: in range, so only this
// pattern gives them away.
TEST(OpenData, Uint32DataReadAsUint16IsRefused) {
  const TempDir tmp("sources_dtype");
  const std::vector<uint32_t> ids = ramp(300, 256);
  const std::string u32 = write_ids(tmp / "u32.bin", ids, 4);
  std::ostringstream log;
  const std::string msg = error_of([&] { open_data(tokens_config({u32}), log); });
  EXPECT_HAS(msg, "token file '" + u32 + "' read as uint16 has 0 at every odd position (600 tokens)");
  EXPECT_HAS(msg, "set token_dtype = \"uint32\"");
  Config right = tokens_config({u32});
  right.data.token_dtype = "uint32";
  EXPECT_NO_THROW(open_data(right, log));
  // Real uint16 data with many zeros, and a short file, pass; so does a file of zeros only.
  std::vector<uint32_t> sparse(600, 0);
  for (size_t i = 0; i < sparse.size(); i += 2) sparse[i] = 5;
  sparse[401] = 9;
  EXPECT_NO_THROW(open_data(tokens_config({write_ids(tmp / "sparse.bin", sparse, 2)}), log));
  EXPECT_NO_THROW(open_data(tokens_config({write_ids(tmp / "zeros.bin", std::vector<uint32_t>(600, 0), 2)}), log));
  std::vector<uint32_t> short_ids(254, 0);
  for (size_t i = 0; i < short_ids.size(); i += 2) short_ids[i] = 5;
  const std::string s16 = write_ids(tmp / "short.bin", short_ids, 2);
  Config short_run = tokens_config({s16});
  EXPECT_NO_THROW(open_data(short_run, log));
}

TEST(OpenData, TooLittleDataAndIgnoredPaths) {
  const TempDir tmp("sources_size");
  const std::string three = write_ids(tmp / "three.bin", ramp(3 * 17 + 16, 256), 2);  // 3 instances
  std::ostringstream log;
  const std::string msg = error_of([&] { open_data(tokens_config({three}), log); });
  EXPECT_HAS(msg, "not enough train data (1 file '" + three + "' (raw uint16)) for one global batch");
  EXPECT_HAS(msg, "67 tokens make 3 instances of seq_len + 1 = 17 tokens, but train.global_batch is 4");
  EXPECT_HAS(msg, "need at least 4 x 17 = 68 tokens in data.paths");
  Config c = tokens_config({write_ids(tmp / "train.bin", ramp(200, 256), 2)});
  c.data.eval_paths = {write_ids(tmp / "one.bin", ramp(20, 256), 2)};
  EXPECT_HAS(error_of([&] { open_data(c, log); }),
             "an eval batch is train.micro_batch = 2 sequences; need at least 34 tokens in data.eval_paths");
  Config emb = small(1);
  emb.data.paths = {three};
  EXPECT_HAS(error_of([&] { open_data(emb, log); }),
             "data.paths or data.eval_paths names files, but data.source = \"embedded\" ignores them");
  emb.data.paths.clear();
  emb.model.vocab_size = 100;
  EXPECT_HAS(error_of([&] { open_data(emb, log); }), "model.vocab_size must be >= 256, got 100");
}

}  // namespace
}  // namespace moe::testing
