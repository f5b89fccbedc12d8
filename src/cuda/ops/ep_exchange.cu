// Expert-parallel exchange of ep_exchange.h: the host handle (block sizes and offsets per peer, the
// regroup permutation and its inverse), the gather launcher (16-byte path when d % 8 == 0 and both
// buffers are 16-byte aligned), and dispatch / combine, each one NcclComm::all_to_all_v of BF16
// values (counts = rows x d).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "cuda/common.h"
#include "cuda/kernels/ep_exchange.cuh"
#include "cuda/ops/ep_exchange.h"
#include "cuda/ops/launch.h"
#include "cuda/ops/nccl.h"

namespace moe::cuda {

EpHandle make_ep_handle(int ep, int rank, int64_t local_experts, const int32_t* send_counts,
                        const int32_t* recv_counts) {
  const char* op = "make_ep_handle";
  MOE_CHECK(ep >= 1 && rank >= 0 && rank < ep, op, ": rank ", rank, " is not in a group of ", ep);
  MOE_CHECK(local_experts >= 1, op, ": local_experts must be >= 1, got ", local_experts);
  MOE_CHECK(send_counts && recv_counts, op, ": null count array");
  EpHandle p;
  p.ep = ep;
  p.rank = rank;
  p.local_experts = local_experts;
  const int64_t L = local_experts;
  p.send_rows.assign(size_t(ep), 0);
  p.recv_rows.assign(size_t(ep), 0);
  p.send_offsets.assign(size_t(ep), 0);
  p.recv_offsets.assign(size_t(ep), 0);
  for (int q = 0; q < ep; ++q) {
    for (int64_t j = 0; j < L; ++j) {
      const int32_t s = send_counts[q * L + j], r = recv_counts[q * L + j];
      MOE_CHECK(s >= 0 && r >= 0, op, ": negative count for peer ", q, " expert ", j, " (send ", s, ", recv ", r, ")");
      p.send_rows[q] += s;
      p.recv_rows[q] += r;
    }
    p.send_offsets[q] = p.total_send;
    p.recv_offsets[q] = p.total_recv;
    p.total_send += p.send_rows[q];
    p.total_recv += p.recv_rows[q];
  }
  MOE_CHECK(p.total_recv <= INT32_MAX && p.total_send <= INT32_MAX, op, ": ", p.total_recv, " received rows (",
            p.total_send, " sent) do not fit int32 row indices");
  p.local_offsets.assign(size_t(L + 1), 0);
  p.regroup.resize(size_t(p.total_recv));
  p.ungroup.resize(size_t(p.total_recv));
  // Start of block (q, j) inside peer q's received block.
  std::vector<int64_t> within(size_t(ep * L), 0);
  for (int q = 0; q < ep; ++q)
    for (int64_t j = 1; j < L; ++j) within[q * L + j] = within[q * L + j - 1] + recv_counts[q * L + j - 1];
  int64_t at = 0;
  for (int64_t j = 0; j < L; ++j) {
    p.local_offsets[j] = int32_t(at);
    for (int q = 0; q < ep; ++q) {
      const int64_t base = p.recv_offsets[q] + within[q * L + j];
      for (int32_t i = 0; i < recv_counts[q * L + j]; ++i, ++at) {
        p.regroup[at] = int32_t(base + i);
        p.ungroup[base + i] = int32_t(at);
      }
    }
  }
  p.local_offsets[L] = int32_t(at);
  return p;
}

void ep_gather_rows(const uint16_t* src, const int32_t* idx, int64_t rows, int64_t src_rows, int64_t d,
                    uint16_t* dst, Stream stream) {
  const char* op = "cuda::ep_gather_rows";
  MOE_CHECK(rows >= 0 && src_rows >= 0 && d >= 1, op, ": rows, src_rows must be >= 0 and d >= 1, got ", rows, ", ",
            src_rows, ", ", d);
  if (rows == 0) return;
  MOE_CHECK(src && idx && dst, op, ": null buffer for ", rows, " rows");
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool wide = d % 8 == 0 && aligned(src) && aligned(dst);
  const int64_t items = rows * (wide ? d / 8 : d);
  const unsigned blocks = static_cast<unsigned>(std::clamp<int64_t>(
      (items + kernels::kEpGatherThreads - 1) / kernels::kEpGatherThreads, 1, detail::kMaxGridX));
  const auto cs = static_cast<cudaStream_t>(stream);
  if (wide)
    kernels::ep_gather_rows_kernel<8><<<blocks, kernels::kEpGatherThreads, 0, cs>>>(src, idx, rows, src_rows, d, dst);
  else
    kernels::ep_gather_rows_kernel<1><<<blocks, kernels::kEpGatherThreads, 0, cs>>>(src, idx, rows, src_rows, d, dst);
  check_launch("ep_gather_rows_kernel");
}

namespace {

// One all_to_all_v of the handle's row blocks: dispatch sends the send blocks and receives the
// receive blocks; combine the other way round.
void exchange_rows(const char* op, NcclComm& comm, const EpHandle& handle, bool dispatch, const uint16_t* send,
                   uint16_t* recv, int64_t d, Stream stream) {
  MOE_CHECK(comm.size() == handle.ep && comm.rank() == handle.rank, op, ": the handle is for rank ", handle.rank,
            " of ", handle.ep, " but the communicator is rank ", comm.rank(), " of ", comm.size());
  std::vector<int64_t> sc(size_t(handle.ep)), so(size_t(handle.ep)), rc(size_t(handle.ep)), ro(size_t(handle.ep));
  for (int q = 0; q < handle.ep; ++q) {
    sc[q] = (dispatch ? handle.send_rows[q] : handle.recv_rows[q]) * d;
    so[q] = (dispatch ? handle.send_offsets[q] : handle.recv_offsets[q]) * d;
    rc[q] = (dispatch ? handle.recv_rows[q] : handle.send_rows[q]) * d;
    ro[q] = (dispatch ? handle.recv_offsets[q] : handle.send_offsets[q]) * d;
  }
  comm.all_to_all_v(send, sc.data(), so.data(), recv, rc.data(), ro.data(), NcclDType::kBF16, stream);
}

}  // namespace

void ep_dispatch_rows(NcclComm& comm, const EpHandle& handle, const uint16_t* send, uint16_t* recv, int64_t d,
                      Stream stream) {
  exchange_rows("cuda::ep_dispatch_rows", comm, handle, true, send, recv, d, stream);
}

void ep_combine_rows(NcclComm& comm, const EpHandle& handle, const uint16_t* send, uint16_t* recv, int64_t d,
                     Stream stream) {
  exchange_rows("cuda::ep_combine_rows", comm, handle, false, send, recv, d, stream);
}

void sum_of_squares(const double* values, int64_t n, double* out, Stream stream) {
  MOE_CHECK(n >= 0 && out && (n == 0 || values), "cuda::sum_of_squares: n must be >= 0 with non-null buffers, got ", n);
  kernels::ep_norm_combine_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(values, n, true, out);
  check_launch("ep_norm_combine_kernel");
}

void sqrt_of_sum(const double* values, int64_t n, double* out, Stream stream) {
  MOE_CHECK(n >= 0 && out && (n == 0 || values), "cuda::sqrt_of_sum: n must be >= 0 with non-null buffers, got ", n);
  kernels::ep_norm_combine_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(values, n, false, out);
  check_launch("ep_norm_combine_kernel");
}

}  // namespace moe::cuda
