// MOE_HOST_DEVICE: a small inline function the CPU code and the CUDA kernels share (marked
// __host__ __device__ when nvcc compiles it, plain inline otherwise).
#pragma once

#if defined(__CUDACC__)
#define MOE_HOST_DEVICE __host__ __device__
#else
#define MOE_HOST_DEVICE
#endif
