// The experts interface of the MoE layer: LocalExperts against EpExperts. On a one-rank EP group
// the exchange is the identity, so forward, saved rows and backward agree bitwise. On 2 and 4
// thread ranks each rank's rows go through the exchange and are compared with LocalExperts (every
// expert) on the same rows; weight gradients are summed over the ranks. Routing extremes: empty
// experts, every row on one expert, a rank with no rows.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "model/ep_experts.h"
#include "model/experts.h"
#include "parallel/comm.h"
#include "parallel/ep_thread_comm.h"
#include "support/gradcheck.h"
#include "support/parity.h"

namespace moe::testing {
namespace {

constexpr int64_t kE = 4, kD = 6, kI = 5;

// Rows per expert of rank r under one routing pattern.
std::vector<int32_t> counts_of(const std::string& pattern, int rank) {
  if (pattern == "spread") return {3 + rank, 0, 2, 5 - rank};  // expert 1 empty
  if (pattern == "one_expert") return {0, 0, 7 + rank, 0};     // every row on expert 2
  if (pattern == "rank0_empty") {
    if (rank == 0) return {0, 0, 0, 0};
    return {rank, 2, 0, 1};
  }
  return {};
}

std::vector<int32_t> offsets_of(const std::vector<int32_t>& counts) {
  std::vector<int32_t> off(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) off[e + 1] = off[e] + counts[e];
  return off;
}

std::vector<float> floats(int64_t n, uint64_t seed, double scale) {
  const std::vector<double> v = random_vector(n, seed, scale);
  return std::vector<float>(v.begin(), v.end());
}

// One rank's problem: its rows, the full weights (identical on every rank), its output gradient.
struct Problem {
  std::vector<int32_t> offsets;
  std::vector<float> x, dy, w_gate_up, w_down;
};

Problem problem(const std::string& pattern, int rank) {
  Problem p;
  p.offsets = offsets_of(counts_of(pattern, rank));
  const int64_t rows = p.offsets.back();
  p.x = floats(rows * kD, 100 + rank, 1.0);
  p.dy = floats(rows * kD, 200 + rank, 1.0);
  p.w_gate_up = floats(kE * 2 * kI * kD, 7, 0.5);
  p.w_down = floats(kE * kD * kI, 8, 0.5);
  return p;
}

struct Result {
  std::vector<float> y, dx, dw_gate_up, dw_down;  // dw: the experts this rank holds
  ExpertsSaved<float> saved;
};

Result run(const Experts<float>& experts, const Problem& p, int64_t first, int64_t count) {
  const int64_t rows = p.offsets.back(), gu = 2 * kI * kD, dn = kD * kI;
  const std::vector<float> wgu(p.w_gate_up.begin() + first * gu, p.w_gate_up.begin() + (first + count) * gu);
  const std::vector<float> wdn(p.w_down.begin() + first * dn, p.w_down.begin() + (first + count) * dn);
  Result r;
  r.y.assign(rows * kD, -1.f);
  r.dx.assign(rows * kD, -1.f);
  r.dw_gate_up.assign(wgu.size(), 0.f);
  r.dw_down.assign(wdn.size(), 0.f);
  experts.forward(p.x.data(), p.offsets.data(), wgu.data(), wdn.data(), r.saved, r.y.data(), nullptr);
  experts.backward(r.saved, wgu.data(), wdn.data(), p.dy.data(), r.dx.data(), r.dw_gate_up.data(), r.dw_down.data(),
                   nullptr);
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

TEST(ExpertsInterface, LocalAndExpertParallelAgreeBitwiseOnOneRank) {
  std::unique_ptr<Comm> self = make_self_comm();
  const ExpertParallel ep = make_expert_parallel(*self, kE);
  const LocalExperts<float> local(kE, kD, kI);
  const EpExperts remote(ep, kD, kI);
  for (const std::string pattern : {"spread", "one_expert", "rank0_empty"}) {
    SCOPED_TRACE(pattern);
    const Problem p = problem(pattern, 0);
    const Result a = run(local, p, 0, kE), b = run(remote, p, 0, kE);
    EXPECT_TRUE(same_bits(a.y, b.y)) << "y";
    EXPECT_TRUE(same_bits(a.dx, b.dx)) << "dx";
    EXPECT_TRUE(same_bits(a.dw_gate_up, b.dw_gate_up)) << "dw_gate_up";
    EXPECT_TRUE(same_bits(a.dw_down, b.dw_down)) << "dw_down";
    EXPECT_EQ(a.saved.offsets_L1, p.offsets);
    EXPECT_EQ(b.saved.offsets_L1, p.offsets);
    EXPECT_TRUE(same_bits(a.saved.x_GD, p.x)) << "local experts save their input rows";
    EXPECT_TRUE(same_bits(a.saved.x_GD, b.saved.x_GD)) << "x_GD";
    EXPECT_TRUE(same_bits(a.saved.gate_up_G2I, b.saved.gate_up_G2I)) << "gate_up_G2I";
    EXPECT_TRUE(same_bits(a.saved.h_GI, b.saved.h_GI)) << "h_GI";
    EXPECT_EQ(b.saved.handle.num_rows, p.offsets.back());
    EXPECT_EQ(b.saved.handle.num_recv_rows, p.offsets.back());
    // Not a no-op: the outputs were written and the weight gradients are not zero.
    if (p.offsets.back() > 0) {
      EXPECT_NE(a.y[0], -1.f);
      EXPECT_NE(a.dw_down, std::vector<float>(a.dw_down.size(), 0.f));
    }
  }
}

void check_thread_ranks(int ranks, const std::string& pattern) {
  run_thread_ranks(ranks, [&](Comm& comm) {
    const ExpertParallel ep = make_expert_parallel(comm, kE);
    const int me = comm.rank();
    const std::string tag = pattern + " on " + std::to_string(ranks) + " ranks, rank " + std::to_string(me) + ": ";
    const LocalExperts<float> local(kE, kD, kI);
    const EpExperts remote(ep, kD, kI);
    const int64_t first = ep.first_expert(), count = ep.local_experts();
    const Result got = run(remote, problem(pattern, me), first, count);
    // Reference: every rank's rows through every expert here; the weight gradients of this rank's
    // experts summed over the ranks' rows.
    Result ref;
    std::vector<float> dwgu(count * 2 * kI * kD, 0.f), dwdn(count * kD * kI, 0.f);
    for (int r = 0; r < ranks; ++r) {
      Result rr = run(local, problem(pattern, r), 0, kE);
      for (size_t i = 0; i < dwgu.size(); ++i) dwgu[i] += rr.dw_gate_up[first * 2 * kI * kD + i];
      for (size_t i = 0; i < dwdn.size(); ++i) dwdn[i] += rr.dw_down[first * kD * kI + i];
      if (r == me) ref = std::move(rr);
    }
    expect_parity(tag + "y", got.y, ref.y, kFP32Reduction);
    expect_parity(tag + "dx", got.dx, ref.dx, kFP32Reduction);
    expect_parity(tag + "dw_gate_up", got.dw_gate_up, dwgu, kFP32Reduction);
    expect_parity(tag + "dw_down", got.dw_down, dwdn, kFP32Reduction);
    // What this rank's experts received: every rank's rows for them, grouped by local expert.
    int64_t recv = 0;
    for (int r = 0; r < ranks; ++r) {
      const std::vector<int32_t> c = counts_of(pattern, r);
      for (int64_t j = 0; j < count; ++j) recv += c[first + j];
    }
    EXPECT_EQ(got.saved.handle.num_recv_rows, recv) << tag;
    EXPECT_EQ(got.saved.offsets_L1, got.saved.handle.local_offsets) << tag;
    EXPECT_EQ(static_cast<int64_t>(got.saved.x_GD.size()), recv * kD) << tag;
  });
}

TEST(ExpertsInterface, ExpertParallelMatchesLocalOnThreadRanks) {
  for (int ranks : {2, 4})
    for (const std::string pattern : {"spread", "one_expert", "rank0_empty"}) check_thread_ranks(ranks, pattern);
}

}  // namespace
}  // namespace moe::testing
