// The TCP mesh (parallel/tcp/mesh.h): frame reassembly from non-blocking reads (header, then
// payload of header.bytes), the outgoing queues of point-to-point sends, the wait every call of
// the communicator makes, and a close that writes what is queued, sends FIN and drains what the
// peers still send so that no unread data resets a connection.
#include "parallel/tcp/mesh.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>

#include "parallel/tcp/socket.h"

namespace moe::tcp {

void Mesh::close_all(double grace_s) {
  const auto deadline = deadline_after(grace_s);
  std::vector<char> sink(1 << 16);
  std::vector<pollfd> pfs;
  std::vector<Peer*> open;
  for (;;) {
    // FIN once a peer's queued sends are written (or it is gone).
    for (int w = 0; w < int(peers.size()); ++w) {
      Peer& p = peers[size_t(w)];
      if (p.fd < 0 || p.shut) continue;
      if (!p.closed && !push(w)) continue;
      ::shutdown(p.fd, SHUT_WR);
      p.shut = true;
    }
    pfs.clear();
    open.clear();
    for (Peer& p : peers) {
      if (p.fd < 0 || p.closed) continue;
      pfs.push_back({p.fd, short(p.shut ? POLLIN : POLLIN | POLLOUT), 0});
      open.push_back(&p);
    }
    if (pfs.empty() || Clock::now() >= deadline) break;
    if (::poll(pfs.data(), pfs.size(), ms_left(deadline)) <= 0) continue;
    for (size_t i = 0; i < pfs.size(); ++i) {
      if (!(pfs[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
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

bool write_frame(Peer& p, FrameHeader& h, const char* data, size_t* sent) {
  const size_t total = sizeof(FrameHeader) + size_t(h.bytes);
  while (*sent < total && !p.closed) {
    iovec iov[2];
    int n_iov = 0;
    if (*sent < sizeof(FrameHeader)) {
      iov[n_iov++] = {reinterpret_cast<char*>(&h) + *sent, sizeof(FrameHeader) - *sent};
      if (h.bytes) iov[n_iov++] = {const_cast<char*>(data), size_t(h.bytes)};
    } else {
      const size_t off = *sent - sizeof(FrameHeader);
      iov[n_iov++] = {const_cast<char*>(data) + off, size_t(h.bytes) - off};
    }
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = size_t(n_iov);
    const ssize_t k = ::sendmsg(p.fd, &mh, MSG_NOSIGNAL);
    if (k > 0) {
      *sent += size_t(k);
    } else if (k < 0 && errno == EINTR) {
      continue;
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      break;
    } else if (!p.closed) {
      p.closed = true;
      p.why_closed = "lost its connection (" + errno_text(errno) + "; its process exited or crashed)";
    }
  }
  return *sent == total;
}

bool Mesh::push(int w) {
  Peer& p = peers[size_t(w)];
  while (!p.outq.empty() && !p.closed) {
    Peer::Outgoing& o = p.outq.front();
    if (!write_frame(p, o.h, o.payload.data(), &o.sent)) break;
    p.outq.pop_front();
  }
  return p.outq.empty();
}

void Mesh::push_all() {
  for (int w = 0; w < size; ++w)
    if (w != rank && peers[size_t(w)].fd >= 0) push(w);
}

bool Mesh::wait(Clock::time_point deadline, const std::vector<char>& want_write, std::string* err) {
  std::vector<pollfd> pfs;
  std::vector<int> pf_rank;
  for (int w = 0; w < size; ++w) {
    const Peer& p = peers[size_t(w)];
    if (w == rank || p.fd < 0 || p.closed) continue;
    short ev = POLLIN;
    if (!p.outq.empty() || (size_t(w) < want_write.size() && want_write[size_t(w)])) ev |= POLLOUT;
    pfs.push_back({p.fd, ev, 0});
    pf_rank.push_back(w);
  }
  const int rc = ::poll(pfs.data(), pfs.size(), ms_left(deadline));
  if (rc < 0 && errno != EINTR) {
    *err = "poll failed: " + errno_text(errno);
    return false;
  }
  for (size_t i = 0; rc > 0 && i < pfs.size(); ++i)
    if (pfs[i].revents & (POLLIN | POLLHUP | POLLERR)) drain(pf_rank[i]);
  return true;
}

void Mesh::mark_closed(Peer& p, const std::string& why) {
  if (p.closed) return;
  p.closed = true;
  p.why_closed = why;
}

void Mesh::drain(int w) {
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

}  // namespace moe::tcp
