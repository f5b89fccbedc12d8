// What one GPU does: per-op rates measured on it (GpuRates: what the bench's per-phase ceilings
// read), and for the H200, which `moecore plan` models, the multi-GPU rates and the olmoe-8l
// step's phases as well (GpuCeilings), with the source of every figure. The H200's measured
// figures come from committed results: bench/results/gpu-check-20261201T230245Z (grouped_gemm.json:
// grouped GEMM and cuDNN attention), bench/results/h200-main-20261207 (the step's phases in bf16
// and fp8, the FP8 grouped GEMM), bench/results/gpu-suite-20261202-63025a6 (the dense FP8 GEMM),
// bench/results/memory-check-20261201T2315Z and docs/benchmarks.md (NCCL all-reduce, expert exchange),
// bench/results/step-kernels-h200-20261207 (the streaming rate); the dense GEMM rate was measured on the
// same kind of GPU but is not in a committed result file (docs/planning.md says so). Nominal
// figures are the vendor's datasheet values and say so.
#pragma once

#include <string>

#include "core/error.h"

namespace moe {

// The rates of one GPU; the defaults are the H200's (h100_ceilings() sets every one).
struct GpuRates {
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

  // The fastest memory-bound kernel of the olmoe-8l step's kernel table, DRAM bytes over time:
  // swiglu_backward_rows at 4.14 TB/s (bench/results/step-kernels-h200-20261207/kernels.txt), the
  // rate the permutes and combines (the dispatch and combine phases) are held to.
  double streaming_bytes_per_s = 4.14e12;

  // train.precision = fp8 (the planner): the experts' FP8 grouped GEMM (own wgmma kernel, E4M3 with
  // 1 x 128 and 128 x 128 scales) at the same shape, forward on the weights' codes and data gradient
  // on their transposed copy, the inputs' quantisation not counted (their producers write the
  // codes), TFLOP/s: the mean of three op-bench runs on H200s at 00984e8
  // (bench/results/h200-main-20261207/fp8-kernel-tried/op-base-*.log: the kernel's rate moves by up
  // to 20% from run to run). Its weight gradients run in BF16 (the rates above).
  double gate_up_fwd_fp8_tflops = 927.4, gate_up_dgrad_fp8_tflops = 870.4;
  double down_fwd_fp8_tflops = 814.4, down_dgrad_fp8_tflops = 966.2;
  // Block-scaled FP8 GEMM through cuBLASLt, 16384 x 2048 x 2048, the activation's quantisation not
  // counted: 1089.8 TFLOP/s (bench/results/gpu-suite-20261202-63025a6/fp8_gemm.log), the rate of
  // the FP8 projections' and MLPs' forward and data-gradient GEMMs.
  double dense_fp8_gemm_tflops = 1089.8;
};

// Milliseconds of a dense linear's GEMMs at `g`'s rates, `forward_flops` its forward's FLOPs (2 x
// its MACs), factor 6 for the forward, data and weight gradients (2 : 2 : 2) or 2 for the forward
// alone. Under the FP8 recipe (fp8) the forward and data gradient run at the dense FP8 GEMM's rate
// and the weight gradient at the BF16 one, as the GPU step runs them.
inline double dense_linear_ms(double forward_flops, double factor, bool fp8, const GpuRates& g) {
  const double ms_per_tflop = 1e3 / 1e12;
  if (!fp8) return factor / 2.0 * forward_flops / g.dense_gemm_tflops * ms_per_tflop;
  const double fwd_dgrad = (factor < 4.0 ? factor : 4.0) / 2.0, wgrad = (factor > 4.0 ? factor - 4.0 : 0.0) / 2.0;
  return (fwd_dgrad * forward_flops / g.dense_fp8_gemm_tflops + wgrad * forward_flops / g.dense_gemm_tflops) *
         ms_per_tflop;
}

// The measured phases of a reference step (ms, phase_ms_scaled_to_step of `moecore bench`).
struct RefStep {
  double embedding = 0, attention = 0, mlp = 0, router = 0, dispatch = 0, experts = 0, combine = 0, lm_head = 0;
  double optimizer = 0, step = 0;
};

// A GPU as the planner models it: its rates, the figures of several GPUs, and the measured step of
// a reference shape (olmoe-8l with ref_layers layers) the non-GEMM work scales from. The defaults
// are the H200's.
struct GpuCeilings : GpuRates {
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

  // The olmoe-8l step on one H200, recompute none, CUDA graph: the mean of the two BF16 runs at
  // 00984e8, bench/results/h200-main-20261207/{steps,steps-r2}/bf16.json (phase_ms_scaled_to_step;
  // 168.67 ms): the phases the model scales from. That step writes the weight gradients on its
  // first backward (no zeroing pass), does the LM head's backward GEMMs in its forward (three
  // vocabulary GEMMs per micro-step) and takes the norm's squares of the expert gradients from their
  // weight-gradient GEMMs (one GPU, one micro-step: the run plan's norm_from_expert_squares).
  RefStep ref_bf16{0.305, 44.383, 2.749, 1.402, 4.127, 68.992, 3.907, 15.741, 27.061, 168.67};
  // The same shape with train.precision = fp8 (the routed experts', projections' and MLPs' forward
  // and data-gradient GEMMs in FP8, every quantisation counted; the experts' codes written by their
  // update): the mean of three runs on one H200 at 00984e8,
  // bench/results/h200-main-20261207/{steps/fp8-base,steps/fp8-base-r2,steps-r2/fp8}.json (161.75 ms).
  RefStep ref_fp8{0.299, 41.678, 2.699, 1.377, 4.810, 61.277, 4.807, 14.752, 30.050, 161.75};
  // The reference shape: configs/olmoe-8l.toml with this many layers, and its parameters.
  double ref_layers = 8, ref_params = 3562604544.0;
};

inline const GpuCeilings& h200_ceilings() {
  static const GpuCeilings c;
  return c;
}

// One NVIDIA H100 80GB HBM3 (SXM). Rates measured in one GPU call by the op bench
// (bench/results/h100-ceilings-20261206/, command.sh): the experts' grouped GEMMs at the olmoe
// shape (grouped_gemm.log), cuDNN 9.14 causal attention at B 4, S 4096, 16 heads, hd 128
// (attention.log), the dense BF16 GEMM 16384 x 2048 x 2048 through cuBLASLt (fp8_gemm.log, its bf16
// column) and AdamW's traffic on every SM at 30 bytes a parameter (adamw.log: 2959 GB/s), the rate
// the experts' weight traffic and the optimizer are counted at (the H200's fitted 8.6 bytes per
// expert parameter kept: it is the step's traffic, not the GPU's). memory_gib: nvidia-smi's
// 81559 MiB. The reference step: olmoe-8l with 6 of its 8 layers (what fits 80 GB), bf16, recompute
// none, CUDA graph, bench/results/fp8-codes-in-bf16-20261207/bf16.json (phase_ms_scaled_to_step;
// 138.45 ms, the call of the FP8 reference below). HBM3 nominal 3.35 TB/s, NVLink 4 as the H200's. Not
// measured on H100s: the NCCL all-reduce, its overlap and the expert exchange, which are the
// H200's figures here (the same NVLink 4 generation).
inline const GpuCeilings& h100_ceilings() {
  static const GpuCeilings c = [] {
    GpuCeilings g;
    g.name = "NVIDIA H100 80GB HBM3";
    g.memory_gib = 79.6;
    g.gate_up_fwd_tflops = 724.6, g.gate_up_dgrad_tflops = 680.7, g.gate_up_wgrad_tflops = 598.1;
    g.down_fwd_tflops = 672.7, g.down_dgrad_tflops = 730.3, g.down_wgrad_tflops = 606.0;
    g.attention_fwd_tflops = 577.8, g.attention_bwd_tflops = 406.1;
    g.dense_gemm_tflops = 745.3;
    g.expert_weight_bytes_per_param = 8.6;
    g.expert_weight_bytes_per_s = 2.959e12;
    // swiglu_backward_rows in the step's kernel table on an H100
    // (bench/results/step-kernels-dram-h100-20261207/kernels.txt): 3.07 TB/s.
    g.streaming_bytes_per_s = 3.07e12;
    g.hbm_nominal_bytes_per_s = 3.35e12;
    g.ref_bf16 = {0.360, 33.054, 2.552, 1.176, 3.663, 51.646, 3.578, 14.919, 27.507, 138.45};
    // FP8 (the H100 rows of the rates above): the grouped GEMM from two op-bench runs on an H100
    // (bench/results/fp8-scale-loads-20261206/new-{1,2}.log, the kernel with its scale loads after
    // the MMAs), cuBLASLt's FP8 GEMM from fp8_gemm.log above; the reference step: olmoe-8l with 6
    // layers in fp8 at 0bfa3ac, bench/results/fp8-codes-in-bf16-20261207/fp8-nobf16.json (132.66 ms).
    g.gate_up_fwd_fp8_tflops = 951.5, g.gate_up_dgrad_fp8_tflops = 988.2;
    g.down_fwd_fp8_tflops = 844.4, g.down_dgrad_fp8_tflops = 973.7;
    g.dense_fp8_gemm_tflops = 1108.7;
    g.ref_fp8 = {0.362, 30.976, 2.579, 1.181, 4.272, 45.601, 4.323, 13.910, 29.457, 132.66};
    g.ref_layers = 6, g.ref_params = 2723465216.0;
    return g;
  }();
  return c;
}

// The GPU `moecore plan --gpu` names: "h200" or "h100" (80GB HBM3).
inline const GpuCeilings& planner_gpu(const std::string& name) {
  if (name == "h200") return h200_ceilings();
  if (name == "h100") return h100_ceilings();
  throw Error("--gpu: expected h200 or h100 (the GPUs whose rates are measured), got '" + name + "'");
}

// The measured figures of the GPU named `device` (cudaDeviceProp::name): the H200's or the H100's
// (80GB HBM3) by name, else null (no GPU of that kind has been measured).
inline const GpuCeilings* measured_rates(const std::string& device) {
  if (device.find("H200") != std::string::npos) return &h200_ceilings();
  const bool h100_80gb = device.find("H100") != std::string::npos && device.find("80GB HBM3") != std::string::npos;
  if (h100_80gb) return &h100_ceilings();
  return nullptr;
}

}  // namespace moe
