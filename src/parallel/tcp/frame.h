// The frames of the TCP communicator: a 48-byte header (magic, op, dtype, reduce op, root, group
// size, group id, round, element count, payload bytes) and the payload, sent as the sender's
// memory holds them (the ranks of a job share one architecture). The round and the call it names
// let a receiver check that both ranks run the same collective; describe() words a call for the
// mismatch errors. A point-to-point send (Op::kSend) is one frame: its tag in root, its round
// the sender's count of sends to that rank in the group; collectives and recvs each take only
// their own kind from the stash, so the two never match each other. Group ids: kWorldGroup, and mix64 hashes of it for split groups.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace moe::tcp {

constexpr uint32_t kFrameMagic = 0x4d4f4546;  // frames of a collective
constexpr uint64_t kWorldGroup = 0x9e3779b97f4a7c15ull;

inline uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

enum class Op : uint16_t { kAllReduce = 1, kReduceScatter, kAllGather, kAllToAllV, kAllToAll, kBroadcast, kBarrier, kSplit, kSend };
enum class Dtype : uint8_t { kNone = 0, kF32, kF64, kI64 };

template <typename T>
Dtype dtype_of();
template <>
inline Dtype dtype_of<float>() { return Dtype::kF32; }
template <>
inline Dtype dtype_of<double>() { return Dtype::kF64; }
template <>
inline Dtype dtype_of<int64_t>() { return Dtype::kI64; }

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint16_t op = 0;
  uint8_t dtype = 0;
  uint8_t reduce = 0;  // ReduceOp + 1 for all_reduce, else 0
  int32_t root = -1;   // broadcast root (group rank), the tag of a send, else -1
  int32_t group_size = 0;
  uint64_t group = 0;
  uint64_t round = 0;  // per-group counter of exchanges, equal on every member (send: per pair)
  int64_t count = 0;   // the call's element count as the sender sees it (all_to_all_v: this block)
  uint64_t bytes = 0;  // payload bytes that follow
};
static_assert(sizeof(FrameHeader) == 48, "frame header layout");

// "all_reduce(sum)", "broadcast", ...; "float32", "float64", "int64" ("" for none).
const char* op_name(uint16_t op, uint8_t reduce);
const char* dtype_name(uint8_t d);
// "broadcast from root 1 of 16 int64", "all_to_all_v with a block of 3 float32 for this pair",
// "send with tag 4 of 3 float32".
std::string describe(const FrameHeader& h);

struct Frame {
  FrameHeader h;
  std::vector<char> payload;
};

}  // namespace moe::tcp
