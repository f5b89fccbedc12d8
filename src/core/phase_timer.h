// Wall-clock time per phase of a training step (core/phase.h), accumulated lap by lap: lap(p)
// closes the running phase and opens p; stop() closes it. Disabled timers cost one branch per lap.
// CPU timing only (the GPU backend records CUDA events per phase: cuda/event_timer.h).
// With record_intervals(true) every closed lap is also kept as an interval with its start and end
// (a step trace, train/trace.h); take_intervals() hands them over and starts a new list.
#pragma once

#include <array>
#include <chrono>
#include <string_view>
#include <utility>
#include <vector>

#include "core/phase.h"

namespace moe {

// One closed phase interval: seconds on the steady clock (since its epoch).
struct PhaseInterval {
  Phase phase = Phase::kEmbedding;
  double start_s = 0, end_s = 0;
};

inline double steady_seconds(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

class PhaseTimer {
 public:
  void enable(bool on) { enabled_ = on; }
  bool enabled() const { return enabled_; }
  void lap(Phase p) {
    if (!enabled_) return;
    const auto now = Clock::now();
    if (running_ >= 0) close_lap(now);
    running_ = static_cast<int>(p);
    since_ = now;
  }
  void stop() {
    if (!enabled_ || running_ < 0) return;
    close_lap(Clock::now());
    running_ = -1;
  }
  void reset() { seconds_.fill(0.0); running_ = -1; }
  double seconds(Phase p) const { return seconds_[static_cast<int>(p)]; }

  // Intervals: kept while on (and enabled); reset() leaves them, take_intervals() empties them.
  void record_intervals(bool on) { recording_ = on; }
  std::vector<PhaseInterval> take_intervals() { return std::exchange(intervals_, {}); }

 private:
  using Clock = std::chrono::steady_clock;
  void close_lap(Clock::time_point now) {
    seconds_[running_] += std::chrono::duration<double>(now - since_).count();
    if (recording_) intervals_.push_back({static_cast<Phase>(running_), steady_seconds(since_), steady_seconds(now)});
  }
  bool enabled_ = false;
  bool recording_ = false;
  std::vector<PhaseInterval> intervals_;
  int running_ = -1;
  Clock::time_point since_;
  std::array<double, kNumPhases> seconds_{};
};

}  // namespace moe
