// One whole training step on one GPU without host synchronisation (CUDA builds only). A step
// is every micro-batch's forward and backward (FP32 gradients accumulated), the global grad
// norm, clipping, AdamW on the FP32 master weights, the BF16 refresh and the aux-loss-free
// expert-bias update, all enqueued on the model's stream. The host never reads a device value
// inside a step: the step's statistics are copied asynchronously into pinned host memory and
// collected one step later. When the config allows it (no phase timer, no expert parallelism), the
// step after the first is captured once in a CUDA graph and replayed; random routing reads each
// micro-batch's seed from device memory, staged with the token ids, so the replay draws anew.
// Data parallel (an NcclComm over dp ranks, one GPU each): every rank runs its micro-batches, then
// the FP32 gradients and the step statistics are summed over the ranks with NCCL on the model's
// stream (inside the graph), so every rank computes the same grad norm, skip decision, AdamW
// update and expert-bias update on replicated state; with parallel.overlap_grad_reduce each
// block's gradients are all-reduced during the last backward. parallel.grad_reduce_dtype = "bf16"
// sums them in BF16 (cast, reduce, cast back).
// ZeRO-1 (plan.zero: dp > 1 and parallel.zero): the gradients are reduce-scattered instead, in
// the same buckets and at the same points (optim/flat_shards.h: equal chunks per rank, small tails
// all-reduced); each rank adds the squares of the elements it owns, one FP64 all-reduce gives the
// exact global norm; AdamW updates this rank's chunks (moments for them only, plus the tails),
// then the FP32 master chunks are all-gathered in place and the BF16 copy refreshed, so every
// rank's FP32 and BF16 weights stay whole and identical. All inside the graph, no host sync.
// Expert parallel (parallel.ep > 1, NcclComms over the ep and ep-dp groups): the model holds its
// ep rank's experts and exchanges token rows per MoE layer (CudaModel); dense gradients are summed
// over dp, expert gradients over ep-dp; the grad norm adds the dense squares (once) and the expert
// squares summed over the ep group. That path reads expert counts on the host: no CUDA graph.
#pragma once

#ifdef MOECORE_HAS_CUDA

#include <cstdint>
#include <memory>
#include <vector>

#include "core/config.h"
#include "data/dataset.h"
#include "model/cuda_model.h"
#include "train/run_plan.h"
#include "train/step.h"

namespace moe {
namespace cuda {
class EventTimer;
class NcclComm;
class NvshmemWorld;
}

class CudaStepRunner {
 public:
  // Stats slots in pinned memory: at most this many steps may be submitted and not collected.
  static constexpr int kMaxPending = 4;

  // Gradient all-reduce and ZeRO-1 buckets (elements): 64 Mi elements, 256 MiB of FP32 per NCCL call.
  static constexpr int64_t kGradBucketElements = int64_t(64) << 20;

  // Allocates the model (parameters zero), gradients, moments (zero) and the step buffers for
  // micro-batches of cfg.train.micro_batch x cfg.train.seq_len tokens on the current device.
  // dp (not owned, may be null: one GPU): the data-parallel group, made on the current device;
  // each rank then runs global_batch / (dp x micro_batch) micro-batches per step. Refuses
  // parallel.ep > 1 without an ep group of that size. Every rank of the group must make the
  // same calls in the same order with batches of the same shapes (submit, set_use_graph,
  // set_phase_timer, evaluate is local): a captured NCCL collective is collective over the group.
  // ep, ep_dp (not owned; null or size 1: none): with parallel.ep > 1 the ep group (size
  // parallel.ep; dp must be given) and the ep-dp group (the ranks holding the same experts; null
  // or size 1 when ep = dp). Expert parallelism turns graph capture off.
  // plan: the run plan of cfg over the dp group's ranks (micro-steps per rank size the buffers).
  // plan.zero selects ZeRO-1 (it needs the dp group; make_run_plan sets it for dp > 1, and a plan
  // set to zero with a one-rank group runs the sharded path over that group, as the tests do).
  // rowwise (parallel.ep_backend = "rowwise"): the ep group's NVSHMEM world (PE = ep rank); null
  // with ep = 1: this process's one-PE world (NvshmemWorld::one_pe).
  CudaStepRunner(const Config& cfg, const RunPlan& plan, cuda::NcclComm* dp, cuda::NcclComm* ep,
                 cuda::NcclComm* ep_dp, cuda::NvshmemWorld* rowwise = nullptr);
  // The same with make_run_plan(cfg, dp ranks, "cuda").
  explicit CudaStepRunner(const Config& cfg, cuda::NcclComm* dp = nullptr, cuda::NcclComm* ep = nullptr,
                          cuda::NcclComm* ep_dp = nullptr);
  ~CudaStepRunner();
  CudaStepRunner(const CudaStepRunner&) = delete;
  CudaStepRunner& operator=(const CudaStepRunner&) = delete;

  // The model; with optim.deferred_update its parameters lag the last submitted step's update
  // until flush_update() (download_state, evaluate and time_grad_all_reduce flush first).
  CudaModel& model();
  // optim.deferred_update: each step ends by preparing its AdamW update (norm, clip, skip, step
  // count, coefficients: its statistics are complete), and the next step applies it block by block
  // on a second stream, each block's just before its forward (the first micro-batch's forward
  // waits for it), so the memory-bound update runs beside the forward's GEMMs. The same values
  // bit for bit as the update at the end of the step. flush_update() applies a pending one now.
  bool deferred_update() const;
  void flush_update();
  // Host state in: FP32 params and moments [layout().total_numel()] (moments may be null: zero),
  // optimizer steps taken, expert bias [MoE layers x E]. Waits for every submitted step, then
  // for the copies. ZeRO-1: every rank takes the whole moments and keeps its shard of them.
  void load_state(const float* params, const float* exp_avg, const float* exp_avg_sq, int64_t optimizer_steps,
                  const std::vector<float>& expert_bias);
  // Host state out (waits for every submitted step): the same buffers, whole; any pointer may be
  // null to skip that part. ZeRO-1: the moments are gathered from their owners, so the call is
  // collective over the data-parallel group (every rank calls it, with the same moment pointers
  // null or not).
  void download_state(float* params, float* exp_avg, float* exp_avg_sq, int64_t* optimizer_steps,
                      std::vector<float>* expert_bias);

  // Enqueues step `step` (1-based, larger than every step submitted before). micro: this rank's
  // micro-batches, all of one shape; global_targets: targets of the whole step over every rank
  // (sets the CE scale 1 / global_targets; with dp > 1 the caller sums the ranks' counts on the
  // host, e.g. one MPI all-reduce); lr from the schedule; micro-batch m of dp rank r routes with
  // routing_seed(train_seed, step - 1, r x micro.size() + m) (train/routing_seed.h), its index in
  // the global batch, as the CPU trainer. The lb and z weights are divided by the micro-batches
  // of the global batch (dp x micro.size()). Returns
  // without waiting for the GPU, except that a pinned staging slot is reused only once the
  // device has copied out of it (an event two steps old). Throws when kMaxPending steps are
  // waiting to be collected.
  void submit(int64_t step, const std::vector<Batch>& micro, int64_t global_targets, double lr, uint64_t train_seed);
  // Statistics of the oldest submitted step not yet collected; waits only for that step's event
  // (dp > 1: NcclComm::wait, which throws after parallel.timeout_s or an NCCL error instead of
  // hanging). Throws when nothing is pending, or when the device counted bad token ids or targets
  // on any rank (the step is then dropped from the queue; the ids name vocab_size).
  StepStats collect();
  int64_t pending() const;
  // True when the optimizer runs ZeRO-1 (plan.zero).
  bool zero() const;
  // Ranks of the data-parallel group (1 without one) and this rank's index in it.
  int64_t dp_size() const;
  int64_t dp_rank() const;

  // Eager forward of one batch for evaluation on this GPU alone (waits; returns CE sum and
  // target count; the caller sums over ranks).
  ForwardStats evaluate(const Batch& b, uint64_t routing_seed);

  // While set, steps run eagerly and mark phases on the timer (bench profiling); nullptr: off.
  void set_phase_timer(cuda::EventTimer* timer);
  // True when the config allows graph capture (no expert parallelism) and capture is on.
  bool uses_graph() const;
  // Capture on (the default) or off; off waits for the stream and drops a captured graph.
  void set_use_graph(bool on);
  // Graph replays so far (the capturing step's first launch included).
  int64_t graph_launches() const;
  // Milliseconds of one reduction of the whole gradient buffer over the data-parallel group
  // (dense over dp, experts over ep-dp; all-reduce, or reduce-scatter under ZeRO-1, in
  // parallel.grad_reduce_dtype), eager on the model's stream as the step without overlap
  // runs it, after the submitted steps are collected. Overwrites the gradients (every step zeroes
  // them first). For the bench's bandwidth figure; needs a dp group. bytes (may be null): the
  // bytes each rank reduced (4 per element, 2 with BF16 reduction).
  double time_grad_all_reduce(double* bytes = nullptr);
  // Milliseconds of one NCCL all-to-all over the ep group moving bytes_per_rank bytes from each
  // rank (an equal share to every rank), after one untimed call: the bench's reference for the
  // expert exchange's bandwidth. Needs an ep group (parallel.ep > 1), after the submitted steps
  // are collected.
  double time_ep_all_to_all(int64_t bytes_per_rank);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The kernel choices this process runs (the grouped GEMM backend, MOECORE_GROUPED_GEMM), for the
// bench's record: a figure is only comparable with another of the same choices.
nlohmann::json cuda_kernel_variants();

}  // namespace moe

#endif  // MOECORE_HAS_CUDA
