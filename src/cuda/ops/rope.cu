// RoPE launchers and checked entry points. Grid (seq, min(batch, 65535)) (QK-norm with RoPE: (seq,
// batch / 4 rounded up), a warp per row); 128 threads; dynamic shared memory holds head_dim/2 (cos,
// sin) pairs. Vector path when (head_dim/2) % 8 == 0 and x
// is 16-byte aligned (every row's two halves then are too), else the scalar path.
#include "cuda/ops/rope.h"

#include <algorithm>
#include <cmath>

#include "cuda/common.h"
#include "cuda/kernels/rmsnorm_rope.cuh"
#include "cuda/kernels/rope.cuh"
#include "cuda/ops/launch.h"
#include "cuda/ops/rmsnorm.h"

namespace moe::cuda {
namespace {

using kernels::kVecBf16;

constexpr int64_t kMaxHeadDim = 8192;  // (cos, sin) table of head_dim/2 float2 = 32 KiB of shared memory

template <int V, bool kBackward>
void launch_rope(uint16_t* x, int64_t batch, int64_t seq, int64_t pos0, int64_t heads, int64_t head_dim,
                 double theta, Stream stream) {
  const dim3 grid(static_cast<unsigned>(seq), static_cast<unsigned>(std::min<int64_t>(batch, 65535)));
  const size_t smem = static_cast<size_t>(head_dim / 2) * sizeof(float2);
  kernels::rope_rotate_pairs<V, kBackward><<<grid, kernels::kRopeThreads, smem, stream>>>(
      x, batch, seq, pos0, static_cast<int>(heads), static_cast<int>(head_dim), std::log2(theta));
  check_launch(kBackward ? "rope_rotate_pairs<backward>" : "rope_rotate_pairs<forward>");
}

template <bool kBackward>
void rope_apply(const char* op, uint16_t* x, int64_t batch, int64_t seq, int64_t pos0, int64_t heads,
                int64_t head_dim, double theta, Stream stream) {
  MOE_CHECK(batch >= 0 && seq >= 0 && heads >= 0, op, ": expected batch, seq, heads >= 0, got batch=", batch,
            " seq=", seq, " heads=", heads);
  MOE_CHECK(head_dim > 0 && head_dim % 2 == 0 && head_dim <= kMaxHeadDim, op,
            ": expected an even head_dim in [2, ", kMaxHeadDim, "], got ", head_dim);
  MOE_CHECK(theta > 0.0 && std::isfinite(theta), op, ": expected a finite theta > 0, got ", theta);
  MOE_CHECK(pos0 >= 0 && pos0 <= (int64_t{1} << 40), op, ": expected a position offset in [0, 2^40], got ", pos0);
  MOE_CHECK(seq <= detail::kMaxGridX, op, ": seq=", seq, " exceeds ", detail::kMaxGridX);
  MOE_CHECK(heads * head_dim <= (int64_t{1} << 30), op, ": heads * head_dim = ", heads * head_dim,
            " exceeds 2^30");
  if (batch == 0 || seq == 0 || heads == 0) return;
  detail::check_ptrs(op, {{"x", x}}, 2);
  if ((head_dim / 2) % kVecBf16 == 0 && detail::aligned16(x)) {
    launch_rope<kVecBf16, kBackward>(x, batch, seq, pos0, heads, head_dim, theta, stream);
  } else {
    launch_rope<1, kBackward>(x, batch, seq, pos0, heads, head_dim, theta, stream);
  }
}

}  // namespace

void rope_forward(uint16_t* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double theta,
                  Stream stream) {
  rope_apply<false>("cuda::rope_forward", x, batch, seq, 0, heads, head_dim, theta, stream);
}

void rope_forward_at(uint16_t* x, int64_t n, int64_t pos0, int64_t heads, int64_t head_dim, double theta,
                     Stream stream) {
  rope_apply<false>("cuda::rope_forward_at", x, 1, n, pos0, heads, head_dim, theta, stream);
}

void rope_backward(uint16_t* dx, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double theta,
                   Stream stream) {
  rope_apply<true>("cuda::rope_backward", dx, batch, seq, 0, heads, head_dim, theta, stream);
}

void rmsnorm_rope_forward(const uint16_t* x, const uint16_t* w, uint16_t* y, float* rstd, int64_t batch, int64_t seq,
                          int64_t pos0, int64_t heads, int64_t head_dim, double eps, double theta, Stream stream) {
  const char* op = "cuda::rmsnorm_rope_forward";
  MOE_CHECK(pos0 == 0 || batch == 1, op, ": rows at a position offset are one sequence, got batch=", batch,
            " pos0=", pos0);
  MOE_CHECK(batch >= 0 && seq >= 0 && heads > 0, op, ": expected batch, seq >= 0 and heads > 0, got batch=", batch,
            " seq=", seq, " heads=", heads);
  MOE_CHECK(eps >= 0.0, op, ": expected eps >= 0, got ", eps);
  const int64_t n = batch * seq, d = heads * head_dim;
  const bool fused = head_dim > 0 && head_dim % 2 == 0 && head_dim <= kMaxHeadDim && (head_dim / 2) % kVecBf16 == 0 &&
                     detail::aligned16(x) && detail::aligned16(w) && detail::aligned16(y) && seq <= detail::kMaxGridX &&
                     d <= (int64_t{1} << 30) && theta > 0.0 && std::isfinite(theta) && pos0 >= 0 &&
                     pos0 <= (int64_t{1} << 40);
  if (!fused || n == 0) {  // the two ops (their checks name the bad argument)
    rmsnorm_forward(x, w, y, rstd, n, d, eps, stream);
    if (pos0 == 0) {
      rope_forward(y, batch, seq, heads, head_dim, theta, stream);
    } else {
      rope_forward_at(y, seq, pos0, heads, head_dim, theta, stream);
    }
    return;
  }
  detail::check_ptrs(op, {{"rstd", rstd}}, 4);
  // A warp per row: a block's warps take the rows of its position in several sequences, so that the
  // block's (cos, sin) table serves them all and no warp idles while batch >= the block's warps.
  constexpr int64_t kWarps = kernels::kRmsRopeThreads / kernels::kWarpSize;
  const dim3 grid(static_cast<unsigned>(seq), static_cast<unsigned>(std::min<int64_t>((batch + kWarps - 1) / kWarps,
                                                                                       65535)));
  const size_t smem = static_cast<size_t>(head_dim / 2) * sizeof(float2);
  kernels::rmsnorm_rope_forward_rows<<<grid, kernels::kRmsRopeThreads, smem, stream>>>(
      x, w, y, rstd, batch, seq, pos0, static_cast<int>(heads), static_cast<int>(head_dim), static_cast<float>(eps),
      std::log2(theta));
  check_launch("rmsnorm_rope_forward_rows");
}

}  // namespace moe::cuda
