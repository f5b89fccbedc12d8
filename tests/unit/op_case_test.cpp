// The op-case harness (support/op_case.h) on host memory: buffers with guard bytes and 0xFF-filled
// data stand in for GuardedBuffer, and the "device" runners are host code. A correct op passes
// and prints one parity line per output; an unwritten element, a write past the end, a write
// into an input, a run that does not repeat itself and a misdeclared tensor each fail, naming the
// op, the shape and the tensor. Registered cases become one test per shape.
#include <gtest/gtest-spi.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/swiglu.h"
#include "support/op_case.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

constexpr size_t kHostGuardBytes = 64;
constexpr uint8_t kHostGuardByte = 0xA7;

// Host memory laid out like GuardedBuffer: guard zone, data (shifted by misalign), guard zone.
class HostBuffer {
 public:
  HostBuffer(int64_t n, size_t misalign)
      : n_(static_cast<size_t>(n)), shift_(misalign), mem_(2 * kHostGuardBytes + misalign + n_, kHostGuardByte) {
    std::fill(data(), data() + n_, kOpCaseUnwrittenByte);
  }
  uint8_t* data() { return mem_.data() + kHostGuardBytes + shift_; }
  const uint8_t* data() const { return mem_.data() + kHostGuardBytes + shift_; }
  void upload(const std::vector<uint8_t>& b) {
    ASSERT_EQ(b.size(), n_);
    std::copy(b.begin(), b.end(), data());
  }
  std::vector<uint8_t> download() const { return {data(), data() + n_}; }
  void expect_guards_intact(const std::string& what) const {
    for (size_t i = 0; i < mem_.size(); ++i) {
      const bool in_data = i >= kHostGuardBytes + shift_ && i < kHostGuardBytes + shift_ + n_;
      if (!in_data && mem_[i] != kHostGuardByte) {
        ADD_FAILURE() << what << ": guard byte " << (i < kHostGuardBytes + shift_ ? "before" : "after")
                      << " the data was overwritten";
        return;
      }
    }
  }

 private:
  size_t n_, shift_;
  std::vector<uint8_t> mem_;
};

template <typename Shape, typename Ref>
void run_on_host(const OpCase<Shape, Ref>& c, const Shape& s) {
  run_op_case_on<HostBuffer>(c, s, nullptr, [] {});
}

// A toy op over every kind of tensor: y = 2x (BF16 in, BF16 out), acc += x (FP32), count += n
// (a uint32 counter), z = -z in place (BF16), with a workspace. `fault` plants one bug.
enum class Fault { kNone, kSkipLast, kWritePastEnd, kWriteInput, kDriftBetweenRuns, kWrongAccessor };

struct ToyShape {
  int64_t n;
  size_t misalign;
};

// Shape names streamed (GCC 12 at -O3 warns on literal + string).
template <typename... Parts>
std::string name_of(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

std::string toy_name(const ToyShape& s) { return name_of("n", s.n, s.misalign ? "_misaligned" : ""); }

std::vector<uint16_t> bf16_values(int64_t n, float scale) {
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = f32_to_bf16(scale * static_cast<float>(i % 13 - 6));
  return v;
}

OpCase<ToyShape> toy_case(Fault fault) {
  auto runs = std::make_shared<int>(0);
  return {.name = "toy",
          .shapes = {{0, 0}, {1, 0}, {7, 2}, {259, 0}},
          .shape_name = toy_name,
          .setup =
              [](const ToyShape& s, CaseIo& io) {
                io.input("x", bf16_values(s.n, 0.5f), s.misalign);
                io.output<uint16_t>("y", s.n, kBF16Elementwise, s.misalign);
                io.accumulate("acc", std::vector<float>(static_cast<size_t>(s.n), 1.0f), kFP32Reduction);
                io.accumulate("count", std::vector<uint32_t>{3}, kExact);
                io.in_place("z", bf16_values(s.n, 0.25f), kExact);
                io.workspace("workspace", 16);
              },
          .reference =
              [](const ToyShape& s, RefTensors<float>& t) {
                for (int64_t i = 0; i < s.n; ++i) {
                  t.out("y")[i] = 2.0f * t.in("x")[i];
                  t.out("acc")[i] += t.in("x")[i];
                  t.out("z")[i] = -t.out("z")[i];
                }
                t.out<uint32_t>("count")[0] += static_cast<uint32_t>(s.n);
              },
          .device =
              [fault, runs](const ToyShape& s, DeviceTensors& t, cuda::Stream) {
                ++*runs;
                if (fault == Fault::kWrongAccessor) t.f32("x");
                uint16_t* x = t.bf16("x");
                uint16_t* y = t.bf16("y");
                uint16_t* z = t.bf16("z");
                float* acc = t.f32("acc");
                const int64_t num_y = fault == Fault::kSkipLast && s.n > 0 ? s.n - 1 : s.n;
                for (int64_t i = 0; i < num_y; ++i) y[i] = f32_to_bf16(2.0f * moe::bf16_to_f32(x[i]));
                for (int64_t i = 0; i < s.n; ++i) {
                  acc[i] += moe::bf16_to_f32(x[i]);
                  z[i] = f32_to_bf16(-moe::bf16_to_f32(z[i]));
                }
                t.u32("count")[0] += static_cast<uint32_t>(s.n);
                if (fault == Fault::kWritePastEnd) y[s.n] = 0;
                if (fault == Fault::kWriteInput && s.n > 0) x[s.n - 1] = f32_to_bf16(100.0f);
                if (fault == Fault::kDriftBetweenRuns && *runs % 2 == 0 && s.n > 0) acc[0] += 1.0f;
              },
          // One failure per planted bug: the second run would repeat a guard or input fault.
          .deterministic = fault == Fault::kNone || fault == Fault::kDriftBetweenRuns};
}

TEST(OpCase, CorrectOpPassesAndPrintsOneParityLinePerOutput) {
  const auto c = toy_case(Fault::kNone);
  for (const ToyShape& s : c.shapes) {
    ::testing::internal::CaptureStdout();
    run_on_host(c, s);
    const std::string out = ::testing::internal::GetCapturedStdout();
    for (const char* name : {"toy.y", "toy.acc", "toy.count", "toy.z"}) {
      EXPECT_NE(out.find(std::string("parity ") + name + ": n="), std::string::npos) << name << " in\n" << out;
    }
    EXPECT_EQ(out.find("parity toy.x"), std::string::npos) << "inputs are not compared with the reference";
    EXPECT_EQ(out.find("parity toy.workspace"), std::string::npos);
  }
}

TEST(OpCase, UnwrittenElementFailsNamingOpShapeAndTensor) {
  const auto c = toy_case(Fault::kSkipLast);
  EXPECT_NONFATAL_FAILURE(run_on_host(c, ToyShape{7, 2}), "toy.y (n7_misaligned) fails tolerance 'bf16'");
  EXPECT_NONFATAL_FAILURE(run_on_host(c, ToyShape{7, 2}), "1 NaN/Inf");
}

TEST(OpCase, WritePastTheEndFails) {
  const auto c = toy_case(Fault::kWritePastEnd);
  EXPECT_NONFATAL_FAILURE(run_on_host(c, ToyShape{7, 0}), "toy n7: y: guard byte after the data");
}

TEST(OpCase, WriteIntoAnInputFails) {
  const auto c = toy_case(Fault::kWriteInput);
  EXPECT_NONFATAL_FAILURE(run_on_host(c, ToyShape{259, 0}),
                          "toy n259: input 'x' was modified by the op (first at element 258)");
}

TEST(OpCase, RunThatDoesNotRepeatItselfFails) {
  const auto c = toy_case(Fault::kDriftBetweenRuns);
  EXPECT_NONFATAL_FAILURE(run_on_host(c, ToyShape{7, 0}),
                          "toy n7: acc differs between two identical runs (first at element 0)");
}

TEST(OpCase, AccessorOfTheWrongTypeThrows) {
  const auto c = toy_case(Fault::kWrongAccessor);
  const std::string msg = error_of([&] { run_on_host(c, ToyShape{1, 0}); });
  EXPECT_NE(msg.find("device tensor 'x' is bf16 (uint16_t), not float"), std::string::npos) << msg;
}

TEST(OpCase, DeclarationErrorsThrow) {
  CaseIo io;
  io.input("x", std::vector<float>{1.0f});
  EXPECT_NE(error_of([&] { io.output<float>("x", 1, kExact); }).find("tensor 'x' declared twice"), std::string::npos);
  RefTensors<float> ref(io);
  EXPECT_NE(error_of([&] { ref.in<int32_t>("x"); }).find("holds tensor 'x' as float"), std::string::npos);
  EXPECT_NE(error_of([&] { ref.in("nope"); }).find("no tensor 'nope'"), std::string::npos);
}

// A real op, CPU against itself rounded to BF16 (the GPU tests' pattern): SwiGLU in float, and
// the same case with a double reference.
struct SwigluShape {
  int64_t n, inner;
};

template <typename Ref>
OpCase<SwigluShape, Ref> host_swiglu_case() {
  return {.name = "swiglu_host",
          .shapes = {{0, 4}, {1, 1}, {3, 257}, {16, 64}},
          .shape_name = [](const SwigluShape& s) { return name_of("n", s.n, "_inner", s.inner); },
          .setup =
              [](const SwigluShape& s, CaseIo& io) {
                std::vector<uint16_t> gu(static_cast<size_t>(s.n * 2 * s.inner));
                for (size_t i = 0; i < gu.size(); ++i) gu[i] = f32_to_bf16(std::sin(0.37f * static_cast<float>(i)) * 3);
                io.input("gate_up", gu);
                io.output<uint16_t>("h", s.n * s.inner, kBF16Elementwise);
              },
          .reference =
              [](const SwigluShape& s, RefTensors<Ref>& t) {
                cpu::swiglu_forward<Ref>(t.in("gate_up"), t.out("h"), s.n, s.inner);
              },
          .device =
              [](const SwigluShape& s, DeviceTensors& t, cuda::Stream) {
                const int64_t n_in = s.n * 2 * s.inner, n_out = s.n * s.inner;
                std::vector<float> gu(static_cast<size_t>(n_in)), h(static_cast<size_t>(n_out));
                for (int64_t i = 0; i < n_in; ++i) gu[i] = moe::bf16_to_f32(t.bf16("gate_up")[i]);
                cpu::swiglu_forward<float>(gu.data(), h.data(), s.n, s.inner);
                for (int64_t i = 0; i < n_out; ++i) t.bf16("h")[i] = f32_to_bf16(h[i]);
              }};
}

OpCase<SwigluShape, float> host_swiglu_float() { return host_swiglu_case<float>(); }
OpCase<SwigluShape, double> host_swiglu_double() { return host_swiglu_case<double>(); }
OpCase<ToyShape> toy_correct() { return toy_case(Fault::kNone); }

#define MOE_HOST_OP_CASE_TESTS(Suite, Test, make_case)                                                   \
  [[maybe_unused]] static const bool moe_host_op_case_##Suite##_##Test = register_op_case_tests(        \
      "Shapes/" #Suite, #Test, make_case, [] { return std::string(); },                                   \
      [](const auto& c, const auto& s) { run_on_host(c, s); }, __FILE__, __LINE__)

MOE_HOST_OP_CASE_TESTS(OpCaseHost, Toy, toy_correct);
MOE_HOST_OP_CASE_TESTS(OpCaseHost, SwigluFloat, host_swiglu_float);
MOE_HOST_OP_CASE_TESTS(OpCaseHost, SwigluDouble, host_swiglu_double);

TEST(OpCase, RegistersOneTestPerShape) {
  const ::testing::UnitTest& u = *::testing::UnitTest::GetInstance();
  std::vector<std::string> names;
  for (int i = 0; i < u.total_test_suite_count(); ++i) {
    const ::testing::TestSuite& suite = *u.GetTestSuite(i);
    if (std::string(suite.name()) != "Shapes/OpCaseHost") continue;
    for (int j = 0; j < suite.total_test_count(); ++j) names.push_back(suite.GetTestInfo(j)->name());
  }
  const std::vector<std::string> want = {"Toy/n0",         "Toy/n1",          "Toy/n7_misaligned",
                                         "Toy/n259",       "SwigluFloat/n0_inner4", "SwigluFloat/n1_inner1",
                                         "SwigluFloat/n3_inner257", "SwigluFloat/n16_inner64",
                                         "SwigluDouble/n0_inner4",  "SwigluDouble/n1_inner1",
                                         "SwigluDouble/n3_inner257", "SwigluDouble/n16_inner64"};
  EXPECT_EQ(names, want);
}

}  // namespace
}  // namespace moe::testing
