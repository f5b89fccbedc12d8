// Pipeline schedules (parallel/pipeline_schedule.h) against hand-written tables, their refusals,
// and the bubble fraction of the unit-time simulation against (P - 1) / (V m + P - 1).
#include <gtest/gtest.h>

#include <set>
#include <tuple>

#include "core/error.h"
#include "parallel/pipeline_schedule.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

#define EXPECT_THROW_MSG(expr, part) \
  EXPECT_NE(error_of([&] { (void)(expr); }).find(part), std::string::npos) << "missing: " << (part)

std::string sched(int64_t p, int64_t v, int64_t m, int64_t r) { return describe_schedule(pipeline_schedule(p, v, m, r)); }

TEST(PipelineSchedule, OneFOneBTwoStages) {
  EXPECT_EQ(sched(2, 1, 4, 0), "F0.0 F1.0 B0.0 F2.0 B1.0 F3.0 B2.0 B3.0");
  EXPECT_EQ(sched(2, 1, 4, 1), "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 F3.0 B3.0");
}

TEST(PipelineSchedule, OneFOneBFewerMicroBatchesThanStages) {
  EXPECT_EQ(sched(3, 1, 2, 0), "F0.0 F1.0 B0.0 B1.0");
  EXPECT_EQ(sched(3, 1, 2, 1), "F0.0 F1.0 B0.0 B1.0");
  EXPECT_EQ(sched(3, 1, 2, 2), "F0.0 B0.0 F1.0 B1.0");
  EXPECT_EQ(sched(4, 1, 5, 0), "F0.0 F1.0 F2.0 F3.0 B0.0 F4.0 B1.0 B2.0 B3.0 B4.0");
  EXPECT_EQ(sched(1, 1, 3, 0), "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0");
}

TEST(PipelineSchedule, InterleavedTwoStagesTwoChunks) {
  EXPECT_EQ(sched(2, 2, 2, 0), "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0");
  EXPECT_EQ(sched(2, 2, 2, 1), "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0");
  EXPECT_EQ(sched(2, 2, 4, 1), "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0");
}

TEST(PipelineSchedule, EveryOpOnceForwardBeforeBackward) {
  for (int64_t p : {1, 2, 3, 4})
    for (int64_t v : {1, 2, 3})
      for (int64_t m : {1, 2, 3, 4, 8, 12}) {
        if (v > 1 && m % p != 0) continue;
        for (int64_t r = 0; r < p; ++r) {
          const auto ops = pipeline_schedule(p, v, m, r);
          ASSERT_EQ(int64_t(ops.size()), 2 * v * m);
          std::set<std::tuple<bool, int64_t, int64_t>> seen;
          for (const PipelineOp& op : ops) {
            EXPECT_TRUE(seen.insert({op.forward, op.micro_batch, op.virtual_stage}).second);
            if (!op.forward) {
              EXPECT_TRUE(seen.count({true, op.micro_batch, op.virtual_stage}));
            }
          }
        }
        EXPECT_NO_THROW(simulate_schedule(p, v, m)) << p << " " << v << " " << m;
      }
}

TEST(PipelineSchedule, RefusalsNameTheKeys) {
  EXPECT_THROW_MSG(pipeline_schedule(2, 2, 3, 0), "parallel.virtual_stages = 2");
  EXPECT_THROW_MSG(pipeline_schedule(2, 2, 3, 0), "multiple of parallel.pp = 2");
  EXPECT_THROW_MSG(pipeline_schedule(0, 1, 3, 0), "parallel.pp must be >= 1");
  EXPECT_THROW_MSG(pipeline_schedule(2, 0, 3, 0), "parallel.virtual_stages must be >= 1");
  EXPECT_THROW_MSG(pipeline_schedule(2, 1, 3, 2), "pipeline rank 2");
}

// 1F1B: the simulated bubble is exactly (P - 1) / (m + P - 1) for any forward/backward cost
// ratio. Interleaved: with forward and backward of equal cost it is (P - 1) / (V m + P - 1); with
// backward = 2 x forward the warm-up forwards of the first groups leave a little more idle time
// (at most the formula plus (P - 1) forwards' worth, measured below).
TEST(PipelineSchedule, BubbleFractionMatchesTheFormula) {
  for (int64_t p : {2, 3, 4})
    for (int64_t m : {1, 2, 4, 8, 16}) {
      for (double b : {1.0, 2.0}) {
        const ScheduleTiming t = simulate_schedule(p, 1, m, 1.0, b);
        EXPECT_NEAR(t.bubble_fraction, bubble_fraction_formula(p, 1, m), 1e-12) << p << " " << m << " " << b;
        EXPECT_NEAR(t.makespan, (m + p - 1) * (1.0 + b), 1e-12);
      }
    }
  for (int64_t p : {2, 4})
    for (int64_t v : {2, 4})
      for (int64_t m : {p, 2 * p, 4 * p}) {
        const ScheduleTiming eq = simulate_schedule(p, v, m, 1.0, 1.0);
        EXPECT_NEAR(eq.bubble_fraction, bubble_fraction_formula(p, v, m), 1e-12) << p << " " << v << " " << m;
        const ScheduleTiming t = simulate_schedule(p, v, m, 1.0, 2.0);
        EXPECT_GE(t.bubble_fraction + 1e-12, bubble_fraction_formula(p, v, m)) << p << " " << v << " " << m;
        EXPECT_LE(t.makespan, (v * m + p - 1) * 3.0 + (p - 1) * 1.0 + 1e-12) << p << " " << v << " " << m;
      }
  EXPECT_NEAR(bubble_fraction_formula(4, 1, 8), 3.0 / 11.0, 1e-15);
  EXPECT_NEAR(bubble_fraction_formula(4, 2, 8), 3.0 / 19.0, 1e-15);
}

}  // namespace
}  // namespace moe::testing
