// The command line through the real binary: one parser for every subcommand (--k=v and --k v,
// --config, --help, --version, errors that say what is missing), user-facing error messages
// (the site only under MOECORE_DEBUG=1), sizes refused before they are multiplied, token ids
// checked against the vocabulary, files that must be regular, resume checks against the
// checkpoint's model, and the export of a model with dense layers naming the keys to set.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "core/config.h"
#include "core/config_io.h"
#include "e2e/cli_util.h"
#include "support/test_util.h"
#include "train/run_plan.h"
#include "train/trainer.h"

namespace moe::testing {
namespace {

namespace fs = std::filesystem;

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "missing: " << (part) << "\nin: " << (text)
#define EXPECT_LACKS(text, part) \
  EXPECT_EQ(std::string(text).find(part), std::string::npos) << "unexpected: " << (part) << "\nin: " << (text)

const std::string kTiny = std::string(MOECORE_SOURCE_DIR) + "/configs/tiny.toml";

// The resolved-config part of a dry run (everything before the run plan's "# " lines).
std::string resolved_config(const std::string& dry_run_output) {
  return dry_run_output.substr(0, dry_run_output.find("\n# "));
}

TEST(Cli, OverridesTakeEqualsOrSpaceForm) {
  const CmdResult eq = run_cli("train --dry-run --train.steps=5 --run.dir=runs/x");
  const CmdResult sp = run_cli("train --dry-run --train.steps 5 --run.dir runs/x");
  ASSERT_EQ(eq.status, 0) << eq.output;
  ASSERT_EQ(sp.status, 0) << sp.output;
  EXPECT_CONTAINS(sp.output, "steps = 5\n");
  EXPECT_CONTAINS(sp.output, "dir = \"runs/x\"");
  EXPECT_EQ(resolved_config(sp.output), resolved_config(eq.output));
  // Flags too: --world 2 and --world=2.
  const CmdResult w = run_cli("train --dry-run --world=2 --train.global_batch 16 --train.micro_batch 2");
  ASSERT_EQ(w.status, 0) << w.output;
  EXPECT_CONTAINS(w.output, "2 rank(s) on cpu: dp 2");
  // An empty value in the space form sets "".
  const CmdResult empty = run_cli("train --dry-run --checkpoint.dir ''");
  ASSERT_EQ(empty.status, 0) << empty.output;
  EXPECT_CONTAINS(empty.output, "[checkpoint]\ndir = \"\"");
}

TEST(Cli, ConfigFlagEqualsPositional) {
  const CmdResult pos = run_cli("train --dry-run " + kTiny + " --train.steps=7");
  const CmdResult flag = run_cli("train --dry-run --config " + kTiny + " --train.steps=7");
  const CmdResult flag_eq = run_cli("train --dry-run --config=" + kTiny + " --train.steps=7");
  ASSERT_EQ(pos.status, 0) << pos.output;
  ASSERT_EQ(flag.status, 0) << flag.output;
  ASSERT_EQ(flag_eq.status, 0) << flag_eq.output;
  EXPECT_EQ(resolved_config(flag.output), resolved_config(pos.output));
  EXPECT_EQ(resolved_config(flag_eq.output), resolved_config(pos.output));
  const CmdResult both = run_cli("train --dry-run " + kTiny + " --config " + kTiny);
  EXPECT_EQ(both.status, 1);
  EXPECT_CONTAINS(both.output, "the config is given twice");
  const CmdResult missing = run_cli("train --dry-run --config /nonexistent/run.toml");
  EXPECT_EQ(missing.status, 1);
  EXPECT_CONTAINS(missing.output, "/nonexistent/run.toml");
}

TEST(Cli, VersionNamesProjectVersionAndCommit) {
  for (const char* form : {"--version", "version"}) {
    const CmdResult r = run_cli(form);
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(^moecore \d+\.\d+\.\d+ \(commit ([0-9a-f]{4,}|unknown)\)\n$)")))
        << form << ": " << r.output;
  }
}

TEST(Cli, EverySubcommandHasHelp) {
  for (const char* cmd : {"train", "bench", "inspect", "export-hf", "import-hf", "logits", "tokenize", "version"}) {
    for (const char* flag : {"--help", "-h"}) {
      const CmdResult r = run_cli(std::string(cmd) + " " + flag);
      EXPECT_EQ(r.status, 0) << cmd << " " << flag << ": " << r.output;
      EXPECT_CONTAINS(r.output, std::string("usage: moecore ") + cmd);
      EXPECT_CONTAINS(r.output, "--help");
    }
  }
  EXPECT_CONTAINS(run_cli("train --help").output, "model.n_layers");  // the key table
  EXPECT_CONTAINS(run_cli("help logits").output, "usage: moecore logits CHECKPOINT_DIR --tokens");
}

// A command line refused: its exit status and the parts of what it prints.
struct Refusal {
  const char* args;
  int status;
  std::vector<const char*> says;
};

void expect_refusals(std::initializer_list<Refusal> cases) {
  for (const Refusal& c : cases) {
    SCOPED_TRACE(c.args);
    const CmdResult r = run_cli(c.args);
    EXPECT_EQ(r.status, c.status) << r.output;
    for (const char* part : c.says) EXPECT_CONTAINS(r.output, part);
  }
}

TEST(Cli, MissingArgumentsAreNamed) {
  expect_refusals({
      {"tokenize --out=/tmp/moecore_unused.bin", 1, {"error: missing TEXT_FILE...", "usage: moecore tokenize"}},
      {"tokenize a.txt", 1, {"error: missing --out FILE"}},
      {"export-hf /tmp/some_checkpoint", 1, {"error: missing OUT_DIR"}},
      {"logits /tmp/some_checkpoint", 1, {"error: missing --tokens"}},
      {"inspect", 1, {"error: missing CHECKPOINT_DIR"}},
      {"inspect a b", 1, {"unexpected argument 'b'"}},
      {"train --dry-run --run.dir --train.steps=3", 1,
       {"--run.dir needs a value, but the next argument is the option '--train.steps=3'"}},
      {"train --dry-run --train.steps", 1, {"--train.steps needs a value"}},
  });
}

TEST(Cli, UnknownOptionsSuggestTheNearest) {
  expect_refusals({
      {"bench --stpes 3 --out=", 1, {"unknown option '--stpes' for `moecore bench`; did you mean '--steps'?"}},
      {"train --dry-run --steps=3", 1, {"did you mean the config key '--train.steps'?"}},
      {"inspect --model.n_layers=2 x", 1, {"takes no config overrides"}},
      {"trian", 2, {"unknown command 'trian'; did you mean 'train'?"}},
      {"train --world 2", 1, {"--world N goes with --dry-run"}},
  });
}

TEST(Cli, BadKeysAndValuesAreNamed) {
  expect_refusals({
      {"train --dry-run --moe.topk=3", 1, {"moe.top_k"}},
      {"bench --steps x --out=", 1, {"--steps: expected an integer, got 'x'"}},
      {"tokenize --out /tmp/unused.bin --eos", 1, {"--eos needs a value"}},
      {"train /nonexistent/config.toml", 1, {"/nonexistent/config.toml"}},
  });
}

TEST(Cli, ErrorSiteOnlyUnderMoecoreDebug) {
  const CmdResult plain = run_cli("train --dry-run --model.n_kv_heads=3");
  EXPECT_EQ(plain.status, 1);
  EXPECT_CONTAINS(plain.output, "model.n_heads (4) must be divisible by model.n_kv_heads (3)");
  EXPECT_LACKS(plain.output, "config_io.cpp:");
  EXPECT_LACKS(plain.output, "check:");
  const CmdResult debug = run_cli("train --dry-run --model.n_kv_heads=3", "MOECORE_DEBUG=1");
  EXPECT_EQ(debug.status, 1);
  EXPECT_CONTAINS(debug.output, "must be divisible by model.n_kv_heads (3)");
  EXPECT_CONTAINS(debug.output, "[config_io.cpp:");
  const CmdResult check = run_cli("logits /nonexistent --tokens 1", "MOECORE_DEBUG=1");
  EXPECT_CONTAINS(check.output, "check: dir.has_value()");
}

// Values no machine can run are refused at validation, naming the key and the bound, before
// anything is built from them (a billion layers would otherwise hang building the layout).
TEST(Cli, ImpossibleSizesAreRefusedNamingTheKey) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--model.n_layers=1000000000", "model.n_layers must be <= 16384"},
      {"--model.n_layers 1000000000", "model.n_layers must be <= 16384"},
      {"--train.seq_len=576460752303423488", "train.seq_len must be <= 16777216"},        // 2^59
      {"--train.global_batch=1152921504606846976", "train.global_batch must be <= 4294967296"},  // 2^60
      {"--train.eval_batches=4611686018427387904", "train.eval_batches must be <= 1048576"},     // 2^62
      {"--train.steps=4611686018427387904", "train.steps must be <= 1099511627776"},             // 2^62
      {"--model.d_model=4294967296 --model.n_heads=4", "model.d_model must be <= 65536"},        // 2^32
      {"--moe.num_experts=1048576", "moe.num_experts must be <= 65536"},
      {"--model.vocab_size=4294967296", "model.vocab_size must be <= 2147483647"},
      {"--train.global_batch=4294967296 --train.micro_batch=8 --train.seq_len=16777216", "tokens per step"},
  };
  for (const auto& [args, expect] : cases) {
    const CmdResult r = run_cli("train --dry-run " + args);
    EXPECT_EQ(r.status, 1) << args << ": " << r.output;
    EXPECT_CONTAINS(r.output, expect);
  }
}

TEST(Cli, StrayQuoteInAValueIsRefused) {
  const CmdResult r = run_cli("train --dry-run '--run.dir=\"abc'");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_CONTAINS(r.output, "run.dir: expected a string");
  EXPECT_CONTAINS(r.output, "badly quoted");
  const CmdResult ok = run_cli("train --dry-run '--run.dir=\"a b\"'");
  EXPECT_EQ(ok.status, 0) << ok.output;
  EXPECT_CONTAINS(ok.output, "dir = \"a b\"");
}

// The derived sizes of the run plan are checked products: an unvalidated config whose tokens
// per micro-batch leave int64 fails naming the quantity instead of wrapping.
TEST(RunPlan, DerivedSizesAreCheckedProducts) {
  Config c;
  c.train.seq_len = int64_t(1) << 40;
  c.train.micro_batch = int64_t(1) << 30;
  c.train.global_batch = int64_t(1) << 30;
  const std::string msg = error_of([&] { make_run_plan(c, 1, "cpu"); });
  EXPECT_CONTAINS(msg, "tokens per micro-batch (train.micro_batch x train.seq_len) overflows int64");
}

// A one-step run of the small test model (2 layers: a dense layer 0, then MoE), its checkpoint.
fs::path small_checkpoint(const fs::path& root, int64_t n_layers = 2) {
  Config c = small_train_config(root / "run", n_layers, /*global_batch=*/2, /*steps=*/1);
  std::ostringstream log;
  train(c, log);
  return root / "run" / "checkpoints";
}

TEST(Cli, LogitsRefusesIdsOutsideTheVocabulary) {
  const TempDir tmp("logits_ids");
  const fs::path ck = small_checkpoint(tmp.root());
  const CmdResult big = run_cli("logits " + ck.string() + " --tokens 1,1099511627776");
  EXPECT_EQ(big.status, 1) << big.output;
  EXPECT_CONTAINS(big.output, "--tokens: item 2 is 1099511627776, not a token id of this model: expected [0, 256)");
  const CmdResult neg = run_cli("logits " + ck.string() + " --tokens=-1");
  EXPECT_EQ(neg.status, 1) << neg.output;
  EXPECT_CONTAINS(neg.output, "item 1 is -1");
  const CmdResult gap = run_cli("logits " + ck.string() + " --tokens 1,,2");
  EXPECT_EQ(gap.status, 1) << gap.output;
  EXPECT_CONTAINS(gap.output, "--tokens: item 2 of '1,,2' is empty");
  const CmdResult huge = run_cli("logits " + ck.string() + " --tokens 99999999999999999999");
  EXPECT_EQ(huge.status, 1) << huge.output;
  EXPECT_CONTAINS(huge.output, "out of range");
  // A good sequence writes [S, V] float32 logits under the name given, and nothing else.
  const fs::path out = tmp / "logits.f32";
  const CmdResult ok = run_cli("logits " + ck.string() + " --tokens 1,2,3 --out " + out.string());
  ASSERT_EQ(ok.status, 0) << ok.output;
  EXPECT_CONTAINS(ok.output, "tokens 3 loss ");
  EXPECT_EQ(fs::file_size(out), 3u * 256u * sizeof(float));
  for (const auto& e : fs::directory_iterator(tmp.root()))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
}

// The embedded default has a dense MLP layer, which OLMoE cannot express: the refusal names the
// key to set, and a model trained with it set exports.
TEST(Cli, ExportOfDenseLayersNamesTheKeyToSet) {
  const TempDir tmp("export_dense");
  const fs::path ck = small_checkpoint(tmp.root());
  const CmdResult r = run_cli("export-hf " + ck.string() + " " + (tmp / "hf").string());
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_CONTAINS(r.output, "it has dense MLP layers (model.dense_layers = [0]");
  EXPECT_CONTAINS(r.output, "set model.dense_layers = []");
  EXPECT_FALSE(fs::exists(tmp / "hf" / "config.json"));

  Config c = small_train_config(tmp / "moe_only", 2, 2, 1);
  c.model.dense_layers = {};
  c.moe.bias_update_rate = 0;
  std::ostringstream log;
  train(c, log);
  // A staged shard an interrupted export left is removed; other files are not touched.
  fs::create_directories(tmp / "hf2");
  std::ofstream(tmp / "hf2" / ".model-00001-of-00003.safetensors.tmp-4242") << "partial";
  std::ofstream(tmp / "hf2" / "README.md") << "mine";
  const CmdResult ok = run_cli("export-hf " + (tmp / "moe_only" / "checkpoints").string() + " " +
                               (tmp / "hf2").string() + " --dtype fp32");
  ASSERT_EQ(ok.status, 0) << ok.output;
  EXPECT_TRUE(fs::exists(tmp / "hf2" / "config.json"));
  EXPECT_TRUE(fs::exists(tmp / "hf2" / "model.safetensors.index.json"));
  for (const auto& e : fs::directory_iterator(tmp / "hf2"))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
  EXPECT_TRUE(fs::exists(tmp / "hf2" / "README.md"));
}

// A FIFO or a directory where a file is read is refused at once, naming the path.
TEST(Cli, FifoOrDirectoryInPlaceOfAFileIsRefused) {
  const TempDir tmp("fifo");
  fs::create_directories(tmp / "hf");
  ASSERT_EQ(::mkfifo((tmp / "hf" / "config.json").c_str(), 0644), 0);
  const CmdResult fifo = run_cli("import-hf " + (tmp / "hf").string() + " " + (tmp / "ck").string(), "timeout 20");
  EXPECT_EQ(fifo.status, 1) << fifo.output;
  EXPECT_CONTAINS(fifo.output, (tmp / "hf" / "config.json").string() + "' is a FIFO: expected a regular file");
  fs::create_directories(tmp / "hf_dir" / "config.json");
  const CmdResult dir = run_cli("import-hf " + (tmp / "hf_dir").string() + " " + (tmp / "ck").string(), "timeout 20");
  EXPECT_EQ(dir.status, 1) << dir.output;
  EXPECT_CONTAINS(dir.output, "config.json' is a directory: expected a regular file");
  const CmdResult cfg = run_cli("train --dry-run " + (tmp / "hf" / "config.json").string(), "timeout 20");
  EXPECT_EQ(cfg.status, 1) << cfg.output;
  EXPECT_CONTAINS(cfg.output, "is not a regular file");
}

// Resuming with a model that differs from the checkpoint's is refused, naming every key that
// differs (before: a 2-layer checkpoint resumed with 1 layer dropped a layer silently, and
// qk_norm = false ignored the norm weights).
TEST(Resume, RefusesAModelThatDiffersFromTheCheckpoint) {
  const TempDir tmp("resume_check");
  const fs::path ck = small_checkpoint(tmp.root(), 2);
  Config c = small_train_config(tmp / "again", 2, 2, 2);
  c.checkpoint.resume = ck.string();
  std::ostringstream log;
  Config fewer = c;
  fewer.run.dir = (tmp / "fewer").string();
  fewer.model.n_layers = 1;
  std::string msg = error_of([&] { train(fewer, log); });
  EXPECT_CONTAINS(msg, "this run's model differs from the checkpoint's in 1 key:");
  EXPECT_CONTAINS(msg, "model.n_layers: 2 in the checkpoint, 1 in this run");
  Config no_norm = c;
  no_norm.run.dir = (tmp / "no_norm").string();
  no_norm.model.qk_norm = false;
  no_norm.moe.top_k = 1;
  msg = error_of([&] { train(no_norm, log); });
  EXPECT_CONTAINS(msg, "in 2 keys:");
  EXPECT_CONTAINS(msg, "model.qk_norm: true in the checkpoint, false in this run");
  EXPECT_CONTAINS(msg, "moe.top_k: 2 in the checkpoint, 1 in this run");
  EXPECT_CONTAINS(msg, "checkpoint.resume = \"none\"");
  // Through the CLI, with the same model: resumes.
  const CmdResult r = run_cli("train --train.steps=2 --checkpoint.resume=" + ck.string() + " --run.dir=" +
                              (tmp / "cli").string() + " --model.n_layers=1 --model.dense_layers=0 --model.d_model=32"
                              " --model.n_heads=4 --moe.num_experts=4 --moe.expert_hidden=32 --train.seq_len=16"
                              " --train.micro_batch=2 --train.global_batch=2 --train.eval_interval=0");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_CONTAINS(r.output, "model.n_layers: 2 in the checkpoint, 1 in this run");
  const TrainSummary s = train(c, log);
  EXPECT_EQ(s.start_step, 1);
}

}  // namespace
}  // namespace moe::testing
