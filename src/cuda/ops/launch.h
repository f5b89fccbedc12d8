// Host-side launch helpers shared by the op launchers: alignment tests that pick the 16-byte
// vector path, and the block/grid shape of "rows x vectors" kernels (threadIdx.x walks the
// vectors of a row, threadIdx.y the rows of a block; grid-stride over rows beyond the grid).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "core/error.h"

namespace moe::cuda::detail {

constexpr int kRowBlockThreads = 256;
constexpr int64_t kMaxGridX = int64_t{1} << 30;

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

struct NamedPtr {
  const char* name;
  const void* ptr;
};

// Every pointer non-null and aligned to its element size (`align` bytes); the message names
// the op and the argument.
inline void check_ptrs(const char* op, std::initializer_list<NamedPtr> ptrs, uintptr_t align) {
  for (const NamedPtr& p : ptrs) {
    MOE_CHECK(p.ptr != nullptr, op, ": argument '", p.name, "' is a null device pointer");
    MOE_CHECK(reinterpret_cast<uintptr_t>(p.ptr) % align == 0, op, ": argument '", p.name,
              "' must be ", align, "-byte aligned, got address ", p.ptr);
  }
}

struct RowLaunch {
  dim3 grid;
  dim3 block;
};

// Block: tx lanes along a row (a power of two, 32..256, no wider than the row needs), ty = 256/tx
// rows. Grid: enough blocks for every row, capped (kernels loop over the rest).
inline RowLaunch row_launch(int64_t rows, int64_t vecs_per_row) {
  int tx = 32;
  while (tx < kRowBlockThreads && tx < vecs_per_row) tx *= 2;
  const int ty = kRowBlockThreads / tx;
  const int64_t blocks = std::min<int64_t>((rows + ty - 1) / ty, kMaxGridX);
  return {dim3(static_cast<unsigned>(std::max<int64_t>(blocks, 1))), dim3(tx, ty)};
}

}  // namespace moe::cuda::detail
