// Local rank, GPU binding and NCCL communicator set-up of nccl_comm.h. Host names travel as
// kHostWords int64 words per rank (zero padded, truncated beyond 255 bytes); the NCCL id as
// kNcclIdBytes / 8 int64 words broadcast from rank 0 of the group.
#include "parallel/nccl_comm.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/error.h"

#ifdef MOECORE_HAS_CUDA
#include "cuda/device.h"
#include "cuda/ops/nccl.h"
#endif

namespace moe {

namespace {

constexpr int64_t kHostWords = 32;  // 256 bytes

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown-host";
  return std::string(buf);
}

}  // namespace

int local_rank_from_env(const std::function<const char*(const char*)>& getenv_fn, std::string* name) {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"}) {
    const char* v = getenv_fn(var);
    if (v == nullptr || *v == '\0') continue;
    char* end = nullptr;
    const long r = std::strtol(v, &end, 10);
    MOE_CHECK(end != nullptr && *end == '\0' && r >= 0 && r < (1L << 30), var,
              " must be a non-negative integer (the launcher's local rank), got '", v, "'");
    if (name) *name = var;
    return int(r);
  }
  return -1;
}

LocalRank local_rank(Comm& world) {
  LocalRank lr;
  lr.host = host_name();
  std::vector<int64_t> mine(kHostWords, 0), all(size_t(kHostWords) * size_t(world.size()), 0);
  std::memcpy(mine.data(), lr.host.data(), std::min<size_t>(lr.host.size(), kHostWords * 8 - 1));
  world.all_gather(mine.data(), all.data(), kHostWords);
  int before = 0, same = 0;
  for (int r = 0; r < world.size(); ++r) {
    if (std::memcmp(all.data() + size_t(r) * kHostWords, mine.data(), kHostWords * 8) != 0) continue;
    ++same;
    if (r < world.rank()) ++before;
  }
  lr.size = same;
  std::string var;
  const int env = local_rank_from_env([](const char* n) -> const char* { return std::getenv(n); }, &var);
  if (env >= 0) {
    MOE_CHECK(env < same, var, " = ", env, " on world rank ", world.rank(), ", but ", same,
              " rank(s) of the job run on host '", lr.host, "': the launcher's local rank must be below that");
    lr.rank = env;
    lr.source = var;
  } else {
    lr.rank = before;
    lr.source = "hostname split";
  }
  return lr;
}

#ifdef MOECORE_HAS_CUDA

int bind_local_gpu(Comm& world, LocalRank* local) {
  const LocalRank lr = local_rank(world);
  if (local) *local = lr;
  const int count = cuda::cuda_device_count();
  MOE_CHECK(count > 0, "rank ", world.rank(), " on host '", lr.host, "' sees no CUDA device (CUDA_VISIBLE_DEVICES, ",
            "nvidia-smi)");
  MOE_CHECK(lr.size <= count, lr.size, " ranks of the job run on host '", lr.host, "' but it has ", count,
            " visible GPU(s); NCCL needs one GPU per rank: launch at most ", count,
            " ranks per host (mpirun -np / --map-by ppr:", count, ":node) or make more GPUs visible");
  const int ordinal = lr.rank % count;
  cuda::set_device(ordinal);
  return ordinal;
}

std::unique_ptr<cuda::NcclComm> make_nccl_comm(Comm& group) {
  static_assert(cuda::kNcclIdBytes % 8 == 0, "the NCCL id travels as int64 words");
  constexpr int64_t kWords = cuda::kNcclIdBytes / 8;
  cuda::NcclId id;
  int64_t words[kWords] = {};
  if (group.rank() == 0) {
    id = cuda::nccl_make_id();
    std::memcpy(words, id.bytes, sizeof(words));
  }
  group.broadcast(words, kWords, 0);
  std::memcpy(id.bytes, words, sizeof(words));
  return std::make_unique<cuda::NcclComm>(id, group.size(), group.rank(), group.timeout_s());
}

#endif  // MOECORE_HAS_CUDA

}  // namespace moe
