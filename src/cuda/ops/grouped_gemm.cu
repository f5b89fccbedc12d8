// Grouped GEMM launchers and checked entry points. Forward and dgrad launch a persistent grid of
// (multiprocessors x resident CTAs), capped by the static tile bound (ceil(max_rows/128) + E) x
// N-tiles; wgrad launches one CTA per (128 x 128 tile of dw[e], e). Shared memory beyond 48 KiB is
// enabled per launch (host-only attribute calls, legal during stream capture).
#include "cuda/ops/grouped_gemm.h"

#include <algorithm>
#include <limits>

#include "cuda/common.h"
#include "cuda/kernels/grouped_gemm.cuh"
#include "cuda/ops/launch.h"

namespace moe::cuda {
namespace {

using kernels::kGemmBM;
using kernels::kGemmBN;
using kernels::kGemmPipelineBytes;
using kernels::kGemmThreads;
using kernels::Major;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Sizes every entry point shares: E in [1, kGroupedGemmMaxExperts], n and k positive multiples
// of 8 (rows are moved in 16-byte chunks), n, k and max_rows at most 2^30 (the kernels index
// rows and columns in int, with a tile of headroom).
void check_sizes(const char* op, int64_t max_rows, int64_t num_experts, int64_t n, int64_t k) {
  constexpr int64_t kMaxSize = int64_t{1} << 30;
  MOE_CHECK(num_experts >= 1 && num_experts <= kGroupedGemmMaxExperts, op, ": num_experts must be in [1, ",
            kGroupedGemmMaxExperts, "], got ", num_experts);
  MOE_CHECK(n > 0 && n % 8 == 0 && n <= kMaxSize, op, ": n=", n,
            " must be a positive multiple of 8 (rows are read in 16-byte chunks of 8 BF16), at most 2^30");
  MOE_CHECK(k > 0 && k % 8 == 0 && k <= kMaxSize, op, ": k=", k,
            " must be a positive multiple of 8 (rows are read in 16-byte chunks of 8 BF16), at most 2^30");
  MOE_CHECK(max_rows >= 0 && max_rows <= kMaxSize, op, ": max_rows must be in [0, ", kMaxSize, "], got ",
            max_rows);
  MOE_CHECK(n * k <= std::numeric_limits<int64_t>::max() / num_experts, op, ": E x n x k = ", num_experts, " x ", n,
            " x ", k, " elements overflow int64");
}

// Raises the kernel's dynamic shared-memory limit to `smem` and asks for the largest carveout.
template <typename Kernel>
void enable_shared_memory(Kernel kernel, size_t smem) {
  MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  MOE_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
}

// out = a @ B_e per row group; kK: w[e] is [n_out, k_red] (forward), kMN: [k_red, n_out] (dgrad).
template <Major kBMajor>
void launch_m_contiguous(const char* op, const uint16_t* a, const uint16_t* w, const int32_t* expert_offsets,
                         uint16_t* out, int64_t max_rows, int64_t num_experts, int64_t n_out, int64_t k_red,
                         Stream stream) {
  const auto kernel = kernels::grouped_gemm_m_contiguous<kBMajor>;
  const size_t smem = static_cast<size_t>(kGemmPipelineBytes + kernels::m_grouped_schedule_bytes(num_experts));
  enable_shared_memory(kernel, smem);
  int device = 0, num_sms = 0, per_sm = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kGemmThreads, smem));
  MOE_CHECK(per_sm > 0, op, ": no CTA of ", kGemmThreads, " threads with ", smem,
            " bytes of shared memory fits on a multiprocessor of device ", device);
  // Upper bound on tiles for valid offsets: sum_e ceil(rows_e / BM) <= ceil(max_rows / BM) + E.
  const int64_t max_tiles = (ceil_div(max_rows, kGemmBM) + num_experts) * ceil_div(n_out, kGemmBN);
  const int64_t grid = std::min<int64_t>(max_tiles, int64_t{num_sms} * per_sm);
  kernel<<<static_cast<unsigned>(grid), kGemmThreads, smem, stream>>>(
      a, w, expert_offsets, out, static_cast<int>(max_rows), static_cast<int>(num_experts), static_cast<int>(n_out),
      static_cast<int>(k_red));
  check_launch(kBMajor == Major::kK ? "grouped_gemm_m_contiguous<kK>" : "grouped_gemm_m_contiguous<kMN>");
}

}  // namespace

void grouped_gemm_forward(const uint16_t* x, const uint16_t* w, const int32_t* expert_offsets, uint16_t* y,
                          int64_t max_rows, int64_t num_experts, int64_t n, int64_t k, Stream stream) {
  const char* op = "cuda::grouped_gemm_forward";
  check_sizes(op, max_rows, num_experts, n, k);
  if (max_rows == 0) return;
  detail::check_ptrs(op, {{"x", x}, {"w", w}, {"y", y}}, 16);
  detail::check_ptrs(op, {{"expert_offsets", expert_offsets}}, 4);
  launch_m_contiguous<Major::kK>(op, x, w, expert_offsets, y, max_rows, num_experts, n, k, stream);
}

void grouped_gemm_dgrad(const uint16_t* dy, const uint16_t* w, const int32_t* expert_offsets, uint16_t* dx,
                        int64_t max_rows, int64_t num_experts, int64_t n, int64_t k, Stream stream) {
  const char* op = "cuda::grouped_gemm_dgrad";
  check_sizes(op, max_rows, num_experts, n, k);
  if (max_rows == 0) return;
  detail::check_ptrs(op, {{"dy", dy}, {"w", w}, {"dx", dx}}, 16);
  detail::check_ptrs(op, {{"expert_offsets", expert_offsets}}, 4);
  // dx = dy @ w[e]: output width k, reduction over n, w[e] read as [n (reduction), k (output)].
  launch_m_contiguous<Major::kMN>(op, dy, w, expert_offsets, dx, max_rows, num_experts, k, n, stream);
}

void grouped_gemm_wgrad(const uint16_t* dy, const uint16_t* x, const int32_t* expert_offsets, float* dw,
                        int64_t max_rows, int64_t num_experts, int64_t n, int64_t k, bool accumulate,
                        Stream stream) {
  const char* op = "cuda::grouped_gemm_wgrad";
  check_sizes(op, max_rows, num_experts, n, k);
  if (max_rows == 0) {
    // Every expert has zero rows: accumulate leaves dw alone, overwrite zeroes it.
    if (accumulate) return;
    detail::check_ptrs(op, {{"dw", dw}}, 16);
    MOE_CUDA_CHECK(cudaMemsetAsync(dw, 0, static_cast<size_t>(num_experts * n * k) * sizeof(float), stream));
    return;
  }
  detail::check_ptrs(op, {{"dy", dy}, {"x", x}}, 16);
  detail::check_ptrs(op, {{"dw", dw}}, 16);
  detail::check_ptrs(op, {{"expert_offsets", expert_offsets}}, 4);
  const int64_t tiles = ceil_div(n, kGemmBM) * ceil_div(k, kGemmBN);
  MOE_CHECK(tiles <= detail::kMaxGridX, op, ": n=", n, " x k=", k, " needs ", tiles, " tiles of ", kGemmBM, "x",
            kGemmBN, ", more than the supported ", detail::kMaxGridX);
  const auto kernel = kernels::grouped_gemm_k_contiguous;
  const size_t smem = static_cast<size_t>(kGemmPipelineBytes);
  enable_shared_memory(kernel, smem);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(num_experts));
  kernel<<<grid, kGemmThreads, smem, stream>>>(dy, x, expert_offsets, dw, static_cast<int>(max_rows),
                                               static_cast<int>(n), static_cast<int>(k), accumulate);
  check_launch("grouped_gemm_k_contiguous");
}

}  // namespace moe::cuda
