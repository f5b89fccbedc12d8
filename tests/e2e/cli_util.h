// Running the real moecore binary from e2e tests: its exit status and its stdout and stderr
// together. `prefix` goes in front of the binary on the shell line: environment assignments
// ("MOECORE_DEBUG=1") or a wrapper ("timeout 20").
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace moe::testing {

struct CmdResult {
  int status;
  std::string output;
};

inline CmdResult run_cli(const std::string& args, const std::string& prefix = "") {
  const std::string cmd = prefix + (prefix.empty() ? "" : " ") + std::string(MOECORE_BINARY) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int rc = pclose(p);
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, out};
}

}  // namespace moe::testing
