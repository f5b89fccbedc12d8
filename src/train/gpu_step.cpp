// The GPU step: this rank's GPU bound by local rank and its NCCL groups made over the topology's
// groups (data parallel over dp; with expert parallelism the ep and ep-dp groups, in the same
// order on every rank), the memory estimate checked against the free device memory before
// anything is allocated, then CudaStepRunner (sync-free steps, one CUDA graph where the config
// allows it) loaded from the HostState or initialised on the device. Statistics of step s arrive
// when step s + 1 was submitted (in_flight 2). Bench details: device, graph, the gradient
// all-reduce alone (algorithm and bus bandwidth, nccl-tests formulas), expert-exchange traffic.
#include <cstdio>
#include <ostream>

#include "core/error.h"
#include "train/step.h"

#ifdef MOECORE_HAS_CUDA
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>

#include "cuda/event_timer.h"
#include "cuda/ops/device_info.h"
#include "cuda/ops/memory.h"
#include "cuda/ops/nccl.h"
#include "cuda/ops/nvshmem_world.h"
#include "model/cuda_experts.h"
#include "model/cuda_model.h"
#include "parallel/comm.h"
#include "parallel/nccl_comm.h"
#include "parallel/topology.h"
#include "train/checkpointing.h"
#include "train/cuda_step.h"
#include "train/run_plan.h"
#endif

namespace moe {

#ifndef MOECORE_HAS_CUDA

std::unique_ptr<Step> make_gpu_step(const Config&, const RunPlan&, const Topology&, HostState*, std::ostream&) {
  MOE_FAIL("train.device = \"cuda\" needs a build with the CUDA backend (cmake --preset cuda)");
}

std::string gpu_fit_problem(const RunPlan&) {
  return "train.device = \"cuda\" needs a build with the CUDA backend (cmake --preset cuda)";
}

#else

namespace {

constexpr double kGiB = double(1ull << 30);

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", bytes / kGiB);
  return buf;
}

// This rank's GPU and NCCL groups: the one place a multi-GPU job is set up (train and bench).
struct GpuGroups {
  LocalRank local;
  std::unique_ptr<cuda::NcclComm> dp, ep, ep_dp;
  std::unique_ptr<cuda::NvshmemWorld> rowwise;  // parallel.ep_backend = "rowwise" with ep > 1
};

GpuGroups make_gpu_groups(const Config& cfg, const RunPlan& plan, const Topology& topo, std::ostream& out) {
  GpuGroups g;
  Comm& world = *topo.world;
  if (world.size() > 1) {  // one GPU per rank, chosen before anything is allocated on a GPU
    const int64_t mine = bind_local_gpu(world, &g.local);
    std::vector<int64_t> gpus(size_t(world.size()));
    world.all_gather(&mine, gpus.data(), 1);
    out << "GPUs: rank r -> GPU";
    for (size_t r = 0; r < gpus.size(); ++r) out << (r ? ", " : " ") << r << ":" << gpus[r];
    out << " (local rank from " << g.local.source << ")\n" << std::flush;
  }
  if (plan.sizes.dp > 1) {
    g.dp = make_nccl_comm(*topo.dp_comm);
    const bool overlap = cfg.parallel.overlap_grad_reduce && plan.sizes.ep == 1;
    out << "data parallel over " << plan.sizes.dp << " GPUs: NCCL " << cuda::nccl_version() << ", gradients all-reduced "
        << (overlap ? "block by block during the last backward (overlapped)" : "after the last backward")
        << " in " << cfg.parallel.grad_reduce_dtype
        << (plan.zero ? "; ZeRO-1: gradients reduce-scattered, AdamW moments sharded over the ranks, FP32 weights "
                        "all-gathered\n"
                      : ", replicated AdamW\n")
        << std::flush;
  }
  if (plan.sizes.ep > 1) {
    g.ep = make_nccl_comm(*topo.ep_comm);
    if (plan.ep_dp > 1) g.ep_dp = make_nccl_comm(*topo.ep_dp_comm);
    const bool rowwise = cfg.parallel.ep_backend == "rowwise";
    if (rowwise) {
      // NVSHMEM over the ep group: its rank 0's unique id, broadcast as int64 words over the group.
      Comm& epc = *topo.ep_comm;
      std::vector<uint8_t> id = epc.rank() == 0 ? cuda::nvshmem_unique_id() : std::vector<uint8_t>();
      int64_t size = int64_t(id.size());
      epc.broadcast(&size, 1, 0);
      std::vector<int64_t> words(size_t((size + 7) / 8), 0);
      if (epc.rank() == 0) std::memcpy(words.data(), id.data(), id.size());
      epc.broadcast(words.data(), int64_t(words.size()), 0);
      id.resize(size_t(size));
      std::memcpy(id.data(), words.data(), id.size());
      const int64_t rows = cfg.train.micro_batch * cfg.train.seq_len * cfg.moe.top_k;
      const int64_t heap = CudaRowwiseExperts::symmetric_bytes(cfg.moe, cfg.model.d_model, num_moe_layers(cfg.model),
                                                               plan.sizes.ep, cfg.parallel.ep_capacity_factor, rows,
                                                               cfg.train.precision == "fp8");
      g.rowwise = std::make_unique<cuda::NvshmemWorld>(epc.rank(), epc.size(), id, size_t(heap) + (size_t(64) << 20));
    }
    out << "expert parallel over " << plan.sizes.ep << " GPUs per group (" << cfg.moe.num_experts / plan.sizes.ep
        << " experts each, ep-dp " << plan.ep_dp << "): "
        << (rowwise ? "rowwise exchange (rows stored into the expert ranks' NVSHMEM buffers, no host read, CUDA graph "
                      "on)\n"
                    : "NCCL all-to-all of token rows per MoE layer, counts read on the host (no CUDA graph)\n")
        << std::flush;
  }
  return g;
}

// Why a plan's estimate does not fit the device's free memory ("" when it fits).
std::string fit_problem(const RunPlan& plan, const cuda::DeviceInfo& dev) {
  const MemoryEstimate& m = plan.memory;
  if (m.total() <= double(dev.free_bytes)) return "";
  const double saving = bf16_moment_saving(m);
  return detail::concat("this run does not fit on one ", dev.name, ": it needs about ",
            gib(m.total()), " GiB per GPU (", m.local_params, " parameters: ", gib(m.params + m.grads + m.moments),
            " GiB of FP32 weights, BF16 copy, FP32 gradients and two AdamW moments",
            plan.zero ? " (this rank's ZeRO-1 shard)" : "", ", plus ~", gib(m.activations() + m.exchange),
            " GiB of activations for a micro-batch of ", plan.tokens_per_micro_batch, " tokens) but the GPU has ",
            gib(double(dev.free_bytes)), " GiB free of ", gib(double(dev.total_bytes)),
            " GiB; use fewer layers or experts (configs/olmoe-8l.toml fits one H200), split the experts over GPUs "
            "(parallel.ep), recompute activations (train.recompute = \"selective\" or \"full\"), ",
            saving > 0 ? detail::concat("keep the AdamW moments in BF16 (optim.moment_dtype = \"bf16\": ", gib(saving),
                                        " GiB less), ")
                       : std::string(),
            "or lower train.micro_batch / train.seq_len (moecore plan shows each choice's memory)");
}

// Refuses, before anything is allocated on the device, a plan whose estimate exceeds its free memory.
void check_fits(const RunPlan& plan, const cuda::DeviceInfo& dev) {
  const std::string problem = fit_problem(plan, dev);
  MOE_CHECK(problem.empty(), problem);
}

class GpuStep final : public Step {
 public:
  GpuStep(const Config& cfg, const RunPlan& plan, const Topology& topo, HostState* state, std::ostream& out)
      : cfg_(cfg), plan_(plan), topo_(topo), state_(state), groups_(make_gpu_groups(cfg, plan, topo, out)),
        dev_(cuda::device_info()), used_before_((check_fits(plan, dev_), cuda::device_used_bytes())) {
    cuda::reset_device_peak_bytes();
    runner_ = std::make_unique<CudaStepRunner>(cfg, plan, groups_.dp.get(), groups_.ep.get(), groups_.ep_dp.get(),
                                               groups_.rowwise.get());
    CudaModel& model = runner_->model();
    if (state_ != nullptr && state_->initialised) {
      runner_->load_state(state_->model.params(), state_->opt.exp_avg().data(), state_->opt.exp_avg_sq().data(),
                          state_->opt.steps_taken(), state_->model.expert_bias());
    } else {
      // The same seed on every rank: replicas start identical (each GPU's experts at their offsets).
      model.init_params_device(cfg.train.seed, cfg.model.init_std);
      model.load_expert_bias(std::vector<float>(size_t(model.num_moe_layers() * cfg.moe.num_experts), 0.0f));
      cuda::stream_sync(model.stream());
    }
  }

  // A timed step (set_phase_recording) runs eagerly with the event timer and is waited for here:
  // its intervals are placed on the host's steady clock by the moment its last event completed.
  void submit(const StepInput& in) override {
    if (!record_times_ || profiling_) {
      runner_->submit(in.step, *in.micro, in.global_targets, in.lr, cfg_.train.seed);
      return;
    }
    if (!timer_) timer_ = std::make_unique<cuda::EventTimer>(runner_->model().stream());
    runner_->set_phase_timer(timer_.get());
    try {
      runner_->submit(in.step, *in.micro, in.global_targets, in.lr, cfg_.train.seed);
    } catch (...) {
      runner_->set_phase_timer(nullptr);
      throw;
    }
    runner_->set_phase_timer(nullptr);  // the next untimed step may replay the CUDA graph again
    std::vector<cuda::EventTimer::Interval> ivs;
    const auto ms = timer_->collect_intervals(&ivs);
    const double done_s = steady_seconds(std::chrono::steady_clock::now());
    double end_ms = 0;
    for (const auto& iv : ivs) end_ms = std::max(end_ms, iv.end_ms);
    const double origin_s = done_s - 1e-3 * end_ms;
    Timed& t = timed_[in.step];
    t.ms.assign(ms.begin(), ms.end());
    if (record_intervals_)
      for (const auto& iv : ivs) t.intervals.push_back({iv.phase, origin_s + 1e-3 * iv.start_ms, origin_s + 1e-3 * iv.end_ms});
  }
  StepStats collect() override {
    StepStats s = runner_->collect();
    const auto it = timed_.find(s.step);
    if (it != timed_.end()) {
      s.phase_ms = std::move(it->second.ms);
      s.phase_intervals = std::move(it->second.intervals);
      timed_.erase(it);
    }
    return s;
  }
  void set_phase_recording(bool times, bool intervals) override {
    record_times_ = times || intervals;
    record_intervals_ = intervals;
  }
  bool cheap_phase_times() const override { return false; }
  int64_t pending() const override { return runner_->pending(); }
  int64_t in_flight() const override { return 2; }  // step s + 1 is enqueued while step s runs
  ForwardStats evaluate(const Batch& b, uint64_t routing_seed) override { return runner_->evaluate(b, routing_seed); }
  bool eval_is_collective() const override { return runner_->model().ep_size() > 1; }

  void sync_host_state(bool all_ranks) override {
    MOE_CHECK(state_ != nullptr, "GpuStep: no host state to download into (a bench step initialised on the device)");
    MOE_CHECK(runner_->pending() == 0, "GpuStep::sync_host_state: ", runner_->pending(),
              " submitted step(s) not collected; collect them first");
    // ZeRO-1 gathers the moment shards: a collective, so every rank downloads.
    if (!all_ranks && topo_.rank != 0 && !runner_->zero()) return;
    int64_t optimizer_steps = 0;
    runner_->download_state(state_->model.params(), state_->opt.exp_avg().data(), state_->opt.exp_avg_sq().data(),
                            &optimizer_steps, &state_->model.expert_bias());
    state_->opt.set_steps_taken(optimizer_steps);
    state_->initialised = true;
  }

  bool has_device_figures() const override { return true; }
  DeviceFigures device_figures(int64_t steps, double seconds) const override {
    DeviceFigures g;
    g.tflops_per_gpu = plan_.flops_per_step * double(steps) / seconds / 1e12 / double(plan_.sizes.dp);
    g.mem_peak_gib = double(cuda::device_peak_bytes()) / kGiB;
    size_t free_bytes = 0, total_bytes = 0;
    cuda::device_mem_info(&free_bytes, &total_bytes);
    g.mem_used_gib = double(total_bytes - free_bytes) / kGiB;
    g.num_gpus = plan_.sizes.dp;
    return g;
  }

  void set_profiling(bool on) override {
    CudaModel& model = runner_->model();
    if (on && !timer_) timer_ = std::make_unique<cuda::EventTimer>(model.stream());
    profiling_ = on;
    runner_->set_phase_timer(on ? timer_.get() : nullptr);  // eager steps while set
    model.reset_ep_traffic();
  }

  std::vector<std::pair<std::string, double>> profiled_phases_ms() override {
    MOE_CHECK(timer_ != nullptr, "GpuStep: profiled_phases_ms before set_profiling(true)");
    const auto ms = timer_->collect();
    std::vector<std::pair<std::string, double>> out;
    for (int p = 0; p < kNumPhases; ++p) out.emplace_back(phase_name(Phase(p)), ms[size_t(p)]);
    traffic_ = runner_->model().ep_traffic();
    runner_->model().reset_ep_traffic();
    exchange_ms_ = ms[int(Phase::kDispatch)] + ms[int(Phase::kCombine)];
    dispatch_ms_ = ms[int(Phase::kDispatch)];
    combine_ms_ = ms[int(Phase::kCombine)];
    grad_reduce_exposed_ms_ = ms[int(Phase::kGradReduce)];
    return out;
  }

  nlohmann::json bench_details() override;

 private:
  const Config& cfg_;
  const RunPlan& plan_;
  const Topology& topo_;
  HostState* state_;
  GpuGroups groups_;
  cuda::DeviceInfo dev_;
  size_t used_before_ = 0;
  std::unique_ptr<CudaStepRunner> runner_;
  std::unique_ptr<cuda::EventTimer> timer_;
  bool profiling_ = false;  // the bench's phase profile holds the timer
  bool record_times_ = false, record_intervals_ = false;
  struct Timed {
    std::vector<double> ms;
    std::vector<PhaseInterval> intervals;
  };
  std::map<int64_t, Timed> timed_;  // phase times of submitted steps, by step
  EpTraffic traffic_;
  double exchange_ms_ = 0, dispatch_ms_ = 0, combine_ms_ = 0, grad_reduce_exposed_ms_ = 0;
};

nlohmann::json GpuStep::bench_details() {
  Comm& world = *topo_.world;
  const int64_t dp = plan_.sizes.dp, ep = plan_.sizes.ep;
  // The gradient all-reduce alone (every rank): one reduction of the whole FP32 gradient buffer,
  // as the step without overlap runs it, for the bandwidth figure.
  double full_reduce_ms = 0, reduce_bytes = 0;
  if (dp > 1) full_reduce_ms = runner_->time_grad_all_reduce(&reduce_bytes);
  // NCCL's all-to-all of one exchange's rows (a micro-batch's routed rows), the reference for the
  // exchange's bandwidth (nccl-tests' busbw for all-to-all: algbw x (n - 1) / n).
  const int64_t exchange_bytes = ep > 1 ? cfg_.train.micro_batch * cfg_.train.seq_len * cfg_.moe.top_k *
                                              cfg_.model.d_model * int64_t(sizeof(uint16_t))
                                        : 0;
  const double nccl_a2a_ms = ep > 1 ? runner_->time_ep_all_to_all(exchange_bytes) : 0.0;
  const size_t used_after = cuda::device_used_bytes();
  double peak_bytes = double(cuda::device_peak_bytes());
  if (world.size() > 1) world.all_reduce(&peak_bytes, 1, ReduceOp::kMax);  // the fullest GPU
  nlohmann::json d = {
      {"gpu",
       {{"name", dev_.name},
        {"compute_capability", std::to_string(dev_.cc_major) + "." + std::to_string(dev_.cc_minor)},
        {"sm_count", dev_.sm_count},
        {"memory_gib", double(dev_.total_bytes) / kGiB}}},
      {"num_gpus", dp},
      {"cuda_graph", runner_->uses_graph()},
      {"graph_launches", runner_->graph_launches()},
      {"mem_peak_gib", peak_bytes / kGiB},
      {"mem_peak_source", "high-water mark of moecore's device allocations (cuda::device_peak_bytes), largest over GPUs"},
      {"mem_used_gib", double(used_after) / kGiB},
      {"mem_used_source", "cudaMemGetInfo total - free after the run (CUDA context, cuBLASLt and other processes included)"},
      {"mem_bench_gib", double(used_after - std::min(used_after, used_before_)) / kGiB},
      {"kernel_variants", cuda_kernel_variants()}};
  if (ep > 1) {
    const double a2a_gbs = exchange_ms_ > 0 ? double(traffic_.bytes_sent) / (exchange_ms_ * 1e-3) / 1e9 : 0.0;
    d["expert_parallel"] = {
        {"ep", ep},
        {"experts_per_gpu", cfg_.moe.num_experts / ep},
        {"dispatch_ms", dispatch_ms_},
        {"combine_ms", combine_ms_},
        {"bytes_sent_per_rank", traffic_.bytes_sent},
        {"bytes_received_per_rank", traffic_.bytes_received},
        {"row_exchanges", traffic_.exchanges},
        {"backend", cfg_.parallel.ep_backend},
        {"nccl_alltoall_bytes_per_rank", exchange_bytes},
        {"nccl_alltoall_ms", nccl_a2a_ms},
        {"nccl_alltoall_busbw_gbs", nccl_a2a_ms > 0 ? double(exchange_bytes) / (nccl_a2a_ms * 1e-3) / 1e9 *
                                                          double(ep - 1) / double(ep)
                                                    : 0.0},
        {"nccl_alltoall_source", "CUDA events around one NCCL all-to-all of nccl_alltoall_bytes_per_rank bytes from "
                                 "each rank over the ep group (equal shares), after one untimed call; busbw as "
                                 "nccl-tests: algbw x (ep - 1) / ep"},
        {"alltoall_gbs", a2a_gbs},
        {"alltoall_source", "BF16 row bytes rank 0 sent to other GPUs in the profiled eager step (dispatch and "
                            "combine, forward and backward; rowwise: its rows stored into the peers and the rows "
                            "its experts received, loaded back by them) over its dispatch + combine phase time "
                            "(all-to-all: with the host count read and the regroup gathers; rowwise: with the "
                            "barriers; both: waiting for the peer)"}};
  }
  if (dp > 1) {
    const double algbw = full_reduce_ms > 0 ? reduce_bytes / (full_reduce_ms * 1e-3) / 1e9 : 0.0;
    d["data_parallel"] = {
        {"nccl_version", cuda::nccl_version()},
        {"local_rank_source", groups_.local.source},
        {"overlap_grad_reduce", cfg_.parallel.overlap_grad_reduce && ep == 1},
        {"grad_reduce_exposed_ms", grad_reduce_exposed_ms_},
        {"grad_reduce_exposed_source", "CUDA events of the eager profiled step on rank 0 from the end of backward to "
                                       "the gradients and statistics being summed (with overlap: the blocks' "
                                       "all-reduces still running after backward, then the statistics)"},
        {"grad_reduce_ms", full_reduce_ms},
        {"grad_reduce_bytes", reduce_bytes},
        {"grad_reduce_algbw_gbs", algbw},
        {"grad_reduce_busbw_gbs", algbw * 2.0 * double(dp - 1) / double(dp)},
        {"grad_reduce_source", "CUDA events around one all-reduce of the whole FP32 gradient buffer on rank 0 after "
                               "the profiled step, waiting for the slower rank included"},
        {"scaling_efficiency_source", "tokens_per_s_per_gpu here divided by tokens_per_s of a one-GPU run of the "
                                      "same config (moecore bench without mpirun), a separate run"}};
  }
  return d;
}

}  // namespace

std::string gpu_fit_problem(const RunPlan& plan) { return fit_problem(plan, cuda::device_info()); }

// A pipeline stage's step (parallel.pp > 1; train/gpu_pipeline_step.cpp).
std::unique_ptr<Step> make_gpu_pipeline_step(const Config& cfg, const RunPlan& plan, const Topology& topo,
                                             HostState* state, std::ostream& out);

std::unique_ptr<Step> make_gpu_step(const Config& cfg, const RunPlan& plan, const Topology& topo, HostState* state,
                                    std::ostream& out) {
  if (plan.sizes.pp > 1) return make_gpu_pipeline_step(cfg, plan, topo, state, out);
  return std::make_unique<GpuStep>(cfg, plan, topo, state, out);
}

#endif  // MOECORE_HAS_CUDA

}  // namespace moe
