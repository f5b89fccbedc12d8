// Launchers of the initialisation kernels: the Philox key of a tensor is computed on the host
// (core/rng.h philox_key(seed, name_key(name))) and passed by value; grids of
// min(ceil(n / 256), 65536) blocks of 256 threads walk the elements grid-stride.
#include "cuda/ops/init.h"

#include <algorithm>
#include <cmath>

#include "core/arena.h"
#include "core/rng.h"
#include "cuda/common.h"
#include "cuda/kernels/init.cuh"
#include "cuda/ops/launch.h"

namespace moe::cuda {
namespace {

constexpr int64_t kMaxInitBlocks = 65536;

unsigned init_blocks(int64_t n) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((n + kernels::kInitThreads - 1) / kernels::kInitThreads, 1, kMaxInitBlocks));
}

}  // namespace

void fill_trunc_normal(float* out, int64_t n, int64_t global_offset, uint64_t seed, std::string_view name,
                       double std, Stream stream) {
  const char* op = "cuda::fill_trunc_normal";
  MOE_CHECK(n >= 0, op, ": element count must be >= 0, got ", n, " (tensor '", name, "')");
  MOE_CHECK(global_offset >= 0, op, ": global_offset must be >= 0, got ", global_offset, " (tensor '", name, "')");
  MOE_CHECK(std >= 0.0 && std::isfinite(std), op, ": std must be finite and >= 0, got ", std, " (tensor '", name,
            "')");
  if (n == 0) return;
  detail::check_ptrs(op, {{"out", out}}, sizeof(float));
  const auto key = philox_key(seed, name_key(name));
  kernels::fill_trunc_normal_kernel<<<init_blocks(n), kernels::kInitThreads, 0, stream>>>(
      out, n, static_cast<uint64_t>(global_offset), key[0], key[1], std);
  check_launch("fill_trunc_normal_kernel");
}

void fill_value(float* out, int64_t n, float value, Stream stream) {
  const char* op = "cuda::fill_value";
  MOE_CHECK(n >= 0, op, ": element count must be >= 0, got ", n);
  if (n == 0) return;
  detail::check_ptrs(op, {{"out", out}}, sizeof(float));
  kernels::fill_value_kernel<<<init_blocks(n), kernels::kInitThreads, 0, stream>>>(out, n, value);
  check_launch("fill_value_kernel");
}

void init_params(const ParamLayout& layout, float* params, uint64_t seed, double std, Stream stream) {
  const char* op = "cuda::init_params";
  detail::check_ptrs(op, {{"params", params}}, sizeof(float));
  for (const ParamEntry& e : layout.entries()) {
    MOE_CHECK(e.offset >= 0 && e.offset + e.numel <= layout.total_numel(), op, ": tensor '", e.name,
              "' at [", e.offset, ", ", e.offset + e.numel, ") lies outside the layout's ", layout.total_numel(),
              " elements");
    // Model<float>::init_params: 1-D tensors are norm weights (ones), the rest truncated normals.
    if (e.shape.size() == 1) {
      fill_value(params + e.offset, e.numel, 1.0f, stream);
    } else {
      fill_trunc_normal(params + e.offset, e.numel, 0, seed, e.name, std, stream);
    }
  }
}

}  // namespace moe::cuda
