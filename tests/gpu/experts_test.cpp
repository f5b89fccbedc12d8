// cuda::experts_forward / _backward against cpu::experts_* in float on the same BF16 inputs, for both
// grouped GEMM backends (mma; wgmma where the device is sm_90). Each stored GPU tensor is one BF16
// rounding of FP32 math on the GPU's previous tensor, so each is held to the bf16 row against the
// twin's step fed that tensor (gate_up and dh against cpu::experts_* directly; h, y, dgate_up and
// dx against the cpu::swiglu / cpu::gemm calls cpu::experts_* is made of), weight gradients to
// fp32-reduction, and the whole chain (y, dx) against cpu::experts_* normwise. Groups: awkward
// widths, empty experts first / middle / last, every row in one expert, E = 1, no rows at all; rows
// past offsets[E] hold NaN inputs (never change a result) and stay unwritten in y, gate_up and dx.
// In place (dx = dy, as the expert-parallel path runs it) equals out of place bitwise; the op equals
// its grouped GEMM + SwiGLU sequence bitwise; a captured graph replays with the offsets changed on
// the device equal to eager runs.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <numeric>
#include <ostream>
#include <tuple>

#include "cpu/experts.h"
#include "cpu/linear.h"
#include "cpu/swiglu.h"
#include "cuda/ops/experts.h"
#include "cuda/ops/grouped_gemm.h"
#include "cuda/ops/swiglu.h"
#include "gpu/gpu_test_util.h"
#include "support/parity.h"

namespace moe::testing {
namespace {

using Backend = cuda::GroupedGemmBackend;

#define MOE_SKIP_WITHOUT_BACKEND(backend)                                                    \
  do {                                                                                       \
    MOE_SKIP_WITHOUT_GPU();                                                                  \
    if ((backend) == Backend::kWgmma && !cuda::grouped_gemm_wgmma_available())               \
      GTEST_SKIP() << "the wgmma backend needs a compute capability 9.0 device";             \
  } while (0)

// Rows per expert (prefix sums give the offsets) and spare rows past offsets[E]:
// max_rows = sum(counts) + spare_rows.
struct ExpertsCase {
  const char* name;
  int64_t d, inner;
  std::vector<int64_t> counts;
  int64_t spare_rows;

  int64_t num_experts() const { return static_cast<int64_t>(counts.size()); }
  int64_t rows() const { return std::accumulate(counts.begin(), counts.end(), int64_t{0}); }
  int64_t max_rows() const { return rows() + spare_rows; }
  std::vector<int32_t> offsets() const {
    std::vector<int32_t> off(counts.size() + 1, 0);
    for (size_t e = 0; e < counts.size(); ++e) off[e + 1] = off[e] + static_cast<int32_t>(counts[e]);
    return off;
  }
};

void PrintTo(const ExpertsCase& c, std::ostream* os) {
  *os << c.name << " (E=" << c.num_experts() << ", d=" << c.d << ", inner=" << c.inner << ", rows=" << c.rows()
      << ", max_rows=" << c.max_rows() << ")";
}

std::vector<int64_t> drawn_counts(int64_t rows, int64_t num_experts, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int64_t> pick(0, num_experts - 1);
  std::vector<int64_t> counts(static_cast<size_t>(num_experts), 0);
  for (int64_t r = 0; r < rows; ++r) ++counts[static_cast<size_t>(pick(gen))];
  return counts;
}

std::vector<ExpertsCase> cases() {
  return {
      {"awkward", 40, 24, {0, 1, 130, 17, 0}, 5},
      {"empty_first_middle_last", 64, 32, {0, 33, 0, 64, 7, 0}, 0},
      {"one_expert_all_rows", 136, 72, {0, 0, 0, 300, 0, 0, 0, 0}, 9},
      {"single_expert", 48, 40, {77}, 3},
      {"no_rows", 32, 16, {0, 0, 0, 0}, 16},
      {"e8_d256_i128", 256, 128, drawn_counts(512, 8, 31), 0},
  };
}

constexpr uint16_t kBF16NaN = 0x7FC0;
constexpr uint16_t kUnwritten = 0xFFFF;

void poison_rows(std::vector<uint16_t>& v, int64_t width, int64_t from) {
  std::fill(v.begin() + from * width, v.end(), kBF16NaN);
}

struct Inputs {
  std::vector<uint16_t> x, w_gate_up, w_down, dy;  // x [R, D], w_gate_up [E, 2I, D], w_down [E, D, I], dy [R, D]
  std::vector<float> dw0_gate_up, dw0_down;        // FP32 gradients before the backward
};

Inputs make_inputs(const ExpertsCase& c, uint64_t seed) {
  const int64_t e = c.num_experts(), d = c.d, in = c.inner, r = c.max_rows();
  Inputs a;
  a.x = random_bf16(r * d, seed);
  a.w_gate_up = random_bf16(e * 2 * in * d, seed + 1, 1.0f / std::sqrt(float(d)));
  a.w_down = random_bf16(e * d * in, seed + 2, 1.0f / std::sqrt(float(in)));
  a.dy = random_bf16(r * d, seed + 3);
  poison_rows(a.x, d, c.rows());
  poison_rows(a.dy, d, c.rows());
  a.dw0_gate_up = random_f32(e * 2 * in * d, seed + 4);
  a.dw0_down = random_f32(e * d * in, seed + 5);
  return a;
}

// The first `rows` rows of a [*, width] array, as bits and as float.
std::vector<uint16_t> head_rows_bits(const std::vector<uint16_t>& v, int64_t rows, int64_t width) {
  return std::vector<uint16_t>(v.begin(), v.begin() + rows * width);
}
std::vector<float> head_rows(const std::vector<uint16_t>& v, int64_t rows, int64_t width) {
  return bf16_to_f32(head_rows_bits(v, rows, width));
}

bool bitwise_equal_f32(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void expect_rows_unwritten(const std::string& what, const std::vector<uint16_t>& v, int64_t width, int64_t from) {
  for (size_t i = size_t(from * width); i < v.size(); ++i) {
    if (v[i] != kUnwritten) {
      ADD_FAILURE() << what << ": row " << int64_t(i) / width << " past offsets[E] was written";
      return;
    }
  }
}

// Normwise check of a chain of BF16 roundings against the all-FP32 twin: each stored tensor adds
// at most 2^-9 relative error per element, amplified by at most a few through SwiGLU; three to
// four roundings stay far below 2^-6 normwise on these inputs.
constexpr double kChainNormTol = 0x1p-6;

void expect_chain(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref) {
  ASSERT_EQ(got.size(), ref.size());
  double err = 0, base = 0;
  int64_t nonfinite = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]) || !std::isfinite(ref[i])) ++nonfinite;
    err += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
    base += double(ref[i]) * ref[i];
  }
  const double norm = base > 0 ? std::sqrt(err / base) : std::sqrt(err);
  std::printf("parity %s: n=%zu tol=bf16-chain(normwise %.3e) norm=%.3e nonfinite=%lld\n", what.c_str(), got.size(),
              kChainNormTol, norm, static_cast<long long>(nonfinite));
  EXPECT_EQ(nonfinite, 0) << what;
  EXPECT_LE(norm, kChainNormTol) << what << " against the all-FP32 twin";
}

// Both sides' outputs after one forward and one backward.
struct GpuRun {
  std::vector<uint16_t> gate_up, h, y, dx, dgate_up, dh;
  std::vector<float> dw_gate_up, dw_down;
};

GpuRun run_gpu(const ExpertsCase& c, const Inputs& a, Backend backend, bool in_place) {
  const int64_t e = c.num_experts(), d = c.d, in = c.inner, r = c.max_rows();
  GuardedBuffer<uint16_t> x(a.x), wgu(a.w_gate_up), wd(a.w_down), dy(a.dy);
  GuardedBuffer<uint16_t> gate_up(r * 2 * in), h(r * in), y(r * d), dx(r * d);
  GuardedBuffer<float> dwgu(a.dw0_gate_up), dwd(a.dw0_down);
  GuardedBuffer<int32_t> off(c.offsets());
  const size_t ws_bytes = cuda::experts_backward_workspace_bytes(r, in);
  GuardedBuffer<uint8_t> ws(static_cast<int64_t>(ws_bytes));
  TestStream stream;
  const cudaStream_t s = stream.get();
  cuda::experts_forward(x.data(), off.data(), wgu.data(), wd.data(), r, e, d, in, gate_up.data(), h.data(), y.data(),
                        s, backend);
  uint16_t* dx_ptr = in_place ? dy.data() : dx.data();
  cuda::experts_backward(x.data(), off.data(), wgu.data(), wd.data(), gate_up.data(), h.data(), dy.data(), r, e, d, in,
                         dx_ptr, dwgu.data(), dwd.data(), ws.data(), ws_bytes, s, backend);
  stream.sync();
  GpuRun g;
  g.gate_up = gate_up.download();
  g.h = h.download();
  g.y = y.download();
  g.dx = in_place ? dy.download() : dx.download();
  g.dw_gate_up = dwgu.download();
  g.dw_down = dwd.download();
  std::vector<uint16_t> w(static_cast<size_t>(r * 3 * in));
  if (r > 0) MOE_CUDA_CHECK(cudaMemcpy(w.data(), ws.data(), w.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  g.dgate_up.assign(w.begin(), w.begin() + r * 2 * in);
  g.dh.assign(w.begin() + r * 2 * in, w.end());
  EXPECT_TRUE(bitwise_equal(x.download(), a.x)) << "x_sorted was modified";
  EXPECT_TRUE(bitwise_equal(wgu.download(), a.w_gate_up)) << "w_gate_up was modified";
  EXPECT_TRUE(bitwise_equal(wd.download(), a.w_down)) << "w_down was modified";
  if (!in_place) {
    EXPECT_TRUE(bitwise_equal(dy.download(), a.dy)) << "dy was modified";
  }
  for (auto* b : {&x, &wgu, &wd, &dy, &gate_up, &h, &y, &dx}) b->expect_guards_intact("experts bf16 buffer");
  dwgu.expect_guards_intact("dw_gate_up");
  dwd.expect_guards_intact("dw_down");
  off.expect_guards_intact("expert_offsets");
  ws.expect_guards_intact("workspace");
  return g;
}

class ExpertsParity : public ::testing::TestWithParam<std::tuple<ExpertsCase, Backend>> {
 protected:
  const ExpertsCase& problem() const { return std::get<0>(GetParam()); }
  Backend backend() const { return std::get<1>(GetParam()); }
  std::string label(const char* what) const {
    return param_name(what, "[", problem().name, ",", cuda::grouped_gemm_backend_name(backend()), "]");
  }
};

TEST_P(ExpertsParity, ForwardBackward) {
  MOE_SKIP_WITHOUT_BACKEND(backend());
  const ExpertsCase& c = problem();
  const int64_t e = c.num_experts(), d = c.d, in = c.inner, rows = c.rows();
  const auto off = c.offsets();
  const Inputs a = make_inputs(c, 1001);
  const GpuRun g = run_gpu(c, a, backend(), false);

  const auto xf = bf16_to_f32(a.x), wguf = bf16_to_f32(a.w_gate_up), wdf = bf16_to_f32(a.w_down),
             dyf = bf16_to_f32(a.dy);
  const auto gate_up = head_rows(g.gate_up, rows, 2 * in), h = head_rows(g.h, rows, in), y = head_rows(g.y, rows, d);
  const auto dgate_up = head_rows(g.dgate_up, rows, 2 * in), dh = head_rows(g.dh, rows, in),
             dx = head_rows(g.dx, rows, d);

  // Forward: the twin on the BF16 inputs; each later GPU tensor against the twin's step on the GPU's
  // previous tensor.
  std::vector<float> ref_gate_up(size_t(rows * 2 * in)), ref_h(size_t(rows * in)), ref_y(size_t(rows * d));
  if (rows > 0) {
    cpu::experts_forward(xf.data(), off.data(), wguf.data(), wdf.data(), e, d, in, ref_gate_up.data(), ref_h.data(),
                         ref_y.data());
  }
  expect_parity(label("experts.gate_up"), gate_up, ref_gate_up, kBF16Elementwise);
  std::vector<float> step_h(size_t(rows * in)), step_y(size_t(rows * d), 0.0f);
  cpu::swiglu_forward(gate_up.data(), step_h.data(), rows, in);
  for (int64_t x = 0; x < e; ++x) {
    const int64_t r0 = off[x], n = off[x + 1] - off[x];
    if (n > 0) cpu::linear_forward(h.data() + r0 * in, wdf.data() + x * d * in, step_y.data() + r0 * d, n, in, d);
  }
  expect_parity(label("experts.h"), h, step_h, kBF16Elementwise);
  expect_parity(label("experts.y"), y, step_y, kBF16Elementwise);
  if (rows > 0) expect_chain(label("experts.y(chain)"), y, ref_y);

  // Backward: the twin fed the GPU's saved gate_up and h (so it is judged on its own), then the
  // steps after dh on the GPU's dh and dgate_up.
  std::vector<float> ref_dx(size_t(rows * d)), ref_dwgu = a.dw0_gate_up, ref_dwd = a.dw0_down,
                                               scratch(size_t(rows * 3 * in));
  if (rows > 0) {
    cpu::experts_backward(xf.data(), off.data(), wguf.data(), wdf.data(), gate_up.data(), h.data(), dyf.data(), e, d,
                          in, ref_dx.data(), ref_dwgu.data(), ref_dwd.data(), scratch.data());
  }
  const std::vector<float> ref_dh(scratch.begin() + rows * 2 * in, scratch.end());
  expect_parity(label("experts.dh"), dh, ref_dh, kBF16Elementwise);
  expect_parity(label("experts.dw_down"), g.dw_down, ref_dwd, kFP32Reduction);
  std::vector<float> step_dgu(size_t(rows * 2 * in)), step_dx(size_t(rows * d), 0.0f), step_dwgu = a.dw0_gate_up;
  cpu::swiglu_backward(gate_up.data(), dh.data(), step_dgu.data(), rows, in);
  for (int64_t x = 0; x < e; ++x) {
    const int64_t r0 = off[x], n = off[x + 1] - off[x];
    if (n == 0) continue;
    cpu::linear_backward(xf.data() + r0 * d, wguf.data() + x * 2 * in * d, dgate_up.data() + r0 * 2 * in,
                         step_dx.data() + r0 * d, step_dwgu.data() + x * 2 * in * d, n, d, 2 * in);
  }
  expect_parity(label("experts.dgate_up"), dgate_up, step_dgu, kBF16Elementwise);
  expect_parity(label("experts.dx"), dx, step_dx, kBF16Elementwise);
  expect_parity(label("experts.dw_gate_up"), g.dw_gate_up, step_dwgu, kFP32Reduction);
  if (rows > 0) expect_chain(label("experts.dx(chain)"), dx, ref_dx);

  // Rows past offsets[E] and empty experts.
  expect_rows_unwritten("gate_up", g.gate_up, 2 * in, rows);
  expect_rows_unwritten("y", g.y, d, rows);
  expect_rows_unwritten("dx", g.dx, d, rows);
  for (int64_t x = 0; x < e; ++x) {
    if (c.counts[size_t(x)] != 0) continue;
    EXPECT_EQ(std::memcmp(g.dw_gate_up.data() + x * 2 * in * d, a.dw0_gate_up.data() + x * 2 * in * d,
                          size_t(2 * in * d) * sizeof(float)), 0)
        << "dw_gate_up of empty expert " << x << " changed";
    EXPECT_EQ(
        std::memcmp(g.dw_down.data() + x * d * in, a.dw0_down.data() + x * d * in, size_t(d * in) * sizeof(float)), 0)
        << "dw_down of empty expert " << x << " changed";
  }

  // In place (dx = dy): bitwise the same.
  const GpuRun p = run_gpu(c, a, backend(), true);
  EXPECT_TRUE(bitwise_equal(head_rows_bits(p.dx, rows, d), head_rows_bits(g.dx, rows, d))) << "dx in place differs";
  EXPECT_TRUE(bitwise_equal_f32(p.dw_gate_up, g.dw_gate_up)) << "dw_gate_up in place differs";
  EXPECT_TRUE(bitwise_equal_f32(p.dw_down, g.dw_down)) << "dw_down in place differs";
}

std::string backend_suffix(Backend b) { return std::string("_") + cuda::grouped_gemm_backend_name(b); }

INSTANTIATE_TEST_SUITE_P(Groups, ExpertsParity,
                         ::testing::Combine(::testing::ValuesIn(cases()),
                                            ::testing::Values(Backend::kMma, Backend::kWgmma)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + backend_suffix(std::get<1>(info.param));
                         });

// The op is the grouped GEMM + SwiGLU sequence the CUDA model ran inline: bitwise the same outputs.
TEST(ExpertsOp, MatchesItsGroupedGemmSequenceBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  const ExpertsCase c{"sequence", 256, 128, {40, 0, 200, 17, 0, 64, 1, 190}, 0};
  const int64_t e = c.num_experts(), d = c.d, in = c.inner, r = c.max_rows();
  const Inputs a = make_inputs(c, 2001);
  GuardedBuffer<uint16_t> x(a.x), wgu(a.w_gate_up), wd(a.w_down), dy(a.dy);
  GuardedBuffer<int32_t> off(c.offsets());
  GuardedBuffer<uint16_t> gu1(r * 2 * in), h1(r * in), y1(r * d), dx1(r * d), gu2(r * 2 * in), h2(r * in), y2(r * d),
      dx2(r * d), dh2(r * in), dgu2(r * 2 * in);
  GuardedBuffer<float> dwgu1(a.dw0_gate_up), dwd1(a.dw0_down), dwgu2(a.dw0_gate_up), dwd2(a.dw0_down);
  const size_t ws_bytes = cuda::experts_backward_workspace_bytes(r, in);
  GuardedBuffer<uint8_t> ws(static_cast<int64_t>(ws_bytes));
  TestStream stream;
  const cudaStream_t s = stream.get();
  cuda::experts_forward(x.data(), off.data(), wgu.data(), wd.data(), r, e, d, in, gu1.data(), h1.data(), y1.data(), s);
  cuda::experts_backward(x.data(), off.data(), wgu.data(), wd.data(), gu1.data(), h1.data(), dy.data(), r, e, d, in,
                         dx1.data(), dwgu1.data(), dwd1.data(), ws.data(), ws_bytes, s);
  cuda::grouped_gemm_forward(x.data(), wgu.data(), off.data(), gu2.data(), r, e, 2 * in, d, s);
  cuda::swiglu_forward(gu2.data(), h2.data(), r, in, s);
  cuda::grouped_gemm_forward(h2.data(), wd.data(), off.data(), y2.data(), r, e, d, in, s);
  cuda::grouped_gemm_dgrad(dy.data(), wd.data(), off.data(), dh2.data(), r, e, d, in, s);
  cuda::grouped_gemm_wgrad(dy.data(), h2.data(), off.data(), dwd2.data(), r, e, d, in, true, s);
  cuda::swiglu_backward(gu2.data(), dh2.data(), dgu2.data(), r, in, s);
  cuda::grouped_gemm_dgrad(dgu2.data(), wgu.data(), off.data(), dx2.data(), r, e, 2 * in, d, s);
  cuda::grouped_gemm_wgrad(dgu2.data(), x.data(), off.data(), dwgu2.data(), r, e, 2 * in, d, true, s);
  stream.sync();
  EXPECT_TRUE(bitwise_equal(gu1.download(), gu2.download())) << "gate_up";
  EXPECT_TRUE(bitwise_equal(h1.download(), h2.download())) << "h";
  EXPECT_TRUE(bitwise_equal(y1.download(), y2.download())) << "y";
  EXPECT_TRUE(bitwise_equal(dx1.download(), dx2.download())) << "dx";
  EXPECT_TRUE(bitwise_equal_f32(dwgu1.download(), dwgu2.download())) << "dw_gate_up";
  EXPECT_TRUE(bitwise_equal_f32(dwd1.download(), dwd2.download())) << "dw_down";
  std::vector<uint16_t> w(static_cast<size_t>(r * 3 * in));
  MOE_CUDA_CHECK(cudaMemcpy(w.data(), ws.data(), ws_bytes, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(bitwise_equal(std::vector<uint16_t>(w.begin(), w.begin() + r * 2 * in), dgu2.download()))
      << "workspace dgate_up";
  EXPECT_TRUE(bitwise_equal(std::vector<uint16_t>(w.begin() + r * 2 * in, w.end()), dh2.download()))
      << "workspace dh";
}

// accumulate_dw = false (a step's first backward) writes what accumulating into zeros gives, never
// reading the old values (NaN here), experts without rows included; with no rows at all it zeroes.
TEST(ExpertsOp, OverwrittenWeightGradientsEqualAccumulatedIntoZeros) {
  MOE_SKIP_WITHOUT_GPU();
  const ExpertsCase c{"overwrite", 256, 128, {40, 0, 200, 17, 0, 64, 1, 190}, 0};
  const int64_t e = c.num_experts(), d = c.d, in = c.inner, r = c.max_rows();
  const Inputs a = make_inputs(c, 2002);
  GuardedBuffer<uint16_t> x(a.x), wgu(a.w_gate_up), wd(a.w_down), dy(a.dy);
  GuardedBuffer<int32_t> off(c.offsets());
  GuardedBuffer<uint16_t> gu(r * 2 * in), h(r * in), y(r * d), dx(r * d);
  const std::vector<float> nan_gu(a.dw0_gate_up.size(), NAN), nan_d(a.dw0_down.size(), NAN);
  GuardedBuffer<float> zgu(std::vector<float>(nan_gu.size(), 0.f)), zd(std::vector<float>(nan_d.size(), 0.f)),
      wgu_out(nan_gu), wd_out(nan_d), empty_gu(nan_gu), empty_d(nan_d);
  const size_t ws_bytes = cuda::experts_backward_workspace_bytes(r, in);
  GuardedBuffer<uint8_t> ws(static_cast<int64_t>(ws_bytes));
  TestStream stream;
  const cudaStream_t s = stream.get();
  cuda::experts_forward(x.data(), off.data(), wgu.data(), wd.data(), r, e, d, in, gu.data(), h.data(), y.data(), s);
  cuda::experts_backward(x.data(), off.data(), wgu.data(), wd.data(), gu.data(), h.data(), dy.data(), r, e, d, in,
                         dx.data(), zgu.data(), zd.data(), ws.data(), ws_bytes, s);
  cuda::experts_backward(x.data(), off.data(), wgu.data(), wd.data(), gu.data(), h.data(), dy.data(), r, e, d, in,
                         dx.data(), wgu_out.data(), wd_out.data(), ws.data(), ws_bytes, s,
                         cuda::GroupedGemmBackend::kAuto, /*accumulate_dw=*/false);
  cuda::experts_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, e, d, in, nullptr,
                         empty_gu.data(), empty_d.data(), nullptr, 0, s, cuda::GroupedGemmBackend::kAuto, false);
  stream.sync();
  auto same_up_to_subnormals = [](const std::vector<float>& p, const std::vector<float>& q) {
    if (p.size() != q.size()) return false;
    for (size_t i = 0; i < p.size(); ++i) {
      if (std::memcmp(&p[i], &q[i], sizeof(float)) == 0) continue;
      if (!(std::fabs(p[i]) < FLT_MIN && std::fabs(q[i]) < FLT_MIN)) return false;
    }
    return true;
  };
  EXPECT_TRUE(same_up_to_subnormals(wgu_out.download(), zgu.download())) << "dw_gate_up";
  EXPECT_TRUE(same_up_to_subnormals(wd_out.download(), zd.download())) << "dw_down";
  EXPECT_EQ(empty_gu.download(), std::vector<float>(nan_gu.size(), 0.f)) << "no rows: dw_gate_up zeroed";
  EXPECT_EQ(empty_d.download(), std::vector<float>(nan_d.size(), 0.f)) << "no rows: dw_down zeroed";
  wgu_out.expect_guards_intact("dw_gate_up");
  wd_out.expect_guards_intact("dw_down");
}

// One captured graph of forward and backward, replayed after the offsets were rewritten on the
// device: each replay must equal an eager run with the same offsets.
struct GraphBuffers {
  static constexpr int64_t kExperts = 8, kD = 256, kInner = 96, kMaxRows = 700;
  GuardedBuffer<uint16_t> x{random_bf16(kMaxRows * kD, 3001)},
      wgu{random_bf16(kExperts * 2 * kInner * kD, 3002, 0.0625f)}, wd{random_bf16(kExperts * kD * kInner, 3003, 0.1f)},
      dy{random_bf16(kMaxRows * kD, 3004)}, gate_up{kMaxRows * 2 * kInner}, h{kMaxRows * kInner}, y{kMaxRows * kD},
      dx{kMaxRows * kD};
  GuardedBuffer<float> dw_start_gu{random_f32(kExperts * 2 * kInner * kD, 3005)},
      dw_start_d{random_f32(kExperts * kD * kInner, 3006)}, dwgu{kExperts * 2 * kInner * kD},
      dwd{kExperts * kD * kInner};
  GuardedBuffer<int32_t> offsets{kExperts + 1};
  size_t ws_bytes = cuda::experts_backward_workspace_bytes(kMaxRows, kInner);
  GuardedBuffer<uint8_t> ws{static_cast<int64_t>(ws_bytes)};

  void run(cudaStream_t s) {
    for (auto* b : {&gate_up, &h, &y, &dx}) MOE_CUDA_CHECK(cudaMemsetAsync(b->data(), 0xFF, b->bytes(), s));
    MOE_CUDA_CHECK(cudaMemcpyAsync(dwgu.data(), dw_start_gu.data(), dwgu.bytes(), cudaMemcpyDeviceToDevice, s));
    MOE_CUDA_CHECK(cudaMemcpyAsync(dwd.data(), dw_start_d.data(), dwd.bytes(), cudaMemcpyDeviceToDevice, s));
    cuda::experts_forward(x.data(), offsets.data(), wgu.data(), wd.data(), kMaxRows, kExperts, kD, kInner,
                          gate_up.data(), h.data(), y.data(), s);
    cuda::experts_backward(x.data(), offsets.data(), wgu.data(), wd.data(), gate_up.data(), h.data(), dy.data(),
                           kMaxRows, kExperts, kD, kInner, dx.data(), dwgu.data(), dwd.data(), ws.data(), ws_bytes, s);
  }
};

struct GraphSnapshot {
  std::vector<uint16_t> gate_up, y, dx;
  std::vector<float> dwgu, dwd;
  bool operator==(const GraphSnapshot& o) const {
    return bitwise_equal(gate_up, o.gate_up) && bitwise_equal(y, o.y) && bitwise_equal(dx, o.dx) &&
           bitwise_equal_f32(dwgu, o.dwgu) && bitwise_equal_f32(dwd, o.dwd);
  }
};

GraphSnapshot snapshot(const GraphBuffers& b) {
  return {b.gate_up.download(), b.y.download(), b.dx.download(), b.dwgu.download(), b.dwd.download()};
}

TEST(ExpertsOp, GraphReplaysWithOffsetsChangedOnDevice) {
  MOE_SKIP_WITHOUT_GPU();
  GraphBuffers b;
  TestStream stream;
  const std::vector<std::vector<int32_t>> offset_sets = {
      {0, 100, 100, 350, 351, 450, 450, 650, 700},  // mixed, two empty experts, one single row
      {0, 0, 700, 700, 700, 700, 700, 700, 700},    // every row in expert 1
      {0, 10, 30, 60, 60, 60, 65, 70, 73},          // 73 of 700 rows grouped
      {0, 100, 100, 350, 351, 450, 450, 650, 700},  // the first set again
  };
  b.offsets.upload(offset_sets[0]);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  cudaGraph_t graph = nullptr;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  b.run(stream.get());
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  std::vector<GraphSnapshot> replays;
  for (size_t i = 0; i < offset_sets.size(); ++i) {
    b.offsets.upload(offset_sets[i]);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    b.run(stream.get());
    stream.sync();
    const GraphSnapshot eager = snapshot(b);
    MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    stream.sync();
    replays.push_back(snapshot(b));
    EXPECT_TRUE(replays.back() == eager) << "replay with offset set " << i << " differs from the eager run";
  }
  EXPECT_FALSE(replays[0] == replays[1]) << "replays with different offsets gave the same results";
  EXPECT_TRUE(replays[0] == replays[3]) << "replays with the same offsets differ";
  expect_rows_unwritten("y (replay, 73 rows grouped)", replays[2].y, GraphBuffers::kD, 73);
  MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOE_CUDA_CHECK(cudaGraphDestroy(graph));
  for (auto* buf : {&b.x, &b.wgu, &b.wd, &b.dy, &b.gate_up, &b.h, &b.y, &b.dx}) buf->expect_guards_intact("graph bf16");
  b.dwgu.expect_guards_intact("graph dw_gate_up");
  b.dwd.expect_guards_intact("graph dw_down");
  b.ws.expect_guards_intact("graph workspace");
}

template <typename Fn>
void expect_error_naming(Fn fn, std::initializer_list<const char*> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected moe::Error";
  } catch (const moe::Error& e) {
    for (const char* p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

// Every check comes before any device use, so these run without a GPU (the pointers are host
// memory that is never touched).
TEST(ExpertsOp, RejectsBadArguments) {
  alignas(16) static uint16_t host[4096];
  const uint16_t* x = host;
  uint16_t* out = host;
  const int32_t* off = reinterpret_cast<const int32_t*>(host);
  expect_error_naming([&] { cuda::experts_forward(x, off, x, x, 16, 4, 36, 16, out, out, out, nullptr); },
                      {"experts_forward", "d=36", "multiples of 8"});
  expect_error_naming([&] { cuda::experts_forward(x, off, x, x, 16, 0, 32, 16, out, out, out, nullptr); },
                      {"experts_forward", "num_experts", "got 0"});
  expect_error_naming(
      [&] {
        cuda::experts_backward(x, off, x, x, x, x, x, 16, 4, 32, 16, out, nullptr, nullptr, out, 100, nullptr);
      },
      {"experts_backward", "experts_backward_workspace_bytes"});
  // dx overlapping dy without being dy, and dx on top of a saved input.
  const size_t ws = cuda::experts_backward_workspace_bytes(4, 16);
  uint16_t* wsp = host + 2048;
  expect_error_naming(
      [&] {
        cuda::experts_backward(host + 512, off, x, x, host + 768, host + 1024, host + 1536, 4, 4, 32, 16, host + 1544,
                               nullptr, nullptr, wsp, ws, nullptr);
      },
      {"experts_backward", "dx_sorted overlaps dy"});
  expect_error_naming(
      [&] {
        cuda::experts_backward(host + 512, off, x, x, host + 768, host + 1024, host + 1536, 4, 4, 32, 16, host + 1024,
                               nullptr, nullptr, wsp, ws, nullptr);
      },
      {"experts_backward", "'h'"});
  // Nothing to do: no pointer is looked at.
  EXPECT_NO_THROW(cuda::experts_forward(nullptr, nullptr, nullptr, nullptr, 0, 4, 32, 16, nullptr, nullptr, nullptr,
                                        nullptr));
  EXPECT_NO_THROW(cuda::experts_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 4, 32, 16,
                                         nullptr, nullptr, nullptr, nullptr, 0, nullptr));
}

}  // namespace
}  // namespace moe::testing
