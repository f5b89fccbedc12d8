#include "core/recompute.h"

#include "core/error.h"

namespace moe {

Recompute parse_recompute(const std::string& mode) {
  if (mode == "none") return Recompute::kNone;
  if (mode == "selective") return Recompute::kSelective;
  if (mode == "full") return Recompute::kFull;
  MOE_FAIL("train.recompute = \"", mode, "\" is not a recompute mode; expected \"none\", \"selective\" or \"full\"");
}

const char* recompute_name(Recompute mode) {
  switch (mode) {
    case Recompute::kNone:
      return "none";
    case Recompute::kSelective:
      return "selective";
    case Recompute::kFull:
      return "full";
  }
  return "?";
}

}  // namespace moe
