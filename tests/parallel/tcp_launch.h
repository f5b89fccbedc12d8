// Starts a torchrun-style job for the tests: N processes of one command with RANK, LOCAL_RANK,
// WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT (a port that was free a
// moment ago) in their environment, waits for all of them (killing them past a time limit) and
// returns every rank's exit status, and its output when asked to keep it (a file per rank).
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace moe::testing {

// A TCP port nobody listened on a moment ago (bind port 0 on the loopback, read it back).
inline int free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 29500;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  int port = 29500;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

struct RankRun {
  int status = -1;     // exit status, 128 + signal, or 124 when killed at the time limit
  std::string output;  // stdout and stderr, when kept
};

struct TcpJob {
  std::vector<RankRun> ranks;
  double seconds = 0;
  int worst() const {
    int w = 0;
    for (const RankRun& r : ranks) w = std::max(w, r.status);
    return w;
  }
  std::string all_output() const {
    std::string s;
    for (size_t r = 0; r < ranks.size(); ++r)
      s += "---- rank " + std::to_string(r) + " (status " + std::to_string(ranks[r].status) + ")\n" + ranks[r].output;
    return s;
  }
};

// Runs `argv` as ranks 0..np-1. `env` adds or replaces NAME=value pairs for every rank (also
// the ones set here, e.g. MASTER_PORT), and a bare NAME removes that variable. With `log_dir` each rank's output goes to log_dir/rank_<r>.log
// and comes back in RankRun::output; without, the ranks inherit this process's stdout/stderr.
inline TcpJob launch_tcp_job(int np, const std::vector<std::string>& argv, const std::vector<std::string>& env,
                             double limit_s, const std::filesystem::path& log_dir = {}) {
  TcpJob job;
  job.ranks.resize(size_t(np));
  const int port = free_tcp_port();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<pid_t> pids(size_t(np), -1);
  for (int r = 0; r < np; ++r) {
    std::vector<std::string> vars;
    std::vector<std::string> set = {"RANK=" + std::to_string(r),       "LOCAL_RANK=" + std::to_string(r),
                                    "WORLD_SIZE=" + std::to_string(np), "LOCAL_WORLD_SIZE=" + std::to_string(np),
                                    "MASTER_ADDR=127.0.0.1",            "MASTER_PORT=" + std::to_string(port)};
    set.insert(set.end(), env.begin(), env.end());
    auto name_of = [](const std::string& kv) { return kv.substr(0, kv.find('=')); };
    for (size_t i = 0; i < set.size(); ++i)  // a later entry replaces an earlier one of that name
      for (size_t j = i + 1; j < set.size(); ++j)
        if (name_of(set[i]) == name_of(set[j])) set[i].clear();
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string kv = *e;
      bool replaced = false;
      for (const std::string& s : set) replaced = replaced || (!s.empty() && name_of(s) == name_of(kv));
      if (!replaced) vars.push_back(kv);
    }
    for (const std::string& s : set)
      if (s.find('=') != std::string::npos) vars.push_back(s);
    std::vector<char*> envp, args;
    for (std::string& v : vars) envp.push_back(v.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_copy = argv;
    for (std::string& a : argv_copy) args.push_back(a.data());
    args.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    const std::string log = log_dir.empty() ? "" : (log_dir / ("rank_" + std::to_string(r) + ".log")).string();
    if (!log.empty()) {
      posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      posix_spawn_file_actions_adddup2(&fa, 1, 2);
    }
    pid_t pid = -1;
    if (posix_spawn(&pid, args[0], &fa, nullptr, args.data(), envp.data()) == 0) pids[size_t(r)] = pid;
    posix_spawn_file_actions_destroy(&fa);
  }
  const auto deadline = t0 + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                 std::chrono::duration<double>(limit_s));
  for (int left = np; left > 0;) {
    left = 0;
    for (int r = 0; r < np; ++r) {
      pid_t& pid = pids[size_t(r)];
      if (pid < 0) continue;
      int st = 0;
      const pid_t w = ::waitpid(pid, &st, WNOHANG);
      if (w == pid) {
        job.ranks[size_t(r)].status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
        pid = -1;
        continue;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &st, 0);
        job.ranks[size_t(r)].status = 124;
        pid = -1;
        continue;
      }
      ++left;
    }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  job.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!log_dir.empty()) {
    for (int r = 0; r < np; ++r) {
      std::ifstream f(log_dir / ("rank_" + std::to_string(r) + ".log"));
      std::ostringstream s;
      s << f.rdbuf();
      job.ranks[size_t(r)].output = s.str();
    }
  }
  return job;
}

}  // namespace moe::testing
