// StopSignals: sigaction handlers for SIGINT and SIGTERM around one atomic request word.
#include "core/signals.h"

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>

namespace moe {

namespace {

std::atomic<int> g_requested{0};
struct sigaction g_old_int, g_old_term;

void on_stop_signal(int signo) {
  int expected = 0;
  if (g_requested.compare_exchange_strong(expected, signo)) {
    static const char kLine[] =
        "\nmoecore: stop requested: finishing cleanly (training: the current step and its checkpoint); send the "
        "signal again to stop at once\n";
    ssize_t unused = ::write(STDERR_FILENO, kLine, sizeof kLine - 1);
    (void)unused;
    return;
  }
  // The second request: the default action, now.
  std::signal(signo, SIG_DFL);
  std::raise(signo);
}

}  // namespace

StopSignals::StopSignals() {
  g_requested.store(0);
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, &g_old_int);
  sigaction(SIGTERM, &sa, &g_old_term);
}

StopSignals::~StopSignals() {
  sigaction(SIGINT, &g_old_int, nullptr);
  sigaction(SIGTERM, &g_old_term, nullptr);
}

int StopSignals::requested() { return g_requested.load(); }

const char* StopSignals::name(int signo) {
  if (signo == SIGINT) return "SIGINT";
  if (signo == SIGTERM) return "SIGTERM";
  static thread_local char buf[32];
  std::snprintf(buf, sizeof buf, "signal %d", signo);
  return buf;
}

}  // namespace moe
