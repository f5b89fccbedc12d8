// NVSHMEM on one GPU (one PE): bootstrapped from a unique id, a symmetric buffer written by a
// stream-ordered put to this PE, visible after the barrier. Skipped (never passed) without a GPU
// or in a build without NVSHMEM; the two-GPU exchange is tested where two GPUs are.
#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include <cuda_runtime.h>

#include "cuda/ops/nvshmem_world.h"
#include "gpu/gpu_test_util.h"

namespace moe::testing {
namespace {

TEST(NvshmemOnePe, PutIntoTheSymmetricBufferIsVisibleAfterTheBarrier) {
  MOE_SKIP_WITHOUT_GPU();
  if (!cuda::nvshmem_available()) GTEST_SKIP() << "this build has no NVSHMEM";
  TestStream stream;
  cuda::NvshmemWorld world(0, 1, cuda::nvshmem_unique_id());
  EXPECT_EQ(world.pe(), 0);
  EXPECT_EQ(world.npes(), 1);
  constexpr int64_t kN = 1 << 16;
  std::vector<int32_t> host(kN);
  std::iota(host.begin(), host.end(), 7);
  GuardedBuffer<int32_t> src(host);
  auto* dst = static_cast<int32_t*>(world.malloc(kN * sizeof(int32_t)));
  ASSERT_NE(dst, nullptr);
  MOE_CUDA_CHECK(cudaMemsetAsync(dst, 0, kN * sizeof(int32_t), stream.get()));
  world.put(dst, src.data(), kN * sizeof(int32_t), 0, stream.get());
  world.barrier(stream.get());
  stream.sync();
  std::vector<int32_t> got(kN);
  MOE_CUDA_CHECK(cudaMemcpy(got.data(), dst, kN * sizeof(int32_t), cudaMemcpyDeviceToHost));
  EXPECT_EQ(got, host);
  world.free(dst);
}

}  // namespace
}  // namespace moe::testing
