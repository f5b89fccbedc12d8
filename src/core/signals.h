// Graceful stop on SIGINT and SIGTERM for long-running commands. While a StopSignals lives, the
// first SIGINT or SIGTERM only records its number (the command finishes what it is doing, saves,
// and exits); a second one restores the default action and re-raises it, ending the process at
// once. The handler is async-signal-safe (an atomic store and one write(2) of a fixed line).
#pragma once

namespace moe {

class StopSignals {
 public:
  StopSignals();   // installs the handlers (and forgets an earlier request)
  ~StopSignals();  // restores the previous handlers
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The signal number of the first request since installation, or 0.
  static int requested();
  // "SIGINT", "SIGTERM" or "signal N".
  static const char* name(int signo);
};

}  // namespace moe
