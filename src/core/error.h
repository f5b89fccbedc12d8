// Checked errors: MOE_CHECK(cond, parts...) throws moe::Error with a message built from `parts`
// (expected vs got, and what to do). MOE_FAIL(parts...) throws unconditionally. The message is
// for users; the site (file:line) and the failed expression are appended only when the
// environment sets MOECORE_DEBUG=1. Nothing here aborts: callers decide.
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

// True when MOECORE_DEBUG=1: check messages carry " [file:line, check: expr]".
bool debug_messages();

// MOE_CHECK / MOE_FAIL: `msg`, plus the site and expression under MOECORE_DEBUG=1 (always when
// `msg` is empty, since then they are all there is to say).
[[noreturn]] void throw_check(const char* file, int line, const char* expr, const std::string& msg);

// Always with " [file:line]": the status-code checks of the CUDA libraries (src/cuda/common.h),
// whose reader is debugging whatever the environment says.
[[noreturn]] void throw_error(const char* file, int line, const char* expr, const std::string& msg);
}  // namespace detail

}  // namespace moe

#define MOE_CHECK(cond, ...)                                                              \
  do {                                                                                    \
    if (!(cond)) [[unlikely]] {                                                           \
      ::moe::detail::throw_check(__FILE__, __LINE__, #cond,                               \
                                 ::moe::detail::concat("" __VA_OPT__(, ) __VA_ARGS__));  \
    }                                                                                     \
  } while (0)

#define MOE_FAIL(...) \
  ::moe::detail::throw_check(__FILE__, __LINE__, nullptr, ::moe::detail::concat("" __VA_OPT__(, ) __VA_ARGS__))
