// `moecore data prepare` without Python: a hand-written byte-level tokenizer.json (ids 0..255 are
// the bytes, one merge "a"+"b" = 256, <|endoftext|> = 300), so every expected id is known. The
// .npy files open as token files and train; --jobs 1 and 3 give the same bytes over inputs of
// several batches; bad inputs are refused naming the file, the line and the key, leaving nothing
// in the output folder; SIGINT stops with status 130 and leaves nothing. The comparison with the
// Python library is tests/data/prepare_check.py (CTest entry data.prepare).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/token_file.h"
#include "e2e/cli_util.h"
#include "support/test_util.h"

#if MOECORE_HAS_TOKENIZER
#include "data/tokenizer.h"
#endif

namespace moe::testing {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace std::chrono_literals;

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary);
  f << text;
}

std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> out;
  if (!fs::exists(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

#if MOECORE_HAS_TOKENIZER

// Ids 0..255: the bytes; 256: "ab"; 300: <|endoftext|> (special). `eos = false` leaves it out.
std::string tokenizer_json(bool eos = true) {
  json vocab = json::object();
  const auto& alphabet = byte_level_alphabet();
  for (int b = 0; b < 256; ++b) vocab[alphabet[b]] = b;
  vocab["ab"] = 256;
  json added = json::array();
  if (eos)
    added.push_back({{"id", 300}, {"content", "<|endoftext|>"}, {"special", true}, {"normalized", false},
                     {"lstrip", false}, {"rstrip", false}, {"single_word", false}});
  return json{{"version", "1.0"},
              {"added_tokens", added},
              {"normalizer", nullptr},
              {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
              {"post_processor", nullptr},
              {"decoder", {{"type", "ByteLevel"}}},
              {"model",
               {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"vocab", vocab},
                {"merges", json::array({json::array({"a", "b"})})}}}}
      .dump();
}

// The ids this tokenizer gives: bytes, with every "ab" inside a word as 256.
std::vector<uint32_t> ids_of(const std::string& text) {
  std::vector<uint32_t> ids;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == 'a' && i + 1 < text.size() && text[i + 1] == 'b') {
      ids.push_back(256);
      ++i;
    } else {
      ids.push_back(static_cast<unsigned char>(text[i]));
    }
  }
  return ids;
}

std::vector<uint32_t> read_all(const fs::path& p, int64_t vocab = 301) {
  const TokenSource s = TokenSource::open({p.string()}, "uint16", vocab);
  std::vector<int32_t> buf(static_cast<size_t>(s.num_tokens()));
  if (!buf.empty()) s.read(0, s.num_tokens(), buf.data());
  EXPECT_EQ(s.file_format(0), "npy <u2");
  return std::vector<uint32_t>(buf.begin(), buf.end());
}

void write_gz(const fs::path& p, const std::string& text) {
  gzFile g = gzopen(p.c_str(), "wb");
  ASSERT_NE(g, nullptr);
  ASSERT_EQ(gzwrite(g, text.data(), static_cast<unsigned>(text.size())), static_cast<int>(text.size()));
  gzclose(g);
}

TEST(DataPrepare, WritesTheTokensOfEveryDocumentAndTheyTrain) {
  const TempDir tmp("prepare");
  write_text(tmp / "tok.json", tokenizer_json());
  const std::vector<std::string> docs = {"abc ab", "xyz\nnew line", "", "café ab ab"};
  std::string jsonl;
  for (const std::string& d : docs) jsonl += json{{"text", d}, {"n", 1}}.dump() + "\n\n";
  write_text(tmp / "one.jsonl", jsonl);
  write_gz(tmp / "two.jsonl.gz", jsonl);
  write_text(tmp / "three.txt", "whole file\nis one document ab");
  const CmdResult r = run_cli("data prepare --tokenizer " + tmp.sub("tok.json") + " --out " + tmp.sub("out") + " " +
                              tmp.sub("one.jsonl") + " " + tmp.sub("two.jsonl.gz") + " " + tmp.sub("three.txt"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("9 documents"), std::string::npos) << r.output;
  std::vector<uint32_t> want;
  for (const std::string& d : docs) {
    const auto ids = ids_of(d);
    want.insert(want.end(), ids.begin(), ids.end());
    want.push_back(300);
  }
  EXPECT_EQ(read_all(tmp / "out" / "one.npy"), want);
  EXPECT_EQ(read_all(tmp / "out" / "two.npy"), want);
  std::vector<uint32_t> whole = ids_of("whole file\nis one document ab");
  whole.push_back(300);
  EXPECT_EQ(read_all(tmp / "out" / "three.npy"), whole);
  EXPECT_EQ(names_in(tmp / "out"), (std::vector<std::string>{"one.npy", "summary.json", "three.npy", "two.npy"}));
  const json s = json::parse(read_text(tmp / "out" / "summary.json"));
  EXPECT_EQ(s["documents"], 9);
  EXPECT_EQ(s["tokens"], 2 * want.size() + whole.size());
  EXPECT_EQ(s["dtype"], "uint16");
  EXPECT_EQ(s["eos_id"], 300);
  EXPECT_EQ(s["tokenizer"]["sha256"].get<std::string>().size(), 64u);
  EXPECT_EQ(s["sources"][1]["documents"], 4);

  // The files train as data.paths (model.vocab_size covers EOS 300).
  const CmdResult t = run_cli(
      "train --run.dir=" + tmp.sub("run") + " --data.source=tokens --data.paths=" + tmp.sub("out/one.npy") + "," +
      tmp.sub("out/two.npy") + "," + tmp.sub("out/three.npy") +
      " --model.vocab_size=301 --data.eos_id=300 --train.steps=2 --model.n_layers=2 --model.d_model=32 "
      "--model.n_heads=4 --model.n_kv_heads=2 --model.dense_hidden=64 --moe.num_experts=4 --moe.expert_hidden=32 "
      "--train.seq_len=8 --train.micro_batch=2 --train.global_batch=4 --train.eval_interval=0 --train.device=cpu");
  EXPECT_EQ(t.status, 0) << t.output;
  EXPECT_NE(t.output.find("3 files (npy <u2)"), std::string::npos) << t.output;
}

TEST(DataPrepare, SameBytesForEveryJobCount) {
  const TempDir tmp("prepare_jobs");
  write_text(tmp / "tok.json", tokenizer_json());
  // About 3 MB of lines: several 1 MiB batches per file.
  std::string jsonl, txt;
  for (int i = 0; i < 40000; ++i) {
    const std::string doc = "document " + std::to_string(i) + std::string(static_cast<size_t>(i % 50), 'a') + " ab" +
                            std::string(static_cast<size_t>(i % 7), 'b') + " ünïcödé 東京";
    jsonl += json{{"text", doc}}.dump() + "\n";
    txt += doc + "\n";
  }
  write_text(tmp / "big.jsonl", jsonl);
  write_text(tmp / "lines.txt", txt);
  std::string first;
  for (const char* jobs : {"1", "3"}) {
    const fs::path out = tmp / (std::string("out") + jobs);
    const CmdResult r = run_cli("data prepare --lines --jobs " + std::string(jobs) + " --tokenizer " + tmp.sub("tok.json") +
                                " --out " + out.string() + " " + tmp.sub("big.jsonl") + " " + tmp.sub("lines.txt"));
    ASSERT_EQ(r.status, 0) << r.output;
    const std::string bytes = read_text(out / "big.npy") + read_text(out / "lines.npy") + read_text(out / "summary.json");
    if (first.empty())
      first = bytes;
    else
      EXPECT_TRUE(bytes == first) << "--jobs " << jobs << " wrote other bytes than --jobs 1";
  }
  EXPECT_EQ(read_all(tmp / "out1" / "big.npy"), read_all(tmp / "out1" / "lines.npy"));
  const std::vector<uint32_t> ids = read_all(tmp / "out1" / "big.npy");
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 300u), 40000);
}

TEST(DataPrepare, RefusesBadInputsNamingFileLineAndKey) {
  const TempDir tmp("prepare_bad");
  write_text(tmp / "tok.json", tokenizer_json());
  write_text(tmp / "noeos.json", tokenizer_json(false));
  write_text(tmp / "good.jsonl", "{\"text\": \"fine\"}\n");
  write_text(tmp / "missing.jsonl", "{\"text\": \"fine\"}\n\n{\"content\": \"x\", \"id\": 3}\n");
  write_text(tmp / "notjson.jsonl", "{\"text\": \"fine\"}\n{\"text\": \n");
  write_text(tmp / "array.jsonl", "[1, 2]\n");
  write_text(tmp / "number.jsonl", "{\"text\": 12}\n");
  write_text(tmp / "notgz.jsonl.gz", "{\"text\": \"plain\"}\n");
  write_text(tmp / "badutf8.txt", "ok \xC3\x28 bad");
  write_text(tmp / "data.csv", "a,b\n");
  fs::create_directories(tmp / "sub");
  write_text(tmp / "sub" / "good.jsonl", "{\"text\": \"fine\"}\n");
  std::string gz_truncated;
  {
    std::string text;
    for (int i = 0; i < 20000; ++i) text += "{\"text\": \"line " + std::to_string(i * 7919 % 10007) + "\"}\n";
    write_gz(tmp / "full.gz.tmp", text);
    const std::string full = read_text(tmp / "full.gz.tmp");
    gz_truncated = full.substr(0, full.size() / 2);
    fs::remove(tmp / "full.gz.tmp");
    write_text(tmp / "cut.jsonl.gz", gz_truncated);
  }
  const std::string tok = " --tokenizer " + tmp.sub("tok.json") + " --out " + tmp.sub("out") + " ";
  struct Case {
    std::string args, expect;
  };
  const std::vector<Case> cases = {
      {tok + tmp.sub("good.jsonl") + " " + tmp.sub("missing.jsonl"),
       tmp.sub("missing.jsonl") + ":3: the object has no key \"text\" (--text-key); its keys: content, id"},
      {tok + tmp.sub("notjson.jsonl"), tmp.sub("notjson.jsonl") + ":2: not valid JSON"},
      {tok + tmp.sub("array.jsonl"), tmp.sub("array.jsonl") + ":1: expected a JSON object with the text key"},
      {tok + tmp.sub("number.jsonl"), tmp.sub("number.jsonl") + ":1: key \"text\" holds a number; expected a string"},
      {tok + "--text-key body " + tmp.sub("good.jsonl"), ":1: the object has no key \"body\""},
      {tok + tmp.sub("notgz.jsonl.gz"), "is named .gz but is not gzip data"},
      {tok + tmp.sub("cut.jsonl.gz"), "is corrupt or truncated"},
      {tok + tmp.sub("badutf8.txt"), tmp.sub("badutf8.txt") + ": "},  // and the tokenizer's offset, below
      {tok + tmp.sub("data.csv"), "expected a .jsonl, .jsonl.gz or .txt file"},
      {tok + tmp.sub("sub"), "is a directory"},
      {tok + tmp.sub("nothere.jsonl"), "cannot open input '" + tmp.sub("nothere.jsonl") + "'"},
      {tok + tmp.sub("good.jsonl") + " " + tmp.sub("sub/good.jsonl"), "would both be written to 'good.npy'"},
      {" --tokenizer " + tmp.sub("noeos.json") + " --out " + tmp.sub("out") + " " + tmp.sub("good.jsonl"),
       "has no end-of-document token under the usual names (<|endoftext|>, <|end_of_text|>, </s>"},
      {tok + "--eos-id 301 " + tmp.sub("good.jsonl"), "--eos-id 301 is not a token of"},
      {" --out " + tmp.sub("out") + " " + tmp.sub("good.jsonl"), "--tokenizer"},
  };
  for (const Case& c : cases) {
    const CmdResult r = run_cli("data prepare" + c.args);
    EXPECT_EQ(r.status, 1) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_TRUE(names_in(tmp / "out").empty()) << c.args << ": left " << names_in(tmp / "out").size() << " files";
  }
  EXPECT_NE(run_cli("data prepare" + tok + tmp.sub("badutf8.txt")).output.find("not valid UTF-8 at byte 3"), std::string::npos);
  EXPECT_EQ(run_cli("data").status, 2);
  EXPECT_EQ(run_cli("data preprae x").status, 2);
}

TEST(DataPrepare, SigintLeavesNothingAndExits130) {
  const TempDir tmp("prepare_sigint");
  write_text(tmp / "tok.json", tokenizer_json());
  write_text(tmp / "first.jsonl", "{\"text\": \"a finished input\"}\n");
  const fs::path fifo = tmp / "in.jsonl", out = tmp / "out", log = tmp / "log.txt";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const std::string tok = tmp.sub("tok.json"), first = tmp.sub("first.jsonl");
  const pid_t pid = fork();
  if (pid == 0) {
    FILE* f = std::fopen(log.c_str(), "w");
    dup2(fileno(f), STDOUT_FILENO);
    dup2(fileno(f), STDERR_FILENO);
    execl(MOECORE_BINARY, MOECORE_BINARY, "data", "prepare", "--tokenizer", tok.c_str(), "--out", out.c_str(),
          first.c_str(), fifo.c_str(), (char*)nullptr);
    _exit(127);
  }
  std::signal(SIGPIPE, SIG_IGN);
  FILE* w = std::fopen(fifo.c_str(), "w");  // opens once data prepare opened its end
  ASSERT_NE(w, nullptr);
  std::string chunk;
  while (chunk.size() < (1u << 16)) chunk += "{\"text\": \"some text of the document ab\"}\n";
  std::fwrite(chunk.data(), 1, chunk.size(), w);
  std::fflush(w);
  std::this_thread::sleep_for(300ms);
  ASSERT_EQ(kill(pid, SIGINT), 0);
  std::this_thread::sleep_for(100ms);
  for (int i = 0; i < 40; ++i) std::fwrite(chunk.data(), 1, chunk.size(), w);  // past one read chunk
  std::fclose(w);
  std::signal(SIGPIPE, SIG_DFL);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  const std::string text = read_text(log);
  ASSERT_TRUE(WIFEXITED(status)) << text;
  EXPECT_EQ(WEXITSTATUS(status), 130) << text;
  EXPECT_NE(text.find("stopped by SIGINT; nothing was written"), std::string::npos) << text;
  EXPECT_TRUE(names_in(out).empty()) << "left behind: " << names_in(out).size() << " files, " << text;
}

#else  // a build without PCRE2/ICU

TEST(DataPrepare, SaysTheBuildHasNoTokenizer) {
  const TempDir tmp("prepare_none");
  write_text(tmp / "a.jsonl", "{\"text\": \"x\"}\n");
  write_text(tmp / "tok.json", "{}");
  const CmdResult r = run_cli("data prepare --tokenizer " + tmp.sub("tok.json") + " --out " + tmp.sub("out") + " " +
                              tmp.sub("a.jsonl"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("this build of moecore has no tokenizer: PCRE2 and ICU were not found"), std::string::npos)
      << r.output;
  EXPECT_TRUE(names_in(tmp / "out").empty());
}

#endif

}  // namespace
}  // namespace moe::testing
