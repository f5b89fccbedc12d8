// NVSHMEM host calls behind cuda/ops/nvshmem_world.h: unique-id bootstrap of the host library
// (nvshmemx_hostlib_init_attr, as NVSHMEM's Python bindings initialise it), symmetric heap,
// putmem/barrier on a stream. Compiled with the NVSHMEM headers only when the build found them.
#include "cuda/ops/nvshmem_world.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "core/error.h"

#ifdef MOECORE_HAS_NVSHMEM
#include <cuda_runtime.h>
#include <nvshmem_host.h>
#endif

namespace moe::cuda {

#ifndef MOECORE_HAS_NVSHMEM

namespace {
[[noreturn]] void missing(const char* what) {
  MOE_FAIL(what, ": this build has no NVSHMEM (run scripts/setup.sh, which fetches nvidia-nvshmem-cu13, or pass "
           "-DNVSHMEM_ROOT=<dir>, then configure again)");
}
}  // namespace

bool nvshmem_available() { return false; }
std::vector<uint8_t> nvshmem_unique_id() { missing("nvshmem_unique_id"); }
NvshmemWorld::NvshmemWorld(int, int, const std::vector<uint8_t>&, size_t) { missing("NvshmemWorld"); }
NvshmemWorld::~NvshmemWorld() = default;
NvshmemWorld& NvshmemWorld::one_pe(size_t) { missing("NvshmemWorld::one_pe"); }
int NvshmemWorld::pe() const { missing("NvshmemWorld::pe"); }
int NvshmemWorld::npes() const { missing("NvshmemWorld::npes"); }
void* NvshmemWorld::malloc(size_t) { missing("NvshmemWorld::malloc"); }
void NvshmemWorld::free(void*) { missing("NvshmemWorld::free"); }
void NvshmemWorld::put(void*, const void*, size_t, int, Stream) { missing("NvshmemWorld::put"); }
void NvshmemWorld::barrier(Stream) { missing("NvshmemWorld::barrier"); }
void* NvshmemWorld::peer(void*, int) const { missing("NvshmemWorld::peer"); }

#else

bool nvshmem_available() { return true; }

std::vector<uint8_t> nvshmem_unique_id() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;  // the struct's version, which NVSHMEM checks
  const int status = nvshmemx_get_uniqueid(&id);
  MOE_CHECK(status == 0, "nvshmemx_get_uniqueid failed with status ", status);
  std::vector<uint8_t> bytes(sizeof id);
  std::memcpy(bytes.data(), &id, sizeof id);
  return bytes;
}

NvshmemWorld::NvshmemWorld(int rank, int npes, const std::vector<uint8_t>& unique_id, size_t heap_bytes) {
  MOE_CHECK(npes >= 1 && rank >= 0 && rank < npes, "NvshmemWorld: rank ", rank, " of ", npes, " PEs");
  if (heap_bytes > 0 && std::getenv("NVSHMEM_SYMMETRIC_SIZE") == nullptr)
    setenv("NVSHMEM_SYMMETRIC_SIZE", std::to_string(heap_bytes).c_str(), 1);
  MOE_CHECK(unique_id.size() == sizeof(nvshmemx_uniqueid_t), "NvshmemWorld: the unique id has ", unique_id.size(),
            " bytes, NVSHMEM's has ", sizeof(nvshmemx_uniqueid_t), " (ids from another NVSHMEM version?)");
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  std::memcpy(&id, unique_id.data(), sizeof id);  // rank 0's id, its version included
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  int status = nvshmemx_set_attr_uniqueid_args(rank, npes, &id, &attr);
  MOE_CHECK(status == 0, "nvshmemx_set_attr_uniqueid_args(rank ", rank, ", ", npes, " PEs) failed with status ",
            status);
  // The host library's own initialisation (no device-side NVSHMEM state: the stream-ordered host
  // calls below need none; device-initiated puts would link libnvshmem_device.a with -rdc).
  status = nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
  MOE_CHECK(status == 0, "nvshmemx_hostlib_init_attr (unique id, rank ", rank, " of ", npes, ") failed with status ",
            status);
  MOE_CHECK(nvshmem_my_pe() == rank && nvshmem_n_pes() == npes, "NVSHMEM made this process PE ", nvshmem_my_pe(),
            " of ", nvshmem_n_pes(), ", expected ", rank, " of ", npes);
}

NvshmemWorld::~NvshmemWorld() { nvshmemx_hostlib_finalize(); }

NvshmemWorld& NvshmemWorld::one_pe(size_t heap_bytes) {
  // Never finalised: at exit the CUDA runtime may already be torn down, and NVSHMEM's finalisation
  // then faults; the process's end releases the heap.
  static NvshmemWorld* world = nullptr;
  static size_t heap = 0;
  if (world == nullptr) {
    heap = heap_bytes;
    world = new NvshmemWorld(0, 1, nvshmem_unique_id(), heap_bytes);
  }
  MOE_CHECK(heap_bytes <= heap || heap == 0, "NvshmemWorld::one_pe: this process's NVSHMEM heap was made for ", heap,
            " bytes; ", heap_bytes, " are asked for now (one NVSHMEM initialisation per process)");
  return *world;
}

int NvshmemWorld::pe() const { return nvshmem_my_pe(); }
int NvshmemWorld::npes() const { return nvshmem_n_pes(); }

void* NvshmemWorld::malloc(size_t bytes) {
  void* p = nvshmem_malloc(bytes);
  MOE_CHECK(p != nullptr || bytes == 0, "nvshmem_malloc(", bytes, " bytes) failed: the symmetric heap is too small "
            "(NVSHMEM_SYMMETRIC_SIZE sets it)");
  return p;
}

void NvshmemWorld::free(void* p) { nvshmem_free(p); }

void NvshmemWorld::put(void* dst, const void* src, size_t bytes, int pe, Stream stream) {
  MOE_CHECK(pe >= 0 && pe < nvshmem_n_pes(), "NvshmemWorld::put: PE ", pe, " outside ", nvshmem_n_pes(), " PEs");
  nvshmemx_putmem_on_stream(dst, src, bytes, pe, reinterpret_cast<cudaStream_t>(stream));
}

void NvshmemWorld::barrier(Stream stream) { nvshmemx_barrier_all_on_stream(reinterpret_cast<cudaStream_t>(stream)); }

void* NvshmemWorld::peer(void* sym, int pe) const {
  MOE_CHECK(pe >= 0 && pe < nvshmem_n_pes(), "NvshmemWorld::peer: PE ", pe, " outside ", nvshmem_n_pes(), " PEs");
  if (pe == nvshmem_my_pe()) return sym;
  void* p = nvshmem_ptr(sym, pe);
  MOE_CHECK(p != nullptr, "NvshmemWorld::peer: PE ", pe, "'s symmetric memory cannot be loaded from or stored to by ",
            "this GPU (no NVLink or PCIe peer path: another node?); the rowwise exchange needs every PE of the ",
            "expert-parallel group on one node");
  return p;
}

#endif

}  // namespace moe::cuda
