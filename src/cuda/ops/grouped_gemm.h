// Grouped GEMMs of the MoE experts on the GPU, with the per-expert row groups on the device:
// expert e owns the sorted rows [expert_offsets[e], expert_offsets[e+1]) of x / y / dy / dx
// (int32 [E+1] device array, from the GPU counting sort; the host never reads it). Launch sizes
// come from static bounds only (max_rows = T * k, E, n, k), so every call is graph-capturable.
// BF16 operands (uint16_t bit patterns), FP32 accumulation; weights w are [E, n, k] row-major.
// Two kernel families, same contract and results within the GEMM tolerance: wgmma (sm_90 only:
// TMA + wgmma, grouped_gemm_sm90.cuh, about 2x faster) and mma (mma.sync, grouped_gemm.cuh).
// Every shape the checks accept runs on either; no call is sent to the other backend.
#pragma once

#include <cstdint>

#include "core/square_blocks.h"
#include "cuda/device.h"

namespace moe::cuda {

// Which kernels an entry point uses. kAuto: the environment variable MOECORE_GROUPED_GEMM
// ("mma" or "wgmma") when set, else wgmma on a compute capability 9.0 device and mma elsewhere.
enum class GroupedGemmBackend { kAuto, kMma, kWgmma };

// "auto", "mma" or "wgmma".
const char* grouped_gemm_backend_name(GroupedGemmBackend backend);

// The backend `requested` runs on for the current device (never kAuto). Throws moe::Error when
// MOECORE_GROUPED_GEMM holds another value, or when wgmma is asked for (by argument or variable)
// on a device that is not compute capability 9.0.
GroupedGemmBackend grouped_gemm_resolve_backend(GroupedGemmBackend requested = GroupedGemmBackend::kAuto);

// Whether the current device runs the wgmma backend (compute capability 9.0); false without a GPU.
bool grouped_gemm_wgmma_available();

// Forward, M-grouped contiguous: y[r, :] = x[r, :] @ w[e]^T for the rows r of expert e.
// x [max_rows, k], w [E, n, k], y [max_rows, n] (BF16). Rows outside [offsets[0], offsets[E])
// (the dispatcher's dropped tail) are never written and never change a result, by every entry
// point here (the wgmma kernels may load some of them into a tile whose products they discard).
// n and k must be multiples of 8, pointers 16-byte aligned.
void grouped_gemm_forward(const uint16_t* x, const uint16_t* w, const int32_t* expert_offsets, uint16_t* y,
                          int64_t max_rows, int64_t num_experts, int64_t n, int64_t k, Stream stream,
                          GroupedGemmBackend backend = GroupedGemmBackend::kAuto);

// Data gradient, M-grouped contiguous: dx[r, :] = dy[r, :] @ w[e] for the rows r of expert e.
// dy [max_rows, n], w [E, n, k] (read as is, no transposed copy), dx [max_rows, k] (BF16,
// overwritten on the grouped rows only).
void grouped_gemm_dgrad(const uint16_t* dy, const uint16_t* w, const int32_t* expert_offsets, uint16_t* dx,
                        int64_t max_rows, int64_t num_experts, int64_t n, int64_t k, Stream stream,
                        GroupedGemmBackend backend = GroupedGemmBackend::kAuto);

// Weight gradient, K-grouped: dw[e] = dy_e^T @ x_e (+ dw[e] when accumulate), the sum over the
// rows of expert e. dy [max_rows, n], x [max_rows, k] (BF16), dw [E, n, k] FP32. An expert with
// no rows leaves dw[e] bitwise unchanged (accumulate) or zeroes it (overwrite). Deterministic:
// each dw tile is reduced by one CTA over the expert's rows in order (no row split, no two writers
// of an element). Accumulate: both backends add dw[e] to the finished sum in one FP32 add (mma in
// registers; wgmma by a TMA reduce-add of the tile into dw, done in L2, subnormals flushed).
// squares (overwrite only; null: none): also the sum of squares of each 128 x 128 block of the dw
// this call writes, square_blocks(E, n, k) FP64 values in core/square_blocks.h's order, each summed
// by the CTA that computed the block in a fixed order (deterministic; cpu::block_square_sums is the
// twin, equal up to the order of the FP64 sum), at no extra read of dw.
void grouped_gemm_wgrad(const uint16_t* dy, const uint16_t* x, const int32_t* expert_offsets, float* dw,
                        int64_t max_rows, int64_t num_experts, int64_t n, int64_t k, bool accumulate,
                        Stream stream, GroupedGemmBackend backend = GroupedGemmBackend::kAuto,
                        double* squares = nullptr);

// The CTAs of the wgmma weight gradient on a grid of at most `grid` (the multiprocessors it may
// use), when each expert has `tiles_per_expert` output tiles: the CTAs take tiles in rounds of the
// grid's size, expert by expert, so a grid that is a multiple of an expert's tiles (or divides
// them) gives rounds of whole experts, whose operands each round reads from DRAM once and then
// from L2. The largest such grid is taken when it keeps at least 95% of `grid` (132 -> 128 for
// olmoe-8l's 128 and 64 tiles an expert); otherwise `grid`. Any grid gives the same bits.
int wgrad_grid(int grid, int64_t tiles_per_expert);

// Block-scaled FP8 (E4M3 x E4M3), M-grouped contiguous, sm_90 only: for the rows r of expert e,
//   out[r, j] = sum over K blocks b of (sum_{p in b} qa[r, p] qb[e, j, p]) * sa[r, b] * sb[e, j / 128, b]
// (FP32 partial sums promoted per block of 128 K elements, cpu::fp8_gemm_block_scaled per expert).
// qa [max_rows, k] codes with 1 x 128 scales sa [max_rows, ceil(k / 128)] (cuda::fp8_quantize_blocks'
// row-major layout); qb [E, n, k] codes with 128 x 128 scales sb [E, ceil(n / 128), ceil(k / 128)];
// out [max_rows, n] BF16 on the grouped rows only. The forward (qb: W's codes) and the data gradient
// (qb: the transposed copy of W's codes and scales, cuda::fp8_transpose_blocks). n a multiple of 8,
// k of 16; 16-byte aligned code and output pointers.
void grouped_gemm_fp8(const uint8_t* qa, const float* sa, const uint8_t* qb, const float* sb,
                      const int32_t* expert_offsets, uint16_t* out, int64_t max_rows, int64_t num_experts, int64_t n,
                      int64_t k, Stream stream);

// The experts' FP8 weight gradient, K-grouped over each expert's rows (sm_90 only): for every
// expert e, dw[e] [n, k] (+)= sum over the K blocks b of its padded rows (padded_offsets[e] / 128 ..
// padded_offsets[e + 1] / 128, as cuda::fp8_quantize_expert_columns writes them) of
//   (sum_{p in b} qa_t[i, p] qb_t[j, p]) * sa_t[b, i] * sb_t[b, j],
// qa_t [n, capacity] and qb_t [k, capacity] the codes of dy^T and x^T down the rows (E4M3), sa_t
// [capacity / 128, n] and sb_t [capacity / 128, k] their scales: dw = dy_e^T x_e on the quantised
// operands, per expert cpu::fp8_gemm_rowwise_scaled of its blocks. FP32 dw [E, n, k]: overwritten
// (experts with no rows get zeros) or accumulated. n and k multiples of 128; capacity a multiple
// of 16; 16-byte aligned codes and dw.
void grouped_gemm_fp8_wgrad(const uint8_t* qa_t, const float* sa_t, const uint8_t* qb_t, const float* sb_t,
                            const int32_t* padded_offsets, float* dw, int64_t num_experts, int64_t n, int64_t k,
                            int64_t capacity, bool accumulate, Stream stream);

// Largest num_experts the entry points accept (the M-grouped schedule lives in shared memory).
inline constexpr int64_t kGroupedGemmMaxExperts = 4096;

}  // namespace moe::cuda
