// safetensors writer and validating reader. The reader maps the file read-only and checks
// every header field against the file size before any tensor byte is touched, so a corrupt
// or hostile file yields a moe::Error, never an out-of-bounds read. Integer arithmetic on
// header values is overflow-checked; decoding to f32 reads through memcpy (any alignment).
#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <string_view>
#include <unordered_set>

#include "checkpoint/files.h"
#include "core/error.h"

namespace moe {

namespace {

using nlohmann::json;

constexpr std::string_view kMetadataKey = "__metadata__";

struct StDTypeInfo {
  std::string_view name;
  int64_t size;
  std::optional<DType> dtype;
};

// The safetensors dtypes with whole-byte elements.
constexpr StDTypeInfo kStDTypes[] = {
    {"BOOL", 1, std::nullopt},     {"U8", 1, std::nullopt},
    {"I8", 1, std::nullopt},       {"I16", 2, std::nullopt},
    {"U16", 2, DType::kU16},       {"F16", 2, std::nullopt},
    {"BF16", 2, DType::kBF16},     {"I32", 4, DType::kI32},
    {"U32", 4, DType::kU32},       {"F32", 4, DType::kF32},
    {"F64", 8, DType::kF64},       {"I64", 8, DType::kI64},
    {"U64", 8, std::nullopt},      {"F8_E5M2", 1, DType::kF8E5M2},
    {"F8_E4M3", 1, DType::kF8E4M3}, {"F8_E8M0", 1, DType::kE8M0},
};

const StDTypeInfo* find_st_dtype(std::string_view name) {
  for (const auto& d : kStDTypes)
    if (d.name == name) return &d;
  return nullptr;
}

std::string accepted_st_dtypes() {
  std::string s;
  for (const auto& d : kStDTypes) s += (s.empty() ? "" : ", ") + std::string(d.name);
  return s;
}

// a * b for non-negative values; false on int64 overflow.
bool mul_checked(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

// ---- writing -----------------------------------------------------------------------------

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const size_t chunk = std::min<size_t>(n, size_t(1) << 30);
    const ssize_t put = ::write(fd, p, chunk);
    if (put < 0 && errno == EINTR) continue;
    MOE_CHECK(put > 0, "write to '", path, "' failed: ", write_error_hint(put < 0 ? errno : EIO));
    p += put;
    n -= size_t(put);
  }
}

// ---- decoding to f32 ---------------------------------------------------------------------

template <typename Bits>
Bits load_bits(const uint8_t* p) {
  Bits b;
  std::memcpy(&b, p, sizeof(Bits));
  return b;
}

float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float bf16_bits_to_f32(uint16_t b) { return bits_to_f32(uint32_t(b) << 16); }

// OCP e4m3 "fn": bias 7, no infinities, S.1111.111 is NaN.
float e4m3_bits_to_f32(uint8_t b) {
  const bool neg = b & 0x80;
  const int exp = (b >> 3) & 0xF, man = b & 0x7;
  float v;
  if (exp == 0xF && man == 0x7) v = std::numeric_limits<float>::quiet_NaN();
  else if (exp == 0) v = std::ldexp(float(man), -9);  // subnormal: man/8 * 2^-6
  else v = std::ldexp(1.0f + float(man) / 8.0f, exp - 7);
  return neg ? -v : v;
}

// e5m2 is the upper byte of an IEEE half.
float e5m2_bits_to_f32(uint8_t b) { return f16_bits_to_f32(uint16_t(b) << 8); }

// e8m0: 2^(b - 127), 0xFF is NaN.
float e8m0_bits_to_f32(uint8_t b) {
  if (b == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, int(b) - 127);
}

}  // namespace

float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in f32
    const float v = std::ldexp(float(man), -24);
    return sign ? -v : v;
  }
  if (exp == 0x1F) return bits_to_f32(sign | 0x7F800000u | (man << 13));  // inf / NaN
  return bits_to_f32(sign | ((exp - 15 + 127) << 23) | (man << 13));
}

void safetensors_to_f32(const void* src, const std::string& dtype_name, float* dst, int64_t n) {
  const auto* p = static_cast<const uint8_t*>(src);
  if (dtype_name == "F32") {
    if (n > 0) std::memcpy(dst, p, size_t(n) * 4);
  } else if (dtype_name == "F64") {
    for (int64_t i = 0; i < n; ++i) dst[i] = float(load_bits<double>(p + 8 * i));
  } else if (dtype_name == "BF16") {
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_f32(load_bits<uint16_t>(p + 2 * i));
  } else if (dtype_name == "F16") {
    for (int64_t i = 0; i < n; ++i) dst[i] = f16_bits_to_f32(load_bits<uint16_t>(p + 2 * i));
  } else if (dtype_name == "F8_E4M3") {
    for (int64_t i = 0; i < n; ++i) dst[i] = e4m3_bits_to_f32(p[i]);
  } else if (dtype_name == "F8_E5M2") {
    for (int64_t i = 0; i < n; ++i) dst[i] = e5m2_bits_to_f32(p[i]);
  } else if (dtype_name == "F8_E8M0") {
    for (int64_t i = 0; i < n; ++i) dst[i] = e8m0_bits_to_f32(p[i]);
  } else {
    MOE_FAIL("cannot convert dtype ", dtype_name,
             " to f32: expected one of F32, F64, BF16, F16, F8_E4M3, F8_E5M2, F8_E8M0");
  }
}

void write_safetensors(const std::string& path, const std::vector<TensorRef>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  auto it = metadata.find("format");
  MOE_CHECK(it == metadata.end() || it->second == "pt", "safetensors metadata 'format' must be 'pt', got '",
            it == metadata.end() ? "" : it->second, "' (writing '", path, "')");

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  auto& meta = header[std::string(kMetadataKey)];
  meta["format"] = "pt";
  for (const auto& [k, v] : metadata)
    if (k != "format") meta[k] = v;

  std::unordered_set<std::string> names;
  std::vector<int64_t> sizes;
  int64_t offset = 0;
  for (const auto& t : tensors) {
    MOE_CHECK(t.name != kMetadataKey, "tensor name '__metadata__' is reserved (writing '", path, "')");
    MOE_CHECK(names.insert(t.name).second, "duplicate tensor name '", t.name, "' (writing '", path, "')");
    int64_t numel = 1;
    for (int64_t d : t.shape) {
      MOE_CHECK(d >= 0, "tensor '", t.name, "' has a negative dimension in shape ", shape_str(t.shape),
                " (writing '", path, "')");
      MOE_CHECK(mul_checked(numel, d, &numel), "tensor '", t.name, "' shape ", shape_str(t.shape),
                " overflows int64");
    }
    int64_t bytes = 0;
    MOE_CHECK(mul_checked(numel, dtype_size(t.dtype), &bytes), "tensor '", t.name, "' byte size overflows");
    MOE_CHECK(bytes == 0 || t.data != nullptr, "tensor '", t.name, "' has ", numel,
              " elements but a null data pointer (writing '", path, "')");
    auto& entry = header[t.name];
    entry["dtype"] = std::string(dtype_safetensors_name(t.dtype));
    entry["shape"] = t.shape;
    entry["data_offsets"] = {offset, offset + bytes};
    sizes.push_back(bytes);
    MOE_CHECK(!__builtin_add_overflow(offset, bytes, &offset), "total data size overflows int64");
  }

  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // e.g. a name that is not valid UTF-8
    MOE_FAIL("cannot encode the safetensors header for '", path, "': ", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t len_le[8];
  for (int i = 0; i < 8; ++i) len_le[i] = uint8_t(uint64_t(text.size()) >> (8 * i));

  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  MOE_CHECK(fd >= 0, "cannot create '", path, "': ", write_error_hint(errno));
  try {
    write_all(fd, len_le, 8, path);
    write_all(fd, text.data(), text.size(), path);
    for (size_t i = 0; i < tensors.size(); ++i)
      if (sizes[i] > 0) write_all(fd, tensors[i].data, size_t(sizes[i]), path);
    MOE_CHECK(::fsync(fd) == 0, "fsync of '", path, "' failed: ", write_error_hint(errno));
  } catch (...) {
    ::close(fd);
    throw;
  }
  MOE_CHECK(::close(fd) == 0, "close of '", path, "' failed: ", write_error_hint(errno));
}

// ---- reading -----------------------------------------------------------------------------

struct SafetensorsFile::Mapping {
  void* addr = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (addr) ::munmap(addr, size);
  }
};

namespace {

// Parses JSON, rejecting repeated keys inside any object (a plain parse keeps the last one).
json parse_header_json(std::string_view text, std::string* duplicate_key) {
  std::vector<std::unordered_set<std::string>> keys_per_object;
  auto callback = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      keys_per_object.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!keys_per_object.empty()) keys_per_object.pop_back();
    } else if (event == json::parse_event_t::key && !keys_per_object.empty() && parsed.is_string()) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (!keys_per_object.back().insert(key).second && duplicate_key->empty()) *duplicate_key = key;
    }
    return true;
  };
  return json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/false);
}

// A JSON value for an error message: primitives and flat arrays verbatim, anything nested by
// its type only (printing is recursive, and a hostile header may nest millions deep).
std::string describe(const json& v) {
  if (v.is_array()) {
    for (const auto& e : v)
      if (e.is_structured()) return "a nested array";
  } else if (v.is_object()) {
    return "an object";
  }
  return v.dump(-1, ' ', false, json::error_handler_t::replace);
}

// A JSON value as a non-negative int64, or nullopt.
std::optional<int64_t> as_index(const json& v) {
  if (!v.is_number_unsigned()) return std::nullopt;
  const uint64_t u = v.get<uint64_t>();
  if (u > uint64_t(std::numeric_limits<int64_t>::max())) return std::nullopt;
  return int64_t(u);
}

}  // namespace

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  const std::string where = "safetensors file '" + path + "'";
  // O_NONBLOCK: a FIFO in place of the file must be refused, not waited on.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  MOE_CHECK(fd >= 0, "cannot open ", where, ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    MOE_FAIL("cannot stat ", where, ": ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    MOE_FAIL(where, " is ", S_ISDIR(st.st_mode) ? "a directory" : S_ISFIFO(st.st_mode) ? "a FIFO" : "not a regular file",
             ": expected a regular file");
  }
  const int64_t file_size = st.st_size;
  if (file_size < 8) {
    ::close(fd);
    MOE_FAIL(where, " is ", file_size, " bytes: shorter than the 8-byte header length (truncated?)");
  }
  auto mapping = std::make_shared<Mapping>();
  void* addr = ::mmap(nullptr, size_t(file_size), PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);
  MOE_CHECK(addr != MAP_FAILED, "cannot map ", where, ": ", std::strerror(map_err));
  mapping->addr = addr;
  mapping->size = size_t(file_size);
  const auto* bytes = static_cast<const uint8_t*>(addr);

  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= uint64_t(bytes[i]) << (8 * i);
  MOE_CHECK(header_len <= uint64_t(kSafetensorsMaxHeaderBytes), where, ": header length ", header_len,
            " exceeds the ", kSafetensorsMaxHeaderBytes, "-byte limit (corrupt or not safetensors)");
  MOE_CHECK(int64_t(header_len) <= file_size - 8, where, ": header length ", header_len,
            " runs past the end of the ", file_size, "-byte file (truncated?)");

  SafetensorsFile f;
  f.path_ = path;
  f.data_ = bytes + 8 + header_len;
  f.data_size_ = file_size - 8 - int64_t(header_len);

  std::string duplicate;
  const json header =
      parse_header_json(std::string_view(reinterpret_cast<const char*>(bytes + 8), header_len), &duplicate);
  MOE_CHECK(!header.is_discarded(), where, ": header is not valid JSON");
  MOE_CHECK(duplicate.empty(), where, ": header repeats the key '", duplicate, "'");
  MOE_CHECK(header.is_object(), where, ": header must be a JSON object, got ", header.type_name());

  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey) {
      MOE_CHECK(value.is_object(), where, ": __metadata__ must be an object of strings, got ", value.type_name());
      for (const auto& [mk, mv] : value.items()) {
        MOE_CHECK(mv.is_string(), where, ": __metadata__ value for '", mk, "' must be a string, got ",
                  mv.type_name());
        f.metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    const std::string tensor = where + ": tensor '" + key + "'";
    MOE_CHECK(value.is_object(), tensor, ": entry must be an object, got ", value.type_name());
    const auto dt = value.find("dtype");
    const auto sh = value.find("shape");
    const auto off = value.find("data_offsets");
    MOE_CHECK(dt != value.end(), tensor, ": missing 'dtype'");
    MOE_CHECK(sh != value.end(), tensor, ": missing 'shape'");
    MOE_CHECK(off != value.end(), tensor, ": missing 'data_offsets'");

    TensorInfo info;
    info.name = key;
    MOE_CHECK(dt->is_string(), tensor, ": 'dtype' must be a string, got ", dt->type_name());
    info.dtype_name = dt->get<std::string>();
    const StDTypeInfo* st_dtype = find_st_dtype(info.dtype_name);
    MOE_CHECK(st_dtype != nullptr, tensor, ": unknown dtype '", info.dtype_name, "': expected one of ",
              accepted_st_dtypes());
    info.dtype = st_dtype->dtype;

    MOE_CHECK(sh->is_array(), tensor, ": 'shape' must be an array, got ", sh->type_name());
    int64_t numel = 1;
    for (const auto& d : *sh) {
      const auto dim = as_index(d);
      MOE_CHECK(dim.has_value(), tensor, ": 'shape' entries must be non-negative integers, got ", describe(d));
      MOE_CHECK(mul_checked(numel, *dim, &numel), tensor, ": shape ", describe(*sh), " overflows int64");
      info.shape.push_back(*dim);
    }
    int64_t nbytes = 0;
    MOE_CHECK(mul_checked(numel, st_dtype->size, &nbytes), tensor, ": byte size of shape ", describe(*sh),
              " overflows int64");

    MOE_CHECK(off->is_array() && off->size() == 2, tensor, ": 'data_offsets' must be [begin, end], got ",
              describe(*off));
    const auto begin = as_index((*off)[0]), end = as_index((*off)[1]);
    MOE_CHECK(begin && end, tensor, ": 'data_offsets' must be non-negative integers, got ", describe(*off));
    MOE_CHECK(*begin <= *end, tensor, ": data_offsets ", describe(*off), " has begin > end");
    MOE_CHECK(*end <= f.data_size_, tensor, ": data_offsets ", describe(*off), " end beyond the ", f.data_size_,
              "-byte data area (truncated?)");
    MOE_CHECK(*end - *begin == nbytes, tensor, ": data_offsets ", describe(*off), " span ", *end - *begin,
              " bytes but shape ", describe(*sh), " of ", info.dtype_name, " needs ", nbytes);
    info.begin = *begin;
    info.end = *end;
    f.tensors_.push_back(std::move(info));
  }

  std::stable_sort(f.tensors_.begin(), f.tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  int64_t cursor = 0;
  const TensorInfo* prev = nullptr;
  for (const auto& t : f.tensors_) {
    MOE_CHECK(t.begin >= cursor, where, ": tensor '", t.name, "' [", t.begin, ", ", t.end,
              ") overlaps tensor '", prev ? prev->name : "", "' which ends at ", cursor);
    MOE_CHECK(t.begin == cursor, where, ": gap of ", t.begin - cursor, " bytes at [", cursor, ", ", t.begin,
              ") before tensor '", t.name, "': tensors must tile the data area");
    cursor = t.end;
    prev = &t;
  }
  MOE_CHECK(cursor == f.data_size_, where, ": ", f.data_size_ - cursor, " trailing bytes after the last tensor at [",
            cursor, ", ", f.data_size_, "): tensors must tile the data area");

  for (size_t i = 0; i < f.tensors_.size(); ++i) f.index_.emplace(f.tensors_[i].name, i);
  f.mapping_ = std::move(mapping);
  return f;
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const void* SafetensorsFile::data(const TensorInfo& t) const {
  MOE_CHECK(t.begin >= 0 && t.begin <= t.end && t.end <= data_size_, "tensor '", t.name,
            "' offsets [", t.begin, ", ", t.end, ") lie outside the data area of '", path_, "'");
  return data_ + t.begin;
}

void SafetensorsFile::read_f32(const std::string& name, float* out, int64_t expected_numel) const {
  const TensorInfo* t = find(name);
  MOE_CHECK(t != nullptr, "tensor '", name, "' not found in '", path_, "'");
  MOE_CHECK(t->numel() == expected_numel, "tensor '", name, "' in '", path_, "' has ", t->numel(),
            " elements (shape ", shape_str(t->shape), "), expected ", expected_numel);
  try {
    safetensors_to_f32(data(*t), t->dtype_name, out, t->numel());
  } catch (const Error& e) {
    MOE_FAIL("tensor '", name, "' in '", path_, "': ", e.what());
  }
}

}  // namespace moe
