// Embedding launchers and checked entry points. Forward copies 16 bytes at a time when d % 8 == 0
// and w, out are 16-byte aligned. Backward = keys kernel, CUB stable radix sort of (key,
// position) over the low bits that can hold `vocab`, then the segment kernel. Workspace layout
// (each part 256-byte aligned): keys_in, keys_out, positions_in, positions_out ([n] uint32
// each), then CUB's temporary storage.
#include "cuda/ops/embedding.h"

#include <algorithm>
#include <bit>
#include <cub/device/device_radix_sort.cuh>
#include <limits>

#include "cuda/common.h"
#include "cuda/kernels/embedding.cuh"
#include "cuda/ops/launch.h"

namespace moe::cuda {
namespace {

using kernels::kVecBf16;

constexpr size_t kWorkspaceAlign = 256;

size_t align_up(size_t x) { return (x + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

// Keys are in [0, vocab]: sort only the bits that can be set.
int sort_end_bit(int64_t vocab) { return std::bit_width(static_cast<uint64_t>(vocab)); }

size_t cub_sort_bytes(int64_t n, int64_t vocab) {
  size_t bytes = 0;
  MOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint32_t*>(nullptr),
                                                 static_cast<uint32_t*>(nullptr),
                                                 static_cast<const uint32_t*>(nullptr),
                                                 static_cast<uint32_t*>(nullptr), static_cast<int>(n), 0,
                                                 sort_end_bit(vocab)));
  return bytes;
}

void check_sizes(const char* op, int64_t n, int64_t vocab, int64_t d) {
  MOE_CHECK(n >= 0 && vocab > 0 && d >= 0, op, ": expected n >= 0, vocab > 0, d >= 0, got n=", n,
            " vocab=", vocab, " d=", d);
  MOE_CHECK(n <= std::numeric_limits<int32_t>::max(), op, ": n=", n, " tokens exceed 2^31 - 1");
  MOE_CHECK(vocab < std::numeric_limits<int32_t>::max(), op, ": vocab=", vocab, " must be below 2^31 - 1");
}

template <int V>
void launch_embedding_forward(const int32_t* ids, const uint16_t* w, uint16_t* out, int64_t n, int64_t vocab,
                              int64_t d, uint32_t* num_bad_ids, Stream stream) {
  const auto l = detail::row_launch(n, d / V);
  kernels::embedding_forward_rows<V><<<l.grid, l.block, 0, stream>>>(ids, w, out, n, vocab, d, num_bad_ids);
  check_launch("embedding_forward_rows");
}

template <int V>
void launch_embedding_accumulate(const uint32_t* keys, const uint32_t* positions, const uint16_t* dout,
                                 float* dw, int64_t n, int64_t vocab, int64_t d, Stream stream) {
  const dim3 block(kernels::kWarpSize, kernels::kEmbeddingSegmentsPerBlock);
  const int64_t vecs = d / V;
  const int64_t chunks = (vecs + kernels::kWarpSize - 1) / kernels::kWarpSize;
  MOE_CHECK(chunks <= 65535, "cuda::embedding_backward: d=", d, " is too wide (at most ",
            int64_t{65535} * kernels::kWarpSize * V, " for this alignment)");
  const dim3 grid(static_cast<unsigned>((n + block.y - 1) / block.y), static_cast<unsigned>(chunks));
  kernels::embedding_accumulate_segments<V><<<grid, block, 0, stream>>>(keys, positions, dout, dw, n, vocab, d);
  check_launch("embedding_accumulate_segments");
}

}  // namespace

void embedding_forward(const int32_t* ids, const uint16_t* w, uint16_t* out, int64_t n, int64_t vocab,
                       int64_t d, uint32_t* num_bad_ids, Stream stream) {
  const char* op = "cuda::embedding_forward";
  check_sizes(op, n, vocab, d);
  if (n == 0 || d == 0) return;
  detail::check_ptrs(op, {{"ids", ids}, {"num_bad_ids", num_bad_ids}}, 4);
  detail::check_ptrs(op, {{"w", w}, {"out", out}}, 2);
  if (d % kVecBf16 == 0 && detail::aligned16(w) && detail::aligned16(out)) {
    launch_embedding_forward<kVecBf16>(ids, w, out, n, vocab, d, num_bad_ids, stream);
  } else {
    launch_embedding_forward<1>(ids, w, out, n, vocab, d, num_bad_ids, stream);
  }
}

size_t embedding_backward_workspace_bytes(int64_t n, int64_t vocab) {
  check_sizes("cuda::embedding_backward_workspace_bytes", n, vocab, 1);
  if (n == 0) return 0;
  return 4 * align_up(static_cast<size_t>(n) * sizeof(uint32_t)) + align_up(cub_sort_bytes(n, vocab));
}

void embedding_backward(const int32_t* ids, const uint16_t* dout, float* dw, int64_t n, int64_t vocab,
                        int64_t d, uint32_t* num_bad_ids, void* workspace, size_t workspace_bytes,
                        Stream stream) {
  const char* op = "cuda::embedding_backward";
  check_sizes(op, n, vocab, d);
  if (n == 0 || d == 0) return;
  detail::check_ptrs(op, {{"ids", ids}, {"num_bad_ids", num_bad_ids}, {"dw", dw}}, 4);
  detail::check_ptrs(op, {{"dout", dout}}, 2);
  detail::check_ptrs(op, {{"workspace", workspace}}, kWorkspaceAlign);
  const size_t part = align_up(static_cast<size_t>(n) * sizeof(uint32_t));
  size_t sort_bytes = cub_sort_bytes(n, vocab);
  const size_t need = 4 * part + align_up(sort_bytes);
  MOE_CHECK(workspace_bytes >= need, op, ": workspace of ", workspace_bytes, " bytes is too small, need ", need,
            " (embedding_backward_workspace_bytes(", n, ", ", vocab, "))");

  char* base = static_cast<char*>(workspace);
  auto* keys_in = reinterpret_cast<uint32_t*>(base);
  auto* keys_out = reinterpret_cast<uint32_t*>(base + part);
  auto* pos_in = reinterpret_cast<uint32_t*>(base + 2 * part);
  auto* pos_out = reinterpret_cast<uint32_t*>(base + 3 * part);
  void* sort_temp = base + 4 * part;

  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, detail::kMaxGridX);
  kernels::embedding_make_sort_keys<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(ids, keys_in, pos_in,
                                                                                           n, vocab, num_bad_ids);
  check_launch("embedding_make_sort_keys");
  MOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_temp, sort_bytes, keys_in, keys_out, pos_in, pos_out,
                                                 static_cast<int>(n), 0, sort_end_bit(vocab), stream));
  if (d % kVecBf16 == 0 && detail::aligned16(dout) && detail::aligned16(dw)) {
    launch_embedding_accumulate<kVecBf16>(keys_out, pos_out, dout, dw, n, vocab, d, stream);
  } else {
    launch_embedding_accumulate<1>(keys_out, pos_out, dout, dw, n, vocab, d, stream);
  }
}

}  // namespace moe::cuda
