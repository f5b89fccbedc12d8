// safetensors: round trips (every DType, zero-sized tensors, scalars, metadata, header padded
// to 8), decoding F16/BF16/F8 bit patterns to f32, refusal of malformed files with the reason
// named, and a seeded fuzz that mutates header bytes: open either succeeds or throws moe::Error.
#include "checkpoint/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"

namespace moe::testing {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            ("moe_st_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::filesystem::remove(path);  // a fresh file: rewriting via truncation makes ext4 flush on close
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

// A file built by hand: 8-byte LE length (header.size() unless overridden), header, data.
void write_raw(const std::string& path, const std::string& header, size_t data_bytes,
               uint64_t header_len = std::numeric_limits<uint64_t>::max()) {
  if (header_len == std::numeric_limits<uint64_t>::max()) header_len = header.size();
  std::vector<uint8_t> bytes(8);
  for (int i = 0; i < 8; ++i) bytes[i] = uint8_t(header_len >> (8 * i));
  bytes.insert(bytes.end(), header.begin(), header.end());
  for (size_t i = 0; i < data_bytes; ++i) bytes.push_back(uint8_t(i * 37 + 1));
  write_bytes(path, bytes);
}

// Opening `path` must throw moe::Error whose message holds every one of `parts`.
void expect_open_error(const std::string& path, std::initializer_list<std::string> parts) {
  try {
    SafetensorsFile::open(path);
    ADD_FAILURE() << "expected open('" << path << "') to fail";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
  }
}

void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected a moe::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
  }
}

uint16_t bf16_bits(float x) {  // truncation: exact for the values used here
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return uint16_t(u >> 16);
}

TEST(Safetensors, RoundTrip) {
  TempDir dir;
  const std::string path = dir.file("a.safetensors");
  std::vector<float> w(3 * 5);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.25f * float(i) - 1.0f;
  std::vector<uint16_t> b(4 * 7);  // odd byte count before the next tensor: unaligned data
  for (size_t i = 0; i < b.size(); ++i) b[i] = bf16_bits(float(i) - 3.5f);
  std::vector<int32_t> ids = {7, -1, 0, 1 << 30, -(1 << 30), 42};
  float scalar = 3.75f;
  std::vector<uint8_t> odd = {1, 2, 3};  // 3-byte FP8 tensor shifts later offsets off alignment
  std::vector<double> d = {1.5, -2.25};
  const std::vector<TensorRef> refs = {
      {"w", DType::kF32, {3, 5}, w.data()},        {"b", DType::kBF16, {4, 7}, b.data()},
      {"empty", DType::kF32, {0, 4}, nullptr},     {"ids", DType::kI32, {6}, ids.data()},
      {"fp8", DType::kF8E4M3, {3}, odd.data()},    {"scalar", DType::kF32, {}, &scalar},
      {"d", DType::kF64, {2}, d.data()},
  };
  write_safetensors(path, refs, {{"note", "hello"}, {"step", "12"}});

  const auto bytes = read_bytes(path);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(bytes[i]) << (8 * i);
  EXPECT_EQ(n % 8, 0u) << "header must be padded to a multiple of 8";
  EXPECT_EQ(bytes[8], '{');
  EXPECT_EQ(bytes[8 + n - 1] == ' ' || bytes[8 + n - 1] == '}', true);

  const auto f = SafetensorsFile::open(path);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("note"), "hello");
  EXPECT_EQ(f.metadata().at("step"), "12");
  EXPECT_EQ(f.data_size(), int64_t(bytes.size() - 8 - n));
  ASSERT_EQ(f.tensors().size(), refs.size());
  // Data order is the given order (the zero-sized tensor sits between b and ids).
  const char* order[] = {"w", "b", "empty", "ids", "fp8", "scalar", "d"};
  int64_t expected_begin = 0;
  for (size_t i = 0; i < refs.size(); ++i) {
    const TensorInfo& t = f.tensors()[i];
    EXPECT_EQ(t.name, order[i]);
    EXPECT_EQ(t.begin, expected_begin) << t.name;
    expected_begin = t.end;
    ASSERT_TRUE(t.dtype.has_value());
    EXPECT_EQ(*t.dtype, refs[i].dtype);
    EXPECT_EQ(t.dtype_name, dtype_safetensors_name(refs[i].dtype));
    EXPECT_EQ(t.shape, refs[i].shape);
    if (t.bytes() > 0) {
      EXPECT_EQ(std::memcmp(f.data(t), refs[i].data, size_t(t.bytes())), 0) << t.name;
    }
  }
  EXPECT_EQ(f.find("scalar")->shape, Shape{});
  EXPECT_EQ(f.find("scalar")->numel(), 1);
  EXPECT_EQ(f.find("empty")->bytes(), 0);
  EXPECT_EQ(f.find("nope"), nullptr);

  std::vector<float> out(w.size());
  f.read_f32("w", out.data(), int64_t(w.size()));
  EXPECT_EQ(out, w);
  out.assign(b.size(), 0.f);
  f.read_f32("b", out.data(), int64_t(b.size()));
  for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(out[i], float(i) - 3.5f);
  float s = 0;
  f.read_f32("scalar", &s, 1);
  EXPECT_EQ(s, 3.75f);
  out.assign(2, 0.f);
  f.read_f32("d", out.data(), 2);
  EXPECT_EQ(out[0], 1.5f);
  EXPECT_EQ(out[1], -2.25f);
  f.read_f32("empty", nullptr, 0);
}

TEST(Safetensors, EveryDTypeRoundTrips) {
  TempDir dir;
  const DType all[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kF8E4M3, DType::kF8E5M2,
                       DType::kE8M0, DType::kI32, DType::kI64, DType::kU16, DType::kU32};
  std::vector<uint8_t> payload(64);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = uint8_t(i * 13 + 5);
  for (DType t : all) {
    const std::string path = dir.file(std::string(dtype_name(t)) + ".safetensors");
    write_safetensors(path, {{"x", t, {2, 3}, payload.data()}}, {});
    const auto f = SafetensorsFile::open(path);
    const TensorInfo* x = f.find("x");
    ASSERT_NE(x, nullptr);
    ASSERT_TRUE(x->dtype.has_value());
    EXPECT_EQ(*x->dtype, t) << dtype_name(t);
    EXPECT_EQ(x->bytes(), 6 * dtype_size(t));
    EXPECT_EQ(std::memcmp(f.data(*x), payload.data(), size_t(x->bytes())), 0);
  }
}

TEST(Safetensors, EmptyFileHasOnlyMetadata) {
  TempDir dir;
  const std::string path = dir.file("e.safetensors");
  write_safetensors(path, {}, {});
  const auto f = SafetensorsFile::open(path);
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(f.data_size(), 0);
  EXPECT_EQ(f.metadata().size(), 1u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
}

TEST(Safetensors, DecodesHalfAndFp8BitPatterns) {
  // F16: 1, -2, smallest subnormal, largest finite, -0, 1/3 rounded, +inf, NaN.
  const uint16_t h[] = {0x3C00, 0xC000, 0x0001, 0x7BFF, 0x8000, 0x3555, 0x7C00, 0x7E00};
  const float hv[] = {1.f, -2.f, std::ldexp(1.f, -24), 65504.f, -0.f, 0.333251953125f};
  float out[8];
  safetensors_to_f32(h, "F16", out, 8);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out[i], hv[i]) << i;
  EXPECT_TRUE(std::signbit(out[4]));
  EXPECT_EQ(out[6], std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(out[7]));

  // E4M3 (fn): 1, -1, max 448, smallest subnormal 2^-9, 0.5 + 1/16 (0x31), NaN.
  const uint8_t e4[] = {0x38, 0xB8, 0x7E, 0x01, 0x31, 0x7F};
  safetensors_to_f32(e4, "F8_E4M3", out, 6);
  EXPECT_EQ(out[0], 1.f);
  EXPECT_EQ(out[1], -1.f);
  EXPECT_EQ(out[2], 448.f);
  EXPECT_EQ(out[3], std::ldexp(1.f, -9));
  EXPECT_EQ(out[4], 0.5625f);
  EXPECT_TRUE(std::isnan(out[5]));

  // E5M2: 1, max 57344, smallest subnormal 2^-16, -inf.
  const uint8_t e5[] = {0x3C, 0x7B, 0x01, 0xFC};
  safetensors_to_f32(e5, "F8_E5M2", out, 4);
  EXPECT_EQ(out[0], 1.f);
  EXPECT_EQ(out[1], 57344.f);
  EXPECT_EQ(out[2], std::ldexp(1.f, -16));
  EXPECT_EQ(out[3], -std::numeric_limits<float>::infinity());

  // E8M0: 2^(b-127); 0xFF is NaN.
  const uint8_t e8[] = {127, 130, 0, 255};
  safetensors_to_f32(e8, "F8_E8M0", out, 4);
  EXPECT_EQ(out[0], 1.f);
  EXPECT_EQ(out[1], 8.f);
  EXPECT_EQ(out[2], std::ldexp(1.f, -127));
  EXPECT_TRUE(std::isnan(out[3]));

  // Every F16 pattern agrees with the E5M2 decoder on its top byte where the low byte is 0.
  for (int b = 0; b < 256; ++b) {
    const uint8_t e = uint8_t(b);
    float x, y;
    safetensors_to_f32(&e, "F8_E5M2", &x, 1);
    y = f16_bits_to_f32(uint16_t(b << 8));
    EXPECT_TRUE((std::isnan(x) && std::isnan(y)) || x == y) << b;
  }
}

TEST(Safetensors, ReadsF16FromAForeignFile) {
  // moecore has no F16 DType, but files written elsewhere (HF exports) use it.
  TempDir dir;
  const std::string path = dir.file("h.safetensors");
  const std::string header = R"({"h":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})";
  std::vector<uint8_t> bytes(8);
  bytes[0] = uint8_t(header.size());
  bytes.insert(bytes.end(), header.begin(), header.end());
  const uint8_t data[] = {0x00, 0x3C, 0x00, 0xC4};  // 1.0, -4.0 little-endian
  bytes.insert(bytes.end(), data, data + 4);
  write_bytes(path, bytes);
  const auto f = SafetensorsFile::open(path);
  EXPECT_FALSE(f.find("h")->dtype.has_value());
  EXPECT_EQ(f.find("h")->dtype_name, "F16");
  float out[2];
  f.read_f32("h", out, 2);
  EXPECT_EQ(out[0], 1.f);
  EXPECT_EQ(out[1], -4.f);
}

TEST(Safetensors, ReadF32Errors) {
  TempDir dir;
  const std::string path = dir.file("r.safetensors");
  std::vector<int32_t> ids = {1, 2, 3};
  std::vector<float> w = {1, 2};
  write_safetensors(path, {{"ids", DType::kI32, {3}, ids.data()}, {"w", DType::kF32, {2}, w.data()}}, {});
  const auto f = SafetensorsFile::open(path);
  float out[3];
  expect_error([&] { f.read_f32("missing", out, 3); }, {"'missing'", "not found", path});
  expect_error([&] { f.read_f32("w", out, 3); }, {"'w'", "2 elements", "expected 3", path});
  expect_error([&] { f.read_f32("ids", out, 3); }, {"'ids'", "I32", path});
}

TEST(Safetensors, WriterRefusesBadInput) {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  float x = 1;
  expect_error([&] { write_safetensors(path, {{"a", DType::kF32, {1}, &x}, {"a", DType::kF32, {1}, &x}}, {}); },
               {"duplicate tensor name 'a'"});
  expect_error([&] { write_safetensors(path, {{"__metadata__", DType::kF32, {1}, &x}}, {}); }, {"reserved"});
  expect_error([&] { write_safetensors(path, {{"a", DType::kF32, {2}, nullptr}}, {}); }, {"'a'", "null"});
  expect_error([&] { write_safetensors(path, {{"a", DType::kF32, {-1}, &x}}, {}); }, {"'a'", "negative"});
  expect_error([&] { write_safetensors(path, {}, {{"format", "np"}}); }, {"'format'", "'np'"});
  expect_error([&] { write_safetensors(dir.file("no/such/dir/w.safetensors"), {}, {}); }, {"cannot create"});
}

// ---- malformed files ---------------------------------------------------------------------

TEST(SafetensorsMalformed, ShorterThanLengthPrefix) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  write_bytes(path, {1, 2, 3, 4, 5});
  expect_open_error(path, {path, "shorter than the 8-byte header length"});
  write_bytes(path, {});
  expect_open_error(path, {path, "shorter"});
}

TEST(SafetensorsMalformed, HugeHeaderLength) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  write_raw(path, "{}", 0, uint64_t(1) << 40);
  expect_open_error(path, {path, "exceeds the 100000000-byte limit"});
  write_raw(path, "{}", 0, ~uint64_t(0) - 1);  // would overflow 8 + N
  expect_open_error(path, {path, "exceeds"});
}

TEST(SafetensorsMalformed, HeaderLengthBeyondFile) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  write_raw(path, "{}      ", 0, 1000);
  expect_open_error(path, {path, "header length 1000 runs past the end"});
}

TEST(SafetensorsMalformed, BadJson) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  write_raw(path, R"({"a": {"dtype": "F32",)", 0);
  expect_open_error(path, {path, "not valid JSON"});
  write_raw(path, "", 0);
  expect_open_error(path, {path, "not valid JSON"});
  write_raw(path, "[1, 2, 3]", 0);
  expect_open_error(path, {path, "must be a JSON object"});
  write_raw(path, "{\"a\xff\": 1}", 0);  // invalid UTF-8 in a key
  expect_open_error(path, {path, "not valid JSON"});
}

TEST(SafetensorsMalformed, MissingFields) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  write_raw(path, R"({"t": {"shape": [1], "data_offsets": [0, 4]}})", 4);
  expect_open_error(path, {path, "tensor 't'", "missing 'dtype'"});
  write_raw(path, R"({"t": {"dtype": "F32", "data_offsets": [0, 4]}})", 4);
  expect_open_error(path, {"tensor 't'", "missing 'shape'"});
  write_raw(path, R"({"t": {"dtype": "F32", "shape": [1]}})", 4);
  expect_open_error(path, {"tensor 't'", "missing 'data_offsets'"});
  write_raw(path, R"({"t": [1, 2]})", 0);
  expect_open_error(path, {"tensor 't'", "must be an object"});
  write_raw(path, R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 4);
  expect_open_error(path, {"tensor 't'", "[begin, end]"});
  write_raw(path, R"({"__metadata__": {"format": 3}})", 0);
  expect_open_error(path, {"__metadata__", "'format'", "must be a string"});
}

TEST(SafetensorsMalformed, UnknownDtype) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  write_raw(path, R"({"t": {"dtype": "F17", "shape": [1], "data_offsets": [0, 4]}})", 4);
  expect_open_error(path, {path, "tensor 't'", "unknown dtype 'F17'", "expected one of"});
  write_raw(path, R"({"t": {"dtype": 4, "shape": [1], "data_offsets": [0, 4]}})", 4);
  expect_open_error(path, {"tensor 't'", "'dtype' must be a string"});
}

TEST(SafetensorsMalformed, NegativeNonIntegerOrOverflowingShape) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  write_raw(path, R"({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4);
  expect_open_error(path, {"tensor 't'", "non-negative integers", "-1"});
  write_raw(path, R"({"t": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", 4);
  expect_open_error(path, {"tensor 't'", "non-negative integers"});
  write_raw(path, R"({"t": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})", 0);
  expect_open_error(path, {"tensor 't'", "overflows"});
  write_raw(path, R"({"t": {"dtype": "F64", "shape": [2305843009213693952], "data_offsets": [0, 0]}})", 0);
  expect_open_error(path, {"tensor 't'", "byte size", "overflows"});
  write_raw(path, R"({"t": {"dtype": "F32", "shape": [18446744073709551615], "data_offsets": [0, 0]}})", 0);
  expect_open_error(path, {"tensor 't'", "non-negative integers"});
}

TEST(SafetensorsMalformed, DeeplyNestedValues) {
  // Parsing is iterative; error messages must not print nested values (printing recurses).
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  write_raw(path, R"({"t": {"dtype": "F32", "shape": [4294967296, 4294967296, )" + deep +
                      R"(], "data_offsets": [0, 0]}})", 0);
  expect_open_error(path, {"tensor 't'", "overflows"});
  write_raw(path, R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": )" + deep + "}}", 4);
  expect_open_error(path, {"tensor 't'", "a nested array"});
  write_raw(path, R"({"t": {"dtype": "F32", "shape": [)" + deep + R"(], "data_offsets": [0, 4]}})", 4);
  expect_open_error(path, {"tensor 't'", "non-negative integers"});
}

TEST(Safetensors, WriterRefusesNamesThatAreNotUtf8) {
  TempDir dir;
  float x = 1;
  expect_error([&] { write_safetensors(dir.file("u.safetensors"), {{"bad\xff", DType::kF32, {1}, &x}}, {}); },
               {"cannot encode the safetensors header"});
}

TEST(SafetensorsMalformed, WrongDtypeSizeForOffsets) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  write_raw(path, R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})", 4);
  expect_open_error(path, {path, "tensor 't'", "span 4 bytes", "F32 needs 8"});
}

TEST(SafetensorsMalformed, OffsetsOutsideData) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  write_raw(path, R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 4);
  expect_open_error(path, {path, "tensor 't'", "beyond the 4-byte data area"});
  write_raw(path, R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 8);
  expect_open_error(path, {"tensor 't'", "begin > end"});
  write_raw(path, R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", 8);
  expect_open_error(path, {"tensor 't'", "non-negative"});
}

TEST(SafetensorsMalformed, TruncatedData) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  std::vector<float> w(100, 1.f);
  write_safetensors(path, {{"a", DType::kF32, {10}, w.data()}, {"b", DType::kF32, {90}, w.data()}}, {});
  auto bytes = read_bytes(path);
  bytes.resize(bytes.size() - 3);
  write_bytes(path, bytes);
  expect_open_error(path, {path, "tensor 'b'", "beyond", "truncated"});
}

TEST(SafetensorsMalformed, OverlappingTensors) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  write_raw(path,
            R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
            12);
  expect_open_error(path, {path, "tensor 'b'", "overlaps tensor 'a'"});
  write_raw(path,
            R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
            8);
  expect_open_error(path, {path, "overlaps"});
  // A zero-sized tensor inside another one also overlaps.
  write_raw(path,
            R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "z": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}})",
            8);
  expect_open_error(path, {"tensor 'z'", "overlaps tensor 'a'"});
}

TEST(SafetensorsMalformed, GapOrTrailingBytes) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  write_raw(path,
            R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
            12);
  expect_open_error(path, {path, "gap of 4 bytes at [4, 8)", "tensor 'b'"});
  write_raw(path, R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8);
  expect_open_error(path, {"gap of 4 bytes at [0, 4)"});
  write_raw(path, R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 6);
  expect_open_error(path, {path, "2 trailing bytes"});
}

TEST(SafetensorsMalformed, DuplicateNames) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  write_raw(path,
            R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
            8);
  expect_open_error(path, {path, "repeats the key 'a'"});
}

// Mutates a valid file's length prefix and header (byte flips, random bytes, truncation) with
// a fixed seed. Every open must succeed or throw moe::Error; on success every tensor is read.
TEST(SafetensorsMalformed, FuzzHeaderBytes) {
  TempDir dir;
  const std::string src = dir.file("src.safetensors");
  std::vector<float> w(24);
  for (size_t i = 0; i < w.size(); ++i) w[i] = float(i);
  std::vector<uint16_t> b(10, 0x3F80);
  std::vector<int64_t> ids = {1, 2, 3};
  write_safetensors(src,
                    {{"model.layers.0.w", DType::kF32, {4, 6}, w.data()},
                     {"b", DType::kBF16, {2, 5}, b.data()},
                     {"empty", DType::kF32, {0}, nullptr},
                     {"ids", DType::kI64, {3}, ids.data()}},
                    {{"k", "v"}});
  const auto original = read_bytes(src);
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= uint64_t(original[i]) << (8 * i);
  const size_t header_end = 8 + size_t(header_len);

  std::mt19937_64 gen(20240611);
  const std::string path = dir.file("fuzz.safetensors");
  int opened = 0, refused = 0;
  std::vector<float> sink(64);
  for (int iter = 0; iter < 3000; ++iter) {
    auto bytes = original;
    const int mode = int(gen() % 4);
    const int flips = 1 + int(gen() % 4);
    for (int k = 0; k < flips && mode != 3; ++k) {
      const size_t pos = gen() % header_end;
      if (mode == 0) bytes[pos] ^= uint8_t(1u << (gen() % 8));
      else if (mode == 1) bytes[pos] = uint8_t(gen());
      else bytes[pos] = "{}[],:\" 0123456789-eE."[gen() % 22];
    }
    if (mode == 3 || gen() % 8 == 0) bytes.resize(gen() % (bytes.size() + 1));
    write_bytes(path, bytes);
    try {
      const auto f = SafetensorsFile::open(path);
      ++opened;
      for (const auto& t : f.tensors()) {
        const auto* p = static_cast<const uint8_t*>(f.data(t));
        uint8_t acc = 0;
        for (int64_t i = 0; i < t.bytes(); ++i) acc ^= p[i];  // touches every byte of the tensor
        (void)acc;
        const bool is_float = t.dtype_name == "F32" || t.dtype_name == "BF16" || t.dtype_name == "F16" ||
                              t.dtype_name == "F64" || t.dtype_name.rfind("F8_", 0) == 0;
        if (is_float && t.numel() <= int64_t(sink.size())) f.read_f32(t.name, sink.data(), t.numel());
      }
    } catch (const Error&) {
      ++refused;
    } catch (const std::exception& e) {
      FAIL() << "iteration " << iter << ": open threw a non-moe exception: " << e.what();
    }
  }
  EXPECT_GT(opened, 0);   // some mutations (inside names, padding) stay valid
  EXPECT_GT(refused, 0);  // most do not
  RecordProperty("opened", opened);
  RecordProperty("refused", refused);
}

}  // namespace
}  // namespace moe::testing
