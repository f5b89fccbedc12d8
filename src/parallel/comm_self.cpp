// The one-rank communicator of parallel/comm_self.h: collectives check their counts and root
// and copy send to recv where the call has both (memmove: the buffers may overlap).
#include "parallel/comm_self.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

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
  std::unique_ptr<Comm> split(int, int) override { return std::make_unique<SelfComm>(timeout_s_); }
  [[noreturn]] void abort(int code) override { flush_and_exit(code); }

 private:
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
