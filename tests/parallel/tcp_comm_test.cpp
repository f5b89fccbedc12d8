// The TCP communicator (comm_tcp.h). TcpComm.* run on every rank of a torchrun-style job (CTest's
// tcp.* entries start test_parallel that way; elsewhere they skip): sums bitwise equal on every
// rank and equal to x0 + x1 + ... in rank order, buffers large enough for partial socket writes,
// expert-parallel groups (ep and ep-dp) used in turns, nested splits. TcpEnv.*, TcpRendezvous.*,
// TcpFrame.* and TcpP2p.* run in one process: the environment's checks, ranks as threads, the
// send frame's wording, and send/recv between thread ranks (order, sends that do not wait for
// the receiver, tag and size mismatches, a dead peer, a timeout).
#include <gtest/gtest.h>

#include <functional>
#include <chrono>
#include <string>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "parallel/comm.h"
#include "parallel/comm_tcp.h"
#include "parallel/tcp/frame.h"
#include "parallel/mpi_test_util.h"
#include "parallel/tcp_launch.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

bool in_tcp_job() { return world_comm().backend() == "tcp"; }

#define SKIP_OUTSIDE_TCP_JOB() \
  if (!in_tcp_job()) GTEST_SKIP() << "runs on the ranks of a torchrun-style job (CTest entries tcp.*)"

TEST(TcpComm, WorldFollowsTheEnvironment) {
  SKIP_OUTSIDE_TCP_JOB();
  Comm& w = world_comm();
  EXPECT_EQ(w.size(), std::atoi(std::getenv("WORLD_SIZE")));
  EXPECT_EQ(w.rank(), std::atoi(std::getenv("RANK")));
}

// Rank p's inputs, reproducible on every rank.
template <typename T>
std::vector<T> noise(int p, size_t n) {
  std::mt19937 rng(1234u + unsigned(p));
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<T> v(n);
  for (T& x : v) x = T(u(rng) * (1.0 + 1e3 * (p % 3)));  // magnitudes differ: order matters
  return v;
}

template <typename T>
void expect_rank_order_sum(Comm& w, size_t n) {
  const int np = w.size();
  std::vector<T> x = noise<T>(w.rank(), n);
  w.all_reduce(x.data(), int64_t(n), ReduceOp::kSum);
  std::vector<T> want = noise<T>(0, n);
  for (int p = 1; p < np; ++p) {
    const std::vector<T> y = noise<T>(p, n);
    for (size_t i = 0; i < n; ++i) want[i] = want[i] + y[i];
  }
  EXPECT_EQ(std::memcmp(x.data(), want.data(), n * sizeof(T)), 0) << "not ((x0 + x1) + x2) + ... bit for bit";
  // Every rank holds the same bits: compare the first and last words of rank 0's result.
  std::vector<int64_t> bits(2, 0), all(size_t(2 * np));
  std::memcpy(&bits[0], &x[0], sizeof(T));
  std::memcpy(&bits[1], &x[n - 1], sizeof(T));
  w.all_gather(bits.data(), all.data(), 2);
  for (int p = 0; p < np; ++p) {
    EXPECT_EQ(all[size_t(2 * p)], all[0]) << "rank " << p;
    EXPECT_EQ(all[size_t(2 * p + 1)], all[1]) << "rank " << p;
  }
}

TEST(TcpComm, SumsAreBitwiseEqualInRankOrder) {
  SKIP_OUTSIDE_TCP_JOB();
  Comm& w = world_comm();
  for (size_t n : {size_t(1), size_t(3), size_t(1001)}) {  // fewer elements than ranks, uneven chunks
    expect_rank_order_sum<float>(w, n);
    expect_rank_order_sum<double>(w, n);
  }
  // reduce_scatter: block r of every rank, summed in rank order.
  const int np = w.size();
  const size_t count = 37;
  const std::vector<float> send = noise<float>(w.rank(), count * size_t(np));
  std::vector<float> recv(count);
  w.reduce_scatter(send.data(), recv.data(), int64_t(count));
  std::vector<float> want(count, 0.f);
  for (int p = 0; p < np; ++p) {
    const std::vector<float> y = noise<float>(p, count * size_t(np));
    for (size_t i = 0; i < count; ++i)
      want[i] = p == 0 ? y[size_t(w.rank()) * count + i] : want[i] + y[size_t(w.rank()) * count + i];
  }
  EXPECT_EQ(std::memcmp(recv.data(), want.data(), count * sizeof(float)), 0);
  // max of non-integer values: the largest over ranks.
  std::vector<double> m = noise<double>(w.rank(), 9);
  w.all_reduce(m.data(), 9, ReduceOp::kMax);
  for (size_t i = 0; i < 9; ++i) {
    double best = noise<double>(0, 9)[i];
    for (int p = 1; p < np; ++p) best = std::max(best, noise<double>(p, 9)[i]);
    EXPECT_EQ(m[i], best) << i;
  }
}

TEST(TcpComm, LargeBuffersArriveWhole) {
  SKIP_OUTSIDE_TCP_JOB();
  Comm& w = world_comm();
  const int np = w.size(), r = w.rank();
  const int64_t n = (int64_t(1) << 21) + 3;  // 8 MB of floats: many partial socket writes
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[size_t(i)] = float((r + 1) * (i % 1024));
  w.all_reduce(x.data(), n, ReduceOp::kSum);
  const int64_t rank_sum = int64_t(np) * (np + 1) / 2;
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += x[size_t(i)] != float(rank_sum * (i % 1024));
  EXPECT_EQ(wrong, 0);
  std::vector<float> all(static_cast<size_t>(n) * size_t(np));
  std::vector<float> mine(static_cast<size_t>(n), float(r));
  w.all_gather(mine.data(), all.data(), n);
  wrong = 0;
  for (int p = 0; p < np; ++p)
    for (int64_t i = 0; i < n; ++i) wrong += all[size_t(p) * size_t(n) + size_t(i)] != float(p);
  EXPECT_EQ(wrong, 0);
}

// Groups as the trainer makes them with ep = 2: ep groups of consecutive ranks {2g, 2g + 1}, ep-dp
// groups of equal r % 2. Collectives alternate between the groups (and the world) so frames of
// one group arrive while a rank still waits in another.
TEST(TcpComm, ExpertParallelGroupsInTurns) {
  SKIP_OUTSIDE_TCP_JOB();
  Comm& w = world_comm();
  const int np = w.size(), r = w.rank();
  if (np % 2 != 0) GTEST_SKIP() << "needs an even world";
  std::unique_ptr<Comm> ep = w.split(r / 2, r);
  std::unique_ptr<Comm> ep_dp = w.split(r % 2, r);
  ASSERT_EQ(ep->size(), 2);
  ASSERT_EQ(ep->rank(), r % 2);
  ASSERT_EQ(ep_dp->size(), np / 2);
  ASSERT_EQ(ep_dp->rank(), r / 2);
  EXPECT_EQ(ep->backend(), "tcp");
  for (int it = 0; it < 12; ++it) {
    const int64_t n = 1 + (it * 7919) % 5000;
    // ep: sum over {2g, 2g+1}.
    std::vector<float> a(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) a[size_t(i)] = float(r * 1000 + i % 17);
    ep->all_reduce(a.data(), n, ReduceOp::kSum);
    const int g0 = r / 2 * 2;
    EXPECT_EQ(a[size_t(n - 1)], float((g0 + g0 + 1) * 1000 + 2 * ((n - 1) % 17))) << it;
    // ep-dp: max of the world rank over {r % 2, r % 2 + 2, ...}.
    int64_t mx = r;
    ep_dp->all_reduce(&mx, 1, ReduceOp::kMax);
    EXPECT_EQ(mx, np - 2 + r % 2) << it;
    // ep: uneven token exchange, rank q of the pair sends (q + 2 d + it) % 3 rows to d.
    const int q = ep->rank();
    std::vector<int64_t> sc(2), rc(2);
    std::vector<float> send, recv;
    for (int d = 0; d < 2; ++d) {
      sc[size_t(d)] = (q + 2 * d + it) % 3;
      rc[size_t(d)] = (d + 2 * q + it) % 3;
      for (int64_t j = 0; j < sc[size_t(d)]; ++j) send.push_back(float(100 * r + 10 * d + j));
    }
    recv.assign(size_t(rc[0] + rc[1]) + 1, -1.f);
    send.push_back(0.f);
    ep->all_to_all_v(send.data(), sc.data(), recv.data(), rc.data());
    int64_t at = 0;
    for (int s = 0; s < 2; ++s)
      for (int64_t j = 0; j < rc[size_t(s)]; ++j)
        EXPECT_EQ(recv[size_t(at++)], float(100 * (g0 + s) + 10 * q + j)) << it;
    // ep-dp: broadcast from its last rank, then the world.
    std::vector<int64_t> b = {int64_t(r), int64_t(it)};
    ep_dp->broadcast(b.data(), 2, ep_dp->size() - 1);
    EXPECT_EQ(b[0], np - 2 + r % 2) << it;
    if (it % 4 == 0) {
      double s = r;
      w.all_reduce(&s, 1, ReduceOp::kSum);
      EXPECT_EQ(s, double(np) * (np - 1) / 2);
      ep_dp->barrier();
    }
  }
  // A group split again: ep-dp ordered by descending world rank.
  std::unique_ptr<Comm> rev = ep_dp->split(0, -r);
  ASSERT_EQ(rev->size(), np / 2);
  EXPECT_EQ(rev->rank(), np / 2 - 1 - r / 2);
  std::vector<int64_t> seen(size_t(rev->size()));
  int64_t me = r;
  rev->all_gather(&me, seen.data(), 1);
  for (int k = 0; k < rev->size(); ++k) EXPECT_EQ(seen[size_t(k)], np - 2 * (k + 1) + r % 2);
}

// ---------------------------------------------------------------------------------------------
// One process.

std::function<const char*(const char*)> fake_env(const std::map<std::string, std::string>& vars) {
  return [vars](const char* n) -> const char* {
    auto it = vars.find(n);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

TEST(TcpEnv, ReadsTheTorchrunVariables) {
  TcpLaunchEnv e = tcp_launch_env(fake_env({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"MASTER_PORT", "29501"}}));
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 29501);
  e = tcp_launch_env(
      fake_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(e.master_addr, "node7");
}

TEST(TcpEnv, MissingOrBadVariablesAreNamed) {
  EXPECT_CONTAINS(error_of([] { tcp_launch_env(fake_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}})); }),
                  "MASTER_PORT is not set");
  EXPECT_CONTAINS(
      error_of([] { tcp_launch_env(fake_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "http"}})); }),
      "MASTER_PORT must be a port number");
  EXPECT_CONTAINS(
      error_of([] { tcp_launch_env(fake_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}})); }),
      "got '70000'");
  EXPECT_CONTAINS(
      error_of([] { tcp_launch_env(fake_env({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1234"}})); }),
      "RANK must be this process's rank, below WORLD_SIZE");
}

TEST(TcpEnv, TorchrunAgentStoreMovesThePort) {
  // torchrun's agent listens on MASTER_PORT itself: the rendezvous takes the next port.
  TcpLaunchEnv e = tcp_launch_env(fake_env(
      {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}}));
  EXPECT_EQ(e.master_port, 29501);
  e = tcp_launch_env(fake_env(
      {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}, {"TORCHELASTIC_USE_AGENT_STORE", "False"}}));
  EXPECT_EQ(e.master_port, 29500);
  e = tcp_launch_env(fake_env({{"RANK", "1"},
                               {"WORLD_SIZE", "2"},
                               {"MASTER_PORT", "29500"},
                               {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                               {"MOECORE_MASTER_PORT", "31000"}}));
  EXPECT_EQ(e.master_port, 31000);
  EXPECT_CONTAINS(error_of([] {
                    tcp_launch_env(fake_env({{"RANK", "1"},
                                             {"WORLD_SIZE", "2"},
                                             {"MASTER_PORT", "29500"},
                                             {"MOECORE_MASTER_PORT", "-3"}}));
                  }),
                  "MOECORE_MASTER_PORT must be a port number");
}

// Ranks as threads of this process (each its own rendezvous and mesh).
TEST(TcpRendezvous, ThreadRanksReduce) {
  const int port = free_tcp_port();
  constexpr int kRanks = 3;
  std::vector<double> result(kRanks, -1);
  std::vector<std::string> errors(kRanks);
  std::vector<std::thread> ts;
  for (int r = kRanks - 1; r >= 0; --r) {  // rank 0 last: the others retry until it listens
    ts.emplace_back([&, r] {
      try {
        std::unique_ptr<Comm> c = make_tcp_world(r, kRanks, "127.0.0.1", port, 30);
        double x = 0.25 * (r + 1);
        c->all_reduce(&x, 1, ReduceOp::kSum);
        result[size_t(r)] = x;
        c->barrier();
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(errors[size_t(r)], "") << r;
    EXPECT_EQ(result[size_t(r)], 1.5) << r;
  }
}

TEST(TcpRendezvous, DuplicateRankIsRefused) {
  const int port = free_tcp_port();
  std::vector<std::string> errors(3);
  const int ranks[3] = {0, 1, 1};
  std::vector<std::thread> ts;
  for (int k = 0; k < 3; ++k)
    ts.emplace_back([&, k] { errors[size_t(k)] = error_of([&] { make_tcp_world(ranks[k], 3, "127.0.0.1", port, 20); }); });
  for (auto& t : ts) t.join();
  EXPECT_CONTAINS(errors[0], "two processes claim RANK=1");
  // The two claimants hear it from rank 0 (one may have been refused first: both fail).
  EXPECT_CONTAINS(errors[1] + errors[2], "rendezvous failed on rank 0: two processes claim RANK=1");
  EXPECT_NE(errors[1], "");
  EXPECT_NE(errors[2], "");
}

TEST(TcpRendezvous, AbsentRankZeroTimesOut) {
  const int port = free_tcp_port();
  const std::string e = error_of([&] { make_tcp_world(1, 2, "127.0.0.1", port, 0.5); });
  EXPECT_CONTAINS(e, "rank 1 could not reach rank 0 at 127.0.0.1:" + std::to_string(port) +
                         " (MASTER_ADDR, MASTER_PORT) within 0.5 s");
}

TEST(TcpFrame, DescribesSends) {
  tcp::FrameHeader h;
  h.op = uint16_t(tcp::Op::kSend);
  h.dtype = uint8_t(tcp::Dtype::kF32);
  h.root = 4;
  h.count = 3;
  EXPECT_EQ(std::string(tcp::op_name(h.op, h.reduce)), "send");
  EXPECT_EQ(tcp::describe(h), "send with tag 4 of 3 float32");
}

// Runs body(comm) on `n` thread ranks of one TCP world; returns each rank's error ("" if none).
std::vector<std::string> on_thread_ranks(int n, double timeout_s, const std::function<void(Comm&)>& body) {
  const int port = free_tcp_port();
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> ts;
  for (int r = n - 1; r >= 0; --r) {
    ts.emplace_back([&, r] {
      try {
        std::unique_ptr<Comm> c = make_tcp_world(r, n, "127.0.0.1", port, timeout_s);
        body(*c);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  return errors;
}

std::vector<float> message(int from, int to, int k, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = float(from * 1000 + to * 100 + k) + float(i % 97) * 0.5f;
  return v;
}

// Every rank sends everything first (a 16 MB message among them: more than the sockets buffer,
// so a send that waited for its receiver would deadlock), a collective runs while the sends are
// in flight, then every rank receives in order; in a split group too.
void expect_sends_in_order(int n) {
  constexpr size_t kBig = size_t(4) << 20;
  const std::vector<std::string> errors = on_thread_ranks(n, 60, [&](Comm& c) {
    const int me = c.rank();
    const std::vector<size_t> sizes = {3, kBig, 0, 1000};
    for (int k = 0; k < int(sizes.size()); ++k)
      for (int p = 0; p < n; ++p) {
        const std::vector<float> m = message(me, p, k, sizes[size_t(k)]);
        c.send(m.data(), int64_t(m.size()), p, 10 + k);
      }
    double x = 1;
    c.all_reduce(&x, 1, ReduceOp::kSum);
    EXPECT_EQ(x, double(n));
    for (int p = 0; p < n; ++p)
      for (int k = 0; k < int(sizes.size()); ++k) {
        std::vector<float> got(sizes[size_t(k)], -1.0f);
        c.recv(got.data(), int64_t(got.size()), p, 10 + k);
        EXPECT_TRUE(got == message(p, me, k, sizes[size_t(k)])) << "from " << p << " message " << k;
      }
    c.flush_sends();
    // Pairs (0 1), (2 3): group rank 0 sends two messages to group rank 1 and back.
    std::unique_ptr<Comm> pair = c.split(me / 2, me);
    if (pair->size() == 2) {
      const int peer = 1 - pair->rank(), wp = me - pair->rank() + peer;  // group and world rank
      const std::vector<float> a = message(me, wp, 0, 5), b = message(me, wp, 1, 7);
      pair->send(a.data(), 5, peer, 1);
      pair->send(b.data(), 7, peer, 2);
      std::vector<float> ga(5), gb(7);
      pair->recv(ga.data(), 5, peer, 1);
      pair->recv(gb.data(), 7, peer, 2);
      EXPECT_TRUE(ga == message(wp, me, 0, 5));
      EXPECT_TRUE(gb == message(wp, me, 1, 7));
      pair->flush_sends();
    }
    c.barrier();
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[size_t(r)], "") << "rank " << r;
}

TEST(TcpP2p, SendsArriveInOrderWithoutWaitingForTheReceiver2) { expect_sends_in_order(2); }
TEST(TcpP2p, SendsArriveInOrderWithoutWaitingForTheReceiver4) { expect_sends_in_order(4); }

// A wrong tag, then a wrong size: the receiver fails naming both ranks and what it expected,
// drops the message (as MPI does) and the pair goes on; in a split group the world ranks too.
TEST(TcpP2p, TagAndSizeMismatchesNameBothRanks) {
  std::vector<std::string> seen(4);
  const std::vector<std::string> errors = on_thread_ranks(4, 30, [&](Comm& c) {
    std::unique_ptr<Comm> g = c.split(c.rank() % 2, c.rank());  // (0 2), (1 3)
    std::vector<float> a = {1, 2, 3}, b(3);
    if (g->rank() == 0) {
      g->send(a.data(), 3, 1, 4);
      g->send(a.data(), 2, 1, 5);
      g->send(a.data(), 3, 1, 6);
      g->flush_sends();
    } else {
      seen[size_t(c.rank())] = error_of([&] { g->recv(b.data(), 3, 0, 5); });
      seen[size_t(c.rank())] += "\n" + error_of([&] { g->recv(b.data(), 3, 0, 5); });
      g->recv(b.data(), 3, 0, 6);
      EXPECT_EQ(b, a);
    }
    g->barrier();
  });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(errors[size_t(r)], "") << "rank " << r;
  for (int r : {2, 3}) {
    EXPECT_CONTAINS(seen[size_t(r)], "recv on rank 1 of a group of 2 from rank 0: expected tag 5 with 3 elements, got "
                                     "tag 4 with 3 (its send number 0 to this rank (world ranks " +
                                         std::to_string(r) + " and " + std::to_string(r - 2) + "))");
    EXPECT_CONTAINS(seen[size_t(r)], "expected tag 5 with 3 elements, got tag 5 with 2 (its send number 1");
    EXPECT_CONTAINS(seen[size_t(r)], "the two ranks run different pipeline schedules");
  }
}

// A peer that closes its connection without sending: recv fails at once naming it (not at the
// timeout), and so does a later send to it; a recv from a live peer that sends nothing times out.
TEST(TcpP2p, DeadPeerAndTimeoutAreNamed) {
  std::string dead, send_dead, late;
  double dead_s = -1;
  const std::vector<std::string> errors = on_thread_ranks(2, 20, [&](Comm& c) {
    float x[3] = {};
    c.set_timeout_s(0.3);
    if (c.rank() == 0) late = error_of([&] { c.recv(x, 3, 1, 9); });
    c.set_timeout_s(20);
    c.barrier();
    if (c.rank() == 1) return;  // closes its sockets
    const auto t0 = std::chrono::steady_clock::now();
    dead = error_of([&] { c.recv(x, 3, 1, 6); });
    dead_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    send_dead = error_of([&] { c.send(x, 3, 1, 7); });
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_CONTAINS(late, "recv on rank 0 of a group of 2 from rank 1 (tag 9, 3 elements) timed out after 0.3 s: rank 1");
  EXPECT_CONTAINS(dead, "recv on rank 0 of a group of 2 from rank 1 (tag 6, 3 elements) failed: rank 1 closed its "
                        "connection (its process exited or crashed)");
  EXPECT_LT(dead_s, 10) << "the dead peer must be named before the 20 s timeout";
  EXPECT_CONTAINS(send_dead, "send on rank 0 of a group of 2 to rank 1 (tag 7, 3 elements) failed: rank 1 closed");
}

// Sends to this rank itself go straight to its own stash.
TEST(TcpP2p, SendToItself) {
  const std::vector<std::string> errors = on_thread_ranks(2, 20, [&](Comm& c) {
    std::vector<float> a = {float(c.rank()), 7}, b(2);
    c.send(a.data(), 2, c.rank(), 3);
    c.recv(b.data(), 2, c.rank(), 3);
    EXPECT_EQ(a, b);
    c.barrier();
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

}  // namespace
}  // namespace moe::testing
