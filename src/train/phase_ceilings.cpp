// phase_ceilings: FLOPs and bytes per phase from the model's shapes (the counts of
// docs/architecture.md split by phase), each over its ceiling rate.
#include "train/phase_ceilings.h"

#include <algorithm>
#include <cstdio>

#include "model/layout.h"

namespace moe {

std::vector<PhaseCeiling> phase_ceilings(const Config& cfg, const RunPlan& plan, const GpuRates& gpu) {
  const ModelConfig& m = cfg.model;
  const MoeConfig& e = cfg.moe;
  const double micro = double(plan.micro_steps);
  const double n = double(plan.tokens_per_micro_batch), b = double(plan.micro_batch), s = double(plan.seq_len);
  const double d = double(m.d_model), hd = double(m.head_dim());
  const double q = double(m.n_heads) * hd, kv = double(m.n_kv_heads) * hd;
  const double dense_rate = 1e12 * gpu.dense_gemm_tflops;
  char what[160];
  std::snprintf(what, sizeof what, "%.0f TFLOP/s dense BF16 GEMM", gpu.dense_gemm_tflops);
  const std::string gemm_ceiling = what;
  // The FP8 recipe's GEMMs: forward and data gradient at the dense FP8 GEMM's rate (the same
  // convention: cuBLASLt's dense GEMM is the ceiling of the grouped ones too), the weight gradient
  // at the BF16 rate. Seconds of `flops` (forward + dgrad + wgrad FLOPs, 2 : 2 : 2).
  const Fp8Parts f8 = fp8_parts(cfg);
  std::snprintf(what, sizeof what, "%.0f TFLOP/s dense FP8 GEMM (forward, dgrad), %.0f BF16 (wgrad)",
                gpu.dense_fp8_gemm_tflops, gpu.dense_gemm_tflops);
  const std::string fp8_ceiling = what;
  const auto gemm_s = [&](double flops, bool fp8) { return dense_linear_ms(flops / 3.0, 6.0, fp8, gpu) / 1e3; };
  int64_t moe_layers = 0, dense_layers = 0;
  for (int64_t l = 0; l < m.n_layers; ++l) (is_dense_layer(m, l) ? dense_layers : moe_layers) += 1;
  std::vector<PhaseCeiling> out;

  // Attention: Q, K, V, O projections (forward, dgrad, wgrad) and the causal core.
  {
    PhaseCeiling c;
    c.phase = "attention";
    const double proj = 6.0 * n * d * (2.0 * q + 2.0 * kv);
    const double core_fwd = 2.0 * b * double(m.n_heads) * s * s * hd;  // 4 B H S^2 hd / 2 (causal)
    const double core_bwd = 2.5 * core_fwd;
    c.flops = micro * double(m.n_layers) * (proj + core_fwd + core_bwd);
    c.ideal_ms = 1e3 * micro * double(m.n_layers) *
                 (gemm_s(proj, f8.projections) + core_fwd / (1e12 * gpu.attention_fwd_tflops) +
                  core_bwd / (1e12 * gpu.attention_bwd_tflops));
    std::snprintf(what, sizeof what, "%s; core %.0f / %.0f TFLOP/s (cuDNN fwd / bwd)",
                  (f8.projections ? fp8_ceiling : gemm_ceiling).c_str(), gpu.attention_fwd_tflops,
                  gpu.attention_bwd_tflops);
    c.ceiling = what;
    out.push_back(c);
  }
  // Dense MLPs and shared experts: three SwiGLU GEMMs, forward and backward.
  {
    const double f_dense = double(m.dense_hidden), f_shared = double(e.shared_experts * e.expert_hidden);
    PhaseCeiling c;
    c.phase = "mlp";
    const double dense_flops = micro * 6.0 * n * 3.0 * d * double(dense_layers) * f_dense;
    const double shared_flops = micro * 6.0 * n * 3.0 * d * double(moe_layers) * f_shared;
    c.flops = dense_flops + shared_flops;
    c.ideal_ms = 1e3 * (gemm_s(dense_flops, f8.dense_mlp) + gemm_s(shared_flops, f8.shared_mlp));
    c.ceiling = f8.dense_mlp || f8.shared_mlp ? fp8_ceiling : gemm_ceiling;
    if (c.flops > 0) out.push_back(c);
  }
  // The dispatch and combine around the routed experts on one GPU (no exchange: ep 1, the
  // experts reading sorted rows), as bytes a MoE layer moves per micro-step at the streaming rate:
  // R = n x top_k rows of d, BF16 (2 bytes), FP8 codes and their 1 x 128 scales (fp8_block_row_bytes).
  // Dispatch: the map (the routes read, sorted_route and route_to_row written: 12 R), the permute
  // (x read, x_sorted written: 2 n d + 2 R d, plus the codes under FP8 experts) and its backward
  // (dx_sorted read, the branch gradient read and written: 2 R d + 4 n d).
  // Combine: forward, y_sorted read (2 R d) and, without a shared expert, added into the FP32
  // residual stream (read and written) with its BF16 copy written (10 n d), else the branch
  // written (2 n d); backward, dy read, y_sorted read, dy_sorted written (2 n d + 4 R d, plus the
  // codes under FP8 experts).
  const bool local_rows = plan.sizes.ep == 1 && cfg.parallel.ep_backend != "rowwise";
  const double rows = n * double(e.top_k);
  const double codes = f8.experts ? rows * fp8_block_row_bytes(d) : 0.0;
  const auto streaming = [&](const char* phase, double layer_bytes) {
    PhaseCeiling c;
    c.phase = phase;
    c.bytes = micro * double(moe_layers) * layer_bytes;
    c.ideal_ms = 1e3 * c.bytes / gpu.streaming_bytes_per_s;
    std::snprintf(what, sizeof what, "%.2f GB at %.2f TB/s (streaming)", c.bytes / 1e9,
                  gpu.streaming_bytes_per_s / 1e12);
    c.ceiling = what;
    out.push_back(c);
  };
  if (moe_layers > 0 && local_rows)
    streaming("dispatch", 12.0 * rows + 2.0 * n * d + 2.0 * rows * d + codes + 2.0 * rows * d + 4.0 * n * d);
  // Routed experts: the grouped GEMMs over n x top_k rows, or their weight traffic.
  if (moe_layers > 0) {
    PhaseCeiling c;
    c.phase = "experts";
    const double inner = double(e.expert_hidden);
    c.flops = micro * double(moe_layers) * 6.0 * rows * 3.0 * d * inner;
    c.bytes = micro * gpu.expert_weight_bytes_per_param * double(plan.memory.expert_params);
    const double by_flops = gemm_s(c.flops, f8.experts), by_bytes = c.bytes / gpu.expert_weight_bytes_per_s;
    c.ideal_ms = 1e3 * std::max(by_flops, by_bytes);
    if (by_bytes > by_flops) {
      std::snprintf(what, sizeof what, "weight traffic, %.0f B/param at %.1f TB/s", gpu.expert_weight_bytes_per_param,
                    gpu.expert_weight_bytes_per_s / 1e12);
      c.ceiling = what;
    } else {
      c.ceiling = f8.experts ? fp8_ceiling : gemm_ceiling;
    }
    out.push_back(c);
  }
  if (moe_layers > 0 && local_rows) {
    const bool shared = e.shared_experts > 0;
    streaming("combine", 2.0 * rows * d + (shared ? 2.0 : 10.0) * n * d + 2.0 * n * d + 4.0 * rows * d + codes);
  }
  // LM head: logits, their data and weight gradients.
  {
    PhaseCeiling c;
    c.phase = "lm_head";
    c.flops = micro * 6.0 * n * d * double(m.vocab_size);
    c.ideal_ms = 1e3 * c.flops / dense_rate;
    c.ceiling = gemm_ceiling;
    out.push_back(c);
  }
  // Optimizer: the gradient norm's read (4 bytes; none for the experts' gradients when the norm
  // comes from their block square sums) and AdamW's update (FP32 weight, gradient and two moments
  // read, weight and moments written, the BF16 copy written: 30 bytes, 22 with BF16 moments:
  // adamw_update_bytes) per parameter. With the
  // update deferred into the next forward (optim.deferred_update) only the norm's read is left in
  // the phase; the update's time shows in the forward's phases.
  {
    PhaseCeiling c;
    c.phase = "optimizer";
    const double params = double(plan.memory.local_params);
    const double norm_params = plan.norm_from_expert_squares ? params - double(plan.memory.expert_params) : params;
    const double update = cfg.optim.deferred_update ? 0.0 : adamw_update_bytes(plan.memory.moment_bytes);
    c.bytes = 4.0 * norm_params + update * params;
    c.ideal_ms = 1e3 * c.bytes / gpu.expert_weight_bytes_per_s;
    const char* deferred = cfg.optim.deferred_update ? " (the norm; the update deferred)" : "";
    std::snprintf(what, sizeof what, "%.1f B/param at %.1f TB/s%s", c.bytes / params,
                  gpu.expert_weight_bytes_per_s / 1e12, deferred);
    c.ceiling = what;
    out.push_back(c);
  }
  return out;
}

}  // namespace moe
