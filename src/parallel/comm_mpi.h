// The MPI world for world_comm() (comm.h): MPI initialised on first use, MPI_COMM_WORLD as a
// Comm. Declared without MPI headers: only comm_mpi.cpp sees mpi.h.
#pragma once

#include <memory>

#include "parallel/comm.h"

namespace moe {

// Initialises MPI (MPI_THREAD_FUNNELED; finalised at exit) and returns the world communicator,
// backend() "mpi", with the given timeout_s(). Under Slurm alone (no mpirun or PMI variables) a
// world that does not hold SLURM_NTASKS ranks (srun without an MPI plugin) prints the fix and
// aborts the job. Throws when MPI_Init_thread fails.
std::unique_ptr<Comm> make_mpi_world(double timeout_s);

}  // namespace moe
