// Shared test helpers: the message of an expected moe::Error, and a temporary directory that
// is removed with everything in it when the test ends.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

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
inline std::vector<nlohmann::json> read_metrics(const std::filesystem::path& run_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream f(run_dir / "metrics.jsonl");
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

inline std::vector<double> train_losses(const std::filesystem::path& run_dir) {
  std::vector<double> out;
  for (const auto& r : read_metrics(run_dir))
    if (r.contains("loss")) out.push_back(r["loss"].get<double>());
  return out;
}

}  // namespace moe::testing
