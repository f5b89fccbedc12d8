// Communicators: a group of ranks and the collectives the trainer needs, on host buffers.
// Comm is the interface; world_comm() returns the MPI world when the process was started
// by mpirun/srun (an MPI launcher's environment), a TCP world (comm_tcp.h) under a torchrun-style
// launch (RANK, WORLD_SIZE > 1, MASTER_ADDR, MASTER_PORT) and a one-rank communicator otherwise. Every
// collective is blocking and called by every rank of the group in the same order. Counts are in
// elements. A collective that does not complete within timeout_s() throws an Error naming the
// collective, the rank and the group size.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace moe {

enum class ReduceOp { kSum, kMax };

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "mpi", "tcp" or "self".
  virtual std::string backend() const = 0;

  // In place over `n` elements.
  virtual void all_reduce(float* data, int64_t n, ReduceOp op) = 0;
  virtual void all_reduce(double* data, int64_t n, ReduceOp op) = 0;
  virtual void all_reduce(int64_t* data, int64_t n, ReduceOp op) = 0;
  // send: size() * count elements; rank r receives the sum of every rank's block r in recv[count].
  virtual void reduce_scatter(const float* send, float* recv, int64_t count) = 0;
  // send[count] from every rank; recv: size() * count elements, rank r's block at r * count.
  virtual void all_gather(const float* send, float* recv, int64_t count) = 0;
  virtual void all_gather(const int64_t* send, int64_t* recv, int64_t count) = 0;
  // send holds size() blocks, block p (send_counts[p] elements) going to rank p, packed in rank
  // order; recv receives recv_counts[p] elements from rank p, packed in rank order.
  virtual void all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                            const int64_t* recv_counts) = 0;
  // Fixed-size exchange: `count` elements to and from every rank (e.g. per-expert counts).
  virtual void all_to_all(const int64_t* send, int64_t* recv, int64_t count) = 0;
  virtual void broadcast(float* data, int64_t n, int root) = 0;
  virtual void broadcast(int64_t* data, int64_t n, int root) = 0;
  virtual void barrier() = 0;
  // Point-to-point, for pipeline stages (not collective: only the two ranks take part). send
  // hands n floats to group rank `dst` under `tag` (0 <= tag <= kMaxTag) and returns without
  // waiting for the receiver (the data is copied). recv waits, up to timeout_s(), for the next
  // message from `src` and throws an Error naming both ranks when its tag or element count is not
  // the expected one (the two ranks run different schedules) or when it does not arrive. Messages
  // of a pair of ranks arrive in send order. flush_sends waits until every send of this rank was
  // delivered. MPI, TCP (a per-peer outgoing queue, parallel/tcp/mesh.h) and the one-rank
  // communicator implement them; others (test communicators) throw naming their backend.
  static constexpr int kMaxTag = 32767;
  virtual void send(const float* data, int64_t n, int dst, int tag);
  virtual void recv(float* data, int64_t n, int src, int tag);
  virtual void flush_sends() {}
  // Ranks with equal color form a new group, ordered by key (MPI_Comm_split semantics). The
  // new group inherits timeout_s().
  virtual std::unique_ptr<Comm> split(int color, int key) = 0;
  // Ends every process of the job with a non-zero status (MPI_Abort); never returns.
  [[noreturn]] virtual void abort(int code) = 0;

  double timeout_s() const { return timeout_s_; }
  void set_timeout_s(double s) { timeout_s_ = s; }

 protected:
  double timeout_s_ = 300.0;
};

// Seconds a collective may wait before it fails, when neither the config (parallel.timeout_s)
// nor the environment (MOECORE_COMM_TIMEOUT_S) says otherwise.
inline constexpr double kDefaultCommTimeoutS = 300.0;

// The communicator every rank of this process's job shares (one-rank when not launched in
// parallel). Initialises MPI on first use when an MPI launcher started the process; finalised at
// exit. Under a torchrun-style launch without an MPI launcher it joins the TCP rendezvous at
// MASTER_ADDR (default 127.0.0.1):MASTER_PORT (throws naming MASTER_PORT when it is missing or not
// a port). Its timeout_s() starts at MOECORE_COMM_TIMEOUT_S when that is set.
Comm& world_comm();
// True once world_comm() has been created (main uses it to decide how to fail).
bool world_comm_started();
// A standalone one-rank communicator (tests, single-process tools).
std::unique_ptr<Comm> make_self_comm();

// Which launcher the environment `getenv` describes: "mpi" (OMPI_COMM_WORLD_SIZE, PMI_SIZE /
// PMI_RANK, PMIX_RANK, or SLURM_PROCID with SLURM_NTASKS > 1), "torchrun" (RANK and WORLD_SIZE
// > 1 without an MPI launcher) or "none". Exposed for tests.
std::string detect_launcher(const std::function<const char*(const char*)>& getenv_fn);

}  // namespace moe
