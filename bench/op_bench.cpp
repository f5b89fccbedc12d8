// moecore_op_bench: CUDA op micro-benchmarks. Grouped GEMM of the MoE experts (forward,
// dgrad, wgrad) on a model's expert shapes, rows spread over experts by a random top-k
// routing, for each grouped-GEMM backend the device runs (mma everywhere, wgmma on sm_90).
// Random BF16 data (never zeros), inputs larger than L2, warm-up, CUDA events, median/min/max.
// Prints `op | backend | us | TFLOP/s | diff`, diff = ||out - out_mma|| / ||out_mma|| of one
// overwrite run of each backend (0 for mma itself), and writes one JSON file.
// usage: moecore_op_bench [--tokens T] [--top-k K] [--experts E] [--d-model D] [--hidden I]
//                         [--warmup N] [--iters N] [--backend mma|wgmma|all] [--out FILE.json]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/rng.h"
#include "cuda/common.h"
#include "cuda/ops/grouped_gemm.h"

namespace {

struct Args {
  int64_t tokens = 16384, top_k = 8, experts = 64, d_model = 2048, hidden = 1024;
  int warmup = 5, iters = 20;
  std::string backend = "all";
  std::string out;
};

using moe::cuda::GroupedGemmBackend;

template <typename T>
T* device_copy(const std::vector<T>& h) {
  T* d = nullptr;
  MOE_CUDA_CHECK(cudaMalloc(&d, h.size() * sizeof(T)));
  MOE_CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

std::vector<uint16_t> random_bf16(int64_t n, const char* name, float scale) {
  std::vector<float> f(n);
  moe::fill_normal(f.data(), n, 0, 1234, name, scale);
  std::vector<uint16_t> b(n);
  for (int64_t i = 0; i < n; ++i) b[i] = moe::f32_to_bf16(f[i]);
  return b;
}

template <typename F>
nlohmann::json time_op(const std::string& op, GroupedGemmBackend backend, double flops, const Args& a,
                       cudaStream_t s, F&& fn) {
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
  const double med = ms[ms.size() / 2];
  const double tflops = flops / (med * 1e-3) / 1e12;
  return {{"op", op}, {"backend", moe::cuda::grouped_gemm_backend_name(backend)}, {"us_median", med * 1e3},
          {"us_min", ms.front() * 1e3}, {"us_max", ms.back() * 1e3}, {"tflops", tflops}, {"flops", flops}};
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

}  // namespace

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
    else { std::fprintf(stderr, "error: unknown argument '%s'\n", k.c_str()); return 2; }
  }
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
    auto* x = device_copy(random_bf16(rows * D, "x", 1.f));
    auto* h = device_copy(random_bf16(rows * I, "h", 1.f));
    auto* w_gu = device_copy(random_bf16(E * 2 * I * D, "w_gate_up", 0.02f));
    auto* w_dn = device_copy(random_bf16(E * D * I, "w_down", 0.02f));
    auto* dy_gu = device_copy(random_bf16(rows * 2 * I, "dy_gate_up", 1.f));
    auto* dy_dn = device_copy(random_bf16(rows * D, "dy_down", 1.f));
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
    // One problem: the timed call (wgrad accumulates, as in training) and an overwrite call whose
    // output the backends' results are compared on.
    struct Problem {
      const char* op;
      double flops;
      const void* out;
      int64_t out_count;
      bool bf16;
      std::function<void(GroupedGemmBackend, bool)> run;  // (backend, timed)
    };
    const std::vector<Problem> problems = {
        {"gate_up forward", f_gu, y_gu, rows * 2 * I, true,
         [&](GroupedGemmBackend b, bool) { grouped_gemm_forward(x, w_gu, off, y_gu, rows, E, 2 * I, D, s, b); }},
        {"gate_up dgrad", f_gu, dx, rows * D, true,
         [&](GroupedGemmBackend b, bool) { grouped_gemm_dgrad(dy_gu, w_gu, off, dx, rows, E, 2 * I, D, s, b); }},
        {"gate_up wgrad", f_gu, dw, E * 2 * I * D, false,
         [&](GroupedGemmBackend b, bool timed) {
           grouped_gemm_wgrad(dy_gu, x, off, dw, rows, E, 2 * I, D, timed, s, b);
         }},
        {"down forward", f_dn, y_dn, rows * D, true,
         [&](GroupedGemmBackend b, bool) { grouped_gemm_forward(h, w_dn, off, y_dn, rows, E, D, I, s, b); }},
        {"down dgrad", f_dn, dx, rows * I, true,
         [&](GroupedGemmBackend b, bool) { grouped_gemm_dgrad(dy_dn, w_dn, off, dx, rows, E, D, I, s, b); }},
        {"down wgrad", f_dn, dw, E * D * I, false,
         [&](GroupedGemmBackend b, bool timed) { grouped_gemm_wgrad(dy_dn, h, off, dw, rows, E, D, I, timed, s, b); }},
    };
    std::printf("%-18s | %-7s | %10s | %9s | %s\n", "op", "backend", "us", "TFLOP/s", "diff vs mma");
    nlohmann::json results = nlohmann::json::array();
    for (const Problem& p : problems) {
      std::vector<float> reference;
      for (GroupedGemmBackend b : backends) {
        nlohmann::json r = time_op(p.op, b, p.flops, a, s, [&] { p.run(b, true); });
        // The compared run starts from NaN bytes, so an element a backend skipped shows.
        MOE_CUDA_CHECK(cudaMemsetAsync(const_cast<void*>(p.out), 0xFF, p.out_count * (p.bf16 ? 2 : 4), s));
        p.run(b, false);
        MOE_CUDA_CHECK(cudaStreamSynchronize(s));
        std::vector<float> out = download(p.out, p.out_count, p.bf16);
        double diff = 0.0;
        if (b == GroupedGemmBackend::kMma) {
          reference = std::move(out);
        } else if (!reference.empty()) {
          diff = relative_difference(out, reference);
        }
        r["diff_vs_mma"] = reference.empty() ? nlohmann::json() : nlohmann::json(diff);
        char diff_text[32] = "-";
        if (!reference.empty()) std::snprintf(diff_text, sizeof(diff_text), "%.3e", diff);
        std::printf("%-18s | %-7s | %10.1f | %9.1f | %s\n", p.op, grouped_gemm_backend_name(b),
                    r["us_median"].get<double>(), r["tflops"].get<double>(), diff_text);
        results.push_back(std::move(r));
      }
    }
    if (!a.out.empty()) {
      nlohmann::json rec = {{"gpu", prop.name}, {"tokens", a.tokens}, {"top_k", a.top_k}, {"experts", E},
                            {"d_model", D}, {"hidden", I}, {"rows", rows}, {"counts", counts},
                            {"warmup", a.warmup}, {"iters", a.iters}, {"results", results}};
      std::ofstream(a.out) << rec.dump(2) << "\n";
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
