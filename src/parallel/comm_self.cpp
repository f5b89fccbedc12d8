// The one-rank communicator of parallel/comm_self.h: collectives check their counts and root
// and copy send to recv where the call has both (memmove: the buffers may overlap).
#include "parallel/comm_self.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <deque>
#include <string>
#include <vector>

#include "core/error.h"

namespace moe {
namespace {

class SelfComm final : public Comm {
 public:
  explicit SelfComm(double timeout_s) { timeout_s_ = timeout_s; }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "self"; }

  void all_reduce(float*, int64_t n, ReduceOp) override { check_count(n, "all_reduce"); }
  void all_reduce(double*, int64_t n, ReduceOp) override { check_count(n, "all_reduce"); }
  void all_reduce(int64_t*, int64_t n, ReduceOp) override { check_count(n, "all_reduce"); }
  void reduce_scatter(const float* send, float* recv, int64_t count) override { copy(send, recv, count, "reduce_scatter"); }
  void all_gather(const float* send, float* recv, int64_t count) override { copy(send, recv, count, "all_gather"); }
  void all_gather(const int64_t* send, int64_t* recv, int64_t count) override { copy(send, recv, count, "all_gather"); }
  void all_to_all_v(const float* send, const int64_t* send_counts, float* recv, const int64_t* recv_counts) override {
    MOE_CHECK(send_counts[0] == recv_counts[0], "all_to_all_v on one rank: send count ", send_counts[0],
              " must equal receive count ", recv_counts[0]);
    copy(send, recv, send_counts[0], "all_to_all_v");
  }
  void all_to_all(const int64_t* send, int64_t* recv, int64_t count) override { copy(send, recv, count, "all_to_all"); }
  void broadcast(float*, int64_t n, int root) override { check_root(n, root); }
  void broadcast(int64_t*, int64_t n, int root) override { check_root(n, root); }
  void barrier() override {}
  // A loopback queue: rank 0 sends to itself and receives in send order.
  void send(const float* data, int64_t n, int dst, int tag) override {
    check_count(n, "send");
    MOE_CHECK(dst == 0, "send: rank ", dst, " is not a rank of a one-rank group");
    MOE_CHECK(tag >= 0 && tag <= kMaxTag, "send: tag ", tag, " must be in [0, ", kMaxTag, "]");
    queue_.push_back({tag, std::vector<float>(data, data + n)});
  }
  void recv(float* data, int64_t n, int src, int tag) override {
    check_count(n, "recv");
    MOE_CHECK(src == 0, "recv: rank ", src, " is not a rank of a one-rank group");
    MOE_CHECK(!queue_.empty(), "recv on rank 0 from rank 0 (tag ", tag, ", ", n,
              " elements): nothing was sent; the schedule receives a message it never sent");
    Message m = std::move(queue_.front());
    queue_.pop_front();
    MOE_CHECK(m.tag == tag && int64_t(m.data.size()) == n, "recv on rank 0 from rank 0: expected tag ", tag, " with ",
              n, " elements, got tag ", m.tag, " with ", m.data.size(), ": the ranks run different schedules");
    std::copy(m.data.begin(), m.data.end(), data);
  }
  std::unique_ptr<Comm> split(int, int) override { return std::make_unique<SelfComm>(timeout_s_); }
  [[noreturn]] void abort(int code) override { flush_and_exit(code); }

 private:
  struct Message {
    int tag = 0;
    std::vector<float> data;
  };
  std::deque<Message> queue_;
  static void check_count(int64_t n, const char* what) {
    MOE_CHECK(n >= 0, what, ": element count must be >= 0, got ", n);
  }
  template <typename T>
  static void copy(const T* send, T* recv, int64_t n, const char* what) {
    check_count(n, what);
    if (n > 0 && send != recv) std::memmove(recv, send, size_t(n) * sizeof(T));
  }
  static void check_root(int64_t n, int root) {
    check_count(n, "broadcast");
    MOE_CHECK(root == 0, "broadcast root ", root, " is not a rank of a one-rank group");
  }
};

}  // namespace

[[noreturn]] void flush_and_exit(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code == 0 ? 1 : code);
}

std::unique_ptr<Comm> make_self_comm(double timeout_s) { return std::make_unique<SelfComm>(timeout_s); }

std::unique_ptr<Comm> make_self_comm() { return std::make_unique<SelfComm>(kDefaultCommTimeoutS); }

}  // namespace moe
