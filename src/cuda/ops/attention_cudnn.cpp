// cuDNN SDPA behind attention.h. Tensors are described in cuDNN's [B, H, S, D] order with the
// strides of the project's BSHD rows ([S*H*D, D, H*D, 1]); Stats (natural-log logsumexp of the
// scaled scores, [B, Hq, S, 1] FP32) is the lse. Causal = diagonal band with right bound 0, top
// left; attn_scale 1/sqrt(D); the backward asks for cuDNN's deterministic algorithm. Plans,
// workspaces and one cudnnHandle per device live in a process-wide cache behind one mutex.
#include "cuda/ops/attention_cudnn.h"

#include "core/error.h"

#ifdef MOECORE_HAS_CUDNN

#include <cuda_runtime.h>
#include <cudnn.h>

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

// The frontend's JSON (de)serialisation is not used here; leaving it out saves a third of this
// file's compile time.
#define CUDNN_FRONTEND_SKIP_JSON_LIB 1
#include <cudnn_frontend.h>

#include "cuda/common.h"
#include "cuda/ops/memory.h"

namespace moe::cuda {
namespace {

namespace fe = cudnn_frontend;

// Tensor uids of the variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kSeqLenQ, kSeqLenKV };

struct PlanKey {
  int device;
  int64_t batch, seq, q_heads, kv_heads, head_dim;
  AttentionDirection direction;
  auto tie() const { return std::tie(device, batch, seq, q_heads, kv_heads, head_dim, direction); }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

std::string describe(const PlanKey& key) {
  return ::moe::detail::concat(key.direction == AttentionDirection::kForward ? "forward" : "backward", " B=", key.batch,
                        " S=", key.seq, " Hq=", key.q_heads, " Hkv=", key.kv_heads, " D=", key.head_dim,
                        " on device ", key.device);
}

void check_cudnn(cudnnStatus_t status, const char* call) {
  MOE_CHECK(status == CUDNN_STATUS_SUCCESS, "cuDNN error ", cudnnGetErrorString(status), " (", static_cast<int>(status),
            ") from ", call);
}

void check_fe(fe::error_t err, const char* step, const PlanKey& key) {
  if (err.is_good()) return;
  MOE_FAIL("cuda::attention (cuDNN): ", step, " failed for ", describe(key), ": ", err.get_message(), " (code ",
           static_cast<int>(err.get_code()), "); cuDNN ", attention_cudnn_version(),
           ". Use the own backend (MOECORE_ATTENTION=own) for this shape");
}

// One built graph with what its execution needs besides the caller's tensors (device memory from
// device_alloc, so the process's device byte counter sees it). A cached plan is
// never freed: the cache lives as long as the process (destroying it at exit would race the CUDA
// runtime's own teardown); the destructor runs only for a plan whose build failed.
struct Plan {
  std::shared_ptr<fe::graph::Graph> graph;
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  int32_t* seq_lens = nullptr;  // backward with an explicit padding mask: [B] of S, twice (q then kv)

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    device_free(workspace);
    device_free(seq_lens);
  }
};

struct Cache {
  std::mutex mutex;
  std::map<int, cudnnHandle_t> handles;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
};

Cache& cache() {
  static Cache* c = new Cache;  // intentionally never destroyed (see Plan)
  return *c;
}

cudnnHandle_t handle_for(Cache& c, int device) {
  auto it = c.handles.find(device);
  if (it != c.handles.end()) return it->second;
  const size_t runtime = cudnnGetVersion();
  MOE_CHECK(runtime >= 90000, "cuda::attention (cuDNN): the loaded libcudnn is version ", runtime,
            "; the cuDNN backend needs cuDNN 9 (built against ", CUDNN_VERSION, ")");
  cudnnHandle_t h = nullptr;
  check_cudnn(cudnnCreate(&h), "cudnnCreate");
  c.handles.emplace(device, h);
  return h;
}

// With cuDNN up to 9.15 the frontend works around a backend limitation of backward graphs whose
// s_kv is not a multiple of 128 by adding a padding mask itself, with sequence lengths it copies
// from a host temporary at every execute (which graph capture cannot hold). Here the mask is
// explicit, so the frontend adds nothing, and its lengths live in device memory written once,
// when the plan is built.
bool backward_needs_padding_mask(int64_t seq) { return seq % 128 != 0 && cudnnGetVersion() <= 91500; }

std::shared_ptr<fe::graph::Tensor_attributes> bshd_tensor(fe::graph::Graph& g, const char* name, int64_t uid,
                                                          const PlanKey& key, int64_t heads) {
  const int64_t s = key.seq, d = key.head_dim;
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({key.batch, heads, s, d})
                      .set_stride({s * heads * d, d, heads * d, 1}));
}

void set_bshd_output(const std::shared_ptr<fe::graph::Tensor_attributes>& t, int64_t uid, const PlanKey& key,
                     int64_t heads) {
  const int64_t s = key.seq, d = key.head_dim;
  t->set_output(true).set_uid(uid).set_dim({key.batch, heads, s, d}).set_stride({s * heads * d, d, heads * d, 1});
}

std::vector<int64_t> stats_dim(const PlanKey& key) { return {key.batch, key.q_heads, key.seq, 1}; }
std::vector<int64_t> stats_stride(const PlanKey& key) { return {key.q_heads * key.seq, key.seq, 1, 1}; }

std::unique_ptr<Plan> build_plan(const PlanKey& key, cudnnHandle_t handle) {
  auto plan = std::make_unique<Plan>();
  plan->graph = std::make_shared<fe::graph::Graph>();
  fe::graph::Graph& g = *plan->graph;
  g.set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(key.head_dim)));
  auto q = bshd_tensor(g, "q", kQ, key, key.q_heads);
  auto k = bshd_tensor(g, "k", kK, key, key.kv_heads);
  auto v = bshd_tensor(g, "v", kV, key, key.kv_heads);

  if (key.direction == AttentionDirection::kForward) {
    auto options = fe::graph::SDPA_attributes()
                       .set_name("attention_forward")
                       .set_generate_stats(true)
                       .set_attn_scale(scale)
                       .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                       .set_diagonal_band_right_bound(0);
    auto [o, stats] = g.sdpa(q, k, v, options);
    set_bshd_output(o, kO, key, key.q_heads);
    stats->set_output(true)
        .set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim(stats_dim(key))
        .set_stride(stats_stride(key));
  } else {
    auto o = bshd_tensor(g, "o", kO, key, key.q_heads);
    auto dout = bshd_tensor(g, "dout", kDO, key, key.q_heads);
    auto stats = g.tensor(fe::graph::Tensor_attributes()
                              .set_name("stats")
                              .set_uid(kStats)
                              .set_data_type(fe::DataType_t::FLOAT)
                              .set_dim(stats_dim(key))
                              .set_stride(stats_stride(key)));
    auto options = fe::graph::SDPA_backward_attributes()
                       .set_name("attention_backward")
                       .set_attn_scale(scale)
                       .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                       .set_diagonal_band_right_bound(0)
                       .set_deterministic_algorithm(true);
    if (backward_needs_padding_mask(key.seq)) {
      auto seq_len = [&](const char* name, int64_t uid) {
        return g.tensor(fe::graph::Tensor_attributes()
                            .set_name(name)
                            .set_uid(uid)
                            .set_data_type(fe::DataType_t::INT32)
                            .set_dim({key.batch, 1, 1, 1})
                            .set_stride({1, 1, 1, 1}));
      };
      options.set_padding_mask(true)
          .set_seq_len_q(seq_len("seq_len_q", kSeqLenQ))
          .set_seq_len_kv(seq_len("seq_len_kv", kSeqLenKV));
      const std::vector<int32_t> lens(static_cast<size_t>(2 * key.batch), static_cast<int32_t>(key.seq));
      plan->seq_lens = static_cast<int32_t*>(device_alloc(lens.size() * sizeof(int32_t)));
      MOE_CUDA_CHECK(
          cudaMemcpy(plan->seq_lens, lens.data(), lens.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    }
    auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, dout, stats, options);
    set_bshd_output(dq, kDQ, key, key.q_heads);
    set_bshd_output(dk, kDK, key, key.kv_heads);
    set_bshd_output(dv, kDV, key, key.kv_heads);
  }

  check_fe(g.validate(), "graph validation", key);
  check_fe(g.build_operation_graph(handle), "building the operation graph", key);
  check_fe(g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "the heuristics query", key);
  check_fe(g.check_support(), "the support check (no engine runs this graph)", key);
  check_fe(g.build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "building the execution plan", key);
  check_fe(g.get_workspace_size(plan->workspace_bytes), "the workspace query", key);
  if (plan->workspace_bytes > 0) {
    plan->workspace = device_alloc(static_cast<size_t>(plan->workspace_bytes));
  }
  return plan;
}

// The cached plan of `key`, built now when missing; refuses to build while `stream` is captured.
// Called with the cache mutex held.
Plan& plan_for(Cache& c, const PlanKey& key, Stream stream) {
  auto it = c.plans.find(key);
  if (it != c.plans.end()) return *it->second;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  MOE_CHECK(capture == cudaStreamCaptureStatusNone, "cuda::attention (cuDNN): no plan for ", describe(key),
            " and the stream is being captured into a CUDA graph; plans are built (with a workspace "
            "allocation) only outside capture: run this shape once eagerly, or call attention_prepare, before "
            "capturing");
  std::unique_ptr<Plan> plan = build_plan(key, handle_for(c, key.device));
  return *c.plans.emplace(key, std::move(plan)).first->second;
}

int current_device() {
  int device = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

void execute(Cache& c, const PlanKey& key, Plan& plan, std::unordered_map<int64_t, void*>& pack, Stream stream) {
  if (plan.seq_lens != nullptr) {
    pack.emplace(kSeqLenQ, plan.seq_lens);
    pack.emplace(kSeqLenKV, plan.seq_lens + key.batch);
  }
  cudnnHandle_t handle = handle_for(c, key.device);
  check_cudnn(cudnnSetStream(handle, stream), "cudnnSetStream");
  check_fe(plan.graph->execute(handle, pack, plan.workspace), "execution", key);
}

}  // namespace

bool attention_cudnn_built() { return true; }

std::string attention_cudnn_version() {
  const size_t v = cudnnGetVersion();
  return ::moe::detail::concat("cuDNN ", v / 10000, ".", (v / 100) % 100, ".", v % 100, " (built against ", CUDNN_MAJOR,
                        ".", CUDNN_MINOR, ".", CUDNN_PATCHLEVEL, "), frontend ", CUDNN_FRONTEND_MAJOR_VERSION, ".",
                        CUDNN_FRONTEND_MINOR_VERSION, ".", CUDNN_FRONTEND_PATCH_VERSION);
}

bool attention_cudnn_supports_head_dim(int64_t head_dim) {
  return head_dim >= 8 && head_dim <= 256 && head_dim % 8 == 0;
}

size_t attention_cudnn_prepare(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                               AttentionDirection direction, Stream stream) {
  MOE_CHECK(direction == AttentionDirection::kForward || seq > 1,
            "cuda::attention (cuDNN): cuDNN has no backward for seq = 1 (one key per query); "
            "attention_backward runs it on its own single-key kernel");
  Cache& c = cache();
  const PlanKey key{current_device(), batch, seq, q_heads, kv_heads, head_dim, direction};
  std::lock_guard<std::mutex> lock(c.mutex);
  return static_cast<size_t>(plan_for(c, key, stream).workspace_bytes);
}

void attention_cudnn_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, float* lse,
                             int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                             Stream stream) {
  Cache& c = cache();
  const PlanKey key{current_device(), batch, seq, q_heads, kv_heads, head_dim, AttentionDirection::kForward};
  std::lock_guard<std::mutex> lock(c.mutex);
  Plan& plan = plan_for(c, key, stream);
  std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<uint16_t*>(q)}, {kK, const_cast<uint16_t*>(k)},
                                             {kV, const_cast<uint16_t*>(v)}, {kO, out},
                                             {kStats, lse}};
  execute(c, key, plan, pack, stream);
}

void attention_cudnn_backward(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* out,
                              const float* lse, const uint16_t* dout, uint16_t* dq, uint16_t* dk, uint16_t* dv,
                              int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                              Stream stream) {
  MOE_CHECK(seq > 1, "cuda::attention (cuDNN): cuDNN has no backward for seq = 1 (one key per query); "
            "attention_backward runs it on its own single-key kernel");
  Cache& c = cache();
  const PlanKey key{current_device(), batch, seq, q_heads, kv_heads, head_dim, AttentionDirection::kBackward};
  std::lock_guard<std::mutex> lock(c.mutex);
  Plan& plan = plan_for(c, key, stream);
  std::unordered_map<int64_t, void*> pack = {
      {kQ, const_cast<uint16_t*>(q)},      {kK, const_cast<uint16_t*>(k)},
      {kV, const_cast<uint16_t*>(v)},      {kO, const_cast<uint16_t*>(out)},
      {kDO, const_cast<uint16_t*>(dout)},  {kStats, const_cast<float*>(lse)},
      {kDQ, dq},                           {kDK, dk},
      {kDV, dv}};
  execute(c, key, plan, pack, stream);
}

size_t attention_cudnn_cached_plans() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.plans.size();
}

}  // namespace moe::cuda

#else  // !MOECORE_HAS_CUDNN

namespace moe::cuda {
namespace {

[[noreturn]] void not_built() {
  MOE_FAIL("cuda::attention: this build has no cuDNN backend (configured without cuDNN 9 or without the cuDNN "
           "frontend headers; see the 'cuDNN attention' line of the CMake configure output and run "
           "scripts/setup.sh); use the own backend (MOECORE_ATTENTION=own)");
}

}  // namespace

bool attention_cudnn_built() { return false; }

std::string attention_cudnn_version() { return "not built"; }

bool attention_cudnn_supports_head_dim(int64_t) { return false; }

size_t attention_cudnn_prepare(int64_t, int64_t, int64_t, int64_t, int64_t, AttentionDirection, Stream) {
  not_built();
}

void attention_cudnn_forward(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, float*, int64_t, int64_t,
                             int64_t, int64_t, int64_t, Stream) {
  not_built();
}

void attention_cudnn_backward(const uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, const float*,
                              const uint16_t*, uint16_t*, uint16_t*, uint16_t*, int64_t, int64_t, int64_t, int64_t,
                              int64_t, Stream) {
  not_built();
}

size_t attention_cudnn_cached_plans() { return 0; }

}  // namespace moe::cuda

#endif  // MOECORE_HAS_CUDNN
