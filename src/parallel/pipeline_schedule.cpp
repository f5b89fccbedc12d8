// The 1F1B and interleaved 1F1B lists of parallel/pipeline_schedule.h and the unit-time
// simulation that measures their bubble. Interleaved: the k-th forward of a rank runs virtual
// stage (k / P) % V of micro-batch (k / (P V)) P + k % P, the k-th backward virtual stage
// V - 1 - (k / P) % V of the same micro-batch formula.
#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>

#include "core/error.h"

namespace moe {

namespace {

void check_sizes(int64_t p, int64_t v, int64_t m) {
  MOE_CHECK(p >= 1, "parallel.pp must be >= 1, got ", p);
  MOE_CHECK(v >= 1, "parallel.virtual_stages must be >= 1, got ", v);
  MOE_CHECK(m >= 1, "a pipeline step needs >= 1 micro-batch (train.global_batch / (dp x train.micro_batch)), got ", m);
  MOE_CHECK(v == 1 || m % p == 0, "parallel.virtual_stages = ", v, " (interleaved 1F1B) needs the micro-batches per ",
            "step (train.global_batch / (dp x train.micro_batch) = ", m, ") to be a multiple of parallel.pp = ", p, ": ",
            m, " % ", p, " = ", m % p, "; change train.global_batch or train.micro_batch, or set parallel.virtual_stages = 1");
}

PipelineOp interleaved_op(bool forward, int64_t k, int64_t p, int64_t v) {
  const int64_t group = k / p;
  const int64_t chunk = group % v;
  PipelineOp op;
  op.forward = forward;
  op.micro_batch = (k / (p * v)) * p + k % p;
  op.virtual_stage = forward ? chunk : v - 1 - chunk;
  return op;
}

}  // namespace

std::vector<PipelineOp> pipeline_schedule(int64_t p, int64_t v, int64_t m, int64_t rank) {
  check_sizes(p, v, m);
  MOE_CHECK(rank >= 0 && rank < p, "pipeline rank ", rank, " is not in [0, parallel.pp = ", p, ")");
  std::vector<PipelineOp> ops;
  if (v == 1) {
    const int64_t warm = std::min(p - 1 - rank, m);
    for (int64_t i = 0; i < warm; ++i) ops.push_back({true, i, 0});
    for (int64_t i = 0; i < m - warm; ++i) {
      ops.push_back({true, warm + i, 0});
      ops.push_back({false, i, 0});
    }
    for (int64_t i = m - warm; i < m; ++i) ops.push_back({false, i, 0});
    return ops;
  }
  const int64_t total = v * m;
  const int64_t warm = std::min(2 * (p - 1 - rank) + (v - 1) * p, total);
  for (int64_t k = 0; k < warm; ++k) ops.push_back(interleaved_op(true, k, p, v));
  for (int64_t k = 0; k < total - warm; ++k) {
    ops.push_back(interleaved_op(true, warm + k, p, v));
    ops.push_back(interleaved_op(false, k, p, v));
  }
  for (int64_t k = total - warm; k < total; ++k) ops.push_back(interleaved_op(false, k, p, v));
  return ops;
}

std::string describe_schedule(const std::vector<PipelineOp>& ops) {
  std::string s;
  for (const PipelineOp& op : ops) {
    if (!s.empty()) s += ' ';
    s += op.forward ? 'F' : 'B';
    s += std::to_string(op.micro_batch) + "." + std::to_string(op.virtual_stage);
  }
  return s;
}

ScheduleTiming simulate_schedule(int64_t p, int64_t v, int64_t m, double fwd_cost, double bwd_cost) {
  check_sizes(p, v, m);
  std::vector<std::vector<PipelineOp>> lists;
  for (int64_t r = 0; r < p; ++r) lists.push_back(pipeline_schedule(p, v, m, r));
  const int64_t last_stage = p * v - 1;
  // Finish time of (forward?, micro-batch, model stage).
  std::map<std::tuple<bool, int64_t, int64_t>, double> done;
  std::vector<size_t> next(size_t(p), 0);
  std::vector<double> free_at(size_t(p), 0.0);
  double busy = 0;
  size_t remaining = 0;
  for (const auto& l : lists) remaining += l.size();
  while (remaining > 0) {
    bool progressed = false;
    for (int64_t r = 0; r < p; ++r) {
      while (next[size_t(r)] < lists[size_t(r)].size()) {
        const PipelineOp& op = lists[size_t(r)][next[size_t(r)]];
        const int64_t stage = op.virtual_stage * p + r;
        double ready = 0;
        bool have = true;
        auto need = [&](bool fwd, int64_t st) {
          const auto it = done.find({fwd, op.micro_batch, st});
          if (it == done.end()) have = false; else ready = std::max(ready, it->second);
        };
        if (op.forward) {
          if (stage > 0) need(true, stage - 1);
        } else {
          need(true, stage);  // its own forward
          if (stage < last_stage) need(false, stage + 1);
        }
        if (!have) break;
        const double cost = op.forward ? fwd_cost : bwd_cost;
        const double start = std::max(ready, free_at[size_t(r)]);
        free_at[size_t(r)] = start + cost;
        busy += cost;
        done[{op.forward, op.micro_batch, stage}] = start + cost;
        ++next[size_t(r)];
        --remaining;
        progressed = true;
      }
    }
    MOE_CHECK(progressed, "pipeline schedule (pp ", p, ", virtual stages ", v, ", ", m,
              " micro-batches) deadlocks: every rank waits for an operation that never runs");
  }
  ScheduleTiming t;
  t.makespan = *std::max_element(free_at.begin(), free_at.end());
  t.bubble_fraction = 1.0 - busy / (double(p) * t.makespan);
  return t;
}

double bubble_fraction_formula(int64_t p, int64_t v, int64_t m) {
  return double(p - 1) / double(v * m + p - 1);
}

}  // namespace moe
