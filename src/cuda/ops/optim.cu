// Optimizer launchers and checked entry points. global_grad_norm: min(1024, ceil(n / 16384))
// blocks write FP64 partials into the workspace, one block reduces them into *norm (or, for
// grad_sum_squares, *sum without the root). adamw_step:
// adamw_prepare_step (one thread) then adamw_update_segments over the 4096-element chunks the
// segments touch (ParamSegmentTable's chunk runs); the
// float4 path when every FP32 buffer is 16-byte and the BF16 copy 8-byte aligned.
#include "cuda/ops/optim.h"

#include <algorithm>
#include <limits>
#include <type_traits>
#include <utility>

#include "core/arena.h"
#include "core/chunk_runs.h"
#include "core/config.h"
#include "cuda/common.h"
#include "cuda/kernels/optim.cuh"
#include "cuda/kernels/optim_fp8.cuh"
#include "cuda/kernels/optim_resident.cuh"
#include "cuda/ops/launch.h"

namespace moe::cuda {

namespace {

using kernels::kAdamWChunk;
using kernels::kAdamWThreads;
using kernels::kNormThreads;

int norm_blocks(int64_t n) {
  return static_cast<int>(
      std::clamp<int64_t>((n + kernels::kNormBlockElems - 1) / kernels::kNormBlockElems, 1, kernels::kNormMaxBlocks));
}

bool aligned_to(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

size_t global_grad_norm_workspace_bytes(int64_t n) {
  MOE_CHECK(n >= 0, "cuda::global_grad_norm_workspace_bytes: expected n >= 0, got ", n);
  return n == 0 ? 0 : static_cast<size_t>(norm_blocks(n)) * sizeof(double);
}

namespace {

// The sum of squares of grads[0, n) in FP64, by block partials then one block: its square root
// (root: global_grad_norm) or the sum itself (grad_sum_squares) into *out.
void sum_of_squares(const char* op, const float* grads, int64_t n, double* out, bool root, void* workspace,
                    size_t workspace_bytes, Stream stream) {
  MOE_CHECK(n >= 0, op, ": expected n >= 0, got n=", n);
  detail::check_ptrs(op, {{root ? "norm" : "sum", out}}, sizeof(double));
  if (n == 0) {
    MOE_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), stream));  // FP64 +0.0 is all zero bytes
    return;
  }
  detail::check_ptrs(op, {{"grads", grads}}, sizeof(float));
  detail::check_ptrs(op, {{"workspace", workspace}}, sizeof(double));
  const size_t need = global_grad_norm_workspace_bytes(n);
  MOE_CHECK(workspace_bytes >= need, op, ": workspace of ", workspace_bytes, " bytes is too small, need ", need,
            " (global_grad_norm_workspace_bytes(", n, "))");
  double* partials = static_cast<double*>(workspace);
  const int blocks = norm_blocks(n);
  if (detail::aligned16(grads)) {
    kernels::grad_sum_squares_block_partials<true><<<blocks, kNormThreads, 0, stream>>>(grads, n, partials);
  } else {
    kernels::grad_sum_squares_block_partials<false><<<blocks, kNormThreads, 0, stream>>>(grads, n, partials);
  }
  check_launch("grad_sum_squares_block_partials");
  if (root) {
    kernels::grad_norm_from_partials<<<1, kNormThreads, 0, stream>>>(partials, blocks, out);
    check_launch("grad_norm_from_partials");
  } else {
    kernels::grad_sum_from_partials<<<1, kNormThreads, 0, stream>>>(partials, blocks, out);
    check_launch("grad_sum_from_partials");
  }
}

}  // namespace

void global_grad_norm(const float* grads, int64_t n, double* norm, void* workspace, size_t workspace_bytes,
                      Stream stream) {
  sum_of_squares("cuda::global_grad_norm", grads, n, norm, true, workspace, workspace_bytes, stream);
}

void grad_sum_squares(const float* grads, int64_t n, double* sum, void* workspace, size_t workspace_bytes,
                      Stream stream) {
  sum_of_squares("cuda::grad_sum_squares", grads, n, sum, false, workspace, workspace_bytes, stream);
}

void sum_f64(const double* values, int64_t n, double* sum, void* workspace, size_t workspace_bytes, Stream stream) {
  const char* op = "cuda::sum_f64";
  MOE_CHECK(n >= 0, op, ": expected n >= 0, got n=", n);
  detail::check_ptrs(op, {{"sum", sum}}, sizeof(double));
  if (n == 0) {
    MOE_CUDA_CHECK(cudaMemsetAsync(sum, 0, sizeof(double), stream));  // FP64 +0.0 is all zero bytes
    return;
  }
  detail::check_ptrs(op, {{"values", values}, {"workspace", workspace}}, sizeof(double));
  const size_t need = global_grad_norm_workspace_bytes(n);
  MOE_CHECK(workspace_bytes >= need, op, ": workspace of ", workspace_bytes, " bytes is too small, need ", need,
            " (global_grad_norm_workspace_bytes(", n, "))");
  double* partials = static_cast<double*>(workspace);
  const int blocks = norm_blocks(n);
  kernels::f64_sum_block_partials<<<blocks, kNormThreads, 0, stream>>>(values, n, partials);
  check_launch("f64_sum_block_partials");
  kernels::grad_sum_from_partials<<<1, kNormThreads, 0, stream>>>(partials, blocks, sum);
  check_launch("grad_sum_from_partials");
}

ParamSegmentTable::ParamSegmentTable(const ParamLayout& layout)
    : ParamSegmentTable(
          [&layout] {
            std::vector<ParamSegment> segs;
            segs.reserve(layout.entries().size());
            for (const ParamEntry& e : layout.entries()) segs.push_back({e.offset, e.numel, e.decay ? 1 : 0, 0});
            return segs;
          }(),
          layout.total_numel()) {}

ParamSegmentTable::ParamSegmentTable(std::vector<ParamSegment> segments, int64_t total_numel, int64_t state_numel)
    : host_(std::move(segments)), total_numel_(total_numel), state_numel_(state_numel < 0 ? total_numel : state_numel) {
  const char* what = "cuda::ParamSegmentTable";
  MOE_CHECK(total_numel_ >= 0, what, ": expected total_numel >= 0, got ", total_numel_);
  for (ParamSegment& s : host_)
    if (s.state_offset == -1) s.state_offset = s.offset;
  MOE_CHECK(host_.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()), what, ": ", host_.size(),
            " segments exceed 2^31 - 1");
  int64_t prev_end = 0;
  for (size_t i = 0; i < host_.size(); ++i) {
    const ParamSegment& s = host_[i];
    MOE_CHECK(s.offset >= 0 && s.numel >= 0 && s.offset <= total_numel_ - s.numel, what, ": segment ", i,
              " (offset ", s.offset, ", numel ", s.numel, ") is outside the flat buffer of ", total_numel_,
              " elements");
    MOE_CHECK(s.offset >= prev_end, what, ": segment ", i, " starts at ", s.offset,
              " inside the previous one (ending at ", prev_end, "): segments must be sorted and disjoint");
    MOE_CHECK(s.decay == 0 || s.decay == 1, what, ": segment ", i, " has decay ", s.decay, ", expected 0 or 1");
    MOE_CHECK(s.state_offset >= 0 && s.state_offset <= state_numel_ - s.numel, what, ": segment ", i,
              " keeps its moments at ", s.state_offset, " (", s.numel, " elements), outside the moment buffers of ",
              state_numel_, " elements");
    prev_end = s.offset + s.numel;
    if ((s.state_offset - s.offset) % 4 != 0) states_vec4_ = false;
    if (s.state_offset != s.offset) states_at_offsets_ = false;
  }
  // Moment ranges pairwise disjoint (sorted copies: a segment's moments are written by it alone).
  std::vector<std::pair<int64_t, int64_t>> states;
  for (const ParamSegment& s : host_) states.emplace_back(s.state_offset, s.state_offset + s.numel);
  std::sort(states.begin(), states.end());
  for (size_t i = 1; i < states.size(); ++i)
    MOE_CHECK(states[i].first >= states[i - 1].second, what, ": two segments share moments at ", states[i].first,
              ": every segment needs its own moment range");
  runs_ = chunk_runs(host_, kAdamWChunk, &num_chunks_);
  MOE_CHECK(runs_.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()), what, ": ", runs_.size(),
            " chunk runs exceed 2^31 - 1");
  if (!host_.empty()) {
    const size_t seg_bytes = host_.size() * sizeof(ParamSegment), run_bytes = runs_.size() * sizeof(ChunkRun);
    void* mem = nullptr;
    MOE_CUDA_CHECK(cudaMalloc(&mem, seg_bytes + run_bytes));
    device_ = static_cast<ParamSegment*>(mem);
    device_runs_ = reinterpret_cast<ChunkRun*>(static_cast<char*>(mem) + seg_bytes);  // 32-byte multiple
    cudaError_t err = cudaMemcpy(device_, host_.data(), seg_bytes, cudaMemcpyHostToDevice);
    if (err == cudaSuccess && run_bytes > 0)
      err = cudaMemcpy(device_runs_, runs_.data(), run_bytes, cudaMemcpyHostToDevice);
    if (err != cudaSuccess) {
      cudaFree(device_);
      device_ = nullptr;
      MOE_CUDA_CHECK(err);
    }
  }
}

ParamSegmentTable::~ParamSegmentTable() {
  if (device_) cudaFree(device_);
}

namespace {

void check_betas(const char* op, const OptimConfig& cfg) {
  MOE_CHECK(cfg.beta1 >= 0.0 && cfg.beta1 < 1.0 && cfg.beta2 >= 0.0 && cfg.beta2 < 1.0, op,
            ": expected beta1, beta2 in [0, 1), got beta1=", cfg.beta1, " beta2=", cfg.beta2);
  MOE_CHECK(cfg.eps >= 0.0, op, ": expected eps >= 0, got ", cfg.eps);
}

kernels::AdamWConstants adamw_constants(const OptimConfig& cfg) {
  kernels::AdamWConstants c{};
  c.beta1 = cfg.beta1;
  c.beta2 = cfg.beta2;
  c.weight_decay = cfg.weight_decay;
  c.grad_clip = cfg.grad_clip;
  c.b1 = static_cast<float>(cfg.beta1);
  c.b2 = static_cast<float>(cfg.beta2);
  c.one_minus_b1 = 1.0f - c.b1;
  c.one_minus_b2 = 1.0f - c.b2;
  c.eps = static_cast<float>(cfg.eps);
  return c;
}

// Dynamic shared memory (at least `need` bytes) that keeps `kernel`'s blocks of `threads` one to
// a multiprocessor (checked by the occupancy calculator), after allowing it.
template <typename Kernel>
size_t resident_smem_bytes(Kernel kernel, int threads, size_t need = 0) {
  int device = 0, per_sm = 0, per_block = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const size_t smem = std::max(need, std::min<size_t>(size_t(per_block), size_t(per_sm) / 2 + 1024));
  MOE_CHECK(smem <= size_t(per_block), "cuda::adamw_apply: the update on a few multiprocessors needs ", smem,
            " bytes of shared memory a block, device ", device, " has ", per_block);
  set_dynamic_smem_limit(kernel, smem);
  int blocks = 0;
  MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem));
  MOE_CHECK(blocks == 1, "cuda::adamw_apply: ", blocks, " blocks of the update with ", smem,
            " bytes of shared memory fit on a multiprocessor of device ", device, ", expected exactly 1");
  return smem;
}

}  // namespace

void adamw_prepare(const OptimConfig& cfg, OptimStepScalars* scalars, Stream stream) {
  const char* op = "cuda::adamw_prepare";
  check_betas(op, cfg);
  detail::check_ptrs(op, {{"scalars", scalars}}, alignof(OptimStepScalars));
  kernels::adamw_prepare_step<<<1, 1, 0, stream>>>(scalars, adamw_constants(cfg));
  check_launch("adamw_prepare_step");
}

namespace {

// The moments' type the config asks for must be the one the buffers hold.
template <typename M>
void check_moment_type(const char* op, const OptimConfig& cfg) {
  constexpr bool bf16 = std::is_same_v<M, uint16_t>;
  MOE_CHECK(cfg.moment_dtype == (bf16 ? "bf16" : "fp32"), op, ": optim.moment_dtype is '", cfg.moment_dtype,
            "' but the moment buffers given hold ", bf16 ? "BF16" : "FP32", " values");
}

}  // namespace

template <typename M>
void adamw_apply(const ParamSegmentTable& segments, const OptimConfig& cfg, float* params, const float* grads,
                 M* exp_avg, M* exp_avg_sq, uint16_t* params_bf16, const OptimStepScalars* scalars, bool deferred,
                 Stream stream, int sms) {
  const char* op = "cuda::adamw_apply";
  check_betas(op, cfg);
  check_moment_type<M>(op, cfg);
  MOE_CHECK(sms >= 0, op, ": expected sms >= 0 (0: every multiprocessor), got ", sms);
  detail::check_ptrs(op, {{"scalars", scalars}}, alignof(OptimStepScalars));
  const int64_t total = segments.total_numel();
  const std::vector<ParamSegment>& host = segments.segments();
  const int num_segs = static_cast<int>(host.size());
  if (total == 0 || num_segs == 0) return;
  detail::check_ptrs(op, {{"params", params}, {"grads", grads}}, sizeof(float));
  detail::check_ptrs(op, {{"exp_avg", exp_avg}, {"exp_avg_sq", exp_avg_sq}}, sizeof(M));
  if (params_bf16 != nullptr) detail::check_ptrs(op, {{"params_bf16", params_bf16}}, 2);
  // Only the chunks the segments touch (a group's table covers part of the flat buffers, the FP8
  // step's table leaves out the experts' weights between the other tensors of each layer).
  const int64_t chunks = segments.num_chunks();
  if (chunks == 0) return;
  const bool vec4 = segments.states_vec4() && detail::aligned16(params) && detail::aligned16(grads) &&
                    aligned_to(exp_avg, 4 * sizeof(M)) && aligned_to(exp_avg_sq, 4 * sizeof(M)) &&
                    (params_bf16 == nullptr || aligned_to(params_bf16, 8));
  if (sms > 0) {
    // One block on each of `sms` multiprocessors: its chunks streamed through shared memory by
    // bulk copies (optim_resident.cuh) where the moments sit at the flat offsets, else plain loads
    // by kAdamWResidentThreads (the dynamic shared memory, unused there, is more than half a
    // multiprocessor's, so no two blocks share one either way).
    // Bulk copies move whole 16-byte units from 16-byte aligned addresses: BF16 moments need the
    // buffers 16-byte aligned and total a multiple of 8.
    constexpr int64_t kPerUnit = 16 / int64_t(sizeof(M));
    const bool ring = vec4 && segments.states_at_offsets() && total % kPerUnit == 0 && detail::aligned16(exp_avg) &&
                      detail::aligned16(exp_avg_sq);
    const auto kernel = ring   ? kernels::adamw_update_resident<M>
                        : vec4 ? kernels::adamw_update_segments<true, M, kernels::kAdamWResidentThreads>
                               : kernels::adamw_update_segments<false, M, kernels::kAdamWResidentThreads>;
    const int threads = ring ? kernels::kAdamWRingThreads : kernels::kAdamWResidentThreads;
    const size_t smem = resident_smem_bytes(kernel, threads, ring ? size_t(kernels::kAdamWResidentSmemBytes) : 0);
    // At the device's greatest priority (a launch attribute, so a captured graph keeps it): when a
    // multiprocessor frees up, the update's pending blocks are placed before the forward's
    // attention and memory-bound blocks, which are not held to the reserve.
    int least = 0, greatest = 0;
    MOE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributePriority;
    attr[0].val.priority = greatest;
    cudaLaunchConfig_t launch{};
    launch.gridDim = dim3(static_cast<unsigned>(std::min<int64_t>(chunks, sms)));
    launch.blockDim = dim3(static_cast<unsigned>(threads));
    launch.dynamicSmemBytes = smem;
    launch.stream = stream;
    launch.attrs = attr;
    launch.numAttrs = 1;
    MOE_CUDA_CHECK(cudaLaunchKernelEx(&launch, kernel, segments.device_segments(), num_segs,
                                      segments.device_chunk_runs(), segments.num_chunk_runs(), chunks, total, params,
                                      grads, exp_avg, exp_avg_sq, params_bf16, scalars, adamw_constants(cfg), deferred));
    check_launch(ring ? "adamw_update_resident" : "adamw_update_segments (resident)");
    return;
  }
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(chunks, detail::kMaxGridX));
  const auto kernel = vec4 ? kernels::adamw_update_segments<true, M> : kernels::adamw_update_segments<false, M>;
  kernel<<<blocks, kAdamWThreads, 0, stream>>>(segments.device_segments(), num_segs, segments.device_chunk_runs(),
                                               segments.num_chunk_runs(), chunks, total, params, grads, exp_avg,
                                               exp_avg_sq, params_bf16, scalars, adamw_constants(cfg), deferred);
  check_launch("adamw_update_segments");
}

template <typename M>
void adamw_apply_fp8_weights(const ParamSegment& segment, int64_t experts, int64_t n, int64_t k,
                             const OptimConfig& cfg, float* params, const float* grads, M* exp_avg, M* exp_avg_sq,
                             uint16_t* params_bf16, Fp8Format f, uint8_t* q, float* s, uint8_t* qt, float* st,
                             uint32_t* num_nonfinite, const OptimStepScalars* scalars, bool deferred, Stream stream,
                             Fp8Rule rule) {
  const char* op = "cuda::adamw_apply_fp8_weights";
  check_betas(op, cfg);
  check_moment_type<M>(op, cfg);
  MOE_CHECK(experts > 0 && n > 0 && k > 0 && n % 128 == 0 && k % 128 == 0, op,
            ": expected experts > 0 and n, k positive multiples of 128, got experts ", experts, " n ", n, " k ", k);
  MOE_CHECK(segment.numel == experts * n * k, op, ": the segment holds ", segment.numel, " elements, [", experts,
            ", ", n, ", ", k, "] weights are ", experts * n * k);
  const int64_t state = segment.state_offset < 0 ? segment.offset : segment.state_offset;
  MOE_CHECK(segment.offset >= 0 && segment.offset % 4 == 0 && state >= 0 && (state - segment.offset) % 4 == 0, op,
            ": the segment's offset (", segment.offset, ") and its moments' offset (", state,
            ") must be non-negative multiples of 4");
  detail::check_ptrs(op, {{"scalars", scalars}}, alignof(OptimStepScalars));
  detail::check_ptrs(op, {{"params", params}, {"grads", grads}, {"q", q}, {"qt", qt}}, 16);
  detail::check_ptrs(op, {{"exp_avg", exp_avg}, {"exp_avg_sq", exp_avg_sq}}, 4 * sizeof(M));
  detail::check_ptrs(op, {{"s", s}, {"st", st}}, sizeof(float));
  if (params_bf16 != nullptr) detail::check_ptrs(op, {{"params_bf16", params_bf16}}, 8);
  const int64_t blocks = experts * (n / 128) * (k / 128);
  MOE_CHECK(blocks <= detail::kMaxGridX, op, ": ", blocks, " weight blocks exceed one launch's ", detail::kMaxGridX);
  const auto kernel = rule == Fp8Rule::kBlocks ? kernels::adamw_update_fp8_weights<false, M>
                                                : kernels::adamw_update_fp8_weights<true, M>;
  kernel<<<static_cast<unsigned>(blocks), kernels::kFp8WeightThreads, 0, stream>>>(
      segment.offset, state - segment.offset, n, k, segment.decay != 0, params, grads, exp_avg, exp_avg_sq,
      params_bf16, f, rule, q, s, qt, st, num_nonfinite, scalars, adamw_constants(cfg), deferred);
  check_launch("adamw_update_fp8_weights");
}

void adamw_clear_pending(OptimStepScalars* scalars, Stream stream) {
  detail::check_ptrs("cuda::adamw_clear_pending", {{"scalars", scalars}}, alignof(OptimStepScalars));
  kernels::adamw_clear_pending_kernel<<<1, 1, 0, stream>>>(scalars);
  check_launch("adamw_clear_pending");
}

template <typename M>
void adamw_step(const ParamSegmentTable& segments, const OptimConfig& cfg, float* params, const float* grads,
                M* exp_avg, M* exp_avg_sq, uint16_t* params_bf16, OptimStepScalars* scalars, Stream stream) {
  adamw_prepare(cfg, scalars, stream);
  adamw_apply(segments, cfg, params, grads, exp_avg, exp_avg_sq, params_bf16, scalars, /*deferred=*/false, stream);
  adamw_clear_pending(scalars, stream);
}

// The two moment types: FP32, and BF16 bits.
#define MOE_ADAMW_INSTANTIATE(M)                                                                                 \
  template void adamw_apply<M>(const ParamSegmentTable&, const OptimConfig&, float*, const float*, M*, M*,       \
                               uint16_t*, const OptimStepScalars*, bool, Stream, int);                           \
  template void adamw_apply_fp8_weights<M>(const ParamSegment&, int64_t, int64_t, int64_t, const OptimConfig&,   \
                                           float*, const float*, M*, M*, uint16_t*, Fp8Format, uint8_t*, float*, \
                                           uint8_t*, float*, uint32_t*, const OptimStepScalars*, bool, Stream,   \
                                           Fp8Rule);                                                             \
  template void adamw_step<M>(const ParamSegmentTable&, const OptimConfig&, float*, const float*, M*, M*,        \
                              uint16_t*, OptimStepScalars*, Stream);
MOE_ADAMW_INSTANTIATE(float)
MOE_ADAMW_INSTANTIATE(uint16_t)
#undef MOE_ADAMW_INSTANTIATE

}  // namespace moe::cuda
