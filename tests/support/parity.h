// Parity between a backend's output and the CPU reference under a written tolerance (docs/cuda.md).
// Elementwise: |got_i - ref_i| <= rtol * |ref_i| + atol * max_j |ref_j| (atol is relative to the
// tensor's scale); normwise: ||got - ref||_2 <= norm_rtol * ||ref||_2. Exact means bitwise equal.
// A NaN or Inf in either tensor always fails. Each check prints one "parity NAME: ..." line.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

namespace moe::testing {

struct Tolerance {
  const char* name;
  double rtol;       // elementwise, relative to |ref_i|
  double atol;       // elementwise floor, relative to max_j |ref_j|
  double norm_rtol;  // normwise, relative to ||ref||_2
  bool exact;        // bitwise equality; the numbers above are unused
};

// The tolerance table, one row per kind of output.
// Indices, counts, data movement, and sums done in the reference's own order: bitwise.
inline constexpr Tolerance kExact{"exact", 0.0, 0.0, 0.0, true};
// BF16 result of an op computed in FP32 from the same BF16 inputs: the reference stays in FP32,
// the result is rounded once to BF16 (unit roundoff 2^-8), and either side's FP32 rounding may
// tip the result to the neighbouring BF16 value: 1 BF16 ulp (2^-7 relative) per element, a floor
// of 2^-14 of the tensor's scale for results that cancel to near zero, and 2^-8 normwise.
inline constexpr Tolerance kBF16Elementwise{"bf16", 0x1p-7, 0x1p-14, 0x1p-8, false};
// FP32 results of reductions (row statistics, parameter gradients summed over up to ~16k rows)
// whose order differs from the reference's: a few units of FP32 roundoff times sqrt(terms).
inline constexpr Tolerance kFP32Reduction{"fp32-reduction", 3e-5, 3e-5, 1e-5, false};

struct ParityResult {
  bool ok = true;
  int64_t num_bad = 0;        // elements outside the elementwise bound (or not bitwise equal)
  int64_t num_nonfinite = 0;  // NaN or Inf on either side
  int64_t first_bad = -1;
  double max_abs_err = 0.0;
  double max_rel_err = 0.0;   // max_i |err_i| / max(|ref_i|, tiny)
  double norm_err = 0.0;      // ||got - ref|| / ||ref||
};

inline ParityResult compare_parity(const float* got, const float* ref, int64_t n, const Tolerance& tol) {
  ParityResult r;
  double max_ref = 0.0, sum_sq_err = 0.0, sum_sq_ref = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isfinite(ref[i])) max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[i])));
  }
  const double floor = tol.atol * max_ref;
  for (int64_t i = 0; i < n; ++i) {
    const double g = got[i], f = ref[i];
    bool bad = false;
    if (!std::isfinite(g) || !std::isfinite(f)) {
      ++r.num_nonfinite;
      bad = true;
    } else {
      const double err = std::fabs(g - f);
      sum_sq_err += err * err;
      sum_sq_ref += f * f;
      r.max_abs_err = std::max(r.max_abs_err, err);
      r.max_rel_err = std::max(r.max_rel_err, err / std::max(std::fabs(f), 1e-30));
      if (tol.exact) {
        bad = std::memcmp(&got[i], &ref[i], sizeof(float)) != 0;
      } else {
        bad = err > tol.rtol * std::fabs(f) + floor;
      }
    }
    if (bad) {
      if (r.first_bad < 0) r.first_bad = i;
      ++r.num_bad;
    }
  }
  r.norm_err = sum_sq_ref > 0.0 ? std::sqrt(sum_sq_err / sum_sq_ref) : std::sqrt(sum_sq_err);
  r.ok = r.num_bad == 0 && (tol.exact || r.norm_err <= tol.norm_rtol);
  return r;
}

// Compares and reports through GoogleTest, naming the check, the tolerance row and the first bad element.
inline void expect_parity(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref,
                          const Tolerance& tol) {
  ASSERT_EQ(got.size(), ref.size()) << what << ": result and reference sizes differ";
  const ParityResult r = compare_parity(got.data(), ref.data(), static_cast<int64_t>(got.size()), tol);
  std::printf("parity %s: n=%zu tol=%s max_abs=%.3e max_rel=%.3e norm=%.3e bad=%lld nonfinite=%lld\n",
              what.c_str(), got.size(), tol.name, r.max_abs_err, r.max_rel_err, r.norm_err,
              static_cast<long long>(r.num_bad), static_cast<long long>(r.num_nonfinite));
  if (!r.ok) {
    std::ostringstream os;
    os << what << " fails tolerance '" << tol.name << "': " << r.num_bad << " of " << got.size()
       << " elements out of bounds (" << r.num_nonfinite << " NaN/Inf), norm error " << r.norm_err
       << " (limit " << tol.norm_rtol << ")";
    if (r.first_bad >= 0) {
      os << "; first at index " << r.first_bad << ": got " << got[r.first_bad] << ", reference "
         << ref[r.first_bad];
    }
    ADD_FAILURE() << os.str();
  }
}

}  // namespace moe::testing
