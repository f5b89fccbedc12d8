// Checked errors: MOE_CHECK(cond, parts...) throws moe::Error carrying file:line, the failed
// expression and a message built from `parts` (expected vs got, and what to do).
// MOE_FAIL(parts...) throws unconditionally. Nothing here aborts: callers decide.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace moe {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

[[noreturn]] void throw_error(const char* file, int line, const char* expr, const std::string& msg);
}  // namespace detail

}  // namespace moe

#define MOE_CHECK(cond, ...)                                                              \
  do {                                                                                    \
    if (!(cond)) [[unlikely]] {                                                           \
      ::moe::detail::throw_error(__FILE__, __LINE__, #cond,                               \
                                 ::moe::detail::concat("" __VA_OPT__(, ) __VA_ARGS__));  \
    }                                                                                     \
  } while (0)

#define MOE_FAIL(...) \
  ::moe::detail::throw_error(__FILE__, __LINE__, nullptr, ::moe::detail::concat("" __VA_OPT__(, ) __VA_ARGS__))
