// The planner's arithmetic. Memory: make_run_plan (cuda) and activation_memory per mode. Traffic:
// ring collectives and the four row exchanges per MoE layer and micro-step. Time: every phase of
// the olmoe-8l step (train/ceilings.h) split into the work the measured op rates price (grouped
// GEMM per op, cuDNN attention forward / backward, dense GEMM) and the rest (norms, RoPE, SwiGLU,
// permutes, residual adds: memory traffic), which scales with the tensor sizes it touches; the
// optimizer scales with the parameters it reads; collectives with their bytes over measured rates.
#include "train/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>

#include "core/checked_math.h"
#include "core/config_io.h"
#include "core/error.h"
#include "model/layout.h"
#include "parallel/pipeline_schedule.h"

namespace moe {

namespace {

constexpr double kGiB = double(1ull << 30);

// The reference shape: olmoe-8l (configs/olmoe-8l.toml) with the GPU's ref_layers layers, whose
// measured phases GpuCeilings holds.
struct RefShape {
  double b = 4, s = 4096, n = 16384, d = 2048, q = 2048, c = 2048, heads = 16, hd = 128;
  double layers = 8, moe_layers = 8, experts = 64, top_k = 8, rows = 131072, inner = 1024, vocab = 50304;
  double params = 3562604544.0;
  double expert_params = 8.0 * 64 * 3 * 2048 * 1024;
};
RefShape ref_shape(const GpuCeilings& g) {
  RefShape r;
  r.layers = r.moe_layers = g.ref_layers;
  r.params = g.ref_params;
  r.expert_params = g.ref_layers * r.experts * 3.0 * r.d * r.inner;
  return r;
}

double ms(double flops, double tflops) { return flops / (tflops * 1e12) * 1e3; }

struct Shape {
  double b, s, n, d, q, c, heads, hd, layers, moe_layers, dense_layers, experts, top_k, rows, inner, vocab;
  double dense_hidden, shared_hidden;
};

Shape shape_of(const Config& cfg) {
  const ModelConfig& m = cfg.model;
  const MoeConfig& e = cfg.moe;
  Shape s{};
  s.b = double(cfg.train.micro_batch);
  s.s = double(cfg.train.seq_len);
  s.n = s.b * s.s;
  s.d = double(m.d_model);
  s.hd = double(m.head_dim());
  s.heads = double(m.n_heads);
  s.q = s.heads * s.hd;
  s.c = double(m.n_kv_heads) * s.hd;
  s.layers = double(m.n_layers);
  s.moe_layers = double(num_moe_layers(m));
  s.dense_layers = s.layers - s.moe_layers;
  s.experts = double(e.num_experts);
  s.top_k = double(e.top_k);
  s.rows = s.n * s.top_k;
  s.inner = double(e.expert_hidden);
  s.vocab = double(m.vocab_size);
  s.dense_hidden = double(m.dense_hidden);
  s.shared_hidden = double(e.shared_experts) * s.inner;
  return s;
}

double sdpa_fwd_ms(double b, double heads, double s, double hd, const GpuCeilings& g) {
  return ms(4.0 * b * heads * s * s * hd / 2.0, g.attention_fwd_tflops);
}
double sdpa_bwd_ms(double b, double heads, double s, double hd, const GpuCeilings& g) {
  return ms(2.5 * 4.0 * b * heads * s * s * hd / 2.0, g.attention_bwd_tflops);
}
double proj_ms(double n, double d, double q, double c, double factor, const GpuCeilings& g, bool fp8 = false) {
  return dense_linear_ms(2.0 * n * (d * q + 2.0 * d * c + q * d), factor, fp8, g);
}
// One MoE layer's grouped GEMMs for `rows` rows: gate_up and down, forward, dgrad and wgrad (the
// forward and data gradients at the FP8 kernel's rates under the FP8 recipe).
struct ExpertGemm {
  double gate_up_fwd, down_fwd, backward;
  double total() const { return gate_up_fwd + down_fwd + backward; }
};
ExpertGemm expert_gemm_ms(double rows, double d, double inner, const GpuCeilings& g, bool fp8 = false) {
  const double gu = 2.0 * rows * d * 2.0 * inner, dn = 2.0 * rows * inner * d;
  return {ms(gu, fp8 ? g.gate_up_fwd_fp8_tflops : g.gate_up_fwd_tflops),
          ms(dn, fp8 ? g.down_fwd_fp8_tflops : g.down_fwd_tflops),
          ms(gu, fp8 ? g.gate_up_dgrad_fp8_tflops : g.gate_up_dgrad_tflops) + ms(gu, g.gate_up_wgrad_tflops) +
              ms(dn, fp8 ? g.down_dgrad_fp8_tflops : g.down_dgrad_tflops) + ms(dn, g.down_wgrad_tflops)};
}

// The reference step's phases: the BF16 step's, or under the FP8 recipe the FP8 step's.
const RefStep& ref_step(const GpuCeilings& g, bool fp8) { return fp8 ? g.ref_fp8 : g.ref_bf16; }

// The MLP phase's memory traffic of one micro-step (norms, residual adds), equal per layer: the
// reference's MLP phase (olmoe-8l has no MLP GEMMs) scaled by layers x N x D.
double mlp_glue_ms(const Shape& s, const RefShape& r, const RefStep& ref) {
  return ref.mlp * (s.layers * s.n * s.d) / (r.layers * r.n * r.d);
}

// The experts' weight traffic of one micro-step (BF16 weight reads, FP32 gradient accumulation)
// over `expert_params` expert parameters on this GPU, in ms: what grows with the expert count at
// fixed active parameters, beside the GEMMs' FLOPs.
double expert_weight_ms(double expert_params, const GpuCeilings& g) {
  return g.expert_weight_bytes_per_param * expert_params / g.expert_weight_bytes_per_s * 1e3;
}

// The glue (non-GEMM, non-attention-kernel) part of the reference phases, in ms.
struct RefGlue {
  double attention, experts;
};
// fp8: the glue of the reference's FP8 step (olmoe-8l: its experts and projections in FP8, no
// MLP), which holds the FP8 recipe's quantisation passes.
RefGlue ref_glue(const GpuCeilings& g, bool fp8 = false) {
  const RefShape r = ref_shape(g);
  const RefStep& ref = ref_step(g, fp8);
  const double sdpa = r.layers * (sdpa_fwd_ms(r.b, r.heads, r.s, r.hd, g) + sdpa_bwd_ms(r.b, r.heads, r.s, r.hd, g));
  const double proj = r.layers * proj_ms(r.n, r.d, r.q, r.c, 6.0, g, fp8);
  const double gemm = r.moe_layers * expert_gemm_ms(r.rows, r.d, r.inner, g, fp8).total();
  return {std::max(0.0, ref.attention - sdpa - proj),
          std::max(0.0, ref.experts - gemm - expert_weight_ms(r.expert_params, g))};
}

StepTime estimate_step(const LayoutPlan& p, Recompute mode, const GpuCeilings& g) {
  const Shape s = shape_of(p.cfg);
  const RefShape r = ref_shape(g);
  const Fp8Parts f8 = fp8_parts(p.cfg);
  const RefStep& ref = ref_step(g, f8.any);
  const RefGlue glue0 = ref_glue(g, f8.any);
  StepTime t;
  // One micro-step's phases.
  const double sdpa_f = s.layers * sdpa_fwd_ms(s.b, s.heads, s.s, s.hd, g);
  const double sdpa_b = s.layers * sdpa_bwd_ms(s.b, s.heads, s.s, s.hd, g);
  const double proj = s.layers * proj_ms(s.n, s.d, s.q, s.c, 6.0, g, f8.projections);
  const double attn_glue = glue0.attention * (s.layers * s.n * (s.d + s.q + s.c)) / (r.layers * r.n * (r.d + r.q + r.c));
  const double mlp_glue = mlp_glue_ms(s, r, ref);
  const double mlp_fwd = 2.0 * s.n * 3.0 * s.d;  // per hidden unit
  const double mlp_gemm = dense_linear_ms(mlp_fwd * s.dense_layers * s.dense_hidden, 6.0, f8.dense_mlp, g) +
                          dense_linear_ms(mlp_fwd * s.moe_layers * s.shared_hidden, 6.0, f8.shared_mlp, g);
  // SwiGLU of dense and shared MLPs at the experts' glue rate per hidden element.
  const double glue_per_hidden = glue0.experts / (r.moe_layers * r.rows * r.inner);
  const double mlp_swiglu = glue_per_hidden * s.n * (s.dense_layers * s.dense_hidden + s.moe_layers * s.shared_hidden);
  const ExpertGemm eg = expert_gemm_ms(s.rows, s.d, s.inner, g, f8.experts);
  const double experts_glue = glue_per_hidden * s.moe_layers * s.rows * s.inner;
  const double route_scale = (s.moe_layers * s.rows * s.d) / (r.moe_layers * r.rows * r.d);
  const double micro = double(p.run.micro_steps);
  t.embedding = micro * ref.embedding * (s.n * s.d) / (r.n * r.d);
  t.attention = micro * (sdpa_f + sdpa_b + proj + attn_glue);
  t.mlp = micro * (mlp_glue + mlp_gemm + mlp_swiglu);
  t.router = micro * ref.router * (s.moe_layers * s.n * s.experts) / (r.moe_layers * r.n * r.experts);
  t.dispatch = micro * ref.dispatch * route_scale;
  t.combine = micro * ref.combine * route_scale;
  const double weights = expert_weight_ms(double(p.run.memory.expert_params), g);
  t.experts = micro * (s.moe_layers * eg.total() + experts_glue + weights);
  t.lm_head = micro * ref.lm_head * (s.n * s.d * s.vocab) / (r.n * r.d * r.vocab);
  // Recompute: the forward work backward redoes (core/recompute.h). Forward glue is taken as a
  // third of each phase's glue (backward does about twice the forward's traffic), a permute as
  // half of the dispatch / combine phase.
  if (mode == Recompute::kSelective) {
    const double qkv_fwd = 2.0 * s.n * s.d * (s.q + 2.0 * s.c) * s.layers;
    t.recompute = micro * (dense_linear_ms(qkv_fwd, 2.0, f8.projections, g) + attn_glue / 3.0 +
                           mlp_glue / 3.0 + mlp_swiglu / 3.0 + s.moe_layers * eg.down_fwd + experts_glue / 3.0 +
                           ref.dispatch * route_scale / 2.0);
  } else if (mode == Recompute::kFull) {
    t.recompute = micro * (sdpa_f + proj / 3.0 + attn_glue / 3.0 + (mlp_glue + mlp_gemm + mlp_swiglu) / 3.0 +
                           s.moe_layers * (eg.gate_up_fwd + eg.down_fwd) + experts_glue / 3.0 +
                           (ref.dispatch + ref.combine) * route_scale / 2.0);
  }
  // The optimizer: the grad norm's read (4 bytes a local parameter, but none of an expert
  // parameter where the norm takes the experts' squares from their weight-gradient GEMMs: the run
  // plan's norm_from_expert_squares, as in the reference step) and the AdamW update (30 bytes over
  // this GPU's moment shard, 22 with BF16 moments; the reference step's moments are FP32); the
  // gradients are not zeroed (the first backward writes them).
  const MemoryEstimate& m = p.run.memory;
  const double local = double(m.local_params);
  const double shard = p.zero ? p.moments / (2.0 * m.moment_bytes) : local;
  const double norm_read = local - (p.run.norm_from_expert_squares ? double(m.expert_params) : 0.0);
  const double ref_bytes = 4.0 * (r.params - r.expert_params) + adamw_update_bytes(4.0) * r.params;
  t.optimizer = ref.optimizer * (4.0 * norm_read + adamw_update_bytes(m.moment_bytes) * shard) / ref_bytes;
  // Collectives.
  // The gradient reduction (all-reduce, or ZeRO-1's reduce-scatter) overlaps backward under
  // parallel.overlap_grad_reduce without ep; ZeRO-1's all-gather follows the update.
  const bool overlap = p.cfg.parallel.overlap_grad_reduce && p.run.sizes.ep == 1;
  const double paid = overlap ? g.overlap_paid_fraction : 1.0;
  t.grad_reduce = ((p.comm.dp_allreduce_sent + p.comm.zero_reduce_scatter_sent) * paid + p.comm.zero_all_gather_sent) /
                  g.allreduce_bus_bytes_per_s * 1e3;
  t.ep_exchange = p.comm.ep_per_step / g.ep_exchange_bytes_per_s * 1e3;
  return t;
}

CommVolume comm_volume(const LayoutPlan& p) {
  CommVolume v;
  const RunPlan& run = p.run;
  const double dp = double(run.sizes.dp), ep = double(run.sizes.ep), ep_dp = double(run.ep_dp);
  // Gradients travel in parallel.grad_reduce_dtype (FP32 or BF16), parameters in FP32.
  const double gbytes = p.cfg.parallel.grad_reduce_dtype == "bf16" ? 2.0 : 4.0;
  const double dense = gbytes * double(run.memory.dense_params), expert = gbytes * double(run.memory.expert_params);
  if (p.zero) {
    v.zero_reduce_scatter_sent = (dp - 1.0) / dp * dense + (ep_dp - 1.0) / ep_dp * expert;
    v.zero_all_gather_sent = (dp - 1.0) / dp * 4.0 * double(run.memory.dense_params) +
                             (ep_dp - 1.0) / ep_dp * 4.0 * double(run.memory.expert_params);
  } else {
    if (dp > 1) v.dp_allreduce_buffer += dense;
    if (ep_dp > 1) v.dp_allreduce_buffer += expert;
    v.dp_allreduce_sent = 2.0 * (dp - 1.0) / dp * dense + 2.0 * (ep_dp - 1.0) / ep_dp * expert;
  }
  if (ep > 1) {
    const double rows = double(run.tokens_per_micro_batch) * double(p.cfg.moe.top_k);
    const double layers = double(num_moe_layers(p.cfg.model));
    const double one = layers * rows * double(p.cfg.model.d_model) * 2.0 * (ep - 1.0) / ep;
    v.ep_dispatch_fwd_micro = v.ep_combine_fwd_micro = v.ep_dispatch_bwd_micro = v.ep_combine_bwd_micro = one;
    v.ep_per_step = 4.0 * one * double(run.micro_steps);
  }
  if (run.sizes.pp > 1) {
    v.pp_send_per_micro = 4.0 * double(run.tokens_per_micro_batch) * double(p.cfg.model.d_model);
    v.pp_per_step = (run.sizes.pp > 2 ? 2.0 : 1.0) * double(run.micro_steps) * v.pp_send_per_micro;
  }
  return v;
}

// pp > 1, recompute none: the step of the GPU pipeline step's 1F1B schedule. Each layer's share of
// the whole model's phases of one micro-batch (estimate_step over the whole model: attention and
// the MoE phases equal per layer, the MLP's glue equal per layer and its GEMMs and SwiGLU by the
// layer's hidden width), a stage's forward a third of its layers' time (the planner's convention
// for recompute), its backward two thirds; the first stage also runs the embedding, the last the
// LM head (its backward inside the forward, as the step fuses them). A stage other than the last
// runs a micro-batch's forward again before a backward that does not follow it. Each send of the
// FP32 residual stream [N, D] or its gradient occupies the sender's stream for 4 N D bytes at the
// all-reduce's measured bus rate (no point-to-point rate is measured), and the receiver's next
// operation starts after it. The schedule is simulated operation by operation; the phases returned
// are those of the stage busiest in it, with its sends and the rest of the makespan (its waits),
// the optimizer over its parameters and its dp gradient all-reduce. Fills p.stages and p.makespan_ms.
StepTime estimate_pipeline_step(LayoutPlan& p, const GpuCeilings& g) {
  const Shape s = shape_of(p.cfg);
  const RefShape r = ref_shape(g);
  const int64_t P = p.run.sizes.pp, m = p.run.micro_steps, L = p.cfg.model.n_layers;
  const double micro = double(m);
  LayoutPlan whole = p;
  whole.run.memory.expert_params = int64_t(s.moe_layers * s.experts * 3.0 * s.d * s.inner);
  const StepTime t = estimate_step(whole, Recompute::kNone, g);
  const double mlp_glue = mlp_glue_ms(s, r, ref_step(g, fp8_parts(p.cfg).any));
  const double hidden_total = s.dense_layers * s.dense_hidden + s.moe_layers * s.shared_hidden;
  const double mlp_hidden = std::max(0.0, t.mlp / micro - mlp_glue);
  struct Layer {
    double attention = 0, mlp = 0, router = 0, dispatch = 0, experts = 0, combine = 0;
    double total() const { return attention + mlp + router + dispatch + experts + combine; }
  };
  std::vector<Layer> layers(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    Layer& x = layers[size_t(l)];
    const bool dense = is_dense_layer(p.cfg.model, l);
    x.attention = t.attention / micro / s.layers;
    x.mlp = mlp_glue / s.layers +
            (hidden_total > 0 ? mlp_hidden * (dense ? s.dense_hidden : s.shared_hidden) / hidden_total : 0.0);
    if (!dense) {
      x.router = t.router / micro / s.moe_layers;
      x.dispatch = t.dispatch / micro / s.moe_layers;
      x.experts = t.experts / micro / s.moe_layers;
      x.combine = t.combine / micro / s.moe_layers;
    }
  }
  const double embedding = t.embedding / micro, head = t.lm_head / micro;
  const double send = p.comm.pp_send_per_micro / g.allreduce_bus_bytes_per_s * 1e3;
  p.stages.assign(size_t(P), StagePlan{});
  for (int64_t k = 0; k < P; ++k) {
    StagePlan& st = p.stages[size_t(k)];
    st.first_layer = p.run.stage_bounds[size_t(k)];
    st.end_layer = p.run.stage_bounds[size_t(k) + 1];
    double work = 0;
    for (int64_t l = st.first_layer; l < st.end_layer; ++l) work += layers[size_t(l)].total();
    st.forward_ms = work / 3.0 + (k == 0 ? embedding / 3.0 : 0.0) + (k == P - 1 ? head : 0.0);
    st.backward_ms = 2.0 * work / 3.0 + (k == 0 ? 2.0 * embedding / 3.0 : 0.0);
  }
  // The schedule, operation by operation: an operation starts when its stage is free and its input
  // (the previous stage's forward, the next stage's backward) has been sent.
  std::vector<std::vector<PipelineOp>> ops(static_cast<size_t>(P));
  for (int64_t k = 0; k < P; ++k) ops[size_t(k)] = pipeline_schedule(P, 1, m, k);
  std::vector<size_t> next(static_cast<size_t>(P), 0);
  std::vector<double> free_at(static_cast<size_t>(P), 0.0);
  std::vector<int64_t> last_forward(static_cast<size_t>(P), -1);
  const std::vector<double> unsent(static_cast<size_t>(m), -1.0);
  std::vector<std::vector<double>> fwd_sent(static_cast<size_t>(P), unsent), bwd_sent(static_cast<size_t>(P), unsent);
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t k = 0; k < P; ++k) {
      StagePlan& st = p.stages[size_t(k)];
      while (next[size_t(k)] < ops[size_t(k)].size()) {
        const PipelineOp& op = ops[size_t(k)][next[size_t(k)]];
        const size_t mb = size_t(op.micro_batch);
        double ready = 0;
        if (op.forward && k > 0) ready = fwd_sent[size_t(k) - 1][mb];
        if (!op.forward && k < P - 1) ready = bwd_sent[size_t(k) + 1][mb];
        if (ready < 0) break;  // its input is not sent yet
        double busy = op.forward ? st.forward_ms : st.backward_ms;
        if (!op.forward && k < P - 1 && last_forward[size_t(k)] != op.micro_batch) {
          busy += st.forward_ms;  // the forward again, from the stage's saved input
          ++st.forwards_again;
        }
        if (op.forward || k < P - 1) last_forward[size_t(k)] = op.micro_batch;
        const bool sends = op.forward ? k < P - 1 : k > 0;
        const double done = std::max(free_at[size_t(k)], ready) + busy + (sends ? send : 0.0);
        st.busy_ms += busy;
        if (sends) st.sends_ms += send;
        (op.forward ? fwd_sent : bwd_sent)[size_t(k)][mb] = done;
        free_at[size_t(k)] = done;
        ++next[size_t(k)];
        progress = true;
      }
    }
  }
  for (int64_t k = 0; k < P; ++k)
    MOE_CHECK(next[size_t(k)] == ops[size_t(k)].size(), "planner: the pipeline schedule of stage ", k,
              " did not finish (an operation waits for one that never runs)");
  p.makespan_ms = *std::max_element(free_at.begin(), free_at.end());
  p.busiest_stage = 0;
  for (int64_t k = 1; k < P; ++k) {
    const StagePlan &a = p.stages[size_t(k)], &b = p.stages[size_t(p.busiest_stage)];
    if (a.busy_ms + a.sends_ms > b.busy_ms + b.sends_ms) p.busiest_stage = k;
  }
  const int64_t k = p.busiest_stage;
  const StagePlan& st = p.stages[size_t(k)];
  StepTime out;
  for (int64_t l = st.first_layer; l < st.end_layer; ++l) {
    const Layer& x = layers[size_t(l)];
    out.attention += micro * x.attention;
    out.mlp += micro * x.mlp;
    out.router += micro * x.router;
    out.dispatch += micro * x.dispatch;
    out.experts += micro * x.experts;
    out.combine += micro * x.combine;
  }
  if (k == 0) out.embedding = micro * embedding;
  if (k == P - 1) out.lm_head = micro * head;
  out.recompute = double(st.forwards_again) * st.forward_ms;
  out.pipeline_sends = st.sends_ms;
  out.pipeline_wait = std::max(0.0, p.makespan_ms - st.busy_ms - st.sends_ms);
  // The optimizer over the stage's parameters (the largest stage's: the run plan's local figures)
  // and its dp all-reduce, after the schedule.
  const StepTime local = estimate_step(p, Recompute::kNone, g);
  out.optimizer = local.optimizer;
  out.grad_reduce = local.grad_reduce;
  return out;
}

int64_t gcd64(int64_t a, int64_t b) { return b == 0 ? a : gcd64(b, a % b); }

const char* kModeNames[3] = {"none", "selective", "full"};

std::string gib(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3f", bytes / kGiB);
  return b;
}

std::string gb(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f", bytes / 1e9);
  return b;
}

}  // namespace

LayoutRequest parse_layout(const std::string& text, int64_t gpus) {
  const char* expected = "expected dp=N,ep=N,pp=N (any of the three, each a positive integer)";
  MOE_CHECK(!text.empty(), "--layout: the value is empty; ", expected);
  LayoutRequest r;
  bool seen[3] = {false, false, false};
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const std::string part = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const size_t eq = part.find('=');
    MOE_CHECK(eq != std::string::npos, "--layout '", text, "': '", part, "' is not key=value; ", expected);
    const std::string key = part.substr(0, eq), value = part.substr(eq + 1);
    const int idx = key == "dp" ? 0 : key == "ep" ? 1 : key == "pp" ? 2 : -1;
    MOE_CHECK(idx >= 0, "--layout '", text, "': unknown key '", key, "'; ", expected);
    MOE_CHECK(!seen[idx], "--layout '", text, "': ", key, " is given twice");
    seen[idx] = true;
    int64_t n = 0;
    size_t used = 0;
    try {
      n = std::stoll(value, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    MOE_CHECK(used == value.size() && !value.empty() && n >= 1 && n <= kMaxRanks, "--layout '", text, "': ", key,
              " must be an integer in [1, ", kMaxRanks, "], got '", value, "'");
    (idx == 0 ? r.dp : idx == 1 ? r.ep : r.pp) = n;
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (!seen[0]) r.dp = gpus > 0 ? gpus / r.pp : 1;
  MOE_CHECK(gpus <= 0 || r.dp * r.pp == gpus, "--layout '", text, "': dp x pp = ", r.dp, " x ", r.pp, " = ",
            r.dp * r.pp, " GPUs, but --gpus is ", gpus);
  return r;
}

LayoutPlan plan_layout(const Config& cfg, const LayoutRequest& layout, double gpu_memory_gib, const GpuCeilings& g) {
  MOE_CHECK(layout.pp == 1 || layout.ep == 1, "layout dp ", layout.dp, ", ep ", layout.ep, ", pp ", layout.pp,
            ": the GPU pipeline step runs no expert parallelism inside a stage; plan ep = 1 with pp > 1");
  MOE_CHECK(gpu_memory_gib > 0 && std::isfinite(gpu_memory_gib), "--gpu-memory must be a positive number of GiB, got ",
            gpu_memory_gib);
  LayoutPlan p;
  p.cfg = cfg;
  p.cfg.train.device = "cuda";
  // The cuda backend's precisions: FP8 as configured (its codes and workspaces in the memory), BF16
  // otherwise (a config written for the CPU's FP32 trains in BF16 there).
  p.cfg.train.precision = cfg.train.precision == "fp8" ? "fp8" : "bf16";
  p.cfg.parallel.dp = layout.dp;
  p.cfg.parallel.ep = layout.ep;
  p.cfg.parallel.pp = layout.pp;
  if (layout.pp > 1) {
    // What the GPU pipeline step runs (train/gpu_pipeline_step.cpp refuses the rest).
    if (cfg.parallel.virtual_stages != 1) {
      p.notes.push_back("parallel.virtual_stages " + std::to_string(cfg.parallel.virtual_stages) +
                        " -> 1 (the GPU pipeline step runs one stage a rank)");
    }
    if (cfg.parallel.zero && layout.dp > 1) {
      p.notes.push_back("parallel.zero true -> false (the GPU pipeline step keeps each stage's moments whole)");
    }
    if (parse_recompute(cfg.train.recompute) != Recompute::kNone) {
      p.notes.push_back("train.recompute \"" + cfg.train.recompute +
                        "\" -> \"none\" (a stage runs a micro-batch's forward again before its backward instead)");
    }
    p.cfg.parallel.virtual_stages = 1;
    p.cfg.parallel.zero = false;
    p.cfg.train.recompute = "none";
  }
  // The global batch must split over dp x micro-batch: raise it to the least multiple that does.
  const int64_t per_step = checked_mul(layout.dp, cfg.train.micro_batch, "dp x train.micro_batch");
  if (cfg.train.global_batch > 0 && cfg.train.global_batch % per_step != 0) {
    const int64_t gb = cfg.train.global_batch;
    p.cfg.train.global_batch = checked_mul(gb / gcd64(gb, per_step), per_step, "the planned global batch");
    p.batch_note = "train.global_batch " + std::to_string(gb) + " -> " + std::to_string(p.cfg.train.global_batch) +
                   " (the least multiple of dp " + std::to_string(layout.dp) + " x micro_batch " +
                   std::to_string(cfg.train.micro_batch) + ")";
  }
  p.run = make_run_plan(p.cfg, layout.dp * layout.pp, "cuda");
  p.zero = p.run.zero;
  p.moments = p.run.memory.moments;
  p.comm = comm_volume(p);
  p.gpu_memory = gpu_memory_gib * kGiB;
  std::array<ActivationMemory, 3> acts = activation_memory_all_modes(
      p.cfg.model, p.cfg.moe, p.run.micro_batch, p.run.seq_len, p.run.micro_steps, true, layout.ep);
  // The run's own scratch (make_run_plan may add the BF16 reduce stage): every mode has it.
  for (ActivationMemory& a : acts) a.scratch = p.run.memory.activation.scratch;
  // pp > 1: the stage's activations as the run plan counts them (recompute none).
  if (layout.pp > 1) acts[0] = p.run.memory.activation;
  const MemoryEstimate& m = p.run.memory;
  const StepTime pipeline = layout.pp > 1 ? estimate_pipeline_step(p, g) : StepTime{};
  for (size_t i = 0; i < 3; ++i) {
    ModePlan& mp = p.modes[i];
    mp.mode = Recompute(i);
    mp.activations = acts[i];
    mp.memory_total = m.params + m.grads + p.moments + acts[i].total() + m.exchange;
    if (layout.pp > 1 && i > 0) {  // mode none's memory, no time: the mode cannot run
      mp = p.modes[0];
      mp.mode = Recompute(i);
      mp.fits = false;
      mp.time = StepTime{};
      mp.tokens_per_s_per_gpu = mp.tflops_per_gpu = mp.mfu = 0;
      mp.refused = "the GPU pipeline step runs train.recompute = \"none\" only (it runs a stage's forward again "
                   "itself)";
      continue;
    }
    mp.fits = mp.memory_total <= p.gpu_memory;
    mp.time = layout.pp > 1 ? pipeline : estimate_step(p, mp.mode, g);
    const double step_s = mp.time.step_ms() / 1e3;
    const double world = double(p.run.sizes.world);
    mp.tokens_per_s_per_gpu = double(p.run.tokens_per_step) / world / step_s;
    mp.tflops_per_gpu = p.run.flops_per_step / world / step_s / 1e12;
    mp.mfu = mp.tflops_per_gpu / kGpuPeakTflops;
  }
  return p;
}

Enumeration enumerate_layouts(const Config& cfg, int64_t gpus, double gpu_memory_gib, const GpuCeilings& g) {
  MOE_CHECK(gpus >= 1, "--gpus must be >= 1, got ", gpus);
  Enumeration out;
  const int64_t experts = num_moe_layers(cfg.model) > 0 ? cfg.moe.num_experts : 1;
  for (int64_t pp = 1; pp <= std::min(gpus, cfg.model.n_layers); ++pp) {
    if (gpus % pp != 0) continue;
    const int64_t dp = gpus / pp;
    for (int64_t ep = 1; ep <= (pp > 1 ? 1 : dp); ++ep) {
      if (dp % ep != 0 || experts % ep != 0) continue;
      const LayoutPlan plan = plan_layout(cfg, LayoutRequest{dp, ep, pp}, gpu_memory_gib, g);
      for (size_t i = 0; i < 3; ++i) {
        if (!plan.modes[i].refused.empty()) continue;
        LayoutChoice c{plan, Recompute(i)};
        (plan.modes[i].fits ? out.fitting : out.not_fitting).push_back(std::move(c));
      }
    }
  }
  std::stable_sort(out.fitting.begin(), out.fitting.end(), [](const LayoutChoice& a, const LayoutChoice& b) {
    const ModePlan &x = a.mode_plan(), &y = b.mode_plan();
    if (x.tokens_per_s_per_gpu != y.tokens_per_s_per_gpu) return x.tokens_per_s_per_gpu > y.tokens_per_s_per_gpu;
    return x.memory_total < y.memory_total;
  });
  return out;
}

std::string describe_layout_plan(const LayoutPlan& p, const GpuCeilings& g) {
  const RunPlan& run = p.run;
  const MemoryEstimate& m = run.memory;
  const size_t configured = size_t(run.recompute);
  std::string out;
  char buf[512];
  auto line = [&](const char* fmt, auto... args) {
    std::snprintf(buf, sizeof buf, fmt, args...);
    out += buf;
  };
  const bool fp8 = p.cfg.train.precision == "fp8";
  line("# plan              %lld x %s (%.1f GiB per GPU): dp %lld, ep %lld, ep-dp %lld, pp %lld; the cuda backend "
       "(%s)\n",
       (long long)run.sizes.world, g.name, p.gpu_memory / kGiB, (long long)run.sizes.dp, (long long)run.sizes.ep,
       (long long)run.ep_dp, (long long)run.sizes.pp, fp8 ? "FP8" : "BF16");
  if (!p.batch_note.empty()) line("# batch note        %s\n", p.batch_note.c_str());
  for (const std::string& n : p.notes) line("# pipeline note     %s\n", n.c_str());
  out += describe_run_plan(run);
  auto row = [&](const char* name, const std::array<double, 3>& v) {
    line("  %-38s %11s %11s %11s\n", name, gib(v[0]).c_str(), gib(v[1]).c_str(), gib(v[2]).c_str());
  };
  auto same = [](double x) { return std::array<double, 3>{x, x, x}; };
  std::string head[3];
  for (size_t i = 0; i < 3; ++i) head[i] = std::string(kModeNames[i]) + (i == configured ? "*" : "");
  line("\n%-40s %11s %11s %11s\n", "memory per GPU, GiB (* = train.recompute)", head[0].c_str(), head[1].c_str(),
       head[2].c_str());
  row("BF16 params", same(2.0 * double(m.local_params)));
  row("FP32 master weights", same(4.0 * double(m.local_params)));
  // Under FP8: the E4M3 codes of the expert and FP8 MLP weights, each with its transposed copy.
  if (m.fp8_codes > 0) row("FP8 weight codes", same(m.fp8_codes));
  row("FP32 gradients", same(m.grads));
  char moments[96];
  if (p.zero) {
    std::snprintf(moments, sizeof moments, "AdamW moments (ZeRO-1: dp %lld, ep-dp %lld)", (long long)run.sizes.dp,
                  (long long)run.ep_dp);
  } else {
    std::snprintf(moments, sizeof moments, "AdamW moments (replicated)");
  }
  if (m.bf16_moments()) std::strncat(moments, ", BF16", sizeof moments - std::strlen(moments) - 1);
  row(moments, same(p.moments));
  std::array<double, 3> kept{}, pool{}, scratch{}, total{};
  for (size_t i = 0; i < 3; ++i) {
    kept[i] = p.modes[i].activations.kept_bytes();
    pool[i] = p.modes[i].activations.pool_bytes();
    scratch[i] = p.modes[i].activations.scratch_bytes();
    total[i] = p.modes[i].memory_total;
  }
  row("activations kept by the layers", kept);
  row("recompute pools (one layer per kind)", pool);
  row("scratch and workspaces", scratch);
  if (m.exchange > 0) row("expert exchange buffers", same(m.exchange));
  row("total", total);
  auto fits = [&](const ModePlan& mp) { return !mp.refused.empty() ? "refused" : mp.fits ? "yes" : "no"; };
  line("  %-38s %11s %11s %11s\n", "fits", fits(p.modes[0]), fits(p.modes[1]), fits(p.modes[2]));
  // FP32 moments where a mode does not fit: what BF16 moments (optim.moment_dtype) would leave.
  const double saving = bf16_moment_saving(m);
  if (saving > 0 && !(p.modes[0].fits && p.modes[1].fits && p.modes[2].fits)) {
    std::array<double, 3> t16{};
    const char* f16[3];
    for (size_t i = 0; i < 3; ++i) {
      t16[i] = total[i] - saving;
      f16[i] = !p.modes[i].refused.empty() ? "refused" : t16[i] <= p.gpu_memory ? "yes" : "no";
    }
    row("total, optim.moment_dtype = \"bf16\"", t16);
    line("  %-38s %11s %11s %11s\n", "fits, optim.moment_dtype = \"bf16\"", f16[0], f16[1], f16[2]);
  }
  for (const ModePlan& mp : p.modes)
    if (!mp.refused.empty()) line("  %s: refused: %s\n", kModeNames[size_t(mp.mode)], mp.refused.c_str());

  const ActivationMemory& cur = p.modes[configured].activations;
  line("\nactivations of train.recompute = \"%s\", GiB\n", kModeNames[configured]);
  for (const MemoryItem& i : cur.kept) line("  kept  %-44s %9s\n", i.name.c_str(), gib(i.bytes).c_str());
  for (const MemoryItem& i : cur.pool) line("  pool  %-44s %9s\n", i.name.c_str(), gib(i.bytes).c_str());
  for (const MemoryItem& i : cur.scratch) line("  once  %-44s %9s\n", i.name.c_str(), gib(i.bytes).c_str());

  const CommVolume& c = p.comm;
  line("\ncommunication per GPU and step, GB sent\n");
  if (p.zero) {
    line("  ZeRO-1 reduce-scatter (gradients)             %9s\n", gb(c.zero_reduce_scatter_sent).c_str());
    line("  ZeRO-1 all-gather (FP32 parameters)           %9s\n", gb(c.zero_all_gather_sent).c_str());
  } else {
    line("  DP gradient all-reduce (%s GB buffer)       %9s\n", gb(c.dp_allreduce_buffer).c_str(),
         gb(c.dp_allreduce_sent).c_str());
  }
  if (run.sizes.ep > 1) {
    line("  EP dispatch forward, per micro-step           %9s\n", gb(c.ep_dispatch_fwd_micro).c_str());
    line("  EP combine forward, per micro-step            %9s\n", gb(c.ep_combine_fwd_micro).c_str());
    line("  EP dispatch backward, per micro-step          %9s\n", gb(c.ep_dispatch_bwd_micro).c_str());
    line("  EP combine backward, per micro-step           %9s\n", gb(c.ep_combine_bwd_micro).c_str());
    line("  EP all-to-all, per step (%lld micro-steps)      %9s\n", (long long)run.micro_steps,
         gb(c.ep_per_step).c_str());
  }
  if (run.sizes.pp > 1) {
    line("  pipeline send (FP32 [N, D]), per micro-batch  %9s\n", gb(c.pp_send_per_micro).c_str());
    line("  pipeline sends, per step (the busiest stage)  %9s\n", gb(c.pp_per_step).c_str());
  }
  line("  total per step                                %9s\n", gb(c.total_per_step()).c_str());
  if (run.sizes.pp > 1) {
    line("\npipeline, recompute none: 1F1B over %lld micro-batches, simulated (docs/planning.md); bubble formula "
         "(pp-1)/(m+pp-1) = %.3f, makespan %.2f ms\n",
         (long long)run.micro_steps, bubble_fraction_formula(run.sizes.pp, 1, run.micro_steps), p.makespan_ms);
    line("  %-7s %-9s %12s %12s %14s %10s %10s %10s\n", "stage", "layers", "forward ms", "backward ms",
         "forward again", "busy ms", "sends ms", "idle");
    for (size_t k = 0; k < p.stages.size(); ++k) {
      const StagePlan& st = p.stages[k];
      const std::string layers = std::to_string(st.first_layer) + ".." + std::to_string(st.end_layer - 1);
      line("  %-7s %-9s %12.2f %12.2f %14lld %10.2f %10.2f %9.1f%%\n",
           (std::to_string(k) + (int64_t(k) == p.busiest_stage ? "*" : "")).c_str(), layers.c_str(), st.forward_ms,
           st.backward_ms, (long long)st.forwards_again, st.busy_ms, st.sends_ms,
           100.0 * (1.0 - (st.busy_ms + st.sends_ms) / p.makespan_ms));
    }
    line("  (* = the busiest stage, whose phases the step time below shows)\n");
  }

  line("\nstep time estimate, ms, from %s ceilings (docs/planning.md)%s\n", g.name,
       fp8 ? "; FP8: the FP8 GEMMs at their measured rates, the rest from the FP8 reference step" : "");
  line("%-40s %11s %11s %11s\n", "", head[0].c_str(), head[1].c_str(), head[2].c_str());
  auto trow = [&](const char* name, double StepTime::*f) {
    line("  %-38s %11.2f %11.2f %11.2f\n", name, p.modes[0].time.*f, p.modes[1].time.*f, p.modes[2].time.*f);
  };
  trow("embedding", &StepTime::embedding);
  trow("attention", &StepTime::attention);
  trow("mlp", &StepTime::mlp);
  trow("router", &StepTime::router);
  trow("dispatch", &StepTime::dispatch);
  trow("experts", &StepTime::experts);
  trow("combine", &StepTime::combine);
  trow("lm_head", &StepTime::lm_head);
  trow("recompute (forward again)", &StepTime::recompute);
  trow("ep exchange", &StepTime::ep_exchange);
  trow(p.zero ? "ZeRO-1 collectives" : "grad reduce (paid)", &StepTime::grad_reduce);
  trow("optimizer", &StepTime::optimizer);
  if (run.sizes.pp > 1) {
    trow("pipeline sends", &StepTime::pipeline_sends);
    trow("pipeline wait (bubble)", &StepTime::pipeline_wait);
  }
  line("  %-38s %11.2f %11.2f %11.2f\n", "step", p.modes[0].time.step_ms(), p.modes[1].time.step_ms(),
       p.modes[2].time.step_ms());
  line("  %-38s %11.0f %11.0f %11.0f\n", "tokens/s/GPU", p.modes[0].tokens_per_s_per_gpu,
       p.modes[1].tokens_per_s_per_gpu, p.modes[2].tokens_per_s_per_gpu);
  line("  %-38s %11.1f %11.1f %11.1f\n", "TFLOP/s/GPU (recompute not counted)", p.modes[0].tflops_per_gpu,
       p.modes[1].tflops_per_gpu, p.modes[2].tflops_per_gpu);
  line("  %-38s %10.1f%% %10.1f%% %10.1f%%\n", "MFU (of 989)", 100 * p.modes[0].mfu, 100 * p.modes[1].mfu,
       100 * p.modes[2].mfu);
  return out;
}

std::string describe_enumeration(const Enumeration& e, int64_t gpus, double gpu_memory_gib, const GpuCeilings& g) {
  std::string out;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "# layouts of %lld x %s (%.1f GiB per GPU): pp dividing the GPUs, ep dividing dp and "
                "moe.num_experts (1 with pp > 1); best first by estimated tokens/s/GPU (docs/planning.md)\n",
                (long long)gpus, g.name, gpu_memory_gib);
  out += buf;
  // Each dp raises the global batch to its own least multiple: every distinct note once.
  std::vector<std::string> notes;
  for (const auto* list : {&e.fitting, &e.not_fitting})
    for (const LayoutChoice& c : *list)
      if (!c.plan.batch_note.empty() && std::find(notes.begin(), notes.end(), c.plan.batch_note) == notes.end())
        notes.push_back(c.plan.batch_note);
  for (const std::string& n : notes) out += "# batch note        " + n + "\n";
  std::snprintf(buf, sizeof buf, "%-4s %-4s %-4s %-6s %-4s %-10s %10s %10s %13s %12s %12s\n", "rank", "dp", "ep",
                "ep-dp", "pp", "recompute", "GiB/GPU", "step ms", "tokens/s/GPU", "TFLOP/s/GPU", "comm GB/step");
  out += buf;
  int rank = 0;
  auto row = [&](const LayoutChoice& c, const char* tag) {
    const ModePlan& mp = c.mode_plan();
    const RunPlan& r = c.plan.run;
    std::string rk = tag[0] ? tag : std::to_string(++rank);
    std::snprintf(buf, sizeof buf, "%-4s %-4lld %-4lld %-6lld %-4lld %-10s %10.2f %10.1f %13.0f %12.1f %12.2f\n",
                  rk.c_str(), (long long)r.sizes.dp, (long long)r.sizes.ep, (long long)r.ep_dp,
                  (long long)r.sizes.pp, kModeNames[size_t(c.mode)],
                  mp.memory_total / kGiB, mp.time.step_ms(), mp.tokens_per_s_per_gpu, mp.tflops_per_gpu,
                  c.plan.comm.total_per_step() / 1e9);
    out += buf;
  };
  for (const LayoutChoice& c : e.fitting) row(c, "");
  if (e.fitting.empty()) out += "(no layout fits: see below)\n";
  if (!e.not_fitting.empty()) {
    out += "# do not fit:\n";
    for (const LayoutChoice& c : e.not_fitting) row(c, "-");
    // With FP32 moments: the layouts BF16 moments (optim.moment_dtype) would fit, and at what size.
    std::string bf16;
    for (const LayoutChoice& c : e.not_fitting) {
      const ModePlan& mp = c.mode_plan();
      const double saving = bf16_moment_saving(c.plan.run.memory), with_bf16 = mp.memory_total - saving;
      if (saving == 0 || !mp.refused.empty() || with_bf16 > c.plan.gpu_memory) continue;
      std::snprintf(buf, sizeof buf, "%sdp %lld ep %lld pp %lld %s %.2f GiB", bf16.empty() ? "" : ", ",
                    (long long)c.plan.run.sizes.dp, (long long)c.plan.run.sizes.ep, (long long)c.plan.run.sizes.pp,
                    kModeNames[size_t(c.mode)], with_bf16 / kGiB);
      bf16 += buf;
    }
    if (!bf16.empty()) out += "# fit with optim.moment_dtype = \"bf16\" (AdamW moments in BF16): " + bf16 + "\n";
  }
  return out;
}

namespace {

nlohmann::json items_json(const std::vector<MemoryItem>& items) {
  nlohmann::json j = nlohmann::json::object();
  for (const MemoryItem& i : items) j[i.name] = i.bytes;
  return j;
}

}  // namespace

nlohmann::json layout_plan_json(const LayoutPlan& p) {
  const RunPlan& run = p.run;
  const MemoryEstimate& m = run.memory;
  nlohmann::json modes = nlohmann::json::object();
  for (const ModePlan& mp : p.modes) {
    const StepTime& t = mp.time;
    modes[kModeNames[size_t(mp.mode)]] = {
        {"memory_bytes", mp.memory_total},
        {"fits", mp.fits},
        {"refused", mp.refused},
        {"activations",
         {{"kept_bytes", mp.activations.kept_bytes()},
          {"pool_bytes", mp.activations.pool_bytes()},
          {"scratch_bytes", mp.activations.scratch_bytes()},
          {"kept", items_json(mp.activations.kept)},
          {"pool", items_json(mp.activations.pool)},
          {"scratch", items_json(mp.activations.scratch)}}},
        {"time_ms",
         {{"embedding", t.embedding},
          {"attention", t.attention},
          {"mlp", t.mlp},
          {"router", t.router},
          {"dispatch", t.dispatch},
          {"experts", t.experts},
          {"combine", t.combine},
          {"lm_head", t.lm_head},
          {"recompute", t.recompute},
          {"ep_exchange", t.ep_exchange},
          {"grad_reduce", t.grad_reduce},
          {"optimizer", t.optimizer},
          {"pipeline_sends", t.pipeline_sends},
          {"pipeline_wait", t.pipeline_wait},
          {"step", t.step_ms()}}},
        {"tokens_per_s_per_gpu", mp.tokens_per_s_per_gpu},
        {"tflops_per_gpu", mp.tflops_per_gpu},
        {"mfu", mp.mfu}};
  }
  const CommVolume& c = p.comm;
  nlohmann::json pipeline = nullptr;
  if (run.sizes.pp > 1) {
    nlohmann::json stages = nlohmann::json::array();
    for (const StagePlan& st : p.stages)
      stages.push_back({{"first_layer", st.first_layer},
                        {"end_layer", st.end_layer},
                        {"forward_ms", st.forward_ms},
                        {"backward_ms", st.backward_ms},
                        {"forwards_again", st.forwards_again},
                        {"busy_ms", st.busy_ms},
                        {"sends_ms", st.sends_ms}});
    pipeline = {{"schedule", "1f1b"},
                {"micro_batches", run.micro_steps},
                {"makespan_ms", p.makespan_ms},
                {"bubble_formula", bubble_fraction_formula(run.sizes.pp, 1, run.micro_steps)},
                {"busiest_stage", p.busiest_stage},
                {"stages", stages}};
  }
  return {{"layout",
           {{"gpus", run.sizes.world}, {"dp", run.sizes.dp}, {"ep", run.sizes.ep}, {"ep_dp", run.ep_dp},
            {"pp", run.sizes.pp}}},
          {"batch",
           {{"global_batch", run.global_batch}, {"micro_batch", run.micro_batch}, {"micro_steps", run.micro_steps},
            {"seq_len", run.seq_len}, {"tokens_per_step", run.tokens_per_step}, {"note", p.batch_note}}},
          {"recompute", recompute_name(run.recompute)},
          {"precision", p.cfg.train.precision},
          {"gpu_memory_bytes", p.gpu_memory},
          {"parameters",
           {{"total", run.counts.total_params}, {"active", run.counts.active_params}, {"local", m.local_params},
            {"local_dense", m.dense_params}, {"local_experts", m.expert_params}}},
          {"flops_per_step", run.flops_per_step},
          {"memory_bytes",
           {{"params_bf16", 2.0 * double(m.local_params)},
            {"master_fp32", 4.0 * double(m.local_params)},
            {"fp8_weight_codes", m.fp8_codes},
            {"grads_fp32", m.grads},
            {"moments", p.moments},
            {"moments_sharding", p.zero ? "zero1" : "replicated"},
            {"moment_bytes", m.moment_bytes},
            {"moments_replicated", m.moments_replicated},
            {"exchange", m.exchange},
            {"host_mirror", m.host_mirror}}},
          {"comm_bytes_per_step",
           {{"dp_allreduce_buffer", c.dp_allreduce_buffer},
            {"dp_allreduce_sent", c.dp_allreduce_sent},
            {"zero_reduce_scatter_sent", c.zero_reduce_scatter_sent},
            {"zero_all_gather_sent", c.zero_all_gather_sent},
            {"ep_dispatch_fwd_per_micro_step", c.ep_dispatch_fwd_micro},
            {"ep_combine_fwd_per_micro_step", c.ep_combine_fwd_micro},
            {"ep_dispatch_bwd_per_micro_step", c.ep_dispatch_bwd_micro},
            {"ep_combine_bwd_per_micro_step", c.ep_combine_bwd_micro},
            {"ep_per_step", c.ep_per_step},
            {"pp_send_per_micro_batch", c.pp_send_per_micro},
            {"pp_per_step", c.pp_per_step},
            {"total", c.total_per_step()}}},
          {"notes", p.notes},
          {"pipeline", pipeline},
          {"modes", modes}};
}

nlohmann::json enumeration_json(const Enumeration& e, int64_t gpus, double gpu_memory_gib) {
  nlohmann::json fitting = nlohmann::json::array(), not_fitting = nlohmann::json::array();
  auto entry = [](const LayoutChoice& c) {
    const ModePlan& mp = c.mode_plan();
    return nlohmann::json{{"dp", c.plan.run.sizes.dp},
                          {"ep", c.plan.run.sizes.ep},
                          {"ep_dp", c.plan.run.ep_dp},
                          {"pp", c.plan.run.sizes.pp},
                          {"recompute", kModeNames[size_t(c.mode)]},
                          {"memory_bytes", mp.memory_total},
                          {"step_ms", mp.time.step_ms()},
                          {"tokens_per_s_per_gpu", mp.tokens_per_s_per_gpu},
                          {"tflops_per_gpu", mp.tflops_per_gpu},
                          {"comm_bytes_per_step", c.plan.comm.total_per_step()}};
  };
  for (const LayoutChoice& c : e.fitting) fitting.push_back(entry(c));
  for (const LayoutChoice& c : e.not_fitting) not_fitting.push_back(entry(c));
  return {{"gpus", gpus}, {"gpu_memory_gib", gpu_memory_gib}, {"fitting", fitting}, {"not_fitting", not_fitting}};
}

}  // namespace moe
