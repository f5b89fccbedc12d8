// Checkpoint directory store: save/load round trip, `latest`, pruning, replacing a step,
// stale temporary directories, manifest verification (corrupted byte, truncation, missing
// manifest, a sliced shape outside int64), shape checks, typed train_state fields, the resume
// check against the stored config, FIFOs and directories in place of files, a read-only
// checkpoint directory, staged file writes, and crash safety: a forked writer is SIGKILLed
// mid-save repeatedly and every complete step left behind must still verify.
#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/files.h"
#include "checkpoint/safetensors.h"
#include "core/config_io.h"
#include "parallel/comm.h"
#include "support/test_util.h"
#include "core/error.h"

namespace moe::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected a moe::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
  }
}

std::vector<std::string> tmp_entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".tmp-", 0) == 0 || name == "latest.tmp") out.push_back(name);
  }
  return out;
}

// A small model's parameters and AdamW moments with values determined by `seed`.
struct FakeState {
  std::vector<std::string> names = {"model.embed_tokens.weight", "model.layers.0.mlp.experts.w1",
                                    "model.norm.weight", "model.scale"};
  std::vector<Shape> shapes = {{16, 8}, {4, 6, 8}, {8}, {}};
  std::vector<std::vector<float>> params, exp_avg, exp_avg_sq;
  std::vector<std::string> optim_names;

  explicit FakeState(float seed) {
    for (size_t t = 0; t < names.size(); ++t) {
      const int64_t n = shape_numel(shapes[t]);
      std::vector<float> p(n), m(n), v(n);
      for (int64_t i = 0; i < n; ++i) {
        p[i] = seed + float(t) + 0.125f * float(i);
        m[i] = -p[i];
        v[i] = p[i] * p[i];
      }
      params.push_back(p);
      exp_avg.push_back(m);
      exp_avg_sq.push_back(v);
      optim_names.push_back(names[t] + ".exp_avg");
      optim_names.push_back(names[t] + ".exp_avg_sq");
    }
  }

  CheckpointFiles files(json train_state, bool with_optim = true) const {
    CheckpointFiles f;
    for (size_t t = 0; t < names.size(); ++t) {
      f.model.push_back({names[t], DType::kF32, shapes[t], params[t].data()});
      if (with_optim) {
        f.optim.push_back({optim_names[2 * t], DType::kF32, shapes[t], exp_avg[t].data()});
        f.optim.push_back({optim_names[2 * t + 1], DType::kF32, shapes[t], exp_avg_sq[t].data()});
      }
    }
    f.train_state = std::move(train_state);
    return f;
  }

  void expect_matches(const LoadedCheckpoint& c) const {
    for (size_t t = 0; t < names.size(); ++t) {
      std::vector<float> out(params[t].size());
      c.read_model(names[t], shapes[t], out.data());
      EXPECT_EQ(out, params[t]) << names[t];
      if (!c.has_optim()) continue;
      c.read_optim(optim_names[2 * t], shapes[t], out.data());
      EXPECT_EQ(out, exp_avg[t]) << optim_names[2 * t];
      c.read_optim(optim_names[2 * t + 1], shapes[t], out.data());
      EXPECT_EQ(out, exp_avg_sq[t]) << optim_names[2 * t + 1];
    }
  }
};

TEST(Checkpoint, SaveLoadRoundTrip) {
  TempDir dir;
  const std::string ckpt = dir.sub("ckpt");  // created by the save
  const FakeState state(1.0f);
  json ts = {{"data_position", 12345}, {"rng", {1, 2, 3}}, {"config", {{"model", {{"d_model", 8}}}}}};
  const std::string step_dir = save_checkpoint(ckpt, 10, state.files(ts), 3);
  EXPECT_EQ(step_dir, dir.sub("ckpt/step_10"));
  EXPECT_EQ(read_text(ckpt + "/latest"), "step_10\n");
  EXPECT_EQ(list_steps(ckpt), std::vector<int64_t>{10});
  EXPECT_TRUE(tmp_entries(ckpt).empty());

  const json manifest = json::parse(read_text(step_dir + "/manifest.json"));
  EXPECT_EQ(manifest["format"], "moecore-checkpoint");
  EXPECT_EQ(manifest["version"], 1);
  EXPECT_EQ(manifest["step"], 10);
  ASSERT_EQ(manifest["files"].size(), 3u);
  for (const char* f : {"model.safetensors", "optim.safetensors", "train_state.json"}) {
    EXPECT_EQ(manifest["files"][f]["bytes"], fs::file_size(step_dir + "/" + f)) << f;
    EXPECT_EQ(manifest["files"][f]["sha256"].get<std::string>().size(), 64u);
  }

  ASSERT_EQ(resolve_checkpoint(ckpt), step_dir);
  ASSERT_EQ(resolve_checkpoint(step_dir), step_dir);
  const auto c = LoadedCheckpoint::open(step_dir);
  EXPECT_EQ(c.step(), 10);
  EXPECT_EQ(c.train_state()["step"], 10);
  EXPECT_EQ(c.train_state()["data_position"], 12345);
  EXPECT_EQ(c.train_state()["rng"], json({1, 2, 3}));
  EXPECT_EQ(c.train_state()["config"]["model"]["d_model"], 8);
  ASSERT_TRUE(c.has_optim());
  EXPECT_EQ(c.model().tensors().size(), 4u);
  EXPECT_EQ(c.optim().tensors().size(), 8u);
  EXPECT_EQ(c.model().metadata().at("format"), "pt");
  state.expect_matches(c);
}

TEST(Checkpoint, ModelOnlyCheckpointHasNoOptim) {
  TempDir dir;
  const FakeState state(2.0f);
  const std::string step_dir = save_checkpoint(dir.path(), 0, state.files(json::object(), false), 0);
  EXPECT_FALSE(fs::exists(step_dir + "/optim.safetensors"));
  const auto c = LoadedCheckpoint::open(step_dir);
  EXPECT_FALSE(c.has_optim());
  state.expect_matches(c);
  std::vector<float> out(8);
  expect_error([&] { c.optim(); }, {"no optimizer state", step_dir});
  expect_error([&] { c.read_optim("model.norm.weight.exp_avg", {8}, out.data()); }, {"no optimizer state"});
}

TEST(Checkpoint, TrainStateMustAgreeWithStep) {
  TempDir dir;
  const FakeState state(0.0f);
  expect_error([&] { save_checkpoint(dir.path(), 4, state.files({{"step", 3}}), 0); }, {"step 3", "step 4"});
  expect_error([&] { save_checkpoint(dir.path(), 4, state.files(json::array()), 0); }, {"JSON object"});
  expect_error([&] { save_checkpoint(dir.path(), -1, state.files(json::object()), 0); }, {">= 0"});
  EXPECT_TRUE(list_steps(dir.path()).empty());
}

TEST(Checkpoint, LatestFollowsSavesAndKeepLastPrunes) {
  TempDir dir;
  const std::string ckpt = dir.path();
  for (int64_t s = 1; s <= 5; ++s) {
    save_checkpoint(ckpt, s * 100, FakeState(float(s)).files(json::object()), 2);
    EXPECT_EQ(read_text(ckpt + "/latest"), "step_" + std::to_string(s * 100) + "\n");
  }
  EXPECT_EQ(list_steps(ckpt), (std::vector<int64_t>{400, 500}));
  EXPECT_FALSE(fs::exists(ckpt + "/step_300"));
  EXPECT_TRUE(tmp_entries(ckpt).empty());
  FakeState(4.0f).expect_matches(LoadedCheckpoint::open(ckpt + "/step_400"));

  save_checkpoint(ckpt, 600, FakeState(6.0f).files(json::object()), 0);  // keep all
  EXPECT_EQ(list_steps(ckpt), (std::vector<int64_t>{400, 500, 600}));
  save_checkpoint(ckpt, 700, FakeState(7.0f).files(json::object()), 1);  // only the new one
  EXPECT_EQ(list_steps(ckpt), std::vector<int64_t>{700});
  EXPECT_EQ(*resolve_checkpoint(ckpt), ckpt + "/step_700");
}

TEST(Checkpoint, SavingALowerStepNeverPrunesIt) {
  // Resuming from an older step and saving again: the new step survives pruning and `latest`
  // names it, even though a higher-numbered step exists.
  TempDir dir;
  const std::string ckpt = dir.path();
  save_checkpoint(ckpt, 10, FakeState(1.0f).files(json::object()), 2);
  save_checkpoint(ckpt, 20, FakeState(2.0f).files(json::object()), 2);
  save_checkpoint(ckpt, 15, FakeState(3.0f).files(json::object()), 2);
  EXPECT_EQ(list_steps(ckpt), (std::vector<int64_t>{15, 20}));
  EXPECT_EQ(*resolve_checkpoint(ckpt), ckpt + "/step_15");
}

TEST(Checkpoint, ResavingAStepReplacesIt) {
  TempDir dir;
  const std::string ckpt = dir.path();
  save_checkpoint(ckpt, 3, FakeState(1.0f).files({{"tag", "first"}}), 0);
  save_checkpoint(ckpt, 3, FakeState(9.0f).files({{"tag", "second"}}), 0);
  EXPECT_EQ(list_steps(ckpt), std::vector<int64_t>{3});
  EXPECT_TRUE(tmp_entries(ckpt).empty());
  const auto c = LoadedCheckpoint::open(ckpt + "/step_3");
  EXPECT_EQ(c.train_state()["tag"], "second");
  FakeState(9.0f).expect_matches(c);
}

TEST(Checkpoint, StaleTemporariesAreRemovedOnTheNextSave) {
  TempDir dir;
  const std::string ckpt = dir.path();
  fs::create_directories(ckpt + "/.tmp-step_9-4242");
  std::ofstream(ckpt + "/.tmp-step_9-4242/model.safetensors") << "partial";
  fs::create_directories(ckpt + "/.tmp-prune-step_1-4242");
  fs::create_directories(ckpt + "/.tmp-old-step_3-4242");
  std::ofstream(ckpt + "/latest.tmp") << "step_9\n";
  EXPECT_TRUE(list_steps(ckpt).empty());  // none of these is a complete step
  save_checkpoint(ckpt, 12, FakeState(1.0f).files(json::object()), 0);
  EXPECT_TRUE(tmp_entries(ckpt).empty());
  EXPECT_EQ(list_steps(ckpt), std::vector<int64_t>{12});
}

TEST(Checkpoint, CorruptedByteIsAChecksumMismatch) {
  TempDir dir;
  const std::string step_dir = save_checkpoint(dir.path(), 1, FakeState(1.0f).files(json::object()), 0);
  const std::string model = step_dir + "/model.safetensors";
  {
    std::fstream f(model, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-5, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(-5, std::ios::end);
    f.write(&c, 1);
  }
  expect_error([&] { LoadedCheckpoint::open(step_dir); },
               {"checksum mismatch", model, "manifest sha256", "file has"});
}

TEST(Checkpoint, TruncatedFileIsRefused) {
  TempDir dir;
  const std::string step_dir = save_checkpoint(dir.path(), 1, FakeState(1.0f).files(json::object()), 0);
  const std::string optim = step_dir + "/optim.safetensors";
  const auto size = fs::file_size(optim);
  fs::resize_file(optim, size - 4);
  expect_error([&] { LoadedCheckpoint::open(step_dir); },
               {optim, std::to_string(size - 4) + " bytes", "expects " + std::to_string(size), "truncated"});
  fs::remove(optim);
  expect_error([&] { LoadedCheckpoint::open(step_dir); }, {optim, "missing"});
}

TEST(Checkpoint, ShapeMismatchNamesTheTensor) {
  TempDir dir;
  const std::string step_dir = save_checkpoint(dir.path(), 1, FakeState(1.0f).files(json::object()), 0);
  const auto c = LoadedCheckpoint::open(step_dir);
  std::vector<float> out(1024);
  expect_error([&] { c.read_model("model.embed_tokens.weight", {8, 16}, out.data()); },
               {"'model.embed_tokens.weight'", "[16, 8]", "expected [8, 16]", step_dir + "/model.safetensors"});
  expect_error([&] { c.read_optim("model.norm.weight.exp_avg", {9}, out.data()); },
               {"'model.norm.weight.exp_avg'", "[8]", "[9]", "optim.safetensors"});
  expect_error([&] { c.read_model("model.layers.1.absent", {8}, out.data()); },
               {"'model.layers.1.absent'", "not found", "model.safetensors"});
}

TEST(Checkpoint, MissingManifestIsNotAStep) {
  TempDir dir;
  const std::string ckpt = dir.path();
  save_checkpoint(ckpt, 1, FakeState(1.0f).files(json::object()), 0);
  save_checkpoint(ckpt, 2, FakeState(2.0f).files(json::object()), 0);
  fs::remove(ckpt + "/step_2/manifest.json");
  EXPECT_EQ(list_steps(ckpt), std::vector<int64_t>{1});
  expect_error([&] { LoadedCheckpoint::open(ckpt + "/step_2"); }, {"no manifest.json", "step_2"});
  // `latest` still names step_2: resolving says so instead of silently going back to step_1.
  expect_error([&] { resolve_checkpoint(ckpt); }, {"step_2", "not a complete checkpoint"});
  expect_error([&] { resolve_checkpoint(ckpt + "/step_2"); }, {"step_2", "no manifest.json"});
  // Without `latest`, the highest complete step is the answer.
  fs::remove(ckpt + "/latest");
  EXPECT_EQ(*resolve_checkpoint(ckpt), ckpt + "/step_1");
}

TEST(Checkpoint, ResolveWithNothingThere) {
  TempDir dir;
  EXPECT_FALSE(resolve_checkpoint(dir.sub("does_not_exist")).has_value());
  EXPECT_FALSE(resolve_checkpoint(dir.path()).has_value());
  EXPECT_TRUE(list_steps(dir.sub("does_not_exist")).empty());
  fs::create_directories(dir.sub("step_x"));
  fs::create_directories(dir.sub("step_007"));  // not canonical: never a step
  EXPECT_TRUE(list_steps(dir.path()).empty());
  std::ofstream(dir.sub("latest")) << "../elsewhere\n";
  expect_error([&] { resolve_checkpoint(dir.path()); }, {"latest", "expected step_<N>"});
}

TEST(Checkpoint, ManifestIsValidated) {
  TempDir dir;
  const std::string step_dir = save_checkpoint(dir.path(), 5, FakeState(1.0f).files(json::object()), 0);
  const std::string mpath = step_dir + "/manifest.json";
  const json good = json::parse(read_text(mpath));
  auto write_manifest = [&](const json& m) { std::ofstream(mpath, std::ios::trunc) << m.dump(); };

  json m = good;
  m["version"] = 3;
  write_manifest(m);
  expect_error([&] { LoadedCheckpoint::open(step_dir); }, {"version 3", "not supported"});
  m["version"] = 2;  // sliced: needs world_size and a slice map
  write_manifest(m);
  expect_error([&] { LoadedCheckpoint::open(step_dir); }, {"sliced checkpoint needs", "world_size"});
  m = good;
  m["format"] = "other";
  write_manifest(m);
  expect_error([&] { LoadedCheckpoint::open(step_dir); }, {"format", "moecore-checkpoint"});
  m = good;
  m["files"]["../outside"] = good["files"]["train_state.json"];
  write_manifest(m);
  expect_error([&] { LoadedCheckpoint::open(step_dir); }, {"'../outside'", "plain file name"});
  m = good;
  m["files"].erase("model.safetensors");
  write_manifest(m);
  expect_error([&] { LoadedCheckpoint::open(step_dir); }, {"does not list model.safetensors"});
  std::ofstream(mpath, std::ios::trunc) << "{ not json";
  expect_error([&] { LoadedCheckpoint::open(step_dir); }, {mpath, "not a JSON object"});
  write_manifest(good);
  EXPECT_EQ(LoadedCheckpoint::open(step_dir).step(), 5);
}

// ---- crash safety ------------------------------------------------------------------------

constexpr int64_t kCrashModelFloats = 12 << 20;  // 48 MiB of parameters in two tensors
constexpr int64_t kCrashOptimFloats = 2 << 20;   // 2 x 8 MiB of moments
constexpr int64_t kCrashKeepLast = 3;

// Exactly representable: step and tensor id in the integer part, i mod 1024 in the fraction.
float crash_value(int64_t step, int tensor, int64_t i) {
  return float(step * 8 + tensor) + float(i & 1023) / 1024.0f;
}

void fill_crash_tensor(std::vector<float>& v, int64_t step, int tensor) {
  for (int64_t i = 0; i < int64_t(v.size()); ++i) v[i] = crash_value(step, tensor, i);
}

// The forked writer: saves steps first_step, first_step + 1, ... until killed, and after each
// save_checkpoint returns writes the step (8 bytes, atomic on a pipe) to `report_fd`. It only
// allocates and does file I/O, so an idle thread the parent might own (none is started here)
// cannot deadlock it. Leaves through _exit so the parent's test state is never flushed twice.
[[noreturn]] void crash_writer(const std::string& ckpt, int64_t first_step, int report_fd) {
  try {
    const int64_t half = kCrashModelFloats / 2;
    std::vector<float> a(half), b(half), m(kCrashOptimFloats / 2), v(kCrashOptimFloats / 2);
    for (int64_t step = first_step;; ++step) {
      fill_crash_tensor(a, step, 0);
      fill_crash_tensor(b, step, 1);
      fill_crash_tensor(m, step, 2);
      fill_crash_tensor(v, step, 3);
      CheckpointFiles f;
      f.model = {{"w.a", DType::kF32, {half / 1024, 1024}, a.data()},
                 {"w.b", DType::kF32, {half}, b.data()}};
      f.optim = {{"w.a.exp_avg", DType::kF32, {int64_t(m.size())}, m.data()},
                 {"w.a.exp_avg_sq", DType::kF32, {int64_t(v.size())}, v.data()}};
      f.train_state = {{"data_position", step * 1000}};
      save_checkpoint(ckpt, step, f, kCrashKeepLast);
      if (::write(report_fd, &step, sizeof(step)) != sizeof(step)) ::_exit(4);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "crash writer failed: %s\n", e.what());
    std::fflush(stderr);
    ::_exit(3);
  }
}

// One step report from the writer within timeout_ms; false on timeout or end of stream.
bool read_report(int fd, int timeout_ms, int64_t* step) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, timeout_ms) <= 0) return false;
  return ::read(fd, step, sizeof(*step)) == sizeof(*step);
}

// Opens (and so verifies sizes and checksums of) a step, then checks its values belong to it.
void verify_crash_step(const std::string& step_dir, int64_t step) {
  SCOPED_TRACE(step_dir);
  const auto c = LoadedCheckpoint::open(step_dir);
  ASSERT_EQ(c.step(), step);
  EXPECT_EQ(c.train_state()["data_position"], step * 1000);
  const int64_t half = kCrashModelFloats / 2;
  std::vector<float> out(half);
  c.read_model("w.b", {half}, out.data());
  int64_t wrong = 0;
  for (int64_t i = 0; i < half; ++i) wrong += out[i] != crash_value(step, 1, i);
  EXPECT_EQ(wrong, 0);
  out.resize(kCrashOptimFloats / 2);
  c.read_optim("w.a.exp_avg_sq", {int64_t(out.size())}, out.data());
  EXPECT_EQ(out.back(), crash_value(step, 3, int64_t(out.size()) - 1));
}

// train_state.json is read with typed, range-checked fields whose errors name the file and the
// field (before: a string step or a negative position ended in nlohmann's type_error).
TEST(Checkpoint, TrainStateFieldsAreTypedAndRangeChecked) {
  TempDir dir;
  const FakeState state(1.0f);
  auto step_with = [&](int64_t step, json ts) {
    return LoadedCheckpoint::open(save_checkpoint(dir.sub("ck" + std::to_string(step)), step, state.files(ts), 0));
  };
  const TrainState good = read_train_state(step_with(5, {{"data_position", 7}, {"optimizer_steps", 4}, {"config", "x"}}));
  EXPECT_EQ(good.step, 5);
  EXPECT_EQ(good.data_position, 7);
  EXPECT_EQ(good.optimizer_steps, 4);
  EXPECT_EQ(good.config, "x");
  const TrainState old = read_train_state(step_with(6, json::object()));  // the first checkpoints' fields
  EXPECT_EQ(old.data_position, 6);
  EXPECT_EQ(old.optimizer_steps, 6);
  EXPECT_FALSE(old.config.has_value());

  const auto ck = step_with(8, {{"data_position", "7"}});
  expect_error([&] { read_train_state(ck); },
               {dir.sub("ck8/step_8/train_state.json"), "'data_position' must be an integer in [0, 2^40]",
                "got the string \"7\""});
  expect_error([&] { read_train_state(step_with(9, {{"data_position", -1}})); }, {"'data_position'", "got the integer -1"});
  expect_error([&] { read_train_state(step_with(10, {{"optimizer_steps", 11}})); },
               {"'optimizer_steps' must be an integer in [0, 10]", "got the integer 11"});
  expect_error([&] { read_train_state(step_with(11, {{"optimizer_steps", 1.5}})); }, {"got the number 1.5"});
  expect_error([&] { read_train_state(step_with(12, {{"config", 3}})); }, {"'config' must be a string, got the integer 3"});
  expect_error([&] { checkpoint_config(step_with(13, json::object())); }, {"has no 'config'"});
  expect_error([&] { checkpoint_config(step_with(14, {{"config", "[model]\nn_layers = \"two\"\n"}})); },
               {"train_state.json (its 'config')", "model.n_layers: expected an integer"});
  const uint64_t beyond = uint64_t(1) << 63;
  expect_error([&] { read_train_state(step_with(15, {{"data_position", beyond}})); },
               {"'data_position'", "got the integer 9223372036854775808"});
}

// The resume check compares every model.* and moe.* key of the stored config with the run's.
TEST(Checkpoint, ResumeCheckListsEveryDifferingModelKey) {
  TempDir dir;
  Config saved;
  saved.model.dense_layers = {};
  const auto ck = LoadedCheckpoint::open(
      save_checkpoint(dir.path(), 1, FakeState(1.0f).files({{"config", config_to_toml(saved)}}), 0));
  Config run = saved;
  run.train.steps = 1000;  // other sections may change
  run.optim.lr = 1e-4;
  run.model.dense_hidden = 7;  // unused without dense layers
  EXPECT_NO_THROW(check_resume_config(ck, run));
  run.model.n_layers = 2;
  run.moe.capacity_factor = 1.5;
  expect_error([&] { check_resume_config(ck, run); },
               {"cannot resume from '" + dir.sub("step_1") + "'", "in 2 keys:",
                "model.n_layers: 4 in the checkpoint, 2 in this run",
                "moe.capacity_factor: 0.0 in the checkpoint, 1.5 in this run", "checkpoint.resume = \"none\""});
  run = saved;
  run.model.dense_layers = {0};
  run.model.dense_hidden = 7;
  expect_error([&] { check_resume_config(ck, run); },
               {"model.dense_layers: [] in the checkpoint, [0] in this run", "model.dense_hidden: 512"});
}

// A sliced manifest whose shape does not fit int64 is refused, never listed wrapped.
TEST(Checkpoint, SlicedShapeOutsideInt64IsRefused) {
  TempDir dir;
  auto self = make_self_comm();
  std::vector<float> w(6, 1.f);
  SlicedCheckpointFiles files;
  files.model.push_back({"w", {2, 3}, 0, 6, w.data()});
  const std::string step = save_checkpoint_sliced(*self, dir.path(), 1, files, 0);
  const std::string manifest_path = step + "/manifest.json";
  const json manifest = json::parse(read_text(manifest_path));
  auto with_shape = [&](const json& shape) {
    json m = manifest;
    m["tensors"]["model"]["w"]["shape"] = shape;
    std::ofstream(manifest_path) << m.dump();
  };
  with_shape({uint64_t(1) << 63, 2});  // 2^64 + ... wraps to a small count in int64
  expect_error([&] { LoadedCheckpoint::open(step); },
               {manifest_path, "tensor 'w' has the dimension 9223372036854775808 in its shape"});
  with_shape({int64_t(1) << 62, 4});  // each fits, the product does not
  expect_error([&] { LoadedCheckpoint::open(step); }, {"the element count of tensor 'w' overflows int64"});
  with_shape({2, 3});
  EXPECT_EQ(LoadedCheckpoint::open(step).model_tensors()[0].shape, (Shape{2, 3}));
}

// Unblocks a reader stuck opening the FIFO at `path` (by opening its write end) if the test is
// still running after 10 s and remembers that it had to, so that a reader that blocks fails the
// test instead of hanging it.
class FifoWatchdog {
 public:
  explicit FifoWatchdog(std::string path)
      : thread_([this, path = std::move(path)] {
          std::unique_lock<std::mutex> lock(mu_);
          if (cv_.wait_for(lock, std::chrono::seconds(10), [this] { return done_; })) return;
          fired_ = true;
          const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK);
          if (fd >= 0) ::close(fd);
        }) {}
  // True once the watchdog had to unblock a reader.
  bool fired() {
    std::lock_guard<std::mutex> lock(mu_);
    return fired_;
  }
  ~FifoWatchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false, fired_ = false;
  std::thread thread_;
};

// Opening a FIFO or a directory where a checkpoint file belongs fails at once, naming the path.
TEST(Checkpoint, FifoOrDirectoryInPlaceOfAFileIsRefused) {
  TempDir dir;
  const std::string step = save_checkpoint(dir.path(), 1, FakeState(1.0f).files(json::object()), 0);
  fs::remove(step + "/model.safetensors");
  ASSERT_EQ(::mkfifo((step + "/model.safetensors").c_str(), 0644), 0);
  FifoWatchdog watchdog(step + "/model.safetensors");
  expect_error([&] { LoadedCheckpoint::open(step); }, {step + "/model.safetensors", "not a regular file"});
  expect_error([&] { SafetensorsFile::open(step + "/model.safetensors"); },
               {step + "/model.safetensors", "is a FIFO: expected a regular file"});
  expect_error([&] { read_regular_file(step + "/model.safetensors"); },
               {step + "/model.safetensors", "is a FIFO: expected a regular file"});
  EXPECT_FALSE(watchdog.fired()) << "a reader blocked opening the FIFO";
  expect_error([&] { read_regular_file(step); }, {step + "' is a directory: expected a regular file"});
  expect_error([&] { SafetensorsFile::open(step); }, {step + "' is a directory: expected a regular file"});
  fs::remove(step + "/manifest.json");
  ASSERT_EQ(::mkfifo((step + "/manifest.json").c_str(), 0644), 0);
  expect_error([&] { LoadedCheckpoint::open(step); }, {step, "no manifest.json"});
}

// write_file_atomic replaces a file whole through a staged name, and a failed write leaves the
// earlier file as it was.
TEST(Files, AtomicWriteReplacesWholeOrNothing) {
  TempDir dir;
  const std::string path = dir.sub("out.bin");
  write_file_atomic(path, "first");
  EXPECT_EQ(read_regular_file(path), "first");
  write_file_atomic(path, "second, longer");
  EXPECT_EQ(read_regular_file(path), "second, longer");
  EXPECT_EQ(staging_path(path), dir.sub(".out.bin.tmp-" + std::to_string(::getpid())));
  fs::create_directory(staging_path(path));  // the staging name is taken: the write cannot start
  expect_error([&] { write_file_atomic(path, "third"); }, {"cannot write '" + path + "'"});
  EXPECT_EQ(read_regular_file(path), "second, longer");
  fs::remove(staging_path(path));
  expect_error([&] { write_file_atomic(dir.sub("missing/out.bin"), "x"); }, {dir.sub("missing/out.bin")});
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{"out.bin"});
}

// A checkpoint directory that cannot be written: the save fails naming it and what to do, and
// the earlier checkpoints stay loadable. As root (who writes anywhere) the save runs in a child
// that drops to an unprivileged user first.
TEST(Checkpoint, ReadOnlyDirectoryFailsNamingItAndKeepsEarlierSteps) {
  TempDir dir;
  const std::string ckpt = dir.sub("ckpt");
  const FakeState state(1.0f);
  save_checkpoint(ckpt, 1, state.files(json::object()), 0);
  ASSERT_EQ(::chmod(ckpt.c_str(), 0555), 0);
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(fds[0]);
    std::string msg = "no error";
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) msg = "cannot drop root";
    else {
      try {
        save_checkpoint(ckpt, 2, FakeState(2.0f).files(json::object()), 1);
      } catch (const std::exception& e) {
        msg = e.what();
      }
    }
    const ssize_t put = ::write(fds[1], msg.data(), msg.size());
    ::_exit(put == ssize_t(msg.size()) ? 0 : 1);
  }
  ::close(fds[1]);
  std::string msg;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) msg.append(buf, size_t(n));
  ::close(fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ::chmod(ckpt.c_str(), 0755);
  if (msg == "cannot drop root") GTEST_SKIP() << "running as root and cannot switch to an unprivileged user";
  EXPECT_NE(msg.find("cannot save the checkpoint of step 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cannot write into checkpoint directory '" + ckpt + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Permission denied"), std::string::npos) << msg;
  EXPECT_NE(msg.find("set checkpoint.dir to a writable directory"), std::string::npos) << msg;
  EXPECT_EQ(list_steps(ckpt), std::vector<int64_t>{1});
  EXPECT_EQ(*resolve_checkpoint(ckpt), ckpt + "/step_1");
  state.expect_matches(LoadedCheckpoint::open(ckpt + "/step_1"));
}

// Each round forks a writer, waits until it reports one finished save (so slow machines and
// sanitizer builds still make progress), then SIGKILLs it after a seeded random delay of up to
// 1.5x that save's duration, which lands anywhere inside the following save. Every save that
// returned must survive; `latest` must name it or the one after; every complete step verifies.
TEST(CheckpointCrash, KilledWriterLeavesVerifiableCheckpoints) {
  TempDir dir;
  const std::string ckpt = dir.sub("ckpt");
  std::mt19937_64 gen(314159);
  int64_t next_step = 1;
  constexpr int kRounds = 8;
  for (int round = 0; round < kRounds; ++round) {
    int fds[2];
    ASSERT_EQ(::pipe2(fds, O_CLOEXEC), 0);
    std::fflush(stdout);
    std::fflush(stderr);
    const auto start = std::chrono::steady_clock::now();
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0) << "fork failed";
    if (pid == 0) {
      ::close(fds[0]);
      crash_writer(ckpt, next_step, fds[1]);
    }
    ::close(fds[1]);
    int64_t reported = -1;
    const bool progressed = read_report(fds[0], 300'000, &reported);
    const auto first_save_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
    const int64_t delay_ms = progressed ? int64_t(gen() % uint64_t(first_save_ms * 3 / 2 + 1)) : 0;
    ::usleep(useconds_t(delay_ms) * 1000);
    ::kill(pid, SIGKILL);
    int status = 0;
    const pid_t waited = ::waitpid(pid, &status, 0);
    for (int64_t s = 0; read_report(fds[0], 0, &s);) reported = s;  // saves finished during the delay
    ::close(fds[0]);
    ASSERT_EQ(waited, pid);
    ASSERT_TRUE(progressed) << "the writer finished no save within 300 s";
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "the writer ended by itself (exit code " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1) << ")";

    SCOPED_TRACE("round " + std::to_string(round) + ": killed " + std::to_string(delay_ms) +
                 " ms after a save, last reported step " + std::to_string(reported));
    const auto steps = list_steps(ckpt);
    const auto latest = resolve_checkpoint(ckpt);
    ASSERT_TRUE(latest.has_value());
    const int64_t latest_step = LoadedCheckpoint::open(*latest).step();
    EXPECT_EQ(*latest, ckpt + "/step_" + std::to_string(latest_step));
    // Killed after `latest` moved but before reporting: one step ahead of the report.
    EXPECT_TRUE(latest_step == reported || latest_step == reported + 1) << "latest is step " << latest_step;
    EXPECT_NE(std::find(steps.begin(), steps.end(), reported), steps.end());
    // A kill between publishing a step and pruning leaves keep_last + 1 steps.
    EXPECT_LE(int64_t(steps.size()), kCrashKeepLast + 1);
    for (int64_t s : steps) verify_crash_step(ckpt + "/step_" + std::to_string(s), s);
    next_step = steps.back() + 1;
  }
  // The next ordinary save cleans up whatever the kills left behind.
  const std::string final_dir = save_checkpoint(ckpt, next_step, FakeState(1.0f).files(json::object()), 1);
  EXPECT_TRUE(tmp_entries(ckpt).empty());
  EXPECT_EQ(list_steps(ckpt), std::vector<int64_t>{next_step});
  EXPECT_EQ(*resolve_checkpoint(ckpt), final_dir);
}

}  // namespace
}  // namespace moe::testing
