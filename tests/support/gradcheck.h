// Finite-difference gradient checks (double precision) and deterministic test inputs.
// Error metric (docs/numerics.md): max_i |analytic_i - numeric_i| / max(max_i |numeric_i|, 1e-12),
// numeric_i by central differences with step h. Every check prints one "gradcheck" line so
// the worst error of a run can be collected with grep.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace moe::testing {

constexpr double kGradTol = 1e-6;

inline std::vector<double> random_vector(int64_t n, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(gen);
  return v;
}

struct GradCheckResult {
  double rel_err = 0.0;
  double max_abs_err = 0.0;
  double max_ref = 0.0;
  int64_t worst_index = -1;
};

// Perturbs x[i] for every i in `indices` (all when empty), calls loss(), and compares with
// analytic[i]. `x` is restored afterwards.
inline GradCheckResult grad_check(std::vector<double>& x, const std::vector<double>& analytic,
                                  const std::function<double()>& loss, double h = 1e-6,
                                  std::vector<int64_t> indices = {}) {
  EXPECT_EQ(x.size(), analytic.size());
  if (indices.empty()) {
    indices.resize(x.size());
    for (size_t i = 0; i < x.size(); ++i) indices[i] = static_cast<int64_t>(i);
  }
  GradCheckResult r;
  std::vector<double> numeric(indices.size());
  for (size_t j = 0; j < indices.size(); ++j) {
    const int64_t i = indices[j];
    const double saved = x[i];
    x[i] = saved + h;
    const double fp = loss();
    x[i] = saved - h;
    const double fm = loss();
    x[i] = saved;
    numeric[j] = (fp - fm) / (2 * h);
    r.max_ref = std::max(r.max_ref, std::abs(numeric[j]));
  }
  for (size_t j = 0; j < indices.size(); ++j) {
    const double err = std::abs(analytic[indices[j]] - numeric[j]);
    if (err > r.max_abs_err) {
      r.max_abs_err = err;
      r.worst_index = indices[j];
    }
  }
  r.rel_err = r.max_abs_err / std::max(r.max_ref, 1e-12);
  return r;
}

// Checks and reports one named gradient.
inline void expect_grad_close(const std::string& name, std::vector<double>& x,
                              const std::vector<double>& analytic,
                              const std::function<double()>& loss, double tol = kGradTol,
                              double h = 1e-6, std::vector<int64_t> indices = {}) {
  GradCheckResult r = grad_check(x, analytic, loss, h, std::move(indices));
  std::printf("gradcheck %s: rel_err=%.3e max_abs_err=%.3e max_ref=%.3e\n", name.c_str(), r.rel_err,
              r.max_abs_err, r.max_ref);
  EXPECT_LE(r.rel_err, tol) << name << ": worst element " << r.worst_index << " (analytic "
                            << (r.worst_index >= 0 ? analytic[r.worst_index] : 0.0) << ")";
}

// Weighted sum loss L = sum_i out_i * w_i, the usual way to test every output element.
inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace moe::testing
