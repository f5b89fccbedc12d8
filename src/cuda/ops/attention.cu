// Attention entry points: shared checks, then the backend (MOECORE_ATTENTION / argument). Own
// kernels, tiles per head dim: forward 8 warps x 16 query rows against 64-key tiles; backward
// dK/dV 64 keys per block against query tiles of 64 (hd 64) or 32 (hd 128, fewer registers);
// backward dQ 64 query rows against 64-key tiles. Kernels use more than 48 KiB of dynamic shared
// memory, so each launch first raises the kernel's limit (capture-safe). cudnn: attention_cudnn.h.
#include "cuda/ops/attention.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/env_choice.h"
#include "cuda/common.h"
#include "cuda/kernels/attention.cuh"
#include "cuda/kernels/attention_single_key.cuh"
#include "cuda/ops/attention_cudnn.h"
#include "cuda/ops/launch.h"

namespace moe::cuda {
namespace {

constexpr int kForwardWarps = 8;
constexpr int kDotThreads = 256;
constexpr int kMaxGridYZ = 65535;

template <int D>
constexpr int backward_query_tile() {
  return D <= 64 ? 64 : 32;
}

struct Shape {
  int64_t batch, seq, q_heads, kv_heads, head_dim;
};

// What each backend's head-dim rule is, for messages.
const char* head_dim_rule(AttentionBackend backend) {
  return backend == AttentionBackend::kCudnn ? "supported head dims are multiples of 8 from 8 to 256"
                                             : "supported head dims are 64 and 128";
}

void check_shape(const char* op, const Shape& s, AttentionBackend backend) {
  MOE_CHECK(s.batch >= 0 && s.seq >= 0, op, ": expected batch >= 0 and seq >= 0, got batch=", s.batch,
            " seq=", s.seq);
  MOE_CHECK(s.kv_heads > 0 && s.q_heads > 0 && s.q_heads % s.kv_heads == 0, op,
            ": q_heads must be a positive multiple of kv_heads, got q_heads=", s.q_heads, " kv_heads=", s.kv_heads);
  MOE_CHECK(attention_supports_head_dim(s.head_dim, backend), op, ": head_dim ", s.head_dim, " has no kernel in the ",
            attention_backend_name(backend), " backend; ", head_dim_rule(backend));
  MOE_CHECK(s.seq <= std::numeric_limits<int32_t>::max() / 2, op, ": seq=", s.seq, " exceeds 2^30");
  MOE_CHECK(s.q_heads <= kMaxGridYZ && s.batch <= kMaxGridYZ, op, ": q_heads=", s.q_heads, " and batch=", s.batch,
            " must each be at most ", kMaxGridYZ, " (grid dimensions)");
}

// Every tensor pointer 16-byte aligned (the kernels move 16-byte vectors).
void check_aligned(const char* op, std::initializer_list<detail::NamedPtr> ptrs) {
  detail::check_ptrs(op, ptrs, 2);
  for (const detail::NamedPtr& p : ptrs) {
    MOE_CHECK(detail::aligned16(p.ptr), op, ": argument '", p.name, "' must be 16-byte aligned, got address ",
              p.ptr);
  }
}

template <int D>
void launch_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, float* lse,
                    const Shape& s, Stream stream) {
  using Tile = kernels::AttnForwardTile<D, kForwardWarps>;
  auto kernel = kernels::attention_forward_flash<D, kForwardWarps>;
  set_dynamic_smem_limit(kernel, Tile::kSmemBytes);
  const dim3 grid(static_cast<unsigned>((s.seq + Tile::kBlockQ - 1) / Tile::kBlockQ), static_cast<unsigned>(s.q_heads),
                  static_cast<unsigned>(s.batch));
  const float scale_log2 = static_cast<float>(kernels::kAttnLog2e / std::sqrt(static_cast<double>(D)));
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(q, k, v, out, lse, static_cast<int>(s.seq),
                                                             static_cast<int>(s.q_heads),
                                                             static_cast<int>(s.kv_heads), scale_log2);
  check_launch("attention_forward_flash");
}

template <int D>
void launch_backward(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* out,
                     const float* lse, const uint16_t* dout, uint16_t* dq, uint16_t* dk, uint16_t* dv,
                     float* delta, const Shape& s, Stream stream) {
  const int seq = static_cast<int>(s.seq), hq = static_cast<int>(s.q_heads), hkv = static_cast<int>(s.kv_heads);
  const double scale_d = 1.0 / std::sqrt(static_cast<double>(D));
  const float scale = static_cast<float>(scale_d);
  const float scale_log2 = static_cast<float>(scale_d * static_cast<double>(kernels::kAttnLog2e));

  const int64_t rows = s.batch * s.seq * s.q_heads;
  const int64_t rows_per_block = kDotThreads / (D / 8);
  const int64_t dot_blocks = std::min<int64_t>((rows + rows_per_block - 1) / rows_per_block, detail::kMaxGridX);
  kernels::attention_backward_dot_rows<D>
      <<<static_cast<unsigned>(dot_blocks), kDotThreads, 0, stream>>>(out, dout, delta, rows, seq, hq);
  check_launch("attention_backward_dot_rows");

  using KvTile = kernels::AttnBackwardKvTile<D, backward_query_tile<D>()>;
  auto kv_kernel = kernels::attention_backward_dkdv_flash<D, backward_query_tile<D>()>;
  set_dynamic_smem_limit(kv_kernel, KvTile::kSmemBytes);
  const dim3 kv_grid(static_cast<unsigned>((s.seq + KvTile::kBlockK - 1) / KvTile::kBlockK),
                     static_cast<unsigned>(s.kv_heads), static_cast<unsigned>(s.batch));
  kv_kernel<<<kv_grid, KvTile::kThreads, KvTile::kSmemBytes, stream>>>(q, k, v, lse, delta, dout, dk, dv, seq, hq,
                                                                       hkv, scale, scale_log2);
  check_launch("attention_backward_dkdv_flash");

  using QTile = kernels::AttnBackwardQTile<D>;
  auto q_kernel = kernels::attention_backward_dq_flash<D>;
  set_dynamic_smem_limit(q_kernel, QTile::kSmemBytes);
  const dim3 q_grid(static_cast<unsigned>((s.seq + QTile::kBlockQ - 1) / QTile::kBlockQ),
                    static_cast<unsigned>(s.q_heads), static_cast<unsigned>(s.batch));
  q_kernel<<<q_grid, QTile::kThreads, QTile::kSmemBytes, stream>>>(q, k, v, lse, delta, dout, dq, seq, hq, hkv,
                                                                   scale, scale_log2);
  check_launch("attention_backward_dq_flash");
}

// seq = 1 on the cudnn backend (cuDNN refuses s_q = s_kv = 1 in its backward).
void launch_backward_single_key(const uint16_t* dout, uint16_t* dq, uint16_t* dk, uint16_t* dv, const Shape& s,
                                Stream stream) {
  constexpr int kThreads = 256;
  const int64_t n = s.batch * s.q_heads * s.head_dim;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, detail::kMaxGridX);
  kernels::attention_backward_single_key<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      dout, dq, dk, dv, s.batch, static_cast<int>(s.q_heads), static_cast<int>(s.kv_heads),
      static_cast<int>(s.head_dim));
  check_launch("attention_backward_single_key");
}

// MOECORE_ATTENTION: unset or empty -> kAuto; "own" / "cudnn"; anything else is refused.
AttentionBackend backend_from_environment() {
  switch (env_choice("MOECORE_ATTENTION", {"own", "cudnn"})) {
    case 1:
      return AttentionBackend::kOwn;
    case 2:
      return AttentionBackend::kCudnn;
    default:
      return AttentionBackend::kAuto;
  }
}

}  // namespace

const char* attention_backend_name(AttentionBackend backend) {
  switch (backend) {
    case AttentionBackend::kAuto:
      return "auto";
    case AttentionBackend::kOwn:
      return "own";
    case AttentionBackend::kCudnn:
      return "cudnn";
  }
  return "unknown";
}

bool attention_cudnn_available() { return attention_cudnn_built(); }

AttentionBackend attention_resolve_backend(AttentionBackend requested) {
  const bool from_env = requested == AttentionBackend::kAuto;
  if (from_env) requested = backend_from_environment();
  if (requested == AttentionBackend::kAuto) {
    return attention_cudnn_built() ? AttentionBackend::kCudnn : AttentionBackend::kOwn;
  }
  MOE_CHECK(requested != AttentionBackend::kCudnn || attention_cudnn_built(), "cuda::attention: the cudnn backend",
            from_env ? " (MOECORE_ATTENTION=cudnn)" : "",
            " is not in this build: it was configured without cuDNN 9 or without the cuDNN frontend headers (see "
            "the 'cuDNN attention' line of the CMake configure output; scripts/setup.sh fetches the frontend); "
            "use the own backend");
  return requested;
}

bool attention_supports_head_dim(int64_t head_dim, AttentionBackend backend) {
  if (attention_resolve_backend(backend) == AttentionBackend::kCudnn) {
    return attention_cudnn_supports_head_dim(head_dim);
  }
  return head_dim == 64 || head_dim == 128;
}

void attention_prepare(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                       Stream stream, AttentionBackend backend) {
  backend = attention_resolve_backend(backend);
  const Shape s{batch, seq, q_heads, kv_heads, head_dim};
  check_shape("cuda::attention_prepare", s, backend);
  if (backend != AttentionBackend::kCudnn || batch == 0 || seq == 0) return;
  attention_cudnn_prepare(batch, seq, q_heads, kv_heads, head_dim, AttentionDirection::kForward, stream);
  if (seq > 1) {
    attention_cudnn_prepare(batch, seq, q_heads, kv_heads, head_dim, AttentionDirection::kBackward, stream);
  }
}

void attention_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, float* lse,
                       int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                       Stream stream, AttentionBackend backend) {
  const char* op = "cuda::attention_forward";
  backend = attention_resolve_backend(backend);
  const Shape s{batch, seq, q_heads, kv_heads, head_dim};
  check_shape(op, s, backend);
  if (batch == 0 || seq == 0) return;
  check_aligned(op, {{"q", q}, {"k", k}, {"v", v}, {"out", out}});
  detail::check_ptrs(op, {{"lse", lse}}, 4);
  if (backend == AttentionBackend::kCudnn) {
    attention_cudnn_forward(q, k, v, out, lse, batch, seq, q_heads, kv_heads, head_dim, stream);
  } else if (head_dim == 64) {
    launch_forward<64>(q, k, v, out, lse, s, stream);
  } else {
    launch_forward<128>(q, k, v, out, lse, s, stream);
  }
}

size_t attention_backward_workspace_bytes(int64_t batch, int64_t seq, int64_t q_heads) {
  MOE_CHECK(batch >= 0 && seq >= 0 && q_heads >= 0,
            "cuda::attention_backward_workspace_bytes: expected batch, seq, q_heads >= 0, got batch=", batch,
            " seq=", seq, " q_heads=", q_heads);
  return static_cast<size_t>(batch) * static_cast<size_t>(seq) * static_cast<size_t>(q_heads) * sizeof(float);
}

void attention_backward(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* out,
                        const float* lse, const uint16_t* dout, uint16_t* dq, uint16_t* dk, uint16_t* dv,
                        int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                        void* workspace, size_t workspace_bytes, Stream stream, AttentionBackend backend) {
  const char* op = "cuda::attention_backward";
  backend = attention_resolve_backend(backend);
  const Shape s{batch, seq, q_heads, kv_heads, head_dim};
  check_shape(op, s, backend);
  if (batch == 0 || seq == 0) return;
  check_aligned(op, {{"q", q}, {"k", k}, {"v", v}, {"out", out}, {"dout", dout}, {"dq", dq}, {"dk", dk}, {"dv", dv}});
  detail::check_ptrs(op, {{"lse", lse}}, 4);
  detail::check_ptrs(op, {{"workspace", workspace}}, 4);
  const size_t need = attention_backward_workspace_bytes(batch, seq, q_heads);
  MOE_CHECK(workspace_bytes >= need, op, ": workspace of ", workspace_bytes, " bytes is too small, need ", need,
            " (attention_backward_workspace_bytes(", batch, ", ", seq, ", ", q_heads, "))");
  if (backend == AttentionBackend::kCudnn) {
    if (seq == 1) {
      launch_backward_single_key(dout, dq, dk, dv, s, stream);
    } else {
      attention_cudnn_backward(q, k, v, out, lse, dout, dq, dk, dv, batch, seq, q_heads, kv_heads, head_dim, stream);
    }
    return;
  }
  float* delta = static_cast<float*>(workspace);
  if (head_dim == 64) {
    launch_backward<64>(q, k, v, out, lse, dout, dq, dk, dv, delta, s, stream);
  } else {
    launch_backward<128>(q, k, v, out, lse, dout, dq, dk, dv, delta, s, stream);
  }
}

}  // namespace moe::cuda
