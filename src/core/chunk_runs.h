// The chunks of the flat buffers an optimizer update touches, as runs: the GPU's AdamW launches one
// block per chunk of these runs only (cuda::ParamSegmentTable), so the gaps between a table's
// segments (another group's tensors, the experts' weights the FP8 update takes, another ZeRO-1
// rank's pieces) cost nothing. Host code; the record is core/chunk_run_types.h's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/chunk_run_types.h"
#include "core/error.h"

namespace moe {

// The runs of consecutive `chunk`-element chunks that `segments` (anything with int64 `offset` and
// `numel`, sorted by offset, disjoint) touch, in order; *num_chunks receives the total. Chunks two
// segments share are counted once and adjacent chunks join one run; a segment of no elements
// touches none.
template <typename Segment>
std::vector<ChunkRun> chunk_runs(const std::vector<Segment>& segments, int64_t chunk, int64_t* num_chunks) {
  MOE_CHECK(chunk > 0, "chunk_runs: expected a positive chunk size, got ", chunk);
  std::vector<ChunkRun> runs;
  int64_t total = 0;
  for (const Segment& x : segments) {
    if (x.numel == 0) continue;
    MOE_CHECK(x.offset >= 0 && x.numel > 0, "chunk_runs: a segment at ", x.offset, " of ", x.numel, " elements");
    const int64_t first = x.offset / chunk, last = (x.offset + x.numel - 1) / chunk;
    // The previous run ends at chunk runs.back().first + (total - runs.back().before) - 1.
    if (!runs.empty() && first <= runs.back().first + (total - runs.back().before)) {
      total = std::max(total, runs.back().before + (last - runs.back().first + 1));
      continue;
    }
    runs.push_back({first, total});
    total += last - first + 1;
  }
  if (num_chunks != nullptr) *num_chunks = total;
  return runs;
}

}  // namespace moe
