// RMSNorm launchers and checked entry points. Vector path (16-byte accesses) when d % 8 == 0
// and x, w, y / dy, dx and the workspace are 16-byte aligned; else the scalar path. Backward:
// one block per 32-row chunk writes a partial dw row into the workspace, then a reduction
// kernel adds the partials to dw in chunk order; on the vector path with d <= 6144 the block
// copies its rows of x and dy into shared memory asynchronously, a sub-chunk ahead of the one it
// computes (kStaged).
#include "cuda/ops/rmsnorm.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "cuda/common.h"
#include "cuda/kernels/rmsnorm.cuh"
#include "cuda/ops/launch.h"

namespace moe::cuda {
namespace {

using kernels::kRmsChunkRows;
using kernels::kVecBf16;

constexpr int kForwardWarpsPerBlock = 8;

int64_t num_chunks(int64_t n) { return (n + kRmsChunkRows - 1) / kRmsChunkRows; }

// The forward kernels' grid: a warp per row, kForwardWarpsPerBlock rows a block (grid-stride past
// the grid's limit).
unsigned forward_blocks(int64_t n) {
  return static_cast<unsigned>(
      std::min<int64_t>((n + kForwardWarpsPerBlock - 1) / kForwardWarpsPerBlock, detail::kMaxGridX));
}

// The vector path keeps each lane's pieces of the row in registers up to d = 4096 (8 or 16 pieces
// a lane), else reads the row twice.
template <int V>
void launch_rmsnorm_forward(const uint16_t* x, const uint16_t* w, uint16_t* y, float* rstd, int64_t n,
                            int64_t d, float eps, Stream stream) {
  const unsigned threads = kForwardWarpsPerBlock * kernels::kWarpSize;
  constexpr int64_t kRowPiece = kernels::kWarpSize * kVecBf16;
  auto kernel = kernels::rmsnorm_forward_warp_per_row<V>;
  if constexpr (V == kVecBf16) {
    if (d <= 8 * kRowPiece) {
      kernel = kernels::rmsnorm_forward_warp_per_row_held<8>;
    } else if (d <= 16 * kRowPiece) {
      kernel = kernels::rmsnorm_forward_warp_per_row_held<16>;
    }
  }
  kernel<<<forward_blocks(n), threads, 0, stream>>>(x, w, y, rstd, n, d, eps);
  check_launch("rmsnorm_forward_warp_per_row");
}

template <int V, bool kAddResidual = false, bool kRope = false>
void launch_rmsnorm_backward(const uint16_t* x, const uint16_t* w, const float* rstd, const uint16_t* dy,
                             uint16_t* dx, float* dw, float* partial_dw, int64_t n, int64_t d, Stream stream,
                             float* acc = nullptr, uint16_t* acc_bf16 = nullptr, const float2* rope_table = nullptr,
                             int64_t seq = 0, int head_dim = 0) {
  const int64_t chunks = num_chunks(n);
  const int64_t stage = kernels::rmsnorm_backward_stage_bytes(d, kRope);
  bool staged = false;
  if constexpr (V == kVecBf16) {
    if (d <= kernels::kRmsMaxStagedWidth) {
      // The rows of x and dy copied into shared memory a sub-chunk ahead of the one computed.
      const auto kernel = kernels::rmsnorm_backward_row_chunks<V, kAddResidual, kRope, true>;
      if (stage > 48 * 1024) set_dynamic_smem_limit(kernel, size_t(stage));
      kernel<<<static_cast<unsigned>(chunks), kernels::kRmsBackwardThreads, static_cast<size_t>(stage), stream>>>(
          x, w, rstd, dy, dx, partial_dw, n, d, acc, acc_bf16, rope_table, seq, head_dim);
      staged = true;
    }
  }
  if (!staged) {
    kernels::rmsnorm_backward_row_chunks<V, kAddResidual, kRope>
        <<<static_cast<unsigned>(chunks), kernels::kRmsBackwardThreads, 0, stream>>>(
            x, w, rstd, dy, dx, partial_dw, n, d, acc, acc_bf16, rope_table, seq, head_dim);
  }
  check_launch("rmsnorm_backward_row_chunks");
  const dim3 block(kernels::kWarpSize, kernels::kRmsReduceWarps);
  const int64_t blocks = (d + kernels::kWarpSize - 1) / kernels::kWarpSize;
  kernels::rmsnorm_dw_reduce_chunks<<<static_cast<unsigned>(blocks), block, 0, stream>>>(partial_dw, dw,
                                                                                          chunks, d);
  check_launch("rmsnorm_dw_reduce_chunks");
}

void check_sizes(const char* op, int64_t n, int64_t d) {
  MOE_CHECK(n >= 0 && d > 0, op, ": expected n >= 0 and d > 0, got n=", n, " d=", d);
  // One block per chunk: the grid's x dimension bounds the number of chunks.
  MOE_CHECK(num_chunks(n) <= detail::kMaxGridX, op, ": n=", n, " rows exceed the supported ",
            detail::kMaxGridX * kRmsChunkRows);
}

}  // namespace

void rmsnorm_forward(const uint16_t* x, const uint16_t* w, uint16_t* y, float* rstd, int64_t n, int64_t d,
                     double eps, Stream stream) {
  const char* op = "cuda::rmsnorm_forward";
  check_sizes(op, n, d);
  MOE_CHECK(eps >= 0.0, op, ": expected eps >= 0, got ", eps);
  if (n == 0) return;
  detail::check_ptrs(op, {{"x", x}, {"w", w}, {"y", y}}, 2);
  detail::check_ptrs(op, {{"rstd", rstd}}, 4);
  const float eps_f = static_cast<float>(eps);
  if (d % kVecBf16 == 0 && detail::aligned16(x) && detail::aligned16(w) && detail::aligned16(y)) {
    launch_rmsnorm_forward<kVecBf16>(x, w, y, rstd, n, d, eps_f, stream);
  } else {
    launch_rmsnorm_forward<1>(x, w, y, rstd, n, d, eps_f, stream);
  }
}

bool rmsnorm_forward_fp8_fuses(const uint16_t* x, const uint16_t* w, const uint16_t* y, const uint8_t* q, int64_t d) {
  return d > 0 && d % 128 == 0 && detail::aligned16(x) && detail::aligned16(w) && detail::aligned16(y) &&
         reinterpret_cast<uintptr_t>(q) % 8 == 0;
}

void rmsnorm_forward_fp8(const uint16_t* x, const uint16_t* w, uint16_t* y, float* rstd, uint8_t* q, float* scales,
                         int64_t n, int64_t d, double eps, Stream stream, Fp8Rule rule) {
  const char* op = "cuda::rmsnorm_forward_fp8";
  check_sizes(op, n, d);
  MOE_CHECK(eps >= 0.0, op, ": expected eps >= 0, got ", eps);
  if (n == 0) return;
  detail::check_ptrs(op, {{"x", x}, {"w", w}, {"y", y}, {"q", q}}, 1);
  detail::check_ptrs(op, {{"rstd", rstd}, {"scales", scales}}, 4);
  MOE_CHECK(rmsnorm_forward_fp8_fuses(x, w, y, q, d), op, ": expected d a multiple of 128 (got ", d,
            "), x, w, y 16-byte and q 8-byte aligned (rmsnorm_forward_fp8_fuses)");
  const auto kernel = rule == Fp8Rule::kBlocks ? kernels::rmsnorm_forward_fp8_warp_per_row<false>
                                               : kernels::rmsnorm_forward_fp8_warp_per_row<true>;
  kernel<<<forward_blocks(n), kForwardWarpsPerBlock * kernels::kWarpSize, 0, stream>>>(
      x, w, y, rstd, q, scales, n, d, static_cast<float>(eps), rule);
  check_launch("rmsnorm_forward_fp8_warp_per_row");
}

size_t rmsnorm_backward_workspace_bytes(int64_t n, int64_t d) {
  MOE_CHECK(n >= 0 && d >= 0, "cuda::rmsnorm_backward_workspace_bytes: expected n, d >= 0, got n=", n,
            " d=", d);
  return static_cast<size_t>(num_chunks(n)) * static_cast<size_t>(d) * sizeof(float);
}

namespace {

// rmsnorm_backward (add false: dx stored) or rmsnorm_backward_add (add: dx added into acc).
void backward_checked(const char* op, bool add, const uint16_t* x, const uint16_t* w, const float* rstd,
                      const uint16_t* dy, uint16_t* dx, float* acc, uint16_t* acc_bf16, float* dw, int64_t n,
                      int64_t d, void* workspace, size_t workspace_bytes, Stream stream) {
  check_sizes(op, n, d);
  if (n == 0) return;
  detail::check_ptrs(op, {{"x", x}, {"w", w}, {"dy", dy}}, 2);
  if (!add) detail::check_ptrs(op, {{"dx", dx}}, 2);
  if (add && acc_bf16 != nullptr) detail::check_ptrs(op, {{"acc_bf16", acc_bf16}}, 2);
  detail::check_ptrs(op, {{"rstd", rstd}, {"dw", dw}}, 4);
  if (add) detail::check_ptrs(op, {{"acc", acc}}, 4);
  detail::check_ptrs(op, {{"workspace", workspace}}, 16);
  const size_t need = rmsnorm_backward_workspace_bytes(n, d);
  MOE_CHECK(workspace_bytes >= need, op, ": workspace of ", workspace_bytes, " bytes is too small, need ",
            need, " (rmsnorm_backward_workspace_bytes(", n, ", ", d, "))");
  float* partial_dw = static_cast<float*>(workspace);
  const bool vec = d % kVecBf16 == 0 && detail::aligned16(x) && detail::aligned16(w) && detail::aligned16(dy) &&
                   (add ? detail::aligned16(acc) && (acc_bf16 == nullptr || detail::aligned16(acc_bf16))
                        : detail::aligned16(dx));
  if (add && vec) {
    launch_rmsnorm_backward<kVecBf16, true>(x, w, rstd, dy, nullptr, dw, partial_dw, n, d, stream, acc, acc_bf16);
  } else if (add) {
    launch_rmsnorm_backward<1, true>(x, w, rstd, dy, nullptr, dw, partial_dw, n, d, stream, acc, acc_bf16);
  } else if (vec) {
    launch_rmsnorm_backward<kVecBf16>(x, w, rstd, dy, dx, dw, partial_dw, n, d, stream);
  } else {
    launch_rmsnorm_backward<1>(x, w, rstd, dy, dx, dw, partial_dw, n, d, stream);
  }
}

}  // namespace

void rmsnorm_backward(const uint16_t* x, const uint16_t* w, const float* rstd, const uint16_t* dy,
                      uint16_t* dx, float* dw, int64_t n, int64_t d, void* workspace,
                      size_t workspace_bytes, Stream stream) {
  backward_checked("cuda::rmsnorm_backward", false, x, w, rstd, dy, dx, nullptr, nullptr, dw, n, d, workspace,
                   workspace_bytes, stream);
}

void rmsnorm_backward_add(const uint16_t* x, const uint16_t* w, const float* rstd, const uint16_t* dy, float* acc,
                          uint16_t* acc_bf16, float* dw, int64_t n, int64_t d, void* workspace,
                          size_t workspace_bytes, Stream stream) {
  backward_checked("cuda::rmsnorm_backward_add", true, x, w, rstd, dy, nullptr, acc, acc_bf16, dw, n, d, workspace,
                   workspace_bytes, stream);
}

namespace {

constexpr int64_t kRopeTableAlign = 256;  // the (cos, sin) table after the partial dw rows

int64_t rope_table_offset(int64_t n, int64_t d) {
  return (static_cast<int64_t>(rmsnorm_backward_workspace_bytes(n, d)) + kRopeTableAlign - 1) / kRopeTableAlign *
         kRopeTableAlign;
}

}  // namespace

size_t rope_rmsnorm_backward_workspace_bytes(int64_t n, int64_t d, int64_t seq, int64_t head_dim) {
  MOE_CHECK(seq >= 0 && head_dim >= 0, "cuda::rope_rmsnorm_backward_workspace_bytes: expected seq, head_dim >= 0, got "
            "seq=", seq, " head_dim=", head_dim);
  return static_cast<size_t>(rope_table_offset(n, d) + seq * (head_dim / 2) * int64_t{sizeof(float2)});
}

bool rope_rmsnorm_backward_fuses(const uint16_t* x, const uint16_t* w, const uint16_t* dy, const uint16_t* dx,
                                 int64_t heads, int64_t head_dim) {
  // The kernel finds a column's place in its head by a 32-bit remainder: rows narrower than 2^31.
  return heads > 0 && head_dim > 0 && head_dim % 2 == 0 && (head_dim / 2) % kVecBf16 == 0 &&
         heads <= std::numeric_limits<int32_t>::max() / head_dim && detail::aligned16(x) && detail::aligned16(w) &&
         detail::aligned16(dy) && detail::aligned16(dx);
}

void rope_rmsnorm_backward(const uint16_t* x, const uint16_t* w, const float* rstd, const uint16_t* dy, uint16_t* dx,
                           float* dw, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double theta,
                           void* workspace, size_t workspace_bytes, Stream stream) {
  const char* op = "cuda::rope_rmsnorm_backward";
  MOE_CHECK(batch >= 0 && seq >= 0, op, ": expected batch, seq >= 0, got batch=", batch, " seq=", seq);
  MOE_CHECK(rope_rmsnorm_backward_fuses(x, w, dy, dx, heads, head_dim), op, ": expected heads > 0, head_dim / 2 a "
            "multiple of 8 and 16-byte aligned x, w, dy, dx (rope_rmsnorm_backward_fuses), got heads=", heads,
            " head_dim=", head_dim);
  MOE_CHECK(theta > 0.0 && std::isfinite(theta), op, ": expected a finite theta > 0, got ", theta);
  const int64_t n = batch * seq, d = heads * head_dim;
  check_sizes(op, n, d);
  if (n == 0) return;
  detail::check_ptrs(op, {{"rstd", rstd}, {"dw", dw}}, 4);
  detail::check_ptrs(op, {{"workspace", workspace}}, 16);
  const size_t need = rope_rmsnorm_backward_workspace_bytes(n, d, seq, head_dim);
  MOE_CHECK(workspace_bytes >= need, op, ": workspace of ", workspace_bytes, " bytes is too small, need ", need,
            " (rope_rmsnorm_backward_workspace_bytes(", n, ", ", d, ", ", seq, ", ", head_dim, "))");
  float* partial_dw = static_cast<float*>(workspace);
  auto* table = reinterpret_cast<float2*>(static_cast<unsigned char*>(workspace) + rope_table_offset(n, d));
  const int64_t entries = seq * (head_dim / 2);
  kernels::rope_cos_sin_table<<<static_cast<unsigned>(std::min<int64_t>((entries + 255) / 256, detail::kMaxGridX)),
                                256, 0, stream>>>(table, seq, static_cast<int>(head_dim), std::log2(theta));
  check_launch("rope_cos_sin_table");
  launch_rmsnorm_backward<kVecBf16, false, true>(x, w, rstd, dy, dx, dw, partial_dw, n, d, stream, nullptr, nullptr,
                                                 table, seq, static_cast<int>(head_dim));
}

}  // namespace moe::cuda
