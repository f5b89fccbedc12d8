// Communicator over a full mesh of TCP sockets (comm_tcp.h). Every message is a frame: a 48-byte
// header (magic, group id, round, op, dtype, reduce op, root, group size, element count, payload
// bytes) and the payload. Every collective starts with a round in which each pair of ranks
// exchanges a frame, so ranks that called different collectives (or sizes) fail on both sides
// naming both calls. all_reduce is reduce-scatter then all-gather: rank p sums chunk p in rank
// order, so the sum is x0 + x1 + ... + x(n-1) and every rank gets the same bits.
#include "parallel/comm_tcp.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "core/error.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kFrameMagic = 0x4d4f4546;      // frames of a collective
constexpr uint32_t kHelloMagic = 0x4d4f4548;      // rank -> rank 0 at the rendezvous
constexpr uint32_t kReplyMagic = 0x4d4f4552;      // rank 0 -> rank: the table or an error
constexpr uint32_t kHandshakeMagic = 0x4d4f454d;  // rank i -> rank j < i when building the mesh
constexpr uint64_t kWorldGroup = 0x9e3779b97f4a7c15ull;
constexpr size_t kAddrBytes = 64;

Clock::time_point deadline_after(double s) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

int ms_left(Clock::time_point deadline) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return int(std::clamp<int64_t>(ms, 0, 1000));  // at most a second per poll: deadlines stay exact
}

uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// ---------------------------------------------------------------------------------------------
// Frames and what they describe.

enum class Op : uint16_t { kAllReduce = 1, kReduceScatter, kAllGather, kAllToAllV, kAllToAll, kBroadcast, kBarrier, kSplit };
enum class Dtype : uint8_t { kNone = 0, kF32, kF64, kI64 };

template <typename T>
Dtype dtype_of();
template <>
Dtype dtype_of<float>() { return Dtype::kF32; }
template <>
Dtype dtype_of<double>() { return Dtype::kF64; }
template <>
Dtype dtype_of<int64_t>() { return Dtype::kI64; }

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint16_t op = 0;
  uint8_t dtype = 0;
  uint8_t reduce = 0;  // ReduceOp + 1 for all_reduce, else 0
  int32_t root = -1;   // broadcast root (group rank), else -1
  int32_t group_size = 0;
  uint64_t group = 0;
  uint64_t round = 0;  // per-group counter of exchanges, equal on every member
  int64_t count = 0;   // the call's element count as the sender sees it (all_to_all_v: this block)
  uint64_t bytes = 0;  // payload bytes that follow
};
static_assert(sizeof(FrameHeader) == 48, "frame header layout");

const char* op_name(uint16_t op, uint8_t reduce) {
  switch (Op(op)) {
    case Op::kAllReduce: return reduce == 2 ? "all_reduce(max)" : "all_reduce(sum)";
    case Op::kReduceScatter: return "reduce_scatter";
    case Op::kAllGather: return "all_gather";
    case Op::kAllToAllV: return "all_to_all_v";
    case Op::kAllToAll: return "all_to_all";
    case Op::kBroadcast: return "broadcast";
    case Op::kBarrier: return "barrier";
    case Op::kSplit: return "split";
  }
  return "unknown collective";
}

const char* dtype_name(uint8_t d) {
  switch (Dtype(d)) {
    case Dtype::kF32: return "float32";
    case Dtype::kF64: return "float64";
    case Dtype::kI64: return "int64";
    case Dtype::kNone: break;
  }
  return "";
}

// "broadcast from root 1 of 16 int64", "all_to_all_v with a block of 3 float32 for this pair".
std::string describe(const FrameHeader& h) {
  std::string s = op_name(h.op, h.reduce);
  if (Op(h.op) == Op::kBarrier) return s;
  if (Op(h.op) == Op::kBroadcast) s += " from root " + std::to_string(h.root);
  if (Op(h.op) == Op::kAllToAllV)
    return s + " with a block of " + std::to_string(h.count) + " " + dtype_name(h.dtype) + " for this pair of ranks";
  s += " of " + std::to_string(h.count) + " " + dtype_name(h.dtype);
  if (Op(h.op) == Op::kReduceScatter || Op(h.op) == Op::kAllGather || Op(h.op) == Op::kAllToAll) s += " per rank";
  return s;
}

struct Frame {
  FrameHeader h;
  std::vector<char> payload;
};

// ---------------------------------------------------------------------------------------------
// Socket helpers (non-blocking sockets, every wait against a deadline).

std::string errno_text(int e) { return std::strerror(e); }

void set_socket_options(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// Sends (sending) or receives exactly n bytes at p; false with `err` on a closed peer, an error or
// the deadline.
bool transfer_all(int fd, char* p, size_t n, bool sending, Clock::time_point deadline, std::string* err) {
  while (n > 0) {
    const ssize_t k = sending ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (k > 0) {
      p += k;
      n -= size_t(k);
      continue;
    }
    if (k == 0 && !sending) {
      *err = "the connection was closed";
      return false;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (Clock::now() >= deadline) {
        *err = sending ? "timed out sending" : "timed out waiting";
        return false;
      }
      pollfd pf{fd, short(sending ? POLLOUT : POLLIN), 0};
      ::poll(&pf, 1, ms_left(deadline));
      continue;
    }
    *err = errno_text(errno);
    return false;
  }
  return true;
}

bool write_all(int fd, const void* data, size_t n, Clock::time_point deadline, std::string* err) {
  return transfer_all(fd, const_cast<char*>(static_cast<const char*>(data)), n, true, deadline, err);
}

bool read_all(int fd, void* data, size_t n, Clock::time_point deadline, std::string* err) {
  return transfer_all(fd, static_cast<char*>(data), n, false, deadline, err);
}

// A listening socket on every address of `family` (AF_INET6 also takes IPv4), port 0 = ephemeral.
int listen_any(int family, int port, int backlog, std::string* err) {
  const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = errno_text(errno);
    return -1;
  }
  int one = 1, zero = 0;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_storage ss{};
  socklen_t len = 0;
  if (family == AF_INET6) {
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    a->sin6_family = AF_INET6;
    a->sin6_addr = in6addr_any;
    a->sin6_port = htons(uint16_t(port));
    len = sizeof(sockaddr_in6);
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl(INADDR_ANY);
    a->sin_port = htons(uint16_t(port));
    len = sizeof(sockaddr_in);
  }
  if (::bind(fd, reinterpret_cast<sockaddr*>(&ss), len) != 0 || ::listen(fd, backlog) != 0) {
    *err = errno_text(errno);
    ::close(fd);
    return -1;
  }
  set_socket_options(fd);
  return fd;
}

int socket_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  return ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                  : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
}

// The local address of a connected socket as numeric text, and its family.
std::string local_address(int fd, int* family) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  char host[NI_MAXHOST] = {};
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0 ||
      ::getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0) {
    *family = AF_INET;
    return "127.0.0.1";
  }
  *family = ss.ss_family;
  return host;
}

// Accepts one connection before the deadline; -1 when it passes.
int accept_until(int lfd, Clock::time_point deadline) {
  for (;;) {
    const int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      set_socket_options(fd);
      return fd;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) return -1;
    if (Clock::now() >= deadline) return -1;
    pollfd pf{lfd, POLLIN, 0};
    ::poll(&pf, 1, ms_left(deadline));
  }
}

// Connects to host:port, retrying with a growing pause (the listener may not exist yet) until
// the deadline; -1 with the last error in `err` when it passes.
int connect_until(const std::string& host, int port, Clock::time_point deadline, std::string* err) {
  auto pause = std::chrono::milliseconds(10);
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* list = nullptr;
    const int gai = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &list);
    if (gai != 0) *err = std::string("cannot resolve the address: ") + ::gai_strerror(gai);
    for (addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
      const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
      if (fd < 0) {
        *err = errno_text(errno);
        continue;
      }
      int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        pollfd pf{fd, POLLOUT, 0};
        while ((rc = ::poll(&pf, 1, ms_left(deadline))) == 0 && Clock::now() < deadline) {
        }
        int so = ETIMEDOUT;
        socklen_t sl = sizeof so;
        if (rc > 0) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &sl);
        errno = so;
        rc = so == 0 ? 0 : -1;
      }
      if (rc == 0) {
        ::freeaddrinfo(list);
        set_socket_options(fd);
        return fd;
      }
      *err = errno_text(errno);
      ::close(fd);
    }
    if (list) ::freeaddrinfo(list);
    if (Clock::now() + pause >= deadline) return -1;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(500));
  }
}

// ---------------------------------------------------------------------------------------------
// The mesh: one socket per peer, shared by the world and every group split from it.

struct Peer {
  int fd = -1;
  bool closed = false;     // end of stream or a socket error seen
  std::string why_closed;  // for the error message
  FrameHeader h;           // the frame being read
  size_t header_got = 0;
  std::vector<char> payload;
  size_t payload_got = 0;
  std::deque<Frame> stash;  // complete frames not yet taken by a collective
};

struct Mesh {
  int rank = 0;
  int size = 1;
  std::vector<Peer> peers;
  std::string broken;  // set when an error left a stream in an unknown state

  ~Mesh() { close_all(0.5); }

  // Ends every connection without losing data: a socket closed with unread bytes resets the
  // connection, and the peer then loses frames it has not read yet (e.g. the last result of a
  // rank that fails right after sending it). So: send FIN, read and drop what still comes until
  // every peer has closed too or `grace_s` passes, then close.
  void close_all(double grace_s) {
    for (Peer& p : peers)
      if (p.fd >= 0) ::shutdown(p.fd, SHUT_WR);
    const auto deadline = deadline_after(grace_s);
    std::vector<char> sink(1 << 16);
    std::vector<pollfd> pfs;
    std::vector<Peer*> open;
    for (;;) {
      pfs.clear();
      open.clear();
      for (Peer& p : peers) {
        if (p.fd < 0 || p.closed) continue;
        pfs.push_back({p.fd, POLLIN, 0});
        open.push_back(&p);
      }
      if (pfs.empty() || Clock::now() >= deadline) break;
      if (::poll(pfs.data(), pfs.size(), ms_left(deadline)) <= 0) continue;
      for (size_t i = 0; i < pfs.size(); ++i) {
        if (!pfs[i].revents) continue;
        for (;;) {
          const ssize_t k = ::recv(open[i]->fd, sink.data(), sink.size(), 0);
          if (k > 0) continue;
          if (k < 0 && errno == EINTR) continue;
          if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) open[i]->closed = true;
          break;
        }
      }
    }
    for (Peer& p : peers) {
      if (p.fd >= 0) ::close(p.fd);
      p.fd = -1;
    }
  }

  void mark_closed(Peer& p, const std::string& why) {
    if (p.closed) return;
    p.closed = true;
    p.why_closed = why;
  }

  // Reads whatever peer w's socket holds; complete frames go to its stash.
  void drain(int w) {
    Peer& p = peers[size_t(w)];
    while (!p.closed) {
      const bool in_header = p.header_got < sizeof(FrameHeader);
      char* dst = in_header ? reinterpret_cast<char*>(&p.h) + p.header_got : p.payload.data() + p.payload_got;
      const size_t want = in_header ? sizeof(FrameHeader) - p.header_got : size_t(p.h.bytes) - p.payload_got;
      if (want > 0) {
        const ssize_t k = ::recv(p.fd, dst, want, 0);
        if (k == 0) {
          mark_closed(p, "closed its connection (its process exited or crashed)");
          return;
        }
        if (k < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) return;
          mark_closed(p, "lost its connection (" + errno_text(errno) + "; its process exited or crashed)");
          return;
        }
        if (in_header) {
          p.header_got += size_t(k);
          if (p.header_got < sizeof(FrameHeader)) continue;
          if (p.h.magic != kFrameMagic) {
            mark_closed(p, "sent bytes that are not a moecore frame (a corrupted stream)");
            return;
          }
          p.payload.assign(size_t(p.h.bytes), 0);
          p.payload_got = 0;
        } else {
          p.payload_got += size_t(k);
        }
      }
      if (p.header_got == sizeof(FrameHeader) && p.payload_got == p.h.bytes) {
        p.stash.push_back(Frame{p.h, std::move(p.payload)});
        p.payload = {};
        p.header_got = 0;
        p.payload_got = 0;
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------
// The communicator of one group (the world or a split) over the shared mesh.

class TcpComm final : public Comm {
 public:
  TcpComm(std::shared_ptr<Mesh> mesh, uint64_t group, std::vector<int> members, double timeout_s)
      : mesh_(std::move(mesh)), group_(group), members_(std::move(members)) {
    timeout_s_ = timeout_s;
    size_ = int(members_.size());
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
    Call c = start(Op::kReduceScatter, Dtype::kF32, 0, -1, count);
    const size_t bytes = size_t(count) * sizeof(float);
    std::vector<Out> outs(static_cast<size_t>(size_));
    std::vector<In> ins(static_cast<size_t>(size_));
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      outs[size_t(p)] = {true, send + int64_t(p) * count, bytes, count};
      ins[size_t(p)] = {true, count, bytes};
    }
    std::vector<Frame> got = exchange(c, outs, ins);
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
    Call c = start(Op::kAllToAll, Dtype::kI64, 0, -1, count);
    const size_t bytes = size_t(count) * sizeof(int64_t);
    std::vector<Out> outs(static_cast<size_t>(size_));
    std::vector<In> ins(static_cast<size_t>(size_));
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      outs[size_t(p)] = {true, send + int64_t(p) * count, bytes, count};
      ins[size_t(p)] = {true, count, bytes};
    }
    std::vector<Frame> got = exchange(c, outs, ins);
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

  std::unique_ptr<Comm> split(int color, int key) override {
    MOE_CHECK(color >= 0, "split: color must be >= 0, got ", color, " on rank ", rank_);
    Call c = start(Op::kSplit, Dtype::kI64, 0, -1, 3);
    const uint64_t round = round_;
    const int64_t mine[3] = {color, key, rank_};
    std::vector<int64_t> all(size_t(size_) * 3);
    gather_words(c, mine, all.data(), 3);
    std::vector<std::pair<int64_t, int>> order;  // (key, parent rank) of this color
    for (int p = 0; p < size_; ++p)
      if (all[size_t(p) * 3] == color) order.emplace_back(all[size_t(p) * 3 + 1], p);
    std::sort(order.begin(), order.end());
    std::vector<int> members;
    for (const auto& [k, p] : order) members.push_back(members_[size_t(p)]);
    const uint64_t child = mix64(group_ ^ mix64(round + 1) ^ mix64(0x51ull + uint64_t(color)));
    return std::make_unique<TcpComm>(mesh_, child, std::move(members), timeout_s_);
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

  std::string where(const Call& c) const {
    return "collective " + c.name + " on rank " + std::to_string(rank_) + " of group size " + std::to_string(size_);
  }

  [[noreturn]] void fail(const std::string& msg) {
    mesh_->broken = msg;
    MOE_FAIL(msg);
  }

  // Frame from group rank p for this round, if it is in p's stash; a frame of this group with
  // another round or another call is a mismatch (the first frame of this group from p must be it).
  bool take(const Call& c, uint64_t round, int p, const In& in, Frame* out) {
    std::deque<Frame>& stash = mesh_->peers[size_t(members_[size_t(p)])].stash;
    for (auto it = stash.begin(); it != stash.end(); ++it) {
      const FrameHeader& h = it->h;
      if (h.group != group_) continue;
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
    std::vector<pollfd> pfs;
    std::vector<int> pf_rank;
    for (;;) {
      // Sends: as much as the sockets take now.
      bool sends_left = false;
      for (Sending& s : sending) {
        const size_t total = sizeof(FrameHeader) + size_t(s.h.bytes);
        Peer& peer = m.peers[size_t(members_[size_t(s.p)])];
        while (s.sent < total && !peer.closed) {
          iovec iov[2];
          int n_iov = 0;
          if (s.sent < sizeof(FrameHeader)) {
            iov[n_iov++] = {reinterpret_cast<char*>(&s.h) + s.sent, sizeof(FrameHeader) - s.sent};
            if (s.h.bytes) iov[n_iov++] = {const_cast<char*>(s.data), size_t(s.h.bytes)};
          } else {
            const size_t off = s.sent - sizeof(FrameHeader);
            iov[n_iov++] = {const_cast<char*>(s.data) + off, size_t(s.h.bytes) - off};
          }
          msghdr mh{};
          mh.msg_iov = iov;
          mh.msg_iovlen = size_t(n_iov);
          const ssize_t k = ::sendmsg(peer.fd, &mh, MSG_NOSIGNAL);
          if (k > 0) {
            s.sent += size_t(k);
          } else if (k < 0 && errno == EINTR) {
            continue;
          } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            break;
          } else {
            m.mark_closed(peer, "lost its connection (" + errno_text(errno) + "; its process exited or crashed)");
          }
        }
        if (s.sent < total) sends_left = true;
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
          if (needed) fail(where(c) + " failed: " + who(p) + " " + peer.why_closed);
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
      pfs.clear();
      pf_rank.clear();
      for (int w = 0; w < m.size; ++w) {
        const Peer& peer = m.peers[size_t(w)];
        if (w == m.rank || peer.fd < 0 || peer.closed) continue;
        short ev = POLLIN;
        for (const Sending& s : sending)
          if (members_[size_t(s.p)] == w && s.sent < sizeof(FrameHeader) + size_t(s.h.bytes)) ev |= POLLOUT;
        pfs.push_back({peer.fd, ev, 0});
        pf_rank.push_back(w);
      }
      const int rc = ::poll(pfs.data(), pfs.size(), ms_left(c.deadline));
      if (rc < 0 && errno != EINTR) fail(where(c) + ": poll failed: " + errno_text(errno));
      for (size_t i = 0; rc > 0 && i < pfs.size(); ++i)
        if (pfs[i].revents & (POLLIN | POLLHUP | POLLERR)) m.drain(pf_rank[i]);
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
    std::vector<Out> outs(static_cast<size_t>(size_));
    std::vector<In> ins(static_cast<size_t>(size_));
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      outs[size_t(p)] = {true, recv + int64_t(rank_) * count, bytes, count};
      ins[size_t(p)] = {true, count, bytes};
    }
    std::vector<Frame> got = exchange(c, outs, ins);
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
};

// ---------------------------------------------------------------------------------------------
// Rendezvous.

struct Hello {
  uint32_t magic = kHelloMagic;
  int32_t rank = 0;
  int32_t world_size = 0;
  int32_t port = 0;
  char addr[kAddrBytes] = {};
};
struct Reply {
  uint32_t magic = kReplyMagic;
  int32_t status = 0;  // 0: the table follows; else a message of message_bytes
  int32_t world_size = 0;
  int32_t message_bytes = 0;
  uint64_t job = 0;
};
struct TableEntry {
  int32_t port = 0;
  int32_t pad = 0;
  char addr[kAddrBytes] = {};
};
struct Handshake {
  uint32_t magic = kHandshakeMagic;
  int32_t rank = 0;
  uint64_t job = 0;
};

std::string timeout_text(double s) {
  std::ostringstream t;
  t << s;
  return t.str();
}

// Rank 0: accepts every other rank's hello on the master port, checks them, sends the table.
void rendezvous_root(Mesh& mesh, int master_port, double timeout_s, Clock::time_point deadline) {
  std::string err;
  int lfd = listen_any(AF_INET6, master_port, mesh.size + 8, &err);
  if (lfd < 0) lfd = listen_any(AF_INET, master_port, mesh.size + 8, &err);
  MOE_CHECK(lfd >= 0, "rank 0 cannot listen on the rendezvous port ", master_port, " (", err,
            "): another program or job uses that port; choose a free MASTER_PORT, or set MOECORE_MASTER_PORT "
            "(under torchrun the rendezvous takes MASTER_PORT + 1, since torchrun's agent holds MASTER_PORT)");
  std::random_device rd;
  const uint64_t job = mix64((uint64_t(rd()) << 32) ^ rd() ^ uint64_t(::getpid()) ^
                             uint64_t(Clock::now().time_since_epoch().count()));
  std::vector<TableEntry> table(size_t(mesh.size));
  std::vector<int> fds(size_t(mesh.size), -1);
  std::string problem;
  int joined = 1;
  while (joined < mesh.size && problem.empty()) {
    const int fd = accept_until(lfd, deadline);
    if (fd < 0) {
      std::string missing;
      for (int r = 1; r < mesh.size; ++r)
        if (fds[size_t(r)] < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      for (int f : fds)
        if (f >= 0) ::close(f);
      ::close(lfd);
      MOE_FAIL("rendezvous: rank 0 waited ", timeout_text(timeout_s), " s on port ", master_port, " but only ",
               joined, " of ", mesh.size, " ranks joined (missing RANK ", missing,
               "); start every rank with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE");
    }
    Hello h;
    const auto hello_deadline = std::min(deadline, deadline_after(30));
    if (!read_all(fd, &h, sizeof h, hello_deadline, &err) || h.magic != kHelloMagic) {
      ::close(fd);  // not a rank of this job (a port probe): ignore it
      continue;
    }
    h.addr[kAddrBytes - 1] = '\0';
    if (h.world_size != mesh.size) {
      problem = "rank " + std::to_string(h.rank) + " was started with WORLD_SIZE=" + std::to_string(h.world_size) +
                " but rank 0 with WORLD_SIZE=" + std::to_string(mesh.size) + "; every rank needs the same WORLD_SIZE";
    } else if (h.rank <= 0 || h.rank >= mesh.size || fds[size_t(h.rank)] >= 0) {
      problem = "two processes claim RANK=" + std::to_string(h.rank) + " (WORLD_SIZE=" + std::to_string(mesh.size) +
                "); every process needs its own RANK in [0, WORLD_SIZE)";
    }
    if (!problem.empty()) {
      fds.push_back(fd);  // told below like the others
      break;
    }
    fds[size_t(h.rank)] = fd;
    table[size_t(h.rank)].port = h.port;
    std::memcpy(table[size_t(h.rank)].addr, h.addr, kAddrBytes);
    ++joined;
  }
  ::close(lfd);
  Reply reply;
  reply.world_size = mesh.size;
  reply.job = job;
  if (!problem.empty()) {
    reply.status = 1;
    reply.message_bytes = int32_t(problem.size());
    for (int f : fds) {
      if (f < 0) continue;
      write_all(f, &reply, sizeof reply, deadline, &err);
      write_all(f, problem.data(), problem.size(), deadline, &err);
      ::close(f);
    }
    MOE_FAIL("rendezvous on rank 0 (port ", master_port, "): ", problem);
  }
  for (int r = 1; r < mesh.size; ++r) {
    const int f = fds[size_t(r)];
    MOE_CHECK(write_all(f, &reply, sizeof reply, deadline, &err) &&
                  write_all(f, table.data(), table.size() * sizeof(TableEntry), deadline, &err),
              "rendezvous: rank 0 could not send the table to rank ", r, ": ", err);
    mesh.peers[size_t(r)].fd = f;
  }
}

// Rank r > 0: joins at rank 0, gets the table, connects to every lower rank and accepts every
// higher one (the rank 0 connection is the mesh socket to rank 0).
void rendezvous_rank(Mesh& mesh, const std::string& master_addr, int master_port, double timeout_s,
                     Clock::time_point deadline) {
  const int me = mesh.rank;
  std::string err;
  const int fd0 = connect_until(master_addr, master_port, deadline, &err);
  MOE_CHECK(fd0 >= 0, "rendezvous: rank ", me, " could not reach rank 0 at ", master_addr, ":", master_port,
            " (MASTER_ADDR, MASTER_PORT) within ", timeout_text(timeout_s), " s (last error: ", err,
            "); is rank 0 running, and do all ranks have the same MASTER_ADDR and MASTER_PORT?");
  int family = AF_INET;
  const std::string addr = local_address(fd0, &family);
  const int lfd = listen_any(family, 0, mesh.size + 8, &err);
  if (lfd < 0) ::close(fd0);
  MOE_CHECK(lfd >= 0, "rendezvous: rank ", me, " cannot open a listening socket for its peers: ", err);
  Hello h;
  h.rank = me;
  h.world_size = mesh.size;
  h.port = socket_port(lfd);
  std::snprintf(h.addr, kAddrBytes, "%s", addr.c_str());
  Reply reply;
  auto fail = [&](const std::string& msg) {
    ::close(fd0);
    ::close(lfd);
    MOE_FAIL(msg);
  };
  if (!write_all(fd0, &h, sizeof h, deadline, &err) || !read_all(fd0, &reply, sizeof reply, deadline, &err) ||
      reply.magic != kReplyMagic) {
    fail("rendezvous: rank " + std::to_string(me) + " joined rank 0 at " + master_addr + ":" +
         std::to_string(master_port) + " but got no table within " + timeout_text(timeout_s) + " s (" +
         (err.empty() ? "not a moecore rendezvous" : err) + "); every rank must join within that time");
  }
  if (reply.status != 0) {
    std::string msg(size_t(std::clamp(reply.message_bytes, 0, 4096)), '\0');
    read_all(fd0, msg.data(), msg.size(), deadline, &err);
    fail("rendezvous failed on rank 0: " + msg);
  }
  std::vector<TableEntry> table(size_t(mesh.size));
  if (!read_all(fd0, table.data(), table.size() * sizeof(TableEntry), deadline, &err))
    fail("rendezvous: rank " + std::to_string(me) + " lost rank 0 while reading the table: " + err);
  mesh.peers[0].fd = fd0;
  for (int j = 1; j < me; ++j) {
    table[size_t(j)].addr[kAddrBytes - 1] = '\0';
    const std::string peer_addr = table[size_t(j)].addr;
    const int fd = connect_until(peer_addr, table[size_t(j)].port, deadline, &err);
    Handshake hs;
    hs.rank = me;
    hs.job = reply.job;
    if (fd < 0 || !write_all(fd, &hs, sizeof hs, deadline, &err)) {
      if (fd >= 0) ::close(fd);
      fail("rendezvous: rank " + std::to_string(me) + " could not connect to rank " + std::to_string(j) + " at " +
           peer_addr + ":" + std::to_string(table[size_t(j)].port) + ": " + err);
    }
    mesh.peers[size_t(j)].fd = fd;
  }
  for (int joined = me + 1; joined < mesh.size;) {
    const int fd = accept_until(lfd, deadline);
    if (fd < 0) {
      std::string missing;
      for (int r = me + 1; r < mesh.size; ++r)
        if (mesh.peers[size_t(r)].fd < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      fail("rendezvous: rank " + std::to_string(me) + " waited " + timeout_text(timeout_s) +
           " s for its connections from rank(s) " + missing);
    }
    Handshake hs;
    if (!read_all(fd, &hs, sizeof hs, std::min(deadline, deadline_after(30)), &err) ||
        hs.magic != kHandshakeMagic || hs.job != reply.job || hs.rank <= me || hs.rank >= mesh.size ||
        mesh.peers[size_t(hs.rank)].fd >= 0) {
      ::close(fd);  // not a peer of this job
      continue;
    }
    mesh.peers[size_t(hs.rank)].fd = fd;
    ++joined;
  }
  ::close(lfd);
}

int parse_int_env(const std::function<const char*(const char*)>& getenv_fn, const char* name, long lo, long hi,
                  const char* what) {
  const char* v = getenv_fn(name);
  MOE_CHECK(v != nullptr && *v != '\0', name, " is not set: a torchrun-style launch (RANK, WORLD_SIZE > 1) needs ",
            name, " (", what, ")");
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  MOE_CHECK(errno == 0 && end != v && *end == '\0' && x >= lo && x <= hi, name, " must be ", what, " (an integer in [",
            lo, ", ", hi, "]), got '", v, "'");
  return int(x);
}

}  // namespace

TcpLaunchEnv tcp_launch_env(const std::function<const char*(const char*)>& getenv_fn) {
  TcpLaunchEnv e;
  e.world_size = parse_int_env(getenv_fn, "WORLD_SIZE", 1, 1 << 20, "the number of ranks");
  e.rank = parse_int_env(getenv_fn, "RANK", 0, e.world_size - 1, "this process's rank, below WORLD_SIZE");
  const char* addr = getenv_fn("MASTER_ADDR");
  e.master_addr = addr && *addr ? addr : "127.0.0.1";
  e.master_port = parse_int_env(getenv_fn, "MASTER_PORT", 1, 65535,
                                "a port number, where rank 0 listens for the rendezvous");
  const char* own = getenv_fn("MOECORE_MASTER_PORT");
  const char* agent = getenv_fn("TORCHELASTIC_USE_AGENT_STORE");
  if (own != nullptr && *own != '\0') {
    e.master_port = parse_int_env(getenv_fn, "MOECORE_MASTER_PORT", 1, 65535,
                                  "a port number, where rank 0 listens for the rendezvous");
  } else if (agent != nullptr && std::strcmp(agent, "True") == 0) {
    // torchrun's agent serves its own TCPStore on MASTER_PORT: take the next port.
    MOE_CHECK(e.master_port < 65535, "MASTER_PORT = 65535 under torchrun (TORCHELASTIC_USE_AGENT_STORE=True): ",
              "the rendezvous would use MASTER_PORT + 1; set MOECORE_MASTER_PORT to a free port");
    e.master_port += 1;
  }
  return e;
}

std::unique_ptr<Comm> make_tcp_world(int rank, int world_size, const std::string& master_addr, int master_port,
                                     double timeout_s) {
  MOE_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "tcp world: rank ", rank,
            " is not in [0, WORLD_SIZE = ", world_size, ")");
  MOE_CHECK(master_port >= 1 && master_port <= 65535, "tcp world: MASTER_PORT must be in [1, 65535], got ",
            master_port);
  MOE_CHECK(timeout_s > 0, "tcp world: the timeout must be > 0 s, got ", timeout_s);
  auto mesh = std::make_shared<Mesh>();
  mesh->rank = rank;
  mesh->size = world_size;
  mesh->peers.resize(size_t(world_size));
  const auto deadline = deadline_after(timeout_s);
  if (world_size > 1) {
    if (rank == 0) {
      rendezvous_root(*mesh, master_port, timeout_s, deadline);
    } else {
      rendezvous_rank(*mesh, master_addr, master_port, timeout_s, deadline);
    }
  }
  std::vector<int> members(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) members[size_t(r)] = r;
  return std::make_unique<TcpComm>(mesh, kWorldGroup, std::move(members), timeout_s);
}

}  // namespace moe
