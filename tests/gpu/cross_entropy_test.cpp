// cuda::cross_entropy_forward_backward against cpu::cross_entropy_forward / _backward in float on
// the same BF16 logits: loss and lse under the FP32-reduction row, dlogits under the BF16 row, the
// loss sum within FP32 roundoff of the reference's sum. In place and out of place, vocab 1 to
// 262144, rows whose 16-byte alignment varies (odd vocab), ignored and out-of-range targets, and
// each block size a row may take.
#include <cmath>
#include <limits>
#include <string>

#include "cpu/cross_entropy.h"
#include "cuda/ops/cross_entropy.h"
#include "gpu/op_case_gpu.h"

namespace moe::testing {
namespace {

constexpr float kGradScale = 0.37f;

struct CeShape {
  int64_t n, vocab;
  double z_weight;
  bool in_place;
  size_t misalign;  // bytes shifted off the allocation's alignment (dlogits only when out of place)
  int threads = 0;  // block_threads: 0 for the launcher's choice
};

// Logits N(0, 2^2), every 3rd row shifted by +40 and every 5th by -25 (max-shifting matters).
std::vector<uint16_t> make_logits(int64_t n, int64_t vocab, uint64_t seed) {
  auto x = random_bf16(n * vocab, seed, 2.0f);
  for (int64_t r = 0; r < n; ++r) {
    const float shift = r % 3 == 1 ? 40.0f : (r % 5 == 2 ? -25.0f : 0.0f);
    if (shift == 0.0f) continue;
    for (int64_t j = 0; j < vocab; ++j) x[r * vocab + j] = f32_to_bf16(moe::bf16_to_f32(x[r * vocab + j]) + shift);
  }
  return x;
}

// Uniform targets in [0, vocab); every 7th row ignored (-1, or -100 on odd rows).
std::vector<int32_t> make_targets(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int64_t> any(0, vocab - 1);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[i] = i % 7 == 3 ? (i % 2 ? -100 : -1) : static_cast<int32_t>(any(gen));
  return t;
}

struct CeReference {
  std::vector<float> loss, lse, dlogits;
  double loss_sum = 0.0, abs_loss_sum = 0.0;
};

CeReference cpu_reference(const std::vector<uint16_t>& logits, const std::vector<int32_t>& targets, int64_t n,
                          int64_t vocab, double z_weight, float grad_scale) {
  CeReference r;
  const auto x = bf16_to_f32(logits);
  r.loss.resize(static_cast<size_t>(n));
  r.lse.resize(static_cast<size_t>(n));
  r.dlogits.resize(static_cast<size_t>(n * vocab));
  cpu::cross_entropy_forward(x.data(), targets.data(), r.loss.data(), r.lse.data(), n, vocab, z_weight);
  cpu::cross_entropy_backward(x.data(), targets.data(), r.lse.data(), r.dlogits.data(), n, vocab, z_weight,
                              grad_scale);
  for (const float l : r.loss) {
    r.loss_sum += l;
    r.abs_loss_sum += std::fabs(l);
  }
  return r;
}

// Device buffers of one call; dlogits is the logits buffer itself when in place.
struct CeBuffers {
  CeBuffers(const std::vector<uint16_t>& logits, const std::vector<int32_t>& targets, int64_t n, int64_t vocab,
            bool in_place, size_t misalign, float grad_scale, double loss_sum0)
      : d_logits(logits, in_place ? misalign : 0),
        d_dlogits(in_place ? 0 : n * vocab, misalign),
        d_targets(targets),
        d_loss(n),
        d_lse(n),
        d_grad_scale(std::vector<float>{grad_scale}),
        d_loss_sum(std::vector<double>{loss_sum0}),
        d_bad(std::vector<uint32_t>{0}),
        in_place_(in_place) {}

  uint16_t* dlogits() { return in_place_ ? d_logits.data() : d_dlogits.data(); }
  std::vector<uint16_t> download_dlogits() const { return in_place_ ? d_logits.download() : d_dlogits.download(); }

  void run(int64_t n, int64_t vocab, double z_weight, cudaStream_t s) {
    cuda::cross_entropy_forward_backward(d_logits.data(), dlogits(), d_targets.data(), d_loss.data(), d_lse.data(), n,
                                         vocab, z_weight, d_grad_scale.data(), d_loss_sum.data(), d_bad.data(), s);
  }

  void expect_guards_intact() const {
    d_logits.expect_guards_intact("logits");
    if (!in_place_) d_dlogits.expect_guards_intact("dlogits");
    d_targets.expect_guards_intact("targets");
    d_loss.expect_guards_intact("loss");
    d_lse.expect_guards_intact("lse");
    d_grad_scale.expect_guards_intact("grad_scale");
    d_loss_sum.expect_guards_intact("loss_sum");
    d_bad.expect_guards_intact("num_bad_targets");
  }

  GuardedBuffer<uint16_t> d_logits, d_dlogits;
  GuardedBuffer<int32_t> d_targets;
  GuardedBuffer<float> d_loss, d_lse, d_grad_scale;
  GuardedBuffer<double> d_loss_sum;
  GuardedBuffer<uint32_t> d_bad;

 private:
  bool in_place_;
};

const std::vector<CeShape> kShapes = {
    {0, 257, 1e-4, true, 0},     {1, 1, 0.0, true, 0},         {33, 1, 1e-4, true, 0},
    {33, 257, 0.0, true, 0},     {4096, 257, 1e-4, true, 2},   {33, 257, 1e-4, false, 2},
    {1, 50304, 1e-4, true, 0},   {33, 50304, 0.0, true, 6},    {4096, 50304, 1e-4, true, 0},
    {33, 50304, 1e-4, false, 0}, {33, 50304, 0.0, false, 2},   {1, 100352, 0.0, true, 0},
    {33, 100352, 1e-4, true, 0}, {33, 100355, 1e-4, true, 2},  {2, 262144, 1e-4, true, 0},
    // The other block sizes the launcher takes (the op bench times them on the LM head's chunk).
    {33, 50304, 1e-4, true, 0, 32},  {33, 50304, 1e-4, true, 2, 64},  {33, 50304, 0.0, false, 2, 128},
    {65, 50304, 1e-4, true, 0, 256}, {33, 257, 1e-4, true, 2, 256}, {33, 100355, 1e-4, true, 2, 128}};

std::string shape_name(const CeShape& p) {
  return param_name("n", p.n, "_v", p.vocab, p.z_weight > 0.0 ? "_z" : "", p.in_place ? "_inplace" : "_outofplace",
                    p.misalign ? "_misaligned" : "", p.threads ? "_t" : "",
                    p.threads ? std::to_string(p.threads) : std::string());
}

constexpr double kLossSum0 = 0.75;  // loss_sum accumulates onto this

// In place, "dlogits" starts as the logits; out of place, "logits" is an input left unchanged.
// A second run from the same start (loss_sum reset) must repeat every output and the sum bitwise.
OpCase<CeShape> cross_entropy_case() {
  OpCase<CeShape> c{"cross_entropy", kShapes, shape_name};
  c.setup = [](const CeShape& p, CaseIo& io) {
    const auto logits = make_logits(p.n, p.vocab, 101 + static_cast<uint64_t>(p.vocab));
    if (p.in_place) {
      io.in_place("dlogits", logits, kBF16Elementwise, p.misalign);
    } else {
      io.input("logits", logits);
      io.output<uint16_t>("dlogits", p.n * p.vocab, kBF16Elementwise, p.misalign);
    }
    io.input("targets", make_targets(p.n, p.vocab, 102));
    io.output<float>("loss", p.n, kFP32Reduction);
    io.output<float>("lse", p.n, kFP32Reduction);
    io.input("grad_scale", std::vector<float>{kGradScale});
    io.accumulate("loss_sum", std::vector<double>{kLossSum0}, std::nullopt);  // checked below
    io.accumulate("num_bad_targets", std::vector<uint32_t>{0}, kExact);
  };
  c.reference = [](const CeShape& p, RefTensors<float>& t) {
    std::vector<float> start;  // in place: the logits that the reference's dlogits overwrite
    if (p.in_place) start = t.start("dlogits");
    const float* x = p.in_place ? start.data() : t.in("logits");
    const int32_t* targets = t.in<int32_t>("targets");
    cpu::cross_entropy_forward(x, targets, t.out("loss"), t.out("lse"), p.n, p.vocab, p.z_weight);
    cpu::cross_entropy_backward(x, targets, t.in("lse"), t.out("dlogits"), p.n, p.vocab, p.z_weight, kGradScale);
  };
  c.device = [](const CeShape& p, DeviceTensors& t, cuda::Stream stream) {
    uint16_t* dlogits = t.bf16("dlogits");
    cuda::cross_entropy_forward_backward(p.in_place ? dlogits : t.bf16("logits"), dlogits, t.i32("targets"),
                                         t.f32("loss"), t.f32("lse"), p.n, p.vocab, p.z_weight, t.f32("grad_scale"),
                                         t.f64("loss_sum"), t.u32("num_bad_targets"), stream, p.threads);
  };
  c.check = [](const CeShape& p, const CaseResults<float>& r) {
    // Each per-token loss is within FP32 roundoff of the reference; so is their sum, plus the
    // accumulator's start value.
    double sum = 0.0, abs_sum = 0.0;
    for (const float l : r.reference("loss")) {
      sum += l;
      abs_sum += std::fabs(l);
    }
    EXPECT_NEAR(r.device<double>("loss_sum")[0] - kLossSum0, sum, 3e-5 * abs_sum + 1e-12) << "loss_sum";
    const auto targets = r.start<int32_t>("targets");
    const auto loss = r.device<float>("loss");
    for (int64_t i = 0; i < p.n; ++i) {
      if (targets[i] < 0) {
        ASSERT_EQ(loss[i], 0.0f) << "ignored row " << i << " must have loss 0";
      }
    }
  };
  c.deterministic = true;
  return c;
}

MOE_GPU_OP_CASE_TESTS(CrossEntropyParity, ForwardBackward, cross_entropy_case);

// Targets >= vocab: counted (the counter accumulates, never reset), loss 0, zero gradient row,
// lse still written; the other rows are unaffected.
TEST(CrossEntropy, OutOfRangeTargetsAreCountedNotTrapped) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t n = 6, vocab = 300;
  const std::vector<int32_t> targets = {5, 300, -1, std::numeric_limits<int32_t>::max(), 299, 301};
  const auto logits = make_logits(n, vocab, 111);
  CeBuffers b(logits, targets, n, vocab, true, 0, kGradScale, 0.0);
  b.d_bad.upload({7});
  TestStream stream;
  b.run(n, vocab, 1e-4, stream.get());
  stream.sync();
  EXPECT_EQ(b.d_bad.download()[0], 7u + 3u);

  std::vector<int32_t> cleaned = targets;
  for (auto& t : cleaned) t = t >= vocab ? -1 : t;
  const CeReference ref = cpu_reference(logits, cleaned, n, vocab, 1e-4, kGradScale);
  expect_parity("cross_entropy.bad_targets.loss", b.d_loss.download(), ref.loss, kFP32Reduction);
  expect_parity("cross_entropy.bad_targets.lse", b.d_lse.download(), ref.lse, kFP32Reduction);
  expect_parity("cross_entropy.bad_targets.dlogits", bf16_to_f32(b.download_dlogits()), ref.dlogits,
                kBF16Elementwise);
  EXPECT_NEAR(b.d_loss_sum.download()[0], ref.loss_sum, 3e-5 * ref.abs_loss_sum);
  b.expect_guards_intact();
}

// grad_scale is read on the device at run time: a second run with a new value scales dlogits.
TEST(CrossEntropy, GradScaleIsReadFromDeviceMemory) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t n = 5, vocab = 1000;
  const auto logits = make_logits(n, vocab, 121);
  const auto targets = make_targets(n, vocab, 122);
  CeBuffers b(logits, targets, n, vocab, true, 0, 1.0f, 0.0);
  TestStream stream;
  b.run(n, vocab, 0.0, stream.get());
  stream.sync();
  const auto g1 = bf16_to_f32(b.download_dlogits());
  b.d_logits.upload(logits);
  b.d_grad_scale.upload({0.25f});
  b.run(n, vocab, 0.0, stream.get());
  stream.sync();
  const auto g4 = bf16_to_f32(b.download_dlogits());
  for (size_t i = 0; i < g1.size(); ++i) {
    ASSERT_EQ(g4[i], g1[i] * 0.25f) << "element " << i << ": scaling by a power of two must be exact";
  }
}

TEST(CrossEntropy, BadArgumentsAreRejected) {
  MOE_SKIP_WITHOUT_GPU();
  GuardedBuffer<uint16_t> x(64);
  GuardedBuffer<int32_t> t(std::vector<int32_t>{0, 0});
  GuardedBuffer<float> f(8);
  GuardedBuffer<uint32_t> bad(std::vector<uint32_t>{0});
  auto expect_error = [](auto fn, const char* needle) {
    try {
      fn();
      ADD_FAILURE() << "expected moe::Error mentioning '" << needle << "'";
    } catch (const moe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] {
    cuda::cross_entropy_forward_backward(x.data(), x.data(), t.data(), f.data(), f.data(), 2, 32, -1.0, f.data(),
                                         nullptr, bad.data(), nullptr);
  }, "z_weight");
  expect_error([&] {
    cuda::cross_entropy_forward_backward(x.data(), x.data() + 1, t.data(), f.data(), f.data(), 2, 32, 0.0, f.data(),
                                         nullptr, bad.data(), nullptr);
  }, "overlap");
  expect_error([&] {
    cuda::cross_entropy_forward_backward(x.data(), x.data(), t.data(), f.data(), f.data(), 2, 0, 0.0, f.data(),
                                         nullptr, bad.data(), nullptr);
  }, "vocab > 0");
  expect_error([&] {
    cuda::cross_entropy_forward_backward(x.data(), x.data(), t.data(), f.data(), f.data(), 2, 32, 0.0, nullptr,
                                         nullptr, bad.data(), nullptr);
  }, "grad_scale");
  for (const int threads : {16, 48, 1024}) {
    expect_error([&] {
      cuda::cross_entropy_forward_backward(x.data(), x.data(), t.data(), f.data(), f.data(), 2, 32, 0.0, f.data(),
                                           nullptr, bad.data(), nullptr, threads);
    }, "block_threads");
  }
  EXPECT_NO_THROW(cuda::cross_entropy_forward_backward(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 32, 0.0,
                                                       nullptr, nullptr, nullptr, nullptr));
}

}  // namespace
}  // namespace moe::testing
