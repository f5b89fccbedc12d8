#include "cuda/sm_reserve.h"

#include <algorithm>

#include "core/error.h"

namespace moe::cuda {

namespace {
thread_local int t_reserved = 0;
}  // namespace

int reserved_sms() { return t_reserved; }

int set_reserved_sms(int sms) {
  MOE_CHECK(sms >= 0, "cuda::set_reserved_sms: expected a reserve >= 0 multiprocessors, got ", sms);
  const int previous = t_reserved;
  t_reserved = sms;
  return previous;
}

int gemm_sms(int device_sms) { return std::max(1, device_sms - t_reserved); }

}  // namespace moe::cuda
