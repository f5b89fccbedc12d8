// A named choice read from an environment variable (the MOECORE_* switches of
// docs/configuration.md that pick between implementations giving the same results).
#pragma once

#include <initializer_list>

namespace moe {

// 0 when `var` is unset or empty, i + 1 when it equals choices[i]; any other value throws
// moe::Error naming the variable, the allowed values and the value found.
int env_choice(const char* var, std::initializer_list<const char*> choices);

}  // namespace moe
