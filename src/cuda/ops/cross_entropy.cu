// Cross-entropy launcher and checked entry point. One block per row (threads: a power of two,
// 32..512, about one 16-byte vector per thread per 4 batches); 16-byte accesses when logits and
// dlogits share their address modulo 16 (any vocab: rows are peeled to 16-byte boundaries),
// else the scalar kernel. Then one block adds the losses onto *loss_sum.
#include "cuda/ops/cross_entropy.h"

#include <cmath>
#include <limits>

#include "cuda/common.h"
#include "cuda/kernels/cross_entropy.cuh"
#include "cuda/ops/launch.h"

namespace moe::cuda {
namespace {

using kernels::kVecBf16;

template <int V>
void launch_cross_entropy(const uint16_t* logits, uint16_t* dlogits, const int32_t* targets, float* loss,
                          float* lse, int64_t n, int64_t vocab, float z_weight, const float* grad_scale,
                          uint32_t* num_bad_targets, Stream stream, int threads) {
  kernels::cross_entropy_fused_rows<V><<<static_cast<unsigned>(n), threads, 0, stream>>>(
      logits, dlogits, targets, loss, lse, vocab, z_weight, grad_scale, num_bad_targets);
  check_launch("cross_entropy_fused_rows");
}

}  // namespace

int cross_entropy_block_threads(int64_t vocab) {
  const int64_t vecs = (vocab + kVecBf16 - 1) / kVecBf16;
  int t = kernels::kWarpSize;
  while (t < kernels::kCeMaxThreads && int64_t{t} * kernels::kCeVecBatch < vecs) t *= 2;
  return t;
}

void cross_entropy_forward_backward(const uint16_t* logits, uint16_t* dlogits, const int32_t* targets,
                                    float* loss, float* lse, int64_t n, int64_t vocab, double z_weight,
                                    const float* grad_scale, double* loss_sum, uint32_t* num_bad_targets,
                                    Stream stream, int block_threads) {
  const char* op = "cuda::cross_entropy_forward_backward";
  MOE_CHECK(block_threads == 0 || (block_threads >= kernels::kWarpSize && block_threads <= kernels::kCeMaxThreads &&
                                   (block_threads & (block_threads - 1)) == 0),
            op, ": block_threads must be 0 (the launcher's choice) or a power of two in [32, ",
            kernels::kCeMaxThreads, "], got ", block_threads);
  MOE_CHECK(n >= 0 && vocab > 0, op, ": expected n >= 0 and vocab > 0, got n=", n, " vocab=", vocab);
  MOE_CHECK(n <= std::numeric_limits<int32_t>::max(), op, ": n=", n, " rows exceed 2^31 - 1 (one block per row)");
  MOE_CHECK(vocab <= std::numeric_limits<int32_t>::max(), op, ": vocab=", vocab,
            " exceeds 2^31 - 1 (targets are int32)");
  MOE_CHECK(std::isfinite(z_weight) && z_weight >= 0.0, op, ": expected a finite z_weight >= 0, got ", z_weight);
  if (n == 0) return;
  detail::check_ptrs(op, {{"logits", logits}, {"dlogits", dlogits}}, 2);
  detail::check_ptrs(op, {{"targets", targets}, {"loss", loss}, {"lse", lse}, {"grad_scale", grad_scale},
                          {"num_bad_targets", num_bad_targets}},
                     4);
  const auto addr_l = reinterpret_cast<uintptr_t>(logits), addr_d = reinterpret_cast<uintptr_t>(dlogits);
  const uintptr_t bytes = static_cast<uintptr_t>(n) * static_cast<uintptr_t>(vocab) * sizeof(uint16_t);
  MOE_CHECK(addr_l == addr_d || addr_l + bytes <= addr_d || addr_d + bytes <= addr_l, op,
            ": dlogits must either equal logits (in place) or not overlap it; got logits=", logits,
            " dlogits=", dlogits, " for ", bytes, " bytes");
  const float z = static_cast<float>(z_weight);
  const int threads = block_threads != 0 ? block_threads : cross_entropy_block_threads(vocab);
  if (((addr_l ^ addr_d) & 15u) == 0) {
    launch_cross_entropy<kVecBf16>(logits, dlogits, targets, loss, lse, n, vocab, z, grad_scale,
                                   num_bad_targets, stream, threads);
  } else {
    launch_cross_entropy<1>(logits, dlogits, targets, loss, lse, n, vocab, z, grad_scale, num_bad_targets,
                            stream, threads);
  }
  if (loss_sum != nullptr) {
    detail::check_ptrs(op, {{"loss_sum", loss_sum}}, 8);
    kernels::cross_entropy_sum_losses<<<1, kernels::kCeSumThreads, 0, stream>>>(loss, n, loss_sum);
    check_launch("cross_entropy_sum_losses");
  }
}

}  // namespace moe::cuda
