// Device memory, copies and streams for code that never includes CUDA headers (src/model):
// thin wrappers over the CUDA runtime that throw moe::Error on failure, a move-only byte
// buffer, and the two element-wise kernels the model glue needs (FP32 -> BF16 cast and the
// FP32 residual add that also writes the BF16 copy the next op reads). BF16 = uint16_t bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/device.h"

namespace moe::cuda {

void* device_alloc(size_t bytes);  // 256-byte aligned; 0 bytes gives nullptr
void device_free(void* p);         // nullptr is a no-op; never throws
void copy_h2d(void* dst, const void* src, size_t bytes, Stream stream);  // ordered on stream
void copy_d2h(void* dst, const void* src, size_t bytes, Stream stream);  // waits for the stream
void copy_d2d(void* dst, const void* src, size_t bytes, Stream stream);
void device_memset(void* p, int value, size_t bytes, Stream stream);
Stream stream_create();              // a non-blocking stream
void stream_destroy(Stream stream);  // never throws
void stream_sync(Stream stream);

// dst[i] = bf16(src[i]) (round to nearest even), i < n.
void cast_f32_to_bf16(const float* src, uint16_t* dst, int64_t n, Stream stream);

// acc[i] += float(add[i]); acc_bf16[i] = bf16(acc[i]) (acc_bf16 may be null), i < n.
void residual_add(float* acc, const uint16_t* add, uint16_t* acc_bf16, int64_t n, Stream stream);

// A device allocation that grows on demand (contents are lost when it grows).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) { reserve(bytes); }
  ~DeviceBuffer() { device_free(ptr_); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr, o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Ensures at least `bytes` bytes.
  void reserve(size_t bytes);
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace moe::cuda
