// Parity between a backend's output and a reference under a written tolerance (docs/numerics.md).
// Elementwise: |got_i - ref_i| <= rtol * |ref_i| + atol * max_j |ref_j| (atol is relative to the
// tensor's scale); normwise: ||got - ref||_2 <= norm_rtol * ||ref||_2. Exact means bitwise equal.
// A NaN or Inf in either tensor always fails. Each check prints one "parity NAME: ..." line
// (scripts/parity-summary reads them). Every tolerance row of the suite is defined here.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace moe::testing {

struct Tolerance {
  const char* name;
  double rtol;       // elementwise, relative to |ref_i|
  double atol;       // elementwise floor, relative to max_j |ref_j|
  double norm_rtol;  // normwise, relative to ||ref||_2
  bool exact;        // bitwise equality; the numbers above are unused
};

// The tolerance table, one row per kind of output; docs/numerics.md lists every row with its
// reasoning. A new row goes here, with its justification, and into that table.

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
// A BF16 pair rotation undone by its inverse (RoPE forward then backward against the input): two
// BF16 roundings, each relative to the pair's norm rather than to the element's own size, so a
// floor only (2^-6 of the tensor's scale, twice the one-rounding ulp) and 2^-7 normwise.
inline constexpr Tolerance kBF16x2Pairs{"bf16x2-pairs", 0.0, 0x1p-6, 0x1p-7, false};
// BF16 outputs of attention. The kernels round the probabilities P (forward, and dV in the
// backward) and dS (dQ, dK) to BF16 before their tensor-core products, as FlashAttention does
// (cuDNN's SDPA too); the FP32 reference does not. Each such rounding is an independent relative
// error of at most 2^-9 per term, so a sum over keys (or queries) carries a random-walk error of
// about 2^-9 / sqrt(3) of the root-sum-square of its terms, about the size of the result itself on
// these random inputs; the output's own rounding adds up to 2^-9 more. Hence 2 BF16 ulps
// (2^-6) per element, a floor of 2^-8 of the tensor's largest value for results that cancel
// (some 15 standard deviations of the rounding noise above it), and 2^-7 normwise (about 3x the
// expected error). An emulation of these roundings in double on the test's shapes (seq
// 7 to 4096, hd 64 and 128) gave norm errors 1.5e-3 to 2.4e-3 and worst elements at 0.45 of the bound.
inline constexpr Tolerance kAttentionBF16{"bf16-attention", 0x1p-6, 0x1p-8, 0x1p-7, false};
// One attention backend against the other: each is within the row above of the reference, so
// (triangle inequality) they agree within twice it; the same for lse against the FP32-reduction row.
inline constexpr Tolerance kAttentionBF16Pair{"bf16-attention x2", 0x1p-5, 0x1p-7, 0x1p-6, false};
inline constexpr Tolerance kFP32ReductionPair{"fp32-reduction x2", 6e-5, 6e-5, 2e-5, false};
// FP32 results of the same formula whose inputs may differ in the last bit (the optimizer step
// with clipping: the clip factor is computed from norms summed in different orders): 1e-6
// relative, a floor of 1e-7 of the tensor's scale for moments that cancel to near zero.
inline constexpr Tolerance kFP32Update{"fp32-update", 1e-6, 1e-7, 1e-7, false};
// Expert-parallel CPU runs against the one-process reference (tests/parallel/ep_check.h): the same
// FP32 math with an expert's rows grouped by source rank, so GEMM and weight-gradient sums run in
// another order: 1e-5 relative elementwise with a floor of 1e-5 of the tensor's largest value,
// and 1e-5 normwise (measured worst normwise 2.3e-6).
inline constexpr Tolerance kEpTol{"ep-fp32-1e-5", 1e-5, 1e-5, 1e-5, false};
// The experts' weight gradients under the FP8 recipe where the expert-parallel run's blocks of an
// expert's rows differ from the reference's (tests/parallel/ep_check.h): the recipe quantises a
// weight gradient's two operands in 1 x 128 blocks down the expert's rows, the EP experts over the
// rows of every rank of their group at once, the reference over one micro-batch's (or all tokens').
// Each operand's element then lands on the FP8 grid of another scale, up to one E4M3 half-ulp
// (2^-4 relative) on either side in each run: up to 2 x 2 x 2^-4 = 25% per product, the normwise
// bound (elementwise unbounded near zero, so normwise only). Measured worst 12% normwise, on the
// tests' tiny experts (d 8, hidden 6, a few rows per expert).
inline constexpr Tolerance kEpFp8GroupedWgrad{"ep-fp8-wgrad-groups", 1.0, 1.0, 0.25, false};

struct ParityResult {
  bool ok = true;
  int64_t num_bad = 0;        // elements outside the elementwise bound (or not bitwise equal)
  int64_t num_nonfinite = 0;  // NaN or Inf on either side
  int64_t first_bad = -1;
  double max_abs_err = 0.0;
  double max_rel_err = 0.0;   // max_i |err_i| / max(|ref_i|, tiny)
  double norm_err = 0.0;      // ||got - ref|| / ||ref||
};

// Elements of float or double tensors; exact compares the bits of T.
template <typename T>
ParityResult compare_parity(const T* got, const T* ref, int64_t n, const Tolerance& tol) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "compare_parity takes float or double");
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
        bad = std::memcmp(&got[i], &ref[i], sizeof(T)) != 0;
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

// Compares n elements, prints the check's "parity" line and reports a failure through GoogleTest,
// naming the check, `where` (when given: the shape, the rank), the tolerance row and the first
// bad element.
template <typename T>
void expect_parity_n(const std::string& what, const T* got, const T* ref, int64_t n, const Tolerance& tol,
                     const std::string& where = "") {
  const ParityResult r = compare_parity(got, ref, n, tol);
  std::printf("parity %s: n=%lld tol=%s max_abs=%.3e max_rel=%.3e norm=%.3e bad=%lld nonfinite=%lld\n",
              what.c_str(), static_cast<long long>(n), tol.name, r.max_abs_err, r.max_rel_err, r.norm_err,
              static_cast<long long>(r.num_bad), static_cast<long long>(r.num_nonfinite));
  if (!r.ok) {
    std::ostringstream os;
    os << what;
    if (!where.empty()) os << " (" << where << ")";
    os << " fails tolerance '" << tol.name << "': " << r.num_bad << " of " << n << " elements out of bounds ("
       << r.num_nonfinite << " NaN/Inf), norm error " << r.norm_err << " (limit " << tol.norm_rtol << ")";
    if (r.first_bad >= 0) {
      os << "; first at index " << r.first_bad << ": got " << got[r.first_bad] << ", reference "
         << ref[r.first_bad];
    }
    ADD_FAILURE() << os.str();
  }
}

// ||got - ref||_2 / ||ref||_2 in double (how far a whole tensor moved, e.g. under FP8).
inline double normwise_difference(const std::vector<float>& got, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size() && i < ref.size(); ++i) {
    num += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

inline void expect_parity(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref,
                          const Tolerance& tol) {
  ASSERT_EQ(got.size(), ref.size()) << what << ": result and reference sizes differ";
  expect_parity_n(what, got.data(), ref.data(), static_cast<int64_t>(got.size()), tol);
}

inline void expect_parity(const std::string& what, const std::vector<double>& got, const std::vector<double>& ref,
                          const Tolerance& tol) {
  ASSERT_EQ(got.size(), ref.size()) << what << ": result and reference sizes differ";
  expect_parity_n(what, got.data(), ref.data(), static_cast<int64_t>(got.size()), tol);
}

}  // namespace moe::testing
