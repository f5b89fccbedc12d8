// What one NVIDIA H200 does, as `moecore plan` uses it: per-op rates measured on one H200 and the
// olmoe-8l step's phases, with the source of every figure. Measured figures come from committed
// results: bench/results/gpu-check-20261201T230245Z (grouped_gemm.json: grouped GEMM and cuDNN
// attention), bench/results/deferred-update-20261202 (the step's phases), bench/results/memory-check-20261201T2315Z and
// docs/benchmarks.md (NCCL all-reduce, expert exchange); the dense GEMM rate was measured on the
// same kind of GPU but is not in a committed result file (docs/planning.md says so). Nominal
// figures are the vendor's datasheet values and say so.
#pragma once

namespace moe {

struct GpuCeilings {
  const char* name = "NVIDIA H200";
  double memory_gib = 139.8;  // usable device memory (cudaMemGetInfo total, bench-olmoe-8l.json)

  // Grouped BF16 GEMM of the experts, own wgmma kernels, measured at the olmoe shape (131072 rows
  // over 64 experts, d_model 2048, expert hidden 1024), TFLOP/s (grouped_gemm.json).
  double gate_up_fwd_tflops = 737.7, gate_up_dgrad_tflops = 751.3, gate_up_wgrad_tflops = 628.6;
  double down_fwd_tflops = 699.0, down_dgrad_tflops = 748.0, down_wgrad_tflops = 638.4;

  // cuDNN 9.14 causal attention at B 4, S 4096, 16 heads, head_dim 128 (grouped_gemm.json):
  // forward 500.4 us = 549.3 TFLOP/s (4*B*H*S*S*hd/2 FLOPs), backward 1632.6 us = 420.9 (2.5 x forward).
  double attention_fwd_tflops = 549.3, attention_bwd_tflops = 420.9;

  // Dense BF16 GEMM (cuBLASLt), 16384 x 2048 x 2048 on random data: 784 TFLOP/s, measured on an
  // H200 of the same host (project performance notes; no committed result file holds it).
  double dense_gemm_tflops = 784.0;

  // What the experts phase costs per expert parameter and micro-step besides the GEMMs' FLOPs (the
  // BF16 weights read by forward and dgrad, the FP32 weight gradient stored or accumulated by
  // wgrad, smaller per-expert GEMMs), as bytes at the HBM rate (4.3e12 bytes/s, also the rate of
  // the optimizer's traffic): fitted to the one-GPU expert-scaling sweeps of
  // bench/results/experiments-20261202T045008Z, where e8 -> e128 (5.28e9 more expert parameters)
  // adds 10.3 ms per micro-step at one micro-step of 8192 tokens (experts 13.5 -> 23.8 ms) and
  // 10.8 ms per micro-step at 16 micro-steps of 4 x 8192 (881 -> 1053 ms per step): 8.4 and 8.8
  // bytes per parameter. The first micro-step writes its weight gradients without reading them
  // and later ones read and write them, yet both grow alike: the growth is not the gradient's bytes
  // alone.
  double expert_weight_bytes_per_param = 8.6;
  double expert_weight_bytes_per_s = 4.3e12;

  // HBM3e bandwidth, nominal (datasheet): 4.8 TB/s. NVLink 4 between two H200s, nominal: 450 GB/s
  // per direction. Printed for orientation; the model below uses the measured rates.
  double hbm_nominal_bytes_per_s = 4.8e12;
  double nvlink_nominal_bytes_per_s = 450e9;

  // NCCL all-reduce of the FP32 gradients between two H200s: 14.25 GB in 48.8 ms, bus bandwidth
  // 292 GB/s (docs/benchmarks.md, olmoe-8l dp 2). Used for every dp (measured at 2 GPUs only).
  double allreduce_bus_bytes_per_s = 292e9;
  // With parallel.overlap_grad_reduce the all-reduce runs under backward but shares the SMs: the
  // dp 2 step grew by 28.8 ms (184.0 -> 212.8 ms) for a 48.8 ms all-reduce: 0.59 of it is paid.
  double overlap_paid_fraction = 0.59;
  // The expert exchange as moecore's all-to-all path reaches it (olmoe-1b-7b, ep 2): 17.2 GB of
  // BF16 rows sent per rank per step at 128.5 GB/s over the dispatch and combine phases (host
  // count reads and regroups included; docs/benchmarks.md).
  double ep_exchange_bytes_per_s = 128.5e9;

  // The olmoe-8l step on one H200, recompute none, CUDA graph: the mean of the two rounds of
  // bench/results/deferred-update-20261202/olmoe-8l-deferred-false-{1,2}.json
  // (phase_ms_scaled_to_step; 173.45 ms): the phases the model scales from. That step writes the
  // weight gradients on its first backward (no zeroing pass) and does the LM head's backward GEMMs
  // in its forward (three vocabulary GEMMs per micro-step).
  double ref_embedding_ms = 0.323, ref_attention_ms = 45.79, ref_mlp_ms = 3.424, ref_router_ms = 1.417;
  double ref_dispatch_ms = 4.134, ref_experts_ms = 68.94, ref_combine_ms = 3.743, ref_lm_head_ms = 15.58;
  double ref_optimizer_ms = 30.09;
  double ref_step_ms = 173.45;
};

inline const GpuCeilings& h200_ceilings() {
  static const GpuCeilings c;
  return c;
}

}  // namespace moe
