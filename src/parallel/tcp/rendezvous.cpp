// The rendezvous of parallel/tcp/rendezvous.h over fixed-size structs (hello, reply, table entry,
// handshake, each starting with its magic), sent as the sender's memory holds them. A connection
// whose first bytes are not a hello (a port probe) or a handshake of this job is dropped.
#include "parallel/tcp/rendezvous.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "parallel/tcp/frame.h"

namespace moe::tcp {
namespace {

constexpr uint32_t kHelloMagic = 0x4d4f4548;      // rank -> rank 0 at the rendezvous
constexpr uint32_t kReplyMagic = 0x4d4f4552;      // rank 0 -> rank: the table or an error
constexpr uint32_t kHandshakeMagic = 0x4d4f454d;  // rank i -> rank j < i when building the mesh
constexpr size_t kAddrBytes = 64;

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

}  // namespace

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

}  // namespace moe::tcp
