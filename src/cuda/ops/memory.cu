// Runtime wrappers and the element-wise glue kernels declared in memory.h (grid-stride loops,
// FP32 math, __float2bfloat16_rn rounding).
#include "cuda/ops/memory.h"

#include <cuda_bf16.h>

#include "cuda/common.h"

namespace moe::cuda {

void* device_alloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  MOE_CUDA_CHECK(cudaMalloc(&p, bytes));
  return p;
}

void device_free(void* p) {
  if (p != nullptr) cudaFree(p);
}

void copy_h2d(void* dst, const void* src, size_t bytes, Stream stream) {
  if (bytes == 0) return;
  MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
}

void copy_d2h(void* dst, const void* src, size_t bytes, Stream stream) {
  if (bytes == 0) return;
  MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void copy_d2d(void* dst, const void* src, size_t bytes, Stream stream) {
  if (bytes == 0) return;
  MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
}

void device_memset(void* p, int value, size_t bytes, Stream stream) {
  if (bytes == 0) return;
  MOE_CUDA_CHECK(cudaMemsetAsync(p, value, bytes, stream));
}

Stream stream_create() {
  cudaStream_t s = nullptr;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

void stream_destroy(Stream stream) {
  if (stream != nullptr) cudaStreamDestroy(stream);
}

void stream_sync(Stream stream) { MOE_CUDA_CHECK(cudaStreamSynchronize(stream)); }

namespace {

constexpr int kThreads = 256;

int grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

__global__ void cast_f32_to_bf16_kernel(const float* src, __nv_bfloat16* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = __float2bfloat16_rn(src[i]);
  }
}

__global__ void residual_add_kernel(float* acc, const __nv_bfloat16* add, __nv_bfloat16* acc_bf16, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float v = acc[i] + __bfloat162float(add[i]);
    acc[i] = v;
    if (acc_bf16 != nullptr) acc_bf16[i] = __float2bfloat16_rn(v);
  }
}

}  // namespace

void cast_f32_to_bf16(const float* src, uint16_t* dst, int64_t n, Stream stream) {
  MOE_CHECK(n >= 0, "cast_f32_to_bf16: n must be >= 0, got ", n);
  if (n == 0) return;
  cast_f32_to_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(src, reinterpret_cast<__nv_bfloat16*>(dst), n);
  check_launch("cast_f32_to_bf16");
}

void residual_add(float* acc, const uint16_t* add, uint16_t* acc_bf16, int64_t n, Stream stream) {
  MOE_CHECK(n >= 0, "residual_add: n must be >= 0, got ", n);
  if (n == 0) return;
  residual_add_kernel<<<grid_for(n), kThreads, 0, stream>>>(acc, reinterpret_cast<const __nv_bfloat16*>(add),
                                                            reinterpret_cast<__nv_bfloat16*>(acc_bf16), n);
  check_launch("residual_add");
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    device_free(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::reserve(size_t bytes) {
  if (bytes <= bytes_) return;
  void* p = device_alloc(bytes);
  device_free(ptr_);
  ptr_ = p;
  bytes_ = bytes;
}

}  // namespace moe::cuda
