// Collectives of world_comm() on however many ranks the suite was started with (1: the self
// communicator), against values every rank can compute: integer-valued floats so that sums are
// exact in any order, uneven all-to-all-v blocks with zero counts, and split groups.
#include <gtest/gtest.h>

#include <climits>
#include <cstdlib>
#include <map>
#include <numeric>
#include <vector>

#include "parallel/comm.h"
#include "parallel/mpi_test_util.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

TEST(Comm, AllReduceSumAndMax) {
  Comm& w = world_comm();
  const int r = w.rank(), n = w.size();
  std::vector<float> f(5);
  std::vector<double> d(5);
  std::vector<int64_t> i(5);
  for (int k = 0; k < 5; ++k) {
    f[k] = float(100 * r + k);
    d[k] = 0.5 * (100 * r + k);
    i[k] = (int64_t(1) << 40) * r + k;
  }
  w.all_reduce(f.data(), 5, ReduceOp::kSum);
  w.all_reduce(d.data(), 5, ReduceOp::kSum);
  w.all_reduce(i.data(), 5, ReduceOp::kSum);
  const int64_t rank_sum = int64_t(n) * (n - 1) / 2;
  for (int k = 0; k < 5; ++k) {
    EXPECT_EQ(f[k], float(100 * rank_sum + n * k)) << k;
    EXPECT_EQ(d[k], 0.5 * double(100 * rank_sum + n * k)) << k;
    EXPECT_EQ(i[k], (int64_t(1) << 40) * rank_sum + n * k) << k;
  }
  std::vector<float> m = {float(r), float(-r)};
  w.all_reduce(m.data(), 2, ReduceOp::kMax);
  EXPECT_EQ(m[0], float(n - 1));
  EXPECT_EQ(m[1], 0.f);
  w.all_reduce(m.data(), 0, ReduceOp::kSum);  // zero elements: nothing happens
  EXPECT_EQ(m[0], float(n - 1));
}

TEST(Comm, ReduceScatterAndAllGather) {
  Comm& w = world_comm();
  const int r = w.rank(), n = w.size();
  const int64_t count = 3;
  std::vector<float> send(size_t(n * count)), recv(size_t(count), -1.f);
  for (int p = 0; p < n; ++p)
    for (int k = 0; k < count; ++k) send[size_t(p * count + k)] = float(r + 10 * p + 1000 * k);
  w.reduce_scatter(send.data(), recv.data(), count);
  const int rank_sum = n * (n - 1) / 2;
  for (int k = 0; k < count; ++k) EXPECT_EQ(recv[size_t(k)], float(rank_sum + n * (10 * r + 1000 * k))) << k;

  std::vector<float> mine = {float(r), float(2 * r + 1)};
  std::vector<float> all(size_t(2 * n), -1.f);
  w.all_gather(mine.data(), all.data(), 2);
  std::vector<int64_t> mine64 = {int64_t(r) << 33}, all64(size_t(n), -1);
  w.all_gather(mine64.data(), all64.data(), 1);
  for (int p = 0; p < n; ++p) {
    EXPECT_EQ(all[size_t(2 * p)], float(p));
    EXPECT_EQ(all[size_t(2 * p + 1)], float(2 * p + 1));
    EXPECT_EQ(all64[size_t(p)], int64_t(p) << 33);
  }
}

// Rank s sends (s + 2 d) % 3 elements to rank d (some blocks empty), valued 1000 s + 10 d + j.
int64_t block(int s, int d) { return (s + 2 * d) % 3; }

TEST(Comm, AllToAllVUnevenWithZeroCounts) {
  Comm& w = world_comm();
  const int r = w.rank(), n = w.size();
  std::vector<int64_t> sc(static_cast<size_t>(n)), rc(static_cast<size_t>(n));
  std::vector<float> send;
  for (int d = 0; d < n; ++d) {
    sc[size_t(d)] = block(r, d);
    rc[size_t(d)] = block(d, r);
    for (int64_t j = 0; j < sc[size_t(d)]; ++j) send.push_back(float(1000 * r + 10 * d + j));
  }
  const int64_t total = std::accumulate(rc.begin(), rc.end(), int64_t(0));
  std::vector<float> recv(size_t(total) + 1, -7.f);  // one guard element past the end
  send.push_back(0.f);                               // never empty, even when r sends nothing
  w.all_to_all_v(send.data(), sc.data(), recv.data(), rc.data());
  int64_t at = 0;
  for (int s = 0; s < n; ++s)
    for (int64_t j = 0; j < rc[size_t(s)]; ++j) EXPECT_EQ(recv[size_t(at++)], float(1000 * s + 10 * r + j));
  EXPECT_EQ(recv[size_t(total)], -7.f) << "wrote past the received blocks";

  std::vector<int64_t> s2(size_t(2 * n)), r2(size_t(2 * n), -1);
  for (int d = 0; d < n; ++d) {
    s2[size_t(2 * d)] = 100 * r + d;
    s2[size_t(2 * d + 1)] = -(100 * r + d);
  }
  w.all_to_all(s2.data(), r2.data(), 2);
  for (int s = 0; s < n; ++s) {
    EXPECT_EQ(r2[size_t(2 * s)], 100 * s + r);
    EXPECT_EQ(r2[size_t(2 * s + 1)], -(100 * s + r));
  }
}

TEST(Comm, BroadcastFromLastRank) {
  Comm& w = world_comm();
  const int root = w.size() - 1;
  std::vector<float> f = {float(w.rank()), 2.5f};
  std::vector<int64_t> i = {int64_t(w.rank()) * 7, 9};
  w.broadcast(f.data(), 2, root);
  w.broadcast(i.data(), 2, root);
  EXPECT_EQ(f[0], float(root));
  EXPECT_EQ(i[0], int64_t(root) * 7);
  w.barrier();
}

TEST(Comm, SplitGroupsOrderedByKey) {
  Comm& w = world_comm();
  const int r = w.rank(), n = w.size();
  // Even and odd ranks, each group ordered by descending world rank.
  std::unique_ptr<Comm> g = w.split(r % 2, -r);
  std::vector<int> members;
  for (int p = n - 1; p >= 0; --p)
    if (p % 2 == r % 2) members.push_back(p);
  ASSERT_EQ(g->size(), int(members.size()));
  EXPECT_EQ(members[size_t(g->rank())], r);
  EXPECT_EQ(g->timeout_s(), w.timeout_s());
  std::vector<int64_t> seen(size_t(g->size()));
  int64_t me = r;
  g->all_gather(&me, seen.data(), 1);
  for (size_t k = 0; k < members.size(); ++k) EXPECT_EQ(seen[k], members[k]);
  int64_t sum = r;
  g->all_reduce(&sum, 1, ReduceOp::kSum);
  EXPECT_EQ(sum, std::accumulate(members.begin(), members.end(), int64_t(0)));
}

TEST(Comm, CountsAboveIntMaxAreRefused) {
  Comm& w = world_comm();
  if (w.backend() != "mpi") GTEST_SKIP() << "one-rank communicator: no MPI count limit";
  const int64_t too_many = int64_t(INT_MAX) + 1;
  // Checked before any buffer is touched, so null buffers are safe here.
  EXPECT_CONTAINS(error_of([&] { w.reduce_scatter(nullptr, nullptr, too_many); }), "exceed INT_MAX");
  EXPECT_CONTAINS(error_of([&] { w.all_gather(static_cast<const float*>(nullptr), nullptr, too_many); }),
                  "exceed INT_MAX");
  w.barrier();
}

TEST(Comm, WorldFollowsTheLauncher) {
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  const char* tcp_size = std::getenv("WORLD_SIZE");
  if (size) {
    EXPECT_EQ(world_comm().backend(), "mpi");
    EXPECT_EQ(world_comm().size(), std::atoi(size));
  } else if (tcp_size && std::atoi(tcp_size) > 1) {
    EXPECT_EQ(world_comm().backend(), "tcp");
    EXPECT_EQ(world_comm().size(), std::atoi(tcp_size));
  } else {
    EXPECT_EQ(world_comm().backend(), "self");
    EXPECT_EQ(world_comm().size(), 1);
  }
  EXPECT_EQ(make_self_comm()->size(), 1);
}

TEST(Comm, DetectLauncher) {
  auto env = [](std::map<std::string, std::string> vars) {
    return detect_launcher([vars](const char* n) -> const char* {
      auto it = vars.find(n);
      return it == vars.end() ? nullptr : it->second.c_str();
    });
  };
  EXPECT_EQ(env({}), "none");
  EXPECT_EQ(env({{"OMPI_COMM_WORLD_SIZE", "2"}}), "mpi");
  EXPECT_EQ(env({{"PMI_RANK", "0"}, {"PMI_SIZE", "4"}}), "mpi");
  EXPECT_EQ(env({{"PMIX_RANK", "1"}}), "mpi");
  EXPECT_EQ(env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}}), "mpi");
  EXPECT_EQ(env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}), "none");  // a batch script's own step
  EXPECT_EQ(env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}), "torchrun");
  EXPECT_EQ(env({{"RANK", "0"}, {"WORLD_SIZE", "1"}}), "none");
  EXPECT_EQ(env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_SIZE", "2"}}), "mpi");
}

}  // namespace
}  // namespace moe::testing
