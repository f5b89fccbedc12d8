// The error path of phase_name (core/phase.h), out of line so the header stays free of the
// error machinery.
#include "core/phase.h"

#include "core/error.h"

namespace moe::detail {

void throw_bad_phase(int p) { MOE_FAIL("phase_name: expected a phase below kCount, got ", p); }

}  // namespace moe::detail
