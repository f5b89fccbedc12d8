// A step trace in the Chrome trace event format (what https://ui.perfetto.dev and chrome://tracing
// open): every phase interval of the traced steps (log.trace) as a complete event
//   {"name": "attention", "cat": "phase", "ph": "X", "ts": us, "dur": us, "pid": rank, "tid": 0,
//    "args": {"step": s}}
// plus one "step" event per step on tid 1 spanning its phases (args.step_ms: the loop's measured
// step time; a GPU step is collected one submit later, so its measured span is not drawn), and
// metadata events naming the process ("rank R") and the two threads. Timestamps are microseconds
// since the run's clock started (steady clock; ranks of one host share it). One file per rank:
// RUN_DIR/trace.json on one rank, RUN_DIR/trace.rank<R>.json on each rank of a job; written
// atomically once the window's last step is collected (or when the run ends earlier).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/phase_timer.h"

namespace moe {

// The trace file of `rank` of `world_size` ranks in run directory `run_dir`.
std::string trace_path(const std::string& run_dir, int rank, int world_size);

class StepTrace {
 public:
  // origin_s: steady-clock seconds of ts = 0.
  StepTrace(std::string path, int rank, double origin_s) : path_(std::move(path)), rank_(rank), origin_s_(origin_s) {}

  // Step `step`'s phase intervals and its measured span [start_s, end_s] (steady-clock seconds).
  void add_step(int64_t step, const std::vector<PhaseInterval>& intervals, double start_s, double end_s);
  // Writes the file (events ordered by ts); returns the number of phase events.
  int64_t write() const;
  const std::string& path() const { return path_; }
  bool empty() const { return events_.empty(); }

 private:
  struct Event {
    std::string name, cat;
    double ts_us, dur_us;
    int tid;
    int64_t step;
    double measured_ms;  // step events: the loop's measured step time; -1 for phases
  };
  std::string path_;
  int rank_;
  double origin_s_;
  std::vector<Event> events_;
};

}  // namespace moe
