// The CUDA error macros and device count. The message tests need no GPU (they only format
// status codes); the launch-check test does.
#include <gtest/gtest.h>

#include <string>

#include "cuda/sm_reserve.h"
#include "gpu/gpu_test_util.h"

namespace moe::testing {
namespace {

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const moe::Error& e) {
    return e.what();
  }
  return "";
}

TEST(CudaCommon, DeviceCountNeverThrows) {
  int count = -1;
  EXPECT_NO_THROW(count = cuda::cuda_device_count());
  EXPECT_GE(count, 0);
}

TEST(CudaCommon, CudaCheckNamesErrorCallAndSite) {
  const std::string msg = message_of([] { MOE_CUDA_CHECK(cudaErrorInvalidValue); });
  EXPECT_NE(msg.find("cudaErrorInvalidValue"), std::string::npos) << msg;
  EXPECT_NE(msg.find(cudaGetErrorString(cudaErrorInvalidValue)), std::string::npos) << msg;
  EXPECT_NE(msg.find("from cudaErrorInvalidValue"), std::string::npos) << msg;  // the call as written
  EXPECT_NE(msg.find("common_test.cpp:"), std::string::npos) << msg;
  EXPECT_NO_THROW(MOE_CUDA_CHECK(cudaSuccess));
}

TEST(CudaCommon, CudaCheckAddsHintForOutOfMemory) {
  const std::string msg = message_of([] { MOE_CUDA_CHECK(cudaErrorMemoryAllocation); });
  EXPECT_NE(msg.find("cudaErrorMemoryAllocation"), std::string::npos) << msg;
  EXPECT_NE(msg.find("out of device memory"), std::string::npos) << msg;
}

TEST(CudaCommon, CublasCheckNamesStatus) {
  const std::string msg = message_of([] { MOE_CUBLAS_CHECK(CUBLAS_STATUS_NOT_SUPPORTED); });
  EXPECT_NE(msg.find("CUBLAS_STATUS_NOT_SUPPORTED"), std::string::npos) << msg;
  EXPECT_NE(msg.find("common_test.cpp:"), std::string::npos) << msg;
  EXPECT_NO_THROW(MOE_CUBLAS_CHECK(CUBLAS_STATUS_SUCCESS));
}

TEST(CudaCommon, CheckLaunchReportsPendingErrorOnce) {
  MOE_SKIP_WITHOUT_GPU();
  MOE_CUDA_CHECK(cudaFree(nullptr));  // create the context
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, size_t{1} << 62), cudaErrorMemoryAllocation);  // leaves a pending error
  const std::string msg = message_of([] { cuda::check_launch("probe_kernel"); });
  EXPECT_NE(msg.find("launch of probe_kernel"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cudaErrorMemoryAllocation"), std::string::npos) << msg;
  EXPECT_NE(msg.find("common_test.cpp:"), std::string::npos) << msg;
  EXPECT_NO_THROW(cuda::check_launch("probe_kernel"));  // the error was consumed
}

// The reserve of multiprocessors (host state, no GPU needed): scoped guards nest and restore,
// gemm_sms leaves at least one multiprocessor, a negative reserve is refused by name.
TEST(SmReserve, ScopedGuardsNestAndRestore) {
  EXPECT_EQ(cuda::reserved_sms(), 0);
  EXPECT_EQ(cuda::gemm_sms(132), 132);
  {
    const cuda::ScopedSmReserve outer(16);
    EXPECT_EQ(cuda::gemm_sms(132), 116);
    {
      const cuda::ScopedSmReserve inner(0);
      EXPECT_EQ(cuda::gemm_sms(132), 132);
      EXPECT_EQ(cuda::set_reserved_sms(200), 0);
      EXPECT_EQ(cuda::gemm_sms(132), 1);
    }
    EXPECT_EQ(cuda::reserved_sms(), 16);
  }
  EXPECT_EQ(cuda::reserved_sms(), 0);
  try {
    cuda::set_reserved_sms(-1);
    FAIL() << "a negative reserve was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("reserve >= 0"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cuda::reserved_sms(), 0);
}

}  // namespace
}  // namespace moe::testing
