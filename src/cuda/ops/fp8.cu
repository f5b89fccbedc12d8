// Launchers of the FP8 quantisation kernels (contract in cuda/ops/fp8.h): shape checks, one CTA
// per scaling block (threads: the block's element count rounded up to a warp, at most 256),
// grid-stride elementwise dequantisation.
#include "cuda/ops/fp8.h"

#include <algorithm>
#include <limits>

#include "cuda/common.h"
#include "cuda/kernels/fp8.cuh"
#include "cuda/ops/launch.h"

namespace moe::cuda {
namespace {

constexpr int64_t kMaxGrid = int64_t{1} << 31;

void check_shape(const char* op, int64_t rows, int64_t cols, Fp8Block block) {
  MOE_CHECK(rows >= 0 && cols >= 0, op, ": rows and cols must be >= 0, got ", rows, " x ", cols);
  MOE_CHECK(block.rows > 0 && block.cols > 0, op, ": block must be positive, got ", block.rows, " x ", block.cols);
}

kernels::Fp8BlockArgs block_args(int64_t rows, int64_t cols, Fp8Block block) {
  return {rows, cols, block.rows, block.cols, (cols + block.cols - 1) / block.cols};
}

unsigned elementwise_blocks(int64_t n) { return static_cast<unsigned>(std::clamp<int64_t>((n + 255) / 256, 1, 65536)); }

template <typename T>
void quantize_blocks(const char* op, const T* x, int64_t rows, int64_t cols, Fp8Block block, Fp8Format f, uint8_t* q,
                     float* scales, uint32_t* num_nonfinite, Stream stream, Fp8Rule rule) {
  check_shape(op, rows, cols, block);
  if (rows == 0 || cols == 0) return;
  detail::check_ptrs(op, {{"x", x}}, sizeof(T));
  detail::check_ptrs(op, {{"q", q}}, 1);
  detail::check_ptrs(op, {{"scales", scales}}, sizeof(float));
  const bool whole_rows = block.rows == 1 && block.cols == 128 && cols % 128 == 0 &&
                          reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(q) % 8 == 0;
  MOE_CHECK(rule == Fp8Rule::kBlocks || whole_rows, op, ": the MX rules quantise whole 1 x 128 blocks (cols a ",
            "multiple of 128, x 16-byte and q 8-byte aligned); got a ", block.rows, " x ", block.cols, " block over ",
            rows, " x ", cols);
  if (whole_rows) {
    // Whole 1 x 128 blocks: a half-warp per block (the same codes and scales as the generic kernel).
    const int64_t blocks = rows * (cols / 128);
    const int64_t grid = (blocks + kernels::kFp8RowBlocksPerCta - 1) / kernels::kFp8RowBlocksPerCta;
    MOE_CHECK(grid < kMaxGrid, op, ": ", blocks, " scaling blocks exceed one launch's grid");
    const auto kernel = rule == Fp8Rule::kBlocks ? kernels::fp8_quantize_rows128_kernel<T, false>
                                                 : kernels::fp8_quantize_rows128_kernel<T, true>;
    kernel<<<static_cast<unsigned>(grid), 32 * kernels::kFp8RowWarps, 0, stream>>>(x, blocks, cols / 128, cols, f, rule,
                                                                                  q, scales, num_nonfinite);
    check_launch("fp8_quantize_rows128_kernel");
    return;
  }
  const kernels::Fp8BlockArgs a = block_args(rows, cols, block);
  const int64_t grid = ((rows + block.rows - 1) / block.rows) * a.scale_cols;
  MOE_CHECK(grid < kMaxGrid, op, ": ", grid, " scaling blocks exceed one launch's grid");
  const int64_t elems = std::min(block.rows, rows) * std::min(block.cols, cols);
  const int threads = static_cast<int>(std::clamp<int64_t>((elems + 31) / 32 * 32, 32, kernels::kFp8MaxThreads));
  kernels::fp8_quantize_blocks_kernel<T><<<static_cast<unsigned>(grid), threads, 0, stream>>>(x, a, f, q, scales,
                                                                                              num_nonfinite);
  check_launch("fp8_quantize_blocks_kernel");
}

template <typename T>
void mx_quantize_impl(const char* op, const T* x, int64_t rows, int64_t cols, Fp8Format f, MxScale rule, uint8_t* q,
                      uint8_t* scales, uint32_t* num_nonfinite, Stream stream) {
  check_shape(op, rows, cols, {1, kMxBlock});
  if (rows == 0 || cols == 0) return;
  detail::check_ptrs(op, {{"x", x}}, sizeof(T));
  detail::check_ptrs(op, {{"q", q}, {"scales_e8m0", scales}}, 1);
  const int64_t scale_cols = (cols + kMxBlock - 1) / kMxBlock, grid = rows * scale_cols;
  MOE_CHECK(grid < kMaxGrid, op, ": ", grid, " scaling blocks exceed one launch's grid");
  kernels::mx_quantize_kernel<T><<<static_cast<unsigned>(grid), 32, 0, stream>>>(x, rows, cols, scale_cols, f, rule, q,
                                                                                 scales, num_nonfinite);
  check_launch("mx_quantize_kernel");
}

template <typename T>
void quantize_weights(const char* op, const T* w, int64_t experts, int64_t n, int64_t k, Fp8Format f, uint8_t* q,
                      float* s, uint8_t* qt, float* st, uint32_t* num_nonfinite, Stream stream, Fp8Rule rule) {
  MOE_CHECK(experts >= 0 && n >= 0 && k >= 0, op, ": experts, n and k must be >= 0, got ", experts, ", ", n, ", ", k);
  MOE_CHECK((qt == nullptr) == (st == nullptr), op, ": the transposed codes and their scales come together (qt ",
            qt == nullptr ? "null" : "set", ", st ", st == nullptr ? "null" : "set", ")");
  if (experts == 0 || n == 0 || k == 0) return;
  detail::check_ptrs(op, {{"w", w}}, sizeof(T));
  detail::check_ptrs(op, {{"s", s}}, sizeof(float));
  const int64_t nb = (n + 127) / 128, kb = (k + 127) / 128, grid = experts * nb * kb;
  MOE_CHECK(grid < kMaxGrid, op, ": ", grid, " scaling blocks exceed one launch's grid");
  const auto aligned = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool whole = n % 128 == 0 && k % 128 == 0 && aligned(w) && aligned(q) && aligned(qt);
  MOE_CHECK(rule == Fp8Rule::kBlocks || whole, op, ": the MX rules quantise whole 128 x 128 blocks (n and k ",
            "multiples of 128, w, q and qt 16-byte aligned); got n ", n, ", k ", k);
  if (whole) {
    // Whole blocks: vector loads and stores (the same codes and scales as the generic kernel).
    if (rule == Fp8Rule::kBlocks) {
      kernels::fp8_quantize_weights_whole_kernel<T, false>
          <<<static_cast<unsigned>(grid), kernels::kFp8WeightThreads, 0, stream>>>(w, n, k, f, rule, q, s, qt, st,
                                                                                   num_nonfinite);
    } else {
      kernels::fp8_quantize_weights_whole_kernel<T, true>
          <<<static_cast<unsigned>(grid), kernels::kFp8WeightThreads, 0, stream>>>(w, n, k, f, rule, q, s, qt, st,
                                                                                   num_nonfinite);
    }
    check_launch("fp8_quantize_weights_whole_kernel");
    return;
  }
  kernels::fp8_quantize_weights_kernel<T><<<static_cast<unsigned>(grid), kernels::kFp8WeightThreads, 0, stream>>>(
      w, n, k, nb, kb, f, q, s, qt, st, num_nonfinite);
  check_launch("fp8_quantize_weights_kernel");
}

}  // namespace

void fp8_quantize_blocks(const float* x, int64_t rows, int64_t cols, Fp8Block block, Fp8Format f, uint8_t* q,
                         float* scales, uint32_t* num_nonfinite, Stream stream, Fp8Rule rule) {
  quantize_blocks("cuda::fp8_quantize_blocks", x, rows, cols, block, f, q, scales, num_nonfinite, stream, rule);
}

void fp8_quantize_blocks(const uint16_t* x_bf16, int64_t rows, int64_t cols, Fp8Block block, Fp8Format f, uint8_t* q,
                         float* scales, uint32_t* num_nonfinite, Stream stream, Fp8Rule rule) {
  quantize_blocks("cuda::fp8_quantize_blocks (bf16)", x_bf16, rows, cols, block, f, q, scales, num_nonfinite, stream,
                  rule);
}

void fp8_quantize_rows_into(const uint16_t* x_bf16, int64_t rows, int64_t cols, int64_t ldq, Fp8Format f, uint8_t* q,
                            float* scales, uint32_t* num_nonfinite, Stream stream, Fp8Rule rule) {
  const char* op = "cuda::fp8_quantize_rows_into";
  MOE_CHECK(rows >= 0 && cols > 0 && cols % 128 == 0 && ldq >= cols && ldq % 8 == 0, op,
            ": expected rows >= 0, cols a positive multiple of 128 and ldq >= cols a multiple of 8, got rows ", rows,
            ", cols ", cols, ", ldq ", ldq);
  if (rows == 0) return;
  detail::check_ptrs(op, {{"x", x_bf16}}, 16);
  detail::check_ptrs(op, {{"q", q}}, 8);
  detail::check_ptrs(op, {{"scales", scales}}, sizeof(float));
  const int64_t blocks = rows * (cols / 128);
  const int64_t grid = (blocks + kernels::kFp8RowBlocksPerCta - 1) / kernels::kFp8RowBlocksPerCta;
  MOE_CHECK(grid < kMaxGrid, op, ": ", blocks, " scaling blocks exceed one launch's grid");
  const auto kernel = rule == Fp8Rule::kBlocks ? kernels::fp8_quantize_rows128_kernel<uint16_t, false>
                                               : kernels::fp8_quantize_rows128_kernel<uint16_t, true>;
  kernel<<<static_cast<unsigned>(grid), 32 * kernels::kFp8RowWarps, 0, stream>>>(x_bf16, blocks, cols / 128, ldq, f,
                                                                                rule, q, scales, num_nonfinite);
  check_launch("fp8_quantize_rows128_kernel");
}

void fp8_dequantize_blocks(const uint8_t* q, const float* scales, int64_t rows, int64_t cols, Fp8Block block,
                           Fp8Format f, float* x, Stream stream) {
  const char* op = "cuda::fp8_dequantize_blocks";
  check_shape(op, rows, cols, block);
  if (rows == 0 || cols == 0) return;
  detail::check_ptrs(op, {{"q", q}}, 1);
  detail::check_ptrs(op, {{"scales", scales}, {"x", x}}, sizeof(float));
  kernels::fp8_dequantize_blocks_kernel<<<elementwise_blocks(rows * cols), 256, 0, stream>>>(
      q, scales, block_args(rows, cols, block), f, x);
  check_launch("fp8_dequantize_blocks_kernel");
}

void mx_quantize(const float* x, int64_t rows, int64_t cols, Fp8Format f, MxScale rule, uint8_t* q,
                 uint8_t* scales_e8m0, uint32_t* num_nonfinite, Stream stream) {
  mx_quantize_impl("cuda::mx_quantize", x, rows, cols, f, rule, q, scales_e8m0, num_nonfinite, stream);
}

void mx_quantize(const uint16_t* x_bf16, int64_t rows, int64_t cols, Fp8Format f, MxScale rule, uint8_t* q,
                 uint8_t* scales_e8m0, uint32_t* num_nonfinite, Stream stream) {
  mx_quantize_impl("cuda::mx_quantize (bf16)", x_bf16, rows, cols, f, rule, q, scales_e8m0, num_nonfinite, stream);
}

void mx_dequantize(const uint8_t* q, const uint8_t* scales_e8m0, int64_t rows, int64_t cols, Fp8Format f, float* x,
                   Stream stream) {
  const char* op = "cuda::mx_dequantize";
  check_shape(op, rows, cols, {1, kMxBlock});
  if (rows == 0 || cols == 0) return;
  detail::check_ptrs(op, {{"q", q}, {"scales_e8m0", scales_e8m0}}, 1);
  detail::check_ptrs(op, {{"x", x}}, sizeof(float));
  kernels::mx_dequantize_kernel<<<elementwise_blocks(rows * cols), 256, 0, stream>>>(
      q, scales_e8m0, rows, cols, (cols + kMxBlock - 1) / kMxBlock, f, x);
  check_launch("mx_dequantize_kernel");
}

void mx_to_blocks128(const uint8_t* q, const uint8_t* scales_e8m0, int64_t rows, int64_t cols, Fp8Format f,
                     uint8_t* q_out, float* scales_out, unsigned long long* changed, uint32_t* nan_scales,
                     Stream stream) {
  const char* op = "cuda::mx_to_blocks128";
  check_shape(op, rows, cols, {1, kMxBlock});
  if (rows == 0 || cols == 0) return;
  detail::check_ptrs(op, {{"q", q}, {"scales_e8m0", scales_e8m0}, {"q_out", q_out}}, 1);
  detail::check_ptrs(op, {{"scales_out", scales_out}}, sizeof(float));
  const int64_t out_cols = (cols + 127) / 128, blocks = rows * out_cols;
  MOE_CHECK(blocks <= std::numeric_limits<int32_t>::max(), op, ": ", rows, " x ", out_cols,
            " blocks exceed one launch's grid");
  kernels::mx_to_blocks128_kernel<<<static_cast<unsigned>(blocks), 32, 0, stream>>>(
      q, scales_e8m0, cols, (cols + kMxBlock - 1) / kMxBlock, out_cols, f, q_out, scales_out, changed, nan_scales);
  check_launch("mx_to_blocks128_kernel");
}

void mx_scales_tiled(const uint8_t* scales_e8m0, int64_t rows, int64_t cols, uint8_t* out, Stream stream) {
  const char* op = "cuda::mx_scales_tiled";
  MOE_CHECK(rows >= 0 && cols >= 0, op, ": expected rows, cols >= 0, got ", rows, " x ", cols);
  const int64_t bytes = mx_scales_tiled_bytes(rows, cols);
  if (bytes == 0) return;
  detail::check_ptrs(op, {{"scales_e8m0", scales_e8m0}, {"out", out}}, 1);
  const int64_t blocks = std::min<int64_t>((bytes + 255) / 256, 65536);
  kernels::mx_scales_tiled_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(scales_e8m0, rows, cols, out,
                                                                                      bytes);
  check_launch("mx_scales_tiled_kernel");
}

void fp8_quantize_weights(const float* w, int64_t experts, int64_t n, int64_t k, Fp8Format f, uint8_t* q, float* s,
                          uint8_t* qt, float* st, uint32_t* num_nonfinite, Stream stream, Fp8Rule rule) {
  quantize_weights("cuda::fp8_quantize_weights", w, experts, n, k, f, q, s, qt, st, num_nonfinite, stream, rule);
}

void fp8_quantize_weights(const uint16_t* w_bf16, int64_t experts, int64_t n, int64_t k, Fp8Format f, uint8_t* q,
                          float* s, uint8_t* qt, float* st, uint32_t* num_nonfinite, Stream stream, Fp8Rule rule) {
  quantize_weights("cuda::fp8_quantize_weights (bf16)", w_bf16, experts, n, k, f, q, s, qt, st, num_nonfinite,
                   stream, rule);
}

void fp8_quantize_weights_bf16_rounded(const float* w, int64_t experts, int64_t n, int64_t k, Fp8Format f, uint8_t* q,
                                       float* s, uint8_t* qt, float* st, uint32_t* num_nonfinite, Stream stream,
                                       Fp8Rule rule) {
  quantize_weights("cuda::fp8_quantize_weights_bf16_rounded", reinterpret_cast<const kernels::Bf16OfF32*>(w), experts,
                   n, k, f, q, s, qt, st, num_nonfinite, stream, rule);
}

void fp8_scales_k_major(const float* s, int64_t rows, int64_t kb, int64_t ld, float* out, Stream stream) {
  const char* op = "cuda::fp8_scales_k_major";
  MOE_CHECK(rows >= 0 && kb >= 0 && ld >= rows, op, ": expected rows, kb >= 0 and ld >= rows, got rows ", rows,
            ", kb ", kb, ", ld ", ld);
  if (kb == 0 || ld == 0) return;
  if (rows > 0) detail::check_ptrs(op, {{"s", s}}, sizeof(float));
  detail::check_ptrs(op, {{"out", out}}, sizeof(float));
  kernels::fp8_scales_k_major_kernel<<<elementwise_blocks(kb * ld), 256, 0, stream>>>(s, rows, kb, ld, out);
  check_launch("fp8_scales_k_major_kernel");
}

int64_t fp8_expert_columns_capacity(int64_t max_rows, int64_t num_experts) {
  MOE_CHECK(max_rows >= 0 && num_experts > 0, "cuda::fp8_expert_columns_capacity: expected max_rows >= 0 and ",
            "num_experts > 0, got ", max_rows, " and ", num_experts);
  return (max_rows + 127) / 128 * 128 + 128 * num_experts;
}

void fp8_quantize_expert_columns(const uint16_t* x_bf16, const int32_t* offsets, int64_t max_rows,
                                 int64_t num_experts, int64_t width, int64_t capacity, Fp8Format f, uint8_t* q_t,
                                 float* scales_t, int32_t* padded_offsets, uint32_t* num_nonfinite, Stream stream) {
  const char* op = "cuda::fp8_quantize_expert_columns";
  MOE_CHECK(max_rows >= 0 && width > 0 && num_experts > 0, op, ": expected max_rows >= 0, width > 0 and ",
            "num_experts > 0, got ", max_rows, ", ", width, " and ", num_experts);
  MOE_CHECK(width % 8 == 0, op, ": width ", width, " must be a multiple of 8 (rows are read in 16-byte words)");
  const int64_t need = fp8_expert_columns_capacity(max_rows, num_experts);
  MOE_CHECK(capacity >= need && capacity % 16 == 0, op, ": capacity ", capacity, " must be a multiple of 16 and at ",
            "least ", need, " (fp8_expert_columns_capacity)");
  MOE_CHECK(max_rows <= std::numeric_limits<int32_t>::max() - 128 * num_experts, op, ": ", max_rows, " rows and ",
            num_experts, " experts overflow the int32 padded offsets");
  detail::check_ptrs(op, {{"x", x_bf16}, {"q_t", q_t}}, 16);
  detail::check_ptrs(op, {{"offsets", offsets}, {"padded_offsets", padded_offsets}, {"scales_t", scales_t}}, 4);
  kernels::fp8_expert_padded_offsets_kernel<<<1, 32, 0, stream>>>(offsets, static_cast<int>(num_experts),
                                                                 static_cast<int>(max_rows), padded_offsets);
  check_launch("fp8_expert_padded_offsets_kernel");
  const int64_t blocks = capacity / 128;
  MOE_CHECK(blocks <= std::numeric_limits<int32_t>::max() && (width + 63) / 64 <= 65535, op, ": ", blocks,
            " row blocks x ", (width + 63) / 64, " column tiles exceed one launch");
  if (blocks == 0) return;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>((width + 63) / 64));
  kernels::fp8_quantize_expert_columns_kernel<<<grid, kernels::kFp8ColumnThreads, 0, stream>>>(
      x_bf16, offsets, padded_offsets, static_cast<int>(num_experts), static_cast<int>(max_rows),
      static_cast<int>(width), capacity, f, q_t, scales_t, num_nonfinite);
  check_launch("fp8_quantize_expert_columns_kernel");
}

int64_t fp8_row_payload_bytes(int64_t cols) {
  MOE_CHECK(cols >= 0 && cols % 128 == 0, "cuda::fp8_row_payload_bytes: cols must be a non-negative multiple of 128, ",
            "got ", cols);
  return cols + 4 * (cols / 128);
}

namespace {

// The payload row stride: `stride` (0: the packed row's bytes), checked.
int64_t payload_stride(const char* op, int64_t cols, int64_t stride) {
  const int64_t per = fp8_row_payload_bytes(cols);
  if (stride == 0) return per;
  MOE_CHECK(stride >= per && stride % 4 == 0, op, ": payload rows ", stride, " bytes apart; expected a multiple of 4 ",
            "of at least ", per, " (", cols, " codes and their scales)");
  return stride;
}

}  // namespace

void fp8_pack_rows(const uint16_t* x_bf16, int64_t rows, int64_t cols, Fp8Format f, uint8_t* payload,
                   uint32_t* num_nonfinite, Stream stream, int64_t stride, Fp8Rule rule) {
  const char* op = "cuda::fp8_pack_rows";
  MOE_CHECK(rows >= 0, op, ": rows must be >= 0, got ", rows);
  const int64_t per = payload_stride(op, cols, stride);
  if (rows == 0 || cols == 0) return;
  detail::check_ptrs(op, {{"x", x_bf16}, {"payload", payload}}, 16);
  const int64_t blocks = rows * (cols / 128);
  const int64_t grid = (blocks + kernels::kFp8RowBlocksPerCta - 1) / kernels::kFp8RowBlocksPerCta;
  MOE_CHECK(grid <= kMaxGrid, op, ": ", rows, " rows of ", cols, " exceed one launch");
  const auto kernel =
      rule == Fp8Rule::kBlocks ? kernels::fp8_pack_rows_kernel<false> : kernels::fp8_pack_rows_kernel<true>;
  kernel<<<static_cast<unsigned>(grid), 32 * kernels::kFp8RowWarps, 0, stream>>>(x_bf16, blocks, cols / 128, cols,
                                                                                per, f, rule, payload, num_nonfinite);
  check_launch("fp8_pack_rows_kernel");
}

void fp8_unpack_rows(const uint8_t* payload, int64_t rows, int64_t cols, Fp8Format f, uint8_t* codes, float* scales,
                     uint16_t* out_bf16, Stream stream, int64_t stride) {
  const char* op = "cuda::fp8_unpack_rows";
  MOE_CHECK(rows >= 0, op, ": rows must be >= 0, got ", rows);
  const int64_t per = payload_stride(op, cols, stride);
  if (rows == 0 || cols == 0) return;
  detail::check_ptrs(op, {{"payload", payload}}, 16);
  if (codes != nullptr) detail::check_ptrs(op, {{"codes", codes}}, 8);
  if (scales != nullptr) detail::check_ptrs(op, {{"scales", scales}}, sizeof(float));
  if (out_bf16 != nullptr) detail::check_ptrs(op, {{"out", out_bf16}}, 16);
  const unsigned grid = elementwise_blocks(rows * (cols / 8));
  kernels::fp8_unpack_rows_kernel<<<grid, 256, 0, stream>>>(payload, rows, cols, per, f, codes, scales, out_bf16);
  check_launch("fp8_unpack_rows_kernel");
}

}  // namespace moe::cuda
