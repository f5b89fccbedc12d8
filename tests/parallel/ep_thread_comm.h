// Tests only: a Comm whose ranks are threads of one process, so that multi-rank code runs in a
// plain test binary. Every collective posts this rank's buffer pointer and counts, meets the
// others at a generation barrier, reads what it needs straight from their buffers (reductions
// in rank order, so results are deterministic) and meets them again before returning.
// run_thread_ranks(n, fn) runs fn(comm) on n threads; a rank that throws releases the others.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.h"
#include "parallel/comm.h"

namespace moe::testing {

class ThreadGroup {
 public:
  explicit ThreadGroup(int n) : n_(n), posted_(n, nullptr), meta_(n) {}
  int size() const { return n_; }

  // Generation barrier; throws when the group is poisoned or the wait exceeds timeout_s.
  void sync(double timeout_s, const char* what, int rank) {
    std::unique_lock<std::mutex> lk(mu_);
    MOE_CHECK(!poisoned_, "thread comm: ", what, " on rank ", rank, ": another rank failed");
    const int64_t gen = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    const bool done = cv_.wait_for(lk, std::chrono::duration<double>(timeout_s),
                                   [&] { return generation_ != gen || poisoned_; });
    MOE_CHECK(done, "thread comm: ", what, " timed out after ", timeout_s, " s on rank ", rank);
    MOE_CHECK(generation_ != gen, "thread comm: ", what, " on rank ", rank, ": another rank failed");
  }
  void poison() {
    std::vector<std::shared_ptr<ThreadGroup>> kids;
    {
      std::lock_guard<std::mutex> lk(mu_);
      poisoned_ = true;
      for (auto& [k, g] : children_) kids.push_back(g);
      cv_.notify_all();
    }
    for (auto& g : kids) g->poison();
  }
  int64_t generation() {
    std::lock_guard<std::mutex> lk(mu_);
    return generation_;
  }
  std::shared_ptr<ThreadGroup> child(int64_t id, int color, int size) {
    std::lock_guard<std::mutex> lk(mu_);
    auto& g = children_[{id, color}];
    if (!g) g = std::make_shared<ThreadGroup>(size);
    return g;
  }

  std::vector<const void*>& posted() { return posted_; }
  std::vector<std::vector<int64_t>>& meta() { return meta_; }

 private:
  const int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int64_t generation_ = 0;
  bool poisoned_ = false;
  std::vector<const void*> posted_;
  std::vector<std::vector<int64_t>> meta_;
  std::map<std::pair<int64_t, int>, std::shared_ptr<ThreadGroup>> children_;
};

class ThreadComm : public Comm {
 public:
  ThreadComm(std::shared_ptr<ThreadGroup> group, int rank) : g_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->size(); }
  std::string backend() const override { return "threads"; }
  ThreadGroup& group() { return *g_; }

  void all_reduce(float* data, int64_t n, ReduceOp op) override { reduce_impl(data, n, op); }
  void all_reduce(double* data, int64_t n, ReduceOp op) override { reduce_impl(data, n, op); }
  void all_reduce(int64_t* data, int64_t n, ReduceOp op) override { reduce_impl(data, n, op); }

  void reduce_scatter(const float* send, float* recv, int64_t count) override {
    post(send, {count}, "reduce_scatter");
    for (int64_t i = 0; i < count; ++i) {
      float acc = 0;
      for (int p = 0; p < size(); ++p) acc += peer<float>(p)[rank_ * count + i];
      recv[i] = acc;
    }
    done("reduce_scatter");
  }
  void all_gather(const float* send, float* recv, int64_t count) override { gather_impl(send, recv, count); }
  void all_gather(const int64_t* send, int64_t* recv, int64_t count) override { gather_impl(send, recv, count); }

  void all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                    const int64_t* recv_counts) override {
    post(send, std::vector<int64_t>(send_counts, send_counts + size()), "all_to_all_v");
    int64_t at = 0;
    for (int p = 0; p < size(); ++p) {
      const std::vector<int64_t>& their = g_->meta()[p];
      MOE_CHECK(their[rank_] == recv_counts[p], "thread comm all_to_all_v: rank ", p, " sends ", their[rank_],
                " elements to rank ", rank_, ", which expects ", recv_counts[p]);
      int64_t start = 0;
      for (int q = 0; q < rank_; ++q) start += their[q];
      if (recv_counts[p] > 0) std::memcpy(recv + at, peer<float>(p) + start, recv_counts[p] * sizeof(float));
      at += recv_counts[p];
    }
    done("all_to_all_v");
  }
  void all_to_all(const int64_t* send, int64_t* recv, int64_t count) override {
    post(send, {count}, "all_to_all");
    for (int p = 0; p < size(); ++p)
      std::memcpy(recv + p * count, peer<int64_t>(p) + rank_ * count, count * sizeof(int64_t));
    done("all_to_all");
  }
  void broadcast(float* data, int64_t n, int root) override { bcast_impl(data, n, root); }
  void broadcast(int64_t* data, int64_t n, int root) override { bcast_impl(data, n, root); }
  void barrier() override {
    g_->sync(timeout_s(), "barrier", rank_);
  }
  std::unique_ptr<Comm> split(int color, int key) override {
    post(nullptr, {color, key}, "split");
    std::vector<std::pair<int64_t, int>> members;  // (key, old rank) of my color
    for (int p = 0; p < size(); ++p)
      if (g_->meta()[p][0] == color) members.push_back({g_->meta()[p][1], p});
    std::sort(members.begin(), members.end());
    int new_rank = 0;
    while (members[new_rank].second != rank_) ++new_rank;
    // Every rank reads the same generation between the two barriers: the split's identity.
    auto child = g_->child(g_->generation(), color, static_cast<int>(members.size()));
    done("split");
    auto c = std::make_unique<ThreadComm>(child, new_rank);
    c->set_timeout_s(timeout_s());
    return c;
  }
  [[noreturn]] void abort(int code) override { std::abort(); }

 private:
  void post(const void* data, std::vector<int64_t> meta, const char* what) {
    g_->posted()[rank_] = data;
    g_->meta()[rank_] = std::move(meta);
    g_->sync(timeout_s(), what, rank_);
  }
  void done(const char* what) { g_->sync(timeout_s(), what, rank_); }
  template <typename T>
  const T* peer(int p) {
    return static_cast<const T*>(g_->posted()[p]);
  }
  template <typename T>
  void reduce_impl(T* data, int64_t n, ReduceOp op) {
    std::vector<T> mine(data, data + n);
    post(mine.data(), {n}, "all_reduce");
    for (int64_t i = 0; i < n; ++i) {
      T acc = peer<T>(0)[i];
      for (int p = 1; p < size(); ++p)
        acc = op == ReduceOp::kSum ? acc + peer<T>(p)[i] : std::max(acc, peer<T>(p)[i]);
      data[i] = acc;
    }
    done("all_reduce");
  }
  template <typename T>
  void gather_impl(const T* send, T* recv, int64_t count) {
    post(send, {count}, "all_gather");
    for (int p = 0; p < size(); ++p) std::memcpy(recv + p * count, peer<T>(p), count * sizeof(T));
    done("all_gather");
  }
  template <typename T>
  void bcast_impl(T* data, int64_t n, int root) {
    post(data, {n}, "broadcast");
    if (rank_ != root) std::memcpy(data, peer<T>(root), n * sizeof(T));
    done("broadcast");
  }

  std::shared_ptr<ThreadGroup> g_;
  int rank_;
};

// Runs fn(comm) on n threads, one rank each; after every thread ended, rethrows the first
// exception thrown (a throwing rank poisons the group so that the others stop waiting).
template <typename F>
void run_thread_ranks(int n, F&& fn, double timeout_s = 60) {
  auto group = std::make_shared<ThreadGroup>(n);
  std::mutex mu;
  std::exception_ptr first;  // the first failure in time: the cause, not a released waiter
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      ThreadComm comm(group, r);
      comm.set_timeout_s(timeout_s);
      try {
        fn(static_cast<Comm&>(comm));
      } catch (...) {
        {
          std::lock_guard<std::mutex> lk(mu);
          if (!first) first = std::current_exception();
        }
        group->poison();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace moe::testing
