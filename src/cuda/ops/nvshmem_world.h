// NVSHMEM for the rowwise expert exchange: one PE per GPU, bootstrapped from moecore's own world
// (rank 0 makes a unique id, the world broadcasts its bytes, every rank initialises with it), a
// symmetric heap, stream-ordered puts and barriers. CUDA builds only; without NVSHMEM in the build
// (MOECORE_HAS_NVSHMEM unset) nvshmem_available() is false and every other entry point throws
// naming what is missing. No CUDA or NVSHMEM headers here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/device.h"

namespace moe::cuda {

// True when this build links NVSHMEM.
bool nvshmem_available();

// The bytes of a new NVSHMEM unique id (rank 0 calls it; every rank of the job initialises with
// the same bytes).
std::vector<uint8_t> nvshmem_unique_id();

// NVSHMEM initialised on this process's current GPU as PE `rank` of `npes`, from the unique id's
// bytes; finalised by the destructor. One per process. heap_bytes > 0 sizes the symmetric heap
// (NVSHMEM_SYMMETRIC_SIZE, unless the environment sets it already); 0 keeps NVSHMEM's default.
class NvshmemWorld {
 public:
  NvshmemWorld(int rank, int npes, const std::vector<uint8_t>& unique_id, size_t heap_bytes = 0);
  ~NvshmemWorld();
  NvshmemWorld(const NvshmemWorld&) = delete;
  NvshmemWorld& operator=(const NvshmemWorld&) = delete;

  // This process's world of one PE (the rowwise exchange with every expert local), made on the
  // first call on the current GPU with a heap of at least heap_bytes and kept until the process
  // exits, never finalised (NVSHMEM initialises once per process; at exit its finalisation would
  // run after the CUDA runtime's teardown). Throws when a later call needs a larger heap.
  static NvshmemWorld& one_pe(size_t heap_bytes);

  int pe() const;
  int npes() const;
  // Symmetric allocation (collective: every PE asks for the same size, in the same order).
  void* malloc(size_t bytes);
  void free(void* p);
  // dst (symmetric, on PE `pe`) = src (local device memory), `bytes`, ordered on `stream`.
  void put(void* dst, const void* src, size_t bytes, int pe, Stream stream);
  // Every PE's puts so far complete and visible, ordered on `stream` (collective).
  void barrier(Stream stream);
  // The address through which this GPU's kernels load and store PE `pe`'s copy of the symmetric
  // buffer `sym` (its own for pe(); a peer's through NVLink or PCIe peer mappings). Throws when
  // NVSHMEM cannot map it (a PE on another node: no load/store path).
  void* peer(void* sym, int pe) const;
};

}  // namespace moe::cuda
