// The communicator over MPI. Every collective is started with its non-blocking call
// (MPI_Iallreduce, MPI_Ireduce_scatter_block, MPI_Iallgather, MPI_Ialltoallv, MPI_Ibcast,
// MPI_Ibarrier) and completed by polling MPI_Test against a deadline of timeout_s(), so a dead or
// stuck peer turns into an Error (collective, rank, group size) instead of a hang. Reductions and
// broadcasts over more than INT_MAX elements run in chunks; the block-structured collectives
// refuse per-rank counts above INT_MAX.
#include "parallel/comm_mpi.h"

#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "parallel/comm_self.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kMaxMpiCount = INT_MAX;

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf, size_t(len));
}

#define MOE_MPI_CHECK(call, what)                                                                  \
  do {                                                                                             \
    const int moe_mpi_rc_ = (call);                                                                \
    MOE_CHECK(moe_mpi_rc_ == MPI_SUCCESS, what, " failed on rank ", rank_, " of ", size_, ": ", \
              mpi_error_string(moe_mpi_rc_));                                                      \
  } while (0)

template <typename T>
MPI_Datatype mpi_type();
template <>
MPI_Datatype mpi_type<float>() { return MPI_FLOAT; }
template <>
MPI_Datatype mpi_type<double>() { return MPI_DOUBLE; }
template <>
MPI_Datatype mpi_type<int64_t>() { return MPI_INT64_T; }

MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::kSum ? MPI_SUM : MPI_MAX; }

class MpiComm final : public Comm {
 public:
  MpiComm(MPI_Comm comm, bool owned, double timeout_s) : comm_(comm), owned_(owned) {
    timeout_s_ = timeout_s;
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    // Errors come back as codes (turned into moe::Error) instead of aborting inside MPI.
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  }
  ~MpiComm() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned_ && !finalized) MPI_Comm_free(&comm_);
  }
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  void all_reduce(float* data, int64_t n, ReduceOp op) override { all_reduce_t(data, n, op); }
  void all_reduce(double* data, int64_t n, ReduceOp op) override { all_reduce_t(data, n, op); }
  void all_reduce(int64_t* data, int64_t n, ReduceOp op) override { all_reduce_t(data, n, op); }

  void reduce_scatter(const float* send, float* recv, int64_t count) override {
    check_block_count(count, "reduce_scatter");
    MPI_Request req;
    MOE_MPI_CHECK(MPI_Ireduce_scatter_block(send, recv, int(count), MPI_FLOAT, MPI_SUM, comm_, &req),
                  "MPI_Ireduce_scatter_block");
    wait(req, "reduce_scatter", count);
  }
  void all_gather(const float* send, float* recv, int64_t count) override { all_gather_t(send, recv, count); }
  void all_gather(const int64_t* send, int64_t* recv, int64_t count) override { all_gather_t(send, recv, count); }

  void all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                    const int64_t* recv_counts) override {
    const size_t np = static_cast<size_t>(size_);
    std::vector<int> sc(np), sd(np), rc(np), rd(np);
    int64_t soff = 0, roff = 0;
    for (int p = 0; p < size_; ++p) {
      MOE_CHECK(send_counts[p] >= 0 && recv_counts[p] >= 0, "all_to_all_v on rank ", rank_, ": counts for rank ", p,
                " must be >= 0, got send ", send_counts[p], ", receive ", recv_counts[p]);
      MOE_CHECK(soff <= kMaxMpiCount && roff <= kMaxMpiCount && send_counts[p] <= kMaxMpiCount &&
                    recv_counts[p] <= kMaxMpiCount,
                "all_to_all_v on rank ", rank_, " of ", size_, ": counts or offsets above INT_MAX (", kMaxMpiCount,
                ") elements (send offset ", soff, ", receive offset ", roff,
                "); one MPI call cannot address them: exchange smaller blocks");
      sc[p] = int(send_counts[p]);
      rc[p] = int(recv_counts[p]);
      sd[p] = int(soff);
      rd[p] = int(roff);
      soff += send_counts[p];
      roff += recv_counts[p];
    }
    MPI_Request req;
    MOE_MPI_CHECK(MPI_Ialltoallv(send, sc.data(), sd.data(), MPI_FLOAT, recv, rc.data(), rd.data(), MPI_FLOAT,
                                 comm_, &req),
                  "MPI_Ialltoallv");
    wait(req, "all_to_all_v", soff);
  }

  void all_to_all(const int64_t* send, int64_t* recv, int64_t count) override {
    check_block_count(count, "all_to_all");
    MPI_Request req;
    MOE_MPI_CHECK(MPI_Ialltoall(send, int(count), MPI_INT64_T, recv, int(count), MPI_INT64_T, comm_, &req),
                  "MPI_Ialltoall");
    wait(req, "all_to_all", count);
  }

  void broadcast(float* data, int64_t n, int root) override { broadcast_t(data, n, root); }
  void broadcast(int64_t* data, int64_t n, int root) override { broadcast_t(data, n, root); }

  void barrier() override {
    MPI_Request req;
    MOE_MPI_CHECK(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier");
    wait(req, "barrier", 0);
  }

  void send(const float* data, int64_t n, int dst, int tag) override {
    check_block_count(n, "send");
    MOE_CHECK(dst >= 0 && dst < size_, "send on rank ", rank_, ": rank ", dst, " is not in this group of ", size_);
    MOE_CHECK(tag >= 0 && tag <= kMaxTag, "send on rank ", rank_, ": tag ", tag, " must be in [0, ", kMaxTag, "]");
    progress_sends();
    pending_.push_back({std::vector<float>(data, data + n), MPI_REQUEST_NULL, dst, tag});
    PendingSend& p = pending_.back();
    MOE_MPI_CHECK(MPI_Isend(p.data.data(), int(n), MPI_FLOAT, dst, tag, comm_, &p.req), "MPI_Isend");
  }

  // Probes for the next message from src (any tag), checks its tag and count, then receives it.
  void recv(float* data, int64_t n, int src, int tag) override {
    check_block_count(n, "recv");
    MOE_CHECK(src >= 0 && src < size_, "recv on rank ", rank_, ": rank ", src, " is not in this group of ", size_);
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s_));
    auto pause = std::chrono::microseconds(2);
    int64_t polls = 0;
    MPI_Message msg;
    MPI_Status status;
    for (;;) {
      int found = 0;
      MOE_MPI_CHECK(MPI_Improbe(src, MPI_ANY_TAG, comm_, &found, &msg, &status), "MPI_Improbe");
      if (found) break;
      progress_sends();
      if (++polls < 64) continue;
      MOE_CHECK(Clock::now() <= deadline, "recv on rank ", rank_, " of a group of ", size_, " from rank ", src,
                " (tag ", tag, ", ", n, " elements) timed out after ", timeout_s_, " s: rank ", src,
                " died, hangs, or runs another schedule; the limit is parallel.timeout_s (or MOECORE_COMM_TIMEOUT_S)");
      std::this_thread::sleep_for(pause);
      if (pause < std::chrono::microseconds(1000)) pause *= 2;
    }
    int count = 0;
    MPI_Get_count(&status, MPI_FLOAT, &count);
    if (status.MPI_TAG != tag || int64_t(count) != n) {
      std::vector<float> drop(size_t(std::max(count, 0)));
      MPI_Mrecv(drop.data(), count, MPI_FLOAT, &msg, MPI_STATUS_IGNORE);
      MOE_FAIL("recv on rank ", rank_, " of a group of ", size_, " from rank ", src, ": expected tag ", tag, " with ",
               n, " elements, got tag ", status.MPI_TAG, " with ", count,
               ": the two ranks run different pipeline schedules (or layouts)");
    }
    MOE_MPI_CHECK(MPI_Mrecv(data, int(n), MPI_FLOAT, &msg, MPI_STATUS_IGNORE), "MPI_Mrecv");
  }

  void flush_sends() override {
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s_));
    while (!pending_.empty()) {
      progress_sends();
      if (pending_.empty()) break;
      MOE_CHECK(Clock::now() <= deadline, "send on rank ", rank_, " of a group of ", size_, " to rank ",
                pending_.front().dst, " (tag ", pending_.front().tag, ") was not received within ", timeout_s_,
                " s: rank ", pending_.front().dst, " died, hangs, or runs another schedule");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  std::unique_ptr<Comm> split(int color, int key) override {
    MOE_CHECK(color >= 0, "split: color must be >= 0, got ", color, " on rank ", rank_);
    // MPI_Comm_split has no non-blocking form: agree on the call first under the deadline.
    barrier();
    MPI_Comm out;
    MOE_MPI_CHECK(MPI_Comm_split(comm_, color, key, &out), "MPI_Comm_split");
    return std::make_unique<MpiComm>(out, /*owned=*/true, timeout_s_);
  }

  [[noreturn]] void abort(int code) override {
    std::fflush(stdout);
    std::fflush(stderr);
    MPI_Abort(comm_, code == 0 ? 1 : code);
    flush_and_exit(code);
  }

 private:
  template <typename T>
  void all_reduce_t(T* data, int64_t n, ReduceOp op) {
    MOE_CHECK(n >= 0, "all_reduce: element count must be >= 0, got ", n);
    for (int64_t done = 0; done < n; done += kMaxMpiCount) {  // chunks of at most INT_MAX
      const int64_t c = std::min<int64_t>(kMaxMpiCount, n - done);
      MPI_Request req;
      MOE_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, data + done, int(c), mpi_type<T>(), mpi_op(op), comm_, &req),
                    "MPI_Iallreduce");
      wait(req, op == ReduceOp::kSum ? "all_reduce(sum)" : "all_reduce(max)", c);
    }
  }

  template <typename T>
  void all_gather_t(const T* send, T* recv, int64_t count) {
    check_block_count(count, "all_gather");
    MPI_Request req;
    MOE_MPI_CHECK(MPI_Iallgather(send == recv + int64_t(rank_) * count ? MPI_IN_PLACE : send, int(count),
                                 mpi_type<T>(), recv, int(count), mpi_type<T>(), comm_, &req),
                  "MPI_Iallgather");
    wait(req, "all_gather", count);
  }

  template <typename T>
  void broadcast_t(T* data, int64_t n, int root) {
    MOE_CHECK(n >= 0, "broadcast: element count must be >= 0, got ", n);
    MOE_CHECK(root >= 0 && root < size_, "broadcast root ", root, " is not a rank of this group of ", size_);
    for (int64_t done = 0; done < n; done += kMaxMpiCount) {  // chunks of at most INT_MAX
      const int64_t c = std::min<int64_t>(kMaxMpiCount, n - done);
      MPI_Request req;
      MOE_MPI_CHECK(MPI_Ibcast(data + done, int(c), mpi_type<T>(), root, comm_, &req), "MPI_Ibcast");
      wait(req, "broadcast", c);
    }
  }

  void check_block_count(int64_t count, const char* what) const {
    MOE_CHECK(count >= 0, what, ": element count must be >= 0, got ", count);
    MOE_CHECK(count <= kMaxMpiCount, what, " on rank ", rank_, " of ", size_, ": ", count,
              " elements per rank exceed INT_MAX (", kMaxMpiCount,
              "), the most one MPI call can address; split the buffer");
  }

  // Polls the request until it completes or the deadline passes. Spins briefly, then sleeps
  // with a growing pause (up to 1 ms) so that oversubscribed ranks leave the core to peers.
  void wait(MPI_Request& req, const char* what, int64_t count) {
    const auto start = Clock::now();
    const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s_));
    int64_t polls = 0;
    auto pause = std::chrono::microseconds(2);
    for (;;) {
      int done = 0;
      MOE_MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (done) return;
      if (++polls < 64) continue;
      if (Clock::now() > deadline) {
        MOE_FAIL("collective ", what, " (", count, " elements) timed out after ", timeout_s_, " s on rank ", rank_,
                 " of a group of ", size_,
                 ": another rank died, hangs, or called a different collective; the limit is parallel.timeout_s "
                 "(or MOECORE_COMM_TIMEOUT_S)");
      }
      std::this_thread::sleep_for(pause);
      if (pause < std::chrono::microseconds(1000)) pause *= 2;
    }
  }

  // Sends in flight: their copy of the data stays alive until MPI_Test says they completed.
  struct PendingSend {
    std::vector<float> data;
    MPI_Request req;
    int dst = 0, tag = 0;
  };
  void progress_sends() {
    while (!pending_.empty()) {
      int done = 0;
      MOE_MPI_CHECK(MPI_Test(&pending_.front().req, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (!done) return;
      pending_.pop_front();
    }
  }
  std::deque<PendingSend> pending_;

  MPI_Comm comm_;
  bool owned_;
  int rank_ = 0, size_ = 1;
};

long env_long(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtol(v, nullptr, 10) : 0;
}

void finalize_mpi() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) MPI_Finalize();
}

}  // namespace

std::unique_ptr<Comm> make_mpi_world(double timeout_s) {
  int provided = 0;
  MOE_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) == MPI_SUCCESS,
            "MPI_Init_thread failed: the MPI launcher's environment is set but MPI could not start");
  std::atexit(finalize_mpi);
  auto world = std::make_unique<MpiComm>(MPI_COMM_WORLD, /*owned=*/false, timeout_s);
  const long slurm_tasks = env_long("SLURM_NTASKS");
  const bool slurm_only = std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr && std::getenv("PMI_SIZE") == nullptr &&
                          std::getenv("PMIX_RANK") == nullptr;
  if (slurm_only && slurm_tasks > 1 && world->size() != slurm_tasks) {
    std::fprintf(stderr,
                 "error: Slurm started %ld tasks but MPI sees a world of %d: srun did not connect the ranks "
                 "(try `srun --mpi=pmix` or mpirun)\n",
                 slurm_tasks, world->size());
    world->abort(1);
  }
  return world;
}

}  // namespace moe
