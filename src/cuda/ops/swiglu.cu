// SwiGLU launchers and checked entry points. The 16-byte path runs when inner % 8 == 0 and
// every pointer is 16-byte aligned (then each row's gate and up halves are too); otherwise the
// scalar path. One kernel instantiation per vector width.
#include "cuda/ops/swiglu.h"

#include "cuda/common.h"
#include "cuda/kernels/swiglu.cuh"
#include "cuda/kernels/swiglu_fp8.cuh"
#include "cuda/ops/launch.h"

namespace moe::cuda {
namespace {

using kernels::kVecBf16;

void check_swiglu_args(const char* op, int64_t n, int64_t inner,
                       std::initializer_list<detail::NamedPtr> ptrs) {
  MOE_CHECK(n >= 0 && inner >= 0, op, ": expected n >= 0 and inner >= 0, got n=", n, " inner=", inner);
  if (n > 0 && inner > 0) detail::check_ptrs(op, ptrs, 2);
}

template <int V>
void launch_swiglu_forward(const uint16_t* gate_up, uint16_t* h, int64_t n, int64_t inner, Stream stream) {
  const auto l = detail::row_launch(n, inner / V);
  kernels::swiglu_forward_rows<V><<<l.grid, l.block, 0, stream>>>(gate_up, h, n, inner);
  check_launch("swiglu_forward_rows");
}

template <int V>
void launch_swiglu_backward(const uint16_t* gate_up, const uint16_t* dh, uint16_t* dgate_up, int64_t n,
                            int64_t inner, Stream stream) {
  const auto l = detail::row_launch(n, inner / V);
  kernels::swiglu_backward_rows<V><<<l.grid, l.block, 0, stream>>>(gate_up, dh, dgate_up, n, inner);
  check_launch("swiglu_backward_rows");
}

}  // namespace

void swiglu_forward(const uint16_t* gate_up, uint16_t* h, int64_t n, int64_t inner, Stream stream) {
  check_swiglu_args("cuda::swiglu_forward", n, inner, {{"gate_up", gate_up}, {"h", h}});
  if (n == 0 || inner == 0) return;
  if (inner % kVecBf16 == 0 && detail::aligned16(gate_up) && detail::aligned16(h)) {
    launch_swiglu_forward<kVecBf16>(gate_up, h, n, inner, stream);
  } else {
    launch_swiglu_forward<1>(gate_up, h, n, inner, stream);
  }
}

void swiglu_backward(const uint16_t* gate_up, const uint16_t* dh, uint16_t* dgate_up, int64_t n,
                     int64_t inner, Stream stream) {
  check_swiglu_args("cuda::swiglu_backward", n, inner,
                    {{"gate_up", gate_up}, {"dh", dh}, {"dgate_up", dgate_up}});
  if (n == 0 || inner == 0) return;
  if (inner % kVecBf16 == 0 && detail::aligned16(gate_up) && detail::aligned16(dh) &&
      detail::aligned16(dgate_up)) {
    launch_swiglu_backward<kVecBf16>(gate_up, dh, dgate_up, n, inner, stream);
  } else {
    launch_swiglu_backward<1>(gate_up, dh, dgate_up, n, inner, stream);
  }
}

namespace {

void check_swiglu_fp8(const char* op, int64_t n, int64_t inner, std::initializer_list<detail::NamedPtr> ptrs,
                      const float* scales) {
  MOE_CHECK(n >= 0 && inner >= 0 && inner % 128 == 0, op, ": expected n >= 0 and inner a multiple of 128 (whole "
            "1 x 128 blocks), got n=", n, " inner=", inner);
  if (n == 0 || inner == 0) return;
  detail::check_ptrs(op, ptrs, 16);
  detail::check_ptrs(op, {{"scales", scales}}, 4);
}

unsigned swiglu_fp8_grid(const char* op, int64_t blocks) {
  const int64_t grid = (blocks + kernels::kSwigluFp8BlocksPerCta - 1) / kernels::kSwigluFp8BlocksPerCta;
  MOE_CHECK(grid < (int64_t{1} << 31), op, ": ", blocks, " blocks exceed one launch's grid");
  return static_cast<unsigned>(grid);
}

}  // namespace

void swiglu_forward_fp8(const uint16_t* gate_up, uint16_t* h, uint8_t* q_h, float* s_h, int64_t n, int64_t inner,
                        Stream stream, Fp8Rule rule) {
  const char* op = "cuda::swiglu_forward_fp8";
  check_swiglu_fp8(op, n, inner, {{"gate_up", gate_up}, {"h", h}, {"q_h", q_h}}, s_h);
  if (n == 0 || inner == 0) return;
  const auto kernel =
      rule == Fp8Rule::kBlocks ? kernels::swiglu_forward_fp8_rows<false> : kernels::swiglu_forward_fp8_rows<true>;
  kernel<<<swiglu_fp8_grid(op, n * (inner / 128)), 32 * kernels::kSwigluFp8Warps, 0, stream>>>(gate_up, h, q_h, s_h,
                                                                                               n, inner, rule);
  check_launch("swiglu_forward_fp8_rows");
}

void swiglu_backward_fp8(const uint16_t* gate_up, const uint16_t* dh, uint16_t* dgate_up, uint8_t* q_dgu,
                         float* s_dgu, int64_t n, int64_t inner, Stream stream, Fp8Rule rule) {
  const char* op = "cuda::swiglu_backward_fp8";
  check_swiglu_fp8(op, n, inner, {{"gate_up", gate_up}, {"dh", dh}, {"dgate_up", dgate_up}, {"q_dgu", q_dgu}},
                   s_dgu);
  if (n == 0 || inner == 0) return;
  const auto kernel =
      rule == Fp8Rule::kBlocks ? kernels::swiglu_backward_fp8_rows<false> : kernels::swiglu_backward_fp8_rows<true>;
  kernel<<<swiglu_fp8_grid(op, n * (inner / 128)), 32 * kernels::kSwigluFp8Warps, 0, stream>>>(
      gate_up, dh, dgate_up, q_dgu, s_dgu, n, inner, rule);
  check_launch("swiglu_backward_fp8_rows");
}

}  // namespace moe::cuda
