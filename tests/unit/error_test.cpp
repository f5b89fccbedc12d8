// Error messages: MOE_CHECK / MOE_FAIL give the message alone, with the site and expression only
// under MOECORE_DEBUG=1 (or when there is no message); checked arithmetic names the quantity.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/checked_math.h"
#include "core/error.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

// Sets MOECORE_DEBUG for one scope (nullptr: unset), restoring what was there.
class DebugEnv {
 public:
  explicit DebugEnv(const char* value) {
    if (const char* old = std::getenv("MOECORE_DEBUG")) old_ = old, had_ = true;
    if (value)
      ::setenv("MOECORE_DEBUG", value, 1);
    else
      ::unsetenv("MOECORE_DEBUG");
  }
  ~DebugEnv() {
    if (had_)
      ::setenv("MOECORE_DEBUG", old_.c_str(), 1);
    else
      ::unsetenv("MOECORE_DEBUG");
  }

 private:
  std::string old_;
  bool had_ = false;
};

void check_two(int two) { MOE_CHECK(two == 2, "expected 2, got ", two, "; pass 2"); }

TEST(Error, MessageAloneByDefault) {
  const DebugEnv env(nullptr);
  EXPECT_EQ(error_of([] { check_two(3); }), "expected 2, got 3; pass 2");
  EXPECT_EQ(error_of([] { MOE_FAIL("no such file '", "x", "'"); }), "no such file 'x'");
  const DebugEnv other("0");
  EXPECT_EQ(error_of([] { check_two(3); }), "expected 2, got 3; pass 2");
}

TEST(Error, SiteAndExpressionUnderMoecoreDebug) {
  const DebugEnv env("1");
  const std::string msg = error_of([] { check_two(3); });
  EXPECT_EQ(msg.rfind("expected 2, got 3; pass 2 [error_test.cpp:", 0), 0u) << msg;
  EXPECT_NE(msg.find(", check: two == 2]"), std::string::npos) << msg;
  const std::string fail = error_of([] { MOE_FAIL("gone"); });
  EXPECT_EQ(fail.rfind("gone [error_test.cpp:", 0), 0u) << fail;
  EXPECT_EQ(fail.find("check:"), std::string::npos) << fail;
}

TEST(Error, CheckWithoutMessageKeepsItsSite) {
  const DebugEnv env(nullptr);
  const std::string msg = error_of([] { MOE_CHECK(1 + 1 == 3); });
  EXPECT_NE(msg.find("check failed [error_test.cpp:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("check: 1 + 1 == 3"), std::string::npos) << msg;
}

TEST(CheckedMath, OverflowNamesTheQuantity) {
  EXPECT_EQ(checked_mul(int64_t(1) << 31, int64_t(1) << 31, "q"), int64_t(1) << 62);
  EXPECT_EQ(checked_add(INT64_MAX - 1, 1, "q"), INT64_MAX);
  const std::string mul = error_of([] { checked_mul(int64_t(1) << 40, int64_t(1) << 30, "tokens per step"); });
  EXPECT_NE(mul.find("tokens per step overflows int64: 1099511627776 x 1073741824"), std::string::npos) << mul;
  const std::string add = error_of([] { checked_add(INT64_MAX, 1, "offset"); });
  EXPECT_NE(add.find("offset overflows int64"), std::string::npos) << add;
}

}  // namespace
}  // namespace moe::testing
