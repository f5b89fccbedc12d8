// NCCL for data and expert parallelism over GPUs, one GPU per process: the device binding of the
// process, the 128-byte unique id that rank 0 makes and the other ranks receive (over MPI), a
// communicator over the group on the current device (one per group: dp, ep, ep-dp), in-place sum
// all-reduces, reduce-scatters and all-gathers enqueued on a stream (legal inside CUDA graph
// capture), an all-to-all-v of variable
// blocks per peer (grouped ncclSend/ncclRecv), and a wait for device work holding collectives that
// fails instead of hanging when a peer died. No CUDA or NCCL headers: src/train includes it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "cuda/device.h"
#include "cuda/ops/memory.h"

namespace moe::cuda {

// cudaSetDevice(ordinal) for this thread; throws naming the ordinal and the visible device count.
void set_device(int ordinal);
// The current device (cudaGetDevice).
int current_device();

// The NCCL library this process runs ("2.28.9"), from ncclGetVersion.
std::string nccl_version();

constexpr int kNcclIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
struct NcclId {
  unsigned char bytes[kNcclIdBytes] = {};
};
// A fresh id (ncclGetUniqueId): made by one rank, then given to every rank of the group.
NcclId nccl_make_id();

enum class NcclDType { kF32, kF64, kI64, kU32, kI32, kBF16 };
// Bytes of one element of `type`.
int64_t nccl_dtype_bytes(NcclDType type);

class NcclComm {
 public:
  // Collective over the `size` ranks that hold the same id (ncclCommInitRank on the current
  // device; blocks until every rank joined). timeout_s bounds wait().
  NcclComm(const NcclId& id, int size, int rank, double timeout_s);
  ~NcclComm();  // ncclCommDestroy (nothing after an abort); never throws
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const;
  int size() const;
  int device() const;  // the device the communicator was made on
  double timeout_s() const;

  // data[i] = sum over ranks of data[i], i < n, in place in device memory, enqueued on `stream`
  // (returns at once; capturable). Every rank calls it with the same n, type and order. The
  // result is bitwise the same on every rank.
  void all_reduce_sum(void* data, int64_t n, NcclDType type, Stream stream);
  // ZeRO-1's pair, in place over data[0, size() x chunk): reduce_scatter_sum leaves in
  // data[rank() x chunk, (rank() + 1) x chunk) the sum over ranks of that chunk (the rest of
  // data is unspecified afterwards); all_gather copies every rank's chunk r (at r x chunk in its
  // buffer) to r x chunk in every rank's buffer. Enqueued on `stream` (capturable); every rank
  // calls with the same chunk, type and order. chunk == 0: nothing.
  void reduce_scatter_sum(void* data, int64_t chunk, NcclDType type, Stream stream);
  void all_gather(void* data, int64_t chunk, NcclDType type, Stream stream);
  // All-to-all with variable blocks: this rank sends send_counts[p] elements starting at element
  // send_offsets[p] of `send` to peer p and receives recv_counts[p] elements from peer p at element
  // recv_offsets[p] of `recv` (host arrays of size() entries each). One NCCL group of ncclSend /
  // ncclRecv pairs; zero-sized blocks are left out (both sides know the counts, so they agree);
  // the block to this rank itself is a device copy. send and recv must not overlap. Enqueued on
  // `stream`; every rank of the group calls it with matching counts (recv_counts[p] here ==
  // send_counts[this rank] on p).
  void all_to_all_v(const void* send, const int64_t* send_counts, const int64_t* send_offsets, void* recv,
                    const int64_t* recv_counts, const int64_t* recv_offsets, NcclDType type, Stream stream);
  // Point to point: `count` elements to / from rank `peer` of the group (not this rank), enqueued
  // on `stream` (capturable). A send completes only with the peer's matching recv: issue a send
  // and the next recv inside one group_start() / group_end() where each could wait on the other
  // (the pipeline's send-forward-receive-backward pairs).
  void send(const void* data, int64_t count, NcclDType type, int peer, Stream stream);
  void recv(void* data, int64_t count, NcclDType type, int peer, Stream stream);
  // Collectives issued between group_start() and group_end() are launched together.
  void group_start();
  void group_end();

  // Waits until `event` completed, polling it and NCCL's asynchronous error state. When NCCL
  // reports an error, or timeout_s passes (a peer died, hangs, or issued other collectives),
  // aborts the communicator (its pending kernels end, so the stream drains) and throws naming
  // `what`, the rank and the group size.
  void wait(Event event, const char* what);
  // True after the communicator was aborted (every later collective throws).
  bool aborted() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::cuda
