// The mesh of a TCP job: one socket per peer, shared by the world and every group split from it.
// A peer's socket carries the frames of every group in send order; drain() reassembles whatever
// it holds into whole frames and stashes them until the collective of their group and round
// takes them.
#pragma once

#include <deque>
#include <string>
#include <vector>

#include "parallel/tcp/frame.h"

namespace moe::tcp {

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
  void close_all(double grace_s);
  void mark_closed(Peer& p, const std::string& why);
  // Reads whatever peer w's socket holds; complete frames go to its stash.
  void drain(int w);
};

}  // namespace moe::tcp
