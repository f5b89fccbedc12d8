// The GPU step of a pipeline stage (parallel.pp > 1 on train.device = "cuda"): this rank's stage
// model (CudaModel over the HostState's layout part) runs its part of every micro-batch in the
// 1F1B order of pipeline_schedule; activations go forward and their gradients back by NCCL
// send/recv over the pipeline group on the model's stream, each send issued in one NCCL group with
// the next receive (the send-forward-receive-backward and send-backward-receive-forward pairs), so
// neighbouring stages cannot wait on each other's sends. A stage keeps the FP32 input of every
// micro-batch in flight (the previous stage's residual stream, or the token ids on the first) and,
// when a backward is not for the micro-batch it ran last, runs that micro-batch's forward again
// from it before the backward (the same kernels on the same input: the same activations bit for
// bit), so a stage holds one micro-batch's activations whatever the number in flight; the last
// stage's backward always follows its forward. After the schedule: the gradients summed over the
// stage's dp group (NCCL), the squared norm of the stage's gradients summed over the pipeline
// group on the host, AdamW on the device (cuda::adamw_step), the statistics summed over the
// pipeline and dp groups on the host, the aux-loss-free bias updated on the host (every rank the
// same) and uploaded. Synchronous: one step in flight. Eval runs the micro-batch through the
// stages. Refused: virtual stages, expert parallelism, ZeRO-1 and recompute modes other than none
// with pp on the GPU (say so), phase times and traces.
#ifdef MOECORE_HAS_CUDA

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "core/error.h"
#include "cpu/fp8.h"
#include "cuda/event_timer.h"
#include "cuda/ops/device_info.h"
#include "cuda/ops/memory.h"
#include "cuda/ops/nccl.h"
#include "cuda/ops/optim.h"
#include "cuda/optim_types.h"
#include "model/cuda_model.h"
#include "model/layout.h"
#include "model/model.h"
#include "parallel/comm.h"
#include "parallel/nccl_comm.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/topology.h"
#include "train/checkpointing.h"
#include "train/cuda_step.h"
#include "train/routing_seed.h"
#include "train/run_plan.h"
#include "train/step.h"

namespace moe {

namespace {

constexpr double kGiB = double(1ull << 30);

class GpuPipelineStep final : public Step {
 public:
  GpuPipelineStep(const Config& cfg, const RunPlan& plan, const Topology& topo, HostState* state, std::ostream& out)
      : cfg_(cfg), plan_(plan), topo_(topo), state_(state) {
    MOE_CHECK(cfg.parallel.virtual_stages == 1, "parallel.virtual_stages = ", cfg.parallel.virtual_stages,
              " with parallel.pp = ", plan.sizes.pp, " on train.device = \"cuda\": the GPU pipeline step runs 1F1B "
              "with one stage per GPU; set parallel.virtual_stages = 1 (interleaving runs on the cpu backend)");
    MOE_CHECK(plan.sizes.ep == 1, "parallel.ep = ", plan.sizes.ep, " with parallel.pp = ", plan.sizes.pp,
              " on train.device = \"cuda\": expert parallelism inside pipeline stages runs on the cpu backend so far; "
              "set parallel.ep = 1");
    MOE_CHECK(!plan.zero, "parallel.zero = true with parallel.pp = ", plan.sizes.pp, " and parallel.dp = ",
              plan.sizes.dp, " on train.device = \"cuda\": the GPU pipeline step keeps whole AdamW moments per "
              "stage; set parallel.zero = false");
    MOE_CHECK(plan.recompute == Recompute::kNone, "train.recompute = \"", cfg.train.recompute,
              "\" with parallel.pp on train.device = \"cuda\": a GPU pipeline stage already runs a micro-batch's "
              "forward again before its backward when another ran since; set train.recompute = \"none\"");
    MOE_CHECK(state == nullptr || state->initialised, "the GPU pipeline step starts from the HostState's values "
              "(initialised on the host from train.seed, or resumed)");
    if (topo.world->size() > 1) bind_local_gpu(*topo.world);
    used_before_ = cuda::device_used_bytes();
    cuda::reset_device_peak_bytes();
    pp_ = make_nccl_comm(*topo.pp_comm);
    if (plan.sizes.dp > 1) dp_ = make_nccl_comm(*topo.dp_comm);
    const PipelineStage& st = topo.stage;
    out << "pipeline stage " << topo.pp_rank << " of " << plan.sizes.pp << " on this GPU: layers [" << st.first[0]
        << ", " << st.last[0] << ")" << (st.embed ? " + embedding" : "") << (st.head ? " + LM head" : "")
        << "; 1F1B over NCCL send/recv" << (dp_ ? ", gradients all-reduced over the stage's dp group" : "") << "\n"
        << std::flush;
    // The stage's tensors: the HostState's, or (the bench, no host state) initialised on the host
    // from train.seed as the whole model's, with zero moments and bias.
    LayoutPart part;
    part.layers.assign(size_t(cfg.model.n_layers), 0);
    for (int64_t l = 0; l < cfg.model.n_layers; ++l) part.layers[size_t(l)] = st.holds_layer(l) ? 1 : 0;
    part.embed = st.embed;
    part.head = st.head;
    if (state == nullptr) {
      own_ = std::make_unique<Model<float>>(cfg.model, cfg.moe, nullptr, part);
      own_->init_params(cfg.train.seed);
      own_moments_.assign(size_t(own_->layout().total_numel()), 0.0f);
    }
    const Model<float>& host = state ? state->model : *own_;
    model_ = std::make_unique<CudaModel>(cfg.model, cfg.moe, nullptr, part);
    // The last stage's backward follows its forward: the LM head's backward GEMMs run in its forward.
    model_->set_fuse_head_backward(st.head);
    model_->set_fp8(cfg.train.precision == "fp8", cpu::fp8_rule_named(cfg.train.fp8_scaling));
    MOE_CHECK(model_->layout().total_numel() == host.layout().total_numel(), "GPU pipeline step: the stage's ",
              "device layout holds ", model_->layout().total_numel(), " elements, its host mirror ",
              host.layout().total_numel());
    const int64_t total = model_->layout().total_numel();
    model_->load_params(host.params());
    bias_ = host.expert_bias();
    if (model_->num_moe_layers() > 0) model_->load_expert_bias(bias_);
    segments_ = std::make_unique<cuda::ParamSegmentTable>(model_->layout());
    // The moments as the run plan stores them (optim.moment_dtype): FP32, or BF16 rounded to nearest even.
    bf16_moments_ = plan.memory.bf16_moments();
    const size_t moment_bytes = size_t(total) * size_t(plan.memory.moment_bytes);
    exp_avg_.reserve(moment_bytes);
    exp_avg_sq_.reserve(moment_bytes);
    const float* m0 = state ? state->opt.exp_avg().data() : own_moments_.data();
    const float* v0 = state ? state->opt.exp_avg_sq().data() : own_moments_.data();
    cuda::copy_h2d_f32_stored(exp_avg_.data(), m0, total, bf16_moments_, model_->stream());
    cuda::copy_h2d_f32_stored(exp_avg_sq_.data(), v0, total, bf16_moments_, model_->stream());
    opt_.reserve(sizeof(cuda::OptimStepScalars));
    scalars_.step = state ? state->opt.steps_taken() : 0;
    norm_ws_bytes_ = cuda::global_grad_norm_workspace_bytes(total);
    norm_ws_.reserve(std::max<size_t>(norm_ws_bytes_, 16));
    squares_.reserve(sizeof(double));
    moe_layers_here_ = 0;
    for (int64_t l = st.first[0]; l < st.last[0]; ++l) moe_layers_here_ += is_dense_layer(cfg.model, l) ? 0 : 1;
    cuda::stream_sync(model_->stream());
  }

  void submit(const StepInput& in) override {
    MOE_CHECK(!done_, "GPU pipeline step: step ", in.step, " submitted before the previous one was collected");
    const std::vector<Batch>& micro = *in.micro;
    const int64_t m_count = int64_t(micro.size());
    MOE_CHECK(m_count == plan_.micro_steps, "pipeline step: ", m_count, " micro-batches, the plan has ",
              plan_.micro_steps);
    CudaModel& model = *model_;
    const cuda::Stream s = model.stream();
    const PipelineStage& stage = topo_.stage;
    const int64_t first = stage.first[0], last = stage.last[0], d = cfg_.model.d_model;
    const bool embed = stage.embed, head = stage.head;
    const int64_t pp = plan_.sizes.pp, rank = topo_.pp_rank;
    const double micro_total = double(plan_.micro_batches);
    upload_ids(micro);
    model.zero_grads();
    model.reset_stats();
    model.set_loss_scales({1.0 / double(std::max<int64_t>(1, in.global_targets)),
                           cfg_.moe.lb_loss_weight / micro_total, cfg_.moe.z_loss_weight / micro_total});
    const std::vector<PipelineOp> ops = pipeline_schedule(pp, 1, m_count, int(rank));
    const int64_t n = micro[0].num_sequences() * micro[0].seq_len;
    grow(x_in_, size_t(m_count * n * d) * sizeof(float));
    grow(dx_in_, size_t(n * d) * sizeof(float));
    int64_t forwards = 0, last_forward = -1;
    Pending pending;
    auto begin = [&](int64_t mb) {
      const Batch& b = micro[size_t(mb)];
      const uint64_t seed = routing_seed(cfg_.train.seed, in.step - 1, topo_.dp_rank * plan_.micro_steps + mb);
      model.begin_forward(ids_in(mb, n), ids_tg(mb, n), b.num_sequences(), b.seq_len, seed);
      ++forwards;
    };
    auto stage_input = [&](int64_t mb) {
      if (embed) {
        model.embedding_forward();
      } else {
        model.set_stage_input(x_in(mb, n * d));
      }
    };
    for (const PipelineOp& op : ops) {
      const int64_t mb = op.micro_batch;
      if (op.forward) {
        begin(mb);
        if (!embed) exchange(pending, x_in(mb, n * d), n * d, int(rank - 1));
        else flush(pending);
        stage_input(mb);
        model.forward_blocks(first, last);
        if (head) {
          model.lm_head_forward();
        } else {
          pending = {model.residual_device(), n * d, int(rank + 1)};
        }
        model.end_forward();
        last_forward = mb;
      } else {
        if (mb != last_forward) {  // this micro-batch's activations again, from its stage input
          MOE_CHECK(!head, "GPU pipeline step: the last stage's backward of micro-batch ", mb, " does not follow its "
                    "forward");
          begin(mb);
          stage_input(mb);
          model.forward_blocks(first, last);
          last_forward = mb;
        }
        if (head) {
          flush(pending);
          model.lm_head_backward();
        } else {
          exchange(pending, dx_in_.as<float>(), n * d, int(rank + 1));
          model.set_stage_output_grad(dx_in_.as<float>());
        }
        model.backward_blocks(first, last);
        if (embed) {
          model.embedding_backward();
        } else {
          pending = {model.residual_grad_device(), n * d, int(rank - 1)};
        }
        last_forward = -1;  // backward consumed the saved activations' meaning for the next op
      }
    }
    flush(pending);
    // Gradients over the stage's dp group, then the global norm over the pipeline.
    const int64_t total = model.layout().total_numel();
    if (dp_) dp_->all_reduce_sum(model.grads(), total, cuda::NcclDType::kF32, s);
    cuda::grad_sum_squares(model.grads(), total, squares_.as<double>(), norm_ws_.data(), norm_ws_bytes_, s);
    wait_stream("the pipeline step");
    double sq = 0;
    cuda::copy_d2h(&sq, squares_.data(), sizeof(double), s);
    topo_.pp_comm->all_reduce(&sq, 1, ReduceOp::kSum);
    StepStats st = stage_stats(in, forwards, micro_total, n);
    st.grad_norm = std::sqrt(sq);
    st.skipped = !std::isfinite(st.loss()) || !std::isfinite(st.grad_norm);
    // AdamW on the device (a non-finite norm skips it there; a non-finite loss is made one).
    scalars_.lr = in.lr;
    scalars_.grad_norm = st.skipped ? std::nan("") : st.grad_norm;
    cuda::copy_h2d(opt_.data(), &scalars_, sizeof(scalars_), s);
    if (bf16_moments_) {
      cuda::adamw_step(*segments_, cfg_.optim, model.params(), model.grads(), exp_avg_.as<uint16_t>(),
                       exp_avg_sq_.as<uint16_t>(), model.params_bf16(), opt_.as<cuda::OptimStepScalars>(), s);
    } else {
      cuda::adamw_step(*segments_, cfg_.optim, model.params(), model.grads(), exp_avg_.as<float>(),
                       exp_avg_sq_.as<float>(), model.params_bf16(), opt_.as<cuda::OptimStepScalars>(), s);
    }
    model.mark_params_changed();
    cuda::copy_d2h(&scalars_, opt_.data(), sizeof(scalars_), s);
    if (!st.skipped && cfg_.moe.bias_update_rate > 0) update_bias(st.tokens_per_expert);
    st.optimizer_steps = scalars_.step;
    st.expert_bias = bias_;
    stats_ = std::move(st);
    done_ = true;
  }

  StepStats collect() override {
    MOE_CHECK(done_, "GPU pipeline step: collect without a submitted step");
    done_ = false;
    return std::move(stats_);
  }
  int64_t pending() const override { return done_ ? 1 : 0; }
  int64_t in_flight() const override { return 1; }

  // One micro-batch through the stages (nothing kept for backward); the CE sum and target count
  // of the last stage on every rank of the pipeline group.
  ForwardStats evaluate(const Batch& b, uint64_t routing_seed) override {
    CudaModel& model = *model_;
    const PipelineStage& stage = topo_.stage;
    const int64_t n = b.num_sequences() * b.seq_len, d = cfg_.model.d_model, rank = topo_.pp_rank;
    upload_ids({b});
    model.reset_stats();
    const bool fused = model.fuse_head_backward();
    model.set_fuse_head_backward(false);
    model.begin_forward(ids_in(0, n), ids_tg(0, n), b.num_sequences(), b.seq_len, routing_seed);
    grow(x_in_, size_t(n * d) * sizeof(float));
    if (stage.embed) {
      model.embedding_forward();
    } else {
      pp_->recv(x_in_.data(), n * d, cuda::NcclDType::kF32, int(rank - 1), model.stream());
      model.set_stage_input(x_in_.as<float>());
    }
    model.forward_blocks(stage.first[0], stage.last[0]);
    if (stage.head) {
      model.lm_head_forward();
    } else {
      pp_->send(model.residual_device(), n * d, cuda::NcclDType::kF32, int(rank + 1), model.stream());
    }
    model.end_forward();
    wait_stream("the pipeline evaluation");
    model.set_fuse_head_backward(fused);
    ForwardStats f;
    if (stage.head) f = model.read_stats();
    double ce = stage.head ? f.ce_sum : 0.0;
    int64_t count = 0;
    if (stage.head)
      for (int32_t t : b.targets) count += t >= 0 ? 1 : 0;
    topo_.pp_comm->all_reduce(&ce, 1, ReduceOp::kSum);
    topo_.pp_comm->all_reduce(&count, 1, ReduceOp::kSum);
    ForwardStats out;
    out.ce_sum = ce;
    out.num_targets = count;
    return out;
  }
  bool eval_is_collective() const override { return true; }

  void sync_host_state(bool /*all_ranks*/) override {
    MOE_CHECK(state_ != nullptr, "GPU pipeline step: no host state to download into (a bench step)");
    MOE_CHECK(!done_, "GPU pipeline step: sync_host_state with a step not collected");
    const int64_t total = model_->layout().total_numel();
    const std::vector<float> p = model_->download_params();
    std::copy(p.begin(), p.end(), state_->model.params());
    cuda::copy_d2h_stored_to_f32(state_->opt.exp_avg().data(), exp_avg_.data(), total, bf16_moments_, model_->stream());
    cuda::copy_d2h_stored_to_f32(state_->opt.exp_avg_sq().data(), exp_avg_sq_.data(), total, bf16_moments_,
                                 model_->stream());
    state_->opt.set_steps_taken(scalars_.step);
    state_->model.expert_bias() = bias_;
    state_->initialised = true;
  }

  bool has_device_figures() const override { return true; }
  DeviceFigures device_figures(int64_t steps, double seconds) const override {
    DeviceFigures g;
    g.num_gpus = plan_.sizes.dp * plan_.sizes.pp;
    g.tflops_per_gpu = plan_.flops_per_step * double(steps) / seconds / 1e12 / double(g.num_gpus);
    g.mem_peak_gib = double(cuda::device_peak_bytes()) / kGiB;
    size_t free_bytes = 0, total_bytes = 0;
    cuda::device_mem_info(&free_bytes, &total_bytes);
    g.mem_used_gib = double(total_bytes - free_bytes) / kGiB;
    return g;
  }

  void set_phase_recording(bool times, bool intervals) override {
    MOE_CHECK(!times && !intervals, "log.phase_times / log.trace with parallel.pp on train.device = \"cuda\": the GPU "
              "pipeline step records no phase times yet; turn them off (or train on the cpu backend)");
  }
  bool cheap_phase_times() const override { return false; }

  void set_profiling(bool on) override {
    if (on && !timer_) timer_ = std::make_unique<cuda::EventTimer>(model_->stream());
    model_->set_phase_timer(on ? timer_.get() : nullptr);
  }
  std::vector<std::pair<std::string, double>> profiled_phases_ms() override {
    MOE_CHECK(timer_ != nullptr, "GPU pipeline step: profiled_phases_ms before set_profiling(true)");
    const auto ms = timer_->collect();
    std::vector<std::pair<std::string, double>> out;
    for (int p = 0; p < kNumPhases; ++p) out.emplace_back(phase_name(Phase(p)), ms[size_t(p)]);
    return out;
  }
  nlohmann::json bench_details() override {
    const cuda::DeviceInfo dev = cuda::device_info();
    const size_t used_after = cuda::device_used_bytes();
    double peak_bytes = double(cuda::device_peak_bytes());
    if (topo_.world->size() > 1) topo_.world->all_reduce(&peak_bytes, 1, ReduceOp::kMax);  // the fullest GPU
    return {{"gpu", {{"name", dev.name}, {"sm_count", dev.sm_count}, {"memory_gib", double(dev.total_bytes) / kGiB}}},
            {"num_gpus", plan_.sizes.dp * plan_.sizes.pp},
            {"cuda_graph", false},
            {"graph_launches", 0},
            {"mem_peak_gib", peak_bytes / kGiB},
            {"mem_peak_source", "high-water mark of moecore's device allocations, largest over GPUs"},
            {"mem_used_gib", double(used_after) / kGiB},
            {"mem_bench_gib", double(used_after - std::min(used_after, used_before_)) / kGiB},
            {"kernel_variants", cuda_kernel_variants()},
            {"pipeline",
             {{"pp", plan_.sizes.pp},
              {"stage", topo_.pp_rank},
              {"layers", {topo_.stage.first[0], topo_.stage.last[0]}},
              {"schedule", "1F1B, a stage's forward run again before a backward that does not follow it"},
              {"bubble_formula", bubble_fraction_formula(plan_.sizes.pp, 1, plan_.micro_steps)}}}};
  }

 private:
  struct Pending {  // a send issued together with the next receive
    const float* data = nullptr;
    int64_t count = 0;
    int peer = -1;
  };

  void flush(Pending& p) {
    if (p.data == nullptr) return;
    pp_->send(p.data, p.count, cuda::NcclDType::kF32, p.peer, model_->stream());
    p = {};
  }
  // The pending send (if any) and a receive of `count` floats from `peer` into `into`, in one group.
  void exchange(Pending& p, float* into, int64_t count, int peer) {
    pp_->group_start();
    if (p.data != nullptr) pp_->send(p.data, p.count, cuda::NcclDType::kF32, p.peer, model_->stream());
    pp_->recv(into, count, cuda::NcclDType::kF32, peer, model_->stream());
    pp_->group_end();
    p = {};
  }

  static void grow(cuda::DeviceBuffer& b, size_t bytes) {
    if (b.bytes() < bytes) b.reserve(bytes);
  }
  // The micro-batches' token ids on the device: inputs then targets of each, [m, 2, n] int32.
  void upload_ids(const std::vector<Batch>& micro) {
    std::vector<int32_t> host;
    for (const Batch& b : micro) {
      host.insert(host.end(), b.inputs.begin(), b.inputs.end());
      host.insert(host.end(), b.targets.begin(), b.targets.end());
    }
    grow(ids_, host.size() * sizeof(int32_t));
    cuda::copy_h2d(ids_.data(), host.data(), host.size() * sizeof(int32_t), model_->stream());
  }
  const int32_t* ids_in(int64_t mb, int64_t n) const { return ids_.as<int32_t>() + mb * 2 * n; }
  const int32_t* ids_tg(int64_t mb, int64_t n) const { return ids_.as<int32_t>() + mb * 2 * n + n; }
  float* x_in(int64_t mb, int64_t nd) const { return x_in_.as<float>() + mb * nd; }

  void wait_stream(const char* what) {
    cuda::Event done = cuda::event_create();
    cuda::event_record(done, model_->stream());
    try {
      pp_->wait(done, what);
    } catch (...) {
      cuda::event_destroy(done);
      throw;
    }
    cuda::event_destroy(done);
  }

  // This stage's statistics of the step, summed over the pipeline group and the dp group.
  StepStats stage_stats(const StepInput& in, int64_t forwards, double micro_total, int64_t n) {
    const ForwardStats f = model_->read_stats();
    const int64_t m = model_->num_moe_layers(), e = cfg_.moe.num_experts;
    const double calls = double(std::max<int64_t>(1, forwards));
    StepStats st;
    st.step = in.step;
    st.num_targets = in.global_targets;
    st.ce_sum = f.ce_sum;
    // read_stats divides the sums by the forward calls (re-runs included) and M: back to sums,
    // then the mean over the step's micro-batches (every stage runs each once).
    st.lb_loss = f.lb_loss * calls / micro_total;
    st.z_loss = f.z_loss * calls / micro_total;
    st.tokens_per_expert.assign(size_t(m), std::vector<int64_t>(size_t(e), 0));
    st.layer_lb_loss.assign(size_t(m), 0.0);
    st.layer_z_loss.assign(size_t(m), 0.0);
    st.layer_dropped.assign(size_t(m), 0);
    for (int64_t l = 0; l < m; ++l) {
      for (int64_t i = 0; i < e; ++i) st.tokens_per_expert[size_t(l)][size_t(i)] = f.tokens_per_expert[size_t(l)][size_t(i)];
      st.layer_lb_loss[size_t(l)] = f.layer_lb_loss[size_t(l)] * calls / micro_total;
      st.layer_z_loss[size_t(l)] = f.layer_z_loss[size_t(l)] * calls / micro_total;
      st.layer_dropped[size_t(l)] = f.layer_dropped[size_t(l)];
    }
    st.num_routes = moe_layers_here_ * n * cfg_.moe.top_k * plan_.micro_steps;
    st.num_dropped = f.num_dropped;
    for (Comm* c : {topo_.pp_comm.get(), topo_.dp_comm.get()})
      if (c != nullptr) sum_step_stats(st, *c);
    return st;
  }

  // The aux-loss-free bias of every MoE layer (Model::update_expert_bias's formula), the same on
  // every rank, uploaded to the stage's model.
  void update_bias(const std::vector<std::vector<int64_t>>& counts) {
    apply_expert_bias_update(bias_, counts, cfg_.moe.num_experts, cfg_.moe.bias_update_rate);
    model_->load_expert_bias(bias_);
  }

  const Config& cfg_;
  const RunPlan& plan_;
  const Topology& topo_;
  HostState* state_;
  std::unique_ptr<cuda::NcclComm> pp_, dp_;
  std::unique_ptr<Model<float>> own_;  // the bench's host initialisation (no HostState)
  std::vector<float> own_moments_;
  std::unique_ptr<CudaModel> model_;
  std::unique_ptr<cuda::ParamSegmentTable> segments_;
  bool bf16_moments_ = false;  // optim.moment_dtype = "bf16": exp_avg_ and exp_avg_sq_ hold BF16 bits
  cuda::DeviceBuffer exp_avg_, exp_avg_sq_, opt_, norm_ws_, squares_, ids_, x_in_, dx_in_;
  size_t norm_ws_bytes_ = 0, used_before_ = 0;
  cuda::OptimStepScalars scalars_{};
  std::vector<float> bias_;
  int64_t moe_layers_here_ = 0;
  std::unique_ptr<cuda::EventTimer> timer_;
  StepStats stats_;
  bool done_ = false;
};

}  // namespace

std::unique_ptr<Step> make_gpu_pipeline_step(const Config& cfg, const RunPlan& plan, const Topology& topo,
                                             HostState* state, std::ostream& out) {
  return std::make_unique<GpuPipelineStep>(cfg, plan, topo, state, out);
}

}  // namespace moe

#endif  // MOECORE_HAS_CUDA
