// Launchers and checked entry points of ops/step_stats.h: single-block or single-thread kernels
// whose launch shapes depend only on the model's static sizes (layers, experts).
#include "cuda/ops/step_stats.h"

#include "cuda/common.h"
#include "cuda/kernels/step_stats.cuh"
#include "cuda/ops/launch.h"

namespace moe::cuda {

namespace {

constexpr int64_t kMaxBiasExperts = 4096;

void check_layers(const char* op, int64_t num_moe_layers, int64_t num_experts) {
  MOE_CHECK(num_moe_layers >= 0 && num_moe_layers <= (int64_t{1} << 20), op,
            ": num_moe_layers must be in [0, 2^20], got ", num_moe_layers);
  MOE_CHECK(num_experts >= 1 && num_experts <= kMaxBiasExperts, op, ": num_experts must be in [1, ",
            kMaxBiasExperts, "], got ", num_experts);
}

}  // namespace

size_t step_stats_bytes(int64_t num_moe_layers, int64_t num_experts) {
  check_layers("cuda::step_stats_bytes", num_moe_layers, num_experts);
  return sizeof(StepStatsRecord) + static_cast<size_t>(num_moe_layers * (num_experts + 1)) * sizeof(int64_t) +
         static_cast<size_t>(2 * num_moe_layers) * sizeof(double);
}

int64_t* step_stats_counts(StepStatsRecord* rec) { return reinterpret_cast<int64_t*>(rec + 1); }
const int64_t* step_stats_counts(const StepStatsRecord* rec) { return reinterpret_cast<const int64_t*>(rec + 1); }
int64_t* step_stats_layer_dropped(StepStatsRecord* rec, int64_t num_moe_layers, int64_t num_experts) {
  return step_stats_counts(rec) + num_moe_layers * num_experts;
}
const int64_t* step_stats_layer_dropped(const StepStatsRecord* rec, int64_t num_moe_layers, int64_t num_experts) {
  return step_stats_counts(rec) + num_moe_layers * num_experts;
}
double* step_stats_layer_losses(StepStatsRecord* rec, int64_t num_moe_layers, int64_t num_experts) {
  return reinterpret_cast<double*>(step_stats_counts(rec) + num_moe_layers * (num_experts + 1));
}
const double* step_stats_layer_losses(const StepStatsRecord* rec, int64_t num_moe_layers, int64_t num_experts) {
  return reinterpret_cast<const double*>(step_stats_counts(rec) + num_moe_layers * (num_experts + 1));
}

void step_stats_accumulate_router(const float* losses, const int32_t* counts, const int32_t* dropped,
                                  int64_t num_moe_layers, int64_t num_experts, StepStatsRecord* rec, Stream stream) {
  const char* op = "cuda::step_stats_accumulate_router";
  check_layers(op, num_moe_layers, num_experts);
  if (num_moe_layers == 0) return;
  detail::check_ptrs(op, {{"losses", losses}, {"counts", counts}}, 4);
  detail::check_ptrs(op, {{"rec", rec}}, alignof(StepStatsRecord));
  kernels::step_stats_accumulate_router_block<<<1, kernels::kStepStatsThreads, 0, stream>>>(
      losses, counts, dropped, static_cast<int>(num_moe_layers), num_moe_layers * num_experts, rec,
      step_stats_counts(rec), step_stats_layer_dropped(rec, num_moe_layers, num_experts),
      step_stats_layer_losses(rec, num_moe_layers, num_experts));
  check_launch("step_stats_accumulate_router_block");
}

void step_guard_nonfinite_loss(StepStatsRecord* rec, OptimStepScalars* scalars, Stream stream) {
  const char* op = "cuda::step_guard_nonfinite_loss";
  detail::check_ptrs(op, {{"rec", rec}, {"scalars", scalars}}, 8);
  kernels::step_guard_nonfinite_loss_thread<<<1, 1, 0, stream>>>(rec, scalars);
  check_launch("step_guard_nonfinite_loss_thread");
}

void expert_bias_update(const int64_t* counts_sum, int64_t num_moe_layers, int64_t num_experts, double rate,
                        const OptimStepScalars* scalars, float* bias, Stream stream) {
  const char* op = "cuda::expert_bias_update";
  check_layers(op, num_moe_layers, num_experts);
  if (num_moe_layers == 0) return;
  detail::check_ptrs(op, {{"counts_sum", counts_sum}, {"scalars", scalars}}, 8);
  detail::check_ptrs(op, {{"bias", bias}}, 4);
  kernels::expert_bias_update_per_layer<<<static_cast<unsigned>(num_moe_layers), kernels::kStepStatsThreads, 0,
                                          stream>>>(counts_sum, static_cast<int>(num_experts), rate, scalars, bias);
  check_launch("expert_bias_update_per_layer");
}

void step_stats_finish(const OptimStepScalars* scalars, StepStatsRecord* rec, Stream stream) {
  const char* op = "cuda::step_stats_finish";
  detail::check_ptrs(op, {{"rec", rec}, {"scalars", scalars}}, 8);
  kernels::step_stats_finish_thread<<<1, 1, 0, stream>>>(scalars, rec);
  check_launch("step_stats_finish_thread");
}

}  // namespace moe::cuda
