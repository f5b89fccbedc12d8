// The one-rank communicator: every collective is a copy (or nothing) on this rank's buffers,
// with the argument checks of the other backends; split gives another one-rank group and abort
// flushes and ends the process. world_comm() returns one when no launcher started the process;
// tests and single-process tools make their own (make_self_comm, comm.h).
#pragma once

#include <memory>

#include "parallel/comm.h"

namespace moe {

// A one-rank communicator with the given timeout_s() (its collectives never wait).
std::unique_ptr<Comm> make_self_comm(double timeout_s);

// Flushes stdout and stderr and ends this process at once with `code` (1 when code is 0): the
// abort of a one-rank job, and the MPI communicator's last resort after MPI_Abort.
[[noreturn]] void flush_and_exit(int code);

}  // namespace moe
