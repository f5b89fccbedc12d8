// The collectives of the TCP communicator (comm_tcp.h) for one group. Every collective starts with
// a round in which each pair of ranks exchanges a frame, so ranks that called different
// collectives (or sizes) fail on both sides naming both calls. all_reduce is reduce-scatter then
// all-gather: rank p sums chunk p in rank order, so the sum is x0 + x1 + ... + x(n-1) and every
// rank gets the same bits. A round progresses every socket of the mesh; frames of other groups
// or later rounds wait in the peers' stashes. send/recv are one frame each through the mesh's
// outgoing queues (parallel/tcp/mesh.h): a send never waits for its receiver.
#include "parallel/tcp/group_comm.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <sstream>
#include <string>
#include <thread>

#include "core/error.h"
#include "parallel/tcp/frame.h"
#include "parallel/tcp/socket.h"
#include "parallel/tcp/split.h"

namespace moe::tcp {
namespace {

class TcpComm final : public Comm {
 public:
  TcpComm(std::shared_ptr<Mesh> mesh, uint64_t group, std::vector<int> members, double timeout_s)
      : mesh_(std::move(mesh)), group_(group), members_(std::move(members)) {
    timeout_s_ = timeout_s;
    size_ = int(members_.size());
    sends_to_.assign(size_t(size_), 0);
    for (int g = 0; g < size_; ++g)
      if (members_[size_t(g)] == mesh_->rank) rank_ = g;
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "tcp"; }

  void all_reduce(float* data, int64_t n, ReduceOp op) override { all_reduce_t(data, n, op); }
  void all_reduce(double* data, int64_t n, ReduceOp op) override { all_reduce_t(data, n, op); }
  void all_reduce(int64_t* data, int64_t n, ReduceOp op) override { all_reduce_t(data, n, op); }

  void reduce_scatter(const float* send, float* recv, int64_t count) override {
    check_count(count, "reduce_scatter");
    const size_t bytes = size_t(count) * sizeof(float);
    std::vector<Frame> got = exchange_blocks(start(Op::kReduceScatter, Dtype::kF32, 0, -1, count), send, count, true);
    std::vector<float> acc(static_cast<size_t>(count)), v(static_cast<size_t>(count));
    const float* mine = send + int64_t(rank_) * count;
    for (int p = 0; p < size_; ++p) {  // rank order: ((x0 + x1) + x2) + ...
      const float* x = mine;
      if (p != rank_) {
        if (bytes) std::memcpy(v.data(), got[size_t(p)].payload.data(), bytes);
        x = v.data();
      }
      if (p == 0) {
        std::copy(x, x + count, acc.begin());
      } else {
        for (int64_t i = 0; i < count; ++i) acc[size_t(i)] = acc[size_t(i)] + x[i];
      }
    }
    if (bytes) std::memcpy(recv, acc.data(), bytes);
  }

  void all_gather(const float* send, float* recv, int64_t count) override { all_gather_t(send, recv, count); }
  void all_gather(const int64_t* send, int64_t* recv, int64_t count) override { all_gather_t(send, recv, count); }

  void all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                    const int64_t* recv_counts) override {
    std::vector<int64_t> soff(size_t(size_) + 1, 0), roff(size_t(size_) + 1, 0);
    for (int p = 0; p < size_; ++p) {
      MOE_CHECK(send_counts[p] >= 0 && recv_counts[p] >= 0, "all_to_all_v on rank ", rank_, ": counts for rank ", p,
                " must be >= 0, got send ", send_counts[p], ", receive ", recv_counts[p]);
      soff[size_t(p) + 1] = soff[size_t(p)] + send_counts[p];
      roff[size_t(p) + 1] = roff[size_t(p)] + recv_counts[p];
    }
    MOE_CHECK(send_counts[rank_] == recv_counts[rank_], "all_to_all_v on rank ", rank_, " of group size ", size_,
              ": the block to itself has send count ", send_counts[rank_], " but receive count ",
              recv_counts[rank_]);
    Call c = start(Op::kAllToAllV, Dtype::kF32, 0, -1, soff[size_t(size_)]);
    std::vector<Out> outs(static_cast<size_t>(size_));
    std::vector<In> ins(static_cast<size_t>(size_));
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      outs[size_t(p)] = {true, send + soff[size_t(p)], size_t(send_counts[p]) * sizeof(float), send_counts[p]};
      ins[size_t(p)] = {true, recv_counts[p], size_t(recv_counts[p]) * sizeof(float)};
    }
    std::vector<Frame> got = exchange(c, outs, ins);
    if (send_counts[rank_] > 0)
      std::memmove(recv + roff[size_t(rank_)], send + soff[size_t(rank_)], size_t(send_counts[rank_]) * sizeof(float));
    for (int p = 0; p < size_; ++p)
      if (p != rank_ && !got[size_t(p)].payload.empty())
        std::memcpy(recv + roff[size_t(p)], got[size_t(p)].payload.data(), got[size_t(p)].payload.size());
  }

  void all_to_all(const int64_t* send, int64_t* recv, int64_t count) override {
    check_count(count, "all_to_all");
    const size_t bytes = size_t(count) * sizeof(int64_t);
    std::vector<Frame> got = exchange_blocks(start(Op::kAllToAll, Dtype::kI64, 0, -1, count), send, count, true);
    if (bytes) std::memmove(recv + int64_t(rank_) * count, send + int64_t(rank_) * count, bytes);
    for (int p = 0; p < size_; ++p)
      if (p != rank_ && bytes) std::memcpy(recv + int64_t(p) * count, got[size_t(p)].payload.data(), bytes);
  }

  void broadcast(float* data, int64_t n, int root) override { broadcast_t(data, n, root); }
  void broadcast(int64_t* data, int64_t n, int root) override { broadcast_t(data, n, root); }

  void barrier() override {
    Call c = start(Op::kBarrier, Dtype::kNone, 0, -1, 0);
    agree(c);
  }

  // Point-to-point: the frame is copied into the peer's outgoing queue (the mesh writes it as the
  // socket takes it, during this and every later call), so send returns without the receiver.
  // A send to this rank goes straight to its own stash.
  void send(const float* data, int64_t n, int dst, int tag) override {
    check_count(n, "send");
    MOE_CHECK(dst >= 0 && dst < size_, "send on rank ", rank_, ": rank ", dst, " is not in this group of ", size_);
    MOE_CHECK(tag >= 0 && tag <= kMaxTag, "send on rank ", rank_, ": tag ", tag, " must be in [0, ", kMaxTag, "]");
    check_usable("send");
    const int w = members_[size_t(dst)];
    Peer& peer = mesh_->peers[size_t(w)];
    MOE_CHECK(w == mesh_->rank || !peer.closed, "send on rank ", rank_, " of a group of ", size_, " to ", who(dst),
              " (tag ", tag, ", ", n, " elements) failed: ", who(dst), " ", peer.why_closed);
    FrameHeader h;
    h.op = uint16_t(Op::kSend);
    h.dtype = uint8_t(Dtype::kF32);
    h.root = tag;
    h.group_size = size_;
    h.group = group_;
    h.round = sends_to_[size_t(dst)]++;
    h.count = n;
    h.bytes = uint64_t(n) * sizeof(float);
    const char* bytes = reinterpret_cast<const char*>(data);
    std::vector<char> payload(bytes, bytes + h.bytes);
    if (w == mesh_->rank) {
      peer.stash.push_back(Frame{h, std::move(payload)});
      return;
    }
    peer.outq.push_back({h, std::move(payload), 0});
    mesh_->push_all();
  }

  // Waits for the next send of `src` in this group (frames of collectives and other groups stay
  // stashed), progressing every socket meanwhile; checks its tag and count.
  void recv(float* data, int64_t n, int src, int tag) override {
    check_count(n, "recv");
    MOE_CHECK(src >= 0 && src < size_, "recv on rank ", rank_, ": rank ", src, " is not in this group of ", size_);
    check_usable("recv");
    const auto deadline = deadline_after(timeout_s_);
    const int w = members_[size_t(src)];
    Peer& peer = mesh_->peers[size_t(w)];
    const std::string head =
        "recv on rank " + std::to_string(rank_) + " of a group of " + std::to_string(size_) + " from rank " +
        std::to_string(src);
    const std::string call = " (tag " + std::to_string(tag) + ", " + std::to_string(n) + " elements)";
    const std::vector<char> no_writes;
    for (;;) {
      mesh_->push_all();
      for (auto it = peer.stash.begin(); it != peer.stash.end(); ++it) {
        if (it->h.group != group_ || it->h.op != uint16_t(Op::kSend)) continue;
        const FrameHeader h = it->h;
        if (h.root != tag || h.count != n || h.bytes != uint64_t(n) * sizeof(float)) {
          peer.stash.erase(it);  // dropped, as MPI receives and drops it: the streams stay usable
          MOE_FAIL(head, ": expected tag ", tag, " with ", n, " elements, got tag ", h.root, " with ", h.count,
                   " (its send number ", h.round, " to this rank", world_ranks(src),
                   "): the two ranks run different pipeline schedules (or layouts)");
        }
        if (n > 0) std::memcpy(data, it->payload.data(), size_t(h.bytes));
        peer.stash.erase(it);
        return;
      }
      if (peer.closed) {
        linger_after_close();
        MOE_FAIL(head, call, " failed: ", who(src), " ", peer.why_closed);
      }
      if (Clock::now() >= deadline) {
        std::ostringstream t;
        t << timeout_s_;
        MOE_FAIL(head, call, " timed out after ", t.str(), " s: rank ", src,
                 " died, hangs, or runs another schedule", world_ranks(src),
                 "; the limit is parallel.timeout_s (or MOECORE_COMM_TIMEOUT_S)");
      }
      std::string err;
      if (!mesh_->wait(deadline, no_writes, &err)) fail(head + call + ": " + err);
    }
  }

  // Waits until the queued sends to this group's ranks are written to their sockets.
  void flush_sends() override {
    const auto deadline = deadline_after(timeout_s_);
    const std::vector<char> no_writes;
    for (;;) {
      mesh_->push_all();
      int pending = -1;
      for (int p = 0; p < size_ && pending < 0; ++p)
        if (!mesh_->peers[size_t(members_[size_t(p)])].outq.empty()) pending = p;
      if (pending < 0) return;
      const Peer& peer = mesh_->peers[size_t(members_[size_t(pending)])];
      const int tag = peer.outq.front().h.root;
      MOE_CHECK(!peer.closed, "send on rank ", rank_, " of a group of ", size_, " to rank ", pending, " (tag ", tag,
                ") failed: ", who(pending), " ", peer.why_closed);
      if (Clock::now() >= deadline) {
        std::ostringstream t;
        t << timeout_s_;
        MOE_FAIL("send on rank ", rank_, " of a group of ", size_, " to rank ", pending, " (tag ", tag,
                 ") was not received within ", t.str(), " s: rank ", pending,
                 " died, hangs, or runs another schedule", world_ranks(pending));
      }
      std::string err;
      if (!mesh_->wait(deadline, no_writes, &err)) fail("flush_sends on rank " + std::to_string(rank_) + ": " + err);
    }
  }

  std::unique_ptr<Comm> split(int color, int key) override {
    MOE_CHECK(color >= 0, "split: color must be >= 0, got ", color, " on rank ", rank_);
    Call c = start(Op::kSplit, Dtype::kI64, 0, -1, 3);
    const uint64_t round = round_;
    const int64_t mine[3] = {color, key, rank_};
    std::vector<int64_t> all(size_t(size_) * 3);
    gather_words(c, mine, all.data(), 3);
    return std::make_unique<TcpComm>(mesh_, split_group_id(group_, round, color), split_members(all, color, members_),
                                     timeout_s_);
  }

  [[noreturn]] void abort(int code) override {
    std::fflush(stdout);
    std::fflush(stderr);
    mesh_->close_all(1.0);
    std::_Exit(code == 0 ? 1 : code);
  }

 private:
  struct Call {
    FrameHeader h;  // what this rank called (round and bytes filled per frame)
    std::string name;
    Clock::time_point deadline;
  };
  struct Out {
    bool on = false;
    const void* data = nullptr;
    size_t bytes = 0;
    int64_t count = 0;
  };
  struct In {
    bool on = false;
    int64_t count = 0;
    size_t bytes = 0;
  };

  // The call c's exchange of equal blocks of count elements with every peer: peer p gets
  // send[p * count, (p + 1) * count) (per_peer) or send[0, count), and sends this rank a block of
  // count; the frames received, by peer (this rank's own is empty).
  template <typename T>
  std::vector<Frame> exchange_blocks(const Call& c, const T* send, int64_t count, bool per_peer) {
    const size_t bytes = size_t(count) * sizeof(T);
    std::vector<Out> outs(static_cast<size_t>(size_));
    std::vector<In> ins(static_cast<size_t>(size_));
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      outs[size_t(p)] = {true, send + (per_peer ? int64_t(p) * count : 0), bytes, count};
      ins[size_t(p)] = {true, count, bytes};
    }
    return exchange(c, outs, ins);
  }

  static void check_count(int64_t n, const char* what) {
    MOE_CHECK(n >= 0, what, ": element count must be >= 0, got ", n);
  }

  Call start(Op op, Dtype dtype, uint8_t reduce, int root, int64_t count) {
    Call c;
    c.h.op = uint16_t(op);
    c.h.dtype = uint8_t(dtype);
    c.h.reduce = reduce;
    c.h.root = root;
    c.h.group_size = size_;
    c.h.group = group_;
    c.h.count = count;
    c.name = op_name(c.h.op, reduce);
    c.deadline = deadline_after(timeout_s_);
    MOE_CHECK(mesh_->broken.empty(), "collective ", c.name, " on rank ", rank_, " of group size ", size_,
              ": the tcp communicator is unusable after an earlier error (", mesh_->broken, ")");
    return c;
  }

  // "rank 2" in the world, "rank 1 of this group (world rank 3)" in a split group.
  std::string who(int g) const {
    const int w = members_[size_t(g)];
    if (size_ == mesh_->size && w == g) return "rank " + std::to_string(g);
    return "rank " + std::to_string(g) + " of this group (world rank " + std::to_string(w) + ")";
  }

  // " (world ranks 3 and 1)" for this rank and group rank g in a split group, "" in the world.
  std::string world_ranks(int g) const {
    if (size_ == mesh_->size && members_[size_t(g)] == g) return "";
    return " (world ranks " + std::to_string(mesh_->rank) + " and " + std::to_string(members_[size_t(g)]) + ")";
  }

  void check_usable(const char* what) const {
    MOE_CHECK(mesh_->broken.empty(), what, " on rank ", rank_, " of group size ", size_,
              ": the tcp communicator is unusable after an earlier error (", mesh_->broken, ")");
  }

  std::string where(const Call& c) const {
    return "collective " + c.name + " on rank " + std::to_string(rank_) + " of group size " + std::to_string(size_);
  }

  [[noreturn]] void fail(const std::string& msg) {
    mesh_->broken = msg;
    MOE_FAIL(msg);
  }

  // Before failing a call because a peer closed its connection: this rank keeps its own
  // connections open a moment (kCloseGrace), so that the other ranks see the peer that died close
  // before this rank does (its exit closes them) and name that rank, not this one failing after it.
  static void linger_after_close() { std::this_thread::sleep_for(kCloseGrace); }
  static constexpr std::chrono::milliseconds kCloseGrace{250};

  // Frame from group rank p for this round, if it is in p's stash; a frame of this group with
  // another round or another call is a mismatch (the first frame of this group from p must be it).
  bool take(const Call& c, uint64_t round, int p, const In& in, Frame* out) {
    std::deque<Frame>& stash = mesh_->peers[size_t(members_[size_t(p)])].stash;
    for (auto it = stash.begin(); it != stash.end(); ++it) {
      const FrameHeader& h = it->h;
      if (h.group != group_ || h.op == uint16_t(Op::kSend)) continue;  // recv takes those
      FrameHeader want = c.h;
      want.count = in.count;
      const bool same_call = h.op == want.op && h.dtype == want.dtype && h.reduce == want.reduce &&
                             h.root == want.root && h.group_size == want.group_size && h.count == want.count;
      if (!same_call) {
        fail(where(c) + ": " + who(p) + " called " + describe(h) + " while this rank called " + describe(want) +
             "; every rank of a group must call the same collectives in the same order with the same sizes");
      }
      if (h.round != round || h.bytes != in.bytes) {
        fail(where(c) + ": " + who(p) + " sent step " + std::to_string(h.round) + " (" + std::to_string(h.bytes) +
             " bytes) of this group while this rank expected step " + std::to_string(round) + " (" +
             std::to_string(in.bytes) + " bytes); the ranks called different sequences of collectives");
      }
      *out = std::move(*it);
      stash.erase(it);
      return true;
    }
    return false;
  }

  // One round: sends outs[p] to every p with on, receives a frame from every p with ins[p].on.
  // Returns the frames by group rank. Progresses every socket (frames of other groups or later
  // rounds go to the stash) until done, a peer fails, or the collective's deadline passes.
  std::vector<Frame> exchange(const Call& c, const std::vector<Out>& outs, const std::vector<In>& ins) {
    const uint64_t round = round_++;
    Mesh& m = *mesh_;
    struct Sending {
      int p;
      FrameHeader h;
      const char* data;
      size_t sent = 0;
    };
    std::vector<Sending> sending;
    for (int k = 1; k < size_; ++k) {  // start with the next rank: spreads the load
      const int p = (rank_ + k) % size_;
      const Out& o = outs[size_t(p)];
      if (!o.on) continue;
      FrameHeader h = c.h;
      h.round = round;
      h.count = o.count;
      h.bytes = o.bytes;
      sending.push_back({p, h, static_cast<const char*>(o.data)});
    }
    std::vector<Frame> got(static_cast<size_t>(size_));
    std::vector<char> have(size_t(size_), 0);
    std::vector<char> want_write(size_t(m.size), 0);
    for (;;) {
      // Sends: as much as the sockets take now, after the point-to-point frames queued before.
      bool sends_left = false;
      m.push_all();
      for (Sending& s : sending) {
        const int w = members_[size_t(s.p)];
        Peer& peer = m.peers[size_t(w)];
        if (!peer.outq.empty() || !write_frame(peer, s.h, s.data, &s.sent)) sends_left = true;
      }
      // Receives: frames already here (checked against this call as they are taken).
      int missing = 0;
      for (int p = 0; p < size_; ++p) {
        if (!ins[size_t(p)].on || have[size_t(p)]) continue;
        if (take(c, round, p, ins[size_t(p)], &got[size_t(p)])) {
          have[size_t(p)] = 1;
        } else {
          ++missing;
        }
      }
      if (missing == 0 && !sends_left) return got;
      // A peer this round needs has gone. Peers it waits for are named first: one that only
      // still had to receive from this rank may have failed because of them.
      for (int pass = 0; pass < 2; ++pass) {
        for (int p = 0; p < size_; ++p) {
          const Peer& peer = m.peers[size_t(members_[size_t(p)])];
          if (!peer.closed) continue;
          const bool needed = pass == 0 ? ins[size_t(p)].on && !have[size_t(p)]
                                        : std::any_of(sending.begin(), sending.end(), [&](const Sending& s) {
                                            return s.p == p && s.sent < sizeof(FrameHeader) + size_t(s.h.bytes);
                                          });
          if (needed) {
            linger_after_close();
            fail(where(c) + " failed: " + who(p) + " " + peer.why_closed);
          }
        }
      }
      if (Clock::now() >= c.deadline) {
        std::string waiting;
        for (int p = 0; p < size_; ++p) {
          const bool in_wait = ins[size_t(p)].on && !have[size_t(p)];
          const bool out_wait = std::any_of(sending.begin(), sending.end(), [&](const Sending& s) {
            return s.p == p && s.sent < sizeof(FrameHeader) + size_t(s.h.bytes);
          });
          if (in_wait || out_wait) waiting += (waiting.empty() ? "" : ", ") + who(p);
        }
        std::ostringstream t;
        t << timeout_s_;
        fail(where(c) + " did not complete within " + t.str() + " s (" + std::to_string(c.h.count) +
             " elements; waiting for " + waiting +
             "): another rank died, hangs, or called a different collective; the limit is parallel.timeout_s "
             "(or MOECORE_COMM_TIMEOUT_S)");
      }
      // Wait for any socket: every open peer is read (other groups' frames are stashed), and
      // written where a send is pending.
      std::fill(want_write.begin(), want_write.end(), 0);
      for (const Sending& s : sending)
        if (s.sent < sizeof(FrameHeader) + size_t(s.h.bytes)) want_write[size_t(members_[size_t(s.p)])] = 1;
      std::string err;
      if (!m.wait(c.deadline, want_write, &err)) fail(where(c) + ": " + err);
    }
  }

  // A round of empty frames between every pair: every rank sees that every other one made the
  // same call (barrier, and the first round of broadcast).
  void agree(const Call& c) {
    if (size_ == 1) return;
    std::vector<Out> outs(static_cast<size_t>(size_));
    std::vector<In> ins(static_cast<size_t>(size_));
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      outs[size_t(p)] = {true, nullptr, 0, c.h.count};
      ins[size_t(p)] = {true, c.h.count, 0};
    }
    exchange(c, outs, ins);
  }

  template <typename T>
  void gather_words(const Call& c, const T* send, T* recv, int64_t count) {
    const size_t bytes = size_t(count) * sizeof(T);
    if (bytes && send != recv + int64_t(rank_) * count) std::memmove(recv + int64_t(rank_) * count, send, bytes);
    if (size_ == 1) return;
    std::vector<Frame> got = exchange_blocks(c, recv + int64_t(rank_) * count, count, false);
    for (int p = 0; p < size_; ++p)
      if (p != rank_ && bytes) std::memcpy(recv + int64_t(p) * count, got[size_t(p)].payload.data(), bytes);
  }

  template <typename T>
  void all_gather_t(const T* send, T* recv, int64_t count) {
    check_count(count, "all_gather");
    Call c = start(Op::kAllGather, dtype_of<T>(), 0, -1, count);
    gather_words(c, send, recv, count);
  }

  // Reduce-scatter then all-gather over chunks [lo(p), lo(p + 1)): rank p reduces chunk p in
  // rank order and sends it to every rank, so every rank holds the same bits.
  template <typename T>
  void all_reduce_t(T* data, int64_t n, ReduceOp op) {
    check_count(n, "all_reduce");
    Call c = start(Op::kAllReduce, dtype_of<T>(), op == ReduceOp::kSum ? 1 : 2, -1, n);
    if (size_ == 1) return;
    const int64_t np = size_;
    auto lo = [&](int64_t p) { return n / np * p + std::min<int64_t>(p, n % np); };
    auto bytes_of = [&](int64_t p) { return size_t(lo(p + 1) - lo(p)) * sizeof(T); };
    std::vector<Out> outs(static_cast<size_t>(size_));
    std::vector<In> ins(static_cast<size_t>(size_));
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      outs[size_t(p)] = {true, data + lo(p), bytes_of(p), n};
      ins[size_t(p)] = {true, n, bytes_of(rank_)};
    }
    std::vector<Frame> got = exchange(c, outs, ins);
    const int64_t m = lo(rank_ + 1) - lo(rank_);
    std::vector<T> acc(static_cast<size_t>(m)), v(static_cast<size_t>(m));
    for (int p = 0; p < size_; ++p) {
      const T* x = data + lo(rank_);
      if (p != rank_) {
        if (m) std::memcpy(v.data(), got[size_t(p)].payload.data(), size_t(m) * sizeof(T));
        x = v.data();
      }
      if (p == 0) {
        std::copy(x, x + m, acc.begin());
      } else if (op == ReduceOp::kSum) {
        for (int64_t i = 0; i < m; ++i) acc[size_t(i)] = acc[size_t(i)] + x[i];
      } else {
        for (int64_t i = 0; i < m; ++i) acc[size_t(i)] = x[i] > acc[size_t(i)] ? x[i] : acc[size_t(i)];
      }
    }
    if (m) std::memcpy(data + lo(rank_), acc.data(), size_t(m) * sizeof(T));
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      outs[size_t(p)] = {true, data + lo(rank_), bytes_of(rank_), n};
      ins[size_t(p)] = {true, n, bytes_of(p)};
    }
    got = exchange(c, outs, ins);
    for (int p = 0; p < size_; ++p)
      if (p != rank_ && bytes_of(p)) std::memcpy(data + lo(p), got[size_t(p)].payload.data(), bytes_of(p));
  }

  // A round in which every pair agrees on the call (root and size included), then the root's
  // data to every other rank.
  template <typename T>
  void broadcast_t(T* data, int64_t n, int root) {
    check_count(n, "broadcast");
    MOE_CHECK(root >= 0 && root < size_, "broadcast root ", root, " is not a rank of this group of ", size_);
    Call c = start(Op::kBroadcast, dtype_of<T>(), 0, root, n);
    if (size_ == 1) return;
    agree(c);
    const size_t bytes = size_t(n) * sizeof(T);
    std::vector<Out> outs(static_cast<size_t>(size_));
    std::vector<In> ins(static_cast<size_t>(size_));
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      if (rank_ == root) outs[size_t(p)] = {true, data, bytes, n};
      if (p == root) ins[size_t(p)] = {true, n, bytes};
    }
    std::vector<Frame> got = exchange(c, outs, ins);
    if (rank_ != root && bytes) std::memcpy(data, got[size_t(root)].payload.data(), bytes);
  }

  std::shared_ptr<Mesh> mesh_;
  uint64_t group_;
  std::vector<int> members_;  // world rank of each group rank
  int rank_ = 0, size_ = 1;
  uint64_t round_ = 0;
  std::vector<uint64_t> sends_to_;  // sends to each group rank
};

}  // namespace

std::unique_ptr<Comm> make_group_comm(std::shared_ptr<Mesh> mesh, uint64_t group, std::vector<int> members,
                                      double timeout_s) {
  return std::make_unique<TcpComm>(std::move(mesh), group, std::move(members), timeout_s);
}

}  // namespace moe::tcp
