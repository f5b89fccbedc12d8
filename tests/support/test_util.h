// Shared test helpers: the message of an expected moe::Error, and a temporary directory that
// is removed with everything in it when the test ends.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

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

}  // namespace moe::testing
