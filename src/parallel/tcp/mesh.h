// The mesh of a TCP job: one socket per peer, shared by the world and every group split from it.
// A peer's socket carries the frames of every group in send order; drain() reassembles whatever
// it holds into whole frames and stashes them until the collective of their group and round (or
// the recv of their group) takes them. Point-to-point sends (Comm::send) are copied into the
// peer's outgoing queue and written as the socket takes them, by every later call of any group
// on the mesh (a collective's frames to that peer go after what is queued). Memory: the sender
// holds the messages the kernel has not taken yet, the receiver those that arrived before their
// recv; both are bounded by the messages a schedule leaves in flight between two ranks (1F1B:
// at most pp x virtual_stages activations or gradients per pair).
#pragma once

#include <deque>
#include <string>
#include <vector>

#include "parallel/tcp/frame.h"
#include "parallel/tcp/socket.h"

namespace moe::tcp {

struct Peer {
  int fd = -1;
  bool closed = false;     // end of stream or a socket error seen
  std::string why_closed;  // for the error message
  FrameHeader h;           // the frame being read
  size_t header_got = 0;
  std::vector<char> payload;
  size_t payload_got = 0;
  std::deque<Frame> stash;  // complete frames not yet taken by a collective or recv
  struct Outgoing {
    FrameHeader h;
    std::vector<char> payload;
    size_t sent = 0;  // bytes of header and payload written
  };
  std::deque<Outgoing> outq;  // point-to-point frames not yet written, in send order
  bool shut = false;          // FIN sent (close_all)
};

// Writes the frame (header h, then h.bytes of data) from byte *sent on, as far as the socket takes
// it now. True when all of it is written; on a socket error the peer is marked closed.
bool write_frame(Peer& p, FrameHeader& h, const char* data, size_t* sent);

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
  // Writes peer w's outgoing queue as far as its socket takes it; true when the queue is empty.
  bool push(int w);
  void push_all();
  // One wait of at most a second (or to the deadline) for any socket: every open peer is read
  // (complete frames are stashed) and polled for writing where its queue or want_write[w] holds
  // data. False with `err` when poll itself fails.
  bool wait(Clock::time_point deadline, const std::vector<char>& want_write, std::string* err);
};

}  // namespace moe::tcp
