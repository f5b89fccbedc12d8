// Which launcher started this process, from its environment (detect_launcher, comm.h): an MPI
// launcher (Open MPI, PMI, PMIx, or Slurm with more than one task), a torchrun-style launch (RANK
// and WORLD_SIZE > 1) or none. An MPI launcher's variables win over RANK and WORLD_SIZE.
#include <cstdlib>
#include <string>

#include "parallel/comm.h"

namespace moe {

std::string detect_launcher(const std::function<const char*(const char*)>& getenv_fn) {
  auto has = [&](const char* n) {
    const char* v = getenv_fn(n);
    return v != nullptr && *v != '\0';
  };
  auto num = [&](const char* n) -> long {
    const char* v = getenv_fn(n);
    return v && *v ? std::strtol(v, nullptr, 10) : 0;
  };
  if (has("OMPI_COMM_WORLD_SIZE") || has("PMI_SIZE") || has("PMI_RANK") || has("PMIX_RANK")) return "mpi";
  if (has("SLURM_PROCID") && num("SLURM_NTASKS") > 1) return "mpi";
  if (has("RANK") && num("WORLD_SIZE") > 1) return "torchrun";
  return "none";
}

}  // namespace moe
