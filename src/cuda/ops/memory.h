// Device memory, copies, streams, events and stream capture for code that never includes CUDA
// headers (src/model, src/train): thin wrappers over the CUDA runtime that throw moe::Error on
// failure, move-only device and pinned host buffers, a byte counter of device_alloc (current and
// high-water mark), and the two element-wise kernels the model glue needs (FP32 -> BF16 cast and
// the FP32 residual add that also writes the BF16 copy the next op reads). BF16 = uint16_t bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/device.h"

struct CUevent_st;
struct CUgraph_st;
struct CUgraphExec_st;

namespace moe::cuda {

using Event = CUevent_st*;  // the same type as cudaEvent_t

void* device_alloc(size_t bytes);  // 256-byte aligned; 0 bytes gives nullptr; counted below
void device_free(void* p);         // nullptr is a no-op; never throws
// Bytes currently allocated through device_alloc in this process, and the most there ever were
// (since the start or the last reset_device_peak_bytes(), which sets it to the current bytes).
size_t device_bytes_in_use();
size_t device_peak_bytes();
void reset_device_peak_bytes();
// Free and total bytes of the current device (cudaMemGetInfo): a cross-check of the counter that
// also sees cuBLASLt's and the CUDA context's own memory.
void device_mem_info(size_t* free_bytes, size_t* total_bytes);

void* host_alloc_pinned(size_t bytes);  // page-locked host memory (cudaHostAlloc); 0 bytes gives nullptr
void host_free_pinned(void* p);         // nullptr is a no-op; never throws

void copy_h2d(void* dst, const void* src, size_t bytes, Stream stream);  // ordered on stream
void copy_d2h(void* dst, const void* src, size_t bytes, Stream stream);  // waits for the stream
// Ordered on stream, returns at once: dst must be pinned (host_alloc_pinned) and must not be read
// before an event recorded after the copy has completed.
void copy_d2h_async(void* dst, const void* src, size_t bytes, Stream stream);
void copy_d2d(void* dst, const void* src, size_t bytes, Stream stream);
// n FP32 host values stored on the device as BF16 bits, rounded to nearest even on the host (a
// bounded staging buffer at a time); returns when the host values have been read.
void copy_h2d_f32_as_bf16(uint16_t* dst, const float* src, int64_t n, Stream stream);
// n BF16 values on the device widened (exactly) into FP32 on the host; waits for the stream.
void copy_d2h_bf16_as_f32(float* dst, const uint16_t* src, int64_t n, Stream stream);
// n FP32 host values to the device as FP32 (copy_h2d), or as BF16 bits (bf16: copy_h2d_f32_as_bf16):
// how the AdamW moments are stored under optim.moment_dtype.
void copy_h2d_f32_stored(void* dst, const float* src, int64_t n, bool bf16, Stream stream);
// n device values stored as FP32 (copy_d2h) or as BF16 bits (bf16: copy_d2h_bf16_as_f32) into FP32 on
// the host.
void copy_d2h_stored_to_f32(float* dst, const void* src, int64_t n, bool bf16, Stream stream);
void device_memset(void* p, int value, size_t bytes, Stream stream);
Stream stream_create();              // a non-blocking stream
void stream_destroy(Stream stream);  // never throws
void stream_sync(Stream stream);
// True while `stream` is being captured into a graph (cudaStreamIsCapturing).
bool stream_is_capturing(Stream stream);

Event event_create();                      // without timing (cudaEventDisableTiming)
void event_destroy(Event event);           // nullptr is a no-op; never throws
void event_record(Event event, Stream stream);
void event_sync(Event event);              // waits for the work recorded before the event
void stream_wait_event(Stream stream, Event event);  // later work on `stream` waits for `event` (capturable)

// dst[i] = bf16(src[i]) (round to nearest even), i < n.
void cast_f32_to_bf16(const float* src, uint16_t* dst, int64_t n, Stream stream);
// dst[i] = float(src[i]) (exact), i < n; the CPU twin is bf16_to_f32 (core/dtype.h).
void cast_bf16_to_f32(const uint16_t* src, float* dst, int64_t n, Stream stream);

// acc[i] += float(add[i]); acc_bf16[i] = bf16(acc[i]) (acc_bf16 may be null), i < n.
void residual_add(float* acc, const uint16_t* add, uint16_t* acc_bf16, int64_t n, Stream stream);

// One stream's work captured once (cudaStreamBeginCapture in global mode: any synchronising or
// otherwise unsafe call on any thread during the capture fails the capture) and launched as a
// CUDA graph. Not copyable; destroying it releases the graph.
class StreamGraph {
 public:
  StreamGraph() = default;
  ~StreamGraph() { reset(); }
  StreamGraph(const StreamGraph&) = delete;
  StreamGraph& operator=(const StreamGraph&) = delete;

  // Starts capturing `stream`; every op enqueued on it until end_capture() is recorded, not run.
  void begin_capture(Stream stream);
  // Ends the capture begun on `stream` and instantiates the graph (throws, naming the CUDA error,
  // when something inside the capture was illegal; the graph is then empty).
  void end_capture(Stream stream);
  // Ends a capture that must not be kept (an exception inside it) so the stream works again;
  // never throws, leaves no graph.
  void abort_capture(Stream stream) noexcept;
  void launch(Stream stream) const;  // one replay, ordered on `stream`
  bool ready() const { return exec_ != nullptr; }
  void reset();  // never throws

 private:
  CUgraph_st* graph_ = nullptr;
  CUgraphExec_st* exec_ = nullptr;
};

// Page-locked host memory of a fixed size (the target and source of asynchronous copies).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes) : ptr_(host_alloc_pinned(bytes)), bytes_(bytes) {}
  ~PinnedBuffer() { host_free_pinned(ptr_); }
  PinnedBuffer(PinnedBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr, o.bytes_ = 0; }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

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
