// Shared test helpers: the message of an expected moe::Error, and a temporary directory that
// is removed with everything in it when the test ends.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/error.h"

namespace moe::testing {

// The message of the moe::Error that `f` throws ("" and a test failure when it does not throw).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const moe::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a moe::Error";
  return "";
}

// A fresh directory under the system temp dir, unique per process and instance.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "test") {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("moecore_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& root() const { return path_; }
  std::string path() const { return path_.string(); }
  std::string sub(const std::string& name) const { return (path_ / name).string(); }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

// The records of <run_dir>/metrics.jsonl, and the training losses among them.
// The small OLMoE-style model of the CPU training tests: width 32, 4 heads over 2 KV heads,
// a dense layer 0 (hidden 64) then MoE layers of 4 experts top-2 (hidden 32) with expert-bias
// updates; 16-token sequences in micro-batches of 2, warm-up 2, a log line per step, no eval.
inline Config small_train_config(const std::filesystem::path& run_dir, int64_t n_layers, int64_t global_batch,
                                 int64_t steps) {
  Config c;
  c.model.d_model = 32;
  c.model.n_layers = n_layers;
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.dense_layers = {0};
  c.model.dense_hidden = 64;
  c.moe.num_experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 32;
  c.moe.bias_update_rate = 0.001;
  c.train.seq_len = 16;
  c.train.micro_batch = 2;
  c.train.global_batch = global_batch;
  c.train.steps = steps;
  c.train.eval_interval = 0;
  c.optim.warmup_steps = 2;
  c.log.interval = 1;
  c.run.dir = run_dir.string();
  return c;
}

// The model of the GPU training tests (head_dim 64: width 256, 4 heads over 2 KV heads; a dense
// layer 0 of hidden 512, then 8 experts top-2 of hidden 128 with a shared expert), 64-token
// sequences, global batch 8, BF16 on `device` unless given otherwise, a log line per step.
inline Config small_gpu_train_config(const std::filesystem::path& run_dir, int64_t micro_batch, int64_t steps,
                                     const std::string& device = "cuda", const std::string& precision = "bf16") {
  Config c;
  c.model.d_model = 256;
  c.model.n_layers = 3;
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.dense_layers = {0};
  c.model.dense_hidden = 512;
  c.moe.num_experts = 8;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 128;
  c.moe.shared_experts = 1;
  c.train.seq_len = 64;
  c.train.micro_batch = micro_batch;
  c.train.global_batch = 8;
  c.train.steps = steps;
  c.train.device = device;
  c.train.precision = precision;
  c.log.interval = 1;
  c.run.dir = run_dir.string();
  return c;
}

// The complete records of RUN_DIR/metrics.jsonl: lines ended by '\n'. A last line without one is a
// record the trainer is still writing (a test polling a live run reads it), so it is left out.
inline std::vector<nlohmann::json> read_metrics(const std::filesystem::path& run_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream f(run_dir / "metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    if (f.eof()) break;  // no '\n' after it: not complete yet
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

inline std::vector<double> train_losses(const std::filesystem::path& run_dir) {
  std::vector<double> out;
  for (const auto& r : read_metrics(run_dir))
    if (r.contains("loss")) out.push_back(r["loss"].get<double>());
  return out;
}

// Sets an environment variable for its lifetime (the switches read at each call or plan), then
// restores what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) {
      ::setenv(name_, old_.c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

}  // namespace moe::testing
