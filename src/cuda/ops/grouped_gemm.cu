// Grouped GEMM launchers and checked entry points, two backends. mma: forward and dgrad launch a
// persistent grid of (multiprocessors x resident CTAs), capped by the static tile bound
// (ceil(max_rows/128) + E) x N-tiles; wgrad launches one CTA per (128 x 128 tile of dw[e], e).
// wgmma (sm_90): one CTA per multiprocessor, capped by the same kind of bound on 128 x 256 tiles;
// TMA tensor maps are encoded on the host per call from pointers and static sizes (the driver's
// encoder is reached through the runtime's entry-point query, so nothing links libcuda). Shared
// memory beyond 48 KiB is enabled per launch (host-only attribute calls, legal during capture).
#include "cuda/ops/grouped_gemm.h"

#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>

#include "core/env_choice.h"
#include "cuda/common.h"
#include "cuda/kernels/grouped_gemm.cuh"
#include "cuda/kernels/grouped_gemm_fp8_sm90.cuh"
#include "cuda/kernels/grouped_gemm_sm90.cuh"
#include "cuda/ops/launch.h"
#include "cuda/sm_reserve.h"

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
  set_dynamic_smem_limit(kernel, smem);
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
  const int64_t grid = std::min<int64_t>(max_tiles, int64_t{gemm_sms(num_sms)} * per_sm);
  kernel<<<static_cast<unsigned>(grid), kGemmThreads, smem, stream>>>(
      a, w, expert_offsets, out, static_cast<int>(max_rows), static_cast<int>(num_experts), static_cast<int>(n_out),
      static_cast<int>(k_red));
  check_launch(kBMajor == Major::kK ? "grouped_gemm_m_contiguous<kK>" : "grouped_gemm_m_contiguous<kMN>");
}


// ---- wgmma backend (sm_90) -------------------------------------------------------------------

int current_device() {
  int device = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

int multiprocessor_count(int device) {
  int num_sms = 0;
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  return num_sms;
}

bool device_is_sm90(int device, int& major, int& minor) {
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0;
}

// The driver's cuTensorMapEncodeTiled (CUDA 12.0 ABI), looked up once through the runtime.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    MOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    MOE_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
              "grouped_gemm: the CUDA driver does not provide cuTensorMapEncodeTiled (query result ",
              static_cast<int>(found), "); the wgmma backend needs a driver for CUDA 12.0 or newer");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A tensor map with 128-byte swizzle over a row-major BF16 or FP32 tensor: dims and box innermost
// first (elements), strides of the outer dimensions in bytes; out-of-bounds elements load as zeros
// and are skipped by stores.
CUtensorMap tensor_map(const char* op, const char* operand, CUtensorMapDataType dtype, const void* base,
                       std::initializer_list<uint64_t> dims, std::initializer_list<uint64_t> strides,
                       std::initializer_list<uint32_t> box) {
  const auto rank = static_cast<cuuint32_t>(dims.size());
  cuuint64_t global_dim[3] = {}, global_strides[2] = {};
  cuuint32_t box_dim[3] = {}, element_strides[3] = {1, 1, 1};
  std::copy(dims.begin(), dims.end(), global_dim);
  std::copy(strides.begin(), strides.end(), global_strides);
  std::copy(box.begin(), box.end(), box_dim);
  CUtensorMap map;
  std::memset(&map, 0, sizeof(map));
  const CUresult r = tensor_map_encoder()(&map, dtype, rank, const_cast<void*>(base), global_dim, global_strides,
                                          box_dim, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOE_CHECK(r == CUDA_SUCCESS, op, ": cuTensorMapEncodeTiled failed for operand '", operand, "' (CUresult ",
            static_cast<int>(r), ", dims ", global_dim[0], " x ", global_dim[1], " x ", global_dim[2], ")");
  return map;
}

constexpr CUtensorMapDataType kMapBf16 = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
constexpr CUtensorMapDataType kMapF32 = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
constexpr CUtensorMapDataType kMapU8 = CU_TENSOR_MAP_DATA_TYPE_UINT8;

int max_shared_memory_per_block(int device) {
  int bytes = 0;
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return bytes;
}

// The wgmma kernels keep 1 CTA on each multiprocessor (of those a reserve leaves them,
// cuda/sm_reserve.h); checks that it fits.
template <typename Kernel>
int sm90_grid(const char* op, Kernel kernel, size_t smem, int64_t max_tiles) {
  enable_shared_memory(kernel, smem);
  const int device = current_device();
  int per_sm = 0;
  MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kernels::sm90::kThreads, smem));
  MOE_CHECK(per_sm > 0, op, ": no CTA of ", kernels::sm90::kThreads, " threads with ", smem,
            " bytes of shared memory fits on a multiprocessor of device ", device);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_tiles, gemm_sms(multiprocessor_count(device)))));
}

template <bool kBMn, int kStages>
void launch_m_contiguous_sm90_stages(const CUtensorMap& map_a, const CUtensorMap& map_b, const CUtensorMap& map_out,
                                     const char* op, const int32_t* expert_offsets, uint16_t* out, int64_t max_rows,
                                     int64_t num_experts, int64_t n_out, int64_t k_red, Stream stream) {
  namespace k90 = kernels::sm90;
  const auto kernel = k90::grouped_gemm_m_contiguous_sm90<kBMn, kStages>;
  const size_t smem = static_cast<size_t>(k90::smem_bytes(kStages, num_experts, true));
  const int64_t max_tiles = (ceil_div(max_rows, k90::kBM) + num_experts) * ceil_div(n_out, k90::kBN);
  const int grid = sm90_grid(op, kernel, smem, max_tiles);
  kernel<<<grid, k90::kThreads, smem, stream>>>(map_a, map_b, map_out, expert_offsets, out,
                                                static_cast<int>(max_rows), static_cast<int>(num_experts),
                                                static_cast<int>(n_out), static_cast<int>(k_red));
  check_launch(kBMn ? "grouped_gemm_m_contiguous_sm90<MN>" : "grouped_gemm_m_contiguous_sm90<K>");
}

// out = a @ B_e per row group on the wgmma kernels; kBMn as launch_m_contiguous's kMN (dgrad).
// A 4-stage ring when the schedule of E experts fits beside it (E <= 247 on an H100/H200), else 3.
template <bool kBMn>
void launch_m_contiguous_sm90(const char* op, const uint16_t* a, const uint16_t* w, const int32_t* expert_offsets,
                              uint16_t* out, int64_t max_rows, int64_t num_experts, int64_t n_out, int64_t k_red,
                              Stream stream) {
  namespace k90 = kernels::sm90;
  const auto u64 = [](int64_t v) { return static_cast<uint64_t>(v); };
  const CUtensorMap map_a = tensor_map(op, kBMn ? "dy" : "x", kMapBf16, a, {u64(k_red), u64(max_rows)},
                                       {u64(k_red * 2)}, {64, k90::kBM});
  // w[e] is [n_out, k_red] (forward, B K-major: boxes of kBN rows of 64 k) or [k_red, n_out]
  // (dgrad, B MN-major: boxes of 64 k rows of 64 columns).
  const CUtensorMap map_b =
      kBMn ? tensor_map(op, "w", kMapBf16, w, {u64(n_out), u64(k_red), u64(num_experts)},
                        {u64(n_out * 2), u64(n_out * k_red * 2)}, {64, 64, 1})
           : tensor_map(op, "w", kMapBf16, w, {u64(k_red), u64(n_out), u64(num_experts)},
                        {u64(k_red * 2), u64(n_out * k_red * 2)}, {64, k90::kBN, 1});
  const CUtensorMap map_out = tensor_map(op, kBMn ? "dx" : "y", kMapBf16, out, {u64(n_out), u64(max_rows)},
                                         {u64(n_out * 2)}, {64, 64});
  const int limit = max_shared_memory_per_block(current_device());
  if (k90::smem_bytes(4, num_experts, true) <= limit) {
    launch_m_contiguous_sm90_stages<kBMn, 4>(map_a, map_b, map_out, op, expert_offsets, out, max_rows, num_experts,
                                             n_out, k_red, stream);
  } else {
    MOE_CHECK(k90::smem_bytes(3, num_experts, true) <= limit, op, ": the wgmma schedule of ", num_experts,
              " experts needs ", k90::smem_bytes(3, num_experts, true), " bytes of shared memory, the device has ",
              limit);
    launch_m_contiguous_sm90_stages<kBMn, 3>(map_a, map_b, map_out, op, expert_offsets, out, max_rows, num_experts,
                                             n_out, k_red, stream);
  }
}

template <int kStages>
void launch_fp8_m_contiguous_sm90_stages(const CUtensorMap& map_a, const CUtensorMap& map_b,
                                         const CUtensorMap& map_out, const char* op, const int32_t* expert_offsets,
                                         const float* sa, const float* sb, uint16_t* out, int64_t max_rows,
                                         int64_t num_experts, int64_t n_out, int64_t k_red, Stream stream) {
  namespace k90 = kernels::sm90;
  const auto kernel = k90::grouped_gemm_fp8_m_contiguous_sm90<kStages>;
  const size_t smem = static_cast<size_t>(k90::smem_bytes(kStages, num_experts, true, k90::kFp8StageBytes));
  const int64_t max_tiles = (ceil_div(max_rows, k90::kBM) + num_experts) * ceil_div(n_out, k90::kFp8BN);
  const int grid = sm90_grid(op, kernel, smem, max_tiles);
  kernel<<<grid, k90::kThreads, smem, stream>>>(map_a, map_b, map_out, expert_offsets, sa, sb, out,
                                                static_cast<int>(max_rows), static_cast<int>(num_experts),
                                                static_cast<int>(n_out), static_cast<int>(k_red));
  check_launch("grouped_gemm_fp8_m_contiguous_sm90");
}

void launch_k_contiguous_sm90(const char* op, const uint16_t* dy, const uint16_t* x, const int32_t* expert_offsets,
                              float* dw, int64_t max_rows, int64_t num_experts, int64_t n, int64_t k, bool accumulate,
                              double* squares, Stream stream) {
  namespace k90 = kernels::sm90;
  const auto u64 = [](int64_t v) { return static_cast<uint64_t>(v); };
  const CUtensorMap map_a = tensor_map(op, "dy", kMapBf16, dy, {u64(n), u64(max_rows)}, {u64(n * 2)}, {64, 64});
  const CUtensorMap map_b = tensor_map(op, "x", kMapBf16, x, {u64(k), u64(max_rows)}, {u64(k * 2)}, {64, 64});
  const CUtensorMap map_dw = tensor_map(op, "dw", kMapF32, dw, {u64(k), u64(n), u64(num_experts)},
                                        {u64(k * 4), u64(n * k * 4)}, {32, 64, 1});
  const bool sums = squares != nullptr;
  const auto kernel = sums ? k90::grouped_gemm_k_contiguous_sm90<true> : k90::grouped_gemm_k_contiguous_sm90<false>;
  const size_t smem = static_cast<size_t>(k90::smem_bytes(4, num_experts, false) + (sums ? k90::kSquareSumBytes : 0));
  const int64_t per_expert = ceil_div(n, k90::kBM) * ceil_div(k, k90::kBN);
  const int grid = wgrad_grid(sm90_grid(op, kernel, smem, num_experts * per_expert), per_expert);
  kernel<<<grid, k90::kThreads, smem, stream>>>(map_a, map_b, map_dw, expert_offsets, dw, static_cast<int>(max_rows),
                                                static_cast<int>(num_experts), static_cast<int>(n),
                                                static_cast<int>(k), accumulate, squares);
  check_launch("grouped_gemm_k_contiguous_sm90");
}

// MOECORE_GROUPED_GEMM: unset or empty -> kAuto; "mma" / "wgmma"; anything else is refused.
GroupedGemmBackend backend_from_environment() {
  switch (env_choice("MOECORE_GROUPED_GEMM", {"mma", "wgmma"})) {
    case 1:
      return GroupedGemmBackend::kMma;
    case 2:
      return GroupedGemmBackend::kWgmma;
    default:
      return GroupedGemmBackend::kAuto;
  }
}

}  // namespace

const char* grouped_gemm_backend_name(GroupedGemmBackend backend) {
  switch (backend) {
    case GroupedGemmBackend::kAuto:
      return "auto";
    case GroupedGemmBackend::kMma:
      return "mma";
    case GroupedGemmBackend::kWgmma:
      return "wgmma";
  }
  return "unknown";
}

bool grouped_gemm_wgmma_available() {
  if (cuda_device_count() == 0) return false;
  int major = 0, minor = 0;
  return device_is_sm90(current_device(), major, minor);
}

GroupedGemmBackend grouped_gemm_resolve_backend(GroupedGemmBackend requested) {
  const bool from_env = requested == GroupedGemmBackend::kAuto;
  if (from_env) requested = backend_from_environment();
  const int device = current_device();
  int major = 0, minor = 0;
  const bool sm90 = device_is_sm90(device, major, minor);
  if (requested == GroupedGemmBackend::kAuto) return sm90 ? GroupedGemmBackend::kWgmma : GroupedGemmBackend::kMma;
  MOE_CHECK(requested != GroupedGemmBackend::kWgmma || sm90, "grouped_gemm: the wgmma backend",
            from_env ? " (MOECORE_GROUPED_GEMM=wgmma)" : "", " needs a compute capability 9.0 device, device ", device,
            " is ", major, ".", minor, "; use the mma backend");
  return requested;
}

void grouped_gemm_forward(const uint16_t* x, const uint16_t* w, const int32_t* expert_offsets, uint16_t* y,
                          int64_t max_rows, int64_t num_experts, int64_t n, int64_t k, Stream stream,
                          GroupedGemmBackend backend) {
  const char* op = "cuda::grouped_gemm_forward";
  check_sizes(op, max_rows, num_experts, n, k);
  if (max_rows == 0) return;
  detail::check_ptrs(op, {{"x", x}, {"w", w}, {"y", y}}, 16);
  detail::check_ptrs(op, {{"expert_offsets", expert_offsets}}, 4);
  if (grouped_gemm_resolve_backend(backend) == GroupedGemmBackend::kWgmma) {
    launch_m_contiguous_sm90<false>(op, x, w, expert_offsets, y, max_rows, num_experts, n, k, stream);
  } else {
    launch_m_contiguous<Major::kK>(op, x, w, expert_offsets, y, max_rows, num_experts, n, k, stream);
  }
}

void grouped_gemm_dgrad(const uint16_t* dy, const uint16_t* w, const int32_t* expert_offsets, uint16_t* dx,
                        int64_t max_rows, int64_t num_experts, int64_t n, int64_t k, Stream stream,
                        GroupedGemmBackend backend) {
  const char* op = "cuda::grouped_gemm_dgrad";
  check_sizes(op, max_rows, num_experts, n, k);
  if (max_rows == 0) return;
  detail::check_ptrs(op, {{"dy", dy}, {"w", w}, {"dx", dx}}, 16);
  detail::check_ptrs(op, {{"expert_offsets", expert_offsets}}, 4);
  // dx = dy @ w[e]: output width k, reduction over n, w[e] read as [n (reduction), k (output)].
  if (grouped_gemm_resolve_backend(backend) == GroupedGemmBackend::kWgmma) {
    launch_m_contiguous_sm90<true>(op, dy, w, expert_offsets, dx, max_rows, num_experts, k, n, stream);
  } else {
    launch_m_contiguous<Major::kMN>(op, dy, w, expert_offsets, dx, max_rows, num_experts, k, n, stream);
  }
}

int wgrad_grid(int grid, int64_t tiles_per_expert) {
  MOE_CHECK(grid >= 1 && tiles_per_expert >= 1, "cuda::wgrad_grid: grid (", grid, ") and tiles_per_expert (",
            tiles_per_expert, ") must be >= 1");
  int64_t whole = 0;  // a multiple of tiles_per_expert, or a divisor of it, <= grid
  if (tiles_per_expert <= grid) {
    whole = grid - grid % tiles_per_expert;
  } else {
    for (int64_t g = grid; g >= 1 && whole == 0; --g) whole = tiles_per_expert % g == 0 ? g : 0;
  }
  return 20 * whole >= 19 * int64_t{grid} ? static_cast<int>(whole) : grid;
}

void grouped_gemm_wgrad(const uint16_t* dy, const uint16_t* x, const int32_t* expert_offsets, float* dw,
                        int64_t max_rows, int64_t num_experts, int64_t n, int64_t k, bool accumulate,
                        Stream stream, GroupedGemmBackend backend, double* squares) {
  const char* op = "cuda::grouped_gemm_wgrad";
  check_sizes(op, max_rows, num_experts, n, k);
  MOE_CHECK(squares == nullptr || !accumulate, op, ": square sums are of the gradient this call writes; with ",
            "accumulate they would miss what dw held, so pass squares = null");
  if (squares != nullptr) detail::check_ptrs(op, {{"squares", squares}}, sizeof(double));
  if (max_rows == 0) {
    // Every expert has zero rows: accumulate leaves dw alone, overwrite zeroes it (and its sums).
    if (accumulate) return;
    detail::check_ptrs(op, {{"dw", dw}}, 16);
    MOE_CUDA_CHECK(cudaMemsetAsync(dw, 0, static_cast<size_t>(num_experts * n * k) * sizeof(float), stream));
    if (squares != nullptr)  // FP64 +0.0 is all zero bytes
      MOE_CUDA_CHECK(cudaMemsetAsync(squares, 0, static_cast<size_t>(square_blocks(num_experts, n, k)) *
                                                     sizeof(double), stream));
    return;
  }
  detail::check_ptrs(op, {{"dy", dy}, {"x", x}}, 16);
  detail::check_ptrs(op, {{"dw", dw}}, 16);
  detail::check_ptrs(op, {{"expert_offsets", expert_offsets}}, 4);
  if (grouped_gemm_resolve_backend(backend) == GroupedGemmBackend::kWgmma) {
    launch_k_contiguous_sm90(op, dy, x, expert_offsets, dw, max_rows, num_experts, n, k, accumulate, squares, stream);
    return;
  }
  const int64_t tiles = ceil_div(n, kGemmBM) * ceil_div(k, kGemmBN);
  MOE_CHECK(tiles <= detail::kMaxGridX, op, ": n=", n, " x k=", k, " needs ", tiles, " tiles of ", kGemmBM, "x",
            kGemmBN, ", more than the supported ", detail::kMaxGridX);
  const auto kernel =
      squares != nullptr ? kernels::grouped_gemm_k_contiguous<true> : kernels::grouped_gemm_k_contiguous<false>;
  const size_t smem = static_cast<size_t>(kGemmPipelineBytes);
  enable_shared_memory(kernel, smem);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(num_experts));
  kernel<<<grid, kGemmThreads, smem, stream>>>(dy, x, expert_offsets, dw, static_cast<int>(max_rows),
                                               static_cast<int>(n), static_cast<int>(k), accumulate, squares);
  check_launch("grouped_gemm_k_contiguous");
}

void grouped_gemm_fp8(const uint8_t* qa, const float* sa, const uint8_t* qb, const float* sb,
                      const int32_t* expert_offsets, uint16_t* out, int64_t max_rows, int64_t num_experts, int64_t n,
                      int64_t k, Stream stream) {
  const char* op = "cuda::grouped_gemm_fp8";
  check_sizes(op, max_rows, num_experts, n, k);
  MOE_CHECK(k % 16 == 0, op, ": k=", k, " must be a multiple of 16 (rows of FP8 codes are read in 16-byte chunks)");
  if (max_rows == 0) return;
  int major = 0, minor = 0;
  MOE_CHECK(device_is_sm90(current_device(), major, minor), op, ": the FP8 grouped GEMM runs on wgmma and needs a ",
            "compute capability 9.0 device, this one is ", major, ".", minor);
  detail::check_ptrs(op, {{"qa", qa}, {"qb", qb}, {"out", out}}, 16);
  detail::check_ptrs(op, {{"sa", sa}, {"sb", sb}, {"expert_offsets", expert_offsets}}, 4);
  namespace k90 = kernels::sm90;
  const auto u64 = [](int64_t v) { return static_cast<uint64_t>(v); };
  const CUtensorMap map_a = tensor_map(op, "qa", kMapU8, qa, {u64(k), u64(max_rows)}, {u64(k)},
                                       {k90::kFp8BK, k90::kBM});
  const CUtensorMap map_b = tensor_map(op, "qb", kMapU8, qb, {u64(k), u64(n), u64(num_experts)},
                                       {u64(k), u64(n * k)}, {k90::kFp8BK, k90::kFp8BN, 1});
  const CUtensorMap map_out = tensor_map(op, "out", kMapBf16, out, {u64(n), u64(max_rows)}, {u64(n * 2)}, {64, 64});
  const int limit = max_shared_memory_per_block(current_device());
  if (k90::smem_bytes(5, num_experts, true, k90::kFp8StageBytes) <= limit) {
    launch_fp8_m_contiguous_sm90_stages<5>(map_a, map_b, map_out, op, expert_offsets, sa, sb, out, max_rows,
                                           num_experts, n, k, stream);
  } else {
    MOE_CHECK(k90::smem_bytes(3, num_experts, true, k90::kFp8StageBytes) <= limit, op, ": the schedule of ",
              num_experts, " experts needs ", k90::smem_bytes(3, num_experts, true, k90::kFp8StageBytes),
              " bytes of shared memory, the device has ", limit);
    launch_fp8_m_contiguous_sm90_stages<3>(map_a, map_b, map_out, op, expert_offsets, sa, sb, out, max_rows,
                                           num_experts, n, k, stream);
  }
}

void grouped_gemm_fp8_wgrad(const uint8_t* qa_t, const float* sa_t, const uint8_t* qb_t, const float* sb_t,
                            const int32_t* padded_offsets, float* dw, int64_t num_experts, int64_t n, int64_t k,
                            int64_t capacity, bool accumulate, Stream stream) {
  const char* op = "cuda::grouped_gemm_fp8_wgrad";
  MOE_CHECK(num_experts > 0 && num_experts <= kGroupedGemmMaxExperts, op, ": num_experts=", num_experts,
            " must be in [1, ", kGroupedGemmMaxExperts, "]");
  MOE_CHECK(n > 0 && k > 0 && n % 128 == 0 && k % 128 == 0, op, ": n=", n, " and k=", k,
            " must be positive multiples of 128");
  MOE_CHECK(capacity > 0 && capacity % 16 == 0, op, ": capacity=", capacity, " must be a positive multiple of 16");
  MOE_CHECK(num_experts * (n / 128) * (k / 128) <= std::numeric_limits<int32_t>::max(), op, ": ", num_experts,
            " experts of ", n, " x ", k, " are too many tiles");
  int major = 0, minor = 0;
  MOE_CHECK(device_is_sm90(current_device(), major, minor), op, ": the FP8 grouped GEMM runs on wgmma and needs a ",
            "compute capability 9.0 device, this one is ", major, ".", minor);
  detail::check_ptrs(op, {{"qa_t", qa_t}, {"qb_t", qb_t}, {"dw", dw}, {"sa_t", sa_t}, {"sb_t", sb_t}}, 16);
  detail::check_ptrs(op, {{"padded_offsets", padded_offsets}}, 4);
  namespace k90 = kernels::sm90;
  const auto u64 = [](int64_t v) { return static_cast<uint64_t>(v); };
  const CUtensorMap map_a =
      tensor_map(op, "qa_t", kMapU8, qa_t, {u64(capacity), u64(n)}, {u64(capacity)}, {k90::kFp8BK, 128});
  const CUtensorMap map_b =
      tensor_map(op, "qb_t", kMapU8, qb_t, {u64(capacity), u64(k)}, {u64(capacity)}, {k90::kFp8BK, 128});
  constexpr int kStages = 5;
  const auto kernel = k90::grouped_gemm_fp8_wgrad_sm90<kStages>;
  const size_t smem = static_cast<size_t>(k90::smem_bytes(kStages, 0, false, k90::kFp8WgradStageBytes));
  MOE_CHECK(static_cast<int64_t>(smem) <= max_shared_memory_per_block(current_device()), op, ": ", smem,
            " bytes of shared memory do not fit the device's ", max_shared_memory_per_block(current_device()));
  const int grid = sm90_grid(op, kernel, smem, num_experts * (n / 128) * (k / 128));
  kernel<<<grid, k90::kThreads, smem, stream>>>(map_a, map_b, sa_t, sb_t, padded_offsets, dw,
                                                static_cast<int>(num_experts), static_cast<int>(n),
                                                static_cast<int>(k), accumulate);
  check_launch("grouped_gemm_fp8_wgrad_sm90");
}

}  // namespace moe::cuda
