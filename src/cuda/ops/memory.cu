// Runtime wrappers and the element-wise glue kernels declared in memory.h (grid-stride loops,
// FP32 math, __float2bfloat16_rn rounding). device_alloc/device_free keep a map of live
// allocations under a mutex so that the byte counter and its high-water mark are exact.
#include "cuda/ops/memory.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "cuda/common.h"

namespace moe::cuda {

namespace {

struct AllocationCounter {
  std::mutex mu;
  std::unordered_map<void*, size_t> live;
  size_t in_use = 0, peak = 0;
};

AllocationCounter& allocation_counter() {
  static AllocationCounter* c = new AllocationCounter;  // never destroyed: frees may run at exit
  return *c;
}

}  // namespace

void* device_alloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  MOE_CUDA_CHECK(cudaMalloc(&p, bytes));
  AllocationCounter& c = allocation_counter();
  try {
    std::lock_guard<std::mutex> lock(c.mu);
    c.live.emplace(p, bytes);
    c.in_use += bytes;
    if (c.in_use > c.peak) c.peak = c.in_use;
  } catch (...) {
    cudaFree(p);
    throw;
  }
  return p;
}

void device_free(void* p) {
  if (p == nullptr) return;
  AllocationCounter& c = allocation_counter();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    const auto it = c.live.find(p);
    if (it != c.live.end()) {
      c.in_use -= it->second;
      c.live.erase(it);
    }
  }
  cudaFree(p);
}

size_t device_bytes_in_use() {
  AllocationCounter& c = allocation_counter();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.in_use;
}

size_t device_peak_bytes() {
  AllocationCounter& c = allocation_counter();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.peak;
}

void reset_device_peak_bytes() {
  AllocationCounter& c = allocation_counter();
  std::lock_guard<std::mutex> lock(c.mu);
  c.peak = c.in_use;
}

void device_mem_info(size_t* free_bytes, size_t* total_bytes) {
  size_t f = 0, t = 0;
  MOE_CUDA_CHECK(cudaMemGetInfo(&f, &t));
  if (free_bytes != nullptr) *free_bytes = f;
  if (total_bytes != nullptr) *total_bytes = t;
}

void* host_alloc_pinned(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  MOE_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocDefault));
  return p;
}

void host_free_pinned(void* p) {
  if (p != nullptr) cudaFreeHost(p);
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

namespace {
constexpr int64_t kConvertChunk = int64_t{1} << 22;  // elements staged on the host at a time
}  // namespace

void copy_h2d_f32_as_bf16(uint16_t* dst, const float* src, int64_t n, Stream stream) {
  MOE_CHECK(n >= 0, "cuda::copy_h2d_f32_as_bf16: expected n >= 0, got ", n);
  std::vector<uint16_t> bits(size_t(std::min(n, kConvertChunk)));
  for (int64_t at = 0; at < n; at += kConvertChunk) {
    const int64_t len = std::min(kConvertChunk, n - at);
    convert_from_f32(src + at, bits.data(), DType::kBF16, len);
    MOE_CUDA_CHECK(cudaMemcpyAsync(dst + at, bits.data(), size_t(len) * 2, cudaMemcpyHostToDevice, stream));
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));  // `bits` is refilled next
  }
}

void copy_d2h_bf16_as_f32(float* dst, const uint16_t* src, int64_t n, Stream stream) {
  MOE_CHECK(n >= 0, "cuda::copy_d2h_bf16_as_f32: expected n >= 0, got ", n);
  std::vector<uint16_t> bits(size_t(std::min(n, kConvertChunk)));
  for (int64_t at = 0; at < n; at += kConvertChunk) {
    const int64_t len = std::min(kConvertChunk, n - at);
    MOE_CUDA_CHECK(cudaMemcpyAsync(bits.data(), src + at, size_t(len) * 2, cudaMemcpyDeviceToHost, stream));
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    convert_to_f32(bits.data(), DType::kBF16, dst + at, len);
  }
}

void copy_h2d_f32_stored(void* dst, const float* src, int64_t n, bool bf16, Stream stream) {
  if (bf16) {
    copy_h2d_f32_as_bf16(static_cast<uint16_t*>(dst), src, n, stream);
  } else {
    copy_h2d(dst, src, size_t(n) * sizeof(float), stream);
  }
}

void copy_d2h_stored_to_f32(float* dst, const void* src, int64_t n, bool bf16, Stream stream) {
  if (bf16) {
    copy_d2h_bf16_as_f32(dst, static_cast<const uint16_t*>(src), n, stream);
  } else {
    copy_d2h(dst, src, size_t(n) * sizeof(float), stream);
  }
}

void copy_d2h_async(void* dst, const void* src, size_t bytes, Stream stream) {
  if (bytes == 0) return;
  MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
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

bool stream_is_capturing(Stream stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  MOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

Event event_create() {
  cudaEvent_t e = nullptr;
  MOE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void event_destroy(Event event) {
  if (event != nullptr) cudaEventDestroy(event);
}

void event_record(Event event, Stream stream) { MOE_CUDA_CHECK(cudaEventRecord(event, stream)); }

void event_sync(Event event) { MOE_CUDA_CHECK(cudaEventSynchronize(event)); }

void stream_wait_event(Stream stream, Event event) { MOE_CUDA_CHECK(cudaStreamWaitEvent(stream, event, 0)); }

void StreamGraph::begin_capture(Stream stream) {
  MOE_CHECK(exec_ == nullptr && graph_ == nullptr, "StreamGraph::begin_capture: a graph is already held; reset() it first");
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
}

void StreamGraph::end_capture(Stream stream) {
  cudaGraph_t g = nullptr;
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
  graph_ = g;
  cudaGraphExec_t e = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&e, g, 0);
  if (err != cudaSuccess) {
    reset();
    MOE_CUDA_CHECK(err);
  }
  exec_ = e;
}

void StreamGraph::abort_capture(Stream stream) noexcept {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
    cudaGraph_t g = nullptr;
    if (cudaStreamEndCapture(stream, &g) == cudaSuccess && g != nullptr) cudaGraphDestroy(g);
  }
  (void)cudaGetLastError();  // a failed capture leaves a (non-sticky) error behind
  reset();
}

void StreamGraph::launch(Stream stream) const {
  MOE_CHECK(exec_ != nullptr, "StreamGraph::launch: nothing was captured");
  MOE_CUDA_CHECK(cudaGraphLaunch(exec_, stream));
}

void StreamGraph::reset() {
  if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  if (graph_ != nullptr) cudaGraphDestroy(graph_);
  exec_ = nullptr;
  graph_ = nullptr;
}

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

__global__ void cast_bf16_to_f32_kernel(const __nv_bfloat16* src, float* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = __bfloat162float(src[i]);
  }
}

__global__ void residual_add_kernel(float* acc, const __nv_bfloat16* add, __nv_bfloat16* acc_bf16, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float v = acc[i] + __bfloat162float(add[i]);
    acc[i] = v;
    if (acc_bf16 != nullptr) acc_bf16[i] = __float2bfloat16_rn(v);
  }
}

// residual_add_kernel on 8 elements at a time: two 16-byte loads and a store of acc, 16-byte
// loads and stores of the BF16 tensors; the same FP32 add and rounding per element. n8 = n / 8.
__global__ void residual_add_vec8_kernel(float* __restrict__ acc, const uint4* __restrict__ add,
                                         uint4* __restrict__ acc_bf16, int64_t n8) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n8; i += int64_t{gridDim.x} * blockDim.x) {
    float4* a4 = reinterpret_cast<float4*>(acc) + 2 * i;
    float4 lo = a4[0], hi = a4[1];
    const uint4 b = add[i];
    lo.x += __uint_as_float(b.x << 16), lo.y += __uint_as_float(b.x & 0xffff0000u);
    lo.z += __uint_as_float(b.y << 16), lo.w += __uint_as_float(b.y & 0xffff0000u);
    hi.x += __uint_as_float(b.z << 16), hi.y += __uint_as_float(b.z & 0xffff0000u);
    hi.z += __uint_as_float(b.w << 16), hi.w += __uint_as_float(b.w & 0xffff0000u);
    a4[0] = lo;
    a4[1] = hi;
    if (acc_bf16 != nullptr) {
      const auto pack = [](float x, float y) {
        return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(x))) |
               (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(y))) << 16);
      };
      acc_bf16[i] = make_uint4(pack(lo.x, lo.y), pack(lo.z, lo.w), pack(hi.x, hi.y), pack(hi.z, hi.w));
    }
  }
}

}  // namespace

void cast_f32_to_bf16(const float* src, uint16_t* dst, int64_t n, Stream stream) {
  MOE_CHECK(n >= 0, "cast_f32_to_bf16: n must be >= 0, got ", n);
  if (n == 0) return;
  cast_f32_to_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(src, reinterpret_cast<__nv_bfloat16*>(dst), n);
  check_launch("cast_f32_to_bf16");
}

void cast_bf16_to_f32(const uint16_t* src, float* dst, int64_t n, Stream stream) {
  MOE_CHECK(n >= 0, "cast_bf16_to_f32: n must be >= 0, got ", n);
  if (n == 0) return;
  cast_bf16_to_f32_kernel<<<grid_for(n), kThreads, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(src), dst, n);
  check_launch("cast_bf16_to_f32");
}

void residual_add(float* acc, const uint16_t* add, uint16_t* acc_bf16, int64_t n, Stream stream) {
  MOE_CHECK(n >= 0, "residual_add: n must be >= 0, got ", n);
  if (n == 0) return;
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (n % 8 == 0 && aligned16(acc) && aligned16(add) && aligned16(acc_bf16)) {
    residual_add_vec8_kernel<<<grid_for(n / 8), kThreads, 0, stream>>>(
        acc, reinterpret_cast<const uint4*>(add), reinterpret_cast<uint4*>(acc_bf16), n / 8);
  } else {
    residual_add_kernel<<<grid_for(n), kThreads, 0, stream>>>(acc, reinterpret_cast<const __nv_bfloat16*>(add),
                                                              reinterpret_cast<__nv_bfloat16*>(acc_bf16), n);
  }
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

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    host_free_pinned(ptr_);
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
