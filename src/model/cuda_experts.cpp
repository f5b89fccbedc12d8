// CudaLocalExperts and CudaEpExperts of cuda_experts.h. Local: one cuda::experts_forward /
// _backward per MoE layer on the dispatched rows and the device offsets. Expert-parallel: counts
// all-to-all and host read, cuda::make_ep_handle, dispatch, regroup gather, cuda::experts_* on the
// local experts with the handle's local offsets, ungroup gather, combine (docs/parallel.md).
// Legend: D model width, E experts, I expert hidden, R routed rows, L local experts, G received rows.
#ifdef MOECORE_HAS_CUDA

#include "model/cuda_experts.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/square_blocks.h"
#include "cuda/ops/ep_placement.h"
#include "cuda/ops/ep_rowwise.h"
#include "cuda/ops/experts.h"
#include "cuda/ops/fp8.h"
#include "cuda/ops/nvshmem_world.h"
#include "cuda/ops/nccl.h"

namespace moe {

void CudaExperts::forward_tokens(const CudaBlockContext&, int64_t, const LayerParams&, const int32_t*, const int32_t*,
                                 const uint16_t*, const int32_t*, int64_t, int64_t, uint16_t*) {
  MOE_FAIL("CudaExperts::forward_tokens: these experts read sorted rows (takes_token_rows() is false)");
}

void CudaExperts::backward_tokens(const CudaBlockContext&, int64_t, const LayerParams&, const int32_t*,
                                  const uint16_t*, const int32_t*, int64_t, int64_t, int64_t, uint16_t*) {
  MOE_FAIL("CudaExperts::backward_tokens: these experts write sorted rows (takes_token_rows() is false)");
}

void CudaExperts::set_fp8(bool on, Fp8Rule) {
  MOE_CHECK(!on, "train.precision = \"fp8\": these experts have no FP8 path");
}

void CudaExperts::place_fp8_codes(const std::vector<LayerParams>&, uint16_t*, const float*) {
  MOE_FAIL("CudaExperts::place_fp8_codes: these experts keep no FP8 weight codes that their update writes");
}

namespace {

cuda::Fp8ExpertWeights fp8_view(const CudaFp8ExpertCodes& q, Fp8Rule rule) {
  cuda::Fp8ExpertWeights w;
  w.rule = rule;
  w.gate_up = q.q_gate_up;
  w.s_gate_up = q.s_gate_up.as<float>();
  w.gate_up_t = q.q_gate_up_t;
  w.s_gate_up_t = q.s_gate_up_t.as<float>();
  w.down = q.q_down;
  w.s_down = q.s_down.as<float>();
  w.down_t = q.q_down_t;
  w.s_down_t = q.s_down_t.as<float>();
  return w;
}

int64_t blocks128(int64_t n) { return (n + 127) / 128; }

// The MX rules quantise whole 128-wide blocks only (cuda::fp8_quantize_blocks, fp8_quantize_weights).
void check_fp8_rule(bool on, Fp8Rule rule, int64_t d, int64_t inner) {
  MOE_CHECK(!on || rule == Fp8Rule::kBlocks || fp8_mx_experts_shapes(d, inner),
            "train.fp8_scaling = \"mx\" on the GPU: the MX codes are re-blocked into whole 1 x 128 and 128 x 128 ",
            "blocks, so model.d_model (", d, ") and moe.expert_hidden (", inner, ") must be multiples of 128");
}

}  // namespace

void CudaFp8ExpertCodeSet::place(const std::vector<LayerParams>& layers, uint16_t* bf16, const float* f32) {
  MOE_CHECK(experts_ == 0 && !placed(), "CudaFp8ExpertCodeSet::place: the codes are reserved or placed already");
  MOE_CHECK(bf16 != nullptr && f32 != nullptr, "CudaFp8ExpertCodeSet::place: null parameters");
  for (const LayerParams& p : layers) {
    MOE_CHECK(p.moe_index >= 0 && p.experts_gate_up >= 0 && p.experts_down >= 0 && p.experts_gate_up % 8 == 0 &&
                  p.experts_down % 8 == 0,
              "CudaFp8ExpertCodeSet::place: MoE layer ", p.moe_index, "'s expert weights at offsets ",
              p.experts_gate_up, " and ", p.experts_down, " (expected 8-element aligned offsets: 16-byte codes)");
    if (size_t(p.moe_index) >= codes_.size()) codes_.resize(size_t(p.moe_index) + 1);
    CudaFp8ExpertCodes& q = codes_[size_t(p.moe_index)];
    q.q_gate_up = reinterpret_cast<uint8_t*>(bf16 + p.experts_gate_up);
    q.q_down = reinterpret_cast<uint8_t*>(bf16 + p.experts_down);
  }
  f32_ = f32;
}

void CudaFp8ExpertCodeSet::reserve(int64_t layers, int64_t experts, int64_t d, int64_t inner, CudaBufferGrower& g) {
  MOE_CHECK(!placed() || codes_.size() == size_t(layers), "CudaFp8ExpertCodeSet::reserve: the codes of ",
            codes_.size(), " MoE layers are placed, ", layers, " reserved");
  experts_ = experts, d_ = d, inner_ = inner;
  codes_.resize(size_t(layers));
  const int64_t E = experts, D = d, I2 = 2 * inner, I = inner;
  for (size_t m = 0; m < codes_.size(); ++m) {
    CudaFp8ExpertCodes& q = codes_[m];
    g.grow<float>(q.s_gate_up, E * blocks128(I2) * blocks128(D), "FP8 expert gate_up scales");
    g.grow<float>(q.s_gate_up_t, E * blocks128(D) * blocks128(I2), "FP8 expert gate_up transposed scales");
    g.grow<float>(q.s_down, E * blocks128(D) * blocks128(I), "FP8 expert down scales");
    g.grow<float>(q.s_down_t, E * blocks128(I) * blocks128(D), "FP8 expert down transposed scales");
    if (placed()) {  // the codes, then the transposed codes, where the tensor's BF16 copy was
      MOE_CHECK(q.q_gate_up != nullptr && q.q_down != nullptr, "CudaFp8ExpertCodeSet::reserve: MoE layer ", m,
                "'s codes have no place (CudaFp8ExpertCodeSet::place named no such layer)");
      q.q_gate_up_t = q.q_gate_up + E * I2 * D;
      q.q_down_t = q.q_down + E * D * I;
      continue;
    }
    g.grow<uint8_t>(q.gate_up, E * I2 * D, "FP8 expert gate_up codes");
    g.grow<uint8_t>(q.gate_up_t, E * D * I2, "FP8 expert gate_up transposed codes");
    g.grow<uint8_t>(q.down, E * D * I, "FP8 expert down codes");
    g.grow<uint8_t>(q.down_t, E * I * D, "FP8 expert down transposed codes");
    q.q_gate_up = q.gate_up.as<uint8_t>();
    q.q_gate_up_t = q.gate_up_t.as<uint8_t>();
    q.q_down = q.down.as<uint8_t>();
    q.q_down_t = q.down_t.as<uint8_t>();
  }
}

CudaFp8ExpertCodes& CudaFp8ExpertCodeSet::at(int64_t m, const char* what) {
  MOE_CHECK(m >= 0 && m < layers(), what, ": the FP8 codes of MoE layer ", m, " are not reserved (", layers(),
            " layers reserved)");
  return codes_[size_t(m)];
}

void CudaFp8ExpertCodeSet::refresh(const CudaBlockContext& c, int64_t m, const LayerParams& p, cuda::Stream stream) {
  CudaFp8ExpertCodes& q = at(m, "CudaFp8ExpertCodeSet::refresh");
  if (q.version == c.params_version) return;
  if (placed()) {  // the BF16 copy is not kept: the codes of the FP32 weights' BF16 rounding
    cuda::fp8_quantize_weights_bf16_rounded(f32_ + p.experts_gate_up, experts_, 2 * inner_, d_, Fp8Format::kE4M3,
                                            q.q_gate_up, q.s_gate_up.as<float>(), q.q_gate_up_t,
                                            q.s_gate_up_t.as<float>(), nullptr, stream, rule_);
    cuda::fp8_quantize_weights_bf16_rounded(f32_ + p.experts_down, experts_, d_, inner_, Fp8Format::kE4M3, q.q_down,
                                            q.s_down.as<float>(), q.q_down_t, q.s_down_t.as<float>(), nullptr, stream,
                                            rule_);
  } else {
    const uint16_t* P = c.params;
    cuda::fp8_quantize_weights(P + p.experts_gate_up, experts_, 2 * inner_, d_, Fp8Format::kE4M3, q.q_gate_up,
                               q.s_gate_up.as<float>(), q.q_gate_up_t, q.s_gate_up_t.as<float>(), nullptr, stream,
                               rule_);
    cuda::fp8_quantize_weights(P + p.experts_down, experts_, d_, inner_, Fp8Format::kE4M3, q.q_down,
                               q.s_down.as<float>(), q.q_down_t, q.s_down_t.as<float>(), nullptr, stream, rule_);
  }
  q.version = c.params_version;
}

cuda::Fp8ExpertWeights CudaFp8ExpertCodeSet::view(int64_t m) const {
  MOE_CHECK(m >= 0 && m < layers(), "CudaFp8ExpertCodeSet::view: the FP8 codes of MoE layer ", m,
            " are not reserved (", layers(), " layers reserved)");
  return fp8_view(codes_[size_t(m)], rule_);
}

std::vector<CudaFp8ExpertTensor> CudaFp8ExpertCodeSet::tensors(const std::vector<LayerParams>& layers) {
  std::vector<CudaFp8ExpertTensor> out;
  for (const LayerParams& p : layers) {
    CudaFp8ExpertCodes& q = at(p.moe_index, "CudaFp8ExpertCodeSet::tensors");
    out.push_back({p.experts_gate_up, experts_, 2 * inner_, d_, q.q_gate_up, q.s_gate_up.as<float>(), q.q_gate_up_t,
                   q.s_gate_up_t.as<float>(), rule_});
    out.push_back({p.experts_down, experts_, d_, inner_, q.q_down, q.s_down.as<float>(), q.q_down_t,
                   q.s_down_t.as<float>(), rule_});
  }
  return out;
}

void CudaFp8ExpertCodeSet::follow(int64_t from, int64_t to) {
  for (CudaFp8ExpertCodes& q : codes_)
    if (q.version == from) q.version = to;
}

CudaLocalExperts::CudaLocalExperts(const MoeConfig& e, int64_t d, int64_t num_moe_layers)
    : d_(d), e_(e.num_experts), inner_(e.expert_hidden), saved_(static_cast<size_t>(num_moe_layers)) {}

CudaLocalExperts::~CudaLocalExperts() {
  for (cuda::Event ev : ready_) cuda::event_destroy(ev);
  cuda::event_destroy(fork_);
  if (side_ != nullptr) cuda::stream_destroy(side_);
}

void CudaLocalExperts::set_fp8(bool on, Fp8Rule rule) {
  MOE_CHECK(!on || fp8_experts_shapes(d_, inner_), "train.precision = \"fp8\": the FP8 expert GEMMs read rows of ",
            "16 codes, so model.d_model (", d_, ") and moe.expert_hidden (", inner_, ") must be multiples of 16");
  check_fp8_rule(on, rule, d_, inner_);
  fp8_on_ = on;
  fp8_.set_rule(rule);
}

cuda::Fp8Rows CudaLocalExperts::fp8_input_rows(int64_t rows) {
  if (!fp8_on_ || d_ % 128 != 0 || fp8_ws_.data() == nullptr) return {};
  cuda::Fp8Rows in = cuda::experts_fp8_input_rows(fp8_ws_.data(), fp8_ws_.bytes(), rows, d_, inner_);
  in.rule = fp8_.rule();
  return in;
}

void CudaLocalExperts::reserve(int64_t rows, CudaBufferGrower& g) {
  if (saved_.empty()) return;
  for (int64_t m = 0; m < int64_t(saved_.size()); ++m) {
    g.grow<uint16_t>(gate_up_rows(m), rows * 2 * inner_, "expert gate_up");
    g.grow<uint16_t>(h_rows(m), rows * inner_, "expert h");
  }
  g.grow_bytes(ws_, cuda::experts_backward_workspace_bytes(rows, inner_), "expert dgate_up and dh");
  if (!fp8_on_) return;
  fp8_.reserve(int64_t(saved_.size()), e_, d_, inner_, g);
  g.grow_bytes(fp8_ws_, cuda::experts_fp8_workspace_bytes(rows, d_, inner_), "FP8 expert activation codes");
  if (side_ == nullptr) {
    side_ = cuda::stream_create();
    fork_ = cuda::event_create();
  }
  while (ready_.size() < saved_.size()) ready_.push_back(cuda::event_create());
  pending_.resize(saved_.size(), 0);
}

std::vector<CudaFp8ExpertTensor> CudaLocalExperts::fp8_weight_tensors(const std::vector<LayerParams>& layers) {
  if (!fp8_on_) return {};
  return fp8_.tensors(layers);
}

void CudaLocalExperts::fp8_codes_follow(int64_t from, int64_t to) { fp8_.follow(from, to); }

void CudaLocalExperts::refresh_fp8(const CudaBlockContext& c, const std::vector<LayerParams>& layers) {
  if (!fp8_on_) return;
  for (const LayerParams& p : layers) {
    MOE_CHECK(size_t(p.moe_index) >= pending_.size() || !pending_[size_t(p.moe_index)],
              "CudaLocalExperts::refresh_fp8: layer ", p.moe_index,
              "'s codes are being quantised on the side stream (prepare without its forward)");
    fp8_.refresh(c, p.moe_index, p, c.stream);
  }
}

void CudaLocalExperts::place_fp8_codes(const std::vector<LayerParams>& layers, uint16_t* bf16, const float* f32) {
  fp8_.place(layers, bf16, f32);
}

void CudaLocalExperts::prepare(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p) {
  if (!fp8_on_ || side_ == nullptr || pending_[size_t(moe_index)]) return;
  if (moe_index >= fp8_.layers() || fp8_.current(moe_index, c.params_version)) return;
  // The side stream starts after everything c.stream holds so far: the BF16 weights' update (or
  // the wait for it) and every earlier reader of this layer's codes.
  cuda::event_record(fork_, c.stream);
  cuda::stream_wait_event(side_, fork_);
  fp8_.refresh(c, moe_index, p, side_);
  cuda::event_record(ready_[size_t(moe_index)], side_);
  pending_[size_t(moe_index)] = 1;
}

void CudaLocalExperts::forward(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p,
                               const int32_t* /*counts_E*/, const int32_t* offsets_E1, const uint16_t* x_sorted_RD,
                               int64_t rows, uint16_t* y_sorted_RD, bool input_quantised) {
  const uint16_t* P = c.params;
  c.mark(cuda::Phase::kExperts);
  if (fp8_on_) {
    if (pending_[size_t(moe_index)]) {  // prepare quantised the codes on the side stream: join it
      cuda::stream_wait_event(c.stream, ready_[size_t(moe_index)]);
      pending_[size_t(moe_index)] = 0;
    }
    fp8_.refresh(c, moe_index, p, c.stream);  // without prepare (or after a newer version)
    cuda::experts_forward_fp8(x_sorted_RD, offsets_E1, fp8_.view(moe_index), rows, e_, d_, inner_,
                              gate_up_rows(moe_index).as<uint16_t>(), h_rows(moe_index).as<uint16_t>(), y_sorted_RD,
                              fp8_ws_.data(), fp8_ws_.bytes(), c.stream, input_quantised);
    return;
  }
  MOE_CHECK(!input_quantised, "CudaLocalExperts::forward: BF16 experts read no input codes");
  cuda::experts_forward(x_sorted_RD, offsets_E1, P + p.experts_gate_up, P + p.experts_down, rows, e_, d_, inner_,
                        gate_up_rows(moe_index).as<uint16_t>(), h_rows(moe_index).as<uint16_t>(), y_sorted_RD, c.stream);
}

void CudaLocalExperts::recompute(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p,
                                 const int32_t* offsets_E1, int64_t rows, uint16_t* y_sorted_RD) {
  if (fp8_on_) {  // the codes the forward used (the parameters do not change between the two)
    cuda::experts_recompute_fp8(gate_up_rows(moe_index).as<uint16_t>(), offsets_E1,
                                fp8_.view(moe_index), rows, e_, d_, inner_,
                                h_rows(moe_index).as<uint16_t>(), y_sorted_RD, fp8_ws_.data(), fp8_ws_.bytes(),
                                c.stream);
    return;
  }
  cuda::experts_recompute(gate_up_rows(moe_index).as<uint16_t>(), offsets_E1, c.params + p.experts_down, rows, e_, d_,
                          inner_, h_rows(moe_index).as<uint16_t>(), y_sorted_RD, c.stream);
}

void CudaLocalExperts::backward(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p,
                                const int32_t* offsets_E1, const uint16_t* x_sorted_RD, const uint16_t* dy_sorted_RD,
                                int64_t rows, uint16_t* dx_sorted_RD, bool input_quantised) {
  const uint16_t* P = c.params;
  float* Gr = c.grads;
  c.mark(cuda::Phase::kExperts);
  cuda::ExpertGradSquares squares;
  if (c.expert_grad_squares != nullptr) {
    squares.gate_up = c.expert_grad_squares + moe_index * expert_square_blocks(e_, d_, inner_);
    squares.down = squares.gate_up + square_blocks(e_, 2 * inner_, d_);
  }
  if (fp8_on_) {
    cuda::experts_backward_fp8(x_sorted_RD, offsets_E1, fp8_.view(moe_index),
                               gate_up_rows(moe_index).as<uint16_t>(), h_rows(moe_index).as<uint16_t>(), dy_sorted_RD,
                               rows, e_, d_, inner_, dx_sorted_RD, Gr + p.experts_gate_up, Gr + p.experts_down,
                               ws_.data(), ws_.bytes(), fp8_ws_.data(), fp8_ws_.bytes(), c.stream, !c.overwrite_grads,
                               input_quantised, nullptr, 0, squares);
    return;
  }
  MOE_CHECK(!input_quantised, "CudaLocalExperts::backward: BF16 experts read no input codes");
  cuda::experts_backward(x_sorted_RD, offsets_E1, P + p.experts_gate_up, P + p.experts_down,
                         gate_up_rows(moe_index).as<uint16_t>(), h_rows(moe_index).as<uint16_t>(), dy_sorted_RD, rows, e_, d_, inner_,
                         dx_sorted_RD, Gr + p.experts_gate_up, Gr + p.experts_down, ws_.data(), ws_.bytes(),
                         c.stream, cuda::GroupedGemmBackend::kAuto, !c.overwrite_grads, squares);
}

CudaEpExperts::CudaEpExperts(const MoeConfig& e, int64_t d, int64_t num_moe_layers, cuda::NcclComm& comm,
                             int64_t local_experts, CudaBufferGrower& grower)
    : d_(d),
      e_(e.num_experts),
      inner_(e.expert_hidden),
      local_(local_experts),
      comm_(comm),
      grower_(grower),
      saved_(static_cast<size_t>(num_moe_layers)) {}

void CudaEpExperts::reserve(int64_t rows, CudaBufferGrower& g) {
  if (saved_.empty()) return;
  const int64_t d = d_, inner = inner_;
  for (int64_t m = 0; m < int64_t(saved_.size()); ++m) {
    CudaEpExpertsSaved& s = saved_[size_t(m)];
    g.grow<uint16_t>(gate_up_rows(m), rows * 2 * inner, "expert gate_up");
    g.grow<uint16_t>(h_rows(m), rows * inner, "expert h");
    g.grow<uint16_t>(s.x_GD, rows * d, "received expert rows");
    g.grow<int32_t>(s.regroup_G, rows, "regroup map");
    g.grow<int32_t>(s.ungroup_G, rows, "ungroup map");
    g.grow<int32_t>(s.local_offsets_L1, local_ + 1, "local expert offsets");
  }
  g.grow<int32_t>(recv_counts_E, e_, "received expert counts");
  g.grow<uint16_t>(pm_GD, rows * d, "exchanged rows");
  g.grow<uint16_t>(work_GD, rows * d, "expert work rows");
  g.grow_bytes(ws_, cuda::experts_backward_workspace_bytes(rows, inner), "expert dgate_up and dh");
  if (!fp8_on_) return;
  fp8_.reserve(int64_t(saved_.size()), local_, d, inner, g);
  g.grow_bytes(send_RP, size_t(rows * cuda::fp8_row_payload_bytes(d)), "FP8 row payloads sent");
  grow_fp8(rows);
}

void CudaEpExperts::set_fp8(bool on, Fp8Rule rule) {
  MOE_CHECK(!on || (d_ % 128 == 0 && fp8_experts_shapes(d_, inner_)), "train.precision = \"fp8\" with expert ",
            "parallelism: the exchange's FP8 rows are whole 1 x 128 blocks, so model.d_model (", d_, ") must be a ",
            "multiple of 128 and moe.expert_hidden (", inner_, ") of 16");
  check_fp8_rule(on, rule, d_, inner_);
  fp8_on_ = on;
  fp8_.set_rule(rule);
}

void CudaEpExperts::grow_fp8(int64_t rows) {
  const int64_t n = std::max<int64_t>(rows, 1);
  CudaBufferGrower& g = grower_;
  const size_t ws = cuda::experts_fp8_workspace_bytes(n, d_, inner_);
  if (fp8_ws_.bytes() < ws) {  // scratch between the passes: released first, never both held
    g.release(fp8_ws_);
    g.grow_bytes(fp8_ws_, cuda::experts_fp8_workspace_bytes(n + n / 8, d_, inner_), "FP8 expert activation codes");
  }
}

void CudaEpExperts::dispatch_fp8(const cuda::EpHandle& h, const CudaEpExpertsSaved& s, const uint16_t* rows_RD,
                                 int64_t rows, uint16_t* values, cuda::Stream st) {
  const int64_t d = d_, G = h.total_recv, per = cuda::fp8_row_payload_bytes(d);
  MOE_CHECK(send_RP.bytes() >= size_t(rows * per), "CudaEpExperts: ", rows, " rows to send, the FP8 payload buffer ",
            "holds ", send_RP.bytes() / size_t(per));
  MOE_CHECK(per % 2 == 0 && pm_GD.bytes() >= size_t(G * per) && work_GD.bytes() >= size_t(G * per),
            "CudaEpExperts: the exchange buffers do not hold ", G, " FP8 payload rows");
  uint8_t* send = send_RP.as<uint8_t>();
  cuda::fp8_pack_rows(rows_RD, rows, d, Fp8Format::kE4M3, send, nullptr, st, 0, fp8_.rule());
  // The payload rows travel as per / 2 16-bit words (their bits unchanged).
  uint16_t* pm = pm_GD.as<uint16_t>();
  uint16_t* grouped = work_GD.as<uint16_t>();
  cuda::ep_dispatch_rows(comm_, h, reinterpret_cast<const uint16_t*>(send), pm, per / 2, st);
  cuda::ep_gather_rows(pm, s.regroup_G.as<int32_t>(), G, G, per / 2, grouped, st);
  const cuda::Fp8Rows in = cuda::experts_fp8_input_rows(fp8_ws_.data(), fp8_ws_.bytes(), std::max<int64_t>(G, 1), d,
                                                         inner_);
  cuda::fp8_unpack_rows(reinterpret_cast<const uint8_t*>(grouped), G, d, Fp8Format::kE4M3, in.codes, in.scales,
                        values, st);
}

// One MoE layer's forward after the dispatch permute: x_sorted_RD [R, D] rows sorted by global
// expert; y_sorted_RD [R, D] receives the expert outputs in the same order.
void CudaEpExperts::forward(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p,
                            const int32_t* counts_E, const int32_t* /*offsets_E1*/, const uint16_t* x_sorted_RD,
                            int64_t rows, uint16_t* y_sorted_RD, bool input_quantised) {
  MOE_CHECK(!input_quantised, "CudaEpExperts::forward: the exchange carries BF16 rows, no input codes");
  CudaEpExpertsSaved& s = saved_[static_cast<size_t>(moe_index)];
  const cuda::Stream st = c.stream;
  const int64_t d = d_, e = e_, inner = inner_, L = local_;
  const int ep = comm_.size();
  const uint16_t* P = c.params;
  MOE_CHECK(!cuda::stream_is_capturing(st), "CudaModel: the expert-parallel forward reads expert counts on the "
            "host and cannot be captured in a CUDA graph");
  c.mark(cuda::Phase::kDispatch);
  // Counts: L per peer out of the router's [E] (peer p's experts are [p L, (p+1) L)), received
  // [ep * L] (peer-major); both read on the host.
  std::vector<int64_t> cnt(size_t(ep), L);
  std::vector<int64_t> off(size_t(ep), 0);
  for (int q = 0; q < ep; ++q) off[q] = q * L;
  int32_t* recv_counts = recv_counts_E.as<int32_t>();
  comm_.all_to_all_v(counts_E, cnt.data(), off.data(), recv_counts, cnt.data(), off.data(), cuda::NcclDType::kI32,
                     st);
  host_counts_.resize(size_t(2 * e));
  cuda::copy_d2h(host_counts_.data(), counts_E, size_t(e) * sizeof(int32_t), st);
  cuda::copy_d2h(host_counts_.data() + e, recv_counts, size_t(e) * sizeof(int32_t), st);
  s.handle = cuda::make_ep_handle(ep, comm_.rank(), L, host_counts_.data(), host_counts_.data() + e);
  const cuda::EpHandle& h = s.handle;
  const int64_t G = h.total_recv;
  // Everything forward and backward of this layer needs for G rows, grown (with 1/8 headroom)
  // right after the stream was synchronised by the count read, so no pending work uses a buffer.
  const int64_t cap = G + G / 8;
  auto fits = [&](cuda::DeviceBuffer& b, int64_t elems, size_t es) {
    return b.bytes() >= size_t(std::max<int64_t>(G, 1) * elems) * es;
  };
  CudaBufferGrower& g = grower_;
  if (!fits(s.x_GD, d, 2)) g.grow<uint16_t>(s.x_GD, cap * d, "received expert rows");
  if (!fits(gate_up_rows(moe_index), 2 * inner, 2)) g.grow<uint16_t>(gate_up_rows(moe_index), cap * 2 * inner, "expert gate_up");
  if (!fits(h_rows(moe_index), inner, 2)) g.grow<uint16_t>(h_rows(moe_index), cap * inner, "expert h");
  if (!fits(s.regroup_G, 1, 4)) g.grow<int32_t>(s.regroup_G, cap, "regroup map");
  if (!fits(s.ungroup_G, 1, 4)) g.grow<int32_t>(s.ungroup_G, cap, "ungroup map");
  if (!fits(pm_GD, d, 2)) g.grow<uint16_t>(pm_GD, cap * d, "exchanged rows");
  if (!fits(work_GD, d, 2)) g.grow<uint16_t>(work_GD, cap * d, "expert work rows");
  if (ws_.bytes() < cuda::experts_backward_workspace_bytes(std::max<int64_t>(G, 1), inner)) {
    // Scratch only (nothing to keep, nothing pending): freed before the larger one is allocated,
    // so the growth never holds both.
    g.release(ws_);
    g.grow_bytes(ws_, cuda::experts_backward_workspace_bytes(cap, inner), "expert dgate_up and dh");
  }
  g.grow<int32_t>(s.local_offsets_L1, L + 1, "local expert offsets");
  if (fp8_on_) grow_fp8(G);
  if (G > 0) {
    cuda::copy_h2d(s.regroup_G.data(), h.regroup.data(), size_t(G) * sizeof(int32_t), st);
    cuda::copy_h2d(s.ungroup_G.data(), h.ungroup.data(), size_t(G) * sizeof(int32_t), st);
  }
  cuda::copy_h2d(s.local_offsets_L1.data(), h.local_offsets.data(), size_t(L + 1) * sizeof(int32_t), st);
  cuda::stream_sync(st);  // the host handle's vectors may change at the next forward of this layer

  uint16_t* pm = pm_GD.as<uint16_t>();
  uint16_t* xr = s.x_GD.as<uint16_t>();
  uint16_t* yr = work_GD.as<uint16_t>();
  if (fp8_on_) {
    dispatch_fp8(h, s, x_sorted_RD, rows, xr, st);  // xr: the rows' dequantised values
    count_traffic(h, cuda::fp8_row_payload_bytes(d), 2 * d);
    c.mark(cuda::Phase::kExperts);
    fp8_.refresh(c, moe_index, p, st);  // the local experts' codes, when the parameters moved
    cuda::experts_forward_fp8(xr, s.local_offsets_L1.as<int32_t>(), fp8_.view(moe_index), G, L, d, inner,
                              gate_up_rows(moe_index).as<uint16_t>(), h_rows(moe_index).as<uint16_t>(), yr,
                              fp8_ws_.data(), fp8_ws_.bytes(), st, /*input_quantised=*/true);
  } else {
    cuda::ep_dispatch_rows(comm_, h, x_sorted_RD, pm, d, st);
    cuda::ep_gather_rows(pm, s.regroup_G.as<int32_t>(), G, G, d, xr, st);
    count_traffic(h, 2 * d, 2 * d);
    c.mark(cuda::Phase::kExperts);
    // G == 0 (no rows for this rank's experts) enqueues nothing.
    cuda::experts_forward(xr, s.local_offsets_L1.as<int32_t>(), P + p.experts_gate_up, P + p.experts_down, G, L, d,
                          inner, gate_up_rows(moe_index).as<uint16_t>(), h_rows(moe_index).as<uint16_t>(), yr, st);
  }
  c.mark(cuda::Phase::kCombine);
  cuda::ep_gather_rows(yr, s.ungroup_G.as<int32_t>(), G, G, d, pm, st);
  cuda::ep_combine_rows(comm_, h, pm, y_sorted_RD, d, st);
}

// One MoE layer's backward: dy_sorted_RD [R, D] (the unpermute gradient, sorted rows) to the
// experts' ranks, local expert dgrad and wgrad there, dx_sorted_RD [R, D] back.
void CudaEpExperts::backward(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p,
                             const int32_t* /*offsets_E1*/, const uint16_t* /*x_sorted_RD*/,
                             const uint16_t* dy_sorted_RD, int64_t rows, uint16_t* dx_sorted_RD,
                             bool input_quantised) {
  MOE_CHECK(c.expert_grad_squares == nullptr,
            "CudaEpExperts::backward: the experts' square sums are written by local experts only");
  MOE_CHECK(!input_quantised, "CudaEpExperts::backward: the exchange carries BF16 rows, no input codes");
  const CudaEpExpertsSaved& s = saved_[static_cast<size_t>(moe_index)];
  const cuda::Stream st = c.stream;
  const int64_t d = d_, inner = inner_, L = local_;
  const uint16_t* P = c.params;
  float* Gr = c.grads;
  const cuda::EpHandle& h = s.handle;
  const int64_t G = h.total_recv;
  c.mark(cuda::Phase::kDispatch);
  uint16_t* pm = pm_GD.as<uint16_t>();
  uint16_t* work = work_GD.as<uint16_t>();
  if (fp8_on_) {
    // dy as FP8 payload: its codes into the FP8 input rows, its dequantised values into pm (the
    // exchange buffer is free until the combine); dx by local expert into work.
    dispatch_fp8(h, s, dy_sorted_RD, rows, pm, st);
    count_traffic(h, cuda::fp8_row_payload_bytes(d), 2 * d);
    c.mark(cuda::Phase::kExperts);
    cuda::experts_backward_fp8(s.x_GD.as<uint16_t>(), s.local_offsets_L1.as<int32_t>(), fp8_.view(moe_index),
                               gate_up_rows(moe_index).as<uint16_t>(), h_rows(moe_index).as<uint16_t>(), pm, G, L, d,
                               inner, work, Gr + p.experts_gate_up, Gr + p.experts_down, ws_.data(), ws_.bytes(),
                               fp8_ws_.data(), fp8_ws_.bytes(), st, !c.overwrite_grads, /*input_quantised=*/true);
    c.mark(cuda::Phase::kCombine);
    cuda::ep_gather_rows(work, s.ungroup_G.as<int32_t>(), G, G, d, pm, st);
    cuda::ep_combine_rows(comm_, h, pm, dx_sorted_RD, d, st);
    return;
  }
  cuda::ep_dispatch_rows(comm_, h, dy_sorted_RD, pm, d, st);
  cuda::ep_gather_rows(pm, s.regroup_G.as<int32_t>(), G, G, d, work, st);  // dy rows by local expert
  count_traffic(h, 2 * d, 2 * d);
  c.mark(cuda::Phase::kExperts);
  // dx rows by local expert overwrite the dy rows in place (the op reads dy in full first).
  cuda::experts_backward(s.x_GD.as<uint16_t>(), s.local_offsets_L1.as<int32_t>(), P + p.experts_gate_up,
                         P + p.experts_down, gate_up_rows(moe_index).as<uint16_t>(), h_rows(moe_index).as<uint16_t>(), work,
                         G, L, d, inner, work, Gr + p.experts_gate_up, Gr + p.experts_down, ws_.data(), ws_.bytes(),
                         st, cuda::GroupedGemmBackend::kAuto, !c.overwrite_grads);
  c.mark(cuda::Phase::kCombine);
  cuda::ep_gather_rows(work, s.ungroup_G.as<int32_t>(), G, G, d, pm, st);
  cuda::ep_combine_rows(comm_, h, pm, dx_sorted_RD, d, st);
}

// Selective recompute: h of this rank's received rows again from their saved gate/up output (the
// outputs stay saved: recomputing them would need the exchange again).
void CudaEpExperts::recompute(const CudaBlockContext& c, int64_t moe_index, const LayerParams& /*p*/,
                              const int32_t* /*offsets_E1*/, int64_t /*rows*/, uint16_t* /*y_sorted_RD*/) {
  const CudaEpExpertsSaved& s = saved_[static_cast<size_t>(moe_index)];
  if (fp8_on_) {  // h through the FP8 path's SwiGLU (its codes written too), the outputs kept
    cuda::experts_recompute_fp8(gate_up_rows(moe_index).as<uint16_t>(), s.local_offsets_L1.as<int32_t>(),
                                fp8_.view(moe_index), s.handle.total_recv, local_, d_, inner_,
                                h_rows(moe_index).as<uint16_t>(), nullptr, fp8_ws_.data(), fp8_ws_.bytes(), c.stream);
    return;
  }
  cuda::experts_recompute(gate_up_rows(moe_index).as<uint16_t>(), s.local_offsets_L1.as<int32_t>(), nullptr,
                          s.handle.total_recv, local_, d_, inner_, h_rows(moe_index).as<uint16_t>(), nullptr, c.stream);
}

void CudaEpExperts::count_traffic(const cuda::EpHandle& h, int64_t dispatch_bytes, int64_t combine_bytes) {
  EpTraffic& t = traffic_;
  int64_t out = 0, in = 0;
  for (int q = 0; q < h.ep; ++q) {
    if (q == h.rank) continue;
    out += h.send_rows[q];
    in += h.recv_rows[q];
  }
  // Dispatch sends `out` rows and receives `in`; combine returns them the other way.
  t.exchanges += 2;
  t.rows_sent += out + in;
  t.bytes_sent += out * dispatch_bytes + in * combine_bytes;
  t.bytes_received += in * dispatch_bytes + out * combine_bytes;
}

// ---------------------------------------------------------------------------------------------
// Rowwise exchange.

CudaRowwiseExperts::CudaRowwiseExperts(const MoeConfig& e, int64_t d, int64_t num_moe_layers,
                                       cuda::NvshmemWorld& world, double capacity_factor)
    : d_(d),
      e_(e.num_experts),
      inner_(e.expert_hidden),
      local_(e.num_experts / world.npes()),
      ep_(world.npes()),
      rank_(world.pe()),
      capacity_factor_(capacity_factor),
      world_(world),
      saved_(static_cast<size_t>(num_moe_layers)) {
  MOE_CHECK(e_ % ep_ == 0, "CudaRowwiseExperts: ", e_, " experts over ", ep_, " PEs: E must be divisible by ep");
}

CudaRowwiseExperts::~CudaRowwiseExperts() {
  try {
    free_symmetric();
  } catch (...) {
  }
}

void CudaRowwiseExperts::free_symmetric() {
  for (CudaRowwiseExpertsSaved& s : saved_) {
    if (s.x_GD) world_.free(s.x_GD);
    s.x_GD = nullptr;
  }
  if (counts_all_) world_.free(counts_all_);
  if (y_GD_) world_.free(y_GD_);
  if (dy_GD_) world_.free(dy_GD_);
  if (payload_GP_) world_.free(payload_GP_);
  counts_all_ = y_GD_ = dy_GD_ = payload_GP_ = nullptr;
}

int64_t CudaRowwiseExperts::capacity(int64_t rows) const {
  if (capacity_factor_ <= 0) return 0;
  return static_cast<int64_t>(std::ceil(capacity_factor_ * double(rows * ep_) / double(e_)));
}

int64_t CudaRowwiseExperts::receive_rows(int64_t rows) const {
  const int64_t cap = capacity(rows);
  return cap > 0 ? std::min(local_ * cap, rows * ep_) : rows * ep_;
}

int64_t CudaRowwiseExperts::symmetric_bytes(const MoeConfig& e, int64_t d, int64_t num_moe_layers, int64_t ep,
                                            double cf, int64_t rows, bool fp8) {
  const int64_t cap = cf > 0 ? static_cast<int64_t>(std::ceil(cf * double(rows * ep) / double(e.num_experts))) : 0;
  const int64_t g = cap > 0 ? std::min(e.num_experts / ep * cap, rows * ep) : rows * ep;
  auto up = [](int64_t b) { return (b + 511) / 512 * 512; };  // NVSHMEM's allocation alignment
  const int64_t stride = fp8_stride(d);
  return up(ep * e.num_experts * 4) + (num_moe_layers + 2) * up(g * d * 2) + (fp8 ? up(g * stride) : 0);
}

void CudaRowwiseExperts::reserve(int64_t rows, CudaBufferGrower& g) {
  if (saved_.empty()) return;
  const int64_t d = d_, inner = inner_, G = receive_rows(rows);
  for (int64_t m = 0; m < int64_t(saved_.size()); ++m) {
    CudaRowwiseExpertsSaved& s = saved_[size_t(m)];
    g.grow<uint16_t>(gate_up_rows(m), G * 2 * inner, "expert gate_up");
    g.grow<uint16_t>(h_rows(m), G * inner, "expert h");
    g.grow<int32_t>(s.dest_row_R, rows, "rowwise destination rows");
    g.grow<int32_t>(s.local_offsets_L1, local_ + 1, "local expert offsets");
  }
  g.grow<int32_t>(kept_PE_, ep_ * e_, "rowwise kept counts");
  g.grow<int32_t>(dropped_scratch_, 1, "rowwise dropped rows");
  if (traffic_total_.bytes() == 0) {
    g.grow<int64_t>(traffic_slots_, 2 * int64_t(saved_.size()), "rowwise traffic slots");
    g.grow<int64_t>(traffic_total_, 2, "rowwise traffic");
    cuda::device_memset(traffic_total_.data(), 0, 2 * sizeof(int64_t), nullptr);
    cuda::stream_sync(nullptr);
  }
  g.grow_bytes(ws_, cuda::experts_backward_workspace_bytes(G, inner), "expert dgate_up and dh");
  if (fp8_on_) {
    fp8_.reserve(int64_t(saved_.size()), local_, d, inner, g);
    g.grow_bytes(pack_RP_, size_t(rows * fp8_stride(d_)), "FP8 row payloads packed");
    g.grow_bytes(fp8_ws_, cuda::experts_fp8_workspace_bytes(G, d, inner), "FP8 expert activation codes");
  }
  if (rows <= reserved_rows_) return;
  // The symmetric buffers, the same sizes on every PE (collective), then their peers' addresses.
  // The table is made anew through the grower first: that refuses to run under capture and counts
  // a reallocation (a captured graph holding the old addresses is then stale).
  const size_t slots = 3 + saved_.size() + (fp8_on_ ? 1 : 0);
  g.release(peer_table_);
  g.grow<void*>(peer_table_, int64_t(slots) * ep_, "rowwise peer addresses");
  free_symmetric();
  counts_all_ = world_.malloc(size_t(ep_ * e_) * sizeof(int32_t));
  y_GD_ = world_.malloc(size_t(G * d) * sizeof(uint16_t));
  dy_GD_ = world_.malloc(size_t(G * d) * sizeof(uint16_t));
  for (CudaRowwiseExpertsSaved& s : saved_) s.x_GD = world_.malloc(size_t(G * d) * sizeof(uint16_t));
  if (fp8_on_) payload_GP_ = world_.malloc(size_t(G * fp8_stride(d_)));
  std::vector<void*> table(slots * size_t(ep_));
  for (int64_t q = 0; q < ep_; ++q) {
    table[0 * ep_ + q] = world_.peer(counts_all_, int(q));
    table[1 * ep_ + q] = world_.peer(y_GD_, int(q));
    table[2 * ep_ + q] = world_.peer(dy_GD_, int(q));
    for (size_t m = 0; m < saved_.size(); ++m) table[(3 + m) * ep_ + q] = world_.peer(saved_[m].x_GD, int(q));
    if (fp8_on_) table[payload_slot() * ep_ + q] = world_.peer(payload_GP_, int(q));
  }
  cuda::copy_h2d(peer_table_.data(), table.data(), table.size() * sizeof(void*), nullptr);
  cuda::stream_sync(nullptr);
  reserved_rows_ = rows;
}

void CudaRowwiseExperts::set_fp8(bool on, Fp8Rule rule) {
  MOE_CHECK(!on || (d_ % 128 == 0 && fp8_experts_shapes(d_, inner_)), "train.precision = \"fp8\" with the rowwise ",
            "exchange: its FP8 rows are whole 1 x 128 blocks, so model.d_model (", d_, ") must be a multiple of 128 ",
            "and moe.expert_hidden (", inner_, ") of 16");
  check_fp8_rule(on, rule, d_, inner_);
  fp8_on_ = on;
  fp8_.set_rule(rule);
}

std::vector<CudaFp8ExpertTensor> CudaRowwiseExperts::fp8_weight_tensors(const std::vector<LayerParams>& layers) {
  if (!fp8_on_) return {};
  return fp8_.tensors(layers);
}

void CudaRowwiseExperts::fp8_codes_follow(int64_t from, int64_t to) { fp8_.follow(from, to); }

void CudaRowwiseExperts::place_fp8_codes(const std::vector<LayerParams>& layers, uint16_t* bf16, const float* f32) {
  fp8_.place(layers, bf16, f32);
}

void CudaRowwiseExperts::refresh_fp8(const CudaBlockContext& c, const std::vector<LayerParams>& layers) {
  if (!fp8_on_) return;
  for (const LayerParams& p : layers) fp8_.refresh(c, p.moe_index, p, c.stream);  // refuses unreserved layers
}

int64_t CudaRowwiseExperts::fp8_stride(int64_t d) { return (cuda::fp8_row_payload_bytes(d) + 15) / 16 * 16; }

const uint16_t* CudaRowwiseExperts::pack_fp8(const uint16_t* rows, int64_t n, cuda::Stream st) {
  MOE_CHECK(pack_RP_.bytes() >= size_t(n * fp8_stride(d_)), "CudaRowwiseExperts: ", n, " rows to pack, the FP8 ",
            "payload buffer holds ", pack_RP_.bytes() / size_t(fp8_stride(d_)));
  cuda::fp8_pack_rows(rows, n, d_, Fp8Format::kE4M3, pack_RP_.as<uint8_t>(), nullptr, st, fp8_stride(d_),
                      fp8_.rule());
  return pack_RP_.as<uint16_t>();
}

void CudaRowwiseExperts::unpack_fp8(uint16_t* values, int64_t G, cuda::Stream st) {
  MOE_CHECK(payload_GP_ != nullptr, "CudaRowwiseExperts: no FP8 payload buffer; set_fp8 before reserve");
  const cuda::Fp8Rows in = cuda::experts_fp8_input_rows(fp8_ws_.data(), fp8_ws_.bytes(), G, d_, inner_);
  cuda::fp8_unpack_rows(static_cast<const uint8_t*>(payload_GP_), G, d_, Fp8Format::kE4M3, in.codes, in.scales,
                        values, st, fp8_stride(d_));
}

void CudaRowwiseExperts::forward(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p,
                                 const int32_t* counts_E, const int32_t* offsets_E1, const uint16_t* x_sorted_RD,
                                 int64_t rows, uint16_t* y_sorted_RD, bool input_quantised) {
  MOE_CHECK(!input_quantised, "CudaRowwiseExperts::forward: the exchange carries BF16 rows, no input codes");
  forward_rows(c, moe_index, p, counts_E, offsets_E1, x_sorted_RD, nullptr, 1, rows, y_sorted_RD);
}

void CudaRowwiseExperts::forward_tokens(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p,
                                        const int32_t* counts_E, const int32_t* offsets_E1, const uint16_t* tokens_TD,
                                        const int32_t* sorted_route_R, int64_t top_k, int64_t rows,
                                        uint16_t* y_sorted_RD) {
  forward_rows(c, moe_index, p, counts_E, offsets_E1, tokens_TD, sorted_route_R, top_k, rows, y_sorted_RD);
}

void CudaRowwiseExperts::forward_rows(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p,
                                      const int32_t* counts_E, const int32_t* offsets_E1, const uint16_t* x,
                                      const int32_t* sorted_route, int64_t top_k, int64_t rows,
                                      uint16_t* y_sorted_RD) {
  MOE_CHECK(rows <= reserved_rows_, "CudaRowwiseExperts: ", rows, " rows, the buffers hold ", reserved_rows_,
            "; reserve first");
  CudaRowwiseExpertsSaved& s = saved_[static_cast<size_t>(moe_index)];
  const cuda::Stream st = c.stream;
  const int64_t G = receive_rows(reserved_rows_);
  const uint16_t* P = c.params;
  c.mark(cuda::Phase::kDispatch);
  cuda::ep_rowwise_share_counts(counts_E, e_, rank_, reinterpret_cast<int32_t* const*>(peers(0)), ep_, st);
  world_.barrier(st);
  int32_t* dropped = dropped_M_ ? dropped_M_ + moe_index : dropped_scratch_.as<int32_t>();
  cuda::ep_rowwise_placement(static_cast<const int32_t*>(counts_all_), ep_, rank_, e_, capacity(rows), rows,
                             kept_PE_.as<int32_t>(), s.dest_row_R.as<int32_t>(), s.local_offsets_L1.as<int32_t>(),
                             dropped, st);
  cuda::ep_rowwise_count_rows(kept_PE_.as<int32_t>(), ep_, rank_, e_, traffic_slots_.as<int64_t>() + 2 * moe_index,
                              traffic_total_.as<int64_t>(), st);
  exchanges_ += 2;
  traffic_stream_ = st;
  // FP8: the rows (or token rows) go as payload rows, 16-bit words of fp8_stride(d_) bytes.
  const uint16_t* src = fp8_on_ ? pack_fp8(x, sorted_route != nullptr ? rows / top_k : rows, st) : x;
  const int64_t width = fp8_on_ ? fp8_stride(d_) / 2 : d_;
  cuda::ep_rowwise_scatter(src, offsets_E1, s.dest_row_R.as<int32_t>(), rows, e_, local_, width,
                           peers(fp8_on_ ? payload_slot() : 3 + size_t(moe_index)), ep_, st, sorted_route, top_k);
  world_.barrier(st);
  c.mark(cuda::Phase::kExperts);
  if (fp8_on_) {
    unpack_fp8(static_cast<uint16_t*>(s.x_GD), G, st);  // the codes into the FP8 input rows, the values into x
    fp8_.refresh(c, moe_index, p, st);  // without the step's update (or after a newer version)
    cuda::experts_forward_fp8(static_cast<const uint16_t*>(s.x_GD), s.local_offsets_L1.as<int32_t>(),
                              fp8_.view(moe_index), G, local_, d_, inner_, gate_up_rows(moe_index).as<uint16_t>(),
                              h_rows(moe_index).as<uint16_t>(), static_cast<uint16_t*>(y_GD_), fp8_ws_.data(),
                              fp8_ws_.bytes(), st, /*input_quantised=*/true);
  } else {
    cuda::experts_forward(static_cast<const uint16_t*>(s.x_GD), s.local_offsets_L1.as<int32_t>(),
                          P + p.experts_gate_up, P + p.experts_down, G, local_, d_, inner_,
                          gate_up_rows(moe_index).as<uint16_t>(), h_rows(moe_index).as<uint16_t>(),
                          static_cast<uint16_t*>(y_GD_), st);
  }
  world_.barrier(st);  // every rank's outputs written
  c.mark(cuda::Phase::kCombine);
  cuda::ep_rowwise_gather(peers(1), offsets_E1, s.dest_row_R.as<int32_t>(), rows, e_, local_, d_, ep_, y_sorted_RD, st);
  world_.barrier(st);  // every rank has read the outputs before the next layer writes them
}

void CudaRowwiseExperts::recompute(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p,
                                   const int32_t* /*offsets_E1*/, int64_t /*rows*/, uint16_t* /*y_sorted_RD*/) {
  const CudaRowwiseExpertsSaved& s = saved_[static_cast<size_t>(moe_index)];
  if (fp8_on_) {
    cuda::experts_recompute_fp8(gate_up_rows(moe_index).as<uint16_t>(), s.local_offsets_L1.as<int32_t>(),
                                fp8_.view(moe_index), receive_rows(reserved_rows_), local_, d_, inner_,
                                h_rows(moe_index).as<uint16_t>(), nullptr, fp8_ws_.data(), fp8_ws_.bytes(), c.stream);
    return;
  }
  cuda::experts_recompute(gate_up_rows(moe_index).as<uint16_t>(), s.local_offsets_L1.as<int32_t>(),
                          c.params + p.experts_down, receive_rows(reserved_rows_), local_, d_, inner_,
                          h_rows(moe_index).as<uint16_t>(), nullptr, c.stream);
}

void CudaRowwiseExperts::backward_experts(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p,
                                          const int32_t* offsets_E1, const uint16_t* dy_sorted_RD, int64_t rows) {
  const CudaRowwiseExpertsSaved& s = saved_[static_cast<size_t>(moe_index)];
  const cuda::Stream st = c.stream;
  const int64_t G = receive_rows(reserved_rows_);
  const uint16_t* P = c.params;
  float* Gr = c.grads;
  c.mark(cuda::Phase::kCombine);
  cuda::ep_rowwise_count_rows(nullptr, ep_, rank_, e_, traffic_slots_.as<int64_t>() + 2 * moe_index,
                              traffic_total_.as<int64_t>(), st);
  exchanges_ += 2;
  const uint16_t* src = fp8_on_ ? pack_fp8(dy_sorted_RD, rows, st) : dy_sorted_RD;
  cuda::ep_rowwise_scatter(src, offsets_E1, s.dest_row_R.as<int32_t>(), rows, e_, local_,
                           fp8_on_ ? fp8_stride(d_) / 2 : d_, peers(fp8_on_ ? payload_slot() : 2), ep_, st);
  world_.barrier(st);
  c.mark(cuda::Phase::kExperts);
  uint16_t* dy = static_cast<uint16_t*>(dy_GD_);
  if (fp8_on_) {
    unpack_fp8(dy, G, st);  // dy's codes into the FP8 input rows, its values into the gradient rows
    cuda::experts_backward_fp8(static_cast<const uint16_t*>(s.x_GD), s.local_offsets_L1.as<int32_t>(),
                               fp8_.view(moe_index), gate_up_rows(moe_index).as<uint16_t>(),
                               h_rows(moe_index).as<uint16_t>(), dy, G, local_, d_, inner_, dy, Gr + p.experts_gate_up,
                               Gr + p.experts_down, ws_.data(), ws_.bytes(), fp8_ws_.data(), fp8_ws_.bytes(), st,
                               !c.overwrite_grads, /*input_quantised=*/true);
    world_.barrier(st);  // every rank's input gradients written (in place of dy)
    return;
  }
  cuda::experts_backward(static_cast<const uint16_t*>(s.x_GD), s.local_offsets_L1.as<int32_t>(), P + p.experts_gate_up,
                         P + p.experts_down, gate_up_rows(moe_index).as<uint16_t>(), h_rows(moe_index).as<uint16_t>(),
                         dy, G, local_, d_, inner_, dy, Gr + p.experts_gate_up, Gr + p.experts_down, ws_.data(),
                         ws_.bytes(), st, cuda::GroupedGemmBackend::kAuto, !c.overwrite_grads);
  world_.barrier(st);  // every rank's input gradients written (in place of dy)
}

void CudaRowwiseExperts::backward(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p,
                                  const int32_t* offsets_E1, const uint16_t* /*x_sorted_RD*/,
                                  const uint16_t* dy_sorted_RD, int64_t rows, uint16_t* dx_sorted_RD,
                                  bool input_quantised) {
  MOE_CHECK(c.expert_grad_squares == nullptr,
            "CudaRowwiseExperts::backward: the experts' square sums are written by local experts only");
  MOE_CHECK(!input_quantised, "CudaRowwiseExperts::backward: the exchange carries BF16 rows, no input codes");
  backward_experts(c, moe_index, p, offsets_E1, dy_sorted_RD, rows);
  const CudaRowwiseExpertsSaved& s = saved_[static_cast<size_t>(moe_index)];
  c.mark(cuda::Phase::kDispatch);
  cuda::ep_rowwise_gather(peers(2), offsets_E1, s.dest_row_R.as<int32_t>(), rows, e_, local_, d_, ep_, dx_sorted_RD,
                          c.stream);
  world_.barrier(c.stream);  // read before the next layer's gradients are pushed
}

void CudaRowwiseExperts::backward_tokens(const CudaBlockContext& c, int64_t moe_index, const LayerParams& p,
                                         const int32_t* offsets_E1, const uint16_t* dy_sorted_RD,
                                         const int32_t* route_to_row, int64_t num_tokens, int64_t top_k, int64_t rows,
                                         uint16_t* dx_TD) {
  backward_experts(c, moe_index, p, offsets_E1, dy_sorted_RD, rows);
  const CudaRowwiseExpertsSaved& s = saved_[static_cast<size_t>(moe_index)];
  c.mark(cuda::Phase::kDispatch);
  cuda::ep_rowwise_gather_add(peers(2), route_to_row, offsets_E1, s.dest_row_R.as<int32_t>(), num_tokens, top_k, e_,
                              local_, d_, ep_, dx_TD, c.stream);
  world_.barrier(c.stream);  // read before the next layer's gradients are pushed
}

EpTraffic CudaRowwiseExperts::traffic() const {
  EpTraffic t;
  if (traffic_total_.bytes() == 0) return t;
  int64_t rows[2] = {0, 0};
  cuda::copy_d2h(rows, traffic_total_.data(), sizeof rows, traffic_stream_);
  // Each exchange pair moves this rank's rows out (dispatch: stores into the peers) and the rows its
  // experts received back (combine: the peers load them), forward and backward alike.
  t.exchanges = exchanges_;
  t.rows_sent = rows[0] + rows[1];
  // The rows out travel as FP8 payload rows under set_fp8, the rows back in BF16.
  const int64_t out_row = fp8_on_ ? fp8_stride(d_) : 2 * d_;
  t.bytes_sent = rows[0] * out_row + rows[1] * 2 * d_;
  t.bytes_received = rows[1] * out_row + rows[0] * 2 * d_;
  return t;
}

void CudaRowwiseExperts::reset_traffic() {
  exchanges_ = 0;
  if (traffic_total_.bytes() == 0) return;
  cuda::device_memset(traffic_total_.data(), 0, 2 * sizeof(int64_t), traffic_stream_);
  cuda::stream_sync(traffic_stream_);
}

}  // namespace moe

#endif  // MOECORE_HAS_CUDA
