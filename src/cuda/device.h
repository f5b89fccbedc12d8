// CUDA facts that code without CUDA headers may use: the stream type the entry points take
// and a device count. `Stream` is the same type as cudaStream_t (CUstream_st*); nullptr is
// the legacy default stream. Nothing here throws when there is no driver or no GPU.
#pragma once

struct CUstream_st;

namespace moe::cuda {

using Stream = CUstream_st*;

// Number of CUDA devices this process can use; 0 when there is no driver, no GPU, or the
// runtime reports any error (never throws). Tests skip GPU work when this is 0.
int cuda_device_count();

}  // namespace moe::cuda
