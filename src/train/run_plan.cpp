// make_run_plan: resolve_parallel's checks, then the batch arithmetic and one rank's memory.
// Memory per rank (bytes): cpu holds FP32 weights, gradients and moments (4 + 4 + 8 per local
// parameter; ZeRO-1 keeps 8 per parameter of this rank's shard: dense / dp + experts / ep-dp)
// and FP32 activations; cuda holds FP32 master, BF16 copy, FP32 gradients and moments (18 per
// parameter, 14 with BF16 moments; under train.precision = "fp8" 2 more per expert and FP8 MLP parameter, the FP8 codes; ZeRO-1 moments 8 per parameter of the shard, as on cpu), BF16 activations, and with ep > 1 the exchange buffers CudaModel adds (received
// BF16 rows and two int32 maps per MoE layer, two row buffers), plus a host mirror of 16 per parameter.
// Activations: activation_memory (train/memory_plan.h) for train.recompute.
#include "train/run_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include <unistd.h>

#include "core/checked_math.h"
#include "core/env_choice.h"
#include "core/error.h"
#include "core/fp8_types.h"
#include "cpu/fp8.h"
#include "model/layout.h"
#include "parallel/pipeline_schedule.h"

namespace moe {

namespace {

constexpr double kGiB = double(1ull << 30);

int64_t range_numel(const std::vector<FlatRange>& ranges) {
  int64_t n = 0;
  for (const FlatRange& r : ranges) n += r.end - r.begin;
  return n;
}

}  // namespace

Fp8Parts fp8_parts(const Config& cfg) {
  Fp8Parts f;
  if (cfg.train.precision != "fp8") return f;
  const ModelConfig& m = cfg.model;
  const int64_t q = m.n_heads * m.head_dim(), c = m.n_kv_heads * m.head_dim();
  f.any = true;
  f.experts = num_moe_layers(m) > 0;
  f.projections = fp8_mlp_shapes(m.d_model, q) && c % 128 == 0;
  f.dense_mlp = fp8_mlp_shapes(m.d_model, m.dense_hidden);
  f.shared_mlp = fp8_mlp_shapes(m.d_model, cfg.moe.shared_experts * cfg.moe.expert_hidden);
  return f;
}

RunPlan make_run_plan(const Config& cfg, int64_t world_size, const std::string& device) {
  MOE_CHECK(device == "cpu" || device == "cuda", "run plan: device must be \"cpu\" or \"cuda\", got \"", device, "\"");
  const Recompute recompute = parse_recompute(cfg.train.recompute);
  RunPlan p;
  p.device = device;
  p.sizes = resolve_parallel(cfg, world_size);

  MOE_CHECK(device == "cuda" || cfg.parallel.grad_reduce_dtype == "fp32", "parallel.grad_reduce_dtype = \"",
            cfg.parallel.grad_reduce_dtype, "\" on train.device = \"cpu\": BF16 gradient sums are a GPU option (the CPU ",
            "backend sums gradients in FP32); set parallel.grad_reduce_dtype = \"fp32\" or train.device = \"cuda\"");
  // The FP8 recipe on the GPU (docs/numerics.md) runs local experts on rows of 16 codes: refused
  // here, before anything is allocated, where CudaModel::set_fp8 would refuse it.
  if (device == "cuda" && cfg.train.precision == "fp8") {
    const bool fp8_rows = p.sizes.ep > 1 || cfg.parallel.ep_backend == "rowwise";  // rows exchanged as FP8
    MOE_CHECK(!fp8_rows || num_moe_layers(cfg.model) == 0 || cfg.model.d_model % 128 == 0,
              "train.precision = \"fp8\" on train.device = \"cuda\" with parallel.ep = ", p.sizes.ep,
              " and parallel.ep_backend = \"", cfg.parallel.ep_backend, "\": the expert exchange's FP8 rows are whole ",
              "1 x 128 blocks, so model.d_model (", cfg.model.d_model, ") must be a multiple of 128; set parallel.ep = ",
              "1 and parallel.ep_backend = \"alltoall\", or train.precision = \"bf16\"");
    MOE_CHECK(num_moe_layers(cfg.model) == 0 || fp8_experts_shapes(cfg.model.d_model, cfg.moe.expert_hidden),
              "train.precision = \"fp8\" on train.device = \"cuda\": the FP8 expert GEMMs read rows of 16 codes, so "
              "model.d_model (", cfg.model.d_model, ") and moe.expert_hidden (", cfg.moe.expert_hidden,
              ") must be multiples of 16");
    // MX on the GPU: the 1 x 32 sub-blocks re-blocked into the GEMMs' whole 1 x 128 and 128 x 128 blocks
    // (core/fp8_types.h), where CudaModel::set_fp8 would refuse other shapes.
    MOE_CHECK(cfg.train.fp8_scaling == "blocks" ||
                  fp8_mx_experts_shapes(cfg.model.d_model,
                                        num_moe_layers(cfg.model) == 0 ? 128 : cfg.moe.expert_hidden),
              "train.fp8_scaling = \"", cfg.train.fp8_scaling, "\" on train.device = \"cuda\": Hopper's FP8 GEMMs ",
              "take 1 x 128 and 128 x 128 blocks, into which the MX codes are re-blocked whole, so model.d_model (",
              cfg.model.d_model, ") and moe.expert_hidden (", cfg.moe.expert_hidden, ") must be multiples of 128; ",
              "set train.fp8_scaling = \"blocks\", or train.device = \"cpu\"");
  }
  p.virtual_stages = cfg.parallel.virtual_stages;
  p.stage_bounds = stage_bounds(cfg);
  const int64_t dp = p.sizes.dp, ep = p.sizes.ep;
  p.ep_dp = dp / ep;
  p.zero = dp > 1 && cfg.parallel.zero;  // ZeRO-1 on either backend
  p.recompute = recompute;
  p.seq_len = cfg.train.seq_len;
  p.micro_batch = cfg.train.micro_batch;
  p.global_batch = cfg.train.global_batch;
  p.micro_steps = p.global_batch / checked_mul(dp, p.micro_batch, "sequences per micro-step (dp x train.micro_batch)");
  p.micro_batches = checked_mul(dp, p.micro_steps, "micro-batches per step (dp x micro-steps)");
  const bool separate_norm = env_choice("MOECORE_GRAD_NORM", {"fused", "separate"}) == 2;
  p.norm_from_expert_squares = device == "cuda" && dp == 1 && ep == 1 && p.sizes.pp == 1 &&
                               cfg.parallel.ep_backend != "rowwise" && p.micro_steps == 1 &&
                               num_moe_layers(cfg.model) > 0 && !separate_norm;
  p.fp8_codes_in_bf16_copy = device == "cuda" && cfg.train.precision == "fp8" && num_moe_layers(cfg.model) > 0 &&
                             !p.zero && !cfg.optim.deferred_update && p.sizes.pp == 1 &&
                             (p.sizes.ep == 1 || cfg.parallel.ep_backend == "rowwise") &&
                             cfg.model.d_model % 128 == 0 && cfg.moe.expert_hidden % 128 == 0;
  p.tokens_per_micro_batch =
      checked_mul(p.micro_batch, p.seq_len, "tokens per micro-batch (train.micro_batch x train.seq_len)");
  p.tokens_per_step = checked_mul(p.global_batch, p.seq_len, "tokens per step (train.global_batch x train.seq_len)");
  p.counts = count_model(cfg.model, cfg.moe, p.seq_len);
  p.flops_per_step = p.counts.flops_per_token * double(p.tokens_per_step);
  MOE_CHECK(std::isfinite(p.flops_per_step), "FLOPs per step (", p.counts.flops_per_token, " per token x ",
            p.tokens_per_step, " tokens) are not finite: reduce the model or the batch");

  MemoryEstimate& m = p.memory;
  const ExpertSlice slice = ep > 1 ? ExpertSlice{0, cfg.moe.num_experts / ep} : ExpertSlice{};
  // The stage with the most parameters (the whole model without pipeline parallelism).
  ParamLayout layout = build_param_layout(cfg.model, cfg.moe, slice);
  for (int64_t s = 0; p.sizes.pp > 1 && s < p.sizes.pp; ++s) {
    const PipelineStage st = pipeline_stage(cfg, s);
    LayoutPart part;
    part.layers.assign(size_t(cfg.model.n_layers), 0);
    for (int64_t l = 0; l < cfg.model.n_layers; ++l) part.layers[size_t(l)] = st.holds_layer(l) ? 1 : 0;
    part.embed = st.embed;
    part.head = st.head;
    ParamLayout stage_layout = build_param_layout(cfg.model, cfg.moe, slice, part);
    if (s == 0 || stage_layout.total_numel() > layout.total_numel()) layout = std::move(stage_layout);
  }
  m.local_params = layout.total_numel();
  m.dense_params = range_numel(flat_ranges(layout, false));
  m.expert_params = range_numel(flat_ranges(layout, true));
  const double n = double(m.local_params);
  const double rows = double(p.tokens_per_micro_batch) * double(cfg.moe.top_k);
  const double d = double(cfg.model.d_model);
  const double moe_layers = double(num_moe_layers(cfg.model));
  const bool gpu = device == "cuda";
  // Two moments, 4 bytes each, or 2 on the GPU under optim.moment_dtype = "bf16" (the CPU backend
  // keeps their BF16 values in FP32 buffers).
  m.moment_bytes = gpu && cfg.optim.moment_dtype == "bf16" ? 2.0 : 4.0;
  const double moment_pair = 2.0 * m.moment_bytes;
  m.moments_replicated = moment_pair * n;
  // ZeRO-1: dense moments over dp, expert moments over ep-dp (either backend).
  m.moments_sharded = p.zero ? moment_pair * (double(m.dense_params) / double(dp) +
                                              double(m.expert_params) / double(p.ep_dp))
                             : m.moments_replicated;
  m.activation = activation_memory(cfg.model, cfg.moe, p.micro_batch, p.seq_len, p.micro_steps, gpu, recompute, ep);
  if (p.sizes.pp > 1) {
    // A stage keeps the saved activations of every chunk it ran forward and not yet backward:
    // the most layer x micro-batch activations any rank holds at once under its schedule, as a
    // share of one micro-batch's whole-model figure (the pool and the scratch stay once per rank).
    p.pipeline_held_layers = 0;
    for (int64_t s = 0; s < p.sizes.pp; ++s) {
      int64_t held = 0;
      for (const PipelineOp& op : pipeline_schedule(p.sizes.pp, p.virtual_stages, p.micro_steps, s)) {
        const int64_t k = op.virtual_stage * p.sizes.pp + s;
        const int64_t layers = p.stage_bounds[size_t(k) + 1] - p.stage_bounds[size_t(k)];
        held += op.forward ? layers : -layers;
        p.pipeline_held_layers = std::max(p.pipeline_held_layers, held);
      }
    }
    // The GPU pipeline step holds one micro-batch's activations of its stage (it runs a forward
    // again before a backward that does not follow it) and the FP32 stage input of each of the
    // step's micro-batches.
    if (gpu) {
      int64_t widest = 0;
      for (size_t k = 0; k + 1 < p.stage_bounds.size(); ++k)
        widest = std::max(widest, p.stage_bounds[k + 1] - p.stage_bounds[k]);
      p.pipeline_held_layers = widest;
      m.activation.scratch.push_back(
          {"stage inputs of the step's micro-batches (FP32)", 4.0 * double(p.micro_steps) * double(p.tokens_per_micro_batch) * d});
    }
    const double share = double(p.pipeline_held_layers) / double(cfg.model.n_layers);
    for (MemoryItem& item : m.activation.kept) item.bytes *= share;
  }
  // GPU data parallel with BF16 gradient sums: the staging buffer of one bucket (64 Mi elements at most).
  if (gpu && dp > 1 && cfg.parallel.grad_reduce_dtype == "bf16")
    m.activation.scratch.push_back({"BF16 gradient reduce stage", 2.0 * std::min(n, double(int64_t(64) << 20))});
  // FP8 experts (cuda::experts_fp8_workspace_bytes): the codes and 1 x 128 scales of the widest
  // GEMM input [R, max(D, 2I)], one buffer every MoE layer shares.
  const Fp8Parts f8 = gpu ? fp8_parts(cfg) : Fp8Parts{};
  const bool fp8_experts = f8.experts;
  const double fp8_widest = double(std::max(cfg.model.d_model, 2 * cfg.moe.expert_hidden));
  const double fp8_input_row = fp8_block_row_bytes(fp8_widest);
  if (fp8_experts) m.activation.scratch.push_back({"FP8 expert activation codes and scales", rows * fp8_input_row});
  // FP8 dense linears (cuda_fp8_linear.h): the attention projections where D, Q and C are multiples
  // of 128, the MLPs (dense blocks and shared experts) whose D and F are; their weights' two code
  // copies (fp8_dense_params, below) and the model's one set of activation codes, row-major and
  // K-major scales, weight-scale scratch, and the shared-expert output of an FP8 MLP.
  double fp8_dense_params = 0, widest_fp8_mlp = 0, fp8_width = 0, fp8_weight_elems = 0;
  if (f8.any) {
    const double q = double(cfg.model.n_heads * cfg.model.head_dim()), kv = double(cfg.model.n_kv_heads * cfg.model.head_dim());
    if (f8.projections) {
      fp8_dense_params += double(cfg.model.n_layers) * (2.0 * q + 2.0 * kv) * d;
      fp8_width = std::max(d, q + 2.0 * kv);
      fp8_weight_elems = (q + 2.0 * kv) * d;
    }
    for (int64_t l = 0; l < cfg.model.n_layers; ++l) {
      const bool dense = is_dense_layer(cfg.model, l);
      const int64_t f = dense ? cfg.model.dense_hidden : cfg.moe.shared_experts * cfg.moe.expert_hidden;
      if (dense ? f8.dense_mlp : f8.shared_mlp) {
        fp8_dense_params += 3.0 * double(f) * d;
        widest_fp8_mlp = std::max(widest_fp8_mlp, double(f));
      }
    }
    if (widest_fp8_mlp > 0) {
      fp8_width = std::max({fp8_width, d, 2.0 * widest_fp8_mlp});
      fp8_weight_elems = std::max(fp8_weight_elems, 2.0 * widest_fp8_mlp * d);
    }
  }
  if (fp8_width > 0) {
    const double tokens = double(p.tokens_per_micro_batch), kb = std::ceil(fp8_width / 128.0);
    m.activation.scratch.push_back({"FP8 projection and MLP activation codes and scales",
                                    tokens * fp8_width + 2.0 * tokens * kb * 4.0 +
                                        3.0 * fp8_weight_elems / (128.0 * 128.0) * 4.0 +
                                        (widest_fp8_mlp > 0 ? tokens * d * 2.0 : 0.0)});
  }
  m.activations_kept = m.activation.kept_bytes();
  m.activations_pool = m.activation.pool_bytes();
  m.scratch = m.activation.scratch_bytes();
  m.moments = p.zero ? m.moments_sharded : m.moments_replicated;
  m.grads = 4.0 * n;
  if (!gpu) {
    m.params = 4.0 * n;
    if (ep > 1) m.exchange = 2.0 * rows * d * 4.0;  // the send and receive row blocks of one exchange
  } else {
    // FP8 experts and MLPs: each weight's E4M3 codes and their transposed copy, and both copies'
    // 128 x 128 block scales (FP32; padding not counted); the experts' codes only their scales where
    // they take the place of the experts' BF16 copy (p.fp8_codes_in_bf16_copy).
    const double scales = 2.0 * 4.0 / (128.0 * 128.0);
    const double expert_bytes = p.fp8_codes_in_bf16_copy ? scales : 2.0 + scales;
    m.fp8_codes = (fp8_experts ? double(m.expert_params) * expert_bytes : 0.0) + fp8_dense_params * (2.0 + scales);
    m.params = 6.0 * n + m.fp8_codes;  // FP32 master + BF16 copy (whole on every rank, also under ZeRO-1)
    if (ep > 1) m.exchange = moe_layers * rows * (2.0 * d + 8.0) + 2.0 * rows * 2.0 * d;
    // FP8 under expert parallelism: the packed rows this rank sends (cpu::fp8_row_payload_bytes:
    // D + D / 32 bytes a row; the rowwise exchange pads them to 16-byte words, and also holds the
    // FP8 buffers of its G = ep R received rows beyond the R the scratch counts; its received
    // payload rows are in the NVSHMEM heap, CudaRowwiseExperts::symmetric_bytes).
    const double payload = double(cpu::fp8_row_payload_bytes(cfg.model.d_model, cpu::Fp8Recipe{}));
    if (cfg.train.precision == "fp8" && cfg.parallel.ep_backend == "rowwise") {
      const double g = rows * double(ep);
      m.exchange += rows * std::ceil(payload / 16.0) * 16.0 + (g - rows) * fp8_input_row;
    } else if (ep > 1 && cfg.train.precision == "fp8") {
      m.exchange += rows * payload;
    }
    m.host_mirror = 12.0 * n;  // FP32 weights and the two moments (no host gradients)
  }
  return p;
}

std::string host_memory_problem(const RunPlan& plan) {
  const double need = plan.device == "cpu" ? plan.memory.total() : plan.memory.host_mirror;
  const double have = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
  if (have <= 0 || need < 0.9 * have) return "";
  return detail::concat("it needs about ", need / kGiB, " GiB of host memory per rank (FP32 weights, ",
                        plan.device == "cpu" ? "gradients, " : "", "AdamW moments",
                        plan.device == "cpu" ? " and activations" : "",
                        "; see moecore train --dry-run) but the machine has ", have / kGiB, " GiB");
}

std::string describe_run_plan(const RunPlan& p) {
  const MemoryEstimate& m = p.memory;
  char buf[2048], exchange[64] = "";
  if (m.exchange > 0) std::snprintf(exchange, sizeof exchange, " + %.3f expert exchange", m.exchange / kGiB);
  const double active_pct = 100.0 * double(p.counts.active_params) / double(std::max<int64_t>(1, p.counts.total_params));
  std::snprintf(
      buf, sizeof buf,
      "# parameters        %lld total, %lld active per token (%.1f%%)\n"
      "# FLOPs per token   %.4g (forward + backward; %.4g per step of %lld tokens)\n"
      "# layout            %lld rank(s) on %s: dp %lld, ep %lld, ep-dp %lld, pp %lld%s\n"
      "# batch             global %lld sequences = dp %lld x micro-batch %lld x %lld micro-steps; %lld tokens per "
      "micro-batch, %lld per step\n"
      "# memory estimate   per rank on %s: %.3f GiB total = %.3f weights + %.3f grads + %.3f AdamW moments%s%s + %.3f "
      "activations of %s%s (%lld parameters on this rank)\n"
      "# activations       train.recompute = \"%s\"%s: %.3f GiB = %.3f kept by the layers + %.3f recompute pools "
      "(one layer per block kind) + %.3f model-wide scratch\n",
      (long long)p.counts.total_params, (long long)p.counts.active_params, active_pct, p.counts.flops_per_token,
      p.flops_per_step, (long long)p.tokens_per_step, (long long)p.sizes.world, p.device.c_str(),
      (long long)p.sizes.dp, (long long)p.sizes.ep, (long long)p.ep_dp, (long long)p.sizes.pp,
      p.zero ? ", ZeRO-1 moment shards" : "", (long long)p.global_batch, (long long)p.sizes.dp,
      (long long)p.micro_batch, (long long)p.micro_steps, (long long)p.tokens_per_micro_batch,
      (long long)p.tokens_per_step, p.device == "cuda" ? "the GPU" : "the host", m.total() / kGiB, m.params / kGiB,
      m.grads / kGiB, m.moments / kGiB, m.bf16_moments() ? " (BF16)" : "", p.zero ? " (this rank's shard)" : "",
      m.activations() / kGiB,
      p.sizes.pp > 1 ? "the busiest stage's micro-batches in flight" : "one micro-batch", exchange,
      (long long)m.local_params, recompute_name(p.recompute),
      p.device == "cuda" ? "" : " (approximate: Model<float>'s saved FP32 tensors)", m.activations() / kGiB,
      m.activations_kept / kGiB, m.activations_pool / kGiB, m.scratch / kGiB);
  std::string out = buf;
  if (p.sizes.pp > 1) {
    const int64_t stages = p.sizes.pp * p.virtual_stages, dp = p.sizes.dp, ep = p.sizes.ep;
    std::snprintf(buf, sizeof buf,
                  "# pipeline          pp %lld x virtual stages %lld = %lld model stages, %s 1F1B over %lld "
                  "micro-batches per dp rank: bubble (pp-1)/(virtual_stages x micro-batches + pp-1) = %.3f; "
                  "kept activations above are the busiest stage's, %lld layer x micro-batch activations in flight\n",
                  (long long)p.sizes.pp, (long long)p.virtual_stages, (long long)stages,
                  p.virtual_stages > 1 ? "interleaved" : "plain", (long long)p.micro_steps,
                  double(p.sizes.pp - 1) / double(p.virtual_stages * p.micro_steps + p.sizes.pp - 1),
                  (long long)p.pipeline_held_layers);
    out += buf;
    for (int64_t s = 0; s < p.sizes.pp; ++s) {
      std::string layers;
      for (int64_t v = 0; v < p.virtual_stages; ++v) {
        const int64_t k = v * p.sizes.pp + s;
        layers += (v ? ", " : "") + std::to_string(p.stage_bounds[size_t(k)]) + ".." +
                  std::to_string(p.stage_bounds[size_t(k) + 1] - 1);
      }
      std::string groups;
      for (int64_t g = 0; g < dp / ep; ++g) {
        groups += " [";
        for (int64_t e = 0; e < ep; ++e) groups.append(e ? " " : "").append(std::to_string(s * dp + g * ep + e));
        groups += "]";
      }
      std::snprintf(buf, sizeof buf, "#   stage %lld        ranks %lld..%lld (dp group), layers %s%s%s; ep groups%s\n",
                    (long long)s, (long long)(s * dp), (long long)(s * dp + dp - 1), layers.c_str(),
                    s == 0 ? " + embedding" : "", s == (stages - 1) % p.sizes.pp ? " + final norm, LM head" : "",
                    groups.c_str());
      out += buf;
    }
    std::string pipes;
    for (int64_t r = 0; r < dp; ++r) {
      pipes += " [";
      for (int64_t s = 0; s < p.sizes.pp; ++s) pipes.append(s ? " " : "").append(std::to_string(s * dp + r));
      pipes += "]";
    }
    out += "#   pipeline groups" + pipes + " (one rank per stage, activations by send/recv)\n";
  }
  if (p.device == "cuda") {
    std::snprintf(buf, sizeof buf, "# host memory       %.3f GiB per rank (FP32 mirror of weights and moments for "
                  "checkpoints)\n", m.host_mirror / kGiB);
    out += buf;
  }
  return out;
}

}  // namespace moe
