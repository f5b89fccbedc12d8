// Helpers of the data-parallel GPU tests: a tiny step config (head_dim 64, QK-norm, a dense layer,
// 8 experts top-2 with a shared expert, expert-bias updates on), the micro-batches of the global
// batch by global index (the same bytes on every rank), and a run of CudaStepRunner steps that
// keeps every step's statistics and the final replicated state.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "model/model.h"
#include "train/cuda_step.h"

namespace moe::testing {

// Global batch 8 sequences of 64 tokens in micro-batches of 2: 4 micro-batches per step on one
// GPU, 2 per rank on two.
inline Config dp_step_config(const std::string& routing = "learned") {
  Config c;
  c.model.vocab_size = 256;
  c.model.d_model = 256;
  c.model.n_layers = 3;
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.qk_norm = true;
  c.model.dense_layers = {0};
  c.model.dense_hidden = 256;
  c.moe.num_experts = 8;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 128;
  c.moe.shared_experts = 1;
  c.moe.lb_loss_weight = 0.01;
  c.moe.z_loss_weight = 0.001;
  c.moe.bias_update_rate = 1e-3;
  c.moe.routing = routing;
  c.train.seq_len = 64;
  c.train.micro_batch = 2;
  c.train.global_batch = 8;
  c.optim.lr = 2e-3;
  c.optim.weight_decay = 0.1;
  c.optim.grad_clip = 1.0;
  return c;
}

// Micro-batch g of the global batch of step `step`: ids from the first 32 of the vocabulary,
// targets = inputs shifted by one, two targets ignored (so target counts differ from token counts).
// `sequences` > 0 overrides the micro-batch size (e.g. a larger evaluation batch).
inline Batch dp_global_micro_batch(const Config& c, int64_t step, int64_t g, int64_t sequences = -1) {
  const int64_t seqs = sequences > 0 ? sequences : c.train.micro_batch, len = c.train.seq_len;
  std::mt19937_64 gen(7919 * static_cast<uint64_t>(step) + static_cast<uint64_t>(g));
  std::uniform_int_distribution<int32_t> tok(0, 31);
  Batch b;
  b.batch = step;
  b.seq_len = len;
  for (int64_t s = 0; s < seqs; ++s) {
    std::vector<int32_t> row(static_cast<size_t>(len + 1));
    for (auto& t : row) t = tok(gen);
    b.inputs.insert(b.inputs.end(), row.begin(), row.end() - 1);
    b.targets.insert(b.targets.end(), row.begin() + 1, row.end());
  }
  b.targets[static_cast<size_t>(3 + g)] = -1;
  b.targets[b.targets.size() - 2] = -1;
  return b;
}

inline int64_t dp_count_targets(const std::vector<Batch>& micro) {
  int64_t n = 0;
  for (const Batch& b : micro)
    for (int32_t t : b.targets) n += t >= 0;
  return n;
}

struct DpRun {
  std::vector<StepStats> steps;
  std::vector<float> params, exp_avg, exp_avg_sq, bias;
  std::vector<float> bias_after_step1;
  int64_t optimizer_steps = 0, graph_launches = 0;
};

// `steps` steps from Model<float>::init_params(7) on the current GPU. The runner gets the rank's
// micro-batches: global micro-batches [dp_rank * per_rank, (dp_rank + 1) * per_rank) with
// per_rank = global micro-batches / dp_size, and the global batch's target count. Step s + 1 is
// submitted before step s is collected (the trainer's pattern), except after step 1, whose
// expert bias is read back.
inline DpRun dp_run(const Config& c, CudaStepRunner& runner, bool graph, int64_t steps) {
  Model<float> init(c.model, c.moe);
  init.init_params(7);
  runner.set_use_graph(graph);
  runner.load_state(init.params(), nullptr, nullptr, 0, init.expert_bias());
  const int64_t global_micro = c.train.global_batch / c.train.micro_batch;
  const int64_t per_rank = global_micro / runner.dp_size(), first = runner.dp_rank() * per_rank;
  DpRun r;
  for (int64_t step = 1; step <= steps; ++step) {
    std::vector<Batch> all, mine;
    for (int64_t g = 0; g < global_micro; ++g) all.push_back(dp_global_micro_batch(c, step, g));
    for (int64_t m = 0; m < per_rank; ++m) mine.push_back(all[static_cast<size_t>(first + m)]);
    runner.submit(step, mine, dp_count_targets(all), c.optim.lr * (step <= 2 ? 0.5 : 1.0), 99);
    if (step == 1) {
      r.steps.push_back(runner.collect());
      runner.download_state(nullptr, nullptr, nullptr, nullptr, &r.bias_after_step1);
    } else if (runner.pending() > 1) {
      r.steps.push_back(runner.collect());
    }
  }
  while (runner.pending() > 0) r.steps.push_back(runner.collect());
  const int64_t total = runner.model().layout().total_numel();
  r.params.resize(static_cast<size_t>(total));
  r.exp_avg.resize(static_cast<size_t>(total));
  r.exp_avg_sq.resize(static_cast<size_t>(total));
  runner.download_state(r.params.data(), r.exp_avg.data(), r.exp_avg_sq.data(), &r.optimizer_steps, &r.bias);
  r.graph_launches = runner.graph_launches();
  return r;
}

inline double dp_loss(const StepStats& s) { return s.ce_sum / double(s.num_targets); }

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Every statistic of two runs bitwise equal (doubles compared by value: equal bits here).
inline void expect_same_steps(const DpRun& a, const DpRun& b, const std::string& what) {
  ASSERT_EQ(a.steps.size(), b.steps.size()) << what;
  for (size_t i = 0; i < a.steps.size(); ++i) {
    const StepStats &x = a.steps[i], &y = b.steps[i];
    EXPECT_EQ(x.step, y.step) << what;
    EXPECT_EQ(x.ce_sum, y.ce_sum) << what << ", step " << x.step;
    EXPECT_EQ(x.num_targets, y.num_targets) << what << ", step " << x.step;
    EXPECT_EQ(x.lb_loss, y.lb_loss) << what << ", step " << x.step;
    EXPECT_EQ(x.z_loss, y.z_loss) << what << ", step " << x.step;
    EXPECT_EQ(x.grad_norm, y.grad_norm) << what << ", step " << x.step;
    EXPECT_EQ(x.tokens_per_expert, y.tokens_per_expert) << what << ", step " << x.step;
    EXPECT_EQ(x.num_routes, y.num_routes) << what << ", step " << x.step;
    EXPECT_EQ(x.skipped, y.skipped) << what << ", step " << x.step;
    EXPECT_EQ(x.optimizer_steps, y.optimizer_steps) << what << ", step " << x.step;
  }
  EXPECT_TRUE(same_bits(a.params, b.params)) << what << ": parameters differ";
  EXPECT_TRUE(same_bits(a.exp_avg, b.exp_avg)) << what << ": exp_avg differs";
  EXPECT_TRUE(same_bits(a.exp_avg_sq, b.exp_avg_sq)) << what << ": exp_avg_sq differs";
  EXPECT_TRUE(same_bits(a.bias, b.bias)) << what << ": expert bias differs";
  EXPECT_EQ(a.optimizer_steps, b.optimizer_steps) << what;
}

}  // namespace moe::testing
