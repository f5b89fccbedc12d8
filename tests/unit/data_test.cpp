// Data pipeline: token files (headerless, .npy, Megatron indexed datasets, llm.c shards, written
// here byte by byte in those tools' layouts; concatenation, every bad-input error),
// instance ordering and rank/micro-batch slicing, resume by position, the embedded corpus and
// the byte-level tokenizer. Files live in a per-test temporary directory removed afterwards.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "support/test_util.h"
#include "support/token_formats.h"
#include "core/error.h"
#include "data/dataset.h"
#include "data/embedded.h"
#include "data/token_file.h"

namespace moe::testing {
namespace {

namespace fs = std::filesystem;
void expect_contains(const std::string& msg, std::initializer_list<std::string> parts) {
  for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
}

// A .npy file written byte by byte: magic, version, header length, dict padded with spaces and
// a newline so the data starts on a 64-byte boundary (byte 128 for the dicts used here, as
// numpy writes them), then `data`.
Bytes npy_file(const std::string& dict, const Bytes& data, int major = 1) {
  Bytes b = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<uint8_t>(major), 0x00};
  const size_t preamble = major == 1 ? 10 : 12;
  std::string header = dict;
  while ((preamble + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  put_le(b, header.size(), major == 1 ? 2 : 4);
  b.insert(b.end(), header.begin(), header.end());
  b.insert(b.end(), data.begin(), data.end());
  return b;
}

std::string npy_dict(const std::string& descr, const std::string& shape, const char* fortran = "False") {
  return "{'descr': '" + descr + "', 'fortran_order': " + fortran + ", 'shape': " + shape + ", }";
}

class DataFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) /
           ("moecore_data_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const Bytes& bytes) {
    const std::string path = (dir_ / name).string();
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    return path;
  }
  std::string write_text(const std::string& name, const std::string& text) {
    return write(name, Bytes(text.begin(), text.end()));
  }
  // Names of the entries of the test's directory.
  std::set<std::string> listing() const {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.insert(e.path().filename().string());
    return names;
  }

  fs::path dir_;
};

std::vector<int32_t> read_all(const TokenSource& s) {
  std::vector<int32_t> out(static_cast<size_t>(s.num_tokens()));
  s.read(0, s.num_tokens(), out.data());
  return out;
}

// ----------------------------------------------------------------------------- token files

TEST_F(DataFiles, HeaderlessUint16ReadsBack) {
  const std::vector<uint64_t> ids = {0, 1, 255, 256, 4097, 65534, 65535, 7};
  const std::string p = write("a.npy", le_array(ids, 2));
  TokenSource s = TokenSource::open({p}, "uint16", 65536);
  EXPECT_EQ(s.num_tokens(), 8);
  EXPECT_EQ(s.file_format(0), "raw uint16");
  EXPECT_EQ(read_all(s), std::vector<int32_t>(ids.begin(), ids.end()));
}

TEST_F(DataFiles, HeaderlessUint32ReadsBack) {
  const std::vector<uint64_t> ids = {0, 65536, 100277, 3, 1000000, 12};
  const std::string p = write("a.bin", le_array(ids, 4));
  TokenSource s = TokenSource::open({p}, "uint32", 1 << 20);
  EXPECT_EQ(s.num_tokens(), 6);
  EXPECT_EQ(read_all(s), std::vector<int32_t>(ids.begin(), ids.end()));
  std::vector<int32_t> mid(3);
  s.read(2, 3, mid.data());
  EXPECT_EQ(mid, (std::vector<int32_t>{100277, 3, 1000000}));
}

TEST_F(DataFiles, NpyDetectedRegardlessOfConfiguredDtype) {
  const std::vector<uint64_t> ids = {5, 60000, 0, 42, 17};
  const std::string u2 = write("u2.npy", npy_file(npy_dict("<u2", "(5,)"), le_array(ids, 2)));
  const std::string u4 = write("u4.npy", npy_file(npy_dict("<u4", "(5,)"), le_array(ids, 4)));
  const std::vector<int32_t> want(ids.begin(), ids.end());
  for (const char* dtype : {"uint16", "uint32"}) {
    TokenSource a = TokenSource::open({u2}, dtype, 65536);
    TokenSource b = TokenSource::open({u4}, dtype, 65536);
    EXPECT_EQ(a.file_format(0), "npy <u2");
    EXPECT_EQ(b.file_format(0), "npy <u4");
    EXPECT_EQ(read_all(a), want) << dtype;
    EXPECT_EQ(read_all(b), want) << dtype;
  }
}

TEST_F(DataFiles, NpyVersionsAndIntegerDtypes) {
  // Version 2.0 (4-byte header length), signed and 64-bit and byte descrs, double-quoted keys
  // and a header without the trailing comma.
  const std::vector<uint64_t> ids = {9, 0, 31, 2};
  const std::string i4 = write("i4.npy", npy_file(npy_dict("<i4", "(4,)"), le_array(ids, 4), 2));
  const std::string i8 = write("i8.npy", npy_file(npy_dict("<i8", "(4,)"), le_array(ids, 8), 3));
  const std::string u1 =
      write("u1.npy", npy_file("{\"descr\": \"|u1\", \"shape\": (4,), \"fortran_order\": False}",
                               le_array(ids, 1)));
  const std::vector<int32_t> want(ids.begin(), ids.end());
  for (const std::string& p : {i4, i8, u1})
    EXPECT_EQ(read_all(TokenSource::open({p}, "uint16", 32)), want) << p;
}

TEST_F(DataFiles, ConcatenatesFilesInOrder) {
  const std::string a = write("a.npy", le_array({1, 2, 3}, 2));
  const std::string empty = write("empty.npy", {});
  const std::string b = write("b.npy", npy_file(npy_dict("<u4", "(4,)"), le_array({10, 11, 12, 13}, 4)));
  const std::string c = write("c.npy", le_array({20, 21}, 2));
  TokenSource s = TokenSource::open({a, empty, b, c}, "uint16", 100);
  const std::vector<int32_t> want = {1, 2, 3, 10, 11, 12, 13, 20, 21};
  ASSERT_EQ(s.num_tokens(), 9);
  EXPECT_EQ(s.num_files(), 4);
  EXPECT_EQ(s.file_num_tokens(1), 0);
  EXPECT_EQ(s.file_name(2), b);
  for (int64_t off = 0; off <= 9; ++off) {
    for (int64_t n = 0; off + n <= 9; ++n) {
      std::vector<int32_t> got(static_cast<size_t>(n));
      s.read(off, n, got.data());
      EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin() + off)) << off << "+" << n;
    }
  }
  // Same files in another order give another stream.
  EXPECT_EQ(read_all(TokenSource::open({c, a}, "uint16", 100)), (std::vector<int32_t>{20, 21, 1, 2, 3}));
  std::vector<int32_t> one(2);
  expect_contains(error_of([&] { s.read(8, 2, one.data()); }), {"[8, 10)", "9 tokens"});
}

TEST_F(DataFiles, TruncatedHeaderlessFile) {
  Bytes b = le_array({1, 2}, 2);
  b.push_back(7);
  const std::string p = write("odd.npy", b);
  expect_contains(error_of([&] { TokenSource::open({p}, "uint16", 256); }),
                  {"truncated", p, "5 bytes", "multiple of 2", "byte offset 4"});
  const std::string q = write("six.bin", le_array({1, 2, 3}, 2));
  expect_contains(error_of([&] { TokenSource::open({q}, "uint32", 256); }),
                  {"truncated", q, "6 bytes", "multiple of 4", "byte offset 4"});
  EXPECT_EQ(TokenSource::open({q}, "uint16", 256).num_tokens(), 3);
}

TEST_F(DataFiles, BadNpyVersionAndPreamble) {
  Bytes v4 = npy_file(npy_dict("<u2", "(1,)"), le_array({1}, 2));
  v4[6] = 4;
  const std::string p = write("v4.npy", v4);
  expect_contains(error_of([&] { TokenSource::open({p}, "uint16", 256); }),
                  {"unsupported .npy version 4.0", p, "byte offset 6"});
  const std::string short_file = write("short.npy", {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0});
  expect_contains(error_of([&] { TokenSource::open({short_file}, "uint16", 256); }),
                  {"malformed .npy", short_file, "8 bytes"});
  Bytes long_header = npy_file(npy_dict("<u2", "(1,)"), le_array({1}, 2));
  long_header[8] = 0xff;
  long_header[9] = 0x7f;
  const std::string q = write("long_header.npy", long_header);
  expect_contains(error_of([&] { TokenSource::open({q}, "uint16", 256); }),
                  {"malformed .npy", q, "header length 32767", "byte offset 8"});
}

TEST_F(DataFiles, BadNpyHeaders) {
  const Bytes data = le_array({1, 2}, 2);
  struct Case {
    std::string dict;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"['descr', '<u2']", {"malformed .npy header", "byte offset 10", "expected '{'"}},
      {"{'descr': '<u2', 'shape': (2,), }", {"key 'fortran_order' missing"}},
      {npy_dict("<f4", "(2,)"), {"unsupported .npy dtype '<f4'"}},
      {npy_dict(">u2", "(2,)"), {"unsupported .npy dtype '>u2'"}},
      {npy_dict("<u2", "(2,)", "True"), {"fortran_order is True"}},
      {npy_dict("<u2", "(1, 2)"), {"shape (1, 2)", "1-D"}},
      {npy_dict("<u2", "()"), {"shape ()", "1-D"}},
      {"{'descr': '<u2', 'fortran_order': False, 'shape': (2,), 'extra': 1}",
       {"malformed .npy header", "a string, True, False or a tuple"}},
      {"{'descr': '<u2', 'fortran_order': False, 'shape': (2,), 'extra': 'x'}",
       {"expected exactly the keys descr, fortran_order, shape"}},
      {"{'descr': '<u2', 'descr': '<u2', 'fortran_order': False, 'shape': (2,)}", {"'descr' repeated"}},
      {"{'descr': '<u2', 'fortran_order': False, 'shape': (2,)} x", {"only padding after"}},
      {"{'descr': '<u2' 'fortran_order': False, 'shape': (2,)}", {"expected ',' or '}'"}},
      {"{'descr': [('a', '<u2')], 'fortran_order': False, 'shape': (2,)}", {"structured dtypes"}},
      {"{'descr': '<u2', 'fortran_order': False, 'shape': (x,)}", {"a non-negative integer"}},
  };
  int i = 0;
  for (const Case& c : cases) {
    const std::string p = write("bad" + std::to_string(i++) + ".npy", npy_file(c.dict, data));
    const std::string msg = error_of([&] { TokenSource::open({p}, "uint16", 256); });
    expect_contains(msg, {p});
    for (const std::string& e : c.expect) expect_contains(msg, {e});
  }
}

TEST_F(DataFiles, NpyDataShorterOrLongerThanShape) {
  const std::string p = write("short.npy", npy_file(npy_dict("<u2", "(10,)"), le_array({1, 2, 3, 4, 5, 6, 7, 8}, 2)));
  expect_contains(error_of([&] { TokenSource::open({p}, "uint32", 256); }),
                  {"truncated .npy", p, "shape (10,)", "byte offset 128", "ends at byte 144", "8 whole tokens"});
  const std::string q = write("long.npy", npy_file(npy_dict("<u4", "(2,)"), le_array({1, 2, 3}, 4)));
  expect_contains(error_of([&] { TokenSource::open({q}, "uint32", 256); }),
                  {"4 bytes after the data", q, "byte offset 136"});
}

TEST_F(DataFiles, TokenIdOutsideVocabulary) {
  const std::string a = write("a.npy", le_array({1, 2, 3, 4}, 2));
  const std::string b = write("b.npy", le_array({5, 6, 7, 300, 8}, 2));
  TokenSource s = TokenSource::open({a, b}, "uint16", 256);  // opening does not scan
  std::vector<int32_t> out(9);
  s.read(0, 7, out.data());  // the bad id is at stream offset 7: not read yet
  const std::string msg = error_of([&] { s.read(5, 4, out.data()); });
  expect_contains(msg, {"token id 300", "token offset 3 of '" + b + "'", "byte offset 6", "stream offset 7",
                        "[0, 256)"});
  expect_contains(error_of([&] { s.validate_all(); }), {"token offset 3 of '" + b + "'"});
  EXPECT_NO_THROW(TokenSource::open({a, b}, "uint16", 301).validate_all());

  const std::string neg = write("neg.npy", npy_file(npy_dict("<i4", "(3,)"), le_array({1, uint32_t(-5), 2}, 4)));
  expect_contains(error_of([&] { TokenSource::open({neg}, "uint16", 256).validate_all(); }),
                  {"token id -5", "token offset 1 of '" + neg + "'", "byte offset 132"});
  TokenSource mem = TokenSource::from_memory({0, 1, 2, 999}, "in-memory", 1000);
  EXPECT_EQ(read_all(mem), (std::vector<int32_t>{0, 1, 2, 999}));
  expect_contains(error_of([&] { TokenSource::from_memory({0, 1000}, "mem", 1000).validate_all(); }),
                  {"token id 1000", "token offset 1 of 'mem'"});
}

TEST_F(DataFiles, MissingFileEmptyListAndBadDtype) {
  const std::string missing = (dir_ / "nope.npy").string();
  expect_contains(error_of([&] { TokenSource::open({missing}, "uint16", 256); }),
                  {"cannot open token file '" + missing + "': No such file",
                   "nor is it the prefix of a Megatron dataset (no '" + missing + ".bin' or '" + missing + ".idx')"});
  expect_contains(error_of([&] { TokenSource::open({}, "uint16", 256); }), {"no token files"});
  const std::string p = write("a.npy", le_array({1}, 2));
  expect_contains(error_of([&] { TokenSource::open({p}, "int16", 256); }), {"token_dtype", "\"int16\""});
  expect_contains(error_of([&] { TokenSource::open({p}, "uint16", 0); }), {"vocab_size", "got 0"});
  expect_contains(error_of([&] { TokenSource::open({dir_.string()}, "uint16", 256); }),
                  {"not a regular file", dir_.string()});
}

std::vector<int32_t> as_int32(const std::vector<uint64_t>& ids) {
  std::vector<int32_t> out;
  for (uint64_t v : ids) out.push_back(static_cast<int32_t>(static_cast<int64_t>(v)));
  return out;
}

// llm.c shards are read after their 1024-byte header in the header's dtype, whatever token_dtype
// says, and concatenate with the other formats.
TEST_F(DataFiles, LlmcShardsOfEachDtypeAreRead) {
  const std::vector<uint64_t> gpt2_ids = {50256, 11, 12, 13, 65535, 50256};
  const std::vector<uint64_t> llama_ids = {128000, 9, 70000, 128001};
  const std::string gpt2 = write("gpt2_000001.bin", llmc_shard(gpt2_ids, false));
  const std::string llama = write("llama_000001.bin", llmc_shard(llama_ids, true));
  for (const char* dtype : {"uint16", "uint32"}) {
    const TokenSource a = TokenSource::open({gpt2}, dtype, 65536);
    EXPECT_EQ(a.file_format(0), "llm.c uint16");
    EXPECT_EQ(read_all(a), as_int32(gpt2_ids));
    const TokenSource b = TokenSource::open({llama}, dtype, 128256);
    EXPECT_EQ(b.file_format(0), "llm.c uint32");
    EXPECT_EQ(read_all(b), as_int32(llama_ids));
  }
  const std::string raw = write("raw.bin", le_array({7, 8}, 2));
  const std::string empty = write("empty.bin", llmc_shard({}, false));
  const TokenSource all = TokenSource::open({gpt2, empty, raw, llama}, "uint16", 128256);
  EXPECT_EQ(all.num_tokens(), 12);
  EXPECT_EQ(read_all(all), (std::vector<int32_t>{50256, 11, 12, 13, 65535, 50256, 7, 8, 128000, 9, 70000, 128001}));
  // A bad id is located in the shard after its header.
  expect_contains(error_of([&] { read_all(TokenSource::open({llama}, "uint32", 100000)); }),
                  {"token id 128000 at token offset 0 of '" + llama + "' (byte offset 1024"});
}

TEST_F(DataFiles, LlmcBadHeadersAreRefused) {
  const std::string cut = write("cut.bin", llmc_file(20240520, 1, 10, le_array({1, 2, 3}, 2)));
  expect_contains(error_of([&] { TokenSource::open({cut}, "uint16", 256); }),
                  {"truncated llm.c token shard '" + cut + "'", "token count 10 (byte offset 8) of uint16",
                   "1024 + 10 x 2 = 1044 bytes, but the file has 1030"});
  const std::string longer = write("long.bin", llmc_file(20240801, 7, 1, le_array({1, 2}, 4)));
  expect_contains(error_of([&] { TokenSource::open({longer}, "uint16", 256); }),
                  {"malformed llm.c token shard '" + longer + "'", "1024 + 1 x 4 = 1028 bytes, but the file has 1032",
                   "bytes after the last token"});
  const std::string v2 = write("v2.bin", llmc_file(20240520, 2, 1, le_array({1}, 2)));
  expect_contains(error_of([&] { TokenSource::open({v2}, "uint16", 256); }),
                  {"unsupported llm.c token shard '" + v2 + "': version 2 (byte offset 4) with magic 20240520",
                   "llm.c writes version 1 (GPT-2, uint16 tokens)"});
  const std::string v1 = write("v1.bin", llmc_file(20240801, 1, 1, le_array({1}, 4)));
  expect_contains(error_of([&] { TokenSource::open({v1}, "uint16", 256); }),
                  {"version 1 (byte offset 4) with magic 20240801", "llm.c writes version 7 (Llama 3, uint32 tokens)"});
  Bytes head = llmc_file(20240520, 1, 0, {});
  head.resize(100);
  const std::string short_header = write("short.bin", head);
  expect_contains(error_of([&] { TokenSource::open({short_header}, "uint16", 256); }),
                  {"truncated llm.c token shard '" + short_header + "'", "100 bytes, less than the 1024-byte header"});
  const std::string hella = write("hellaswag_val.bin", llmc_file(20240522, 1, 2, le_array({65535, 40, 0}, 2)));
  expect_contains(error_of([&] { TokenSource::open({hella}, "uint16", 65536); }),
                  {"'" + hella + "' is an llm.c multiple-choice eval file", "magic 20240522", "not a token stream"});
  // A headerless file that starts with other ids is read as headerless.
  const std::string near = write("near.bin", le_array({55432, 309, 1, 0}, 2));  // magic's low half, not its high
  EXPECT_EQ(TokenSource::open({near}, "uint16", 65536).file_format(0), "raw uint16");
}

// Three documents (one of two sequences, one empty, one with an empty sequence) by prefix, by
// .bin and by .idx, in every integer dtype; the tokens are the sequences in order.
TEST_F(DataFiles, MegatronDatasetReadByPrefixBinOrIdx) {
  const std::vector<std::vector<std::vector<uint64_t>>> docs = {
      {{5, 6, 7, 0}, {8, 9, 0}}, {}, {{}, {1, 2, 3, 4, 0}}};
  const std::vector<int32_t> want = {5, 6, 7, 0, 8, 9, 0, 1, 2, 3, 4, 0};
  const std::vector<std::pair<int, std::string>> dtypes = {{1, "uint8"}, {2, "int8"},  {3, "int16"},
                                                           {4, "int32"}, {5, "int64"}, {8, "uint16"}};
  for (const auto& [code, name] : dtypes) {
    const std::string prefix = write_megatron((dir_ / ("corpus_" + name + "_text_document")).string(), docs, code);
    for (const std::string& path : {prefix, prefix + ".bin", prefix + ".idx"}) {
      const TokenSource s = TokenSource::open({path}, "uint32", 256);
      EXPECT_EQ(s.file_format(0), "megatron " + name) << path;
      EXPECT_EQ(s.file_name(0), prefix + ".bin");
      EXPECT_EQ(read_all(s), want) << path;
    }
  }
  // Mixed with a headerless file and a wider dtype; a bad id is named in the .bin.
  const std::string wide = write_megatron((dir_ / "wide").string(), {{{70000, 1}}, {{2, 3}}}, 4);
  const std::string raw = write("raw.bin", le_array({10, 11, 12}, 2));  // no raw.idx: headerless
  const TokenSource s = TokenSource::open({raw, wide, dir_.string() + "/corpus_uint16_text_document"}, "uint16", 70001);
  EXPECT_EQ(s.file_format(0), "raw uint16");
  EXPECT_EQ(s.num_tokens(), 3 + 4 + 12);
  std::vector<int32_t> all = {10, 11, 12, 70000, 1, 2, 3};
  all.insert(all.end(), want.begin(), want.end());
  EXPECT_EQ(read_all(s), all);
  expect_contains(error_of([&] { read_all(TokenSource::open({wide}, "uint16", 256)); }),
                  {"token id 70000 at token offset 0 of '" + wide + ".bin' (byte offset 0"});
  const std::string neg = write_megatron((dir_ / "neg").string(), {{{1, static_cast<uint64_t>(-3)}}}, 2);
  expect_contains(error_of([&] { read_all(TokenSource::open({neg}, "uint16", 256)); }),
                  {"token id -3 at token offset 1 of '" + neg + ".bin'"});
  // An empty dataset: no sequences, one document index.
  const std::string none = write_megatron((dir_ / "none").string(), {}, 8);
  EXPECT_EQ(TokenSource::open({none}, "uint16", 256).num_tokens(), 0);
}

TEST_F(DataFiles, MegatronBadIndexOrDataIsRefused) {
  const std::vector<std::vector<std::vector<uint64_t>>> docs = {{{5, 6, 7}, {8}}, {{9, 10}}};
  const Bytes idx = megatron_idx(docs, 8), bin = megatron_bin(docs, 8);
  // Writes PREFIX.idx and PREFIX.bin as given; returns the prefix.
  const auto dataset = [&](const std::string& name, const Bytes& i, const Bytes& b) {
    const std::string prefix = (dir_ / name).string();
    write_bytes(prefix + ".idx", i);
    write_bytes(prefix + ".bin", b);
    return prefix;
  };
  const auto refused = [&](const std::string& prefix) {
    return error_of([&] { TokenSource::open({prefix}, "uint16", 256); });
  };
  ASSERT_EQ(read_all(TokenSource::open({dataset("good", idx, bin)}, "uint16", 256)),
            (std::vector<int32_t>{5, 6, 7, 8, 9, 10}));

  Bytes magic = idx;
  magic[7] = 'Y';
  std::string p = dataset("magic", magic, bin);
  expect_contains(refused(p), {"bad magic in Megatron index '" + p + ".idx' (byte offset 0)",
                               "expected \"MMIDIDX\\x00\\x00\", got \"MMIDIDXY\\x00\""});
  p = dataset("version", megatron_idx(docs, 8, 2), bin);
  expect_contains(refused(p), {"unsupported Megatron index '" + p + ".idx': version 2 (byte offset 9)"});
  for (const auto& [code, name] : std::vector<std::pair<int, std::string>>{{6, "float64"}, {7, "float32"}}) {
    p = dataset("float" + name, megatron_idx(docs, code), megatron_bin(docs, code));
    expect_contains(refused(p), {"Megatron index '" + p + ".idx' has dtype code " + std::to_string(code) + " (" +
                                     name + ") at byte offset 17",
                                 "token ids need an integer dtype"});
  }
  Bytes unknown = idx;
  unknown[17] = 9;
  p = dataset("unknown", unknown, bin);
  expect_contains(refused(p), {"unknown dtype code 9 (byte offset 17) in Megatron index '" + p + ".idx'"});
  p = dataset("short_header", Bytes(idx.begin(), idx.begin() + 20), bin);
  expect_contains(refused(p), {"truncated Megatron index '" + p + ".idx': 20 bytes", "needs 34"});
  p = dataset("cut_idx", Bytes(idx.begin(), idx.end() - 8), bin);
  expect_contains(refused(p), {"size mismatch in Megatron index '" + p + ".idx'",
                               "sequence count 3 (byte offset 18) and document count 3 (byte offset 26)",
                               "= 94 bytes, but the file has 86"});
  Bytes modes = idx;
  modes.insert(modes.end(), {0, 0, 0});
  p = dataset("multimodal", modes, bin);
  expect_contains(refused(p), {"Megatron index '" + p + ".idx' has 3 bytes after its document indices",
                               "multimodal"});
  p = dataset("cut_bin", idx, Bytes(bin.begin(), bin.end() - 1));
  expect_contains(refused(p), {"truncated Megatron data '" + p + ".bin': 11 bytes, but sequence 2 of '" + p + ".idx'",
                               "sequence_lengths[2] = 2 uint16 tokens at byte 8) ends at byte 12"});
  Bytes longer = bin;
  longer.insert(longer.end(), {1, 0});
  p = dataset("long_bin", idx, longer);
  expect_contains(refused(p), {"Megatron data '" + p + ".bin' has 14 bytes", "sum to 6 uint16 tokens = 12 bytes"});
  // Fields of the arrays: lengths at 34, pointers at 34 + 4N, document indices at 34 + 12N (N = 3).
  const auto with_field = [&](int64_t at, uint64_t v, int width) {
    Bytes b = idx;
    for (int i = 0; i < width; ++i) b[at + i] = static_cast<uint8_t>(v >> (8 * i));
    return b;
  };
  p = dataset("neg_len", with_field(34 + 4, static_cast<uint32_t>(-1), 4), bin);
  expect_contains(refused(p), {"'" + p + ".idx': sequence_lengths[1] = -1 (byte offset 38) is negative"});
  p = dataset("gap", with_field(46 + 16, 10, 8), bin);
  expect_contains(refused(p), {"'" + p + ".idx': sequence_pointers[2] = 10 (byte offset 62), but sequence 2 starts "
                               "at byte 8 of '" + p + ".bin'"});
  p = dataset("doc0", with_field(70, 1, 8), bin);
  expect_contains(refused(p), {"'" + p + ".idx': document_indices[0] = 1 (byte offset 70), expected 0"});
  p = dataset("doc_down", with_field(78, 4, 8), bin);
  expect_contains(refused(p), {"document_indices[1] = 4 (byte offset 78) is outside [0, 3]"});
  p = dataset("doc_last", with_field(86, 2, 8), bin);
  expect_contains(refused(p), {"the last document index, document_indices[2] = 2 (byte offset 86), is not the "
                               "sequence count 3"});
  // One half of the pair missing; an index under another name.
  const std::string lone = (dir_ / "lone").string();
  write_bytes(lone + ".idx", idx);
  expect_contains(error_of([&] { TokenSource::open({lone}, "uint16", 256); }),
                  {"Megatron dataset '" + lone + "': '" + lone + ".bin' not found"});
  expect_contains(error_of([&] { TokenSource::open({lone + ".idx"}, "uint16", 256); }), {"'" + lone + ".bin' not found"});
  const std::string renamed = write("index.data", idx);
  expect_contains(error_of([&] { TokenSource::open({renamed}, "uint16", 256); }),
                  {"token file '" + renamed + "' is a Megatron index"});
}

// A FIFO given as a token file is refused at once, naming it; opening it for reading without
// O_NONBLOCK would wait for a writer. A helper opens the write end after 3 s, so a reader that
// does wait returns late (and the test fails) instead of hanging.
TEST_F(DataFiles, FifoAndDirectoryAreRefusedAtOnce) {
  const std::string fifo = (dir_ / "pipe.bin").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::atomic<bool> returned{false};
  std::thread unblock([&] {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    while (!returned && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);  // fails with ENXIO if no reader waits
    if (fd >= 0) ::close(fd);
  });
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg = error_of([&] { TokenSource::open({fifo}, "uint16", 256); });
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  returned = true;
  unblock.join();
  expect_contains(msg, {"token file '" + fifo + "' is a FIFO (named pipe), not a regular file"});
  EXPECT_LT(waited, 2.0) << "opening the FIFO waited for a writer";
  expect_contains(error_of([&] { TokenSource::open({dir_.string()}, "uint16", 256); }),
                  {"token file '" + dir_.string() + "' is a directory, not a regular file"});
}

// ------------------------------------------------------------------------------ ordering

// Stream whose token at offset t is t: instance i starts with token i * (seq_len + 1).
TokenSource counting_source(int64_t num_tokens) {
  std::vector<uint32_t> t(static_cast<size_t>(num_tokens));
  for (int64_t i = 0; i < num_tokens; ++i) t[i] = static_cast<uint32_t>(i);
  return TokenSource::from_memory(std::move(t), "counting", num_tokens);
}

// Instance ids of every row of `b`, checking inputs/targets are one instance shifted by one.
std::vector<int64_t> instances_of(const Batch& b) {
  std::vector<int64_t> ids;
  const int64_t l = b.seq_len;
  for (int64_t s = 0; s < b.num_sequences(); ++s) {
    const int32_t first = b.inputs[s * l];
    EXPECT_EQ(first % (l + 1), 0);
    for (int64_t j = 0; j < l; ++j) {
      EXPECT_EQ(b.inputs[s * l + j], first + j);
      EXPECT_EQ(b.targets[s * l + j], first + j + 1);
    }
    ids.push_back(first / (l + 1));
  }
  return ids;
}

std::vector<int64_t> instances_of(const std::vector<Batch>& micro) {
  std::vector<int64_t> ids;
  for (const Batch& b : micro) {
    const auto more = instances_of(b);
    ids.insert(ids.end(), more.begin(), more.end());
  }
  return ids;
}

TEST(DataLoader, InstancesAndEvalBatches) {
  const int64_t l = 6;
  DataLoader dl(counting_source(10 * (l + 1) + 5), l, 2, 1, 7, 0, 1);
  EXPECT_EQ(dl.num_instances(), 10);  // the 5 remainder tokens are dropped
  EXPECT_EQ(dl.batches_per_epoch(), 5);
  EXPECT_EQ(dl.num_eval_batches(3), 3);
  const Batch e = dl.eval_batch(2, 3);
  EXPECT_EQ(e.batch, 2);
  EXPECT_EQ(e.seq_len, l);
  EXPECT_EQ(instances_of(e), (std::vector<int64_t>{6, 7, 8}));
  expect_contains(error_of([&] { dl.eval_batch(3, 3); }), {"eval batch 3", "3 eval batches"});
}

TEST(DataLoader, PermutationIsPortableAndDeterministic) {
  // Pinned order (also reproduced by an independent Python mt19937_64 + Fisher-Yates): a
  // change here changes every run's data order and breaks resumption.
  EXPECT_EQ(instance_permutation(10, 1234, 0), (std::vector<int64_t>{8, 1, 3, 7, 2, 6, 5, 0, 4, 9}));
  EXPECT_EQ(instance_permutation(10, 1234, 1), (std::vector<int64_t>{0, 9, 7, 6, 3, 5, 1, 4, 2, 8}));
  for (int64_t n : {0, 1, 2, 17, 1000}) {
    auto p = instance_permutation(n, 5, 3);
    EXPECT_EQ(p, instance_permutation(n, 5, 3));
    std::sort(p.begin(), p.end());
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(p[i], i);
  }
  EXPECT_NE(instance_permutation(1000, 5, 0), instance_permutation(1000, 6, 0));
  EXPECT_NE(instance_permutation(1000, 5, 0), instance_permutation(1000, 5, 1));
  std::mt19937_64 rng(1);
  std::vector<int> hits(7, 0);
  for (int i = 0; i < 7000; ++i) {
    const uint64_t v = uniform_below(rng, 7);
    ASSERT_LT(v, 7u);
    ++hits[v];
  }
  for (int h : hits) EXPECT_GT(h, 800);
  EXPECT_EQ(uniform_below(rng, 1), 0u);
}

TEST(DataLoader, OrderDependsOnSeedAndEpoch) {
  const int64_t l = 3, g = 4;
  auto run = [&](uint64_t seed, int64_t batches) {
    DataLoader dl(counting_source(41 * (l + 1)), l, g, 2, seed, 0, 1);
    std::vector<std::vector<int64_t>> out;
    for (int64_t b = 0; b < batches; ++b) {
      const auto micro = dl.next();
      EXPECT_EQ(micro.size(), 2u);
      for (const Batch& m : micro) EXPECT_EQ(m.batch, b);
      out.push_back(instances_of(micro));
    }
    return out;
  };
  const int64_t per_epoch = 41 / g;  // 10 batches; one instance per epoch unused
  const auto a = run(11, 3 * per_epoch), b = run(11, 3 * per_epoch), c = run(12, 3 * per_epoch);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  std::vector<std::set<int64_t>> seen(3);
  std::vector<std::vector<int64_t>> order(3);
  for (int64_t i = 0; i < 3 * per_epoch; ++i) {
    for (int64_t id : a[i]) {
      EXPECT_TRUE(seen[i / per_epoch].insert(id).second) << "instance " << id << " repeated in epoch";
      order[i / per_epoch].push_back(id);
      EXPECT_GE(id, 0);
      EXPECT_LT(id, 41);
    }
  }
  for (int e = 0; e < 3; ++e) EXPECT_EQ(seen[e].size(), static_cast<size_t>(per_epoch * g));
  EXPECT_NE(order[0], order[1]);
  EXPECT_NE(order[1], order[2]);
  // Batches follow the epoch permutation exactly.
  const auto perm1 = instance_permutation(41, 11, 1);
  EXPECT_EQ(order[1], std::vector<int64_t>(perm1.begin(), perm1.begin() + per_epoch * g));
}

TEST(DataLoader, RankSlicesAndMicroBatchesTileTheGlobalBatch) {
  const int64_t l = 5, g = 8, n = 3 * g + 5;
  const TokenSource src = counting_source(n * (l + 1));
  DataLoader whole(src, l, g, g, 99, 0, 1);
  for (int64_t b = 0; b < 7; ++b) {  // crosses two epoch boundaries (3 batches per epoch)
    const auto full = whole.next();
    ASSERT_EQ(full.size(), 1u);
    const auto want = instances_of(full);
    ASSERT_EQ(want.size(), static_cast<size_t>(g));
    for (int64_t dp : {1, 2, 4}) {
      for (int64_t micro : {int64_t{1}, g / dp}) {
        std::vector<int64_t> got;
        for (int64_t r = 0; r < dp; ++r) {
          DataLoader rank(src, l, g, micro, 99, r, dp);
          rank.set_position(b);
          const auto mb = rank.next();
          EXPECT_EQ(static_cast<int64_t>(mb.size()), g / dp / micro);
          EXPECT_EQ(rank.micro_steps_per_batch(), g / dp / micro);
          EXPECT_EQ(rank.position(), b + 1);
          for (const Batch& m : mb) EXPECT_EQ(m.num_sequences(), micro);
          const auto ids = instances_of(mb);
          EXPECT_EQ(std::vector<int64_t>(want.begin() + r * g / dp, want.begin() + (r + 1) * g / dp), ids)
              << "dp " << dp << " rank " << r << " micro " << micro << " batch " << b;
          got.insert(got.end(), ids.begin(), ids.end());
        }
        EXPECT_EQ(got, want) << "dp " << dp << " micro " << micro << " batch " << b;
      }
    }
  }
}

TEST(DataLoader, SetPositionResumes) {
  const int64_t l = 4;
  const TokenSource src = counting_source(23 * (l + 1));
  for (int64_t dp : {1, 2}) {
    for (int64_t pos : {0, 1, 4, 5, 6, 13}) {  // 5 batches of 4 per epoch
      DataLoader fresh(src, l, 4, 1, 3, dp - 1, dp);
      std::vector<Batch> last;
      for (int64_t i = 0; i <= pos; ++i) last = fresh.next();
      DataLoader resumed(src, l, 4, 1, 3, dp - 1, dp);
      resumed.set_position(pos);
      EXPECT_EQ(resumed.epoch(), pos / 5);
      const auto got = resumed.next();
      ASSERT_EQ(got.size(), last.size());
      for (size_t m = 0; m < got.size(); ++m) {
        EXPECT_EQ(got[m].batch, pos);
        EXPECT_EQ(got[m].inputs, last[m].inputs);
        EXPECT_EQ(got[m].targets, last[m].targets);
      }
      EXPECT_EQ(resumed.position(), fresh.position());
    }
  }
  DataLoader dl(src, l, 4, 1, 3, 0, 1);
  expect_contains(error_of([&] { dl.set_position(-1); }), {"got -1"});
}

TEST(DataLoader, RejectsBadShapes) {
  const TokenSource src = counting_source(100 * 9);
  expect_contains(error_of([&] { DataLoader(src, 8, 10, 1, 0, 0, 4); }), {"10 % 4 = 2"});
  expect_contains(error_of([&] { DataLoader(src, 8, 12, 4, 0, 0, 2); }), {"12 / 2 = 6", "6 % 4 = 2"});
  expect_contains(error_of([&] { DataLoader(src, 8, 8, 1, 0, 2, 2); }), {"dp_rank 2", "dp_size 2"});
  expect_contains(error_of([&] { DataLoader(counting_source(60), 8, 8, 1, 0, 0, 1); }),
                  {"60 tokens", "6 instances", "8 x 9 = 72 tokens"});
  expect_contains(error_of([&] { DataLoader(src, 0, 8, 1, 0, 0, 1); }), {"seq_len", "got 0"});
}

// ------------------------------------------------------------------------ embedded corpus

std::vector<std::string> split_documents(const std::vector<uint32_t>& tokens) {
  std::vector<std::string> docs(1);
  for (uint32_t t : tokens) {
    if (t == kEmbeddedEosId) {
      docs.emplace_back();
    } else {
      docs.back() += static_cast<char>(t);
    }
  }
  return docs;
}

TEST(EmbeddedCorpus, DeterministicAndSplitsDiffer) {
  const auto a = embedded_corpus("train", 50000);
  EXPECT_EQ(a.size(), 50000u);
  EXPECT_EQ(a, embedded_corpus("train", 50000));
  const auto e = embedded_corpus("eval", 50000);
  EXPECT_NE(a, e);
  EXPECT_NE(a, embedded_corpus("train", 50000, 1));
  const auto shorter = embedded_corpus("train", 1234);
  EXPECT_TRUE(std::equal(shorter.begin(), shorter.end(), a.begin()));
  EXPECT_TRUE(embedded_corpus("eval", 0).empty());
  // No document text is shared between the splits.
  const auto train_docs = split_documents(a), eval_docs = split_documents(e);
  const std::set<std::string> train_set(train_docs.begin(), train_docs.end() - 1);
  for (size_t i = 0; i + 1 < eval_docs.size(); ++i) EXPECT_FALSE(train_set.count(eval_docs[i]));
  expect_contains(error_of([&] { embedded_corpus("test", 10); }), {"\"test\""});
}

TEST(EmbeddedCorpus, BytesDocumentsAndEos) {
  const auto tokens = embedded_corpus("train", 200000);
  for (uint32_t t : tokens) {
    ASSERT_LT(t, static_cast<uint32_t>(kEmbeddedVocabSize));
    ASSERT_TRUE(t == 0 || t == '\n' || (t >= 32 && t <= 126)) << t;
  }
  const auto docs = split_documents(tokens);
  ASSERT_GT(docs.size(), 50u);
  for (size_t i = 0; i + 1 < docs.size(); ++i) {  // the last one is cut at num_tokens
    ASSERT_EQ(docs[i], embedded_document("train", static_cast<int64_t>(i))) << i;
    EXPECT_GT(docs[i].size(), 100u);
    EXPECT_EQ(docs[i].substr(docs[i].size() - 8), "The end.");
  }
  EXPECT_EQ(docs.back(), embedded_document("train", static_cast<int64_t>(docs.size() - 1)).substr(0, docs.back().size()));
}

TEST(EmbeddedCorpus, RecallAndListsMatchTheirDefinitions) {
  const std::regex define(R"(The (code|number|price) of (\w+) is (\d+)\.)");
  const std::regex recall(R"((?:Remember, the|What is the) (code|number|price) of (\w+)(?: is |\? It is )(\d+)\.)");
  const std::regex packs(R"((\w+) packs ([a-z ,]+)\.)");
  const std::regex unpacks(R"((\w+) unpacks ([a-z ,]+)\.)");
  const std::regex sum(R"((\d+) \+ (\d+) = (\d+)\.)");
  int recalls = 0, lists = 0, sums = 0;
  for (int64_t d = 0; d < 200; ++d) {
    const std::string doc = embedded_document("eval", d, 3);
    std::map<std::string, std::string> values;
    for (std::sregex_iterator it(doc.begin(), doc.end(), define), end; it != end; ++it) {
      const std::string key = (*it)[1].str() + " " + (*it)[2].str();
      EXPECT_FALSE(values.count(key)) << key << " defined twice in: " << doc;
      values[key] = (*it)[3];
    }
    ASSERT_FALSE(values.empty()) << doc;
    for (std::sregex_iterator it(doc.begin(), doc.end(), recall), end; it != end; ++it, ++recalls)
      EXPECT_EQ(values[(*it)[1].str() + " " + (*it)[2].str()], (*it)[3].str()) << doc;
    std::smatch first;
    ASSERT_TRUE(std::regex_search(doc, first, packs)) << doc;
    const std::string name = first[1];
    EXPECT_TRUE(doc.rfind("This is a story about " + name + ".", 0) == 0 ||
                doc.rfind(name + " lives in the ", 0) == 0)
        << doc;
    for (std::sregex_iterator it(doc.begin(), doc.end(), unpacks), end; it != end; ++it, ++lists) {
      EXPECT_EQ((*it)[1].str(), first[1].str()) << doc;
      EXPECT_EQ((*it)[2].str(), first[2].str()) << doc;
    }
    for (std::sregex_iterator it(doc.begin(), doc.end(), sum), end; it != end; ++it, ++sums)
      EXPECT_EQ(std::stoi((*it)[1]) + std::stoi((*it)[2]), std::stoi((*it)[3]));
  }
  EXPECT_GE(recalls, 200);
  EXPECT_GE(lists, 200);
  EXPECT_GT(sums, 20);
}

// ------------------------------------------------------------------------------ tokenizer

TEST_F(DataFiles, TokenizerRoundTrip) {
  std::string t1 = "Hello, world.\nSecond line\t\x01\xff";
  std::string t2;
  for (int c = 1; c < 256; ++c) t2 += static_cast<char>(c);
  const std::string a = write_text("a.txt", t1), b = write_text("b.txt", t2), empty = write_text("e.txt", "");
  const std::string out16 = (dir_ / "out16.bin").string();
  tokenize_text_files({a, empty, b}, out16, "uint16", 0);
  EXPECT_EQ(listing(), (std::set<std::string>{"a.txt", "b.txt", "e.txt", "out16.bin"}));  // no temporary left
  EXPECT_EQ(static_cast<int64_t>(fs::file_size(out16)), 2 * static_cast<int64_t>(t1.size() + t2.size() + 3));
  std::vector<int32_t> want;
  for (const std::string& t : {t1, std::string(), t2}) {
    for (char c : t) want.push_back(static_cast<uint8_t>(c));
    want.push_back(0);
  }
  EXPECT_EQ(read_all(TokenSource::open({out16}, "uint16", 256)), want);

  // uint32 output with an EOS outside the byte range: byte 0 is allowed in the text.
  const std::string z = write_text("z.txt", std::string("a\0b", 3));
  const std::string out32 = (dir_ / "out32.bin").string();
  tokenize_text_files({z, a}, out32, "uint32", 70000);
  std::vector<int32_t> want32 = {'a', 0, 'b', 70000};
  for (char c : t1) want32.push_back(static_cast<uint8_t>(c));
  want32.push_back(70000);
  EXPECT_EQ(read_all(TokenSource::open({out32}, "uint32", 70001)), want32);
}

TEST_F(DataFiles, TokenizerRefusesEosBytesAndBadArguments) {
  const std::string p = write_text("eos.txt", std::string("abc\ndef", 7));
  const std::string out = (dir_ / "out.bin").string();
  const std::set<std::string> before = listing();
  expect_contains(error_of([&] { tokenize_text_files({p}, out, "uint16", '\n'); }),
                  {p, "byte 10", "byte offset 3"});
  EXPECT_EQ(listing(), before);  // neither the output nor the temporary
  const std::string missing = (dir_ / "missing.txt").string();
  expect_contains(error_of([&] { tokenize_text_files({missing}, out, "uint16", 0); }), {missing});
  EXPECT_EQ(listing(), before);
  expect_contains(error_of([&] { tokenize_text_files({p}, out, "uint16", 70000); }), {"eos_id", "70000"});
  expect_contains(error_of([&] { tokenize_text_files({}, out, "uint16", 0); }), {"no input"});
  expect_contains(error_of([&] { tokenize_text_files({p}, out, "u8", 0); }), {"\"u8\""});
  expect_contains(error_of([&] { tokenize_text_files({p}, "", "uint16", 0); }), {"no output"});
  expect_contains(error_of([&] { tokenize_text_files({dir_.string()}, out, "uint16", 0); }),
                  {"input '" + dir_.string() + "' is a directory"});
  expect_contains(error_of([&] { tokenize_text_files({p}, dir_.string(), "uint16", 0); }),
                  {"output '" + dir_.string() + "' exists and is not a regular file (a directory)"});
  expect_contains(error_of([&] { tokenize_text_files({p}, (dir_ / "no_dir" / "out.bin").string(), "uint16", 0); }),
                  {"cannot create the temporary file", "no_dir", "No such file or directory"});
  EXPECT_EQ(listing(), before);
}

// An output that is one of the inputs (by name, another spelling, a hard link or a symlink) is
// refused naming both, and the input is left as it was; the old code replaced it with its tokens.
TEST_F(DataFiles, TokenizerRefusesAnOutputThatIsAnInput) {
  const std::string text = "some text\n";
  const std::string a = write_text("a.txt", text), b = write_text("b.txt", "other\n");
  const std::string respelled = (dir_ / "." / "a.txt").string();
  const std::string hard = (dir_ / "hard.txt").string(), soft = (dir_ / "soft.txt").string();
  fs::create_hard_link(a, hard);
  fs::create_symlink(a, soft);
  const std::set<std::string> before = listing();
  for (const std::string& out : {a, respelled, hard, soft}) {
    expect_contains(error_of([&] { tokenize_text_files({b, a}, out, "uint16", 0); }),
                    {"output '" + out + "' is the input '" + a + "'", "choose another --out"});
    EXPECT_EQ(listing(), before) << out;
  }
  std::ifstream f(a, std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(f), {}), text);
  // A distinct existing output is replaced.
  const std::string out = write_text("out.bin", "old");
  tokenize_text_files({a}, out, "uint16", 0);
  EXPECT_EQ(static_cast<int64_t>(fs::file_size(out)), 2 * static_cast<int64_t>(text.size() + 1));
}

// The tokens go to a new temporary file in the output's directory while the output keeps its old
// content (observed mid-write through an input FIFO the test feeds), then take the output's name.
// An error leaves the old output as it was; a file already named <output>.tmp is never touched.
TEST_F(DataFiles, TokenizerWritesATemporaryBesideTheOutputThenRenames) {
  const std::string out = write_text("out.bin", "old output");
  const std::string user_tmp = write_text("out.bin.tmp", "a file of the user's");
  const std::string fifo = (dir_ / "input.fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::string error;
  std::thread worker([&] {
    try {
      tokenize_text_files({fifo}, out, "uint16", 0);
    } catch (const moe::Error& e) {
      error = e.what();
    }
  });
  {
    std::ofstream feed(fifo, std::ios::binary);  // opens once the tokenizer reads the FIFO
    feed << "ab" << std::flush;
    std::set<std::string> temporaries;
    for (const std::string& name : listing())
      if (name.rfind("out.bin.tmp.", 0) == 0) temporaries.insert(name);
    EXPECT_EQ(temporaries.size(), 1u) << "expected one new temporary beside the output";
    std::ifstream old(out, std::ios::binary);
    EXPECT_EQ(std::string(std::istreambuf_iterator<char>(old), {}), "old output");
  }  // closing the FIFO ends the input
  worker.join();
  EXPECT_EQ(error, "");
  EXPECT_EQ(read_all(TokenSource::open({out}, "uint16", 256)), (std::vector<int32_t>{'a', 'b', 0}));
  EXPECT_EQ(listing(), (std::set<std::string>{"input.fifo", "out.bin", "out.bin.tmp"}));
  std::ifstream kept(user_tmp, std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(kept), {}), "a file of the user's");

  // An error in the second input: the output keeps its last complete content, no temporary stays.
  const std::string good = write_text("good.txt", "xyz"), bad = write_text("bad.txt", std::string("q\0", 2));
  const std::set<std::string> before = listing();
  expect_contains(error_of([&] { tokenize_text_files({good, bad}, out, "uint16", 0); }), {bad, "byte offset 1"});
  EXPECT_EQ(listing(), before);
  EXPECT_EQ(read_all(TokenSource::open({out}, "uint16", 256)), (std::vector<int32_t>{'a', 'b', 0}));
}

}  // namespace
}  // namespace moe::testing
