// Config strings of the router to the enums of core/moe_types.h.
#include "core/moe_types.h"

#include "core/error.h"

namespace moe {

ScoreFunc parse_score_func(const std::string& router) {
  if (router == "softmax") return ScoreFunc::kSoftmax;
  if (router == "sigmoid") return ScoreFunc::kSigmoid;
  MOE_FAIL("moe.router = \"", router, "\": expected one of \"softmax\", \"sigmoid\"");
}

RoutingMode parse_routing_mode(const std::string& routing) {
  if (routing == "learned") return RoutingMode::kLearned;
  if (routing == "random") return RoutingMode::kRandom;
  if (routing == "uniform") return RoutingMode::kUniform;
  MOE_FAIL("moe.routing = \"", routing, "\": expected one of \"learned\", \"random\", \"uniform\"");
}

}  // namespace moe
