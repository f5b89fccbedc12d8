// Op parity cases in the manner of ggml's test-backend-ops. A case names an op, lists its shapes
// (awkward ones: 0 and 1 rows, odd widths, misaligned pointers), declares and fills its tensors for
// a shape, and gives two runners: the CPU reference (cpu::<op> in Ref = float or double, on the
// inputs widened from their storage type) and the device op (on guarded device buffers). Running
// one shape compares every output with the reference under its tolerance row (support/parity.h;
// one "parity <op>.<tensor>" line each), checks the guard bytes and that inputs are unchanged;
// outputs start unwritten (0xFF bytes: NaN in BF16 and FP32), and a deterministic case runs twice
// and must repeat itself bit for bit. Failures name the op, the shape and the tensor.
// No CUDA here: tests/gpu/op_case_gpu.h runs cases on the GPU (CUDA builds only);
// tests/unit/op_case_test.cpp tests the harness itself on host memory.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "cuda/device.h"
#include "support/parity.h"

namespace moe::testing {

// What a device buffer's data region holds before anything writes it (GuardedBuffer's fill).
inline constexpr uint8_t kOpCaseUnwrittenByte = 0xFF;

// Storage types of case tensors: BF16 bit patterns (uint16_t), float, double, int32_t, uint32_t,
// and workspace bytes.
enum class Storage { kBF16, kF32, kF64, kI32, kU32, kBytes };

template <typename T>
constexpr Storage storage_of() {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return Storage::kBF16;
  } else if constexpr (std::is_same_v<T, float>) {
    return Storage::kF32;
  } else if constexpr (std::is_same_v<T, double>) {
    return Storage::kF64;
  } else if constexpr (std::is_same_v<T, int32_t>) {
    return Storage::kI32;
  } else if constexpr (std::is_same_v<T, uint32_t>) {
    return Storage::kU32;
  } else {
    static_assert(std::is_same_v<T, uint8_t>, "case tensors hold uint16_t (BF16), float, double, int32_t or uint32_t");
    return Storage::kBytes;
  }
}

inline size_t storage_bytes(Storage s) {
  switch (s) {
    case Storage::kBF16: return 2;
    case Storage::kF32: return 4;
    case Storage::kF64: return 8;
    case Storage::kI32: return 4;
    case Storage::kU32: return 4;
    case Storage::kBytes: return 1;
  }
  return 1;
}

inline const char* storage_name(Storage s) {
  switch (s) {
    case Storage::kBF16: return "bf16 (uint16_t)";
    case Storage::kF32: return "float";
    case Storage::kF64: return "double";
    case Storage::kI32: return "int32_t";
    case Storage::kU32: return "uint32_t";
    case Storage::kBytes: return "workspace bytes";
  }
  return "?";
}

inline bool is_floating(Storage s) { return s == Storage::kBF16 || s == Storage::kF32 || s == Storage::kF64; }

enum class Role {
  kInput,       // read only; checked unchanged after the run
  kOutput,      // overwritten: unwritten (0xFF) on the device, zero in the reference
  kAccumulate,  // added into (dw +=, counters): both sides start from the given values
  kInPlace,     // overwritten in place (RoPE's x): both sides start from the given values
  kWorkspace,   // device scratch: guard-checked, never compared
};

// One tensor of a case at one shape.
struct CaseTensor {
  std::string name;
  Storage storage = Storage::kF32;
  Role role = Role::kInput;
  int64_t numel = 0;
  std::vector<uint8_t> start;    // stored bytes it starts with (inputs, accumulate, in place)
  std::optional<Tolerance> tol;  // outputs: compared under this row; none: only the case's check reads it
  size_t misalign = 0;           // bytes the device data pointer is shifted off its 256-byte boundary

  size_t bytes() const { return static_cast<size_t>(numel) * storage_bytes(storage); }
  bool is_result() const { return role != Role::kInput && role != Role::kWorkspace; }
};

template <typename T>
std::vector<uint8_t> to_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

template <typename T>
std::vector<T> from_bytes(const std::vector<uint8_t>& b) {
  std::vector<T> v(b.size() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), b.data(), v.size() * sizeof(T));
  return v;
}

// Stored values of a floating tensor as R (BF16 widened exactly).
template <typename R>
std::vector<R> widen_floating(Storage s, const std::vector<uint8_t>& b) {
  std::vector<R> out;
  if (s == Storage::kBF16) {
    const auto bits = from_bytes<uint16_t>(b);
    out.resize(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) out[i] = static_cast<R>(moe::bf16_to_f32(bits[i]));
  } else if (s == Storage::kF32) {
    const auto f = from_bytes<float>(b);
    out.assign(f.begin(), f.end());
  } else {
    const auto d = from_bytes<double>(b);
    out.assign(d.begin(), d.end());
  }
  return out;
}

// What a case's setup declares for one shape: every tensor, its values, its role and its row.
class CaseIo {
 public:
  template <typename T>
  void input(const std::string& name, const std::vector<T>& values, size_t misalign = 0) {
    add<T>(name, Role::kInput, static_cast<int64_t>(values.size()), to_bytes(values), std::nullopt, misalign);
  }
  template <typename T>
  void output(const std::string& name, int64_t numel, std::optional<Tolerance> tol, size_t misalign = 0) {
    add<T>(name, Role::kOutput, numel, {}, tol, misalign);
  }
  template <typename T>
  void accumulate(const std::string& name, const std::vector<T>& start, std::optional<Tolerance> tol,
                  size_t misalign = 0) {
    add<T>(name, Role::kAccumulate, static_cast<int64_t>(start.size()), to_bytes(start), tol, misalign);
  }
  template <typename T>
  void in_place(const std::string& name, const std::vector<T>& start, std::optional<Tolerance> tol,
                size_t misalign = 0) {
    add<T>(name, Role::kInPlace, static_cast<int64_t>(start.size()), to_bytes(start), tol, misalign);
  }
  void workspace(const std::string& name, size_t bytes) {
    add<uint8_t>(name, Role::kWorkspace, static_cast<int64_t>(bytes), {}, std::nullopt, 0);
  }

  const std::vector<CaseTensor>& tensors() const { return tensors_; }
  const CaseTensor& find(const std::string& name) const {
    for (const CaseTensor& t : tensors_)
      if (t.name == name) return t;
    MOE_FAIL("op case: no tensor '", name, "' was declared in the case's setup");
  }

 private:
  template <typename T>
  void add(const std::string& name, Role role, int64_t numel, std::vector<uint8_t> start,
           std::optional<Tolerance> tol, size_t misalign) {
    for (const CaseTensor& t : tensors_) MOE_CHECK(t.name != name, "op case: tensor '", name, "' declared twice");
    MOE_CHECK(numel >= 0, "op case: tensor '", name, "' has ", numel, " elements");
    tensors_.push_back({name, storage_of<T>(), role, numel, std::move(start), tol, misalign});
  }
  std::vector<CaseTensor> tensors_;
};

// The reference runner's tensors: floating ones as Ref (BF16 and FP32 inputs widened), integer
// ones as int32_t / uint32_t. Outputs start at zero, accumulating and in-place ones at their
// start values. Workspaces are device-only.
template <typename Ref>
class RefTensors {
 public:
  explicit RefTensors(const CaseIo& io) : io_(&io) {
    for (const CaseTensor& t : io.tensors()) {
      if (t.role == Role::kWorkspace) continue;
      const size_t n = static_cast<size_t>(t.numel);
      Values v;
      if (is_floating(t.storage)) {
        v = t.start.empty() ? std::vector<Ref>(n, Ref(0)) : widen_floating<Ref>(t.storage, t.start);
      } else if (t.storage == Storage::kI32) {
        v = t.start.empty() ? std::vector<int32_t>(n, 0) : from_bytes<int32_t>(t.start);
      } else {
        v = t.start.empty() ? std::vector<uint32_t>(n, 0u) : from_bytes<uint32_t>(t.start);
      }
      values_.emplace_back(t.name, std::move(v));
    }
  }

  template <typename T = Ref>
  const T* in(const std::string& name) const {
    return values<T>(name).data();
  }
  template <typename T = Ref>
  T* out(const std::string& name) {
    return const_cast<std::vector<T>&>(values<T>(name)).data();
  }
  template <typename T = Ref>
  const std::vector<T>& values(const std::string& name) const {
    static_assert(std::is_same_v<T, Ref> || std::is_same_v<T, int32_t> || std::is_same_v<T, uint32_t>,
                  "the reference holds floating tensors as Ref, integer ones as int32_t or uint32_t");
    for (const auto& [n, v] : values_) {
      if (n != name) continue;
      const auto* p = std::get_if<std::vector<T>>(&v);
      MOE_CHECK(p != nullptr, "op case: the reference holds tensor '", name, "' as ",
                storage_name(io_->find(name).storage), " (floating tensors as the reference's scalar type)");
      return *p;
    }
    MOE_FAIL("op case: the reference has no tensor '", name, "' (not declared, or a workspace)");
  }
  // The values an in-place or accumulating tensor started from (its reference array holds the result).
  template <typename T = Ref>
  std::vector<T> start(const std::string& name) const {
    const CaseTensor& t = io_->find(name);
    if constexpr (std::is_floating_point_v<T>) {
      MOE_CHECK(is_floating(t.storage), "op case: tensor '", name, "' is ", storage_name(t.storage));
      return widen_floating<T>(t.storage, t.start);
    } else {
      MOE_CHECK(t.storage == storage_of<T>(), "op case: tensor '", name, "' is ", storage_name(t.storage));
      return from_bytes<T>(t.start);
    }
  }

 private:
  using Values = std::variant<std::vector<Ref>, std::vector<int32_t>, std::vector<uint32_t>>;

  const CaseIo* io_;
  std::vector<std::pair<std::string, Values>> values_;
};

// The device runner's tensors: each accessor checks the declared storage type.
class DeviceTensors {
 public:
  void bind(const CaseTensor& t, void* data) { bound_.push_back({&t, data}); }

  uint16_t* bf16(const std::string& name) const { return get<uint16_t>(name); }
  float* f32(const std::string& name) const { return get<float>(name); }
  double* f64(const std::string& name) const { return get<double>(name); }
  int32_t* i32(const std::string& name) const { return get<int32_t>(name); }
  uint32_t* u32(const std::string& name) const { return get<uint32_t>(name); }
  void* workspace(const std::string& name) const { return get<uint8_t>(name); }
  size_t workspace_bytes(const std::string& name) const { return find(name).t->bytes(); }

 private:
  struct Bound {
    const CaseTensor* t;
    void* data;
  };
  const Bound& find(const std::string& name) const {
    for (const Bound& b : bound_)
      if (b.t->name == name) return b;
    MOE_FAIL("op case: no device tensor '", name, "' was declared in the case's setup");
  }
  template <typename T>
  T* get(const std::string& name) const {
    const Bound& b = find(name);
    MOE_CHECK(b.t->storage == storage_of<T>(), "op case: device tensor '", name, "' is ", storage_name(b.t->storage),
              ", not ", storage_name(storage_of<T>()));
    return static_cast<T*>(b.data);
  }
  std::vector<Bound> bound_;
};

// What a case's own check sees after the first run: the device's results, the reference's, and
// the declared start values, each in its stored type.
template <typename Ref>
class CaseResults {
 public:
  CaseResults(const CaseIo& io, const std::vector<std::vector<uint8_t>>& got, const RefTensors<Ref>& ref)
      : io_(io), got_(got), ref_(ref) {}

  template <typename T>
  std::vector<T> device(const std::string& name) const {
    const auto& ts = io_.tensors();
    for (size_t i = 0; i < ts.size(); ++i) {
      if (ts[i].name != name) continue;
      MOE_CHECK(ts[i].storage == storage_of<T>(), "op case: tensor '", name, "' is ", storage_name(ts[i].storage),
                ", not ", storage_name(storage_of<T>()));
      MOE_CHECK(ts[i].role != Role::kWorkspace, "op case: workspace '", name, "' is not downloaded");
      return from_bytes<T>(got_[i]);
    }
    MOE_FAIL("op case: no tensor '", name, "'");
  }
  template <typename T = Ref>
  const std::vector<T>& reference(const std::string& name) const {
    return ref_.template values<T>(name);
  }
  template <typename T>
  std::vector<T> start(const std::string& name) const {
    const CaseTensor& t = io_.find(name);
    MOE_CHECK(t.storage == storage_of<T>(), "op case: tensor '", name, "' is ", storage_name(t.storage));
    return from_bytes<T>(t.start);
  }

 private:
  const CaseIo& io_;
  const std::vector<std::vector<uint8_t>>& got_;
  const RefTensors<Ref>& ref_;
};

template <typename Shape, typename Ref = float>
struct OpCase {
  using ShapeType = Shape;
  using RefType = Ref;

  std::string name;  // the checks are named "<name>.<tensor>"
  std::vector<Shape> shapes;
  std::function<std::string(const Shape&)> shape_name = {};  // a GoogleTest name: letters, digits, '_'
  std::function<void(const Shape&, CaseIo&)> setup = {};    // declares and fills the tensors
  std::function<void(const Shape&, RefTensors<Ref>&)> reference = {};
  std::function<void(const Shape&, DeviceTensors&, cuda::Stream)> device = {};
  std::function<void(const Shape&, const CaseResults<Ref>&)> check = {};  // optional further assertions
  bool deterministic = false;  // a second run from the same start must give the same bits
};

namespace detail {

// Where a and b first differ, counted in elements of `bytes_per` bytes, for messages.
inline std::string first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, size_t bytes_per) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return "first at element " + std::to_string(i / bytes_per);
  }
  return a.size() == b.size() ? "no difference" : "sizes differ";
}

// One result against the reference under t.tol, named `check`; `shape` goes into a failure.
template <typename Ref>
void compare_result(const std::string& check, const std::string& shape, const CaseTensor& t,
                    const std::vector<uint8_t>& got, const RefTensors<Ref>& ref) {
  const int64_t n = t.numel;
  if constexpr (std::is_same_v<Ref, float>) {
    if (t.storage == Storage::kBF16 || t.storage == Storage::kF32) {
      const std::vector<float> g = widen_floating<float>(t.storage, got);
      expect_parity_n(check, g.data(), ref.template values<float>(t.name).data(), n, *t.tol, shape);
      return;
    }
  }
  std::vector<double> g, r;
  if (is_floating(t.storage)) {
    g = widen_floating<double>(t.storage, got);
    const auto& rv = ref.template values<Ref>(t.name);
    r.assign(rv.begin(), rv.end());
  } else if (t.storage == Storage::kI32) {
    const auto gv = from_bytes<int32_t>(got);
    const auto& rv = ref.template values<int32_t>(t.name);
    g.assign(gv.begin(), gv.end());
    r.assign(rv.begin(), rv.end());
  } else {
    const auto gv = from_bytes<uint32_t>(got);
    const auto& rv = ref.template values<uint32_t>(t.name);
    g.assign(gv.begin(), gv.end());
    r.assign(rv.begin(), rv.end());
  }
  expect_parity_n(check, g.data(), r.data(), n, *t.tol, shape);
}

}  // namespace detail

// Runs case `c` at shape `s` with device buffers of type Buffer, on `stream`. A Buffer is made
// from (bytes, misalign), starts with kOpCaseUnwrittenByte in its data region, and has data(),
// upload(bytes), download() and expect_guards_intact(what) (GuardedBuffer<uint8_t>). `sync()`
// waits for the uploads before the op runs and for the op before the results are read.
template <typename Buffer, typename Shape, typename Ref, typename Sync>
void run_op_case_on(const OpCase<Shape, Ref>& c, const Shape& s, cuda::Stream stream, Sync&& sync) {
  MOE_CHECK(c.shape_name && c.setup && c.reference && c.device, "op case '", c.name,
            "' needs shape_name, setup, reference and device");
  const std::string shape = c.shape_name(s);
  const std::string where = c.name + " " + shape;
  SCOPED_TRACE(where);
  CaseIo io;
  c.setup(s, io);
  const std::vector<CaseTensor>& ts = io.tensors();

  RefTensors<Ref> ref(io);
  c.reference(s, ref);

  std::vector<std::unique_ptr<Buffer>> bufs;
  DeviceTensors dev;
  for (const CaseTensor& t : ts) {
    bufs.push_back(std::make_unique<Buffer>(static_cast<int64_t>(t.bytes()), t.misalign));
    if (!t.start.empty()) bufs.back()->upload(t.start);
    dev.bind(t, bufs.back()->data());
  }
  sync();
  c.device(s, dev, stream);
  sync();

  std::vector<std::vector<uint8_t>> got(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    if (ts[i].role != Role::kWorkspace) got[i] = bufs[i]->download();
  }
  for (size_t i = 0; i < ts.size(); ++i) {
    const CaseTensor& t = ts[i];
    if (t.role == Role::kInput) {
      if (got[i] != t.start) {
        ADD_FAILURE() << where << ": input '" << t.name << "' was modified by the op ("
                      << detail::first_difference(got[i], t.start, storage_bytes(t.storage)) << ")";
      }
    } else if (t.is_result() && t.tol) {
      detail::compare_result(c.name + "." + t.name, shape, t, got[i], ref);
    }
  }
  for (size_t i = 0; i < ts.size(); ++i) bufs[i]->expect_guards_intact(where + ": " + ts[i].name);
  if (c.check) c.check(s, CaseResults<Ref>(io, got, ref));

  if (!c.deterministic) return;
  // The same start again: inputs and start values re-uploaded, outputs unwritten again.
  for (size_t i = 0; i < ts.size(); ++i) {
    const CaseTensor& t = ts[i];
    if (t.role == Role::kWorkspace) continue;
    bufs[i]->upload(t.start.empty() ? std::vector<uint8_t>(t.bytes(), kOpCaseUnwrittenByte) : t.start);
  }
  sync();
  c.device(s, dev, stream);
  sync();
  for (size_t i = 0; i < ts.size(); ++i) {
    const CaseTensor& t = ts[i];
    if (!t.is_result()) continue;
    const std::vector<uint8_t> again = bufs[i]->download();
    if (again != got[i]) {
      ADD_FAILURE() << where << ": " << t.name << " differs between two identical runs ("
                    << detail::first_difference(again, got[i], storage_bytes(t.storage)) << ")";
    }
  }
  for (size_t i = 0; i < ts.size(); ++i) bufs[i]->expect_guards_intact(where + ", second run: " + ts[i].name);
}

// One GoogleTest per shape of a case, named "<suite>.<test>/<shape name>". The body skips with
// the reason `skip_reason()` gives when it is not empty (so a skipped shape never reports as
// passed), else runs the shape. One fixture type for every case, so cases of different shape
// types may share a suite.
class OpCaseTest : public ::testing::Test {
 public:
  OpCaseTest(std::function<std::string()> skip_reason, std::function<void()> body)
      : skip_reason_(std::move(skip_reason)), body_(std::move(body)) {}

  void TestBody() override {
    if (const std::string why = skip_reason_ ? skip_reason_() : std::string(); !why.empty()) GTEST_SKIP() << why;
    body_();
  }

 private:
  std::function<std::string()> skip_reason_;
  std::function<void()> body_;
};

// Registers the tests of make_case(), each calling run(case, shape). Call it during static
// initialisation, before RUN_ALL_TESTS (the MOE_*_OP_CASE_TESTS macros do). Throws on a repeated
// shape name.
template <typename Case>
bool register_op_case_tests(const char* suite, const char* test, Case (*make_case)(),
                            std::function<std::string()> skip_reason,
                            std::type_identity_t<std::function<void(const Case&, const typename Case::ShapeType&)>> run,
                            const char* file, int line) {
  auto c = std::make_shared<const Case>(make_case());
  std::set<std::string> names;
  for (const auto& s : c->shapes) {
    const std::string name = std::string(test) + "/" + c->shape_name(s);
    MOE_CHECK(names.insert(name).second, "op case '", c->name, "': two shapes are both named '", name, "'");
    ::testing::RegisterTest(suite, name.c_str(), nullptr, nullptr, file, line, [=]() -> OpCaseTest* {
      return new OpCaseTest(skip_reason, [c, s, run] { run(*c, s); });
    });
  }
  return true;
}

}  // namespace moe::testing
