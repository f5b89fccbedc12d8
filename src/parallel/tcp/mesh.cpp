// The TCP mesh (parallel/tcp/mesh.h): frame reassembly from non-blocking reads (header, then
// payload of header.bytes), and a close that sends FIN and drains what the peers still send so that
// no unread data resets a connection.
#include "parallel/tcp/mesh.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "parallel/tcp/socket.h"

namespace moe::tcp {

void Mesh::close_all(double grace_s) {
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
