// Setting up a multi-GPU job, one GPU per process: which rank of its host a process is (its
// local rank), binding the process to GPU local_rank % visible GPUs before any CUDA allocation,
// and an NCCL communicator over the ranks of a host communicator (rank 0 makes the NCCL id and
// broadcasts it as 16 int64 words). The local-rank rule is in every build; the NCCL parts exist
// only in CUDA builds (MOECORE_HAS_CUDA). No CUDA or NCCL headers.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "parallel/comm.h"

namespace moe {

namespace cuda {
class NcclComm;
}

struct LocalRank {
  int rank = 0;          // index of this process among the processes of its host
  int size = 1;          // processes on its host
  std::string host;      // gethostname()
  std::string source;    // where `rank` came from: the variable's name, or "hostname split"
};

// The launcher's local rank when the environment names one, in this order:
// OMPI_COMM_WORLD_LOCAL_RANK (Open MPI), MPI_LOCALRANKID (MPICH, Intel MPI), SLURM_LOCALID,
// LOCAL_RANK (torchrun-style); -1 when none is set. `name` (may be null) receives the variable's
// name. Throws when the variable holds no non-negative integer. Exposed for tests.
int local_rank_from_env(const std::function<const char*(const char*)>& getenv_fn, std::string* name = nullptr);

// Collective over `world`: every rank's host name is all-gathered (as int64 words), so that
// size counts the ranks on this host and, when the environment names no local rank, rank is the
// number of lower world ranks on the same host (what an MPI_COMM_TYPE_SHARED split orders).
LocalRank local_rank(Comm& world);

#ifdef MOECORE_HAS_CUDA
// Collective over `world`: local_rank(world), then cudaSetDevice(local.rank % device count).
// Throws, naming the host and the counts, when the host runs more ranks than it has visible GPUs
// (NCCL needs one GPU per rank). Call it before anything allocates on a GPU. Returns the ordinal.
int bind_local_gpu(Comm& world, LocalRank* local = nullptr);

// Collective over `group`: an NCCL communicator with the same ranks and order on the current
// device; the NCCL id travels from rank 0 over `group`. Its wait() deadline is group.timeout_s().
std::unique_ptr<cuda::NcclComm> make_nccl_comm(Comm& group);
#endif

}  // namespace moe
