// Expert-parallel checks shared by the thread-rank and MPI test binaries. Every rank computes the
// single-process reference itself and compares its part:
// - layer: the MoE expert path (dispatch map, permute, experts, combine and their backward) with
//   hand-made routing, EP (ep_experts_forward/backward) against cpu::experts_* on all tokens;
// - model: Model<float> with an EP context on this rank's sequences against a 1-rank
//   Model<float> of the same seed run on every rank's sequences in turn (gradients accumulate),
//   so every loss term, including the per-micro-batch load-balancing loss, is the same function.
// - recompute: Model<float> with an EP context under train.recompute selective and full against
//   none on the same rank, bitwise.
// Tolerance: kEpTol (support/parity.h), 1e-5 relative (elementwise with a floor of 1e-5 of the
// tensor's largest value, and normwise); counts and routing exactly.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/recompute.h"
#include "core/rng.h"
#include "cpu/fp8.h"
#include "cpu/dispatch.h"
#include "cpu/experts.h"
#include "model/ep_experts.h"
#include "model/layout.h"
#include "model/model.h"
#include "parallel/expert_parallel.h"
#include "support/parity.h"

namespace moe::testing {

inline std::string rank_tag(const Comm& world) { return "[rank " + std::to_string(world.rank()) + "] "; }

inline std::vector<float> normal_values(int64_t n, const std::string& name, double std, uint64_t seed = 5) {
  std::vector<float> v(n);
  fill_normal(v.data(), n, 0, seed, name, std);
  return v;
}

// ---------------------------------------------------------------------------------------------
// Layer level.

struct LayerCase {
  std::string name;
  int64_t num_experts = 4, top_k = 1, d = 8, inner = 6;
  int64_t ep = 2;
  // Tokens per data-parallel rank (size = world size); a rank may have none.
  std::function<int64_t(int rank)> tokens_of;
  // Expert of (global token t of rank `rank`, slot j); slots of a token must differ.
  std::function<int32_t(int rank, int64_t t, int64_t j)> route;
};

struct LayerResult {
  std::vector<float> out, dx, dtopk_w, dw_gate_up, dw_down;  // EP: local experts' weight grads
  EpHandle handle;
};

// Reference and EP runs of one case; compares on this rank and returns the EP handle for
// scenario checks. Collective over `world`. Under an FP8 recipe (fp8 not null) the reference's
// experts read the row-quantised x_sorted and dy (cpu::fp8_quantised_rows), the EP run's receive
// them as FP8 payloads: the outputs and input gradients within kEpTol; the experts' weight
// gradients too when one EP group holds every rank (world = ep), since their 1 x 128 blocks run
// down each expert's rows and the reference's rows of an expert are then the group's; with
// several groups each group's blocks hold only its rows, and the summed gradients agree within
// the FP8 rounding (kEpFp8GroupedWgrad).
inline EpHandle check_layer_case(Comm& world, const LayerCase& c, const cpu::Fp8Recipe* fp8 = nullptr) {
  const int w = world.size(), me = world.rank();
  const int64_t E = c.num_experts, k = c.top_k, d = c.d, inner = c.inner;
  const std::string tag = rank_tag(world) + c.name + ": ";
  ExpertParallelGroups groups = split_expert_parallel(world, c.ep);
  const ExpertParallel ep = make_expert_parallel(*groups.ep, E);
  const int64_t L = ep.local_experts(), first = ep.first_expert();

  // Global problem, identical on every rank.
  std::vector<int64_t> tok_offset(w + 1, 0);
  for (int r = 0; r < w; ++r) tok_offset[r + 1] = tok_offset[r] + c.tokens_of(r);
  const int64_t N = tok_offset[w];
  std::vector<int32_t> idx(N * k);
  for (int r = 0; r < w; ++r)
    for (int64_t t = tok_offset[r]; t < tok_offset[r + 1]; ++t)
      for (int64_t j = 0; j < k; ++j) idx[t * k + j] = c.route(r, t, j);
  const std::vector<float> x = normal_values(N * d, "x", 1.0);
  std::vector<float> topk_w = normal_values(N * k, "w", 1.0);
  for (float& v : topk_w) v = 0.25f + std::fabs(v);
  const std::vector<float> dout = normal_values(N * d, "dout", 1.0);
  const std::vector<float> wgu = normal_values(E * 2 * inner * d, "w_gate_up", 1.0 / std::sqrt(double(d)));
  const std::vector<float> wdn = normal_values(E * d * inner, "w_down", 1.0 / std::sqrt(double(inner)));

  // Single-process reference over all N tokens.
  const int64_t R = N * k;
  std::vector<int32_t> cnt(E), off(E + 1), sorted(R), to_row(R);
  cpu::build_dispatch_map(idx.data(), N, k, E, cnt.data(), off.data(), sorted.data(), to_row.data());
  std::vector<float> xs(R * d), gu(R * 2 * inner), h(R * inner), ys(R * d), out_ref(N * d);
  cpu::permute_forward(x.data(), sorted.data(), R, k, d, xs.data());
  if (fp8 != nullptr) cpu::fp8_quantised_rows(std::vector<float>(xs).data(), R, d, fp8->forward, *fp8, xs.data());
  cpu::experts_forward(xs.data(), off.data(), wgu.data(), wdn.data(), E, d, inner, gu.data(), h.data(), ys.data(),
                       fp8);
  cpu::unpermute_forward(ys.data(), to_row.data(), topk_w.data(), N, k, d, out_ref.data());
  std::vector<float> dys(R * d), dtw_ref(N * k), dxs(R * d), scratch(R * 3 * inner), dx_ref(N * d, 0.f);
  std::vector<float> dwgu_ref(wgu.size(), 0.f), dwdn_ref(wdn.size(), 0.f);
  cpu::unpermute_backward(dout.data(), ys.data(), to_row.data(), topk_w.data(), N, k, d, R, dys.data(), dtw_ref.data());
  if (fp8 != nullptr) cpu::fp8_quantised_rows(std::vector<float>(dys).data(), R, d, fp8->grad, *fp8, dys.data());
  cpu::experts_backward(xs.data(), off.data(), wgu.data(), wdn.data(), gu.data(), h.data(), dys.data(), E, d, inner,
                        dxs.data(), dwgu_ref.data(), dwdn_ref.data(), scratch.data(), fp8);
  cpu::permute_backward(dxs.data(), sorted.data(), R, k, d, dx_ref.data());

  // This rank: its tokens, its experts.
  const int64_t n = c.tokens_of(me), t0 = tok_offset[me], r_loc = n * k;
  std::vector<int32_t> lcnt(E), loff(E + 1), lsorted(r_loc), lto_row(r_loc);
  cpu::build_dispatch_map(idx.data() + t0 * k, n, k, E, lcnt.data(), loff.data(), lsorted.data(), lto_row.data());
  std::vector<float> lxs(r_loc * d), lys(r_loc * d), out(n * d);
  cpu::permute_forward(x.data() + t0 * d, lsorted.data(), r_loc, k, d, lxs.data());
  const int64_t gu_per = 2 * inner * d, dn_per = d * inner;
  const std::vector<float> lwgu(wgu.begin() + first * gu_per, wgu.begin() + (first + L) * gu_per);
  const std::vector<float> lwdn(wdn.begin() + first * dn_per, wdn.begin() + (first + L) * dn_per);
  EpExpertsSaved saved;
  ep_experts_forward(ep, lxs.data(), lcnt.data(), lwgu.data(), lwdn.data(), d, inner, saved, lys.data(), nullptr,
                     fp8);
  cpu::unpermute_forward(lys.data(), lto_row.data(), topk_w.data() + t0 * k, n, k, d, out.data());
  std::vector<float> ldys(r_loc * d), dtw(n * k), ldxs(r_loc * d), dx(n * d, 0.f);
  std::vector<float> dwgu(lwgu.size(), 0.f), dwdn(lwdn.size(), 0.f);
  cpu::unpermute_backward(dout.data() + t0 * d, lys.data(), lto_row.data(), topk_w.data() + t0 * k, n, k, d, r_loc,
                          ldys.data(), dtw.data());
  ep_experts_backward(ep, saved, lwgu.data(), lwdn.data(), ldys.data(), d, inner, ldxs.data(), dwgu.data(), dwdn.data(),
                      nullptr, fp8);
  cpu::permute_backward(ldxs.data(), lsorted.data(), r_loc, k, d, dx.data());
  // Ranks holding the same experts (other EP groups) each saw their own group's tokens.
  groups.ep_dp->all_reduce(dwgu.data(), static_cast<int64_t>(dwgu.size()), ReduceOp::kSum);
  groups.ep_dp->all_reduce(dwdn.data(), static_cast<int64_t>(dwdn.size()), ReduceOp::kSum);

  // Exact: what this rank's experts received from each EP peer, counted from the global routing.
  const int g = static_cast<int>(me / c.ep);  // this rank's EP group: dp ranks [g*ep, (g+1)*ep)
  for (int64_t p = 0; p < c.ep; ++p) {
    const int src = static_cast<int>(g * c.ep + p);
    for (int64_t j = 0; j < L; ++j) {
      int64_t expect = 0;
      for (int64_t t = tok_offset[src] * k; t < tok_offset[src + 1] * k; ++t) expect += idx[t] == first + j;
      EXPECT_EQ(saved.handle.num_recv_tokens_per_expert[p * L + j], expect)
          << tag << "rows from EP peer " << p << " for local expert " << j;
    }
  }

  auto slice = [](const std::vector<float>& v, int64_t from, int64_t count) {
    return std::vector<float>(v.begin() + from, v.begin() + from + count);
  };
  expect_parity(tag + "combine output", out, slice(out_ref, t0 * d, n * d), kEpTol);
  expect_parity(tag + "dx", dx, slice(dx_ref, t0 * d, n * d), kEpTol);
  expect_parity(tag + "dtopk_w", dtw, slice(dtw_ref, t0 * k, n * k), kEpTol);
  const Tolerance wtol = fp8 == nullptr || w == c.ep ? kEpTol : kEpFp8GroupedWgrad;
  expect_parity(tag + "dw_gate_up (local experts)", dwgu, slice(dwgu_ref, first * gu_per, L * gu_per), wtol);
  expect_parity(tag + "dw_down (local experts)", dwdn, slice(dwdn_ref, first * dn_per, L * dn_per), wtol);
  return saved.handle;
}

// ---------------------------------------------------------------------------------------------
// Model level.

struct ModelCase {
  std::string name;
  ModelConfig m;
  MoeConfig e;
  int64_t ep = 2;
  int64_t batch_per_rank = 2, seq = 5;
  uint64_t seed = 11, routing_seed = 3;
  // Expert bias of dp rank r ([num_moe_layers * E]); empty function: zeros.
  std::function<std::vector<float>(int rank, int64_t moe_layers)> bias_of;
  // The rowwise exchange with this capacity factor (check_model_recompute_case only: a capacity
  // drops rows, which the one-rank reference of check_model_case does not).
  bool rowwise = false;
  double ep_capacity_factor = 0.0;
};

inline ModelConfig ep_tiny_model() {
  ModelConfig m;
  m.vocab_size = 19;
  m.d_model = 8;
  m.n_layers = 3;
  m.n_heads = 2;
  m.n_kv_heads = 1;
  m.qk_norm = true;
  m.dense_layers = {1};
  m.dense_hidden = 10;
  m.init_std = 0.5;
  return m;
}

inline MoeConfig ep_tiny_moe(int64_t experts, int64_t top_k) {
  MoeConfig e;
  e.num_experts = experts;
  e.top_k = top_k;
  e.expert_hidden = 6;
  e.lb_loss_weight = 0.1;
  e.z_loss_weight = 0.01;
  return e;
}

struct ModelCheck {
  std::vector<std::vector<int32_t>> tokens_per_expert;  // this rank's forward statistics
};

// Under an FP8 recipe (fp8 not null: both models emulate it) the experts' weight gradients differ by
// FP8 rounding (kEpFp8GroupedWgrad: the EP experts quantise a weight gradient's operands over the
// rows of every rank of the group at once, the reference over one rank's micro-batch at a time);
// everything else, the experts' inputs arriving as FP8 payloads included, within kEpTol.
inline ModelCheck check_model_case(Comm& world, const ModelCase& c, const cpu::Fp8Recipe* fp8 = nullptr) {
  const int w = world.size(), me = world.rank();
  const std::string tag = rank_tag(world) + c.name + ": ";
  ExpertParallelGroups groups = split_expert_parallel(world, c.ep);
  const ExpertParallel ep = make_expert_parallel(*groups.ep, c.e.num_experts);

  Model<float> model(c.m, c.e, &ep);
  Model<float> ref(c.m, c.e);
  model.init_params(c.seed);
  ref.init_params(c.seed);
  model.set_fp8(fp8);
  ref.set_fp8(fp8);
  const int64_t moe_layers = model.num_moe_layers(), E = c.e.num_experts;
  auto bias = [&](int r) {
    return c.bias_of ? c.bias_of(r, moe_layers) : std::vector<float>(moe_layers * E, 0.f);
  };
  model.expert_bias() = bias(me);

  // Layout and initial values: dense tensors whole, expert tensors this rank's rows of the global ones.
  const ExpertSlice slice = model.expert_slice();
  EXPECT_EQ(slice.first, ep.first_expert()) << tag;
  EXPECT_EQ(slice.count, E / c.ep) << tag;
  const auto& entries = model.layout().entries();
  EXPECT_EQ(entries.size(), ref.layout().entries().size()) << tag;
  for (size_t i = 0; i < entries.size(); ++i) {
    const ParamEntry& pe = entries[i];
    const ParamEntry& re = ref.layout().find(pe.name);
    const GlobalPlacement& pl = model.placements()[i];
    EXPECT_EQ(pl.global_shape, re.shape) << tag << pe.name;
    EXPECT_EQ(pe.expert, re.expert) << tag << pe.name;
    // Expert tensors: rows [slice.first, slice.first + count) of the global tensor.
    const int64_t start = pe.expert ? slice.first * (re.numel / re.shape[0]) : 0;
    EXPECT_EQ(pl.offset, start) << tag << pe.name;
    if (pe.expert) {
      EXPECT_EQ(pe.shape[0], slice.count) << tag << pe.name;
    } else {
      EXPECT_EQ(pe.shape, re.shape) << tag << pe.name;
    }
    EXPECT_EQ(std::memcmp(model.params() + pe.offset, ref.params() + re.offset + start, pe.numel * sizeof(float)), 0)
        << tag << "initial values of " << pe.name << " differ from the 1-rank model's rows";
  }

  // Sequences of the global batch; this rank takes batch_per_rank of them.
  const int64_t b = c.batch_per_rank, s = c.seq, per_rank = b * s;
  std::vector<int32_t> inputs(w * per_rank), targets(w * per_rank);
  for (int64_t i = 0; i < w * per_rank; ++i) {
    inputs[i] = static_cast<int32_t>((i * 7 + 3 + i / 5) % c.m.vocab_size);
    targets[i] = i % 9 == 4 ? -1 : static_cast<int32_t>((i * 5 + 1) % c.m.vocab_size);
  }
  int64_t num_targets = 0;
  for (int32_t t : targets) num_targets += t >= 0;
  const LossScales scales{1.0 / double(num_targets), c.e.lb_loss_weight, c.e.z_loss_weight};

  model.zero_grads();
  const ForwardStats st = model.forward(inputs.data() + me * per_rank, targets.data() + me * per_rank, b, s,
                                        c.routing_seed);
  model.backward(scales);
  const std::vector<float> logits = model.logits();

  ref.zero_grads();
  ForwardStats ref_st;
  std::vector<float> ref_logits;
  for (int r = 0; r < w; ++r) {
    ref.expert_bias() = bias(r);
    const ForwardStats rs = ref.forward(inputs.data() + r * per_rank, targets.data() + r * per_rank, b, s,
                                        c.routing_seed);
    ref.backward(scales);
    if (r == me) {
      ref_st = rs;
      ref_logits = ref.logits();
    }
  }

  EXPECT_EQ(st.tokens_per_expert, ref_st.tokens_per_expert) << tag << "global per-expert counts of this rank's tokens";
  EXPECT_EQ(st.num_routes, ref_st.num_routes) << tag;
  EXPECT_EQ(st.num_targets, ref_st.num_targets) << tag;
  EXPECT_NEAR(st.ce_sum, ref_st.ce_sum, 1e-5 * std::fabs(ref_st.ce_sum)) << tag;
  EXPECT_NEAR(st.lb_loss, ref_st.lb_loss, 1e-5 * std::fabs(ref_st.lb_loss)) << tag;
  EXPECT_NEAR(st.z_loss, ref_st.z_loss, 1e-5 * std::fabs(ref_st.z_loss)) << tag;
  expect_parity(tag + "logits", logits, ref_logits, kEpTol);

  // Gradients: dense tensors summed over every rank, expert slices over the ranks holding them.
  for (size_t i = 0; i < entries.size(); ++i) {
    const ParamEntry& pe = entries[i];
    const ParamEntry& re = ref.layout().find(pe.name);
    std::vector<float> g(model.grads() + pe.offset, model.grads() + pe.offset + pe.numel);
    Comm& over = pe.expert ? *groups.ep_dp : world;
    over.all_reduce(g.data(), pe.numel, ReduceOp::kSum);
    const int64_t start = model.placements()[i].offset;
    const std::vector<float> want(ref.grads() + re.offset + start, ref.grads() + re.offset + start + pe.numel);
    expect_parity(tag + "grad " + pe.name, g, want, pe.expert && fp8 != nullptr ? kEpFp8GroupedWgrad : kEpTol);
  }
  return {st.tokens_per_expert};
}

// ---------------------------------------------------------------------------------------------
// Activation recomputation under expert parallelism.

// Model<float> with an EP context, train.recompute selective and full against none on the same
// rank: two micro-batches of different shapes (gradients accumulate), stats, logits and every
// local gradient bitwise, and less saved memory after forward. Every rank recomputes its MoE
// blocks' row exchange in backward. Collective over `world`.
inline void check_model_recompute_case(Comm& world, const ModelCase& c, const cpu::Fp8Recipe* fp8 = nullptr) {
  const int me = world.rank();
  const std::string tag = rank_tag(world) + c.name + ": ";
  ExpertParallelGroups groups = split_expert_parallel(world, c.ep);
  ExpertParallel ep = make_expert_parallel(*groups.ep, c.e.num_experts);
  ep.rowwise = c.rowwise;
  ep.capacity_factor = c.ep_capacity_factor;
  const int64_t b = c.batch_per_rank;
  struct Result {
    std::vector<ForwardStats> stats;
    std::vector<std::vector<float>> logits;
    std::vector<int64_t> bytes;
    std::vector<float> grads;
  };
  auto run = [&](Recompute mode) {
    Model<float> model(c.m, c.e, &ep);
    model.init_params(c.seed);
    model.set_fp8(fp8);
    model.set_recompute(mode);
    if (c.bias_of) model.expert_bias() = c.bias_of(me, model.num_moe_layers());
    model.zero_grads();
    Result r;
    for (int64_t seq : {c.seq, c.seq + 2}) {
      std::vector<int32_t> inputs(b * seq), targets(b * seq);
      for (int64_t i = 0; i < b * seq; ++i) {
        inputs[i] = static_cast<int32_t>((i * 7 + 3 + 5 * me + seq) % c.m.vocab_size);
        targets[i] = i % 9 == 4 ? -1 : static_cast<int32_t>((i * 5 + 1 + me) % c.m.vocab_size);
      }
      r.stats.push_back(model.forward(inputs.data(), targets.data(), b, seq, c.routing_seed + uint64_t(seq)));
      r.logits.push_back(model.logits());
      r.bytes.push_back(model.saved_activation_bytes());
      model.backward({1.0 / 23, c.e.lb_loss_weight, c.e.z_loss_weight});
    }
    r.grads.assign(model.grads(), model.grads() + model.layout().total_numel());
    return r;
  };
  const Result ref = run(Recompute::kNone);
  for (Recompute mode : {Recompute::kSelective, Recompute::kFull}) {
    const std::string at = tag + recompute_name(mode) + ": ";
    const Result r = run(mode);
    for (size_t i = 0; i < ref.stats.size(); ++i) {
      const ForwardStats &a = r.stats[i], &e = ref.stats[i];
      EXPECT_EQ(std::memcmp(&a.ce_sum, &e.ce_sum, sizeof(double)), 0) << at << "ce_sum of micro-batch " << i;
      EXPECT_EQ(std::memcmp(&a.lb_loss, &e.lb_loss, sizeof(double)), 0) << at << "lb_loss of micro-batch " << i;
      EXPECT_EQ(std::memcmp(&a.z_loss, &e.z_loss, sizeof(double)), 0) << at << "z_loss of micro-batch " << i;
      EXPECT_EQ(a.tokens_per_expert, e.tokens_per_expert) << at << "counts of micro-batch " << i;
      EXPECT_EQ(a.num_routes, e.num_routes) << at;
      EXPECT_EQ(a.num_dropped, e.num_dropped) << at << "dropped routes of micro-batch " << i;
      EXPECT_TRUE(r.logits[i] == ref.logits[i] &&
                  std::memcmp(r.logits[i].data(), ref.logits[i].data(), r.logits[i].size() * sizeof(float)) == 0)
          << at << "logits of micro-batch " << i;
      EXPECT_LT(r.bytes[i], ref.bytes[i]) << at << "saved bytes after forward " << i;
    }
    ASSERT_EQ(r.grads.size(), ref.grads.size()) << at;
    EXPECT_EQ(std::memcmp(r.grads.data(), ref.grads.data(), r.grads.size() * sizeof(float)), 0)
        << at << "gradients differ from recompute none";
  }
}

}  // namespace moe::testing
