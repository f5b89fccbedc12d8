// Every entry point is capturable in a CUDA graph (no host synchronisation, allocation or
// device-value read inside): one step of embedding -> RMSNorm -> RoPE and SwiGLU, forward and
// backward, captured once and replayed twice, must reproduce an eager run bitwise, and the
// bad-id counter must advance on every replay (bad ids are flagged, never trapped).
#include "cuda/ops/embedding.h"
#include "cuda/ops/rmsnorm.h"
#include "cuda/ops/rope.h"
#include "cuda/ops/swiglu.h"
#include "gpu/gpu_test_util.h"

namespace moe::testing {
namespace {

struct StepBuffers {
  static constexpr int64_t kBatch = 2, kSeq = 96, kHeads = 4, kHeadDim = 64, kVocab = 500, kInner = 384;
  static constexpr int64_t kN = kBatch * kSeq, kD = kHeads * kHeadDim;

  std::vector<int32_t> ids_host = [] {
    std::vector<int32_t> v(kN);
    for (int64_t i = 0; i < kN; ++i) v[i] = static_cast<int32_t>((i * 37) % kVocab);
    v[5] = -3;      // two bad ids
    v[77] = 100000;
    return v;
  }();
  std::vector<float> dw_emb0 = random_f32(kVocab * kD, 91);
  std::vector<float> dw_norm0 = random_f32(kD, 92);

  GuardedBuffer<int32_t> ids{ids_host};
  GuardedBuffer<uint16_t> w_emb{random_bf16(kVocab * kD, 93)}, w_norm{random_bf16(kD, 94, 0.1f, 1.0f)};
  GuardedBuffer<uint16_t> x{kN * kD}, y{kN * kD}, dy{random_bf16(kN * kD, 95)}, dx{kN * kD};
  GuardedBuffer<uint16_t> gate_up{random_bf16(kN * 2 * kInner, 96)}, h{kN * kInner}, dh{random_bf16(kN * kInner, 97)},
      dgate_up{kN * 2 * kInner};
  GuardedBuffer<float> rstd{kN}, dw_emb{dw_emb0}, dw_norm{dw_norm0}, dw_emb_start{dw_emb0}, dw_norm_start{dw_norm0};
  GuardedBuffer<uint32_t> num_bad{std::vector<uint32_t>{0}};
  size_t ws_emb_bytes = cuda::embedding_backward_workspace_bytes(kN, kVocab);
  size_t ws_norm_bytes = cuda::rmsnorm_backward_workspace_bytes(kN, kD);
  GuardedBuffer<uint8_t> ws_emb{static_cast<int64_t>(ws_emb_bytes)}, ws_norm{static_cast<int64_t>(ws_norm_bytes)};

  // One training-step-shaped sequence of every op, on `s`.
  void run(cudaStream_t s) {
    MOE_CUDA_CHECK(cudaMemcpyAsync(dw_emb.data(), dw_emb_start.data(), dw_emb.bytes(), cudaMemcpyDeviceToDevice, s));
    MOE_CUDA_CHECK(cudaMemcpyAsync(dw_norm.data(), dw_norm_start.data(), dw_norm.bytes(), cudaMemcpyDeviceToDevice, s));
    cuda::embedding_forward(ids.data(), w_emb.data(), x.data(), kN, kVocab, kD, num_bad.data(), s);
    cuda::rmsnorm_forward(x.data(), w_norm.data(), y.data(), rstd.data(), kN, kD, 1e-6, s);
    cuda::rope_forward(y.data(), kBatch, kSeq, kHeads, kHeadDim, 1e4, s);
    cuda::swiglu_forward(gate_up.data(), h.data(), kN, kInner, s);
    cuda::swiglu_backward(gate_up.data(), dh.data(), dgate_up.data(), kN, kInner, s);
    cuda::rope_backward(dy.data(), kBatch, kSeq, kHeads, kHeadDim, 1e4, s);
    cuda::rmsnorm_backward(x.data(), w_norm.data(), rstd.data(), dy.data(), dx.data(), dw_norm.data(), kN, kD,
                           ws_norm.data(), ws_norm_bytes, s);
    cuda::embedding_backward(ids.data(), dx.data(), dw_emb.data(), kN, kVocab, kD, num_bad.data(), ws_emb.data(),
                             ws_emb_bytes, s);
  }
};

struct Snapshot {
  std::vector<uint16_t> y, h, dgate_up, dx;
  std::vector<float> dw_emb, dw_norm;
  bool operator==(const Snapshot& o) const {
    auto same = [](const auto& a, const auto& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
    };
    return same(y, o.y) && same(h, o.h) && same(dgate_up, o.dgate_up) && same(dx, o.dx) &&
           same(dw_emb, o.dw_emb) && same(dw_norm, o.dw_norm);
  }
};

Snapshot snapshot(const StepBuffers& b) {
  return {b.y.download(), b.h.download(), b.dgate_up.download(), b.dx.download(), b.dw_emb.download(),
          b.dw_norm.download()};
}

TEST(CudaGraph, CapturedStepReplaysBitwiseAndCountsBadIds) {
  MOE_SKIP_WITHOUT_GPU();
  StepBuffers b;
  TestStream stream;
  const std::vector<uint16_t> dy0 = b.dy.download();

  b.run(stream.get());  // eager
  stream.sync();
  const Snapshot eager = snapshot(b);
  EXPECT_EQ(b.num_bad.download()[0], 4u);  // 2 bad ids, seen by forward and by backward

  b.dy.upload(dy0);  // rope_backward worked in place on dy
  cudaGraph_t graph = nullptr;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  b.run(stream.get());
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (int replay = 1; replay <= 2; ++replay) {
    b.dy.upload(dy0);
    MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    stream.sync();
    EXPECT_TRUE(snapshot(b) == eager) << "graph replay " << replay << " differs from the eager run";
    EXPECT_EQ(b.num_bad.download()[0], 4u + 4u * replay) << "after replay " << replay;
  }
  MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOE_CUDA_CHECK(cudaGraphDestroy(graph));
}

}  // namespace
}  // namespace moe::testing
