// Op cases (support/op_case.h) on the GPU: device tensors are GuardedBuffers (256 guard bytes each
// side, data filled with 0xFF bytes), the op runs on a non-blocking stream, and
// MOE_GPU_OP_CASE_TESTS registers one GoogleTest per shape that skips when no GPU is visible.
// CUDA builds only (tests/gpu).
#pragma once

#include <string>

#include "gpu/gpu_test_util.h"
#include "support/op_case.h"

namespace moe::testing {

static_assert(kUnwrittenByte == kOpCaseUnwrittenByte, "op cases expect GuardedBuffer's unwritten fill");

template <typename Shape, typename Ref>
void run_op_case(const OpCase<Shape, Ref>& c, const Shape& s) {
  TestStream stream;
  // The uploads (cudaMemcpy, cudaMemset) are on the legacy default stream, which the test stream
  // does not wait for: synchronise the device before the op and after it.
  run_op_case_on<GuardedBuffer<uint8_t>>(c, s, stream.get(), [] { MOE_CUDA_CHECK(cudaDeviceSynchronize()); });
}

inline std::string no_gpu_reason() { return cuda::cuda_device_count() == 0 ? "no CUDA device visible" : ""; }

}  // namespace moe::testing

// The tests of the case make_case() returns, one per shape: "Shapes/<Suite>.<Test>/<shape name>".
#define MOE_GPU_OP_CASE_TESTS(Suite, Test, make_case)                                                    \
  [[maybe_unused]] static const bool moe_op_case_registered_##Suite##_##Test =                          \
      ::moe::testing::register_op_case_tests("Shapes/" #Suite, #Test, make_case, ::moe::testing::no_gpu_reason, \
                                             [](const auto& c, const auto& s) { ::moe::testing::run_op_case(c, s); }, \
                                             __FILE__, __LINE__)
