// Wall-clock time per phase of a training step (core/phase.h), accumulated lap by lap: lap(p)
// closes the running phase and opens p; stop() closes it. Disabled timers cost one branch per lap.
// CPU timing only (the GPU backend records CUDA events per phase: cuda/event_timer.h).
#pragma once

#include <array>
#include <chrono>
#include <string_view>

#include "core/phase.h"

namespace moe {

class PhaseTimer {
 public:
  void enable(bool on) { enabled_ = on; }
  bool enabled() const { return enabled_; }
  void lap(Phase p) {
    if (!enabled_) return;
    const auto now = Clock::now();
    if (running_ >= 0) seconds_[running_] += std::chrono::duration<double>(now - since_).count();
    running_ = static_cast<int>(p);
    since_ = now;
  }
  void stop() {
    if (!enabled_ || running_ < 0) return;
    seconds_[running_] += std::chrono::duration<double>(Clock::now() - since_).count();
    running_ = -1;
  }
  void reset() { seconds_.fill(0.0); running_ = -1; }
  double seconds(Phase p) const { return seconds_[static_cast<int>(p)]; }

 private:
  using Clock = std::chrono::steady_clock;
  bool enabled_ = false;
  int running_ = -1;
  Clock::time_point since_;
  std::array<double, kNumPhases> seconds_{};
};

}  // namespace moe
