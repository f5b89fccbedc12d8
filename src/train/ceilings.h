// What one NVIDIA H200 does, as `moecore plan` uses it: per-op rates measured on one H200 and the
// olmoe-8l step's phases, with the source of every figure. Measured figures come from committed
// results: bench/results/gpu-check-20261201T230245Z (grouped_gemm.json: grouped GEMM and cuDNN
// attention; bench-olmoe-8l.json: the step's phases), bench/results/memory-check-20261201T2315Z and
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

  // The experts' weight traffic of each micro-step, besides their FLOPs: the BF16 weights read by
  // forward and dgrad (2 + 2 bytes per expert parameter) and the FP32 weight gradient read and
  // written by the accumulating wgrad (8): 12 bytes per expert parameter, at 4.3e12 bytes/s, the
  // rate fitted to the one-GPU expert-scaling sweep (bench/results/experiments-20261202T022232Z/
  // sweep-scaling1.json, one micro-batch of 8192 tokens): the experts phase grows 6.9 ms (13.9 ->
  // 20.8 ms, e8 -> e64) for 29.6 GB more of this traffic.
  double expert_weight_bytes_per_param = 12.0;
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

  // The olmoe-8l step on one H200, recompute none, CUDA graph (bench-olmoe-8l.json,
  // phase_ms_scaled_to_step; 178.02 ms): the phases the model scales from.
  double ref_embedding_ms = 0.316, ref_attention_ms = 45.01, ref_mlp_ms = 3.47, ref_router_ms = 1.40;
  double ref_dispatch_ms = 4.15, ref_experts_ms = 68.18, ref_combine_ms = 3.79, ref_lm_head_ms = 21.35;
  double ref_optimizer_ms = 30.35;
  double ref_step_ms = 178.02;
};

inline const GpuCeilings& h200_ceilings() {
  static const GpuCeilings c;
  return c;
}

}  // namespace moe
