// Multiprocessors kept free for work on another stream. While a reserve of r multiprocessors is
// set on a thread, the persistent GEMMs that thread launches (the grouped GEMMs, which keep one
// CTA on each multiprocessor; cuBLASLt's GEMMs, through CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET) size
// their grids for the device's count less r, so that a kernel on another stream that keeps to r
// multiprocessors (the deferred AdamW update, cuda::adamw_apply with `sms`) runs beside them
// instead of taking turns with them. cuDNN's attention engines take no SM count target (they
// refuse one below the device's) and keep their grids. The setting is read when a launch is
// enqueued (a captured graph keeps the grids it was captured with). Results do not depend on it
// for the grouped GEMMs (any grid gives the same bits); cuBLASLt may choose another algorithm for
// the smaller count.
#pragma once

namespace moe::cuda {

// The reserve in force on this thread (0: none).
int reserved_sms();

// Sets this thread's reserve (>= 0) and returns the previous one.
int set_reserved_sms(int sms);

// The multiprocessors a persistent GEMM may use on a device of `device_sms`: device_sms less the
// reserve, at least 1.
int gemm_sms(int device_sms);

// Sets a reserve for its lifetime and restores the previous one after.
class ScopedSmReserve {
 public:
  explicit ScopedSmReserve(int sms) : previous_(set_reserved_sms(sms)) {}
  ~ScopedSmReserve() { set_reserved_sms(previous_); }
  ScopedSmReserve(const ScopedSmReserve&) = delete;
  ScopedSmReserve& operator=(const ScopedSmReserve&) = delete;

 private:
  int previous_;
};

}  // namespace moe::cuda
