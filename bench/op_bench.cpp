// moecore_op_bench: CUDA op micro-benchmarks. Grouped GEMM of the MoE experts (forward,
// dgrad, wgrad) on a model's expert shapes, rows spread over experts by a random top-k
// routing, for each grouped-GEMM backend the device runs (mma everywhere, wgmma on sm_90).
// Random BF16 data drawn on the GPU (truncated normals of core/rng.h, never all zeros), inputs
// larger than L2, warm-up, CUDA events, median/min/max.
// Prints `op | backend | us | TFLOP/s | diff`, diff = ||out - out_mma|| / ||out_mma|| of one
// overwrite run of each backend (0 for mma itself), and writes one JSON file. The weight
// gradients are timed overwriting, accumulating ("+=") and overwriting with the square sums of
// their 128 x 128 blocks ("sq", as a step's first backward runs them).
// Then causal attention forward and backward on one layer's shape (default olmoe-8l: B 4, S 4096,
// 16/16 heads, hd 128) for each attention backend (own, cudnn), FLOPs 4*B*Hq*S*S*D/2 forward and
// 2.5x that backward; diff against the own kernels (out; dq, dk, dv together, both backwards fed
// the own forward's out and lse). JSON key "attention". --ops fp8_gemm alone: the dense
// block-scaled FP8 GEMM against BF16 on olmoe-8l and scaling-e8 dense shapes, and MX operands
// through cuda::mx_gemm (JSON key "fp8_gemm").
// --ops grouped_fp8: the experts' FP8 grouped GEMM (cuda::grouped_gemm_fp8) against the BF16 wgmma
// kernels on the expert shapes, forward and data gradient of both projections, with and without
// the activation's quantisation, and the weights' quantisation with the transposed copy (JSON key
// "grouped_fp8"), and the weight gradients (K-grouped BF16 against cuda::grouped_gemm_fp8_wgrad, with
// and without quantising both operands down the experts' rows); then the whole experts of one MoE
// layer, BF16 against the FP8 recipe (its backward also with the weight gradients in FP8).
// --ops adamw: cuda::adamw_apply over 256M parameters (one segment, BF16 copy written) launched a
// block per chunk on every SM and kept to r SMs (the deferred update's reserve: r = 16, 32, 48,
// 64), with the moments at the flat offsets (the bulk-copy ring) and shifted by 4 elements (plain
// float4 loads): ms and GB/s at 30 bytes a parameter, alone on the GPU (JSON key "adamw"; the same
// with BF16 moments, optim.moment_dtype = "bf16", at 22 bytes a parameter, on every SM and 32; and
// the FP8 step's update of the experts' weights, cuda::adamw_apply_fp8_weights, which writes their
// codes and transposed codes instead of a BF16 copy: 30 and 22 bytes a parameter); then
// the ring on r SMs beside 12 grouped GEMMs held to the other SMs (olmoe-8l's gate_up forward,
// 131072 rows of 2048 over 64 experts): the update's time and the GEMMs' with and without it,
// after the GEMMs on every SM without a reserve (r = 0; JSON key "adamw_beside_gemm").
// --ops cross_entropy: the LM head's fused cross-entropy (cuda::cross_entropy_forward_backward, in
// place as the step runs it) on one chunk of --ce-rows rows (default 4096, the LM head's chunk) of
// --vocab logits (default 50304), at the launcher's block size and at each power of two from 32 to
// 512 threads a row: us and TB/s at the minimum bytes (the logits read once, dlogits written once;
// JSON key "cross_entropy").
// usage: moecore_op_bench [--tokens T] [--top-k K] [--experts E] [--d-model D] [--hidden I]
//                         [--warmup N] [--iters N] [--backend mma|wgmma|all] [--out FILE.json]
//                         [--ops all|grouped_gemm|attention|fp8_gemm|grouped_fp8|adamw|cross_entropy]
//                         [--vocab V] [--ce-rows N] [--attn-batch B] [--attn-seq S]
//                         [--attn-heads Hq] [--attn-kv-heads Hkv] [--attn-head-dim D]
//                         [--attn-backend own|cudnn|all]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "core/square_blocks.h"
#include "cuda/common.h"
#include "cuda/ops/attention.h"
#include "cuda/ops/attention_cudnn.h"
#include "cuda/ops/cross_entropy.h"
#include "cuda/ops/experts.h"
#include "cuda/ops/fp8.h"
#include "cuda/ops/gemm.h"
#include "cuda/ops/grouped_gemm.h"
#include "cuda/ops/init.h"
#include "cuda/ops/memory.h"
#include "cuda/ops/moe_routing.h"
#include "cuda/ops/optim.h"
#include "cuda/ops/swiglu.h"
#include "cuda/sm_reserve.h"
#include "train/run_plan.h"

namespace {

struct Args {
  int64_t tokens = 16384, top_k = 8, experts = 64, d_model = 2048, hidden = 1024;
  int warmup = 5, iters = 20;
  std::string backend = "all";
  std::string out;
  std::string ops = "all";
  int64_t attn_batch = 4, attn_seq = 4096, attn_heads = 16, attn_kv_heads = 16, attn_head_dim = 128;
  std::string attn_backend = "all";
  int64_t vocab = 50304, ce_rows = 4096;
};

using moe::cuda::GroupedGemmBackend;

template <typename T>
T* device_copy(const std::vector<T>& h) {
  T* d = nullptr;
  MOE_CUDA_CHECK(cudaMalloc(&d, h.size() * sizeof(T)));
  MOE_CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// n BF16 values of tensor `name` on the device: core/rng.h's truncated N(0, scale^2) drawn on the
// GPU (cuda::fill_trunc_normal, in chunks) and rounded to BF16, with no host copy: the inputs of
// the larger sections took tens of seconds to draw on the host.
uint16_t* device_random_bf16(int64_t n, const char* name, float scale) {
  constexpr int64_t kChunk = int64_t{1} << 26;
  uint16_t* d = nullptr;
  float* tmp = nullptr;
  MOE_CUDA_CHECK(cudaMalloc(&d, std::max<int64_t>(n, 1) * 2));
  MOE_CUDA_CHECK(cudaMalloc(&tmp, std::clamp<int64_t>(n, 1, kChunk) * 4));
  for (int64_t off = 0; off < n; off += kChunk) {
    const int64_t c = std::min(kChunk, n - off);
    moe::cuda::fill_trunc_normal(tmp, c, off, 1234, name, scale, nullptr);
    moe::cuda::cast_f32_to_bf16(tmp, d + off, c, nullptr);
  }
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  MOE_CUDA_CHECK(cudaFree(tmp));
  return d;
}


// Host copy of a device output as floats (BF16 or FP32 elements).
std::vector<float> download(const void* d, int64_t count, bool bf16) {
  std::vector<float> out(count);
  if (bf16) {
    std::vector<uint16_t> raw(count);
    MOE_CUDA_CHECK(cudaMemcpy(raw.data(), d, count * 2, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < count; ++i) out[i] = moe::bf16_to_f32(raw[i]);
  } else {
    MOE_CUDA_CHECK(cudaMemcpy(out.data(), d, count * 4, cudaMemcpyDeviceToHost));
  }
  return out;
}

// ||got - ref|| / ||ref|| over the first `count` elements (NaN when either holds a NaN).
double relative_difference(const std::vector<float>& got, const std::vector<float>& ref) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = double{got[i]} - ref[i];
    num += d * d;
    den += double{ref[i]} * ref[i];
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Median / min / max milliseconds of `fn` over a.iters timed runs after a.warmup runs.
struct Timing {
  double med_ms, min_ms, max_ms;
};

template <typename F>
Timing time_ms(const Args& a, cudaStream_t s, F&& fn) {
  for (int i = 0; i < a.warmup; ++i) fn();
  std::vector<float> ms(a.iters);
  cudaEvent_t e0, e1;
  MOE_CUDA_CHECK(cudaEventCreate(&e0));
  MOE_CUDA_CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < a.iters; ++i) {
    MOE_CUDA_CHECK(cudaEventRecord(e0, s));
    fn();
    MOE_CUDA_CHECK(cudaEventRecord(e1, s));
    MOE_CUDA_CHECK(cudaEventSynchronize(e1));
    MOE_CUDA_CHECK(cudaEventElapsedTime(&ms[i], e0, e1));
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front(), ms.back()};
}

template <typename F>
nlohmann::json time_op(const std::string& op, GroupedGemmBackend backend, double flops, const Args& a,
                       cudaStream_t s, F&& fn) {
  const Timing t = time_ms(a, s, fn);
  const double tflops = flops / (t.med_ms * 1e-3) / 1e12;
  return {{"op", op}, {"backend", moe::cuda::grouped_gemm_backend_name(backend)}, {"us_median", t.med_ms * 1e3},
          {"us_min", t.min_ms * 1e3}, {"us_max", t.max_ms * 1e3}, {"tflops", tflops}, {"flops", flops}};
}

// The experts' GEMMs in FP8 (cuda::grouped_gemm_fp8) against BF16 (the wgmma kernels) on the
// same rows and experts: forward of gate_up (x [rows, D] -> [rows, 2I]) and down (h [rows, I] -> D)
// on the weights' codes, data gradients (dy_gu -> [rows, D], dy_dn -> [rows, I]) on their
// transposed copies. "fp8" times the GEMM alone, "fp8+q" adds the 1 x 128 quantisation of its BF16
// input; "q(w) us" is the weights' quantisation with the transposed copy (once per step for both
// GEMMs of a weight). diff = ||y_fp8 - y_bf16|| / ||y_bf16||.
nlohmann::json grouped_fp8_section(const Args& a, cudaStream_t s, int64_t rows, int64_t E, int64_t D, int64_t I,
                                   const int32_t* off, const uint16_t* x, const uint16_t* h, const uint16_t* w_gu,
                                   const uint16_t* w_dn, const uint16_t* dy_gu, const uint16_t* dy_dn) {
  using namespace moe::cuda;
  const moe::Fp8Format e4 = moe::Fp8Format::kE4M3;
  const int64_t widest = std::max(2 * I, D);
  uint8_t *qa = nullptr, *qw = nullptr, *qwt = nullptr;
  float *sa = nullptr, *sw = nullptr, *swt = nullptr;
  uint16_t *y8 = nullptr, *y16 = nullptr;
  const int64_t wmax = E * 2 * I * D;
  MOE_CUDA_CHECK(cudaMalloc(&qa, rows * widest));
  MOE_CUDA_CHECK(cudaMalloc(&sa, rows * ((widest + 127) / 128) * 4));
  MOE_CUDA_CHECK(cudaMalloc(&qw, wmax));
  MOE_CUDA_CHECK(cudaMalloc(&qwt, wmax));
  const auto blocks = [](int64_t n) { return (n + 127) / 128; };
  const int64_t wscales = E * std::max(blocks(2 * I) * blocks(D), blocks(D) * blocks(I));
  MOE_CUDA_CHECK(cudaMalloc(&sw, wscales * 4));
  MOE_CUDA_CHECK(cudaMalloc(&swt, wscales * 4));
  MOE_CUDA_CHECK(cudaMalloc(&y8, rows * widest * 2));
  MOE_CUDA_CHECK(cudaMalloc(&y16, rows * widest * 2));
  struct Case {
    const char* op;
    const uint16_t* in;   // the GEMM's BF16 input [rows, k_red]
    const uint16_t* w;    // the BF16 weights [E, n_w, k_w]
    int64_t n_w, k_w;
    bool dgrad;
  };
  const std::vector<Case> cases = {{"gate_up forward", x, w_gu, 2 * I, D, false},
                                   {"gate_up dgrad", dy_gu, w_gu, 2 * I, D, true},
                                   {"down forward", h, w_dn, D, I, false},
                                   {"down dgrad", dy_dn, w_dn, D, I, true}};
  std::printf("\nexperts' grouped GEMM, FP8 (E4M3, 1x128 x 128x128, wgmma) vs BF16 (wgmma), %lld rows, %lld experts\n",
              (long long)rows, (long long)E);
  std::printf("%-16s | %8s | %8s | %8s | %9s | %9s\n", "op", "bf16", "fp8", "fp8+q", "q(w) us", "diff");
  nlohmann::json out = nlohmann::json::array();
  for (const Case& c : cases) {
    const int64_t n_out = c.dgrad ? c.k_w : c.n_w, k_red = c.dgrad ? c.n_w : c.k_w;
    auto quantize_w = [&] { fp8_quantize_weights(c.w, E, c.n_w, c.k_w, e4, qw, sw, qwt, swt, nullptr, s); };
    auto quantize_a = [&] { fp8_quantize_blocks(c.in, rows, k_red, moe::kFp8ActivationBlock, e4, qa, sa, nullptr, s); };
    auto run_fp8 = [&] {
      grouped_gemm_fp8(qa, sa, c.dgrad ? qwt : qw, c.dgrad ? swt : sw, off, y8, rows, E, n_out, k_red, s);
    };
    auto run_bf16 = [&] {
      if (c.dgrad) {
        grouped_gemm_dgrad(c.in, c.w, off, y16, rows, E, c.n_w, c.k_w, s, GroupedGemmBackend::kWgmma);
      } else {
        grouped_gemm_forward(c.in, c.w, off, y16, rows, E, c.n_w, c.k_w, s, GroupedGemmBackend::kWgmma);
      }
    };
    quantize_w();
    quantize_a();
    const double flops = 2.0 * rows * n_out * k_red;
    const Timing tb = time_ms(a, s, run_bf16), t8 = time_ms(a, s, run_fp8);
    const Timing tq = time_ms(a, s, [&] { quantize_a(); run_fp8(); }), tw = time_ms(a, s, quantize_w);
    MOE_CUDA_CHECK(cudaStreamSynchronize(s));
    const double diff = relative_difference(download(y8, rows * n_out, true), download(y16, rows * n_out, true));
    auto tf = [&](const Timing& t) { return flops / (t.med_ms * 1e-3) / 1e12; };
    std::printf("%-16s | %8.1f | %8.1f | %8.1f | %9.1f | %9.3e\n", c.op, tf(tb), tf(t8), tf(tq), tw.med_ms * 1e3, diff);
    out.push_back({{"op", c.op}, {"n", n_out}, {"k", k_red}, {"bf16_tflops", tf(tb)}, {"fp8_tflops", tf(t8)},
                   {"fp8_with_quantise_tflops", tf(tq)}, {"bf16_us", tb.med_ms * 1e3}, {"fp8_us", t8.med_ms * 1e3},
                   {"fp8_with_quantise_us", tq.med_ms * 1e3}, {"w_quantise_us", tw.med_ms * 1e3},
                   {"diff_vs_bf16", diff}});
  }
  // The weight gradients (D and I multiples of 128): the BF16 K-grouped wgrad against
  // cuda::grouped_gemm_fp8_wgrad, alone and with both operands' quantisation down the experts' rows
  // (cuda::fp8_quantize_expert_columns) counted; diff = ||dw_fp8 - dw_bf16|| / ||dw_bf16||.
  if (experts_fp8_wgrad_applies(D, I)) {
    const int64_t cap = fp8_expert_columns_capacity(rows, E), wide = std::max(D, 2 * I);
    uint8_t *ca = nullptr, *cb = nullptr;
    float *wsa = nullptr, *wsb = nullptr, *dw8 = nullptr, *dw16 = nullptr;
    int32_t* padded = nullptr;
    MOE_CUDA_CHECK(cudaMalloc(&ca, wide * cap));
    MOE_CUDA_CHECK(cudaMalloc(&cb, wide * cap));
    MOE_CUDA_CHECK(cudaMalloc(&wsa, cap / 128 * wide * 4));
    MOE_CUDA_CHECK(cudaMalloc(&wsb, cap / 128 * wide * 4));
    MOE_CUDA_CHECK(cudaMalloc(&padded, (E + 1) * 4));
    MOE_CUDA_CHECK(cudaMalloc(&dw8, E * 2 * I * D * 4));
    MOE_CUDA_CHECK(cudaMalloc(&dw16, E * 2 * I * D * 4));
    struct Wgrad {
      const char* op;
      const uint16_t* a;  // [rows, n]
      const uint16_t* b;  // [rows, k]
      int64_t n, k;
    };
    for (const Wgrad& c : {Wgrad{"gate_up wgrad", dy_gu, x, 2 * I, D}, Wgrad{"down wgrad", dy_dn, h, D, I}}) {
      auto quantize = [&] {
        fp8_quantize_expert_columns(c.a, off, rows, E, c.n, cap, e4, ca, wsa, padded, nullptr, s);
        fp8_quantize_expert_columns(c.b, off, rows, E, c.k, cap, e4, cb, wsb, padded, nullptr, s);
      };
      auto run_fp8 = [&] { grouped_gemm_fp8_wgrad(ca, wsa, cb, wsb, padded, dw8, E, c.n, c.k, cap, false, s); };
      auto run_bf16 = [&] {
        grouped_gemm_wgrad(c.a, c.b, off, dw16, rows, E, c.n, c.k, false, s, GroupedGemmBackend::kWgmma);
      };
      quantize();
      const double flops = 2.0 * rows * c.n * c.k;
      const Timing tb = time_ms(a, s, run_bf16), t8 = time_ms(a, s, run_fp8);
      const Timing tq = time_ms(a, s, [&] { quantize(); run_fp8(); });
      MOE_CUDA_CHECK(cudaStreamSynchronize(s));
      const int64_t count = E * c.n * c.k;
      const double diff = relative_difference(download(dw8, count, false), download(dw16, count, false));
      auto tf = [&](const Timing& t) { return flops / (t.med_ms * 1e-3) / 1e12; };
      std::printf("%-16s | %8.1f | %8.1f | %8.1f | %9s | %9.3e\n", c.op, tf(tb), tf(t8), tf(tq), "-", diff);
      out.push_back({{"op", c.op}, {"n", c.n}, {"k", c.k}, {"bf16_tflops", tf(tb)}, {"fp8_tflops", tf(t8)},
                     {"fp8_with_quantise_tflops", tf(tq)}, {"bf16_us", tb.med_ms * 1e3}, {"fp8_us", t8.med_ms * 1e3},
                     {"fp8_with_quantise_us", tq.med_ms * 1e3}, {"diff_vs_bf16", diff}});
    }
    for (void* p : {(void*)ca, (void*)cb, (void*)wsa, (void*)wsb, (void*)padded, (void*)dw8, (void*)dw16}) cudaFree(p);
  }
  for (void* p : {(void*)qa, (void*)qw, (void*)qwt, (void*)sa, (void*)sw, (void*)swt, (void*)y8, (void*)y16})
    cudaFree(p);

  // The whole experts of one MoE layer: cuda::experts_forward / _backward (BF16) against
  // experts_forward_fp8 / _backward_fp8 (every quantisation of an input counted, h and dgate_up
  // quantised by the SwiGLU kernels when I is a multiple of 128; the weights quantised beforehand,
  // their cost in the last column, once per step for both passes). FLOPs of the three GEMMs (forward)
  // or six (backward: the FP8 data gradients and the BF16 weight gradients).
  Fp8ExpertWeights fw;
  uint8_t *c_gu = nullptr, *c_gut = nullptr, *c_dn = nullptr, *c_dnt = nullptr;
  float *s_gu = nullptr, *s_gut = nullptr, *s_dn = nullptr, *s_dnt = nullptr;
  for (uint8_t** c : {&c_gu, &c_gut}) MOE_CUDA_CHECK(cudaMalloc(c, E * 2 * I * D));
  for (uint8_t** c : {&c_dn, &c_dnt}) MOE_CUDA_CHECK(cudaMalloc(c, E * D * I));
  for (float** f : {&s_gu, &s_gut}) MOE_CUDA_CHECK(cudaMalloc(f, E * blocks(2 * I) * blocks(D) * 4));
  for (float** f : {&s_dn, &s_dnt}) MOE_CUDA_CHECK(cudaMalloc(f, E * blocks(D) * blocks(I) * 4));
  fw = {c_gu, s_gu, c_gut, s_gut, c_dn, s_dn, c_dnt, s_dnt};
  auto quantize_weights = [&] {
    fp8_quantize_weights(w_gu, E, 2 * I, D, e4, c_gu, s_gu, c_gut, s_gut, nullptr, s);
    fp8_quantize_weights(w_dn, E, D, I, e4, c_dn, s_dn, c_dnt, s_dnt, nullptr, s);
  };
  uint16_t *gate_up = nullptr, *hh = nullptr, *y = nullptr, *dx = nullptr;
  float *dw_gu = nullptr, *dw_dn = nullptr;
  void *ws = nullptr, *f8 = nullptr;
  const size_t ws_bytes = experts_backward_workspace_bytes(rows, I), f8_bytes = experts_fp8_workspace_bytes(rows, D, I);
  MOE_CUDA_CHECK(cudaMalloc(&gate_up, rows * 2 * I * 2));
  MOE_CUDA_CHECK(cudaMalloc(&hh, rows * I * 2));
  MOE_CUDA_CHECK(cudaMalloc(&y, rows * D * 2));
  MOE_CUDA_CHECK(cudaMalloc(&dx, rows * D * 2));
  MOE_CUDA_CHECK(cudaMalloc(&dw_gu, E * 2 * I * D * 4));
  MOE_CUDA_CHECK(cudaMalloc(&dw_dn, E * D * I * 4));
  MOE_CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  MOE_CUDA_CHECK(cudaMalloc(&f8, f8_bytes));
  quantize_weights();
  const Timing tqw = time_ms(a, s, quantize_weights);
  auto fwd16 = [&] { experts_forward(x, off, w_gu, w_dn, rows, E, D, I, gate_up, hh, y, s); };
  auto fwd8 = [&] { experts_forward_fp8(x, off, fw, rows, E, D, I, gate_up, hh, y, f8, f8_bytes, s); };
  auto bwd16 = [&] {
    experts_backward(x, off, w_gu, w_dn, gate_up, hh, dy_dn, rows, E, D, I, dx, dw_gu, dw_dn, ws, ws_bytes, s,
                     GroupedGemmBackend::kAuto, true);
  };
  auto bwd8 = [&] {
    experts_backward_fp8(x, off, fw, gate_up, hh, dy_dn, rows, E, D, I, dx, dw_gu, dw_dn, ws, ws_bytes, f8, f8_bytes,
                         s, true);
  };
  const double f_fwd = 2.0 * rows * (2 * I) * D + 2.0 * rows * D * I, f_bwd = 2.0 * f_fwd;
  const Timing tf16 = time_ms(a, s, fwd16), tf8 = time_ms(a, s, fwd8);
  fwd16();  // the backward reads the forward's saved tensors
  const Timing tb16 = time_ms(a, s, bwd16);
  fwd8();
  const Timing tb8 = time_ms(a, s, bwd8);
  // The FP8 recipe with its weight gradients in FP8 too (D and I multiples of 128): each wgrad's
  // operands quantised down the experts' rows, then cuda::grouped_gemm_fp8_wgrad.
  const bool fp8_dw = experts_fp8_wgrad_applies(D, I);
  Timing tb8w{};
  if (fp8_dw) {
    const size_t wg_bytes = experts_fp8_wgrad_workspace_bytes(rows, E, D, I);
    void* wg = nullptr;
    MOE_CUDA_CHECK(cudaMalloc(&wg, wg_bytes));
    tb8w = time_ms(a, s, [&] {
      experts_backward_fp8(x, off, fw, gate_up, hh, dy_dn, rows, E, D, I, dx, dw_gu, dw_dn, ws, ws_bytes, f8, f8_bytes,
                           s, true, false, wg, wg_bytes);
    });
    MOE_CUDA_CHECK(cudaStreamSynchronize(s));
    cudaFree(wg);
  }
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  std::printf("\nthe experts of one MoE layer (%s): BF16 vs the FP8 recipe, quantisations counted\n",
              I % 128 == 0 ? "SwiGLU writes the FP8 codes of h and dgate_up" : "h and dgate_up quantised by a pass");
  std::printf("%-16s | %9s | %9s | %7s | %9s\n", "pass", "bf16 us", "fp8 us", "ratio", "q(w) us");
  std::printf("%-16s | %9.1f | %9.1f | %6.2fx | %9.1f\n", "experts forward", tf16.med_ms * 1e3, tf8.med_ms * 1e3,
              tf16.med_ms / tf8.med_ms, tqw.med_ms * 1e3);
  std::printf("%-16s | %9.1f | %9.1f | %6.2fx | %9s\n", "experts backward", tb16.med_ms * 1e3, tb8.med_ms * 1e3,
              tb16.med_ms / tb8.med_ms, "-");
  if (fp8_dw) {
    std::printf("%-16s | %9.1f | %9.1f | %6.2fx | %9s\n", "  with fp8 dw", tb16.med_ms * 1e3, tb8w.med_ms * 1e3,
                tb16.med_ms / tb8w.med_ms, "-");
  }
  out.push_back({{"op", "experts forward"}, {"bf16_us", tf16.med_ms * 1e3}, {"fp8_us", tf8.med_ms * 1e3},
                 {"bf16_tflops", f_fwd / (tf16.med_ms * 1e-3) / 1e12}, {"fp8_tflops", f_fwd / (tf8.med_ms * 1e-3) / 1e12},
                 {"w_quantise_us", tqw.med_ms * 1e3}, {"swiglu_fused", I % 128 == 0}});
  out.push_back({{"op", "experts backward"}, {"bf16_us", tb16.med_ms * 1e3}, {"fp8_us", tb8.med_ms * 1e3},
                 {"bf16_tflops", f_bwd / (tb16.med_ms * 1e-3) / 1e12}, {"fp8_tflops", f_bwd / (tb8.med_ms * 1e-3) / 1e12},
                 {"fp8_dw_us", fp8_dw ? nlohmann::json(tb8w.med_ms * 1e3) : nlohmann::json()},
                 {"swiglu_fused", I % 128 == 0}});

  // The producers of the experts' first GEMM inputs: the permute (x_sorted) and the combine's
  // backward (dy_sorted) on a dispatch map of rows / 8 tokens at top-8 (a random permutation of the
  // routes), plain, followed by the standalone 1 x 128 quantisation of what they wrote (what the
  // experts' FP8 path ran before the producers wrote the codes), and fused
  // (cuda::permute_forward_fp8 / unpermute_backward_fp8).
  if (D % 128 == 0 && rows % 8 == 0) {
    const int64_t k = 8, T = rows / k;
    std::vector<int32_t> perm(static_cast<size_t>(rows)), inv(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) perm[size_t(r)] = static_cast<int32_t>(r);
    uint64_t st = 12345;
    for (int64_t r = rows - 1; r > 0; --r) {  // Fisher-Yates with a fixed LCG
      st = st * 6364136223846793005ull + 1442695040888963407ull;
      std::swap(perm[size_t(r)], perm[size_t((st >> 33) % uint64_t(r + 1))]);
    }
    for (int64_t r = 0; r < rows; ++r) inv[size_t(perm[size_t(r)])] = static_cast<int32_t>(r);
    int32_t *d_sorted = nullptr, *d_r2r = nullptr;
    float *topk_w = nullptr, *dtopk_w = nullptr;
    uint16_t* xs = nullptr;
    MOE_CUDA_CHECK(cudaMalloc(&d_sorted, rows * 4));
    MOE_CUDA_CHECK(cudaMalloc(&d_r2r, rows * 4));
    MOE_CUDA_CHECK(cudaMalloc(&topk_w, rows * 4));
    MOE_CUDA_CHECK(cudaMalloc(&dtopk_w, rows * 4));
    MOE_CUDA_CHECK(cudaMalloc(&xs, rows * D * 2));
    MOE_CUDA_CHECK(cudaMemcpy(d_sorted, perm.data(), rows * 4, cudaMemcpyHostToDevice));
    MOE_CUDA_CHECK(cudaMemcpy(d_r2r, inv.data(), rows * 4, cudaMemcpyHostToDevice));
    const std::vector<float> w_host(static_cast<size_t>(rows), 1.0f / k);
    MOE_CUDA_CHECK(cudaMemcpy(topk_w, w_host.data(), rows * 4, cudaMemcpyHostToDevice));
    const Fp8Rows in = experts_fp8_input_rows(f8, f8_bytes, rows, D, I);
    const uint16_t* tokens = x;  // the first T rows of x as the token rows, y as the combine's saved output
    auto perm16 = [&] { permute_forward(tokens, d_sorted, d_r2r, T, k, D, xs, s); };
    auto perm_q = [&] {
      permute_forward(tokens, d_sorted, d_r2r, T, k, D, xs, s);
      fp8_quantize_blocks(xs, rows, D, moe::kFp8ActivationBlock, e4, in.codes, in.scales, nullptr, s);
    };
    auto perm8 = [&] { permute_forward_fp8(tokens, d_sorted, d_r2r, T, k, D, xs, in.codes, in.scales, s); };
    auto unp16 = [&] { unpermute_backward(tokens, y, d_sorted, d_r2r, topk_w, T, k, D, xs, dtopk_w, s); };
    auto unp_q = [&] {
      unpermute_backward(tokens, y, d_sorted, d_r2r, topk_w, T, k, D, xs, dtopk_w, s);
      fp8_quantize_blocks(xs, rows, D, moe::kFp8ActivationBlock, e4, in.codes, in.scales, nullptr, s);
    };
    auto unp8 = [&] {
      unpermute_backward_fp8(tokens, y, d_sorted, d_r2r, topk_w, T, k, D, xs, dtopk_w, in.codes, in.scales, s);
    };
    std::printf("\nthe producers of the experts' FP8 inputs (%lld tokens x top-%lld, d %lld): us\n",
                static_cast<long long>(T), static_cast<long long>(k), static_cast<long long>(D));
    std::printf("%-22s | %9s | %11s | %9s\n", "pass", "bf16", "+ quantise", "fused");
    const Timing p16 = time_ms(a, s, perm16), pq = time_ms(a, s, perm_q), p8 = time_ms(a, s, perm8);
    const Timing u16 = time_ms(a, s, unp16), uq = time_ms(a, s, unp_q), u8 = time_ms(a, s, unp8);
    for (const auto& [name, t16, tq, t8] :
         {std::tuple{"permute", p16, pq, p8}, std::tuple{"combine backward", u16, uq, u8}}) {
      std::printf("%-22s | %9.1f | %11.1f | %9.1f\n", name, t16.med_ms * 1e3, tq.med_ms * 1e3, t8.med_ms * 1e3);
      out.push_back({{"op", std::string(name) + " producer"}, {"bf16_us", t16.med_ms * 1e3},
                     {"with_quantise_us", tq.med_ms * 1e3}, {"fused_us", t8.med_ms * 1e3}});
    }
    for (void* p : {(void*)d_sorted, (void*)d_r2r, (void*)topk_w, (void*)dtopk_w, (void*)xs}) cudaFree(p);
  }
  for (void* p : {(void*)c_gu, (void*)c_gut, (void*)c_dn, (void*)c_dnt, (void*)s_gu, (void*)s_gut, (void*)s_dn,
                  (void*)s_dnt, (void*)gate_up, (void*)hh, (void*)y, (void*)dx, (void*)dw_gu, (void*)dw_dn, ws, f8})
    cudaFree(p);
  return out;
}

// Causal attention forward and backward of one layer on each requested backend; returns the
// JSON record of the section.
nlohmann::json attention_section(const Args& a, cudaStream_t s);

// Dense block-scaled FP8 GEMM (cuda::fp8_gemm: 1 x 128 activation scales, 128 x 128 weight scales,
// E4M3) against the BF16 GEMM (cuda::gemm) on one problem y[m, n] = x[m, k] w[n, k]^T: the GEMM
// alone on quantised operands, and with the activation's quantisation counted (BF16 x -> codes and
// scales, the scales put K-block-major); the weight's quantisation (once per optimizer step in
// training) timed on its own. diff = ||y_fp8 - y_bf16|| / ||y_bf16||.
nlohmann::json fp8_gemm_section(const Args& a, cudaStream_t s) {
  using namespace moe::cuda;
  struct Shape {
    const char* name;
    int64_t m, n, k;
  };
  const std::vector<Shape> shapes = {{"olmoe-8l projection", 16384, 2048, 2048},
                                     {"olmoe-8l LM head", 16384, 50304, 2048},
                                     {"scaling-e8 projection", 8192, 4096, 4096},
                                     {"scaling-e8 dense MLP up", 8192, 20480, 4096}};
  nlohmann::json out = nlohmann::json::array();
  GemmHandle gemm;
  std::printf("\nblock-scaled FP8 GEMM (E4M3, 1x128 x 128x128) vs BF16, TFLOP/s; mx: both operands MX (1 x 32,\n"
              "E8M0) re-blocked to 1 x 128 and multiplied (cuda::mx_gemm, FP32 out, the re-blocking counted)\n");
  std::printf("%-24s | %5s x %5s x %5s | %8s | %8s | %8s | %11s | %8s | %9s\n", "shape", "m", "n", "k", "bf16", "fp8",
              "fp8+q(x)", "q(w) us", "mx", "diff");
  for (const Shape& sh : shapes) {
    const int64_t m = sh.m, n = sh.n, k = sh.k, kb = k / 128, nb = (n + 127) / 128, ldsb = (kb + 3) / 4 * 4;
    auto* x = device_random_bf16(m * k, "fp8 x", 1.f);
    auto* w = device_random_bf16(n * k, "fp8 w", 0.02f);
    uint16_t *y16 = nullptr, *y8 = nullptr;
    uint8_t *qx = nullptr, *qw = nullptr;
    float *sx = nullptr, *sx_t = nullptr, *sw = nullptr, *sw_pad = nullptr;
    MOE_CUDA_CHECK(cudaMalloc(&y16, m * n * 2));
    MOE_CUDA_CHECK(cudaMalloc(&y8, m * n * 2));
    MOE_CUDA_CHECK(cudaMalloc(&qx, m * k));
    MOE_CUDA_CHECK(cudaMalloc(&qw, n * k));
    MOE_CUDA_CHECK(cudaMalloc(&sx, m * kb * 4));
    MOE_CUDA_CHECK(cudaMalloc(&sx_t, m * kb * 4));
    MOE_CUDA_CHECK(cudaMalloc(&sw, nb * kb * 4));
    MOE_CUDA_CHECK(cudaMalloc(&sw_pad, nb * ldsb * 4));
    MOE_CUDA_CHECK(cudaMemset(sw_pad, 0, nb * ldsb * 4));
    const moe::Fp8Format e4 = moe::Fp8Format::kE4M3;
    auto quantize_w = [&] {
      fp8_quantize_blocks(w, n, k, moe::kFp8WeightBlock, e4, qw, sw, nullptr, s);
      // [nb, kb] -> rows of ldsb (kb a multiple of 4 here, so one copy).
      MOE_CUDA_CHECK(cudaMemcpy2DAsync(sw_pad, ldsb * 4, sw, kb * 4, kb * 4, nb, cudaMemcpyDeviceToDevice, s));
    };
    auto quantize_x = [&] {
      fp8_quantize_blocks(x, m, k, moe::kFp8ActivationBlock, e4, qx, sx, nullptr, s);
      fp8_scales_k_major(sx, m, kb, m, sx_t, s);
    };
    auto run_fp8 = [&] { fp8_gemm(gemm, qx, sx_t, m, e4, qw, sw_pad, ldsb, e4, Fp8BScaling::kBlock128x128, m, n, k, y8, s); };
    auto run_bf16 = [&] { moe::cuda::gemm(gemm, false, true, m, n, k, 1.f, x, k, w, k, 0.f, y16, n, s); };
    quantize_w();
    quantize_x();
    const double flops = 2.0 * m * n * k;
    const Timing tb = time_ms(a, s, run_bf16), t8 = time_ms(a, s, run_fp8);
    const Timing tq = time_ms(a, s, [&] { quantize_x(); run_fp8(); }), tw = time_ms(a, s, quantize_w);
    MOE_CUDA_CHECK(cudaStreamSynchronize(s));
    const double diff = relative_difference(download(y8, m * n, true), download(y16, m * n, true));
    // MX: x and w in 1 x 32 blocks (the codes into qx / qw, E8M0 scales of their own), then mx_gemm.
    Timing tmx{};
    {
      uint8_t *smx = nullptr, *smw = nullptr;
      float* y32 = nullptr;
      void* ws = nullptr;
      const size_t ws_bytes = mx_gemm_workspace_bytes(m, n, k);
      MOE_CUDA_CHECK(cudaMalloc(&smx, m * (k / 32)));
      MOE_CUDA_CHECK(cudaMalloc(&smw, n * (k / 32)));
      MOE_CUDA_CHECK(cudaMalloc(&y32, m * n * 4));
      MOE_CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
      mx_quantize(x, m, k, e4, moe::MxScale::kOcp, qx, smx, nullptr, s);
      mx_quantize(w, n, k, e4, moe::MxScale::kOcp, qw, smw, nullptr, s);
      tmx = time_ms(a, s, [&] {
        mx_gemm(gemm, qx, smx, e4, qw, smw, e4, m, n, k, y32, false, ws, ws_bytes, nullptr, nullptr, s);
      });
      MOE_CUDA_CHECK(cudaStreamSynchronize(s));
      for (void* p : {(void*)smx, (void*)smw, (void*)y32, ws}) cudaFree(p);
    }
    auto tf = [&](const Timing& t) { return flops / (t.med_ms * 1e-3) / 1e12; };
    std::printf("%-24s | %5lld x %5lld x %5lld | %8.1f | %8.1f | %8.1f | %11.1f | %8.1f | %9.3e\n", sh.name,
                (long long)m, (long long)n, (long long)k, tf(tb), tf(t8), tf(tq), tw.med_ms * 1e3, tf(tmx), diff);
    out.push_back({{"shape", sh.name}, {"m", m}, {"n", n}, {"k", k}, {"bf16_tflops", tf(tb)},
                   {"fp8_tflops", tf(t8)}, {"fp8_with_x_quantise_tflops", tf(tq)}, {"mx_reblocked_tflops", tf(tmx)},
                   {"mx_reblocked_us", tmx.med_ms * 1e3},
                   {"bf16_us", tb.med_ms * 1e3}, {"fp8_us", t8.med_ms * 1e3},
                   {"fp8_with_x_quantise_us", tq.med_ms * 1e3}, {"w_quantise_us", tw.med_ms * 1e3},
                   {"diff_vs_bf16", diff}});
    for (void* p : {(void*)x, (void*)w, (void*)y16, (void*)y8, (void*)qx, (void*)qw, (void*)sx, (void*)sx_t,
                    (void*)sw, (void*)sw_pad})
      cudaFree(p);
  }
  return out;
}

// The AdamW update on every SM and on a few (see the header).
nlohmann::json adamw_section(const Args& a, cudaStream_t s) {
  constexpr int64_t kN = int64_t{1} << 28, kShift = 4;
  const moe::OptimConfig cfg;
  std::vector<float> host(size_t(kN + kShift));
  moe::fill_normal(host.data(), kN + kShift, 0, 99, "adamw", 0.02f);
  float* p = device_copy(host);
  float* g = device_copy(host);
  float* m = device_copy(host);
  for (float& x : host) x = std::fabs(x);
  float* v = device_copy(host);
  uint16_t* b = nullptr;
  MOE_CUDA_CHECK(cudaMalloc(&b, size_t(kN) * 2));
  std::vector<moe::cuda::OptimStepScalars> sc(1);
  sc[0].lr = 1e-4;
  sc[0].grad_norm = 0.5;
  auto* scalars = device_copy(sc);
  moe::cuda::adamw_prepare(cfg, scalars, s);
  nlohmann::json out = nlohmann::json::array();
  std::printf("%-26s | %4s | %9s | %8s\n", "adamw (256M parameters)", "SMs", "ms", "GB/s");
  for (const int64_t shift : {int64_t{0}, kShift}) {
    const moe::cuda::ParamSegmentTable table({{0, kN, 1, 0, shift}}, kN, kN + kShift);
    const char* path = shift == 0 ? "moments at offsets (ring)" : "moments shifted (loads)";
    for (const int sms : {0, 16, 32, 48, 64}) {
      const Timing t = time_ms(a, s, [&] { moe::cuda::adamw_apply(table, cfg, p, g, m, v, b, scalars, false, s, sms); });
      const double gbs = moe::adamw_update_bytes(4) * double(kN) / (t.med_ms * 1e-3) / 1e9;
      std::printf("%-26s | %4s | %9.3f | %8.1f\n", path, sms == 0 ? "all" : std::to_string(sms).c_str(), t.med_ms, gbs);
      out.push_back({{"path", path}, {"moments", "fp32"}, {"sms", sms}, {"ms_median", t.med_ms}, {"ms_min", t.min_ms},
                     {"gb_per_s", gbs}});
    }
  }
  // BF16 moments (optim.moment_dtype = "bf16"): 22 bytes a parameter.
  {
    moe::OptimConfig cfg16;
    cfg16.moment_dtype = "bf16";
    std::vector<uint16_t> bits(size_t(kN + kShift));
    for (size_t i = 0; i < bits.size(); ++i) bits[i] = moe::f32_to_bf16(host[i]);  // |N(0, 0.02)|, as v above
    uint16_t* m16 = device_copy(bits);
    uint16_t* v16 = device_copy(bits);
    for (const int64_t shift : {int64_t{0}, kShift}) {
      const moe::cuda::ParamSegmentTable table({{0, kN, 1, 0, shift}}, kN, kN + kShift);
      const char* path = shift == 0 ? "BF16 moments (ring)" : "BF16 moments shifted";
      for (const int sms : {0, 32}) {
        const Timing t =
            time_ms(a, s, [&] { moe::cuda::adamw_apply(table, cfg16, p, g, m16, v16, b, scalars, false, s, sms); });
        const double gbs = moe::adamw_update_bytes(2) * double(kN) / (t.med_ms * 1e-3) / 1e9;
        std::printf("%-26s | %4s | %9.3f | %8.1f\n", path, sms == 0 ? "all" : std::to_string(sms).c_str(), t.med_ms,
                    gbs);
        out.push_back({{"path", path}, {"moments", "bf16"}, {"sms", sms}, {"ms_median", t.med_ms},
                       {"ms_min", t.min_ms}, {"gb_per_s", gbs}});
      }
    }
    // The experts' update that also writes their FP8 codes (cuda::adamw_apply_fp8_weights, the FP8
    // step's update with the codes in the BF16 copy's place: no BF16 copy), the 256M parameters as
    // 64 experts' [2048, 2048] weights: 28 (FP32 moments) or 20 bytes a parameter plus the two codes.
    {
      const int64_t kExperts = 64, kRowsW = 2048, kColsW = kN / (kExperts * kRowsW);
      const moe::cuda::ParamSegment seg{0, kN, 1, 0, -1};
      uint8_t *q = nullptr, *qt = nullptr;
      float *sq = nullptr, *sqt = nullptr;
      uint32_t* bad = nullptr;
      const int64_t blocks = kExperts * (kRowsW / 128) * (kColsW / 128);
      MOE_CUDA_CHECK(cudaMalloc(&q, size_t(kN)));
      MOE_CUDA_CHECK(cudaMalloc(&qt, size_t(kN)));
      MOE_CUDA_CHECK(cudaMalloc(&sq, size_t(blocks) * sizeof(float)));
      MOE_CUDA_CHECK(cudaMalloc(&sqt, size_t(blocks) * sizeof(float)));
      MOE_CUDA_CHECK(cudaMalloc(&bad, sizeof(uint32_t)));
      MOE_CUDA_CHECK(cudaMemset(bad, 0, sizeof(uint32_t)));
      const moe::Fp8Format e4 = moe::Fp8Format::kE4M3;
      for (const bool bf16 : {false, true}) {
        const char* path = bf16 ? "FP8 codes, BF16 moments" : "FP8 codes, FP32 moments";
        const Timing t = time_ms(a, s, [&] {
          if (bf16) {
            moe::cuda::adamw_apply_fp8_weights(seg, kExperts, kRowsW, kColsW, cfg16, p, g, m16, v16, nullptr, e4, q, sq,
                                               qt, sqt, bad, scalars, false, s);
          } else {
            moe::cuda::adamw_apply_fp8_weights(seg, kExperts, kRowsW, kColsW, cfg, p, g, m, v, nullptr, e4, q, sq, qt,
                                               sqt, bad, scalars, false, s);
          }
        });
        const double bytes = moe::adamw_update_bytes(bf16 ? 2 : 4);  // the codes in the BF16 copy's place
        const double gbs = bytes * double(kN) / (t.med_ms * 1e-3) / 1e9;
        std::printf("%-26s | %4s | %9.3f | %8.1f\n", path, "all", t.med_ms, gbs);
        out.push_back({{"path", path}, {"moments", bf16 ? "bf16" : "fp32"}, {"sms", 0}, {"ms_median", t.med_ms},
                       {"ms_min", t.min_ms}, {"gb_per_s", gbs}});
      }
      for (void* ptr : {static_cast<void*>(q), static_cast<void*>(qt), static_cast<void*>(sq),
                        static_cast<void*>(sqt), static_cast<void*>(bad)})
        MOE_CUDA_CHECK(cudaFree(ptr));
    }
    MOE_CUDA_CHECK(cudaFree(m16));
    MOE_CUDA_CHECK(cudaFree(v16));
  }
  // The ring beside the experts' grouped GEMM held to the other SMs (cuda/sm_reserve.h), as the
  // deferred update runs beside the forward: the update enqueued on a second stream right after
  // the GEMMs on the first, both waiting on one event.
  constexpr int64_t kE = 64, kRows = 131072, kD = 2048, kOut = 2048;
  constexpr int kGemms = 12;
  std::vector<int32_t> offsets(size_t(kE + 1));
  for (int64_t e = 0; e <= kE; ++e) offsets[size_t(e)] = static_cast<int32_t>(e * (kRows / kE));
  auto* x = device_random_bf16(kRows * kD, "x", 1.f);
  auto* w = device_random_bf16(kE * kOut * kD, "w_gate_up", 0.02f);
  auto* off = device_copy(offsets);
  uint16_t* y = nullptr;
  MOE_CUDA_CHECK(cudaMalloc(&y, size_t(kRows * kOut) * 2));
  cudaStream_t s2;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t start, gemms_done, u0, u1;
  for (cudaEvent_t* e : {&start, &gemms_done, &u0, &u1}) MOE_CUDA_CHECK(cudaEventCreate(e));
  const moe::cuda::ParamSegmentTable ring({{0, kN, 1, 0, 0}}, kN, kN + kShift);
  nlohmann::json beside = nlohmann::json::array();
  std::printf("%-26s | %4s | %9s | %8s | %14s | %15s\n", "adamw beside grouped GEMMs", "SMs", "update ms", "GB/s",
              "GEMMs alone ms", "GEMMs beside ms");
  // The 12 GEMMs with `reserve` SMs left free, and their time alone on the main stream; each
  // measurement below drops its first round (a warm-up).
  const int rounds = 1 + std::max(1, a.iters / 4);
  auto gemms = [&](int reserve) {
    const moe::cuda::ScopedSmReserve r(reserve);
    for (int i = 0; i < kGemms; ++i) moe::cuda::grouped_gemm_forward(x, w, off, y, kRows, kE, kOut, kD, s);
  };
  auto time_gemms = [&](int reserve) {
    float ms = 0;
    MOE_CUDA_CHECK(cudaEventRecord(start, s));
    gemms(reserve);
    MOE_CUDA_CHECK(cudaEventRecord(gemms_done, s));
    MOE_CUDA_CHECK(cudaEventSynchronize(gemms_done));
    MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, gemms_done));
    return ms;
  };
  auto median = [](std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return double(v[v.size() / 2]);
  };
  // On every SM: the reference for what a reserve costs them.
  {
    std::vector<float> all;
    for (int rep = 0; rep < rounds; ++rep) {
      const float ms = time_gemms(0);
      if (rep > 0) all.push_back(ms);
    }
    const double med = median(all);
    std::printf("%-26s | %4s | %9s | %8s | %14.3f | %15s\n", "no update, no reserve", "0", "-", "-", med, "-");
    beside.push_back({{"sms", 0}, {"gemms", kGemms}, {"gemms_alone_ms", med}});
  }
  for (const int sms : {16, 32, 48}) {
    std::vector<float> alone, with, update;
    for (int rep = 0; rep < rounds; ++rep) {
      const float ms_alone = time_gemms(sms);
      if (rep > 0) alone.push_back(ms_alone);
      float ms = 0;
      MOE_CUDA_CHECK(cudaEventRecord(start, s));
      MOE_CUDA_CHECK(cudaStreamWaitEvent(s2, start, 0));
      gemms(sms);
      MOE_CUDA_CHECK(cudaEventRecord(gemms_done, s));
      MOE_CUDA_CHECK(cudaEventRecord(u0, s2));
      moe::cuda::adamw_apply(ring, cfg, p, g, m, v, b, scalars, false, s2, sms);
      MOE_CUDA_CHECK(cudaEventRecord(u1, s2));
      MOE_CUDA_CHECK(cudaEventSynchronize(gemms_done));
      MOE_CUDA_CHECK(cudaEventSynchronize(u1));
      if (rep > 0) {
        MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, gemms_done));
        with.push_back(ms);
        MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, u0, u1));
        update.push_back(ms);
      }
    }
    const double u = median(update), gbs = moe::adamw_update_bytes(4) * double(kN) / (u * 1e-3) / 1e9;
    std::printf("%-26s | %4d | %9.3f | %8.1f | %14.3f | %15.3f\n", "moments at offsets (ring)", sms, u, gbs,
                median(alone), median(with));
    beside.push_back({{"sms", sms}, {"update_ms", u}, {"update_gb_per_s", gbs}, {"gemms", kGemms},
                      {"gemms_alone_ms", median(alone)}, {"gemms_beside_update_ms", median(with)}});
  }
  for (cudaEvent_t e : {start, gemms_done, u0, u1}) MOE_CUDA_CHECK(cudaEventDestroy(e));
  MOE_CUDA_CHECK(cudaStreamDestroy(s2));
  for (void* ptr : {static_cast<void*>(p), static_cast<void*>(g), static_cast<void*>(m), static_cast<void*>(v),
                    static_cast<void*>(b), static_cast<void*>(scalars), static_cast<void*>(x),
                    static_cast<void*>(w), static_cast<void*>(off), static_cast<void*>(y)})
    MOE_CUDA_CHECK(cudaFree(ptr));
  return {{"solo", out}, {"beside_gemm", beside}};
}

nlohmann::json attention_section(const Args& a, cudaStream_t s) {
  using moe::cuda::AttentionBackend;
  const int64_t B = a.attn_batch, S = a.attn_seq, Hq = a.attn_heads, Hkv = a.attn_kv_heads, D = a.attn_head_dim;
  std::vector<AttentionBackend> backends;
  if ((a.attn_backend == "own" || a.attn_backend == "all") &&
      moe::cuda::attention_supports_head_dim(D, AttentionBackend::kOwn)) {
    backends.push_back(AttentionBackend::kOwn);
  }
  if ((a.attn_backend == "cudnn" || a.attn_backend == "all") && moe::cuda::attention_cudnn_available()) {
    backends.push_back(AttentionBackend::kCudnn);
  }
  std::printf("\nattention (causal) B %lld, S %lld, heads %lld/%lld, hd %lld; %s\n", (long long)B, (long long)S,
              (long long)Hq, (long long)Hkv, (long long)D, moe::cuda::attention_cudnn_version().c_str());
  if (backends.empty()) {
    std::printf("no attention backend to run (--attn-backend %s; own runs hd 64 and 128; cudnn %s)\n",
                a.attn_backend.c_str(), moe::cuda::attention_cudnn_available() ? "built" : "not built");
    return {{"error", "no backend"}};
  }
  const int64_t nq = B * S * Hq * D, nkv = B * S * Hkv * D, nlse = B * Hq * S;
  auto* q = device_random_bf16(nq, "attn_q", 1.f);
  auto* k = device_random_bf16(nkv, "attn_k", 1.f);
  auto* v = device_random_bf16(nkv, "attn_v", 1.f);
  auto* dout = device_random_bf16(nq, "attn_dout", 1.f);
  uint16_t *out = nullptr, *out_own = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;
  float *lse = nullptr, *lse_own = nullptr;
  for (uint16_t** p : {&out, &out_own, &dq}) MOE_CUDA_CHECK(cudaMalloc(p, nq * 2));
  for (uint16_t** p : {&dk, &dv}) MOE_CUDA_CHECK(cudaMalloc(p, nkv * 2));
  for (float** p : {&lse, &lse_own}) MOE_CUDA_CHECK(cudaMalloc(p, nlse * 4));
  const size_t ws_bytes = moe::cuda::attention_backward_workspace_bytes(B, S, Hq);
  void* ws = nullptr;
  MOE_CUDA_CHECK(cudaMalloc(&ws, std::max<size_t>(ws_bytes, 16)));
  // The backward's inputs: one forward's out and lse (the own kernels' when they run, else the
  // first backend's), the same for every backend.
  moe::cuda::attention_forward(q, k, v, out_own, lse_own, B, S, Hq, Hkv, D, s, backends.front());
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));

  const double f_fwd = 4.0 * B * Hq * double(S) * double(S) * D / 2.0, f_bwd = 2.5 * f_fwd;
  std::printf("%-18s | %-7s | %10s | %9s | %s\n", "op", "backend", "us", "TFLOP/s", "diff vs own");
  nlohmann::json results = nlohmann::json::array();
  std::vector<float> ref_out, ref_grads;
  for (AttentionBackend b : backends) {
    const bool own = b == AttentionBackend::kOwn;
    nlohmann::json ws_fields = nlohmann::json::object();
    if (!own) {
      ws_fields = {{"plan_workspace_bytes_forward",
                    moe::cuda::attention_cudnn_prepare(B, S, Hq, Hkv, D, moe::cuda::AttentionDirection::kForward, s)},
                   {"plan_workspace_bytes_backward",
                    moe::cuda::attention_cudnn_prepare(B, S, Hq, Hkv, D, moe::cuda::AttentionDirection::kBackward, s)}};
    }
    struct Run {
      const char* op;
      bool forward;
      double flops;
      std::function<void()> fn;
    };
    const Run runs[] = {
        {"attention forward", true, f_fwd, [&] { moe::cuda::attention_forward(q, k, v, out, lse, B, S, Hq, Hkv, D, s, b); }},
        {"attention backward", false, f_bwd,
         [&] {
           moe::cuda::attention_backward(q, k, v, out_own, lse_own, dout, dq, dk, dv, B, S, Hq, Hkv, D, ws, ws_bytes,
                                         s, b);
         }},
    };
    for (const Run& r : runs) {
      const Timing t = time_ms(a, s, r.fn);
      const bool forward = r.forward;
      // The compared run starts from NaN bytes, so an element a backend skipped shows.
      for (uint16_t* p : {out, dq}) MOE_CUDA_CHECK(cudaMemsetAsync(p, 0xFF, nq * 2, s));
      for (uint16_t* p : {dk, dv}) MOE_CUDA_CHECK(cudaMemsetAsync(p, 0xFF, nkv * 2, s));
      r.fn();
      MOE_CUDA_CHECK(cudaStreamSynchronize(s));
      std::vector<float> got = download(forward ? out : dq, nq, true);
      if (!forward) {
        for (uint16_t* p : {dk, dv}) {
          const std::vector<float> part = download(p, nkv, true);
          got.insert(got.end(), part.begin(), part.end());
        }
      }
      std::vector<float>& ref = forward ? ref_out : ref_grads;
      nlohmann::json diff;
      char diff_text[32] = "-";
      if (own) {
        ref = std::move(got);
        diff = 0.0;
        std::snprintf(diff_text, sizeof(diff_text), "%.3e", 0.0);
      } else if (!ref.empty()) {
        const double d = relative_difference(got, ref);
        diff = d;
        std::snprintf(diff_text, sizeof(diff_text), "%.3e", d);
      }
      const double tflops = r.flops / (t.med_ms * 1e-3) / 1e12;
      std::printf("%-18s | %-7s | %10.1f | %9.1f | %s\n", r.op, moe::cuda::attention_backend_name(b), t.med_ms * 1e3,
                  tflops, diff_text);
      nlohmann::json rec = {{"op", r.op}, {"backend", moe::cuda::attention_backend_name(b)},
                            {"us_median", t.med_ms * 1e3}, {"us_min", t.min_ms * 1e3}, {"us_max", t.max_ms * 1e3},
                            {"tflops", tflops}, {"flops", r.flops}, {"diff_vs_own", diff}};
      rec.update(ws_fields);
      results.push_back(std::move(rec));
    }
  }
  for (void* p : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(dout),
                  static_cast<void*>(out), static_cast<void*>(out_own), static_cast<void*>(dq), static_cast<void*>(dk),
                  static_cast<void*>(dv), static_cast<void*>(lse), static_cast<void*>(lse_own), ws}) {
    cudaFree(p);
  }
  return {{"batch", B}, {"seq", S}, {"q_heads", Hq}, {"kv_heads", Hkv}, {"head_dim", D}, {"causal", true},
          {"flops_forward", "4*B*Hq*S*S*D/2"}, {"flops_backward", "2.5 x forward"},
          {"cudnn", moe::cuda::attention_cudnn_version()}, {"results", results}};
}

}  // namespace

// The fused cross-entropy on one LM-head chunk, in place, at the launcher's block size (threads 0)
// and each power of two from 32 to 512. Each call reads the previous call's dlogits as its logits
// (the step's in-place form; the time does not depend on the values, which stay finite).
nlohmann::json cross_entropy_section(const Args& a, cudaStream_t s) {
  using namespace moe::cuda;
  const int64_t n = a.ce_rows, v = a.vocab;
  uint16_t* logits = device_random_bf16(n * v, "ce_logits", 2.f);
  std::vector<int32_t> targets(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) targets[i] = static_cast<int32_t>(moe::bits_at(11, 5, uint64_t(i)) % uint64_t(v));
  int32_t* d_targets = device_copy(targets);
  float *loss = nullptr, *lse = nullptr;
  uint32_t* bad = nullptr;
  double* loss_sum = nullptr;
  MOE_CUDA_CHECK(cudaMalloc(&loss, n * 4));
  MOE_CUDA_CHECK(cudaMalloc(&lse, n * 4));
  MOE_CUDA_CHECK(cudaMalloc(&bad, 4));
  MOE_CUDA_CHECK(cudaMalloc(&loss_sum, 8));
  MOE_CUDA_CHECK(cudaMemset(bad, 0, 4));
  MOE_CUDA_CHECK(cudaMemset(loss_sum, 0, 8));
  float* grad_scale = device_copy(std::vector<float>{1.0f / static_cast<float>(n)});
  const double bytes = 2.0 * static_cast<double>(n) * static_cast<double>(v) * 2.0;
  cudaDeviceProp prop{};
  MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("cross-entropy on %s: %lld rows x vocab %lld in place (launcher's choice: %d threads a row)\n",
              prop.name, (long long)n, (long long)v, cross_entropy_block_threads(v));
  std::printf("%-8s | %9s | %9s | %9s | %s\n", "threads", "us", "us min", "us max", "TB/s (read + write once)");
  nlohmann::json out = nlohmann::json::array();
  for (const int threads : {0, 32, 64, 128, 256, 512}) {
    const Timing t = time_ms(a, s, [&] {
      cross_entropy_forward_backward(logits, logits, d_targets, loss, lse, n, v, 1e-4, grad_scale, loss_sum, bad, s,
                                     threads);
    });
    const double tbs = bytes / (t.med_ms * 1e-3) / 1e12;
    const int used = threads != 0 ? threads : cross_entropy_block_threads(v);
    const std::string name = threads != 0 ? std::to_string(threads) : "auto " + std::to_string(used);
    std::printf("%-8s | %9.1f | %9.1f | %9.1f | %.2f\n", name.c_str(), t.med_ms * 1e3, t.min_ms * 1e3,
                t.max_ms * 1e3, tbs);
    out.push_back({{"threads", used}, {"launcher_choice", threads == 0}, {"rows", n}, {"vocab", v},
                   {"us_median", t.med_ms * 1e3}, {"us_min", t.min_ms * 1e3}, {"us_max", t.max_ms * 1e3},
                   {"tb_per_s", tbs}, {"bytes", bytes}});
  }
  uint32_t num_bad = 0;
  MOE_CUDA_CHECK(cudaMemcpy(&num_bad, bad, 4, cudaMemcpyDeviceToHost));
  if (num_bad != 0) throw std::runtime_error("cross_entropy bench: targets counted as out of range");
  for (void* p : std::initializer_list<void*>{logits, d_targets, loss, lse, bad, loss_sum, grad_scale})
    MOE_CUDA_CHECK(cudaFree(p));
  return out;
}

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) { std::fprintf(stderr, "error: %s needs a value\n", k.c_str()); std::exit(2); }
      return argv[++i];
    };
    if (k == "--tokens") a.tokens = std::stoll(next());
    else if (k == "--top-k") a.top_k = std::stoll(next());
    else if (k == "--experts") a.experts = std::stoll(next());
    else if (k == "--d-model") a.d_model = std::stoll(next());
    else if (k == "--hidden") a.hidden = std::stoll(next());
    else if (k == "--warmup") a.warmup = std::stoi(next());
    else if (k == "--iters") a.iters = std::stoi(next());
    else if (k == "--backend") a.backend = next();
    else if (k == "--out") a.out = next();
    else if (k == "--ops") a.ops = next();
    else if (k == "--attn-batch") a.attn_batch = std::stoll(next());
    else if (k == "--attn-seq") a.attn_seq = std::stoll(next());
    else if (k == "--attn-heads") a.attn_heads = std::stoll(next());
    else if (k == "--attn-kv-heads") a.attn_kv_heads = std::stoll(next());
    else if (k == "--attn-head-dim") a.attn_head_dim = std::stoll(next());
    else if (k == "--attn-backend") a.attn_backend = next();
    else if (k == "--vocab") a.vocab = std::stoll(next());
    else if (k == "--ce-rows") a.ce_rows = std::stoll(next());
    else { std::fprintf(stderr, "error: unknown argument '%s'\n", k.c_str()); return 2; }
  }
  if (a.ops != "all" && a.ops != "grouped_gemm" && a.ops != "attention" && a.ops != "fp8_gemm" &&
      a.ops != "grouped_fp8" && a.ops != "adamw" && a.ops != "cross_entropy") {
    std::fprintf(stderr,
                 "error: --ops %s: expected all, grouped_gemm, attention, fp8_gemm, grouped_fp8, adamw or "
                 "cross_entropy\n",
                 a.ops.c_str());
    return 2;
  }
  if (a.vocab < 1 || a.ce_rows < 1) {
    std::fprintf(stderr, "error: --vocab %lld --ce-rows %lld: expected both >= 1\n", (long long)a.vocab,
                 (long long)a.ce_rows);
    return 2;
  }
  if (a.attn_backend != "all" && a.attn_backend != "own" && a.attn_backend != "cudnn") {
    std::fprintf(stderr, "error: --attn-backend %s: expected all, own or cudnn\n", a.attn_backend.c_str());
    return 2;
  }
  const bool run_gemm = a.ops != "attention", run_attention = a.ops != "grouped_gemm";
  try {
    if (moe::cuda::cuda_device_count() == 0) {
      std::fprintf(stderr, "error: no CUDA device visible\n");
      return 3;
    }
    const int64_t rows = a.tokens * a.top_k, E = a.experts, D = a.d_model, I = a.hidden;
    // Row counts per expert from a random routing: each (token, slot) picks an expert.
    std::vector<int32_t> counts(E, 0), offsets(E + 1, 0);
    for (int64_t r = 0; r < rows; ++r) counts[moe::bits_at(7, 3, uint64_t(r)) % uint32_t(E)] += 1;
    for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + counts[e];

    cudaStream_t s;
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    if (a.ops == "adamw") {
      const nlohmann::json adamw = adamw_section(a, s);
      if (!a.out.empty())
        std::ofstream(a.out) << nlohmann::json{{"adamw", adamw["solo"]}, {"adamw_beside_gemm", adamw["beside_gemm"]}}
                                    .dump(2)
                             << "\n";
      return 0;
    }
    if (a.ops == "cross_entropy") {
      const nlohmann::json ce = cross_entropy_section(a, s);
      if (!a.out.empty()) std::ofstream(a.out) << nlohmann::json{{"cross_entropy", ce}}.dump(2) << "\n";
      return 0;
    }
    if (a.ops == "fp8_gemm") {
      const nlohmann::json fp8 = fp8_gemm_section(a, s);
      if (!a.out.empty()) std::ofstream(a.out) << nlohmann::json{{"fp8_gemm", fp8}}.dump(2) << "\n";
      return 0;
    }
    auto* x = device_random_bf16(rows * D, "x", 1.f);
    auto* h = device_random_bf16(rows * I, "h", 1.f);
    auto* w_gu = device_random_bf16(E * 2 * I * D, "w_gate_up", 0.02f);
    auto* w_dn = device_random_bf16(E * D * I, "w_down", 0.02f);
    auto* dy_gu = device_random_bf16(rows * 2 * I, "dy_gate_up", 1.f);
    auto* dy_dn = device_random_bf16(rows * D, "dy_down", 1.f);
    auto* off = device_copy(offsets);
    uint16_t *y_gu = nullptr, *y_dn = nullptr, *dx = nullptr;
    float* dw = nullptr;
    MOE_CUDA_CHECK(cudaMalloc(&y_gu, rows * 2 * I * 2));
    MOE_CUDA_CHECK(cudaMalloc(&y_dn, rows * D * 2));
    MOE_CUDA_CHECK(cudaMalloc(&dx, rows * std::max(D, I) * 2));
    MOE_CUDA_CHECK(cudaMalloc(&dw, E * 2 * I * D * 4));
    MOE_CUDA_CHECK(cudaMemset(dw, 0, E * 2 * I * D * 4));

    cudaDeviceProp prop{};
    MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("grouped GEMM on %s: %lld tokens x top-%lld = %lld rows over %lld experts, d_model %lld, hidden %lld\n",
                prop.name, (long long)a.tokens, (long long)a.top_k, (long long)rows, (long long)E, (long long)D,
                (long long)I);
    const double f_gu = 2.0 * rows * (2 * I) * D, f_dn = 2.0 * rows * D * I;
    using namespace moe::cuda;
    std::vector<GroupedGemmBackend> backends;
    if (a.backend == "mma" || a.backend == "all") backends.push_back(GroupedGemmBackend::kMma);
    if ((a.backend == "wgmma" || a.backend == "all") && grouped_gemm_wgmma_available()) {
      backends.push_back(GroupedGemmBackend::kWgmma);
    }
    if (backends.empty()) {
      std::fprintf(stderr, "error: --backend %s: no such backend on this device (mma, wgmma on sm_90, all)\n",
                   a.backend.c_str());
      return 2;
    }
    // One problem: the timed call and an overwrite call whose output the backends' results are
    // compared on. The weight gradients are timed both ways: overwriting (the first micro-batch of
    // a step writes them whole) and accumulating (the later micro-batches, "+="); the "+=" row
    // times the same op as the row before it, whose comparison covers both.
    struct Problem {
      const char* op;
      double flops;
      const void* out;
      int64_t out_count;
      bool bf16;
      std::function<void(GroupedGemmBackend, bool)> run;  // (backend, accumulate: the weight gradients')
      bool accumulate_when_timed = false;
    };
    const auto wgrad_gu = [&](GroupedGemmBackend b, bool acc) {
      grouped_gemm_wgrad(dy_gu, x, off, dw, rows, E, 2 * I, D, acc, s, b);
    };
    const auto wgrad_dn = [&](GroupedGemmBackend b, bool acc) {
      grouped_gemm_wgrad(dy_dn, h, off, dw, rows, E, D, I, acc, s, b);
    };
    // The step's first backward also sums the squares of each 128 x 128 block (the gradient norm's
    // parts); the "sq" rows time that form.
    double* squares = nullptr;
    MOE_CUDA_CHECK(cudaMalloc(&squares, moe::square_blocks(E, 2 * I, D) * sizeof(double)));
    const auto wgrad_gu_sq = [&](GroupedGemmBackend b, bool) {
      grouped_gemm_wgrad(dy_gu, x, off, dw, rows, E, 2 * I, D, false, s, b, squares);
    };
    const auto wgrad_dn_sq = [&](GroupedGemmBackend b, bool) {
      grouped_gemm_wgrad(dy_dn, h, off, dw, rows, E, D, I, false, s, b, squares);
    };
    const std::vector<Problem> problems = {
        {"gate_up forward", f_gu, y_gu, rows * 2 * I, true,
         [&](GroupedGemmBackend b, bool) { grouped_gemm_forward(x, w_gu, off, y_gu, rows, E, 2 * I, D, s, b); }},
        {"gate_up dgrad", f_gu, dx, rows * D, true,
         [&](GroupedGemmBackend b, bool) { grouped_gemm_dgrad(dy_gu, w_gu, off, dx, rows, E, 2 * I, D, s, b); }},
        {"gate_up wgrad", f_gu, dw, E * 2 * I * D, false, wgrad_gu},
        {"gate_up wgrad +=", f_gu, dw, E * 2 * I * D, false, wgrad_gu, true},
        {"gate_up wgrad sq", f_gu, dw, E * 2 * I * D, false, wgrad_gu_sq},
        {"down forward", f_dn, y_dn, rows * D, true,
         [&](GroupedGemmBackend b, bool) { grouped_gemm_forward(h, w_dn, off, y_dn, rows, E, D, I, s, b); }},
        {"down dgrad", f_dn, dx, rows * I, true,
         [&](GroupedGemmBackend b, bool) { grouped_gemm_dgrad(dy_dn, w_dn, off, dx, rows, E, D, I, s, b); }},
        {"down wgrad", f_dn, dw, E * D * I, false, wgrad_dn},
        {"down wgrad +=", f_dn, dw, E * D * I, false, wgrad_dn, true},
        {"down wgrad sq", f_dn, dw, E * D * I, false, wgrad_dn_sq},
    };
    if (a.ops == "grouped_fp8") {
      const nlohmann::json g = grouped_fp8_section(a, s, rows, E, D, I, off, x, h, w_gu, w_dn, dy_gu, dy_dn);
      if (!a.out.empty()) {
        std::ofstream(a.out) << nlohmann::json{{"gpu", prop.name}, {"rows", rows}, {"experts", E}, {"d_model", D},
                                               {"hidden", I}, {"grouped_fp8", g}}.dump(2)
                             << "\n";
      }
      return 0;
    }
    nlohmann::json results = nlohmann::json::array();
    if (run_gemm) {
      std::printf("%-18s | %-7s | %10s | %9s | %s\n", "op", "backend", "us", "TFLOP/s", "diff vs mma");
      for (const Problem& p : problems) {
        std::vector<float> reference;
        for (GroupedGemmBackend b : backends) {
          nlohmann::json r = time_op(p.op, b, p.flops, a, s, [&] { p.run(b, p.accumulate_when_timed); });
          double diff = 0.0;
          if (!p.accumulate_when_timed) {  // a "+=" row is compared in the overwriting row before it
            // The compared run starts from NaN bytes, so an element a backend skipped shows.
            MOE_CUDA_CHECK(cudaMemsetAsync(const_cast<void*>(p.out), 0xFF, p.out_count * (p.bf16 ? 2 : 4), s));
            p.run(b, false);
            MOE_CUDA_CHECK(cudaStreamSynchronize(s));
            std::vector<float> out = download(p.out, p.out_count, p.bf16);
            if (b == GroupedGemmBackend::kMma) {
              reference = std::move(out);
            } else if (!reference.empty()) {
              diff = relative_difference(out, reference);
            }
          }
          r["diff_vs_mma"] = reference.empty() ? nlohmann::json() : nlohmann::json(diff);
          char diff_text[32] = "-";
          if (!reference.empty()) std::snprintf(diff_text, sizeof(diff_text), "%.3e", diff);
          std::printf("%-18s | %-7s | %10.1f | %9.1f | %s\n", p.op, grouped_gemm_backend_name(b),
                      r["us_median"].get<double>(), r["tflops"].get<double>(), diff_text);
          results.push_back(std::move(r));
        }
      }
    }
    nlohmann::json attention;
    if (run_attention) attention = attention_section(a, s);
    if (!a.out.empty()) {
      nlohmann::json rec = {{"gpu", prop.name}, {"tokens", a.tokens}, {"top_k", a.top_k}, {"experts", E},
                            {"d_model", D}, {"hidden", I}, {"rows", rows}, {"counts", counts},
                            {"warmup", a.warmup}, {"iters", a.iters}, {"results", results}};
      if (run_attention) rec["attention"] = attention;
      std::ofstream(a.out) << rec.dump(2) << "\n";
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
