// Token files: mmap, .npy header parsing (versions 1.0/2.0/3.0, 1-D little-endian integer
// arrays) and id conversion to int32 with a vocabulary check. The check is a max/min
// reduction over each copied run (vectorisable); only a failing run is scanned again to name
// the first bad id. Assumes a little-endian host, like the files.
#include "data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>
#include <type_traits>

#include "core/error.h"

static_assert(std::endian::native == std::endian::little, "token files are little-endian");

namespace moe {
namespace {

enum class Elem : uint8_t { kU8, kU16, kU32, kU64, kI16, kI32, kI64 };

int64_t elem_size(Elem e) {
  switch (e) {
    case Elem::kU8: return 1;
    case Elem::kU16: case Elem::kI16: return 2;
    case Elem::kU32: case Elem::kI32: return 4;
    case Elem::kU64: case Elem::kI64: return 8;
  }
  return 0;
}

// A read-only private mapping of a whole file; unmapped on destruction.
struct Mapping {
  void* addr = nullptr;
  size_t len = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (addr) ::munmap(addr, len);
  }
};

struct Segment {
  std::string name;
  std::string format;        // "uint16", "uint32", "npy <u2", ...
  Elem elem = Elem::kU32;
  const uint8_t* data = nullptr;  // first token
  int64_t data_offset = 0;   // byte offset of the first token in the file
  int64_t num_tokens = 0;
  int64_t start = 0;         // stream offset of the first token
};

}  // namespace

struct TokenSource::State {
  std::vector<Segment> segments;
  std::vector<int64_t> starts;  // segments[i].start, for binary search
  std::vector<std::unique_ptr<Mapping>> mappings;
  std::vector<uint32_t> memory;  // from_memory storage
  int64_t total = 0;
  int64_t vocab = 0;
};

namespace {

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

// O_NONBLOCK: opening a FIFO for reading returns at once instead of waiting for a writer, so it
// is refused below rather than blocking the run. It does not change how a regular file is read.
std::unique_ptr<Mapping> map_file(const std::string& path, int64_t* size_out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  MOE_CHECK(fd >= 0, "cannot open token file '", path, "': ", std::strerror(errno),
            " (check [data] paths)");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    MOE_FAIL("cannot stat token file '", path, "': ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    MOE_FAIL("token file '", path, "' is ", file_kind(st.st_mode),
             ", not a regular file; list the token files themselves in [data] paths");
  }
  auto m = std::make_unique<Mapping>();
  *size_out = static_cast<int64_t>(st.st_size);
  if (st.st_size > 0) {
    void* addr = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);
    MOE_CHECK(addr != MAP_FAILED, "cannot mmap token file '", path, "' (", st.st_size,
              " bytes): ", std::strerror(err));
    m->addr = addr;
    m->len = static_cast<size_t>(st.st_size);
  } else {
    ::close(fd);
  }
  return m;
}

template <typename T>
T load_le(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Parser for the Python dict literal of a .npy header, e.g.
// {'descr': '<u2', 'fortran_order': False, 'shape': (1000,), }
struct NpyValue {
  enum Kind { kString, kBool, kTuple } kind = kString;
  std::string str;
  bool flag = false;
  std::vector<int64_t> tuple;
};

class NpyHeaderParser {
 public:
  NpyHeaderParser(std::string_view text, const std::string& path, int64_t base)
      : text_(text), path_(path), base_(base) {}

  std::map<std::string, NpyValue> parse_dict() {
    std::map<std::string, NpyValue> out;
    skip_ws();
    expect('{');
    skip_ws();
    while (peek() != '}') {
      std::string key = parse_string();
      skip_ws();
      expect(':');
      skip_ws();
      MOE_CHECK(!out.count(key), "malformed .npy header in '", path_, "': key '", key,
                "' repeated (byte offset ", base_ + pos_, ")");
      out[key] = parse_value();
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        skip_ws();
      } else if (peek() != '}') {
        fail("',' or '}'");
      }
    }
    ++pos_;
    skip_ws();
    if (pos_ != text_.size()) fail("only padding after the closing '}'");
    return out;
  }

 private:
  char peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  void skip_ws() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' ||
                                   text_[pos_] == '\t' || text_[pos_] == '\r'))
      ++pos_;
  }
  [[noreturn]] void fail(const char* expected) const {
    const std::string got = pos_ < text_.size()
                                ? "'" + std::string(text_.substr(pos_, 12)) + "'"
                                : std::string("end of header");
    MOE_FAIL("malformed .npy header in '", path_, "' at byte offset ", base_ + pos_,
             ": expected ", expected, ", got ", got);
  }
  void expect(char c) {
    if (peek() != c) {
      const char want[4] = {'\'', c, '\'', '\0'};
      fail(want);
    }
    ++pos_;
  }
  std::string parse_string() {
    const char q = peek();
    if (q != '\'' && q != '"') fail("a quoted string");
    const size_t end = text_.find(q, pos_ + 1);
    if (end == std::string_view::npos) fail("a closed string");
    std::string s(text_.substr(pos_ + 1, end - pos_ - 1));
    pos_ = end + 1;
    return s;
  }
  int64_t parse_int() {
    const size_t begin = pos_;
    int64_t v = 0;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
      MOE_CHECK(v <= (std::numeric_limits<int64_t>::max() - 9) / 10,
                "malformed .npy header in '", path_, "': dimension too large at byte offset ",
                base_ + begin);
      v = v * 10 + (text_[pos_++] - '0');
    }
    if (pos_ == begin) fail("a non-negative integer");
    if (peek() == 'L') ++pos_;  // written by old Python 2 numpy
    return v;
  }
  NpyValue parse_value() {
    NpyValue v;
    const char c = peek();
    if (c == '\'' || c == '"') {
      v.kind = NpyValue::kString;
      v.str = parse_string();
    } else if (text_.substr(pos_, 4) == "True") {
      v.kind = NpyValue::kBool;
      v.flag = true;
      pos_ += 4;
    } else if (text_.substr(pos_, 5) == "False") {
      v.kind = NpyValue::kBool;
      pos_ += 5;
    } else if (c == '(') {
      v.kind = NpyValue::kTuple;
      ++pos_;
      skip_ws();
      while (peek() != ')') {
        v.tuple.push_back(parse_int());
        skip_ws();
        if (peek() == ',') {
          ++pos_;
          skip_ws();
        } else if (peek() != ')') {
          fail("',' or ')' in the shape tuple");
        }
      }
      ++pos_;
    } else if (c == '[') {
      MOE_FAIL("unsupported .npy dtype in '", path_, "' at byte offset ", base_ + pos_,
               ": structured dtypes are not token arrays; save a 1-D integer array");
    } else {
      fail("a string, True, False or a tuple");
    }
    return v;
  }

  std::string_view text_;
  const std::string& path_;
  int64_t base_;
  size_t pos_ = 0;
};

constexpr char kNpyMagic[] = "\x93NUMPY";
constexpr int64_t kNpyMagicLen = 6;

bool has_npy_magic(const uint8_t* p, int64_t size) {
  return size >= kNpyMagicLen && std::memcmp(p, kNpyMagic, kNpyMagicLen) == 0;
}

// llm.c files (its dev/data/data_common.py): 256 little-endian int32 header words (magic,
// version, count, then zeros), then the payload. Read as a headerless array, the 1024 header
// bytes would become 512 or 256 tokens, so a file starting with one of these magics is refused.
struct LlmcFormat {
  int32_t magic, version;
  const char* dtype;  // nullptr: not a token stream
  int64_t width;
  const char* what;
};
constexpr LlmcFormat kLlmcFormats[] = {
    {20240520, 1, "uint16", 2, "an llm.c token shard (GPT-2 format: uint16 tokens after a 1024-byte header)"},
    {20240801, 7, "uint32", 4, "an llm.c token shard (Llama 3 format: uint32 tokens after a 1024-byte header)"},
    {20240522, 1, nullptr, 2, "an llm.c multiple-choice eval file (HellaSwag/MMLU examples), not a token stream"},
};
constexpr int64_t kLlmcHeaderBytes = 256 * 4;

void refuse_llmc(const uint8_t* p, int64_t size, const std::string& path) {
  if (size < 4) return;
  const int32_t magic = load_le<int32_t>(p);
  for (const LlmcFormat& f : kLlmcFormats) {
    if (magic != f.magic) continue;
    const int64_t version = size >= 8 ? load_le<int32_t>(p + 4) : -1;
    const int64_t count = size >= 12 ? load_le<int32_t>(p + 8) : -1;
    std::ostringstream found;
    found << "magic " << f.magic << ", version " << version;
    if (version != f.version) found << " (llm.c writes " << f.version << ")";
    found << ", header count " << count << ", " << size << " bytes";
    if (f.dtype && size != kLlmcHeaderBytes + count * f.width)
      found << " (1024 + " << count << " x " << f.width << " = " << kLlmcHeaderBytes + count * f.width
            << " expected: truncated?)";
    if (!f.dtype)
      MOE_FAIL("token file '", path, "' is ", f.what, " (", found.str(), "); list token files in [data] paths");
    MOE_FAIL("token file '", path, "' is ", f.what, " (", found.str(),
             "); moecore reads headerless token arrays and .npy files and would read the header as tokens. "
             "Strip the header and list the new file in [data] paths: tail -c +1025 '", path, "' > '", path, ".",
             f.dtype, "' with [data] token_dtype = \"", f.dtype, "\", or in Python np.save('", path,
             ".npy', np.fromfile('", path, "', dtype=np.", f.dtype, ", offset=1024))");
  }
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + (s.size() == 1 ? ",)" : ")");
}

// Fills seg.{elem, format, data_offset, num_tokens} from the .npy header at p[0, size).
void parse_npy(const uint8_t* p, int64_t size, Segment& seg) {
  const std::string& path = seg.name;
  MOE_CHECK(size >= 10, "malformed .npy file '", path, "': ", size,
            " bytes, but the magic, version and header length need at least 10");
  const int major = p[6], minor = p[7];
  MOE_CHECK((major == 1 || major == 2 || major == 3) && minor == 0, "unsupported .npy version ",
            major, ".", minor, " in '", path, "' (byte offset 6); expected 1.0, 2.0 or 3.0");
  int64_t header_len = 0, header_start = 0;
  if (major == 1) {
    header_len = load_le<uint16_t>(p + 8);
    header_start = 10;
  } else {
    MOE_CHECK(size >= 12, "malformed .npy file '", path, "': ", size,
              " bytes, but a version ", major, " preamble needs 12");
    header_len = load_le<uint32_t>(p + 8);
    header_start = 12;
  }
  MOE_CHECK(header_start + header_len <= size, "malformed .npy file '", path, "': header length ",
            header_len, " (byte offset 8) runs past the end of the file at byte ", size);

  const std::string_view text(reinterpret_cast<const char*>(p + header_start),
                              static_cast<size_t>(header_len));
  NpyHeaderParser parser(text, path, header_start);
  const auto dict = parser.parse_dict();
  for (const char* key : {"descr", "fortran_order", "shape"})
    MOE_CHECK(dict.count(key), "malformed .npy header in '", path, "': key '", key,
              "' missing (header at byte offset ", header_start, ")");
  MOE_CHECK(dict.size() == 3, "malformed .npy header in '", path,
            "': expected exactly the keys descr, fortran_order, shape; got ", dict.size(), " keys");
  const NpyValue& descr = dict.at("descr");
  const NpyValue& fortran = dict.at("fortran_order");
  const NpyValue& shape = dict.at("shape");
  MOE_CHECK(descr.kind == NpyValue::kString, "malformed .npy header in '", path,
            "': 'descr' must be a string");
  MOE_CHECK(fortran.kind == NpyValue::kBool, "malformed .npy header in '", path,
            "': 'fortran_order' must be True or False");
  MOE_CHECK(shape.kind == NpyValue::kTuple, "malformed .npy header in '", path,
            "': 'shape' must be a tuple");

  static const std::map<std::string, Elem> kDescr = {
      {"|u1", Elem::kU8},   {"<u1", Elem::kU8},   {"<u2", Elem::kU16}, {"<u4", Elem::kU32},
      {"<u8", Elem::kU64},  {"<i2", Elem::kI16},  {"<i4", Elem::kI32}, {"<i8", Elem::kI64}};
  const auto it = kDescr.find(descr.str);
  MOE_CHECK(it != kDescr.end(), "unsupported .npy dtype '", descr.str, "' in '", path,
            "' (header at byte offset ", header_start,
            "); token arrays must be little-endian integers: <u2, <u4, <i4, <i8, <u8, <i2, |u1");
  MOE_CHECK(!fortran.flag, "unsupported .npy layout in '", path,
            "': fortran_order is True; save a C-ordered 1-D array");
  MOE_CHECK(shape.tuple.size() == 1, "unsupported .npy shape ", shape_text(shape.tuple), " in '",
            path, "': expected a 1-D token array, e.g. (N,)");

  seg.elem = it->second;
  seg.format = "npy " + descr.str;
  seg.data_offset = header_start + header_len;
  const int64_t count = shape.tuple[0];
  const int64_t have = size - seg.data_offset;
  const int64_t isize = elem_size(seg.elem);
  MOE_CHECK(count <= have / isize, "truncated .npy file '", path, "': shape (", count, ",) of ",
            descr.str, " needs ", count, " x ", isize, " bytes from byte offset ",
            seg.data_offset, ", but the file ends at byte ", size, " (", have / isize,
            " whole tokens)");
  MOE_CHECK(count * isize == have, "malformed .npy file '", path, "': ", have - count * isize,
            " bytes after the data (from byte offset ", seg.data_offset + count * isize,
            "); shape (", count, ",) says the file ends there");
  seg.num_tokens = count;
}

// Converts n tokens of type T starting at src into out; returns false if any id is negative
// or >= vocab (then nothing about `out` beyond the bad id is promised).
template <typename T>
bool convert_run(const uint8_t* src, int64_t n, int32_t* out, int64_t vocab) {
  if constexpr (std::is_unsigned_v<T>) {
    T hi = 0;
    for (int64_t i = 0; i < n; ++i) {
      const T v = load_le<T>(src + i * sizeof(T));
      out[i] = static_cast<int32_t>(v);
      hi = v > hi ? v : hi;
    }
    return static_cast<uint64_t>(hi) < static_cast<uint64_t>(vocab);
  } else {
    T hi = 0, lo = 0;
    for (int64_t i = 0; i < n; ++i) {
      const T v = load_le<T>(src + i * sizeof(T));
      out[i] = static_cast<int32_t>(v);
      hi = v > hi ? v : hi;
      lo = v < lo ? v : lo;
    }
    return lo >= 0 && static_cast<int64_t>(hi) < vocab;
  }
}

template <typename T>
int64_t first_bad(const uint8_t* src, int64_t n, int64_t vocab, int64_t* value) {
  for (int64_t i = 0; i < n; ++i) {
    const T v = load_le<T>(src + i * sizeof(T));
    const bool bad = std::is_unsigned_v<T>
                         ? static_cast<uint64_t>(v) >= static_cast<uint64_t>(vocab)
                         : (v < 0 || static_cast<int64_t>(v) >= vocab);
    if (bad) {
      *value = static_cast<int64_t>(v);
      return i;
    }
  }
  return -1;
}

template <typename F>
auto dispatch_elem(Elem e, F&& f) {
  switch (e) {
    case Elem::kU8: return f(uint8_t{});
    case Elem::kU16: return f(uint16_t{});
    case Elem::kU32: return f(uint32_t{});
    case Elem::kU64: return f(uint64_t{});
    case Elem::kI16: return f(int16_t{});
    case Elem::kI32: return f(int32_t{});
    case Elem::kI64: return f(int64_t{});
  }
  MOE_FAIL("unknown token element type");
}

void check_vocab(int64_t vocab_size) {
  MOE_CHECK(vocab_size >= 1 && vocab_size <= (int64_t{1} << 31),
            "vocab_size must be in [1, 2^31] for int32 token ids, got ", vocab_size);
}

void index_segments(TokenSource::State& s) {
  int64_t start = 0;
  for (Segment& seg : s.segments) {
    seg.start = start;
    s.starts.push_back(start);
    start += seg.num_tokens;
  }
  s.total = start;
}

}  // namespace

int64_t token_dtype_size(const std::string& token_dtype) {
  if (token_dtype == "uint16") return 2;
  if (token_dtype == "uint32") return 4;
  MOE_FAIL("token_dtype must be \"uint16\" or \"uint32\", got \"", token_dtype, "\"");
}

TokenSource TokenSource::open(const std::vector<std::string>& paths, const std::string& token_dtype,
                              int64_t vocab_size) {
  MOE_CHECK(!paths.empty(), "no token files given: set [data] paths to one or more files");
  check_vocab(vocab_size);
  const int64_t raw_size = token_dtype_size(token_dtype);
  const Elem raw_elem = raw_size == 2 ? Elem::kU16 : Elem::kU32;

  auto state = std::make_shared<State>();
  state->vocab = vocab_size;
  for (const std::string& path : paths) {
    int64_t size = 0;
    state->mappings.push_back(map_file(path, &size));
    const auto* bytes = static_cast<const uint8_t*>(state->mappings.back()->addr);
    Segment seg;
    seg.name = path;
    if (has_npy_magic(bytes, size)) {
      parse_npy(bytes, size, seg);
    } else {
      refuse_llmc(bytes, size, path);
      MOE_CHECK(size % raw_size == 0, "truncated token file '", path, "': ", size,
                " bytes is not a multiple of ", raw_size, " (", token_dtype,
                "); the last whole token ends at byte offset ", size - size % raw_size,
                " (wrong token_dtype, or an interrupted write?)");
      seg.elem = raw_elem;
      seg.format = token_dtype;
      seg.data_offset = 0;
      seg.num_tokens = size / raw_size;
    }
    seg.data = bytes ? bytes + seg.data_offset : nullptr;
    state->segments.push_back(std::move(seg));
  }
  index_segments(*state);
  return TokenSource(std::move(state));
}

TokenSource TokenSource::from_memory(std::vector<uint32_t> tokens, std::string name,
                                     int64_t vocab_size) {
  check_vocab(vocab_size);
  auto state = std::make_shared<State>();
  state->vocab = vocab_size;
  state->memory = std::move(tokens);
  Segment seg;
  seg.name = std::move(name);
  seg.format = "uint32";
  seg.elem = Elem::kU32;
  seg.data = reinterpret_cast<const uint8_t*>(state->memory.data());
  seg.num_tokens = static_cast<int64_t>(state->memory.size());
  state->segments.push_back(std::move(seg));
  index_segments(*state);
  return TokenSource(std::move(state));
}

int64_t TokenSource::num_tokens() const { return state_->total; }
int64_t TokenSource::vocab_size() const { return state_->vocab; }
int64_t TokenSource::num_files() const { return static_cast<int64_t>(state_->segments.size()); }

const std::string& TokenSource::file_name(int64_t i) const {
  MOE_CHECK(i >= 0 && i < num_files(), "file index ", i, " out of range [0, ", num_files(), ")");
  return state_->segments[i].name;
}
int64_t TokenSource::file_num_tokens(int64_t i) const {
  MOE_CHECK(i >= 0 && i < num_files(), "file index ", i, " out of range [0, ", num_files(), ")");
  return state_->segments[i].num_tokens;
}
std::string TokenSource::file_format(int64_t i) const {
  MOE_CHECK(i >= 0 && i < num_files(), "file index ", i, " out of range [0, ", num_files(), ")");
  return state_->segments[i].format;
}

void TokenSource::read(int64_t offset, int64_t n, int32_t* out) const {
  const State& s = *state_;
  MOE_CHECK(offset >= 0 && n >= 0 && offset <= s.total - n, "token range [", offset, ", ",
            offset + n, ") is outside the stream of ", s.total, " tokens");
  if (n == 0) return;
  // Last segment starting at or before `offset`; empty segments share their successor's start.
  size_t k = static_cast<size_t>(std::upper_bound(s.starts.begin(), s.starts.end(), offset) -
                                 s.starts.begin()) - 1;
  while (n > 0) {
    const Segment& seg = s.segments[k];
    const int64_t local = offset - seg.start;
    const int64_t take = std::min(n, seg.num_tokens - local);
    const int64_t isize = elem_size(seg.elem);
    const uint8_t* src = seg.data + local * isize;
    const bool ok = dispatch_elem(seg.elem, [&](auto tag) {
      return convert_run<decltype(tag)>(src, take, out, s.vocab);
    });
    if (!ok) {
      int64_t value = 0;
      const int64_t i = dispatch_elem(seg.elem, [&](auto tag) {
        return first_bad<decltype(tag)>(src, take, s.vocab, &value);
      });
      MOE_FAIL("token id ", value, " at token offset ", local + i, " of '", seg.name,
               "' (byte offset ", seg.data_offset + (local + i) * isize, ", stream offset ",
               offset + i, ") is outside the vocabulary [0, ", s.vocab,
               "): the data was tokenized for a larger vocabulary than [model] vocab_size, or "
               "token_dtype does not match the files");
    }
    out += take;
    offset += take;
    n -= take;
    ++k;
  }
}

void TokenSource::validate_all() const {
  constexpr int64_t kChunk = int64_t{1} << 20;
  std::vector<int32_t> buf(static_cast<size_t>(std::min(kChunk, std::max<int64_t>(num_tokens(), 1))));
  for (int64_t off = 0; off < num_tokens(); off += kChunk)
    read(off, std::min(kChunk, num_tokens() - off), buf.data());
}

}  // namespace moe
