// The CPU step (reference backend), synchronous: every micro-batch's forward and backward on the
// HostState's model with the loss scales of the global batch; with dp > 1 the statistics and
// gradients summed over the data-parallel ranks (ZeRO-1 reduce-scatter, or all-reduce; expert
// gradients over ep-dp); the global grad norm, skip on non-finite loss or norm, clipping and
// AdamW (or the ZeRO-1 shards' update and all-gather), then the aux-loss-free bias update. The
// model recomputes activations in backward as train.recompute says (model/model.h: set_recompute).
// With parallel.pp > 1 the rank is one pipeline stage (its model holds only its layers): its
// micro-batches run in the order of pipeline_schedule (1F1B, interleaved with virtual stages),
// activations going forward and their gradients backward by send/recv over the pipeline group,
// each in-flight micro-batch's saved activations moved out of the model until its backward
// (Model::take_activations). Loss, router losses and expert counts are summed over the pipeline
// group, so every rank holds the global figures; the grad norm's squares are summed over the
// stage's dp group and then over the pipeline group; AdamW (or ZeRO-1 over the stage's dp group)
// updates the stage's tensors. Time in recv is the stage's idle time (pipeline_idle_fraction).
#include <sys/resource.h>

#include <algorithm>
#include <fstream>
#include <thread>
#include <cmath>
#include <chrono>
#include <deque>
#include <map>

#include "core/error.h"
#include "core/recompute.h"
#include "parallel/comm.h"
#include "parallel/pipeline_schedule.h"
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
    s_.model.set_matmul_precision(cfg.train.precision, cfg.train.fp8_scaling);  // "fp8": the recipe emulated
  }

  int64_t pending() const override { return int64_t(done_.size()); }
  int64_t in_flight() const override { return 1; }
  bool eval_is_collective() const override { return s_.model.expert_parallel() != nullptr || pipelined(); }
  void sync_host_state(bool) override {}  // the CPU step trains the host state in place

  void submit(const StepInput& in) override {
    PhaseTimer& t = s_.model.timer();
    if (record_times_) {  // this step's laps only (an eval between steps laps too)
      t.enable(true);
      t.reset();
      t.record_intervals(record_intervals_);
      t.take_intervals();
    }
    StepStats st = run_micro_batches(in);
    t.lap(Phase::kOptimizer);  // gradient reduction, norm and update (when timing)
    reduce_gradients(st);
    update(st, in.lr);
    t.stop();
    if (record_times_) {
      st.phase_ms.resize(size_t(kNumPhases));
      for (int p = 0; p < kNumPhases; ++p) st.phase_ms[size_t(p)] = 1e3 * t.seconds(Phase(p));
      st.phase_intervals = t.take_intervals();
      t.record_intervals(false);
    }
    done_.push_back(std::move(st));
  }

  void set_phase_recording(bool times, bool intervals) override {
    record_times_ = times || intervals;
    record_intervals_ = intervals;
  }
  bool cheap_phase_times() const override { return true; }

  StepStats collect() override {
    MOE_CHECK(!done_.empty(), "CpuStep::collect: no submitted step is waiting to be collected");
    StepStats s = std::move(done_.front());
    done_.pop_front();
    return s;
  }

  ForwardStats evaluate(const Batch& b, uint64_t routing_seed) override {
    if (pipelined()) return evaluate_pipeline(b, routing_seed);
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
    nlohmann::json pipeline = nullptr;
    if (pipelined()) {
      const double busy = compute_s_, idle = idle_s_;
      pipeline = {{"pp", plan_.sizes.pp},
                  {"virtual_stages", cfg_.parallel.virtual_stages},
                  {"micro_batches", plan_.micro_steps},
                  {"stage", topo_.pp_rank},
                  {"compute_s", busy},
                  {"idle_s", idle},
                  {"idle_fraction", busy + idle > 0 ? idle / (busy + idle) : 0.0},
                  {"formula_bubble_fraction",
                   bubble_fraction_formula(plan_.sizes.pp, cfg_.parallel.virtual_stages, plan_.micro_steps)}};
    }
    return {{"machine", {{"cpu", cpu_model()}, {"hardware_threads", std::thread::hardware_concurrency()}}},
            {"pipeline", pipeline},
            {"cuda_graph", false},
            {"mem_peak_gib", peak_rss_gib()},
            {"mem_peak_source", "peak resident set size of the process (getrusage ru_maxrss)"}};
  }

 private:
  // Forward and backward of this rank's micro-batches; the statistics summed over dp.
  StepStats run_micro_batches(const StepInput& in) {
    if (pipelined()) return run_pipeline(in);
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
    init_layer_stats(st, model.num_moe_layers());
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
      for (size_t l = 0; l < f.tokens_per_expert.size(); ++l) add_layer_stats(st, l, f, l, micro_total);
    }
    sum_step_stats(st, *topo_.dp_comm);
    return st;
  }

  // Zeroed per-layer statistics of `layers` MoE layers.
  void init_layer_stats(StepStats& st, int64_t layers) const {
    st.tokens_per_expert.assign(size_t(layers), std::vector<int64_t>(size_t(cfg_.moe.num_experts), 0));
    st.layer_lb_loss.assign(size_t(layers), 0.0);
    st.layer_z_loss.assign(size_t(layers), 0.0);
    st.layer_dropped.assign(size_t(layers), 0);
  }

  // Adds MoE layer j of forward `f` into the step's MoE layer l (losses as a mean over the
  // step's micro_total micro-batches).
  static void add_layer_stats(StepStats& st, size_t l, const ForwardStats& f, size_t j, double micro_total) {
    for (size_t e = 0; e < f.tokens_per_expert[j].size(); ++e) st.tokens_per_expert[l][e] += f.tokens_per_expert[j][e];
    st.layer_lb_loss[l] += f.layer_lb_loss[j] / micro_total;
    st.layer_z_loss[l] += f.layer_z_loss[j] / micro_total;
    st.layer_dropped[l] += f.layer_dropped[j];
  }

  bool pipelined() const { return plan_.sizes.pp > 1; }

  // Pipeline rank holding model stage k, and the message tag of (forward?, micro-batch, stage).
  int stage_rank(int64_t k) const { return int(k % plan_.sizes.pp); }
  int tag_of(bool forward, int64_t mb, int64_t k) const {
    return int((2 * (k * plan_.micro_steps + mb) + (forward ? 0 : 1)) % (Comm::kMaxTag + 1));
  }
  int64_t last_model_stage() const { return plan_.sizes.pp * cfg_.parallel.virtual_stages - 1; }

  // recv on the pipeline group, the wait counted as idle time.
  void recv_timed(float* data, int64_t n, int src, int tag) {
    const auto t0 = std::chrono::steady_clock::now();
    topo_.pp_comm->recv(data, n, src, tag);
    idle_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // MoE-layer index (of the whole model) of each MoE block in [first, last), in order.
  std::vector<int64_t> moe_indices(int64_t first, int64_t last) const {
    std::vector<int64_t> out;
    int64_t idx = 0;
    for (int64_t l = 0; l < last; ++l) {
      if (is_dense_layer(cfg_.model, l)) continue;
      if (l >= first) out.push_back(idx);
      ++idx;
    }
    return out;
  }

  // This stage's part of every micro-batch in pipeline_schedule's order; statistics summed over
  // the pipeline group, then over the stage's dp group.
  StepStats run_pipeline(const StepInput& in) {
    const std::vector<Batch>& micro = *in.micro;
    Model<float>& model = s_.model;
    model.zero_grads();
    const auto t_start = std::chrono::steady_clock::now();
    const double idle_before = idle_s_;
    const double micro_total = double(plan_.micro_batches);
    const LossScales scales{1.0 / double(std::max<int64_t>(1, in.global_targets)),
                            cfg_.moe.lb_loss_weight / micro_total, cfg_.moe.z_loss_weight / micro_total};
    const double moe_layers = double(std::max<int64_t>(1, model.num_moe_layers()));
    StepStats st;
    st.step = in.step;
    st.num_targets = in.global_targets;
    init_layer_stats(st, model.num_moe_layers());
    const PipelineStage& stage = topo_.stage;
    const int64_t m_count = int64_t(micro.size());
    MOE_CHECK(m_count == plan_.micro_steps, "pipeline step: ", m_count, " micro-batches, the plan has ",
              plan_.micro_steps);
    const std::vector<PipelineOp> ops =
        pipeline_schedule(plan_.sizes.pp, cfg_.parallel.virtual_stages, m_count, topo_.pp_rank);
    const int64_t d = cfg_.model.d_model;
    std::map<std::pair<int64_t, int64_t>, StageActivations<float>> in_flight;
    std::vector<float> x, dx;
    for (const PipelineOp& op : ops) {
      const Batch& b = micro[size_t(op.micro_batch)];
      const int64_t n = b.num_sequences() * b.seq_len;
      const int64_t v = op.virtual_stage, k = stage.model_stage(v);
      const int64_t first = stage.first[size_t(v)], last = stage.last[size_t(v)];
      const bool embed = k == 0, head = k == last_model_stage();
      if (op.forward) {
        x.assign(size_t(n * d), 0.f);
        if (embed) {
          model.embed_forward(b.inputs.data(), n, x.data());
        } else {
          recv_timed(x.data(), n * d, stage_rank(k - 1), tag_of(true, op.micro_batch, k));
        }
        const uint64_t seed =
            routing_seed(cfg_.train.seed, in.step - 1, topo_.dp_rank * plan_.micro_steps + op.micro_batch);
        ForwardStats f;
        model.forward_blocks(first, last, b.num_sequences(), b.seq_len, seed, x.data(), f);
        st.lb_loss += f.lb_loss / moe_layers / micro_total;
        st.z_loss += f.z_loss / moe_layers / micro_total;
        st.num_routes += f.num_routes;
        st.num_dropped += f.num_dropped;
        const std::vector<int64_t> idx = moe_indices(first, last);
        for (size_t j = 0; j < f.tokens_per_expert.size(); ++j) add_layer_stats(st, size_t(idx[j]), f, j, micro_total);
        if (head) {
          model.head_forward(x.data(), b.targets.data(), n, f);
          st.ce_sum += f.ce_sum;
        } else {
          topo_.pp_comm->send(x.data(), n * d, stage_rank(k + 1), tag_of(true, op.micro_batch, k + 1));
        }
        in_flight[{op.micro_batch, v}] = model.take_activations(first, last, embed, head);
      } else {
        auto it = in_flight.find({op.micro_batch, v});
        MOE_CHECK(it != in_flight.end(), "pipeline schedule on stage ", topo_.pp_rank, ": backward of micro-batch ",
                  op.micro_batch, " before its forward");
        model.restore_activations(std::move(it->second));
        in_flight.erase(it);
        dx.assign(size_t(n * d), 0.f);
        if (head) {
          model.head_backward(scales, dx.data());
        } else {
          recv_timed(dx.data(), n * d, stage_rank(k + 1), tag_of(false, op.micro_batch, k));
        }
        model.backward_blocks(first, last, scales, dx.data());
        if (embed) {
          model.embed_backward(dx.data());
        } else {
          topo_.pp_comm->send(dx.data(), n * d, stage_rank(k - 1), tag_of(false, op.micro_batch, k - 1));
        }
      }
    }
    topo_.pp_comm->flush_sends();
    const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    compute_s_ += total - (idle_s_ - idle_before);
    sum_step_stats(st, *topo_.pp_comm);
    sum_step_stats(st, *topo_.dp_comm);
    return st;
  }

  // One micro-batch's forward through every stage (no saved state kept for backward); the loss
  // figures from the last stage on every rank of the pipeline group.
  ForwardStats evaluate_pipeline(const Batch& b, uint64_t seed) {
    Model<float>& model = s_.model;
    const PipelineStage& stage = topo_.stage;
    const int64_t n = b.num_sequences() * b.seq_len, d = cfg_.model.d_model;
    std::vector<float> x(size_t(n * d));
    ForwardStats out;
    for (int64_t v = 0; v < stage.virtual_stages; ++v) {
      const int64_t k = stage.model_stage(v);
      if (k == 0) {
        model.embed_forward(b.inputs.data(), n, x.data());
      } else {
        topo_.pp_comm->recv(x.data(), n * d, stage_rank(k - 1), tag_of(true, 0, k));
      }
      ForwardStats f;
      model.forward_blocks(stage.first[size_t(v)], stage.last[size_t(v)], b.num_sequences(), b.seq_len, seed, x.data(), f);
      if (k == last_model_stage()) {
        model.head_forward(x.data(), b.targets.data(), n, out);
      } else {
        topo_.pp_comm->send(x.data(), n * d, stage_rank(k + 1), tag_of(true, 0, k + 1));
      }
    }
    topo_.pp_comm->flush_sends();
    double ce = out.ce_sum;
    int64_t count = out.num_targets;
    topo_.pp_comm->all_reduce(&ce, 1, ReduceOp::kSum);
    topo_.pp_comm->all_reduce(&count, 1, ReduceOp::kSum);
    out.ce_sum = ce;
    out.num_targets = count;
    return out;
  }

  // Gradients summed over the ranks; the global norm from the squares each rank owns.
  void reduce_gradients(StepStats& st) {
    Model<float>& model = s_.model;
    if (plan_.sizes.dp == 1 && !pipelined()) {
      st.grad_norm = global_grad_norm(model.grads(), model.layout().total_numel());
      return;
    }
    double sq = 0;
    if (plan_.sizes.dp == 1) {  // a pipeline stage without data parallelism: its own tensors
      for (const ShardGroup& g : s_.owned) sq += owned_sum_squares(g.plan, model.layout(), model.grads());
    } else if (s_.zero) {
      s_.zero->reduce_gradients(model.grads());
      sq = s_.zero->local_sum_squares();
    } else {
      Comm* expert_comm = plan_.sizes.ep > 1 ? topo_.ep_dp_comm.get() : nullptr;
      all_reduce_gradients(model.layout(), model.grads(), *topo_.dp_comm, expert_comm);
      for (const ShardGroup& g : s_.owned) sq += owned_sum_squares(g.plan, model.layout(), model.grads());
    }
    topo_.dp_comm->all_reduce(&sq, 1, ReduceOp::kSum);
    if (pipelined()) topo_.pp_comm->all_reduce(&sq, 1, ReduceOp::kSum);  // every stage's squares
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
    st.expert_bias = model.expert_bias();  // every rank holds every MoE layer's bias
  }

  bool record_times_ = false, record_intervals_ = false;
  const Config& cfg_;
  const RunPlan& plan_;
  const Topology& topo_;
  HostState& s_;
  std::deque<StepStats> done_;
  double compute_s_ = 0, idle_s_ = 0;  // pipeline: seconds computing and waiting in recv, all steps
};

}  // namespace

double StepStats::loss() const { return ce_sum / double(std::max<int64_t>(1, num_targets)); }

// Sums the step's statistics over `comm` (no-op on one rank): global figures on every rank, so
// that every rank takes the same decisions.
void sum_step_stats(StepStats& st, Comm& comm) {
  if (comm.size() > 1) {
    std::vector<double> sums = {st.ce_sum, st.lb_loss, st.z_loss};
    sums.insert(sums.end(), st.layer_lb_loss.begin(), st.layer_lb_loss.end());
    sums.insert(sums.end(), st.layer_z_loss.begin(), st.layer_z_loss.end());
    comm.all_reduce(sums.data(), int64_t(sums.size()), ReduceOp::kSum);
    st.ce_sum = sums[0], st.lb_loss = sums[1], st.z_loss = sums[2];
    size_t at = 3;
    for (double& v : st.layer_lb_loss) v = sums[at++];
    for (double& v : st.layer_z_loss) v = sums[at++];
    std::vector<int64_t> ints = {st.num_routes, st.num_dropped};
    for (const auto& layer : st.tokens_per_expert) ints.insert(ints.end(), layer.begin(), layer.end());
    ints.insert(ints.end(), st.layer_dropped.begin(), st.layer_dropped.end());
    comm.all_reduce(ints.data(), int64_t(ints.size()), ReduceOp::kSum);
    st.num_routes = ints[0], st.num_dropped = ints[1];
    at = 2;
    for (auto& layer : st.tokens_per_expert)
      for (int64_t& c : layer) c = ints[at++];
    for (int64_t& c : st.layer_dropped) c = ints[at++];
  }
}


std::unique_ptr<Step> make_step(const Config& cfg, const RunPlan& plan, const Topology& topo, HostState* state,
                                std::ostream& out) {
  if (plan.device == "cuda") return make_gpu_step(cfg, plan, topo, state, out);
  MOE_CHECK(state != nullptr, "the CPU step trains a HostState: make one for the run plan first");
  MOE_CHECK(!cfg.optim.deferred_update, "optim.deferred_update = true schedules the GPU step's update (on a second "
            "stream, block by block in the next step); the CPU step applies it at the end of its step, with the "
            "same values: set optim.deferred_update = false for train.device = \"", plan.device, "\"");
  return std::make_unique<CpuStep>(cfg, plan, topo, *state);
}

}  // namespace moe
