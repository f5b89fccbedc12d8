// Names of the TCP communicator's frames (parallel/tcp/frame.h) for its error messages: the
// collective and dtype a header names, and the whole call as one phrase.
#include "parallel/tcp/frame.h"

namespace moe::tcp {

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
    case Op::kSend: return "send";
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

std::string describe(const FrameHeader& h) {
  std::string s = op_name(h.op, h.reduce);
  if (Op(h.op) == Op::kBarrier) return s;
  if (Op(h.op) == Op::kBroadcast) s += " from root " + std::to_string(h.root);
  if (Op(h.op) == Op::kSend) s += " with tag " + std::to_string(h.root);
  if (Op(h.op) == Op::kAllToAllV)
    return s + " with a block of " + std::to_string(h.count) + " " + dtype_name(h.dtype) + " for this pair of ranks";
  s += " of " + std::to_string(h.count) + " " + dtype_name(h.dtype);
  if (Op(h.op) == Op::kReduceScatter || Op(h.op) == Op::kAllGather || Op(h.op) == Op::kAllToAll) s += " per rank";
  return s;
}

}  // namespace moe::tcp
