// A run of consecutive optimizer chunks (core/chunk_runs.h): the plain record the host builds and
// the device code walks.
#pragma once

#include <cstdint>

namespace moe {

// Chunks from chunk `first`; in the compact numbering a launch walks, they come after the
// `before` chunks of the runs ahead of it (so a run holds the next run's `before` minus its own,
// the last one the total minus its own). Copied to the device as is.
struct ChunkRun {
  int64_t first = 0;
  int64_t before = 0;
};
static_assert(sizeof(ChunkRun) == 16, "ChunkRun is copied to the device as is");

}  // namespace moe
