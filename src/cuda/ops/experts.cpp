// Grouped experts of experts.h as a fixed sequence of grouped GEMM and SwiGLU entry points (the
// sequence the CUDA model ran inline before): forward gate_up GEMM, SwiGLU, down GEMM; backward
// down dgrad and wgrad, SwiGLU backward, gate_up dgrad and wgrad. Host code only.
#include "cuda/ops/experts.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "core/error.h"
#include "cuda/ops/fp8.h"
#include "cuda/ops/swiglu.h"

namespace moe::cuda {
namespace {

struct Span {
  const char* name;
  const void* ptr;
  size_t bytes;
};

bool overlap(const Span& a, const Span& b) {
  const auto a0 = reinterpret_cast<uintptr_t>(a.ptr), b0 = reinterpret_cast<uintptr_t>(b.ptr);
  return a0 < b0 + b.bytes && b0 < a0 + a.bytes;
}

void check_sizes(const char* op, int64_t max_rows, int64_t num_experts, int64_t d, int64_t inner) {
  MOE_CHECK(max_rows >= 0, op, ": max_rows must be >= 0, got ", max_rows);
  MOE_CHECK(num_experts >= 1 && num_experts <= kGroupedGemmMaxExperts, op, ": num_experts must be in [1, ",
            kGroupedGemmMaxExperts, "], got ", num_experts);
  MOE_CHECK(d > 0 && d % 8 == 0 && inner > 0 && inner % 8 == 0, op,
            ": d and inner must be positive multiples of 8 (grouped GEMM rows move in 16-byte chunks), got d=", d,
            " inner=", inner);
}

void check_ptrs(const char* op, std::initializer_list<Span> spans) {
  for (const Span& s : spans) {
    MOE_CHECK(s.ptr != nullptr, op, ": argument '", s.name, "' is a null device pointer");
    MOE_CHECK(reinterpret_cast<uintptr_t>(s.ptr) % 16 == 0, op, ": argument '", s.name,
              "' must be 16-byte aligned, got address ", s.ptr);
  }
}

// What both backwards do first: the size checks; with no rows, the weight gradients left as they
// are (accumulate) or zeroed, and false (nothing more to do); else the workspace size, the
// activation pointers, and dx_sorted either dy itself (in place) or overlapping nothing the
// backward still reads. The weights are the caller's to check (BF16 tensors or FP8 codes).
bool backward_prologue(const char* op, const uint16_t* x_sorted, const int32_t* expert_offsets,
                       const uint16_t* gate_up, const uint16_t* h, const uint16_t* dy, int64_t max_rows,
                       int64_t num_experts, int64_t d, int64_t inner, const uint16_t* dx_sorted, float* dw_gate_up,
                       float* dw_down, const void* workspace, size_t workspace_bytes, Stream stream,
                       bool accumulate_dw, GroupedGemmBackend backend, const ExpertGradSquares& squares) {
  check_sizes(op, max_rows, num_experts, d, inner);
  MOE_CHECK(!accumulate_dw || (squares.gate_up == nullptr && squares.down == nullptr), op,
            ": square sums are written with the weight gradients (accumulate_dw = false); with accumulate_dw they "
            "would miss what the gradients held, so pass none");
  if (max_rows == 0) {
    // No rows: accumulate leaves the weight gradients as they are, overwrite zeroes them (and their sums).
    if (!accumulate_dw) {
      if (dw_down != nullptr)
        grouped_gemm_wgrad(nullptr, nullptr, nullptr, dw_down, 0, num_experts, d, inner, false, stream, backend,
                           squares.down);
      if (dw_gate_up != nullptr)
        grouped_gemm_wgrad(nullptr, nullptr, nullptr, dw_gate_up, 0, num_experts, 2 * inner, d, false, stream, backend,
                           squares.gate_up);
    }
    return false;
  }
  const size_t need = experts_backward_workspace_bytes(max_rows, inner);
  MOE_CHECK(workspace_bytes >= need, op, ": workspace of ", workspace_bytes, " bytes, ", need,
            " needed: size it with experts_backward_workspace_bytes(max_rows, inner)");
  check_ptrs(op, {{"x_sorted", x_sorted, 0}, {"gate_up", gate_up, 0}, {"h", h, 0}, {"dy", dy, 0},
                  {"dx_sorted", dx_sorted, 0}, {"workspace", workspace, 0}});
  MOE_CHECK(expert_offsets != nullptr, op, ": argument 'expert_offsets' is a null device pointer");
  const size_t rows = static_cast<size_t>(max_rows), bf16 = sizeof(uint16_t);
  const Span dx{"dx_sorted", dx_sorted, rows * d * bf16};
  if (dx_sorted != dy) {
    const Span dys{"dy", dy, rows * d * bf16};
    MOE_CHECK(!overlap(dx, dys), op,
              ": dx_sorted overlaps dy without being equal to it (in place means dx_sorted == dy)");
  }
  for (const Span& s : {Span{"x_sorted", x_sorted, rows * d * bf16}, Span{"gate_up", gate_up, rows * 2 * inner * bf16},
                        Span{"h", h, rows * inner * bf16}, Span{"workspace", workspace, need}}) {
    MOE_CHECK(!overlap(dx, s), op, ": dx_sorted overlaps '", s.name, "', which the backward still reads");
  }
  return true;
}

}  // namespace

void experts_forward(const uint16_t* x_sorted, const int32_t* expert_offsets, const uint16_t* w_gate_up,
                     const uint16_t* w_down, int64_t max_rows, int64_t num_experts, int64_t d, int64_t inner,
                     uint16_t* gate_up, uint16_t* h, uint16_t* y, Stream stream, GroupedGemmBackend backend) {
  const char* op = "cuda::experts_forward";
  check_sizes(op, max_rows, num_experts, d, inner);
  if (max_rows == 0) return;
  check_ptrs(op, {{"x_sorted", x_sorted, 0}, {"w_gate_up", w_gate_up, 0}, {"w_down", w_down, 0},
                  {"gate_up", gate_up, 0}, {"h", h, 0}, {"y", y, 0}});
  MOE_CHECK(expert_offsets != nullptr, op, ": argument 'expert_offsets' is a null device pointer");
  grouped_gemm_forward(x_sorted, w_gate_up, expert_offsets, gate_up, max_rows, num_experts, 2 * inner, d, stream,
                       backend);
  swiglu_forward(gate_up, h, max_rows, inner, stream);
  grouped_gemm_forward(h, w_down, expert_offsets, y, max_rows, num_experts, d, inner, stream, backend);
}

void experts_recompute(const uint16_t* gate_up, const int32_t* expert_offsets, const uint16_t* w_down,
                       int64_t max_rows, int64_t num_experts, int64_t d, int64_t inner, uint16_t* h, uint16_t* y,
                       Stream stream, GroupedGemmBackend backend) {
  const char* op = "cuda::experts_recompute";
  check_sizes(op, max_rows, num_experts, d, inner);
  if (max_rows == 0) return;
  check_ptrs(op, {{"gate_up", gate_up, 0}, {"h", h, 0}});
  swiglu_forward(gate_up, h, max_rows, inner, stream);
  if (y == nullptr) return;
  check_ptrs(op, {{"w_down", w_down, 0}, {"y", y, 0}});
  MOE_CHECK(expert_offsets != nullptr, op, ": argument 'expert_offsets' is a null device pointer");
  grouped_gemm_forward(h, w_down, expert_offsets, y, max_rows, num_experts, d, inner, stream, backend);
}

size_t experts_backward_workspace_bytes(int64_t max_rows, int64_t inner) {
  MOE_CHECK(max_rows >= 0 && inner >= 0, "cuda::experts_backward_workspace_bytes: max_rows and inner must be >= 0, "
            "got ", max_rows, " and ", inner);
  return static_cast<size_t>(max_rows) * static_cast<size_t>(3 * inner) * sizeof(uint16_t);
}

void experts_backward(const uint16_t* x_sorted, const int32_t* expert_offsets, const uint16_t* w_gate_up,
                      const uint16_t* w_down, const uint16_t* gate_up, const uint16_t* h, const uint16_t* dy,
                      int64_t max_rows, int64_t num_experts, int64_t d, int64_t inner, uint16_t* dx_sorted,
                      float* dw_gate_up, float* dw_down, void* workspace, size_t workspace_bytes, Stream stream,
                      GroupedGemmBackend backend, bool accumulate_dw, const ExpertGradSquares& squares) {
  const char* op = "cuda::experts_backward";
  if (!backward_prologue(op, x_sorted, expert_offsets, gate_up, h, dy, max_rows, num_experts, d, inner, dx_sorted,
                         dw_gate_up, dw_down, workspace, workspace_bytes, stream, accumulate_dw, backend, squares)) {
    return;
  }
  check_ptrs(op, {{"w_gate_up", w_gate_up, 0}, {"w_down", w_down, 0}});
  const size_t rows = static_cast<size_t>(max_rows);
  uint16_t* dgate_up = static_cast<uint16_t*>(workspace);   // [R, 2I]
  uint16_t* dh = dgate_up + rows * 2 * static_cast<size_t>(inner);  // [R, I]
  grouped_gemm_dgrad(dy, w_down, expert_offsets, dh, max_rows, num_experts, d, inner, stream, backend);
  if (dw_down != nullptr) {
    grouped_gemm_wgrad(dy, h, expert_offsets, dw_down, max_rows, num_experts, d, inner, accumulate_dw, stream, backend,
                       squares.down);
  }
  swiglu_backward(gate_up, dh, dgate_up, max_rows, inner, stream);
  // dx is written only now: every read of dy (which it may be) is enqueued above.
  grouped_gemm_dgrad(dgate_up, w_gate_up, expert_offsets, dx_sorted, max_rows, num_experts, 2 * inner, d, stream,
                     backend);
  if (dw_gate_up != nullptr) {
    grouped_gemm_wgrad(dgate_up, x_sorted, expert_offsets, dw_gate_up, max_rows, num_experts, 2 * inner, d,
                       accumulate_dw, stream, backend, squares.gate_up);
  }
}

namespace {

// The FP8 workspace's two parts: codes [R, max(D, 2I)], then (16-byte aligned) the scales.
struct Fp8Workspace {
  uint8_t* codes;
  float* scales;
};

size_t fp8_codes_bytes(int64_t max_rows, int64_t d, int64_t inner) {
  return (static_cast<size_t>(max_rows) * static_cast<size_t>(std::max(d, 2 * inner)) + 15) / 16 * 16;
}

Fp8Workspace split_fp8_workspace(const char* op, void* ws, size_t bytes, int64_t max_rows, int64_t d, int64_t inner) {
  const size_t need = experts_fp8_workspace_bytes(max_rows, d, inner);
  MOE_CHECK(bytes >= need, op, ": FP8 workspace of ", bytes, " bytes, ", need,
            " needed: size it with experts_fp8_workspace_bytes(max_rows, d, inner)");
  MOE_CHECK(ws != nullptr && reinterpret_cast<uintptr_t>(ws) % 16 == 0, op,
            ": the FP8 workspace must be a non-null 16-byte aligned device pointer");
  uint8_t* base = static_cast<uint8_t*>(ws);
  return {base, reinterpret_cast<float*>(base + fp8_codes_bytes(max_rows, d, inner))};
}

void check_fp8_weights(const char* op, const Fp8ExpertWeights& w) {
  for (const auto& [name, p] : {std::pair<const char*, const void*>{"gate_up", w.gate_up}, {"s_gate_up", w.s_gate_up},
                                {"gate_up_t", w.gate_up_t}, {"s_gate_up_t", w.s_gate_up_t}, {"down", w.down},
                                {"s_down", w.s_down}, {"down_t", w.down_t}, {"s_down_t", w.s_down_t}}) {
    MOE_CHECK(p != nullptr, op, ": the FP8 weights' '", name, "' is a null device pointer");
  }
}

// out = in @ B_e^T in FP8: in [R, k_red] BF16 quantised into the workspace, then the grouped GEMM.
void fp8_grouped(const uint16_t* in, const uint8_t* qb, const float* sb, const int32_t* offsets, uint16_t* out,
                 int64_t max_rows, int64_t num_experts, int64_t n_out, int64_t k_red, const Fp8Workspace& ws,
                 Fp8Rule rule, Stream stream) {
  fp8_quantize_blocks(in, max_rows, k_red, kFp8ActivationBlock, Fp8Format::kE4M3, ws.codes, ws.scales, nullptr,
                      stream, rule);
  grouped_gemm_fp8(ws.codes, ws.scales, qb, sb, offsets, out, max_rows, num_experts, n_out, k_red, stream);
}

// h = SwiGLU(gate_up) and y = h @ W_down[e]^T in FP8: forward and recompute run exactly this.
void swiglu_down_fp8(const uint16_t* gate_up, const int32_t* offsets, const Fp8ExpertWeights& w, int64_t max_rows,
                     int64_t num_experts, int64_t d, int64_t inner, uint16_t* h, uint16_t* y, const Fp8Workspace& ws,
                     Stream stream) {
  if (inner % 128 == 0) {  // SwiGLU writes h's codes too: no quantisation pass over h
    swiglu_forward_fp8(gate_up, h, ws.codes, ws.scales, max_rows, inner, stream, w.rule);
    grouped_gemm_fp8(ws.codes, ws.scales, w.down, w.s_down, offsets, y, max_rows, num_experts, d, inner, stream);
  } else {
    swiglu_forward(gate_up, h, max_rows, inner, stream);
    fp8_grouped(h, w.down, w.s_down, offsets, y, max_rows, num_experts, d, inner, ws, w.rule, stream);
  }
}

// The FP8 weight gradient's workspace: A codes [max(D, 2I), capacity], B codes [max(D, I),
// capacity], their scales [capacity / 128, rows] and the padded offsets [E + 1], each 16-byte aligned.
struct Fp8WgradWorkspace {
  uint8_t* a;
  uint8_t* b;
  float* sa;
  float* sb;
  int32_t* padded;
  int64_t capacity;
};

size_t align16(size_t bytes) { return (bytes + 15) / 16 * 16; }

Fp8WgradWorkspace fp8_wgrad_layout(void* base_ptr, int64_t max_rows, int64_t num_experts, int64_t d, int64_t inner,
                                   size_t* total) {
  const int64_t capacity = fp8_expert_columns_capacity(max_rows, num_experts);
  const size_t rows_a = static_cast<size_t>(std::max(d, 2 * inner)), rows_b = static_cast<size_t>(std::max(d, inner));
  const size_t cap = static_cast<size_t>(capacity), blocks = cap / 128;
  uint8_t* base = static_cast<uint8_t*>(base_ptr);
  size_t at = 0;
  const auto take = [&](size_t bytes) {
    uint8_t* p = base == nullptr ? nullptr : base + at;
    at += align16(bytes);
    return p;
  };
  Fp8WgradWorkspace w{};
  w.a = take(rows_a * cap);
  w.b = take(rows_b * cap);
  w.sa = reinterpret_cast<float*>(take(blocks * rows_a * sizeof(float)));
  w.sb = reinterpret_cast<float*>(take(blocks * rows_b * sizeof(float)));
  w.padded = reinterpret_cast<int32_t*>(take(static_cast<size_t>(num_experts + 1) * sizeof(int32_t)));
  w.capacity = capacity;
  if (total != nullptr) *total = at;
  return w;
}

// dw (+)= a^T b per expert in FP8: a [R, n] and b [R, k] quantised down each expert's rows.
void fp8_wgrad(const uint16_t* a, const uint16_t* b, const int32_t* offsets, float* dw, int64_t max_rows,
               int64_t num_experts, int64_t n, int64_t k, bool accumulate, const Fp8WgradWorkspace& ws, Stream stream) {
  fp8_quantize_expert_columns(a, offsets, max_rows, num_experts, n, ws.capacity, Fp8Format::kE4M3, ws.a, ws.sa,
                              ws.padded, nullptr, stream);
  fp8_quantize_expert_columns(b, offsets, max_rows, num_experts, k, ws.capacity, Fp8Format::kE4M3, ws.b, ws.sb,
                              ws.padded, nullptr, stream);
  grouped_gemm_fp8_wgrad(ws.a, ws.sa, ws.b, ws.sb, ws.padded, dw, num_experts, n, k, ws.capacity, accumulate, stream);
}

}  // namespace

bool experts_fp8_wgrad_applies(int64_t d, int64_t inner) {
  return d > 0 && inner > 0 && d % 128 == 0 && inner % 128 == 0;
}

size_t experts_fp8_wgrad_workspace_bytes(int64_t max_rows, int64_t num_experts, int64_t d, int64_t inner) {
  MOE_CHECK(max_rows >= 0 && num_experts > 0 && d >= 0 && inner >= 0, "cuda::experts_fp8_wgrad_workspace_bytes: ",
            "expected max_rows, d, inner >= 0 and num_experts > 0, got ", max_rows, ", ", num_experts, ", ", d, ", ",
            inner);
  if (!experts_fp8_wgrad_applies(d, inner)) return 0;
  size_t total = 0;
  fp8_wgrad_layout(nullptr, max_rows, num_experts, d, inner, &total);
  return total;
}

size_t experts_fp8_workspace_bytes(int64_t max_rows, int64_t d, int64_t inner) {
  MOE_CHECK(max_rows >= 0 && d >= 0 && inner >= 0, "cuda::experts_fp8_workspace_bytes: sizes must be >= 0, got ",
            max_rows, ", ", d, ", ", inner);
  const int64_t widest = std::max(d, 2 * inner);
  return fp8_codes_bytes(max_rows, d, inner) +
         static_cast<size_t>(max_rows) * static_cast<size_t>((widest + 127) / 128) * sizeof(float);
}

Fp8Rows experts_fp8_input_rows(void* fp8_workspace, size_t fp8_workspace_bytes, int64_t max_rows, int64_t d,
                               int64_t inner) {
  const char* op = "cuda::experts_fp8_input_rows";
  MOE_CHECK(max_rows >= 0 && d > 0 && d % 128 == 0 && inner >= 0, op, ": expected max_rows >= 0, inner >= 0 and d "
            "a positive multiple of 128 (whole 1 x 128 blocks), got ", max_rows, ", ", d, ", ", inner);
  const Fp8Workspace ws = split_fp8_workspace(op, fp8_workspace, fp8_workspace_bytes, max_rows, d, inner);
  return {ws.codes, ws.scales};
}

void experts_forward_fp8(const uint16_t* x_sorted, const int32_t* expert_offsets, const Fp8ExpertWeights& w,
                         int64_t max_rows, int64_t num_experts, int64_t d, int64_t inner, uint16_t* gate_up,
                         uint16_t* h, uint16_t* y, void* fp8_workspace, size_t fp8_workspace_bytes, Stream stream,
                         bool input_quantised) {
  const char* op = "cuda::experts_forward_fp8";
  check_sizes(op, max_rows, num_experts, d, inner);
  if (max_rows == 0) return;
  check_ptrs(op, {{"x_sorted", x_sorted, 0}, {"gate_up", gate_up, 0}, {"h", h, 0}, {"y", y, 0}});
  check_fp8_weights(op, w);
  MOE_CHECK(expert_offsets != nullptr, op, ": argument 'expert_offsets' is a null device pointer");
  const Fp8Workspace ws = split_fp8_workspace(op, fp8_workspace, fp8_workspace_bytes, max_rows, d, inner);
  MOE_CHECK(!input_quantised || d % 128 == 0, op, ": input_quantised needs d a multiple of 128, got ", d);
  if (input_quantised) {  // x_sorted's producer wrote its codes into the workspace
    grouped_gemm_fp8(ws.codes, ws.scales, w.gate_up, w.s_gate_up, expert_offsets, gate_up, max_rows, num_experts,
                     2 * inner, d, stream);
  } else {
    fp8_grouped(x_sorted, w.gate_up, w.s_gate_up, expert_offsets, gate_up, max_rows, num_experts, 2 * inner, d, ws,
                w.rule, stream);
  }
  swiglu_down_fp8(gate_up, expert_offsets, w, max_rows, num_experts, d, inner, h, y, ws, stream);
}

void experts_recompute_fp8(const uint16_t* gate_up, const int32_t* expert_offsets, const Fp8ExpertWeights& w,
                           int64_t max_rows, int64_t num_experts, int64_t d, int64_t inner, uint16_t* h, uint16_t* y,
                           void* fp8_workspace, size_t fp8_workspace_bytes, Stream stream) {
  const char* op = "cuda::experts_recompute_fp8";
  check_sizes(op, max_rows, num_experts, d, inner);
  if (max_rows == 0) return;
  check_ptrs(op, {{"gate_up", gate_up, 0}, {"h", h, 0}});
  if (y == nullptr) {  // h alone: swiglu_forward_fp8's h is swiglu_forward's, bitwise
    swiglu_forward(gate_up, h, max_rows, inner, stream);
    return;
  }
  check_ptrs(op, {{"y", y, 0}});
  MOE_CHECK(w.down != nullptr && w.s_down != nullptr, op, ": the FP8 weights' 'down' codes and scales are needed for y");
  MOE_CHECK(expert_offsets != nullptr, op, ": argument 'expert_offsets' is a null device pointer");
  const Fp8Workspace ws = split_fp8_workspace(op, fp8_workspace, fp8_workspace_bytes, max_rows, d, inner);
  swiglu_down_fp8(gate_up, expert_offsets, w, max_rows, num_experts, d, inner, h, y, ws, stream);
}

void experts_backward_fp8(const uint16_t* x_sorted, const int32_t* expert_offsets, const Fp8ExpertWeights& w,
                          const uint16_t* gate_up, const uint16_t* h, const uint16_t* dy, int64_t max_rows,
                          int64_t num_experts, int64_t d, int64_t inner, uint16_t* dx_sorted, float* dw_gate_up,
                          float* dw_down, void* workspace, size_t workspace_bytes, void* fp8_workspace,
                          size_t fp8_workspace_bytes, Stream stream, bool accumulate_dw, bool input_quantised,
                          void* wgrad_workspace, size_t wgrad_workspace_bytes, const ExpertGradSquares& squares) {
  const char* op = "cuda::experts_backward_fp8";
  MOE_CHECK(wgrad_workspace == nullptr || (squares.gate_up == nullptr && squares.down == nullptr), op,
            ": square sums come with the BF16 weight gradients; with a wgrad workspace (FP8 weight gradients) pass "
            "none");
  if (!backward_prologue(op, x_sorted, expert_offsets, gate_up, h, dy, max_rows, num_experts, d, inner, dx_sorted,
                         dw_gate_up, dw_down, workspace, workspace_bytes, stream, accumulate_dw,
                         GroupedGemmBackend::kAuto, squares)) {
    return;
  }
  check_fp8_weights(op, w);
  const Fp8Workspace ws = split_fp8_workspace(op, fp8_workspace, fp8_workspace_bytes, max_rows, d, inner);
  const bool fp8_dw = wgrad_workspace != nullptr;
  Fp8WgradWorkspace wws{};
  if (fp8_dw) {
    MOE_CHECK(w.rule == Fp8Rule::kBlocks, op, ": the FP8 weight gradients quantise in the block recipe's 1 x 128 ",
              "blocks; under an MX rule pass no wgrad workspace");
    MOE_CHECK(experts_fp8_wgrad_applies(d, inner), op, ": the FP8 weight gradients need d and inner multiples of ",
              "128, got ", d, " and ", inner, "; pass no wgrad workspace");
    const size_t need = experts_fp8_wgrad_workspace_bytes(max_rows, num_experts, d, inner);
    MOE_CHECK(wgrad_workspace_bytes >= need && reinterpret_cast<uintptr_t>(wgrad_workspace) % 16 == 0, op,
              ": the FP8 weight gradients' workspace has ", wgrad_workspace_bytes, " bytes, ", need, " needed ",
              "(experts_fp8_wgrad_workspace_bytes), 16-byte aligned");
    wws = fp8_wgrad_layout(wgrad_workspace, max_rows, num_experts, d, inner, nullptr);
  }
  // dw [E, n, k] (+)= a^T b per expert (a [R, n], b [R, k]): FP8 with a wgrad workspace, else BF16.
  const auto wgrad = [&](const uint16_t* a, const uint16_t* b, float* dw, int64_t n, int64_t k, double* sq) {
    if (dw == nullptr) return;
    if (fp8_dw) {
      fp8_wgrad(a, b, expert_offsets, dw, max_rows, num_experts, n, k, accumulate_dw, wws, stream);
    } else {
      grouped_gemm_wgrad(a, b, expert_offsets, dw, max_rows, num_experts, n, k, accumulate_dw, stream,
                         GroupedGemmBackend::kAuto, sq);
    }
  };
  const size_t rows = static_cast<size_t>(max_rows);
  uint16_t* dgate_up = static_cast<uint16_t*>(workspace);           // [R, 2I]
  uint16_t* dh = dgate_up + rows * 2 * static_cast<size_t>(inner);  // [R, I]
  // dh = dy @ W_down[e]: the transposed codes [E, I, D] as B (n_out = I, k_red = D).
  MOE_CHECK(!input_quantised || d % 128 == 0, op, ": input_quantised needs d a multiple of 128, got ", d);
  if (input_quantised) {  // dy's producer wrote its codes into the workspace
    grouped_gemm_fp8(ws.codes, ws.scales, w.down_t, w.s_down_t, expert_offsets, dh, max_rows, num_experts, inner, d,
                     stream);
  } else {
    fp8_grouped(dy, w.down_t, w.s_down_t, expert_offsets, dh, max_rows, num_experts, inner, d, ws, w.rule, stream);
  }
  wgrad(dy, h, dw_down, d, inner, squares.down);
  // dx = dgate_up @ W_gate_up[e] (B: [E, D, 2I]); dy (which dx may be) was read in full above.
  if (inner % 128 == 0) {  // the SwiGLU backward writes dgate_up's codes too
    swiglu_backward_fp8(gate_up, dh, dgate_up, ws.codes, ws.scales, max_rows, inner, stream, w.rule);
    grouped_gemm_fp8(ws.codes, ws.scales, w.gate_up_t, w.s_gate_up_t, expert_offsets, dx_sorted, max_rows,
                     num_experts, d, 2 * inner, stream);
  } else {
    swiglu_backward(gate_up, dh, dgate_up, max_rows, inner, stream);
    fp8_grouped(dgate_up, w.gate_up_t, w.s_gate_up_t, expert_offsets, dx_sorted, max_rows, num_experts, d,
                2 * inner, ws, w.rule, stream);
  }
  wgrad(dgate_up, x_sorted, dw_gate_up, 2 * inner, d, squares.gate_up);
}

}  // namespace moe::cuda
