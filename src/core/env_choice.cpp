#include "core/env_choice.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "core/error.h"

namespace moe {

int env_choice(const char* var, std::initializer_list<const char*> choices) {
  const char* v = std::getenv(var);
  if (v == nullptr || *v == '\0') return 0;
  int i = 0;
  std::string allowed;
  for (const char* c : choices) {
    ++i;
    if (std::strcmp(v, c) == 0) return i;
    allowed += (allowed.empty() ? "'" : " or '") + std::string(c) + "'";
  }
  MOE_FAIL("environment variable ", var, " must be ", allowed, " (or unset), got '", v, "'");
}

}  // namespace moe
