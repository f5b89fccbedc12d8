// What the CUDA model's blocks share: the call context (stream, GEMM handle, flat BF16 parameters
// and FP32 gradients at ParamLayout offsets, phase timer, the forward's shape), the buffer grower
// that sizes every device buffer outside graph capture, and the residual stream between blocks
// with the [N, D] scratch every block uses. CUDA builds only (MOECORE_HAS_CUDA); no CUDA headers.
// Legend: B batch, S sequence, N = B*S tokens, D model width. BF16 unless a name ends in 32.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "core/recompute.h"
#include "cuda/device.h"
#include "cuda/event_timer.h"
#include "cuda/ops/memory.h"

namespace moe {

namespace cuda {
class GemmHandle;
}

// One forward's or backward's view of the model, passed to every block call.
struct CudaBlockContext {
  cuda::Stream stream = nullptr;
  cuda::GemmHandle* gemm = nullptr;
  const uint16_t* params = nullptr;   // BF16 copy of the flat parameters (P + offset)
  float* grads = nullptr;             // FP32 flat gradients, accumulated (+=)
  // The step's first backward after CudaModel::prepare_grads_for_step: every weight gradient that a
  // single GEMM writes whole (projections, MLP, router, experts, LM head) is written (beta 0 /
  // overwrite), not added, so those gradients were never zeroed nor read; the others (norm weights,
  // embedding) accumulate into the zeros prepare_grads_for_step wrote.
  bool overwrite_grads = false;
  // With overwrite_grads (CudaModel::set_expert_grad_squares): where the routed experts write the
  // block sums of squares of the weight gradients they write, MoE layer m's at
  // m * CudaModel::expert_square_blocks_per_layer (gate_up's blocks, then down's); null: none.
  double* expert_grad_squares = nullptr;
  cuda::EventTimer* timer = nullptr;  // phase marks while set (eager profiling only)
  int64_t batch = 0, seq = 0;
  // Decoding (CudaModel::decode): MoE layers keep every route (moe.capacity_factor is not applied),
  // as Model<float>::decode does.
  bool dropless = false;
  // The version of the parameters (CudaModel counts every change to the BF16 copy): a block that
  // keeps a copy derived from its weights (the FP8 experts' codes) rebuilds it when this differs
  // from the version it was built at.
  int64_t params_version = 0;

  int64_t tokens() const { return batch * seq; }
  // The beta of a whole-tensor weight-gradient GEMM: 0 on the step's first backward, else 1.
  float wgrad_beta() const { return overwrite_grads ? 0.f : 1.f; }
  void mark(cuda::Phase p) const {
    if (timer != nullptr) timer->mark(p);
  }
};

// Grows device buffers: to at least n elements of T (one at least), never shrinking. Growing while
// the stream is captured would free memory a graph node may point at, so it throws instead.
// generation() counts reallocations (a captured graph is stale once it changes).
class CudaBufferGrower {
 public:
  explicit CudaBufferGrower(cuda::Stream stream = nullptr) : stream_(stream) {}
  void set_stream(cuda::Stream stream) { stream_ = stream; }
  int64_t generation() const { return generation_; }
  // Bytes of every buffer grown through this grower (as sized now).
  int64_t bytes() const { return bytes_; }

  template <typename T>
  void grow(cuda::DeviceBuffer& b, int64_t n, const char* what) {
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T);
    if (bytes <= b.bytes()) return;
    MOE_CHECK(!cuda::stream_is_capturing(stream_), "CudaModel: buffer '", what, "' would grow from ", b.bytes(),
              " to ", bytes, " bytes during graph capture; call reserve(batch, seq) with the step's shape "
              "before capturing");
    bytes_ += static_cast<int64_t>(bytes) - static_cast<int64_t>(b.bytes());
    b.reserve(bytes);
    ++generation_;
  }
  // Frees b (scratch with nothing pending on it), e.g. before growing it without holding both.
  void release(cuda::DeviceBuffer& b) {
    bytes_ -= static_cast<int64_t>(b.bytes());
    b = cuda::DeviceBuffer();
  }
  void grow_bytes(cuda::DeviceBuffer& b, size_t bytes, const char* what) {
    grow<uint8_t>(b, static_cast<int64_t>(std::max<size_t>(bytes, 16)), what);
  }

 private:
  cuda::Stream stream_ = nullptr;
  int64_t generation_ = 0;
  int64_t bytes_ = 0;
};

// Where a block's saved tensors live under recomputation (core/recompute.h): in the block's own
// saved struct, or, for a tensor the mode recomputes, in the pool that every layer's block of that
// kind shares. Built by a block's bind(); refuses a recompute mode without a pool.
template <typename Saved>
class CudaSavedSlots {
 public:
  CudaSavedSlots(const char* where, Recompute mode, Saved& own, Saved* pool) : own_(own), pool_(pool) {
    MOE_CHECK(mode == Recompute::kNone || pool != nullptr, where, ": recompute mode '", recompute_name(mode),
              "' needs a pool");
  }
  // The buffer of field f: the pool's when `pooled`, else the block's own.
  cuda::DeviceBuffer* operator()(cuda::DeviceBuffer Saved::*f, bool pooled) const {
    return pooled ? &(pool_->*f) : &(own_.*f);
  }

 private:
  Saved& own_;
  Saved* pool_;
};

// The residual stream and the scratch all blocks share (one of each per model). A block reads its
// input as the BF16 copy in its own saved activations, adds its branch into x32_ND and writes the
// BF16 copy of the sum into the next block's saved input; backward adds its input gradient into
// dx32_ND and refreshes dx_ND, the BF16 copy the next block's backward reads.
struct CudaResidual {
  cuda::DeviceBuffer x32_ND;      // FP32 residual stream
  cuda::DeviceBuffer branch_ND;   // a block's branch output, before the residual add
  cuda::DeviceBuffer dx32_ND;     // FP32 gradient of the residual stream
  cuda::DeviceBuffer dx_ND;       // its BF16 copy
  cuda::DeviceBuffer dbranch_ND;  // gradient at a block's normed input
  cuda::DeviceBuffer dtmp_ND;     // scratch: the output of a layer recomputed in full (discarded)
  cuda::DeviceBuffer ws_rms;      // rmsnorm_backward workspace (rows N, widest of D, Q, C)

  float* x32() const { return x32_ND.as<float>(); }
  uint16_t* branch() const { return branch_ND.as<uint16_t>(); }
  float* dx32() const { return dx32_ND.as<float>(); }
  uint16_t* dx() const { return dx_ND.as<uint16_t>(); }
  uint16_t* dbranch() const { return dbranch_ND.as<uint16_t>(); }
  uint16_t* dtmp() const { return dtmp_ND.as<uint16_t>(); }
};

}  // namespace moe
