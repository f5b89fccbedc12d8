// Decoding attention over a KV cache (attention.h): checks, then one block per (row, head) of
// kernels/attention_decode.cuh, instantiated for hd up to 32, 64, 128 and 256.
#include <cmath>

#include "cuda/common.h"
#include "cuda/kernels/attention_decode.cuh"
#include "cuda/ops/attention.h"
#include "cuda/ops/launch.h"

namespace moe::cuda {
namespace {

template <int kPerLane>
void launch_decode(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t n, int64_t pos0,
                   int64_t hq, int64_t hkv, int64_t hd, Stream stream) {
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(hq));
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  kernels::attention_decode_rows<kPerLane><<<grid, kernels::kDecodeWarps * kernels::kWarpSize, 0, stream>>>(
      q, k, v, out, pos0, static_cast<int>(hq), static_cast<int>(hkv), static_cast<int>(hd), scale);
  check_launch("attention_decode_rows");
}

}  // namespace

void attention_decode(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, uint16_t* out, int64_t n,
                      int64_t pos0, int64_t q_heads, int64_t kv_heads, int64_t head_dim, Stream stream) {
  constexpr const char* op = "cuda::attention_decode";
  MOE_CHECK(n >= 0 && pos0 >= 0, op, ": expected n >= 0 new rows and a cache of pos0 >= 0 positions, got n=", n,
            " pos0=", pos0);
  MOE_CHECK(kv_heads > 0 && q_heads > 0 && q_heads % kv_heads == 0 && q_heads <= 65535, op,
            ": expected kv_heads > 0 dividing q_heads <= 65535, got q_heads=", q_heads, " kv_heads=", kv_heads);
  MOE_CHECK(head_dim > 0 && head_dim <= kernels::kDecodeMaxHeadDim, op, ": expected head_dim in [1, ",
            kernels::kDecodeMaxHeadDim, "], got ", head_dim);
  MOE_CHECK(n <= detail::kMaxGridX, op, ": n=", n, " exceeds ", detail::kMaxGridX);
  if (n == 0) return;
  detail::check_ptrs(op, {{"q", q}, {"k_cache", k_cache}, {"v_cache", v_cache}, {"out", out}}, 2);
  if (head_dim <= 32) {
    launch_decode<1>(q, k_cache, v_cache, out, n, pos0, q_heads, kv_heads, head_dim, stream);
  } else if (head_dim <= 64) {
    launch_decode<2>(q, k_cache, v_cache, out, n, pos0, q_heads, kv_heads, head_dim, stream);
  } else if (head_dim <= 128) {
    launch_decode<4>(q, k_cache, v_cache, out, n, pos0, q_heads, kv_heads, head_dim, stream);
  } else {
    launch_decode<8>(q, k_cache, v_cache, out, n, pos0, q_heads, kv_heads, head_dim, stream);
  }
}

}  // namespace moe::cuda
