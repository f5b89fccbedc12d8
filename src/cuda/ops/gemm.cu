// cuBLASLt GEMM behind checked entry points. Row-major C = op(A) @ op(B) is column-major
// C^T = op(B)^T @ op(A)^T, so cuBLASLt's first operand is our B and its second our A, each with the
// same transpose flag and leading dimension, and C^T is [n, m] with leading dim ldc. A plan per
// problem (descriptors, layouts, the heuristic's first algorithm) is built once and cached; a
// reserve of multiprocessors (cuda/sm_reserve.h) is part of the problem: its plans target the rest.
#include "cuda/ops/gemm.h"

#include <algorithm>
#include <compare>
#include <limits>
#include <map>
#include <string>

#include "cuda/common.h"
#include "cuda/kernels/gemm.cuh"
#include "cuda/ops/fp8.h"
#include "cuda/ops/launch.h"
#include "cuda/sm_reserve.h"

namespace moe::cuda {
namespace detail {

constexpr uint32_t kMaxAlignBytes = 256;  // cuBLASLt's default (and largest useful) alignment preference
constexpr int kScaleThreads = 256;
constexpr int64_t kScaleMaxBlocks = 4096;

// Everything a plan depends on. Alignments are the largest power of two (<= 256) dividing every
// address cuBLASLt will see for that operand, so a plan is only reused for pointers at least as aligned.
struct GemmKey {
  int64_t m, n, k, lda, ldb, ldc, stride_a, stride_b, stride_c, batch;
  bool trans_a, trans_b, c_f32;
  uint32_t align_a, align_b, align_c;
  int32_t sm_target;  // CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, 0: all the device's (cuda/sm_reserve.h)
  auto operator<=>(const GemmKey&) const = default;
};

std::string describe(const GemmKey& g) {
  std::string s = ::moe::detail::concat("gemm m=", g.m, " n=", g.n, " k=", g.k, " trans_a=", g.trans_a,
                                        " trans_b=", g.trans_b, " lda=", g.lda, " ldb=", g.ldb, " ldc=", g.ldc,
                                        " C=", g.c_f32 ? "f32" : "bf16");
  if (g.batch != 1) {
    s += ::moe::detail::concat(" batch=", g.batch, " strides a/b/c=", g.stride_a, "/", g.stride_b, "/", g.stride_c);
  }
  if (g.align_a != 0) {
    s += ::moe::detail::concat(" (alignment a/b/c ", g.align_a, "/", g.align_b, "/", g.align_c, " bytes)");
  }
  if (g.sm_target != 0) s += ::moe::detail::concat(" on ", g.sm_target, " multiprocessors");
  return s;
}

[[noreturn]] void throw_gemm_cublas_error(const char* file, int line, const char* call, cublasStatus_t st,
                                          const GemmKey& key) {
  ::moe::detail::throw_error(file, line, nullptr,
                             ::moe::detail::concat("cuBLAS error ", cublasLtGetStatusName(st), " (",
                                                   cublasLtGetStatusString(st), ") from ", call, " for ",
                                                   describe(key)));
}

[[noreturn]] void throw_gemm_cublas_error(const char* file, int line, const char* call, cublasStatus_t st,
                                          const struct Fp8GemmKey& key);

#define MOE_GEMM_CUBLAS_CHECK(expr, key)                                                           \
  do {                                                                                             \
    const cublasStatus_t moe_gemm_st_ = (expr);                                                    \
    if (moe_gemm_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]] {                                      \
      ::moe::cuda::detail::throw_gemm_cublas_error(__FILE__, __LINE__, #expr, moe_gemm_st_, (key)); \
    }                                                                                              \
  } while (0)

uint32_t alignment_of(const void* p, int64_t stride_elems, size_t elem_bytes, int64_t batch) {
  uint64_t bits = reinterpret_cast<uintptr_t>(p) | kMaxAlignBytes;
  if (batch > 1 && stride_elems != 0) bits |= static_cast<uint64_t>(stride_elems) * elem_bytes;
  return static_cast<uint32_t>(bits & (~bits + 1));  // lowest set bit
}

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t layout_b = nullptr;  // cuBLASLt's A: our B
  cublasLtMatrixLayout_t layout_a = nullptr;  // cuBLASLt's B: our A
  cublasLtMatrixLayout_t layout_c = nullptr;  // C and D
  cublasLtMatmulAlgo_t algo{};
};

void destroy_plan(Plan& p) {
  if (p.layout_c) cublasLtMatrixLayoutDestroy(p.layout_c);
  if (p.layout_a) cublasLtMatrixLayoutDestroy(p.layout_a);
  if (p.layout_b) cublasLtMatrixLayoutDestroy(p.layout_b);
  if (p.desc) cublasLtMatmulDescDestroy(p.desc);
  p = Plan{};
}

}  // namespace detail

namespace detail {
// What an FP8 plan depends on (pointers are 16-byte aligned by contract).
struct Fp8GemmKey {
  int64_t m, n, k;
  int32_t fa, fb, b_scaling;  // B's scales: 0 128 x 128, 1 1 x 128; 2: both operands MX (1 x 32 E8M0)
  bool c_f32;
  int32_t sm_target;  // as GemmKey's
  auto operator<=>(const Fp8GemmKey&) const = default;
};

std::string describe(const Fp8GemmKey& g) {
  return ::moe::detail::concat("fp8_gemm m=", g.m, " n=", g.n, " k=", g.k, " A=", g.fa ? "e5m2" : "e4m3",
                               " B=", g.fb ? "e5m2" : "e4m3",
                               g.b_scaling == 2   ? " scales=1x32 e8m0 (MX)"
                               : g.b_scaling == 1 ? " B scales=1x128"
                                                  : " B scales=128x128",
                               " C=", g.c_f32 ? "f32" : "bf16",
                               g.sm_target != 0 ? ::moe::detail::concat(" on ", g.sm_target, " multiprocessors")
                                                : std::string());
}

void throw_gemm_cublas_error(const char* file, int line, const char* call, cublasStatus_t st, const Fp8GemmKey& key) {
  ::moe::detail::throw_error(file, line, nullptr,
                             ::moe::detail::concat("cuBLAS error ", cublasLtGetStatusName(st), " (",
                                                   cublasLtGetStatusString(st), ") from ", call, " for ",
                                                   describe(key)));
}
}  // namespace detail

using detail::describe;
using detail::Fp8GemmKey;
using detail::GemmKey;
using detail::Plan;

struct GemmHandle::Impl {
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  int device_sms = 0;  // the multiprocessors of the device the handle was made on
  int device_major = 0;  // its compute capability's major version
  std::map<GemmKey, Plan> plans;
  std::map<Fp8GemmKey, Plan> fp8_plans;

  ~Impl() {
    for (auto& [key, plan] : plans) destroy_plan(plan);
    for (auto& [key, plan] : fp8_plans) destroy_plan(plan);
    if (workspace) cudaFree(workspace);
    if (lt) cublasLtDestroy(lt);
  }

  const Plan& plan_for(const GemmKey& key);
  const Plan& fp8_plan_for(const Fp8GemmKey& key);
};

namespace {

void set_layout_batch(cublasLtMatrixLayout_t layout, int64_t batch, int64_t stride, const GemmKey& key) {
  if (batch == 1) return;
  const int32_t count = static_cast<int32_t>(batch);
  MOE_GEMM_CUBLAS_CHECK(
      cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)), key);
  MOE_GEMM_CUBLAS_CHECK(
      cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)),
      key);
}

// The multiprocessors a GEMM enqueued now should target: 0 (all) without a reserve on this thread.
int32_t sm_target(int device_sms) { return reserved_sms() > 0 ? gemm_sms(device_sms) : 0; }

// A reserve (cuda/sm_reserve.h) as the descriptor's SM count target, so that the heuristic and the
// kernel's grid keep to the multiprocessors it leaves.
template <typename Key>
void set_sm_target(cublasLtMatmulDesc_t desc, int32_t sms, const Key& key) {
  if (sms <= 0) return;
  MOE_GEMM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms, sizeof(sms)),
                        key);
}

// The heuristic's first algorithm for p's descriptor and layouts into p.algo, within the handle's
// workspace, split-K partials reduced only as reduction_mask allows (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE:
// FP32 partials in the workspace, reduced in a fixed order, so a BF16 C is rounded once); aligns:
// the minimum alignments of cuBLASLt's A, B, C, D in bytes, or null for its default. False when no
// algorithm fits.
template <typename Key>
bool choose_algorithm(cublasLtHandle_t lt, Plan& p, const uint32_t* aligns, uint32_t reduction_mask, const Key& key) {
  cublasLtMatmulPreference_t pref = nullptr;
  MOE_GEMM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref), key);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  try {
    const uint64_t ws = GemmHandle::kWorkspaceBytes;
    MOE_GEMM_CUBLAS_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)), key);
    MOE_GEMM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                               &reduction_mask, sizeof(reduction_mask)),
                          key);
    if (aligns != nullptr) {
      const cublasLtMatmulPreferenceAttributes_t attrs[4] = {
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
      for (int i = 0; i < 4; ++i) {
        MOE_GEMM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attrs[i], &aligns[i], sizeof(aligns[i])),
                              key);
      }
    }
    MOE_GEMM_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, p.desc, p.layout_b, p.layout_a, p.layout_c, p.layout_c,
                                                         pref, 1, &result, &found),
                          key);
  } catch (...) {
    cublasLtMatmulPreferenceDestroy(pref);
    throw;
  }
  cublasLtMatmulPreferenceDestroy(pref);
  if (found <= 0 || result.state != CUBLAS_STATUS_SUCCESS) return false;
  p.algo = result.algo;
  return true;
}

// Descriptors, layouts and the heuristic's first choice for `key`; on failure everything built is destroyed.
Plan build_plan(cublasLtHandle_t lt, const GemmKey& key) {
  Plan p;
  try {
    MOE_GEMM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), key);
    const cublasOperation_t op_first = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_second = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    MOE_GEMM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)), key);
    MOE_GEMM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)), key);
    set_sm_target(p.desc, key.sm_target, key);

    // Column-major views: row-major X[r, c] with leading dim ld is column-major [c, r] with the same ld.
    const uint64_t b_rows = static_cast<uint64_t>(key.trans_b ? key.k : key.n);
    const uint64_t b_cols = static_cast<uint64_t>(key.trans_b ? key.n : key.k);
    const uint64_t a_rows = static_cast<uint64_t>(key.trans_a ? key.m : key.k);
    const uint64_t a_cols = static_cast<uint64_t>(key.trans_a ? key.k : key.m);
    MOE_GEMM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.layout_b, CUDA_R_16BF, b_rows, b_cols, key.ldb), key);
    MOE_GEMM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.layout_a, CUDA_R_16BF, a_rows, a_cols, key.lda), key);
    MOE_GEMM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.layout_c, key.c_f32 ? CUDA_R_32F : CUDA_R_16BF,
                                                     static_cast<uint64_t>(key.n), static_cast<uint64_t>(key.m),
                                                     key.ldc),
                          key);
    set_layout_batch(p.layout_b, key.batch, key.stride_b, key);
    set_layout_batch(p.layout_a, key.batch, key.stride_a, key);
    set_layout_batch(p.layout_c, key.batch, key.stride_c, key);

    const uint32_t aligns[4] = {key.align_b, key.align_a, key.align_c, key.align_c};  // cuBLASLt's A, B, C, D
    MOE_CHECK(choose_algorithm(lt, p, aligns, CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE, key),
              "cuda::gemm: cuBLASLt has no algorithm for ", describe(key), ": check the leading dimensions and alignments");
  } catch (...) {
    destroy_plan(p);
    throw;
  }
  return p;
}

// cuBLASLt's A is our B (k x n column-major: B[n, k] row-major, transposed), its B our A (k x m
// column-major, not transposed): the "TN" form FP8 needs, both operands K-major. The scale
// pointers are set per call (scale_pointers).
Plan build_fp8_plan(cublasLtHandle_t lt, const Fp8GemmKey& key, const void* sb, const void* sa_t) {
  Plan p;
  try {
    MOE_GEMM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), key);
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    MOE_GEMM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)), key);
    MOE_GEMM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)), key);
    set_sm_target(p.desc, key.sm_target, key);
    // Block scaling promotes every K block (no fast accumulation, the descriptor's default). The
    // heuristic checks the scale pointers, so they are set before it (and again at every call).
    MOE_GEMM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sb, sizeof(sb)),
                          key);
    MOE_GEMM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sa_t, sizeof(sa_t)), key);
    const int32_t mode_b_ours = key.b_scaling == 2   ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0
                                : key.b_scaling == 0 ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                                     : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    const int32_t mode_a_ours =
        key.b_scaling == 2 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0 : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    MOE_GEMM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_b_ours,
                                                         sizeof(mode_b_ours)),
                          key);
    MOE_GEMM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_a_ours,
                                                         sizeof(mode_a_ours)),
                          key);
    const cudaDataType_t ta = key.fa ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
    const cudaDataType_t tb = key.fb ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
    const auto k = static_cast<uint64_t>(key.k), m = static_cast<uint64_t>(key.m), n = static_cast<uint64_t>(key.n);
    MOE_GEMM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.layout_b, tb, k, n, key.k), key);
    MOE_GEMM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.layout_a, ta, k, m, key.k), key);
    MOE_GEMM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.layout_c, key.c_f32 ? CUDA_R_32F : CUDA_R_16BF, n, m, key.n),
                          key);
    // Split-K partials reduced in FP32 where a kernel allows it; else the library's choice.
    MOE_CHECK(choose_algorithm(lt, p, nullptr, CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE, key) ||
                  choose_algorithm(lt, p, nullptr, CUBLASLT_REDUCTION_SCHEME_MASK, key),
              "cuda::fp8_gemm: cuBLASLt has no algorithm for ", describe(key), " on this GPU (",
              key.b_scaling == 2 ? "MX scales need compute capability 10.0 and CUDA 12.8 or later"
                                 : "block-scaled FP8 needs compute capability 9.0 and CUDA 12.9 or later",
              ")");
  } catch (...) {
    destroy_plan(p);
    throw;
  }
  return p;
}

// The plan of `key` (built at its first call) run on the operands: cuBLASLt's A is our B, so its
// scales are b_scales; its B our A, a_scales.
void run_fp8_plan(GemmHandle& handle, const Fp8GemmKey& key, const uint8_t* qa, const void* a_scales,
                  const uint8_t* qb, const void* b_scales, void* c, bool accumulate, Stream stream) {
  GemmHandle::Impl& h = handle.impl();
  auto it = h.fp8_plans.find(key);
  if (it == h.fp8_plans.end()) it = h.fp8_plans.emplace(key, build_fp8_plan(h.lt, key, b_scales, a_scales)).first;
  const Plan& p = it->second;
  MOE_GEMM_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b_scales, sizeof(b_scales)), key);
  MOE_GEMM_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_scales, sizeof(a_scales)), key);
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  MOE_GEMM_CUBLAS_CHECK(cublasLtMatmul(h.lt, p.desc, &alpha, qb, p.layout_b, qa, p.layout_a, &beta, c, p.layout_c, c,
                                       p.layout_c, &p.algo, h.workspace, GemmHandle::kWorkspaceBytes, stream),
                        key);
}

template <typename T>
void run_fp8_gemm(GemmHandle& handle, const uint8_t* qa, const float* sa_t, int64_t lds_a, Fp8Format fa,
                  const uint8_t* qb, const float* sb, int64_t lds_b, Fp8Format fb, Fp8BScaling b_scaling, int64_t m,
                  int64_t n, int64_t k, T* c, bool accumulate, Stream stream) {
  const char* op = "cuda::fp8_gemm";
  constexpr bool c_f32 = sizeof(T) == 4;
  const Fp8GemmKey key{m, n, k, fa == Fp8Format::kE5M2 ? 1 : 0, fb == Fp8Format::kE5M2 ? 1 : 0,
                       b_scaling == Fp8BScaling::kRow1x128 ? 1 : 0, c_f32, sm_target(handle.impl().device_sms)};
  MOE_CHECK(m >= 0 && n >= 0 && k >= 0, op, ": expected m, n, k >= 0, got ", describe(key));
  if (m == 0 || n == 0) return;
  MOE_CHECK(k > 0 && k % 128 == 0, op, ": k must be a positive multiple of 128 (whole 1 x 128 scaling blocks), got ",
            describe(key));
  MOE_CHECK(n % 16 == 0 && m % 4 == 0, op, ": n must be a multiple of 16 and m of 4, got ", describe(key));
  MOE_CHECK(!(fa == Fp8Format::kE5M2 && fb == Fp8Format::kE5M2), op, ": E5M2 x E5M2 has no tensor-core kernel; ",
            "make one operand E4M3 (", describe(key), ")");
  const int64_t kb = k / 128;
  MOE_CHECK(lds_a >= m && lds_a % 4 == 0, op, ": lds_a must be >= m and a multiple of 4, got ", lds_a, " for ",
            describe(key));
  if (b_scaling == Fp8BScaling::kBlock128x128) {
    MOE_CHECK(lds_b >= kb && lds_b % 4 == 0, op, ": lds_b must be >= k / 128 = ", kb,
              " and a multiple of 4 for 128 x 128 scales, got ", lds_b, " for ", describe(key));
  } else {
    MOE_CHECK(lds_b >= n && lds_b % 4 == 0, op, ": lds_b must be >= n and a multiple of 4 for 1 x 128 scales, got ",
              lds_b, " for ", describe(key));
  }
  detail::check_ptrs(op, {{"qa", qa}, {"qb", qb}, {"sa_t", sa_t}, {"sb", sb}, {"c", c}}, 16);
  // The scale tensors' leading dimensions are implied by the shapes; lds_a / lds_b beyond them are
  // not expressible, so they must equal the minimum (checked here).
  const int64_t want_a = (m + 3) / 4 * 4;
  const int64_t want_b = b_scaling == Fp8BScaling::kBlock128x128 ? (kb + 3) / 4 * 4 : (n + 3) / 4 * 4;
  MOE_CHECK(lds_a == want_a && lds_b == want_b, op, ": the scale tensors' leading dimensions must be the padded ",
            "minimum (lds_a = ", want_a, ", lds_b = ", want_b, "), got ", lds_a, " and ", lds_b, " for ", describe(key));
  run_fp8_plan(handle, key, qa, sa_t, qb, sb, c, accumulate, stream);
}

}  // namespace

const Plan& GemmHandle::Impl::plan_for(const GemmKey& key) {
  const auto it = plans.find(key);
  if (it != plans.end()) return it->second;
  Plan p = build_plan(lt, key);
  return plans.emplace(key, p).first->second;
}

GemmHandle::GemmHandle() : impl_(std::make_unique<Impl>()) {
  MOE_CUBLAS_CHECK(cublasLtCreate(&impl_->lt));
  int device = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&impl_->device_sms, cudaDevAttrMultiProcessorCount, device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&impl_->device_major, cudaDevAttrComputeCapabilityMajor, device));
  MOE_CUDA_CHECK(cudaMalloc(&impl_->workspace, kWorkspaceBytes));
}

GemmHandle::~GemmHandle() = default;

size_t GemmHandle::num_plans() const { return impl_->plans.size(); }

namespace {

template <typename T>
void launch_gemm_scale_c(T* c, int64_t m, int64_t n, int64_t ldc, int64_t stride_c, int64_t batch, float beta,
                         Stream stream) {
  const int64_t total = m * n * batch;
  const int64_t blocks = std::clamp<int64_t>((total + detail::kScaleThreads - 1) / detail::kScaleThreads, 1, detail::kScaleMaxBlocks);
  kernels::gemm_scale_c_elements<T>
      <<<static_cast<unsigned>(blocks), detail::kScaleThreads, 0, stream>>>(c, m, n, ldc, stride_c, batch, beta);
  check_launch("gemm_scale_c_elements");
}

// Validation, the k = 0 case, then the cached plan and one cublasLtMatmul. T is C's element type.
template <typename T>
void run_gemm(GemmHandle& handle, const char* op, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
              float alpha, const uint16_t* a, int64_t lda, int64_t stride_a, const uint16_t* b, int64_t ldb,
              int64_t stride_b, float beta, T* c, int64_t ldc, int64_t stride_c, int64_t batch, Stream stream) {
  constexpr bool c_f32 = sizeof(T) == 4;
  GemmKey key{m, n, k, lda, ldb, ldc, stride_a, stride_b, stride_c, batch, trans_a, trans_b, c_f32, 0, 0, 0, 0};
  MOE_CHECK(m >= 0 && n >= 0 && k >= 0 && batch >= 0, op, ": expected m, n, k, batch >= 0, got ", describe(key));
  if (m == 0 || n == 0 || batch == 0) return;
  MOE_CHECK(batch <= std::numeric_limits<int32_t>::max(), op, ": batch exceeds 2^31 - 1 in ", describe(key));
  MOE_CHECK(ldc >= n, op, ": expected ldc >= n (row-major C[m, n]), got ", describe(key));
  detail::check_ptrs(op, {{"c", c}}, sizeof(T));
  if (batch > 1) {
    MOE_CHECK(stride_c >= (m - 1) * ldc + n, op, ": C matrices overlap: expected stride_c >= (m - 1) * ldc + n = ",
              (m - 1) * ldc + n, ", got ", describe(key));
  }
  if (k == 0) {
    launch_gemm_scale_c<T>(c, m, n, ldc, stride_c, batch, beta, stream);
    return;
  }
  MOE_CHECK(lda >= (trans_a ? m : k), op, ": expected lda >= ", trans_a ? "m" : "k", " (A is row-major [",
            trans_a ? "k, m" : "m, k", "]), got ", describe(key));
  MOE_CHECK(ldb >= (trans_b ? k : n), op, ": expected ldb >= ", trans_b ? "k" : "n", " (B is row-major [",
            trans_b ? "n, k" : "k, n", "]), got ", describe(key));
  MOE_CHECK(stride_a >= 0 && stride_b >= 0, op, ": expected stride_a, stride_b >= 0, got ", describe(key));
  detail::check_ptrs(op, {{"a", a}, {"b", b}}, 2);

  key.align_a = detail::alignment_of(a, stride_a, 2, batch);
  key.align_b = detail::alignment_of(b, stride_b, 2, batch);
  key.align_c = detail::alignment_of(c, stride_c, sizeof(T), batch);
  GemmHandle::Impl& h = handle.impl();
  key.sm_target = sm_target(h.device_sms);
  const Plan& p = h.plan_for(key);
  MOE_GEMM_CUBLAS_CHECK(cublasLtMatmul(h.lt, p.desc, &alpha, b, p.layout_b, a, p.layout_a, &beta, c, p.layout_c, c,
                                       p.layout_c, &p.algo, h.workspace, GemmHandle::kWorkspaceBytes, stream),
                        key);
}

}  // namespace

void gemm(GemmHandle& handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, uint16_t* c, int64_t ldc,
          Stream stream) {
  run_gemm<uint16_t>(handle, "cuda::gemm", trans_a, trans_b, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0,
                     1, stream);
}

void gemm(GemmHandle& handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc,
          Stream stream) {
  run_gemm<float>(handle, "cuda::gemm", trans_a, trans_b, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0, 1,
                  stream);
}

void gemm_strided_batched(GemmHandle& handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                          float alpha, const uint16_t* a, int64_t lda, int64_t stride_a, const uint16_t* b,
                          int64_t ldb, int64_t stride_b, float beta, uint16_t* c, int64_t ldc, int64_t stride_c,
                          int64_t batch, Stream stream) {
  run_gemm<uint16_t>(handle, "cuda::gemm_strided_batched", trans_a, trans_b, m, n, k, alpha, a, lda, stride_a, b,
                     ldb, stride_b, beta, c, ldc, stride_c, batch, stream);
}

void gemm_strided_batched(GemmHandle& handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                          float alpha, const uint16_t* a, int64_t lda, int64_t stride_a, const uint16_t* b,
                          int64_t ldb, int64_t stride_b, float beta, float* c, int64_t ldc, int64_t stride_c,
                          int64_t batch, Stream stream) {
  run_gemm<float>(handle, "cuda::gemm_strided_batched", trans_a, trans_b, m, n, k, alpha, a, lda, stride_a, b, ldb,
                  stride_b, beta, c, ldc, stride_c, batch, stream);
}

void fp8_gemm(GemmHandle& handle, const uint8_t* qa, const float* sa_t, int64_t lds_a, Fp8Format fa,
              const uint8_t* qb, const float* sb, int64_t lds_b, Fp8Format fb, Fp8BScaling b_scaling, int64_t m,
              int64_t n, int64_t k, uint16_t* c, Stream stream) {
  run_fp8_gemm<uint16_t>(handle, qa, sa_t, lds_a, fa, qb, sb, lds_b, fb, b_scaling, m, n, k, c, false, stream);
}

void fp8_gemm(GemmHandle& handle, const uint8_t* qa, const float* sa_t, int64_t lds_a, Fp8Format fa,
              const uint8_t* qb, const float* sb, int64_t lds_b, Fp8Format fb, Fp8BScaling b_scaling, int64_t m,
              int64_t n, int64_t k, float* c, bool accumulate, Stream stream) {
  run_fp8_gemm<float>(handle, qa, sa_t, lds_a, fa, qb, sb, lds_b, fb, b_scaling, m, n, k, c, accumulate, stream);
}

namespace {

// mx_gemm's workspace: the re-blocked codes of A and B, their 1 x 128 scales as the re-blocking
// writes them ([rows, k / 128]) and K-block-major for fp8_gemm, each 256-byte aligned.
struct MxGemmWorkspace {
  size_t qa, qb, sa, sb, sa_t, sb_t, total;
};

MxGemmWorkspace mx_gemm_layout(int64_t m, int64_t n, int64_t k) {
  const auto up = [](size_t b) { return (b + 255) / 256 * 256; };
  const size_t kb = static_cast<size_t>(k / 128), um = static_cast<size_t>(m), un = static_cast<size_t>(n);
  MxGemmWorkspace w{};
  w.qa = 0;
  w.qb = w.qa + up(um * static_cast<size_t>(k));
  w.sa = w.qb + up(un * static_cast<size_t>(k));
  w.sb = w.sa + up(um * kb * sizeof(float));
  w.sa_t = w.sb + up(un * kb * sizeof(float));
  w.sb_t = w.sa_t + up(um * kb * sizeof(float));
  w.total = w.sb_t + up(un * kb * sizeof(float));
  return w;
}

}  // namespace

size_t mx_gemm_workspace_bytes(int64_t m, int64_t n, int64_t k) {
  MOE_CHECK(m >= 0 && n >= 0 && k >= 0, "cuda::mx_gemm_workspace_bytes: expected m, n, k >= 0, got ", m, ", ", n,
            ", ", k);
  return mx_gemm_layout(m, n, k).total;
}

void mx_gemm(GemmHandle& handle, const uint8_t* qa, const uint8_t* sa_e8m0, Fp8Format fa, const uint8_t* qb,
             const uint8_t* sb_e8m0, Fp8Format fb, int64_t m, int64_t n, int64_t k, float* c, bool accumulate,
             void* workspace, size_t workspace_bytes, unsigned long long* changed, uint32_t* nan_scales,
             Stream stream) {
  const char* op = "cuda::mx_gemm";
  MOE_CHECK(m > 0 && n > 0 && k > 0 && k % 128 == 0 && n % 16 == 0 && m % 4 == 0, op,
            ": expected k a positive multiple of 128, n of 16 and m of 4, got m=", m, " n=", n, " k=", k);
  const MxGemmWorkspace w = mx_gemm_layout(m, n, k);
  MOE_CHECK(workspace_bytes >= w.total, op, ": workspace of ", workspace_bytes, " bytes is too small, need ", w.total,
            " (mx_gemm_workspace_bytes(", m, ", ", n, ", ", k, "))");
  detail::check_ptrs(op, {{"workspace", workspace}}, 256);
  auto* base = static_cast<unsigned char*>(workspace);
  if (handle.impl().device_major >= 10) {
    // Blackwell: the scales in its tiles (the workspace's start holds both, far less than the
    // re-blocked codes it is sized for), then the tensor cores' own MX GEMM; nothing re-blocked.
    auto* sa_tiled = base;
    auto* sb_tiled = base + (mx_scales_tiled_bytes(m, k / kMxBlock) + 255) / 256 * 256;
    mx_scales_tiled(sa_e8m0, m, k / kMxBlock, sa_tiled, stream);
    mx_scales_tiled(sb_e8m0, n, k / kMxBlock, sb_tiled, stream);
    mx_gemm_tiled(handle, qa, sa_tiled, fa, qb, sb_tiled, fb, m, n, k, c, accumulate, stream);
    return;
  }
  auto* qa2 = base + w.qa;
  auto* qb2 = base + w.qb;
  auto* sa = reinterpret_cast<float*>(base + w.sa);
  auto* sb = reinterpret_cast<float*>(base + w.sb);
  auto* sa_t = reinterpret_cast<float*>(base + w.sa_t);
  auto* sb_t = reinterpret_cast<float*>(base + w.sb_t);
  const int64_t kb = k / 128;
  mx_to_blocks128(qa, sa_e8m0, m, k, fa, qa2, sa, changed, nan_scales, stream);
  mx_to_blocks128(qb, sb_e8m0, n, k, fb, qb2, sb, changed, nan_scales, stream);
  fp8_scales_k_major(sa, m, kb, m, sa_t, stream);
  fp8_scales_k_major(sb, n, kb, n, sb_t, stream);
  fp8_gemm(handle, qa2, sa_t, m, fa, qb2, sb_t, n, fb, Fp8BScaling::kRow1x128, m, n, k, c, accumulate, stream);
}

void mx_gemm_tiled(GemmHandle& handle, const uint8_t* qa, const uint8_t* sa_tiled, Fp8Format fa, const uint8_t* qb,
                   const uint8_t* sb_tiled, Fp8Format fb, int64_t m, int64_t n, int64_t k, float* c, bool accumulate,
                   Stream stream) {
  const char* op = "cuda::mx_gemm_tiled";
  const int major = handle.impl().device_major;
  MOE_CHECK(major >= 10, op, ": MX scales on the tensor cores need a Blackwell GPU (compute capability 10.0 or ",
            "later), this one is ", major, ".x; cuda::mx_gemm re-blocks MX operands for Hopper's block-scaled GEMM");
  MOE_CHECK(m > 0 && n > 0 && k > 0 && k % 128 == 0 && n % 16 == 0 && m % 4 == 0, op,
            ": expected k a positive multiple of 128, n of 16 and m of 4, got m=", m, " n=", n, " k=", k);
  MOE_CHECK(!(fa == Fp8Format::kE5M2 && fb == Fp8Format::kE5M2), op, ": E5M2 x E5M2 has no tensor-core kernel; ",
            "make one operand E4M3");
  detail::check_ptrs(op, {{"qa", qa}, {"qb", qb}, {"sa_tiled", sa_tiled}, {"sb_tiled", sb_tiled}, {"c", c}}, 16);
  const Fp8GemmKey key{m, n, k, fa == Fp8Format::kE5M2 ? 1 : 0, fb == Fp8Format::kE5M2 ? 1 : 0, 2, true,
                       sm_target(handle.impl().device_sms)};
  run_fp8_plan(handle, key, qa, sa_tiled, qb, sb_tiled, c, accumulate, stream);
}

}  // namespace moe::cuda
