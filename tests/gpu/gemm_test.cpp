// cuda::gemm / gemm_strided_batched against cpu::gemm<float> on the same BF16 inputs, all four
// transpose combinations: random inputs under the bf16 row (C BF16) and the fp32-gemm bound (C FP32,
// beta = 1 accumulating onto a random C); integer-valued inputs, whose FP32 sums are exact in any
// order, bitwise. Padding columns of C are never written; k = 0 gives C = beta * C.
#include <cmath>

#include "cpu/linear.h"
#include "cuda/ops/gemm.h"
#include "gpu/gpu_test_util.h"
#include "support/parity.h"

namespace moe::testing {
namespace {

struct GemmCase {
  int64_t m, n, k;
  bool trans_a, trans_b;
  int64_t pad;      // extra elements per row of A, B and C (leading dims larger than the rows)
  size_t misalign;  // bytes added to every BF16 device pointer (2: unaligned for 16-byte loads)
};

// Row-major storage of the operands of one case.
struct Dims {
  int64_t a_rows, lda, b_rows, ldb, ldc;
  explicit Dims(const GemmCase& p)
      : a_rows(p.trans_a ? p.k : p.m),
        lda((p.trans_a ? p.m : p.k) + p.pad),
        b_rows(p.trans_b ? p.n : p.k),
        ldb((p.trans_b ? p.k : p.n) + p.pad),
        ldc(p.n + p.pad) {}
};

// Test buffers are filled on the legacy default stream (cudaMemset; a pageable cudaMemcpy may
// return before its DMA lands) while the ops run on a non-blocking stream: wait for the fills first.
void settle_uploads() { MOE_CUDA_CHECK(cudaDeviceSynchronize()); }

// Integers in [-3, 3] as BF16: every product and FP32 partial sum below is exact.
std::vector<uint16_t> integer_bf16(int64_t n, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> dist(-3, 3);
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (auto& b : v) b = f32_to_bf16(static_cast<float>(dist(gen)));
  return v;
}

std::vector<float> integer_f32(int64_t n, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> dist(-50, 50);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(dist(gen));
  return v;
}

// The m x n block of a row-major matrix with leading dim ld.
template <typename T>
std::vector<T> valid_block(const std::vector<T>& c, int64_t m, int64_t n, int64_t ld) {
  std::vector<T> out;
  out.reserve(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) out.push_back(c[i * ld + j]);
  return out;
}

// Columns [n, ld) of every row still hold `before`'s bytes.
template <typename T>
void expect_padding_unchanged(const std::string& what, const std::vector<T>& after, const std::vector<T>& before,
                              int64_t m, int64_t n, int64_t ld) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = n; j < ld; ++j) {
      if (std::memcmp(&after[i * ld + j], &before[i * ld + j], sizeof(T)) != 0) {
        ADD_FAILURE() << what << ": padding element (" << i << ", " << j << ") of C was written";
        return;
      }
    }
  }
}

std::vector<float> bf16_rounded(const std::vector<float>& f) {
  std::vector<float> out(f.size());
  for (size_t i = 0; i < f.size(); ++i) out[i] = moe::bf16_to_f32(f32_to_bf16(f[i]));
  return out;
}

// FP32 C against the reference summed in another order (and with the tensor cores' own rounding),
// under the GEMM bound the grouped GEMM tests use ("fp32-gemm"): |got - ref| <= 2^-16 ||op(A)[i, :]||
// ||op(B)[:, j]|| + 2^-22 |ref|. The first term bounds the dot product's rounding (Cauchy-Schwarz: the
// terms' absolute sum is at most the product of the norms); the second, the final add onto C.
constexpr double kGemmDotTol = 0x1p-16;
constexpr double kGemmAddTol = 0x1p-22;

void expect_gemm_f32_parity(const std::string& what, const GemmCase& p, const Dims& d, const std::vector<float>& af,
                            const std::vector<float>& bf, const std::vector<float>& got, const std::vector<float>& ref) {
  ASSERT_EQ(got.size(), ref.size());
  std::vector<double> norm_a(static_cast<size_t>(p.m), 0.0), norm_b(static_cast<size_t>(p.n), 0.0);
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t l = 0; l < p.k; ++l) {
      const double v = p.trans_a ? af[l * d.lda + i] : af[i * d.lda + l];
      norm_a[i] += v * v;
    }
  }
  for (int64_t j = 0; j < p.n; ++j) {
    for (int64_t l = 0; l < p.k; ++l) {
      const double v = p.trans_b ? bf[j * d.ldb + l] : bf[l * d.ldb + j];
      norm_b[j] += v * v;
    }
  }
  int64_t bad = 0, first_bad = -1;
  double max_abs = 0.0, max_ratio = 0.0;
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j) {
      const int64_t x = i * p.n + j;
      const double g = got[x], f = ref[x];
      const double err = std::fabs(g - f);
      const double bound = kGemmDotTol * std::sqrt(norm_a[i] * norm_b[j]) + kGemmAddTol * std::fabs(f);
      const bool ok = std::isfinite(g) && std::isfinite(f) && err <= bound;
      if (std::isfinite(err)) max_abs = std::max(max_abs, err);
      if (bound > 0.0 && std::isfinite(err)) max_ratio = std::max(max_ratio, err / bound);
      if (!ok) {
        ++bad;
        if (first_bad < 0) first_bad = x;
      }
    }
  }
  std::printf("parity %s: n=%zu tol=fp32-gemm max_abs=%.3e max_err/bound=%.3e bad=%lld\n", what.c_str(), got.size(),
              max_abs, max_ratio, static_cast<long long>(bad));
  if (bad > 0) {
    ADD_FAILURE() << what << " fails the fp32-gemm bound: " << bad << " of " << got.size()
                  << " out of bounds or not finite; first at (" << first_bad / p.n << ", " << first_bad % p.n
                  << "): got " << got[first_bad] << ", reference " << ref[first_bad];
  }
}

std::string case_name(const GemmCase& p) {
  return param_name("m", p.m, "_n", p.n, "_k", p.k, p.trans_a ? "_At" : "_An", p.trans_b ? "_Bt" : "_Bn",
                    p.pad ? "_padded" : "", p.misalign ? "_misaligned" : "");
}

class GemmParity : public ::testing::TestWithParam<GemmCase> {
 protected:
  // Runs C (BF16, beta = 0 onto NaN bytes, alpha = alpha_bf16) and C (FP32, beta = 1 onto c0_f32) on
  // the GPU and the CPU; `exact` asks for bitwise equality, else the tolerance rows.
  void run_case(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, const std::vector<float>& c0_f32,
                float alpha_bf16, bool exact, const std::string& tag) {
    const GemmCase p = GetParam();
    const Dims d(p);
    cuda::GemmHandle h;
    GuardedBuffer<uint16_t> d_a(a, p.misalign), d_b(b, p.misalign), d_c16(p.m * d.ldc, p.misalign);
    GuardedBuffer<float> d_c32(c0_f32, p.misalign * 2);
    const std::vector<uint16_t> c16_before = d_c16.download();
    TestStream stream;
    settle_uploads();
    cuda::gemm(h, p.trans_a, p.trans_b, p.m, p.n, p.k, alpha_bf16, d_a.data(), d.lda, d_b.data(), d.ldb, 0.0f,
               d_c16.data(), d.ldc, stream.get());
    cuda::gemm(h, p.trans_a, p.trans_b, p.m, p.n, p.k, 1.0f, d_a.data(), d.lda, d_b.data(), d.ldb, 1.0f,
               d_c32.data(), d.ldc, stream.get());
    stream.sync();
    const auto c16 = d_c16.download();
    const auto c32 = d_c32.download();

    const auto af = bf16_to_f32(a), bf = bf16_to_f32(b);
    std::vector<float> ref16(static_cast<size_t>(p.m * d.ldc), 0.0f), ref32 = c0_f32;
    cpu::gemm<float>(p.trans_a, p.trans_b, p.m, p.n, p.k, alpha_bf16, af.data(), d.lda, bf.data(), d.ldb, 0.0f,
                     ref16.data(), d.ldc);
    cpu::gemm<float>(p.trans_a, p.trans_b, p.m, p.n, p.k, 1.0f, af.data(), d.lda, bf.data(), d.ldb, 1.0f,
                     ref32.data(), d.ldc);
    const auto got16 = valid_block(bf16_to_f32(c16), p.m, p.n, d.ldc);
    const auto got32 = valid_block(c32, p.m, p.n, d.ldc);
    if (exact) {
      expect_parity("gemm." + tag + ".c_bf16", got16, bf16_rounded(valid_block(ref16, p.m, p.n, d.ldc)), kExact);
      expect_parity("gemm." + tag + ".c_f32", got32, valid_block(ref32, p.m, p.n, d.ldc), kExact);
    } else {
      expect_parity("gemm." + tag + ".c_bf16", got16, valid_block(ref16, p.m, p.n, d.ldc), kBF16Elementwise);
      expect_gemm_f32_parity("gemm." + tag + ".c_f32", p, d, af, bf, got32, valid_block(ref32, p.m, p.n, d.ldc));
    }
    expect_padding_unchanged("c_bf16", c16, c16_before, p.m, p.n, d.ldc);
    expect_padding_unchanged("c_f32", c32, c0_f32, p.m, p.n, d.ldc);
    EXPECT_TRUE(bitwise_equal(d_a.download(), a)) << "A was modified";
    EXPECT_TRUE(bitwise_equal(d_b.download(), b)) << "B was modified";
    d_a.expect_guards_intact("a");
    d_b.expect_guards_intact("b");
    d_c16.expect_guards_intact("c_bf16");
    d_c32.expect_guards_intact("c_f32");
  }
};

TEST_P(GemmParity, RandomInputs) {
  MOE_SKIP_WITHOUT_GPU();
  const GemmCase p = GetParam();
  const Dims d(p);
  run_case(random_bf16(d.a_rows * d.lda, 41), random_bf16(d.b_rows * d.ldb, 42), random_f32(p.m * d.ldc, 43, 4.0f),
           1.0f, /*exact=*/false, "random");
}

TEST_P(GemmParity, IntegerInputsAreExact) {
  MOE_SKIP_WITHOUT_GPU();
  const GemmCase p = GetParam();
  const Dims d(p);
  run_case(integer_bf16(d.a_rows * d.lda, 51), integer_bf16(d.b_rows * d.ldb, 52), integer_f32(p.m * d.ldc, 53),
           0.5f, /*exact=*/true, "integer");
}

std::vector<GemmCase> gemm_cases() {
  const GemmCase shapes[] = {
      {1, 1, 1, false, false, 0, 0},          {257, 259, 131, false, false, 0, 0},
      {4096, 2048, 1024, false, false, 0, 0}, {64, 48, 0, false, false, 0, 0},
      {33, 17, 40, false, false, 3, 0},       {257, 259, 131, false, false, 0, 2},
      {128, 96, 64, false, false, 0, 2},
  };
  std::vector<GemmCase> cases;
  for (const GemmCase& s : shapes) {
    for (int t = 0; t < 4; ++t) {
      GemmCase c = s;
      c.trans_a = (t & 1) != 0;
      c.trans_b = (t & 2) != 0;
      cases.push_back(c);
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmParity, ::testing::ValuesIn(gemm_cases()),
                         [](const auto& info) { return case_name(info.param); });

// k = 0: C = beta * C (beta = 0 writes zeros even over NaN), for both C types.
TEST(Gemm, ZeroKScalesC) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t m = 37, n = 29, ldc = 31;
  cuda::GemmHandle h;
  const auto c16_0 = random_bf16(m * ldc, 61);
  const auto c32_0 = random_f32(m * ldc, 62);
  GuardedBuffer<uint16_t> a(1), b(1), c16(c16_0), c16_nan(m * ldc);
  GuardedBuffer<float> c32(c32_0);
  TestStream stream;
  settle_uploads();
  cuda::gemm(h, false, true, m, n, 0, 1.0f, a.data(), 1, b.data(), 1, 0.5f, c16.data(), ldc, stream.get());
  cuda::gemm(h, true, false, m, n, 0, 1.0f, a.data(), 1, b.data(), 1, -2.0f, c32.data(), ldc, stream.get());
  cuda::gemm(h, false, false, m, n, 0, 1.0f, a.data(), 1, b.data(), 1, 0.0f, c16_nan.data(), ldc, stream.get());
  stream.sync();
  const auto g16 = c16.download(), gnan = c16_nan.download();
  const auto g32 = c32.download();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < ldc; ++j) {
      const int64_t x = i * ldc + j;
      const bool inside = j < n;
      const uint16_t want16 = inside ? f32_to_bf16(0.5f * moe::bf16_to_f32(c16_0[x])) : c16_0[x];
      const float want32 = inside ? -2.0f * c32_0[x] : c32_0[x];
      ASSERT_EQ(g16[x], want16) << "bf16 C at (" << i << ", " << j << ")";
      ASSERT_EQ(std::memcmp(&g32[x], &want32, sizeof(float)), 0) << "f32 C at (" << i << ", " << j << ")";
      ASSERT_EQ(gnan[x], inside ? uint16_t{0} : uint16_t{0xFFFF}) << "beta = 0 C at (" << i << ", " << j << ")";
    }
  }
  c16.expect_guards_intact("c16");
  c32.expect_guards_intact("c32");
  c16_nan.expect_guards_intact("c16_nan");
}

// batch matrices at strides with gaps (and a B shared by the batch via stride 0) against a loop of
// cpu::gemm on integer inputs: bitwise.
TEST(Gemm, StridedBatchedMatchesLoopOfGemms) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t batch = 3, m = 65, n = 33, k = 47;
  cuda::GemmHandle h;
  for (int t = 0; t < 4; ++t) {
    const bool ta = (t & 1) != 0, tb = (t & 2) != 0;
    const bool shared_b = t == 3;
    const int64_t lda = ta ? m : k, ldb = tb ? k : n, ldc = n + 2;
    const int64_t stride_a = (ta ? k : m) * lda + 5, stride_b = shared_b ? 0 : (tb ? n : k) * ldb + 7;
    const int64_t stride_c = m * ldc + 3;
    const auto a = integer_bf16(stride_a * batch, 71 + t);
    const auto b = integer_bf16(shared_b ? (tb ? n : k) * ldb : stride_b * batch, 81 + t);
    const auto c0 = integer_f32(stride_c * batch, 91 + t);
    GuardedBuffer<uint16_t> d_a(a), d_b(b), d_c16(stride_c * batch);
    GuardedBuffer<float> d_c32(c0);
    TestStream stream;
    settle_uploads();
    cuda::gemm_strided_batched(h, ta, tb, m, n, k, 1.0f, d_a.data(), lda, stride_a, d_b.data(), ldb, stride_b, 0.0f,
                               d_c16.data(), ldc, stride_c, batch, stream.get());
    cuda::gemm_strided_batched(h, ta, tb, m, n, k, 1.0f, d_a.data(), lda, stride_a, d_b.data(), ldb, stride_b, 1.0f,
                               d_c32.data(), ldc, stride_c, batch, stream.get());
    stream.sync();
    const auto c16 = d_c16.download();
    const auto c32 = d_c32.download();
    const auto af = bf16_to_f32(a), bf = bf16_to_f32(b);
    for (int64_t i = 0; i < batch; ++i) {
      std::vector<float> ref16(static_cast<size_t>(m * ldc), 0.0f);
      std::vector<float> ref32(c0.begin() + i * stride_c, c0.begin() + i * stride_c + m * ldc);
      cpu::gemm<float>(ta, tb, m, n, k, 1.0f, af.data() + i * stride_a, lda, bf.data() + i * stride_b, ldb, 0.0f,
                       ref16.data(), ldc);
      cpu::gemm<float>(ta, tb, m, n, k, 1.0f, af.data() + i * stride_a, lda, bf.data() + i * stride_b, ldb, 1.0f,
                       ref32.data(), ldc);
      const std::vector<uint16_t> g16(c16.begin() + i * stride_c, c16.begin() + i * stride_c + m * ldc);
      const std::vector<float> g32(c32.begin() + i * stride_c, c32.begin() + i * stride_c + m * ldc);
      const std::string tag = param_name("gemm_batched.t", t, ".batch", i);
      expect_parity(tag + ".c_bf16", valid_block(bf16_to_f32(g16), m, n, ldc), bf16_rounded(valid_block(ref16, m, n, ldc)),
                    kExact);
      expect_parity(tag + ".c_f32", valid_block(g32, m, n, ldc), valid_block(ref32, m, n, ldc), kExact);
    }
    // The gaps between C matrices are never written.
    for (int64_t i = 0; i < batch; ++i) {
      for (int64_t x = i * stride_c + m * ldc; x < (i + 1) * stride_c; ++x) {
        ASSERT_EQ(c16[x], uint16_t{0xFFFF}) << "gap element " << x << " of batched bf16 C was written";
        ASSERT_EQ(std::memcmp(&c32[x], &c0[x], sizeof(float)), 0) << "gap element " << x << " of batched f32 C";
      }
    }
    d_c16.expect_guards_intact("batched c16");
    d_c32.expect_guards_intact("batched c32");
  }
}

// Plans are built once per problem: a repeated call adds none, a new shape or a less aligned pointer adds one.
TEST(Gemm, PlansAreCachedPerProblem) {
  MOE_SKIP_WITHOUT_GPU();
  cuda::GemmHandle h;
  EXPECT_EQ(h.num_plans(), 0u);
  const int64_t m = 40, n = 24, k = 16;
  GuardedBuffer<uint16_t> a(random_bf16(m * k + 8, 101)), b(random_bf16(k * n + 8, 102)), c(m * n + 8);
  TestStream stream;
  cuda::gemm(h, false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n, stream.get());
  EXPECT_EQ(h.num_plans(), 1u);
  cuda::gemm(h, false, false, m, n, k, 2.0f, a.data(), k, b.data(), n, 1.0f, c.data(), n, stream.get());
  EXPECT_EQ(h.num_plans(), 1u) << "alpha and beta are not part of a plan";
  cuda::gemm(h, false, false, m, n, k, 1.0f, a.data() + 1, k, b.data(), n, 0.0f, c.data(), n, stream.get());
  EXPECT_EQ(h.num_plans(), 2u) << "a 2-byte aligned A needs its own plan";
  cuda::gemm(h, false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n, stream.get());
  EXPECT_EQ(h.num_plans(), 3u);
  stream.sync();
}

TEST(Gemm, BadLeadingDimensionNamesTheShape) {
  MOE_SKIP_WITHOUT_GPU();
  cuda::GemmHandle h;
  GuardedBuffer<uint16_t> a(257 * 131), b(131 * 259), c(257 * 259);
  try {
    cuda::gemm(h, false, false, 257, 259, 131, 1.0f, a.data(), 130, b.data(), 259, 0.0f, c.data(), 259, nullptr);
    ADD_FAILURE() << "expected moe::Error";
  } catch (const moe::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("lda >= k"), std::string::npos) << msg;
    EXPECT_NE(msg.find("m=257 n=259 k=131"), std::string::npos) << msg;
  }
}

// After one eager call per problem, a graph of BF16 and FP32-accumulating GEMMs replays bitwise
// like the eager run and builds no new plan.
TEST(Gemm, CapturedGemmsReplayBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  cuda::GemmHandle h;
  const int64_t m = 192, n = 160, k = 96;
  GuardedBuffer<uint16_t> x(random_bf16(m * k, 111)), w(random_bf16(n * k, 112)), y(m * n), dy(random_bf16(m * n, 113));
  const auto dw0 = random_f32(n * k, 114);
  GuardedBuffer<float> dw(dw0);
  TestStream stream;
  settle_uploads();
  auto step = [&](cudaStream_t s) {
    cuda::gemm(h, false, true, m, n, k, 1.0f, x.data(), k, w.data(), k, 0.0f, y.data(), n, s);     // y = x W^T
    cuda::gemm(h, true, false, n, k, m, 1.0f, dy.data(), n, x.data(), k, 1.0f, dw.data(), k, s);   // dW += dy^T x
  };
  step(stream.get());
  stream.sync();
  const auto y_eager = y.download();
  const auto dw_eager = dw.download();
  const size_t plans = h.num_plans();

  cudaGraph_t graph = nullptr;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  step(stream.get());
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  EXPECT_EQ(h.num_plans(), plans) << "capture built a plan";
  for (int replay = 1; replay <= 2; ++replay) {
    y.upload(std::vector<uint16_t>(static_cast<size_t>(m * n), 0xFFFF));
    dw.upload(dw0);
    settle_uploads();
    MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    stream.sync();
    EXPECT_TRUE(bitwise_equal(y.download(), y_eager)) << "replay " << replay << ": y differs from the eager run";
    const auto dw_replay = dw.download();
    EXPECT_EQ(std::memcmp(dw_replay.data(), dw_eager.data(), dw_eager.size() * sizeof(float)), 0)
        << "replay " << replay << ": dW differs from the eager run";
  }
  MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOE_CUDA_CHECK(cudaGraphDestroy(graph));
}

}  // namespace
}  // namespace moe::testing
