// activation_memory: every layer's saved tensors as a list (name, bytes, kept under selective,
// kept under full), split per mode into kept (summed over layers) and pool (the largest layer's
// rest), plus the model-wide scratch. The GPU list mirrors CudaAttentionBlock / CudaMoeLayer /
// CudaLocalExperts / CudaMlpBlock / CudaLmHead / CudaModel::reserve and CudaStepRunner's token
// buffer; a change there is a change here (tests/unit/plan_test.cpp pins the sums).
#include "train/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "core/error.h"
#include "core/square_blocks.h"
#include "model/layout.h"

namespace moe {

namespace {

// kind: the pool it goes to when recomputed (CudaModel holds one pool per block kind: attention
// blocks, dense MLP blocks, MoE layers with their experts and shared expert).
enum class Kind { kAttention, kMlp, kMoe };

struct LayerTensor {
  const char* name;
  double bytes;
  bool selective;         // kept under "selective"
  bool full;              // kept under "full"
  bool full_only = false;  // exists only under "full" (the FP32 residual copy)
  Kind kind = Kind::kAttention;
};

bool kept_in(const LayerTensor& t, Recompute mode) {
  switch (mode) {
    case Recompute::kNone:
      return true;
    case Recompute::kSelective:
      return t.selective;
    case Recompute::kFull:
      return t.full;
  }
  return true;
}

// Layer l's tensors: its attention block, then its dense MLP block or MoE layer.
// ep > 1: the experts do not recompute their outputs, so selective keeps y_sorted per layer.
std::vector<LayerTensor> layer_tensors(const ModelConfig& m, const MoeConfig& e, int64_t l, int64_t batch, int64_t seq,
                                       bool gpu, int64_t ep) {
  const double n = double(batch) * double(seq), d = double(m.d_model), hd = double(m.head_dim());
  const double q = double(m.n_heads) * hd, c = double(m.n_kv_heads) * hd, h = double(m.n_heads);
  const double bf = gpu ? 2.0 : 4.0, f32 = 4.0, i32 = 4.0;
  std::vector<LayerTensor> t = {
      {"attention.x", n * d * bf, true, !gpu},
      {"attention.norm", n * d * bf, false, false},
      {"attention.rstd", n * f32, true, false},
  };
  if (m.qk_norm) {
    t.push_back({"attention.q_raw", n * q * bf, false, false});
    t.push_back({"attention.k_raw", n * c * bf, false, false});
    t.push_back({"attention.q_rstd", n * f32, true, false});
    t.push_back({"attention.k_rstd", n * f32, true, false});
  }
  t.push_back({"attention.q", n * q * bf, false, false});
  t.push_back({"attention.k", n * c * bf, false, false});
  t.push_back({"attention.v", n * c * bf, false, false});
  t.push_back({"attention.attn", n * q * bf, true, false});
  t.push_back({"attention.lse", n * h * f32, true, false});
  if (gpu) t.push_back({"attention.x32 (full: FP32 residual)", n * d * f32, false, true, true});
  if (is_dense_layer(m, l)) {
    const double f = double(m.dense_hidden);
    t.push_back({"mlp.x", n * d * bf, true, false, false, Kind::kMlp});
    t.push_back({"mlp.norm", n * d * bf, false, false, false, Kind::kMlp});
    t.push_back({"mlp.rstd", n * f32, true, false, false, Kind::kMlp});
    t.push_back({"mlp.gate_up", n * 2.0 * f * bf, true, false, false, Kind::kMlp});
    t.push_back({"mlp.h", n * f * bf, false, false, false, Kind::kMlp});
    return t;
  }
  const double ne = double(e.num_experts), k = double(e.top_k), r = n * k, inner = double(e.expert_hidden);
  const size_t first_moe = t.size();
  t.push_back({"moe.x", n * d * bf, true, false});
  t.push_back({"moe.norm", n * d * bf, false, false});
  t.push_back({"moe.rstd", n * f32, true, false});
  t.push_back({"moe.logits", n * ne * f32, true, true});
  t.push_back({"moe.scores", n * ne * f32, true, true});
  t.push_back({"moe.topk_idx", n * k * i32, true, true});
  t.push_back({"moe.topk_w", n * k * f32, true, true});
  t.push_back({"moe.offsets", (ne + 1) * i32, true, true});
  t.push_back({"moe.sorted_route", r * i32, true, true});
  t.push_back({"moe.route_to_row", r * i32, true, true});
  t.push_back({"moe.x_sorted", r * d * bf, false, false});
  t.push_back({"moe.y_sorted", r * d * bf, gpu && ep > 1, false});
  t.push_back({"experts.gate_up", r * 2.0 * inner * bf, true, false});
  t.push_back({"experts.h", r * inner * bf, false, false});
  if (e.shared_experts > 0) {
    const double f = double(e.shared_experts) * inner;
    t.push_back({"shared.gate_up", n * 2.0 * f * bf, true, false});
    t.push_back({"shared.h", n * f * bf, false, false});
  }
  for (size_t i = first_moe; i < t.size(); ++i) t[i].kind = Kind::kMoe;
  return t;
}

bool gpu_moe_rows_hold(int64_t moe_layers, double dy_sorted_bytes, double attention_scratch_bytes) {
  return moe_layers > 0 && dy_sorted_bytes >= attention_scratch_bytes;
}

// Rows per tile of the GPU dispatch map (cuda/ops/moe_dispatch.cu map_tiling: 512 threads, at
// most 256 tiles per round).
double dispatch_workspace_bytes(double routes, double experts) {
  const double per_round = 256.0 * 512.0;
  const double chunks = std::max(1.0, std::ceil(routes / per_round));
  return experts * std::ceil(routes / (512.0 * chunks)) * 4.0;
}

std::vector<MemoryItem> scratch_items(const ModelConfig& m, const MoeConfig& e, int64_t batch, int64_t seq,
                                      int64_t micro_steps, bool gpu) {
  const double n = double(batch) * double(seq), d = double(m.d_model), hd = double(m.head_dim());
  const double q = double(m.n_heads) * hd, c = double(m.n_kv_heads) * hd, h = double(m.n_heads);
  const double v = double(m.vocab_size);
  const int64_t moe_layers = num_moe_layers(m);
  const double ne = double(e.num_experts), k = double(e.top_k), r = n * k, inner = double(e.expert_hidden);
  double widest_mlp = 0;
  for (int64_t l = 0; l < m.n_layers; ++l)
    widest_mlp = std::max(widest_mlp, is_dense_layer(m, l) ? double(m.dense_hidden)
                                                           : double(e.shared_experts) * inner);
  std::vector<MemoryItem> s;
  if (!gpu) {  // Model<float>: FP32 head with [N, V] logits and their gradient, one residual gradient
    s.push_back({"lm_head.x, norm", 2.0 * n * d * 4.0});
    s.push_back({"lm_head.rstd, lse, loss", 3.0 * n * 4.0});
    s.push_back({"lm_head.logits [N, V]", n * v * 4.0});
    s.push_back({"lm_head.dlogits [N, V]", n * v * 4.0});
    s.push_back({"residual gradient", n * d * 4.0});
    return s;
  }
  s.push_back({"token ids (step and micro-batch)", (2.0 * double(micro_steps) + 2.0) * n * 4.0});
  s.push_back({"residual.x32", n * d * 4.0});
  s.push_back({"residual.branch", n * d * 2.0});
  s.push_back({"residual.dx32", n * d * 4.0});
  s.push_back({"residual.dx", n * d * 2.0});
  s.push_back({"residual.dbranch", n * d * 2.0});
  s.push_back({"residual.dtmp", n * d * 2.0});
  // The norm backward's partial dw rows; with QK-norm, also the (cos, sin) table [seq, hd / 2] its
  // RoPE-reading backward keeps after the rows (256-byte aligned; cuda::rope_rmsnorm_backward).
  const double norm_rows = std::ceil(n / 32.0) * std::max({d, q, c}) * 4.0;
  const double rope_table = std::ceil(std::ceil(n / 32.0) * std::max(q, c) * 4.0 / 256.0) * 256.0 +
                            double(seq) * std::floor(hd / 2.0) * 8.0;
  s.push_back({"rmsnorm backward workspace", m.qk_norm ? std::max(norm_rows, rope_table) : norm_rows});
  // Attention backward dattn, dq, dk, dv (with QK-norm dq_raw, dk_raw) and its workspace, each
  // 256-byte aligned; they borrow the MoE layers' dy_sorted rows when those are large enough
  // (CudaAttentionBlock::reserve_scratch), else they are a buffer of their own.
  auto up = [](double b) { return std::ceil(b / 256.0) * 256.0; };
  const double attn_scratch = 2.0 * up(n * q * 2.0) + 2.0 * up(n * c * 2.0) +
                              (m.qk_norm ? up(n * q * 2.0) + up(n * c * 2.0) : 0.0) + up(n * h * 4.0);
  if (gpu_moe_rows_hold(moe_layers, r * d * 2.0, attn_scratch))
    s.push_back({"attention backward scratch (in moe dy_sorted)", 0.0});
  else
    s.push_back({"attention backward scratch and workspace", attn_scratch});
  s.push_back({"cuDNN attention backward plan workspace", cudnn_attention_workspace_bytes(batch, m.n_heads, seq)});
  if (moe_layers > 0) {
    const double mm = double(moe_layers);
    // The experts' input gradient overwrites the output gradient rows: one [R, D] buffer.
    s.push_back({"moe backward dy_sorted", r * d * 2.0});
    s.push_back({"moe backward dtopk_w, dlogits (FP32 + BF16)", n * k * 4.0 + n * ne * 6.0});
    s.push_back({"router and dispatch workspaces",
                 std::min(std::ceil(n / 8.0), 1024.0) * (2.0 * ne + 1.0) * 4.0 + dispatch_workspace_bytes(r, ne)});
    s.push_back({"router state (expert bias, counts, losses)", mm * ne * 8.0 + mm * 8.0});
    // cuda::experts_backward_workspace_bytes(R, I): dgate_up [R, 2I] then dh [R, I], BF16.
    s.push_back({"experts backward workspace", r * 3.0 * inner * 2.0});
    // CudaModel::set_expert_grad_squares (one GPU, no gradient reduction; counted on every layout):
    // the experts' weight gradients' block sums of squares, FP64.
    s.push_back({"experts' gradient square sums",
                 mm * 8.0 * double(expert_square_blocks(e.num_experts, m.d_model, e.expert_hidden))});
  }
  if (widest_mlp > 0) s.push_back({"mlp backward dh, dgate_up", n * 3.0 * widest_mlp * 2.0});
  s.push_back({"lm_head.x, norm, dnorm", 3.0 * n * d * 2.0});
  s.push_back({"lm_head.rstd, loss, lse", 3.0 * n * 4.0});
  s.push_back({"lm_head.logits chunk [4096, V]", std::min(n, 4096.0) * v * 2.0});
  // cuda::embedding_backward_workspace_bytes: four id arrays and CUB's radix sort storage (taken as
  // 16 bytes per token: an approximation of a few MiB).
  s.push_back({"embedding backward workspace", 4.0 * n * 4.0 + 16.0 * n});
  return s;
}

}  // namespace

double sum_bytes(const std::vector<MemoryItem>& items) {
  double s = 0;
  for (const MemoryItem& i : items) s += i.bytes;
  return s;
}

double cudnn_attention_workspace_bytes(int64_t batch, int64_t heads, int64_t seq) {
  return double(batch) * double(heads) * double(seq) * (2.0 * double(seq) + 4.0) + 256.0;
}

ActivationMemory activation_memory(const ModelConfig& m, const MoeConfig& e, int64_t batch, int64_t seq,
                                   int64_t micro_steps, bool gpu, Recompute mode, int64_t ep) {
  MOE_CHECK(batch > 0 && seq > 0 && micro_steps > 0, "activation_memory: batch, seq and micro_steps must be > 0, got ",
            batch, ", ", seq, ", ", micro_steps);
  ActivationMemory a;
  a.mode = mode;
  std::vector<std::string> order;  // names in first-seen order
  std::map<std::string, double> kept;
  // One pool per block kind, each the largest layer's of that kind.
  std::array<std::vector<MemoryItem>, 3> largest_pool;
  std::array<double, 3> largest = {-1, -1, -1};
  for (int64_t l = 0; l < m.n_layers; ++l) {
    std::array<std::vector<MemoryItem>, 3> pool;
    for (const LayerTensor& t : layer_tensors(m, e, l, batch, seq, gpu, ep)) {
      if (t.full_only && mode != Recompute::kFull) continue;
      if (kept_in(t, mode)) {
        if (kept.find(t.name) == kept.end()) order.push_back(t.name);
        kept[t.name] += t.bytes;
      } else {
        pool[size_t(t.kind)].push_back({t.name, t.bytes});
      }
    }
    for (size_t k = 0; k < 3; ++k)
      if (const double b = sum_bytes(pool[k]); !pool[k].empty() && b > largest[k])
        largest[k] = b, largest_pool[k] = std::move(pool[k]);
  }
  for (const std::string& name : order) a.kept.push_back({name, kept[name]});
  for (std::vector<MemoryItem>& p : largest_pool)
    for (MemoryItem& i : p) a.pool.push_back(std::move(i));
  a.scratch = scratch_items(m, e, batch, seq, micro_steps, gpu);
  return a;
}

std::array<ActivationMemory, 3> activation_memory_all_modes(const ModelConfig& m, const MoeConfig& e, int64_t batch,
                                                             int64_t seq, int64_t micro_steps, bool gpu, int64_t ep) {
  return {activation_memory(m, e, batch, seq, micro_steps, gpu, Recompute::kNone, ep),
          activation_memory(m, e, batch, seq, micro_steps, gpu, Recompute::kSelective, ep),
          activation_memory(m, e, batch, seq, micro_steps, gpu, Recompute::kFull, ep)};
}

}  // namespace moe
