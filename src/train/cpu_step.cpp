// The CPU step (reference backend), synchronous: every micro-batch's forward and backward on the
// HostState's model with the loss scales of the global batch; with dp > 1 the statistics and
// gradients summed over the data-parallel ranks (ZeRO-1 reduce-scatter, or all-reduce; expert
// gradients over ep-dp); the global grad norm, skip on non-finite loss or norm, clipping and
// AdamW (or the ZeRO-1 shards' update and all-gather), then the aux-loss-free bias update. The
// model recomputes activations in backward as train.recompute says (model/model.h: set_recompute).
#include <sys/resource.h>

#include <algorithm>
#include <fstream>
#include <thread>
#include <cmath>
#include <deque>

#include "core/error.h"
#include "core/recompute.h"
#include "parallel/comm.h"
#include "parallel/topology.h"
#include "train/checkpointing.h"
#include "train/routing_seed.h"
#include "train/run_plan.h"
#include "train/step.h"

namespace moe {

namespace {

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

double peak_rss_gib() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_maxrss) * 1024.0 / double(1ull << 30);  // ru_maxrss is in KiB on Linux
}

class CpuStep final : public Step {
 public:
  CpuStep(const Config& cfg, const RunPlan& plan, const Topology& topo, HostState& state)
      : cfg_(cfg), plan_(plan), topo_(topo), s_(state) {
    s_.model.set_recompute(parse_recompute(cfg.train.recompute));
  }

  int64_t pending() const override { return int64_t(done_.size()); }
  int64_t in_flight() const override { return 1; }
  bool eval_is_collective() const override { return s_.model.expert_parallel() != nullptr; }
  void sync_host_state(bool) override {}  // the CPU step trains the host state in place

  void submit(const StepInput& in) override {
    StepStats st = run_micro_batches(in);
    s_.model.timer().lap(Phase::kOptimizer);  // gradient reduction, norm and update (profiling only)
    reduce_gradients(st);
    update(st, in.lr);
    s_.model.timer().stop();
    done_.push_back(std::move(st));
  }

  StepStats collect() override {
    MOE_CHECK(!done_.empty(), "CpuStep::collect: no submitted step is waiting to be collected");
    StepStats s = std::move(done_.front());
    done_.pop_front();
    return s;
  }

  ForwardStats evaluate(const Batch& b, uint64_t routing_seed) override {
    return s_.model.forward(b.inputs.data(), b.targets.data(), b.num_sequences(), b.seq_len, routing_seed);
  }

  void set_profiling(bool on) override {
    PhaseTimer& t = s_.model.timer();
    t.reset();
    t.enable(on);
  }
  // Milliseconds per phase since the last call (or set_profiling).
  std::vector<std::pair<std::string, double>> profiled_phases_ms() override {
    PhaseTimer& t = s_.model.timer();
    std::vector<std::pair<std::string, double>> out;
    for (int p = 0; p < kNumPhases; ++p) out.emplace_back(phase_name(Phase(p)), 1e3 * t.seconds(Phase(p)));
    t.reset();
    return out;
  }
  nlohmann::json bench_details() override {
    return {{"machine", {{"cpu", cpu_model()}, {"hardware_threads", std::thread::hardware_concurrency()}}},
            {"cuda_graph", false},
            {"mem_peak_gib", peak_rss_gib()},
            {"mem_peak_source", "peak resident set size of the process (getrusage ru_maxrss)"}};
  }

 private:
  // Forward and backward of this rank's micro-batches; the statistics summed over dp.
  StepStats run_micro_batches(const StepInput& in) {
    const std::vector<Batch>& micro = *in.micro;
    Model<float>& model = s_.model;
    model.zero_grads();
    const double micro_total = double(plan_.micro_batches);
    // Scales of the global batch, so that the gradients summed over ranks are the 1-rank ones.
    const LossScales scales{1.0 / double(std::max<int64_t>(1, in.global_targets)),
                            cfg_.moe.lb_loss_weight / micro_total, cfg_.moe.z_loss_weight / micro_total};
    StepStats st;
    st.step = in.step;
    st.num_targets = in.global_targets;
    st.tokens_per_expert.assign(size_t(model.num_moe_layers()), std::vector<int64_t>(size_t(cfg_.moe.num_experts), 0));
    for (int64_t m = 0; m < int64_t(micro.size()); ++m) {
      const Batch& b = micro[size_t(m)];
      const uint64_t seed = routing_seed(cfg_.train.seed, in.step - 1, topo_.dp_rank * plan_.micro_steps + m);
      const ForwardStats f = model.forward(b.inputs.data(), b.targets.data(), b.num_sequences(), b.seq_len, seed);
      model.backward(scales);
      st.ce_sum += f.ce_sum;
      st.lb_loss += f.lb_loss / micro_total;
      st.z_loss += f.z_loss / micro_total;
      st.num_routes += f.num_routes;
      st.num_dropped += f.num_dropped;
      for (size_t l = 0; l < f.tokens_per_expert.size(); ++l)
        for (size_t e = 0; e < f.tokens_per_expert[l].size(); ++e) st.tokens_per_expert[l][e] += f.tokens_per_expert[l][e];
    }
    if (plan_.sizes.dp > 1) {  // global figures on every rank, so that every rank takes the same decisions
      double sums[3] = {st.ce_sum, st.lb_loss, st.z_loss};
      topo_.dp_comm->all_reduce(sums, 3, ReduceOp::kSum);
      st.ce_sum = sums[0], st.lb_loss = sums[1], st.z_loss = sums[2];
      std::vector<int64_t> ints = {st.num_routes, st.num_dropped};
      for (const auto& layer : st.tokens_per_expert) ints.insert(ints.end(), layer.begin(), layer.end());
      topo_.dp_comm->all_reduce(ints.data(), int64_t(ints.size()), ReduceOp::kSum);
      st.num_routes = ints[0], st.num_dropped = ints[1];
      size_t at = 2;
      for (auto& layer : st.tokens_per_expert)
        for (int64_t& c : layer) c = ints[at++];
    }
    return st;
  }

  // Gradients summed over the ranks; the global norm from the squares each rank owns.
  void reduce_gradients(StepStats& st) {
    Model<float>& model = s_.model;
    if (plan_.sizes.dp == 1) {
      st.grad_norm = global_grad_norm(model.grads(), model.layout().total_numel());
      return;
    }
    double sq = 0;
    if (s_.zero) {
      s_.zero->reduce_gradients(model.grads());
      sq = s_.zero->local_sum_squares();
    } else {
      Comm* expert_comm = plan_.sizes.ep > 1 ? topo_.ep_dp_comm.get() : nullptr;
      all_reduce_gradients(model.layout(), model.grads(), *topo_.dp_comm, expert_comm);
      for (const ShardGroup& g : s_.owned) sq += owned_sum_squares(g.plan, model.layout(), model.grads());
    }
    topo_.dp_comm->all_reduce(&sq, 1, ReduceOp::kSum);
    st.grad_norm = std::sqrt(sq);
  }

  // Skip on a non-finite loss or norm; else clip, AdamW (or the shards' update), expert bias.
  void update(StepStats& st, double lr) {
    Model<float>& model = s_.model;
    st.skipped = !std::isfinite(st.loss()) || !std::isfinite(st.grad_norm);
    if (!st.skipped) {
      if (s_.zero) {
        s_.zero->step(model.params(), lr, st.grad_norm);
        s_.opt.set_steps_taken(s_.zero->steps_taken());
      } else {
        clip_grads(model.grads(), model.layout().total_numel(), st.grad_norm, cfg_.optim.grad_clip);
        s_.opt.step(model.params(), model.grads(), lr);
      }
      if (cfg_.moe.bias_update_rate > 0) model.update_expert_bias(st.tokens_per_expert, cfg_.moe.bias_update_rate);
    }
    st.optimizer_steps = s_.opt.steps_taken();
  }

  const Config& cfg_;
  const RunPlan& plan_;
  const Topology& topo_;
  HostState& s_;
  std::deque<StepStats> done_;
};

}  // namespace

double StepStats::loss() const { return ce_sum / double(std::max<int64_t>(1, num_targets)); }

std::unique_ptr<Step> make_step(const Config& cfg, const RunPlan& plan, const Topology& topo, HostState* state,
                                std::ostream& out) {
  if (plan.device == "cuda") return make_gpu_step(cfg, plan, topo, state, out);
  MOE_CHECK(state != nullptr, "the CPU step trains a HostState: make one for the run plan first");
  return std::make_unique<CpuStep>(cfg, plan, topo, *state);
}

}  // namespace moe
