// The socket helpers of parallel/tcp/socket.h on POSIX calls: send/recv loops that poll for
// POLLIN/POLLOUT on EAGAIN, a non-blocking connect completed by poll and SO_ERROR, and retries with
// a pause doubling from 10 ms to 500 ms while the listener does not exist yet.
#include "parallel/tcp/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <thread>

namespace moe::tcp {

Clock::time_point deadline_after(double s) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

int ms_left(Clock::time_point deadline) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return int(std::clamp<int64_t>(ms, 0, 1000));  // at most a second per poll: deadlines stay exact
}

std::string errno_text(int e) { return std::strerror(e); }

void set_socket_options(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

namespace {

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

}  // namespace

bool write_all(int fd, const void* data, size_t n, Clock::time_point deadline, std::string* err) {
  return transfer_all(fd, const_cast<char*>(static_cast<const char*>(data)), n, true, deadline, err);
}

bool read_all(int fd, void* data, size_t n, Clock::time_point deadline, std::string* err) {
  return transfer_all(fd, static_cast<char*>(data), n, false, deadline, err);
}

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

}  // namespace moe::tcp
