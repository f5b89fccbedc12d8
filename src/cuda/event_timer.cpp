// EventTimer on cudaEvent_t: each mark()/close() records one event from a pool that grows on
// demand and is reused after every collect(); an interval is a pair of consecutive events (the
// event that closes a phase also opens the next). collect() waits for the last recorded event
// and adds cudaEventElapsedTime of each interval to its phase.
#include "cuda/event_timer.h"

#include <cuda_runtime.h>

#include <vector>

#include "cuda/common.h"

#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define MOECORE_NVTX 1
#endif

namespace moe::cuda {

namespace {
// An NVTX range per open phase (host side, at the mark; Nsight projects it onto the GPU work).
void nvtx_push(Phase p) {
#ifdef MOECORE_NVTX
  nvtxRangePushA(phase_name(p));
#else
  (void)p;
#endif
}
void nvtx_pop() {
#ifdef MOECORE_NVTX
  nvtxRangePop();
#endif
}
}  // namespace

struct EventTimer::Impl {
  struct Interval {
    int phase;
    size_t begin, end;  // indices into events
  };
  cudaStream_t stream = nullptr;
  std::vector<cudaEvent_t> events;  // the pool; [0, used) recorded since the last collect()
  size_t used = 0;
  std::vector<Interval> intervals;
  int open_phase = -1;  // the phase whose interval started at events[open_event]
  size_t open_event = 0;

  // Records the next pool event on the stream and returns its index.
  size_t record() {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    MOE_CHECK(capture == cudaStreamCaptureStatusNone,
              "EventTimer: the stream is being captured into a CUDA graph; phase timing needs an eager step "
              "(set the timer only on steps that run without the graph)");
    if (used == events.size()) {
      cudaEvent_t e = nullptr;
      MOE_CUDA_CHECK(cudaEventCreate(&e));
      events.push_back(e);
    }
    MOE_CUDA_CHECK(cudaEventRecord(events[used], stream));
    return used++;
  }

  void close_open() {
    if (open_phase < 0) return;
    const size_t e = record();
    intervals.push_back({open_phase, open_event, e});
    open_phase = -1;
    nvtx_pop();
  }
};

EventTimer::EventTimer(Stream stream) : impl_(std::make_unique<Impl>()) { impl_->stream = stream; }

EventTimer::~EventTimer() {
  for (cudaEvent_t e : impl_->events) cudaEventDestroy(e);  // released once complete; never throws
}

void EventTimer::mark(Phase p) {
  MOE_CHECK(p >= Phase::kEmbedding && p < Phase::kCount, "EventTimer::mark: expected a phase below kCount, got ",
            static_cast<int>(p));
  Impl& s = *impl_;
  const size_t e = s.record();
  if (s.open_phase >= 0) {
    s.intervals.push_back({s.open_phase, s.open_event, e});
    nvtx_pop();
  }
  s.open_phase = static_cast<int>(p);
  s.open_event = e;
  nvtx_push(p);
}

void EventTimer::close() { impl_->close_open(); }

std::array<double, kNumPhases> EventTimer::collect() { return collect_intervals(nullptr); }

std::array<double, kNumPhases> EventTimer::collect_intervals(std::vector<Interval>* out) {
  Impl& s = *impl_;
  if (out) out->clear();
  s.close_open();  // a phase still open ends here
  std::array<double, kNumPhases> ms{};
  if (s.used > 0) {
    MOE_CUDA_CHECK(cudaEventSynchronize(s.events[s.used - 1]));
    for (const Impl::Interval& iv : s.intervals) {
      float t = 0.0f;
      MOE_CUDA_CHECK(cudaEventElapsedTime(&t, s.events[iv.begin], s.events[iv.end]));
      ms[iv.phase] += static_cast<double>(t);
      if (out) {
        float start = 0.0f;
        MOE_CUDA_CHECK(cudaEventElapsedTime(&start, s.events[0], s.events[iv.begin]));
        out->push_back({Phase(iv.phase), double(start), double(start) + double(t)});
      }
    }
  }
  s.used = 0;
  s.intervals.clear();
  return ms;
}

}  // namespace moe::cuda
