// Dispatch tests: the counting sort (stable, prefix-sum offsets, inverse map) on a hand case
// and on random routes with empty experts, exact data movement of permute/unpermute with
// integer-valued inputs, dropped routes, finite-difference gradients and index errors.
#include <cstring>
#include <functional>
#include <string>

#include "moe_test_util.h"

namespace moe::testing {
namespace {

struct DispatchMap {
  std::vector<int32_t> counts, offsets, sorted_route, route_to_row;
};

DispatchMap make_map(const std::vector<int32_t>& idx, int64_t n, int64_t k, int64_t ne) {
  DispatchMap m;
  m.counts.assign(ne, -1);
  m.offsets.assign(ne + 1, -1);
  m.sorted_route.assign(n * k, -7);
  m.route_to_row.assign(n * k, -7);
  cpu::build_dispatch_map(idx.data(), n, k, ne, m.counts.data(), m.offsets.data(),
                          m.sorted_route.data(), m.route_to_row.data());
  return m;
}

void expect_valid_map(const std::vector<int32_t>& idx, int64_t n, int64_t k, int64_t ne,
                      const DispatchMap& m) {
  std::vector<int32_t> ref(ne, 0);
  for (int32_t e : idx) ++ref[e];
  EXPECT_EQ(m.counts, ref);
  ASSERT_EQ(m.offsets[0], 0);
  for (int64_t e = 0; e < ne; ++e) EXPECT_EQ(m.offsets[e + 1], m.offsets[e] + ref[e]) << "expert " << e;
  EXPECT_EQ(m.offsets[ne], n * k);
  for (int64_t e = 0; e < ne; ++e) {
    for (int32_t row = m.offsets[e]; row < m.offsets[e + 1]; ++row) {
      const int32_t r = m.sorted_route[row];
      EXPECT_EQ(idx[r], e) << "row " << row << " holds route " << r << " of another expert";
      if (row > m.offsets[e]) {
        EXPECT_LT(m.sorted_route[row - 1], r) << "not stable at row " << row;
      }
    }
  }
  for (int64_t r = 0; r < n * k; ++r) {
    EXPECT_EQ(m.sorted_route[m.route_to_row[r]], r) << "route_to_row is not the inverse at " << r;
  }
}

TEST(Dispatch, HandExample) {
  // T=3, k=2, E=4: token 0 -> {2, 0}, token 1 -> {0, 2}, token 2 -> {1, 2}.
  const std::vector<int32_t> idx = {2, 0, 0, 2, 1, 2};
  const auto m = make_map(idx, 3, 2, 4);
  EXPECT_EQ(m.counts, (std::vector<int32_t>{2, 1, 3, 0}));
  EXPECT_EQ(m.offsets, (std::vector<int32_t>{0, 2, 3, 6, 6}));
  EXPECT_EQ(m.sorted_route, (std::vector<int32_t>{1, 2, 4, 0, 3, 5}));
  EXPECT_EQ(m.route_to_row, (std::vector<int32_t>{3, 0, 1, 4, 2, 5}));
  expect_valid_map(idx, 3, 2, 4, m);
}

TEST(Dispatch, RandomRoutesWithEmptyExperts) {
  // Only experts 0, 2 and 5 of 7 receive routes; 1, 3, 4, 6 are empty (including the last).
  const int64_t n = 50, k = 3, ne = 7;
  std::mt19937_64 gen(5);
  const int32_t used[] = {0, 2, 5};
  std::vector<int32_t> idx(n * k);
  for (auto& e : idx) e = used[gen() % 3];
  const auto m = make_map(idx, n, k, ne);
  expect_valid_map(idx, n, k, ne, m);
  EXPECT_EQ(m.counts[1] + m.counts[3] + m.counts[4] + m.counts[6], 0);
  // All routes to one expert, and the empty batch.
  std::vector<int32_t> one(n * k, 6);
  const auto m1 = make_map(one, n, k, ne);
  expect_valid_map(one, n, k, ne, m1);
  for (int64_t r = 0; r < n * k; ++r) EXPECT_EQ(m1.sorted_route[r], r);
  const auto m0 = make_map({}, 0, k, ne);
  EXPECT_EQ(m0.offsets, std::vector<int32_t>(ne + 1, 0));
}

// Integer-valued data: every copy and every small weighted sum is exact in float.
TEST(Dispatch, PermuteUnpermuteMoveDataExactly) {
  const int64_t n = 9, k = 3, ne = 5, d = 6, rows = n * k;
  std::mt19937_64 gen(9);
  std::vector<int32_t> idx(n * k);
  for (int64_t t = 0; t < n; ++t)  // distinct experts per token
    for (int64_t j = 0; j < k; ++j) idx[t * k + j] = static_cast<int32_t>((t + 2 * j) % ne);
  const auto m = make_map(idx, n, k, ne);
  std::vector<float> x(n * d), xs(rows * d, -1.f);
  for (auto& v : x) v = static_cast<float>(static_cast<int>(gen() % 201) - 100);
  cpu::permute_forward(x.data(), m.sorted_route.data(), rows, k, d, xs.data());
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = m.sorted_route[row] / k;
    EXPECT_EQ(std::memcmp(xs.data() + row * d, x.data() + t * d, d * sizeof(float)), 0) << "row " << row;
  }
  // Round trip with unit weights: out = k * x exactly.
  std::vector<float> ones(n * k, 1.f), out(n * d, 123.f);
  cpu::unpermute_forward(xs.data(), m.route_to_row.data(), ones.data(), n, k, d, out.data());
  for (int64_t i = 0; i < n * d; ++i) EXPECT_EQ(out[i], k * x[i]);
  // Integer weights against a direct reference; one dropped route contributes nothing.
  std::vector<float> w(n * k), y(rows * d);
  for (auto& v : w) v = static_cast<float>(static_cast<int>(gen() % 7) - 3);
  for (auto& v : y) v = static_cast<float>(static_cast<int>(gen() % 101) - 50);
  auto r2r = m.route_to_row;
  r2r[4 * k + 1] = -1;  // token 4, slot 1 dropped
  cpu::unpermute_forward(y.data(), r2r.data(), w.data(), n, k, d, out.data());
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < d; ++i) {
      float ref = 0.f;
      for (int64_t j = 0; j < k; ++j)
        if (!(t == 4 && j == 1)) ref += w[t * k + j] * y[m.route_to_row[t * k + j] * d + i];
      EXPECT_EQ(out[t * d + i], ref) << "token " << t << " col " << i;
    }
  }
  // The combine added into a residual: acc + out, the dropped route still contributing nothing.
  std::vector<float> acc(n * d);
  for (auto& v : acc) v = static_cast<float>(static_cast<int>(gen() % 41) - 20);
  auto acc_sum = acc;
  cpu::unpermute_forward_add(y.data(), r2r.data(), w.data(), n, k, d, acc_sum.data());
  for (int64_t i = 0; i < n * d; ++i) EXPECT_EQ(acc_sum[i], acc[i] + out[i]) << "element " << i;
  // Backward of permute is a combine with unit weights: dx = sum over the token's rows.
  std::vector<float> dx(n * d, 0.f), comb(n * d);
  cpu::permute_backward(y.data(), m.sorted_route.data(), rows, k, d, dx.data());
  cpu::unpermute_forward(y.data(), m.route_to_row.data(), ones.data(), n, k, d, comb.data());
  EXPECT_EQ(dx, comb);
  // Backward of unpermute scatters w * dout into each route's row; the dropped row gets zeros.
  std::vector<float> dy(rows * d, 99.f), dw(n * k, 99.f);
  cpu::unpermute_backward(x.data(), y.data(), r2r.data(), w.data(), n, k, d, rows, dy.data(), dw.data());
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t row = m.route_to_row[t * k + j];
      const bool dropped = (t == 4 && j == 1);
      float ref_dw = 0.f;
      for (int64_t i = 0; i < d; ++i) {
        EXPECT_EQ(dy[row * d + i], dropped ? 0.f : w[t * k + j] * x[t * d + i]);
        if (!dropped) ref_dw += x[t * d + i] * y[row * d + i];
      }
      EXPECT_EQ(dw[t * k + j], ref_dw);
    }
  }
  // Padding rows (route -1) are zero after permute and skipped by its backward.
  auto sr = m.sorted_route;
  sr[3] = -1;
  std::vector<float> xs2(rows * d, 5.f), dx2(n * d, 0.f);
  cpu::permute_forward(x.data(), sr.data(), rows, k, d, xs2.data());
  for (int64_t i = 0; i < d; ++i) EXPECT_EQ(xs2[3 * d + i], 0.f);
  cpu::permute_backward(y.data(), sr.data(), rows, k, d, dx2.data());
  const int64_t t3 = m.sorted_route[3] / k;
  for (int64_t i = 0; i < d; ++i) EXPECT_EQ(dx2[t3 * d + i], comb[t3 * d + i] - y[3 * d + i]);
}

TEST(Dispatch, GradCheck) {
  const int64_t n = 6, k = 2, ne = 4, d = 5, rows = n * k;
  const std::vector<int32_t> idx = {3, 1, 1, 3, 3, 0, 0, 3, 1, 3, 3, 1};  // expert 2 empty
  const auto m = make_map(idx, n, k, ne);
  // permute: L = sum(x_sorted * R).
  {
    auto x = random_vector(n * d, 1);
    const auto r = random_vector(rows * d, 2);
    auto loss = [&] {
      std::vector<double> xs(rows * d);
      cpu::permute_forward(x.data(), m.sorted_route.data(), rows, k, d, xs.data());
      return dot(xs, r);
    };
    std::vector<double> dx(n * d, 0.0);
    cpu::permute_backward(r.data(), m.sorted_route.data(), rows, k, d, dx.data());
    expect_grad_close("permute.dx", x, dx, loss);
  }
  // unpermute: L = sum(out * R), in y_sorted and topk_w, with one dropped route.
  {
    auto y = random_vector(rows * d, 3), w = random_vector(n * k, 4);
    const auto r = random_vector(n * d, 5);
    auto r2r = m.route_to_row;
    r2r[7] = -1;
    auto loss = [&] {
      std::vector<double> out(n * d);
      cpu::unpermute_forward(y.data(), r2r.data(), w.data(), n, k, d, out.data());
      return dot(out, r);
    };
    std::vector<double> dy(rows * d), dw(n * k);
    cpu::unpermute_backward(r.data(), y.data(), r2r.data(), w.data(), n, k, d, rows, dy.data(), dw.data());
    expect_grad_close("unpermute.dy_sorted", y, dy, loss);
    expect_grad_close("unpermute.dtopk_w", w, dw, loss);
  }
}

TEST(Dispatch, BadIndexNamesTokenAndSlot) {
  for (int32_t bad : {7, -1}) {
    std::vector<int32_t> idx = {0, 1, 2, 3, 1, 2};
    idx[3] = bad;  // token 1, slot 1 with k = 2
    const std::string msg = error_of([&] { make_map(idx, 3, 2, 4); });
    EXPECT_NE(msg.find("got " + std::to_string(bad)), std::string::npos) << msg;
    EXPECT_NE(msg.find("token 1 slot 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[0, 4)"), std::string::npos) << msg;
  }
  const std::string k_big = error_of([&] { make_map({0, 1, 2, 3, 0}, 1, 5, 4); });
  EXPECT_NE(k_big.find("top_k=5"), std::string::npos) << k_big;
  // A row index past the buffer in unpermute_backward.
  std::vector<double> g(2, 1.0), y(2, 1.0), w(1, 1.0), dy(2), dw(1);
  const std::vector<int32_t> r2r = {1};
  const std::string row = error_of([&] {
    cpu::unpermute_backward(g.data(), y.data(), r2r.data(), w.data(), 1, 1, 2, 1, dy.data(), dw.data());
  });
  EXPECT_NE(row.find("rows=1"), std::string::npos) << row;
  EXPECT_NE(row.find("got 1"), std::string::npos) << row;
}

}  // namespace
}  // namespace moe::testing
