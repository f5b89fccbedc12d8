// Checked int64 arithmetic for sizes derived from the config (tokens per step, element counts):
// a product or sum that leaves int64 throws moe::Error naming the quantity and its operands,
// instead of wrapping into a small or negative size.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/error.h"

namespace moe {

// a * b; throws naming `what` ("tokens per step = train.global_batch x train.seq_len") on overflow.
inline int64_t checked_mul(int64_t a, int64_t b, std::string_view what) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out))
    MOE_FAIL(what, " overflows int64: ", a, " x ", b, "; reduce the sizes it is made of");
  return out;
}

// a + b; throws naming `what` on overflow.
inline int64_t checked_add(int64_t a, int64_t b, std::string_view what) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out))
    MOE_FAIL(what, " overflows int64: ", a, " + ", b, "; reduce the sizes it is made of");
  return out;
}

}  // namespace moe
