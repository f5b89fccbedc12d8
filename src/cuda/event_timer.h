// Step time by phase on the GPU, measured with CUDA events on one stream (no host wait while
// recording). mark(p) closes the open phase and opens p (phases: core/phase.h); close() closes
// the open one. Each closed interval adds to its phase; collect() waits for the recorded events
// and returns the milliseconds per phase since the last collect(). Forward and backward of a
// phase add to the same phase. Not for use inside CUDA graph capture: profile an eager step.
// collect_intervals() is collect() that also returns each interval with its start and end (for a
// step trace). Where the toolkit has NVTX (nvtx3/nvToolsExt.h), each phase is also an NVTX range
// pushed at its mark and popped when it closes, so Nsight Systems shows the phases.
#pragma once

#include <array>
#include <memory>
#include <vector>

#include "core/phase.h"
#include "cuda/device.h"

namespace moe::cuda {

// The step's phases and their names are core/phase.h's; these names keep cuda::Phase,
// cuda::kNumPhases and cuda::phase_name working.
using Phase = moe::Phase;
using moe::kNumPhases;
using moe::phase_name;

class EventTimer {
 public:
  explicit EventTimer(Stream stream);
  ~EventTimer();
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  void mark(Phase p);
  void close();
  std::array<double, kNumPhases> collect();

  // One closed interval: milliseconds from the first event recorded since the last collect.
  struct Interval {
    Phase phase;
    double start_ms, end_ms;
  };
  // collect() that also fills `intervals` (in recording order); the returned sums are the same.
  std::array<double, kNumPhases> collect_intervals(std::vector<Interval>* intervals);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::cuda
