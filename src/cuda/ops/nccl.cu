// NCCL communicator of nccl.h: ncclCommInitRank on the current device, in-place ncclAllReduce
// (sum), ncclReduceScatter (sum) and ncclAllGather on the caller's stream, group calls, and a polling wait on an event that also watches
// ncclCommGetAsyncError and a deadline, aborting the communicator (ncclCommAbort ends its pending
// kernels) before it throws. Status codes become moe::Error through MOE_NCCL_CHECK.
#include "cuda/ops/nccl.h"

#include <nccl.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "cuda/common.h"

#define MOE_NCCL_CHECK(expr)                                                                             \
  do {                                                                                                   \
    const ncclResult_t moe_nccl_rc_ = (expr);                                                            \
    MOE_CHECK(moe_nccl_rc_ == ncclSuccess, "NCCL error ", int(moe_nccl_rc_), " (",                         \
              ncclGetErrorString(moe_nccl_rc_), ") from ", #expr,                                         \
              "; NCCL_DEBUG=WARN (or INFO) prints NCCL's own account of it");                             \
  } while (0)

namespace moe::cuda {

namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(NcclDType t) {
  switch (t) {
    case NcclDType::kF32: return ncclFloat32;
    case NcclDType::kF64: return ncclFloat64;
    case NcclDType::kI64: return ncclInt64;
    case NcclDType::kU32: return ncclUint32;
    case NcclDType::kI32: return ncclInt32;
    case NcclDType::kBF16: return ncclBfloat16;
  }
  MOE_FAIL("NcclDType: expected kF32, kF64, kI64, kU32, kI32 or kBF16, got ", int(t));
}

}  // namespace

int64_t nccl_dtype_bytes(NcclDType t) {
  switch (t) {
    case NcclDType::kF32: return 4;
    case NcclDType::kF64: return 8;
    case NcclDType::kI64: return 8;
    case NcclDType::kU32: return 4;
    case NcclDType::kI32: return 4;
    case NcclDType::kBF16: return 2;
  }
  MOE_FAIL("NcclDType: expected kF32, kF64, kI64, kU32, kI32 or kBF16, got ", int(t));
}

void set_device(int ordinal) {
  const int count = cuda_device_count();
  MOE_CHECK(ordinal >= 0 && ordinal < count, "GPU ", ordinal, " requested but ", count,
            " CUDA device(s) are visible (CUDA_VISIBLE_DEVICES and nvidia-smi say which)");
  MOE_CUDA_CHECK(cudaSetDevice(ordinal));
}

int current_device() {
  int d = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

std::string nccl_version() {
  int v = 0;
  MOE_NCCL_CHECK(ncclGetVersion(&v));
  // Since NCCL 2.9 the code is major * 10000 + minor * 100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

NcclId nccl_make_id() {
  static_assert(sizeof(ncclUniqueId) == kNcclIdBytes, "NCCL_UNIQUE_ID_BYTES changed: update kNcclIdBytes");
  ncclUniqueId raw;
  MOE_NCCL_CHECK(ncclGetUniqueId(&raw));
  NcclId id;
  std::memcpy(id.bytes, raw.internal, sizeof(raw.internal));
  return id;
}

struct NcclComm::Impl {
  ncclComm_t comm = nullptr;
  int rank = 0, size = 1, device = 0;
  double timeout_s = 300;
  bool aborted = false;

  void check_usable(const char* what) const {
    MOE_CHECK(!aborted, what, " on rank ", rank, " of ", size,
              ": the NCCL communicator was aborted after an earlier failure; nothing more can run on it");
  }
  void abort() {
    if (aborted) return;
    aborted = true;
    ncclCommAbort(comm);  // ends this rank's pending NCCL kernels; the result is not actionable
    comm = nullptr;
  }
};

NcclComm::NcclComm(const NcclId& id, int size, int rank, double timeout_s) : impl_(std::make_unique<Impl>()) {
  MOE_CHECK(size >= 1 && rank >= 0 && rank < size, "NcclComm: rank ", rank, " is not in a group of ", size);
  MOE_CHECK(timeout_s > 0, "NcclComm: timeout_s must be positive, got ", timeout_s);
  Impl& I = *impl_;
  I.rank = rank;
  I.size = size;
  I.timeout_s = timeout_s;
  I.device = current_device();
  ncclUniqueId raw;
  std::memcpy(raw.internal, id.bytes, sizeof(raw.internal));
  const ncclResult_t rc = ncclCommInitRank(&I.comm, size, raw, rank);
  MOE_CHECK(rc == ncclSuccess, "ncclCommInitRank failed on rank ", rank, " of ", size, " (GPU ", I.device,
            "): NCCL error ", int(rc), " (", ncclGetErrorString(rc), ": ", ncclGetLastError(nullptr),
            "); every rank needs its own GPU (one process per GPU) and the same NCCL id; NCCL_DEBUG=INFO says more");
}

NcclComm::~NcclComm() {
  if (impl_ && impl_->comm != nullptr && !impl_->aborted) ncclCommDestroy(impl_->comm);
}

int NcclComm::rank() const { return impl_->rank; }
int NcclComm::size() const { return impl_->size; }
int NcclComm::device() const { return impl_->device; }
double NcclComm::timeout_s() const { return impl_->timeout_s; }
bool NcclComm::aborted() const { return impl_->aborted; }

void NcclComm::all_reduce_sum(void* data, int64_t n, NcclDType type, Stream stream) {
  Impl& I = *impl_;
  I.check_usable("all_reduce_sum");
  MOE_CHECK(n >= 0, "NcclComm::all_reduce_sum: element count must be >= 0, got ", n);
  if (n == 0) return;
  MOE_CHECK(data != nullptr, "NcclComm::all_reduce_sum: null buffer for ", n, " elements");
  MOE_NCCL_CHECK(ncclAllReduce(data, data, static_cast<size_t>(n), nccl_type(type), ncclSum, I.comm,
                               static_cast<cudaStream_t>(stream)));
}

void NcclComm::reduce_scatter_sum(void* data, int64_t chunk, NcclDType type, Stream stream) {
  Impl& I = *impl_;
  I.check_usable("reduce_scatter_sum");
  MOE_CHECK(chunk >= 0, "NcclComm::reduce_scatter_sum: chunk must be >= 0, got ", chunk);
  if (chunk == 0) return;
  MOE_CHECK(data != nullptr, "NcclComm::reduce_scatter_sum: null buffer for ", I.size, " chunks of ", chunk);
  auto* base = static_cast<unsigned char*>(data);
  // In place: NCCL's recvbuff = sendbuff + rank x chunk.
  MOE_NCCL_CHECK(ncclReduceScatter(base, base + I.rank * chunk * nccl_dtype_bytes(type), static_cast<size_t>(chunk),
                                   nccl_type(type), ncclSum, I.comm, static_cast<cudaStream_t>(stream)));
}

void NcclComm::all_gather(void* data, int64_t chunk, NcclDType type, Stream stream) {
  Impl& I = *impl_;
  I.check_usable("all_gather");
  MOE_CHECK(chunk >= 0, "NcclComm::all_gather: chunk must be >= 0, got ", chunk);
  if (chunk == 0) return;
  MOE_CHECK(data != nullptr, "NcclComm::all_gather: null buffer for ", I.size, " chunks of ", chunk);
  auto* base = static_cast<unsigned char*>(data);
  // In place: NCCL's sendbuff = recvbuff + rank x chunk.
  MOE_NCCL_CHECK(ncclAllGather(base + I.rank * chunk * nccl_dtype_bytes(type), base, static_cast<size_t>(chunk),
                               nccl_type(type), I.comm, static_cast<cudaStream_t>(stream)));
}

void NcclComm::all_to_all_v(const void* send, const int64_t* send_counts, const int64_t* send_offsets, void* recv,
                            const int64_t* recv_counts, const int64_t* recv_offsets, NcclDType type, Stream stream) {
  Impl& I = *impl_;
  I.check_usable("all_to_all_v");
  MOE_CHECK(send_counts && send_offsets && recv_counts && recv_offsets,
            "NcclComm::all_to_all_v: null count or offset array");
  const int64_t es = nccl_dtype_bytes(type);
  const auto* s = static_cast<const unsigned char*>(send);
  auto* r = static_cast<unsigned char*>(recv);
  for (int p = 0; p < I.size; ++p) {
    MOE_CHECK(send_counts[p] >= 0 && send_offsets[p] >= 0 && recv_counts[p] >= 0 && recv_offsets[p] >= 0,
              "NcclComm::all_to_all_v on rank ", I.rank, ": negative count or offset for peer ", p, " (send ",
              send_counts[p], " at ", send_offsets[p], ", recv ", recv_counts[p], " at ", recv_offsets[p], ")");
    MOE_CHECK((send_counts[p] == 0 || send) && (recv_counts[p] == 0 || recv),
              "NcclComm::all_to_all_v on rank ", I.rank, ": null buffer for a non-empty block of peer ", p);
  }
  MOE_CHECK(send_counts[I.rank] == recv_counts[I.rank], "NcclComm::all_to_all_v on rank ", I.rank,
            ": the block to itself has ", send_counts[I.rank], " elements sent but ", recv_counts[I.rank],
            " received");
  const auto cs = static_cast<cudaStream_t>(stream);
  if (send_counts[I.rank] > 0)
    MOE_CUDA_CHECK(cudaMemcpyAsync(r + recv_offsets[I.rank] * es, s + send_offsets[I.rank] * es,
                                   size_t(send_counts[I.rank] * es), cudaMemcpyDeviceToDevice, cs));
  MOE_NCCL_CHECK(ncclGroupStart());
  for (int p = 0; p < I.size; ++p) {
    if (p == I.rank) continue;
    if (send_counts[p] > 0)
      MOE_NCCL_CHECK(ncclSend(s + send_offsets[p] * es, size_t(send_counts[p]), nccl_type(type), p, I.comm, cs));
    if (recv_counts[p] > 0)
      MOE_NCCL_CHECK(ncclRecv(r + recv_offsets[p] * es, size_t(recv_counts[p]), nccl_type(type), p, I.comm, cs));
  }
  MOE_NCCL_CHECK(ncclGroupEnd());
}

void NcclComm::send(const void* data, int64_t count, NcclDType type, int peer, Stream stream) {
  Impl& I = *impl_;
  I.check_usable("send");
  MOE_CHECK(peer >= 0 && peer < I.size && peer != I.rank && count >= 0 && (count == 0 || data != nullptr),
            "NcclComm::send on rank ", I.rank, " of ", I.size, ": peer ", peer, ", ", count, " elements");
  if (count == 0) return;
  MOE_NCCL_CHECK(ncclSend(data, size_t(count), nccl_type(type), peer, I.comm, static_cast<cudaStream_t>(stream)));
}

void NcclComm::recv(void* data, int64_t count, NcclDType type, int peer, Stream stream) {
  Impl& I = *impl_;
  I.check_usable("recv");
  MOE_CHECK(peer >= 0 && peer < I.size && peer != I.rank && count >= 0 && (count == 0 || data != nullptr),
            "NcclComm::recv on rank ", I.rank, " of ", I.size, ": peer ", peer, ", ", count, " elements");
  if (count == 0) return;
  MOE_NCCL_CHECK(ncclRecv(data, size_t(count), nccl_type(type), peer, I.comm, static_cast<cudaStream_t>(stream)));
}

void NcclComm::group_start() {
  impl_->check_usable("group_start");
  MOE_NCCL_CHECK(ncclGroupStart());
}

void NcclComm::group_end() {
  impl_->check_usable("group_end");
  MOE_NCCL_CHECK(ncclGroupEnd());
}

void NcclComm::wait(Event event, const char* what) {
  Impl& I = *impl_;
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(I.timeout_s));
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) MOE_CUDA_CHECK(e);
    if (I.aborted) MOE_FAIL(what, " on rank ", I.rank, " of ", I.size, ": the NCCL communicator was aborted");
    ncclResult_t async = ncclSuccess;
    MOE_NCCL_CHECK(ncclCommGetAsyncError(I.comm, &async));
    if (async != ncclSuccess && async != ncclInProgress) {
      const std::string detail = ncclGetLastError(I.comm);
      I.abort();
      MOE_FAIL(what, " on rank ", I.rank, " of ", I.size, " (GPU ", I.device, "): NCCL reported error ", int(async),
               " (", ncclGetErrorString(async), ": ", detail, "); the communicator was aborted");
    }
    if (Clock::now() > deadline) {
      I.abort();
      MOE_FAIL(what, " on rank ", I.rank, " of ", I.size, " (GPU ", I.device, ") did not complete within ",
               I.timeout_s, " s: another rank died, hangs, or issued other collectives; the NCCL communicator was "
               "aborted. The limit is parallel.timeout_s (or MOECORE_COMM_TIMEOUT_S)");
    }
    std::this_thread::sleep_for(pause);
    if (pause < std::chrono::microseconds(200)) pause *= 2;
  }
}

}  // namespace moe::cuda
