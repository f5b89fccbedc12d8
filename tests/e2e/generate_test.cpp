// moecore eval and generate: eval of a checkpoint gives bitwise the trainer's eval loss at that
// step; the KV-cache decode path gives the logits of a full forward (to 1e-5 in FP32, 1e-12 in
// FP64); generation is deterministic at temperature 0 and for a seed, and its first logits are
// those `moecore logits` prints for the prompt.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/config_io.h"
#include "e2e/cli_util.h"
#include "model/generate.h"
#include "model/model.h"
#include "support/test_util.h"
#include "train/trainer.h"

namespace moe::testing {
namespace {

namespace fs = std::filesystem;

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "missing: " << (part) << "\nin: " << (text)

std::vector<float> read_floats(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<float> v(fs::file_size(p) / sizeof(float));
  in.read(reinterpret_cast<char*>(v.data()), std::streamsize(v.size() * sizeof(float)));
  return v;
}

nlohmann::json last_json_line(const std::string& out) {
  std::istringstream in(out);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty() && line[0] == '{') last = line;
  return nlohmann::json::parse(last);
}

// The small test model (a dense layer 0, then MoE with the expert bias on) trained `steps` steps
// with an eval every 2 steps and a checkpoint at the end.
Config eval_run(const fs::path& run, int64_t steps) {
  Config c = small_train_config(run, /*n_layers=*/3, /*global_batch=*/4, steps);
  c.train.eval_interval = 2;
  c.train.eval_batches = 3;
  return c;
}

// Bitwise: the same model state, eval batches, routing seeds and forward, on one rank both times.
TEST(Eval, CheckpointLossIsTheTrainersEvalLossBitwise) {
  const TempDir tmp("eval_bitwise");
  const Config c = eval_run(tmp / "run", 4);
  std::ostringstream log;
  const TrainSummary s = train(c, log);
  ASSERT_GT(s.final_eval_loss, 0);
  const CmdResult r = run_cli("eval " + (tmp / "run" / "checkpoints").string() + " --json");
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json j = last_json_line(r.output);
  EXPECT_EQ(j["step"].get<int64_t>(), 4);
  EXPECT_EQ(j["loss"].get<double>(), s.final_eval_loss);  // bitwise
  EXPECT_EQ(j["tokens"].get<int64_t>(), 3 * c.train.micro_batch * c.train.seq_len);
  EXPECT_EQ(j["batches"].get<int64_t>(), 3);
  EXPECT_NEAR(j["perplexity"].get<double>(), std::exp(s.final_eval_loss), 1e-9 * std::exp(s.final_eval_loss));
  // Fewer batches: another loss, and the text form names it.
  const CmdResult one = run_cli("eval " + (tmp / "run" / "checkpoints").string() + " --train.eval_batches=1");
  ASSERT_EQ(one.status, 0) << one.output;
  EXPECT_CONTAINS(one.output, "step 4: loss ");
  EXPECT_CONTAINS(one.output, "tokens " + std::to_string(c.train.micro_batch * c.train.seq_len) + " (1 batches on cpu)");
}

// data.eval_paths given on the command line replaces the embedded eval split; a run on token
// files without eval files is refused naming the flag.
TEST(Eval, EvalPathsAndNoHeldOutData) {
  const TempDir tmp("eval_paths");
  const Config c = eval_run(tmp / "run", 2);
  std::ostringstream log;
  train(c, log);
  const fs::path text = tmp / "held_out.txt";
  {
    std::ofstream f(text);
    for (int i = 0; i < 40; ++i) f << "the quick brown fox jumps over the lazy dog " << i << "\n";
  }
  const fs::path tokens = tmp / "held_out.bin";
  ASSERT_EQ(run_cli("tokenize --out " + tokens.string() + " " + text.string()).status, 0);
  const std::string ck = (tmp / "run" / "checkpoints").string();
  const CmdResult r = run_cli("eval " + ck + " --json --data.eval_paths=" + tokens.string());
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json j = last_json_line(r.output);
  const int64_t inst = int64_t(fs::file_size(tokens) / 2) / (c.train.seq_len + 1);
  const int64_t batches = std::min<int64_t>(3, inst / c.train.micro_batch);
  EXPECT_EQ(j["tokens"].get<int64_t>(), batches * c.train.micro_batch * c.train.seq_len);
  const CmdResult none =
      run_cli("eval " + ck + " --data.source=tokens --data.paths=" + tokens.string() + " --data.eval_paths=");
  EXPECT_EQ(none.status, 1) << none.output;
  EXPECT_CONTAINS(none.output, "no held-out data for checkpoint");
  EXPECT_CONTAINS(none.output, "--data.eval_paths=FILE");
}

// Logits of every decoded position against the full forward's row at that position: a prompt of 7
// tokens decoded at once, then one token at a time.
template <typename T>
void check_decode_matches_forward(double tol) {
  Config c = small_train_config("unused", /*n_layers=*/3, 2, 1);
  Model<T> model(c.model, c.moe);
  model.init_params(99);
  std::vector<float>& bias = model.expert_bias();  // selection-only bias: decode must apply it too
  for (size_t i = 0; i < bias.size(); ++i) bias[i] = 0.01f * float(i % 3);
  const int64_t s = 13, v = c.model.vocab_size;
  std::vector<int32_t> ids(s);
  for (int64_t i = 0; i < s; ++i) ids[i] = int32_t((i * 37 + 11) % v);
  const std::vector<int32_t> targets(s, -1);
  model.forward(ids.data(), targets.data(), 1, s);
  const std::vector<T> full = model.logits();
  KvCache<T> cache;
  std::vector<T> got = model.decode(ids.data(), 7, cache);
  ASSERT_EQ(int64_t(got.size()), 7 * v);
  for (int64_t p = 7; p < s; ++p) {
    const std::vector<T> one = model.decode(&ids[p], 1, cache);
    got.insert(got.end(), one.begin(), one.end());
  }
  EXPECT_EQ(cache.length, s);
  double worst = 0;
  for (int64_t i = 0; i < s * v; ++i)
    worst = std::max(worst, std::abs(double(got[i]) - double(full[i])) / std::max(1.0, std::abs(double(full[i]))));
  EXPECT_LE(worst, tol);
  // The cache really is used: decoding the last token without its prefix gives other logits.
  KvCache<T> fresh;
  const std::vector<T> alone = model.decode(&ids[s - 1], 1, fresh);
  double diff = 0;
  for (int64_t i = 0; i < v; ++i) diff = std::max(diff, std::abs(double(alone[i]) - double(full[(s - 1) * v + i])));
  EXPECT_GT(diff, 100 * tol);
}

TEST(Decode, CachedLogitsEqualFullForwardFloat) { check_decode_matches_forward<float>(1e-5); }
TEST(Decode, CachedLogitsEqualFullForwardDouble) { check_decode_matches_forward<double>(1e-12); }

TEST(Decode, RefusesIdsOutsideTheVocabulary) {
  Config c = small_train_config("unused", 2, 2, 1);
  Model<float> model(c.model, c.moe);
  KvCache<float> cache;
  const int32_t bad = int32_t(c.model.vocab_size);
  try {
    model.decode(&bad, 1, cache);
    FAIL() << "decode took id " << bad;
  } catch (const Error& e) {
    EXPECT_CONTAINS(std::string(e.what()), "expected [0, 256)");
  }
}

// The nucleus: with top_p = 0.5 over probabilities (0.4, 0.3, 0.2, 0.1) only ids 0 and 1 are drawn,
// in about the ratio 4 : 3; temperature 0 is the argmax; the same draw index gives the same id.
TEST(Sampling, TopPKeepsTheNucleusAndIsReproducible) {
  const std::vector<float> logits = {std::log(0.4f), std::log(0.3f), std::log(0.2f), std::log(0.1f)};
  SamplingOptions o;
  EXPECT_EQ(sample_token(logits.data(), 4, o, 0), 0);
  o.temperature = 1;
  o.top_p = 0.5;
  o.seed = 7;
  int count[4] = {0, 0, 0, 0};
  for (int k = 0; k < 4000; ++k) {
    const int32_t id = sample_token(logits.data(), 4, o, k);
    ASSERT_GE(id, 0);
    ASSERT_LT(id, 4);
    ++count[id];
    EXPECT_EQ(id, sample_token(logits.data(), 4, o, k));
  }
  EXPECT_EQ(count[2] + count[3], 0);
  EXPECT_NEAR(double(count[0]) / 4000, 4.0 / 7, 0.03);
  o.top_p = 1;
  for (int k = 0; k < 4000; ++k) ++count[sample_token(logits.data(), 4, o, k + 4000)];
  EXPECT_GT(count[3], 250);  // the whole distribution: id 3 at about 10%
  o.top_p = 1.5;
  EXPECT_THROW(sample_token(logits.data(), 4, o, 0), Error);
}

struct GenRun {
  nlohmann::json j;
  std::vector<float> logits;
};

GenRun gen(const std::string& ck, const std::string& args, const fs::path& logits_path) {
  const CmdResult r = run_cli("generate " + ck + " --json --logits-out " + logits_path.string() + " " + args);
  EXPECT_EQ(r.status, 0) << r.output;
  if (r.status != 0) return {};
  return {last_json_line(r.output), read_floats(logits_path)};
}

TEST(Generate, GreedyIsDeterministicAndStartsFromTheLogitsOfThePrompt) {
  const TempDir tmp("generate");
  const Config c = eval_run(tmp / "run", 2);
  std::ostringstream log;
  train(c, log);
  const std::string ck = (tmp / "run" / "checkpoints").string();
  const GenRun a = gen(ck, "--prompt 'The cat' --max-new-tokens 12", tmp / "a.f32");
  const GenRun b = gen(ck, "--prompt 'The cat' --max-new-tokens 12", tmp / "b.f32");
  ASSERT_FALSE(a.j.is_null());
  EXPECT_EQ(a.j["prompt_ids"], nlohmann::json({84, 104, 101, 32, 99, 97, 116}));  // the prompt's bytes
  EXPECT_EQ(a.j["ids"], b.j["ids"]);
  EXPECT_EQ(a.logits, b.logits);
  const size_t n = a.j["ids"].size();
  EXPECT_TRUE(n == 12 || a.j["eos"].get<bool>());
  ASSERT_EQ(a.logits.size(), n * 256);
  // Every greedy id is the argmax of the logits it was chosen from.
  for (size_t k = 0; k < n; ++k) {
    const float* row = a.logits.data() + k * 256;
    EXPECT_EQ(a.j["ids"][k].get<int64_t>(), std::max_element(row, row + 256) - row);
  }
  // The first logits: those of the prompt's last position in a full forward.
  const CmdResult lg = run_cli("logits " + ck + " --tokens 84,104,101,32,99,97,116 --out " + (tmp / "full.f32").string());
  ASSERT_EQ(lg.status, 0) << lg.output;
  const std::vector<float> full = read_floats(tmp / "full.f32");
  ASSERT_EQ(full.size(), 7u * 256u);
  for (int i = 0; i < 256; ++i) EXPECT_NEAR(a.logits[i], full[6 * 256 + i], 1e-5f * std::max(1.f, std::abs(full[6 * 256 + i])));
  // The first greedy token after the whole prompt + continuation is the argmax of `logits`' row.
  std::string seq = "84,104,101,32,99,97,116";
  for (size_t k = 0; k + 1 < n; ++k) seq += "," + std::to_string(a.j["ids"][k].get<int64_t>());
  ASSERT_EQ(run_cli("logits " + ck + " --tokens " + seq + " --out " + (tmp / "all.f32").string()).status, 0);
  const std::vector<float> all = read_floats(tmp / "all.f32");
  const float* last = all.data() + (all.size() / 256 - 1) * 256;
  for (int i = 0; i < 256; ++i)
    EXPECT_NEAR(a.logits[(n - 1) * 256 + i], last[i], 1e-5f * std::max(1.f, std::abs(last[i])));
}

TEST(Generate, SamplingIsReproducibleForASeed) {
  const TempDir tmp("generate_seed");
  const Config c = eval_run(tmp / "run", 2);
  std::ostringstream log;
  train(c, log);
  const std::string ck = (tmp / "run" / "checkpoints").string();
  const std::string args = "--prompt 'Once upon' --max-new-tokens 24 --temperature 1.5 --top-p 0.95";
  const GenRun a = gen(ck, args + " --seed 5", tmp / "a.f32");
  const GenRun b = gen(ck, args + " --seed 5", tmp / "b.f32");
  const GenRun d = gen(ck, args + " --seed 6", tmp / "d.f32");
  ASSERT_FALSE(a.j.is_null());
  EXPECT_EQ(a.j["ids"], b.j["ids"]);
  EXPECT_NE(a.j["ids"], d.j["ids"]);
  // A nucleus of one token is greedy decoding.
  const GenRun g = gen(ck, "--prompt 'Once upon' --max-new-tokens 24", tmp / "g.f32");
  const GenRun t = gen(ck, "--prompt 'Once upon' --max-new-tokens 24 --temperature 0.7 --top-p 1e-9 --seed 3",
                       tmp / "t.f32");
  EXPECT_EQ(g.j["ids"], t.j["ids"]);
  // Refusals name the flag.
  const CmdResult bad = run_cli("generate " + ck + " --prompt x --top-p 0");
  EXPECT_EQ(bad.status, 1);
  EXPECT_CONTAINS(bad.output, "--top-p: expected a number in (0, 1]");
  const CmdResult neg = run_cli("generate " + ck + " --prompt x --temperature -1");
  EXPECT_EQ(neg.status, 1);
  EXPECT_CONTAINS(neg.output, "--temperature: expected a number >= 0");
}

}  // namespace
}  // namespace moe::testing
