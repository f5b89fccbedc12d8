// POSIX TCP sockets for the TCP communicator (comm_tcp.h): non-blocking, close-on-exec sockets
// with TCP_NODELAY, and every wait (send, receive, accept, connect) polled against a steady-clock
// deadline, at most a second per poll. Nothing here throws: failures return false or -1 with the
// error text in `err`, and the callers name the rank and the call.
#pragma once

#include <chrono>
#include <string>

namespace moe::tcp {

using Clock = std::chrono::steady_clock;

Clock::time_point deadline_after(double s);
// Milliseconds to the deadline for one poll, clamped to [0, 1000].
int ms_left(Clock::time_point deadline);

std::string errno_text(int e);
// Non-blocking, close-on-exec, TCP_NODELAY.
void set_socket_options(int fd);

// Sends or receives exactly n bytes; false with `err` on a closed peer, an error or the deadline.
bool write_all(int fd, const void* data, size_t n, Clock::time_point deadline, std::string* err);
bool read_all(int fd, void* data, size_t n, Clock::time_point deadline, std::string* err);

// A listening socket on every address of `family` (AF_INET6 also takes IPv4), port 0 = ephemeral;
// -1 with `err` when it cannot be opened.
int listen_any(int family, int port, int backlog, std::string* err);
// The port a socket is bound to.
int socket_port(int fd);
// The local address of a connected socket as numeric text, and its family.
std::string local_address(int fd, int* family);
// Accepts one connection before the deadline; -1 when it passes.
int accept_until(int lfd, Clock::time_point deadline);
// Connects to host:port, retrying with a growing pause (the listener may not exist yet) until
// the deadline; -1 with the last error in `err` when it passes.
int connect_until(const std::string& host, int port, Clock::time_point deadline, std::string* err);

}  // namespace moe::tcp
