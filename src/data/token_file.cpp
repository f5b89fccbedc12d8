// Token files: mmap; the formats users have (NumPy .npy 1.0/2.0/3.0 1-D little-endian integer
// arrays, Megatron-Core indexed datasets .bin + .idx, llm.c token shards, headerless arrays) are
// parsed and validated at open; ids are converted to int32 with a vocabulary check. The check is a
// max/min reduction over each copied run (vectorisable); only a failing run is scanned again to
// name the first bad id. Assumes a little-endian host, like the files.
#include "data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <type_traits>

#include "core/error.h"

static_assert(std::endian::native == std::endian::little, "token files are little-endian");

namespace moe {
namespace {

enum class Elem : uint8_t { kU8, kU16, kU32, kU64, kI8, kI16, kI32, kI64 };

int64_t elem_size(Elem e) {
  switch (e) {
    case Elem::kU8: case Elem::kI8: return 1;
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
  std::string format;        // "raw uint16", "npy <u2", "megatron int32", "llm.c uint16", ...
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

// llm.c files (its dev/data/data_common.py, write_datafile): 256 little-endian int32 header words
// (magic, version, token count, then zeros), then the tokens in the dtype the magic names. Its
// multiple-choice eval files (HellaSwag, MMLU) have the same header but hold examples.
struct LlmcShard {
  int32_t magic, version;
  Elem elem;
  const char* dtype;
  const char* tokenizer;
};
constexpr LlmcShard kLlmcShards[] = {
    {20240520, 1, Elem::kU16, "uint16", "GPT-2"},
    {20240801, 7, Elem::kU32, "uint32", "Llama 3"},
};
constexpr int32_t kLlmcEvalMagic = 20240522;
constexpr int64_t kLlmcHeaderBytes = 256 * 4;

// Fills seg.{elem, format, data_offset, num_tokens} and returns true if the file starts with an
// llm.c shard magic; throws for an llm.c eval file or a shard whose header does not fit the file.
bool parse_llmc(const uint8_t* p, int64_t size, Segment& seg) {
  if (size < 4) return false;
  const std::string& path = seg.name;
  const int32_t magic = load_le<int32_t>(p);
  MOE_CHECK(magic != kLlmcEvalMagic, "token file '", path, "' is an llm.c multiple-choice eval file (magic ",
            kLlmcEvalMagic, " at byte offset 0: HellaSwag/MMLU examples), not a token stream; list token files "
            "in [data] paths");
  for (const LlmcShard& f : kLlmcShards) {
    if (magic != f.magic) continue;
    MOE_CHECK(size >= kLlmcHeaderBytes, "truncated llm.c token shard '", path, "': magic ", magic,
              " at byte offset 0, but ", size, " bytes, less than the 1024-byte header");
    const int32_t version = load_le<int32_t>(p + 4);
    MOE_CHECK(version == f.version, "unsupported llm.c token shard '", path, "': version ", version,
              " (byte offset 4) with magic ", magic, "; llm.c writes version ", f.version, " (", f.tokenizer, ", ",
              f.dtype, " tokens)");
    const int64_t count = load_le<int32_t>(p + 8);
    MOE_CHECK(count >= 0, "malformed llm.c token shard '", path, "': token count ", count,
              " (byte offset 8) is negative");
    const int64_t width = elem_size(f.elem);
    const int64_t expected = kLlmcHeaderBytes + count * width;
    MOE_CHECK(size == expected, size < expected ? "truncated" : "malformed", " llm.c token shard '", path,
              "': the header's token count ", count, " (byte offset 8) of ", f.dtype, " needs 1024 + ", count, " x ",
              width, " = ", expected, " bytes, but the file has ", size,
              size < expected ? " (an interrupted write or copy?)" : " (bytes after the last token)");
    seg.elem = f.elem;
    seg.format = std::string("llm.c ") + f.dtype;
    seg.data_offset = kLlmcHeaderBytes;
    seg.num_tokens = count;
    return true;
  }
  return false;
}

// Megatron-Core indexed dataset (megatron/core/datasets/indexed_dataset.py, _IndexWriter), a
// PREFIX.bin of tokens and its PREFIX.idx: magic "MMIDIDX\0\0" (9 bytes), uint64 version 1, uint8
// dtype code, uint64 sequence count N, uint64 document count D (34 bytes), then int32
// sequence_lengths[N] (tokens), int64 sequence_pointers[N] (byte offsets into the .bin), int64
// document_indices[D] (0, the first sequence of each next document, ..., N). The arrays start
// unaligned at byte 34: every field is read with memcpy.
constexpr char kMegatronMagic[] = "MMIDIDX\0\0";
constexpr int64_t kMegatronMagicLen = 9;
constexpr int64_t kMegatronHeaderBytes = 34;

struct MegatronDtype {
  uint8_t code;
  const char* name;
  bool integer;
  Elem elem;
};
constexpr MegatronDtype kMegatronDtypes[] = {
    {1, "uint8", true, Elem::kU8},    {2, "int8", true, Elem::kI8},       {3, "int16", true, Elem::kI16},
    {4, "int32", true, Elem::kI32},   {5, "int64", true, Elem::kI64},     {6, "float64", false, Elem::kU8},
    {7, "float32", false, Elem::kU8}, {8, "uint16", true, Elem::kU16},
};
constexpr const char* kMegatronIntegerCodes = "1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16";

bool has_megatron_magic(const uint8_t* p, int64_t size) {
  return size >= kMegatronMagicLen && std::memcmp(p, kMegatronMagic, kMegatronMagicLen) == 0;
}

std::string escaped_bytes(const uint8_t* p, int64_t n) {
  std::string out;
  char buf[8];
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] >= 32 && p[i] < 127 && p[i] != '\\' && p[i] != '"') {
      out += static_cast<char>(p[i]);
    } else {
      std::snprintf(buf, sizeof buf, "\\x%02x", p[i]);
      out += buf;
    }
  }
  return out;
}

// Validates the .idx at p[0, size) against a .bin of bin_size bytes and fills seg (named by the
// .bin) with the tokens: the sequences in index order, which must tile the .bin from byte 0.
void parse_megatron(const uint8_t* p, int64_t size, const std::string& idx, int64_t bin_size, Segment& seg) {
  const std::string& bin = seg.name;
  MOE_CHECK(size >= kMegatronHeaderBytes, "truncated Megatron index '", idx, "': ", size,
            " bytes, but the header (magic, version, dtype code, sequence and document counts) needs 34");
  MOE_CHECK(has_megatron_magic(p, size), "bad magic in Megatron index '", idx,
            "' (byte offset 0): expected \"MMIDIDX\\x00\\x00\", got \"", escaped_bytes(p, kMegatronMagicLen),
            "\"; name the prefix of a Megatron-Core indexed dataset (PREFIX.bin + PREFIX.idx)");
  const uint64_t version = load_le<uint64_t>(p + 9);
  MOE_CHECK(version == 1, "unsupported Megatron index '", idx, "': version ", version,
            " (byte offset 9); Megatron-Core writes version 1");
  const uint8_t code = p[17];
  const MegatronDtype* dtype = nullptr;
  for (const MegatronDtype& d : kMegatronDtypes)
    if (d.code == code) dtype = &d;
  MOE_CHECK(dtype != nullptr, "unknown dtype code ", int(code), " (byte offset 17) in Megatron index '", idx,
            "'; expected one of ", kMegatronIntegerCodes, " (6 float64 and 7 float32 are not token ids)");
  MOE_CHECK(dtype->integer, "Megatron index '", idx, "' has dtype code ", int(code), " (", dtype->name,
            ") at byte offset 17: token ids need an integer dtype, one of ", kMegatronIntegerCodes,
            "; this dataset does not hold token ids");
  const uint64_t num_sequences = load_le<uint64_t>(p + 18);
  const uint64_t num_doc_indices = load_le<uint64_t>(p + 26);
  // Counts below 2^58 keep 34 + 12 N + 8 D inside uint64; a real index is far smaller.
  const bool representable = num_sequences < (uint64_t{1} << 58) && num_doc_indices < (uint64_t{1} << 58);
  const uint64_t expected = representable ? kMegatronHeaderBytes + 12 * num_sequences + 8 * num_doc_indices : 0;
  if (!representable || expected != static_cast<uint64_t>(size)) {
    MOE_CHECK(!(representable && num_sequences > 0 && expected + num_sequences == static_cast<uint64_t>(size)),
              "Megatron index '", idx, "' has ", num_sequences, " bytes after its document indices (from byte offset ",
              expected, "): the sequence modes of a multimodal dataset, whose .bin holds more than token ids; "
              "not read");
    std::ostringstream need;
    if (representable)
      need << expected;
    else
      need << "more than 2^61";
    MOE_FAIL("size mismatch in Megatron index '", idx, "': sequence count ", num_sequences,
             " (byte offset 18) and document count ", num_doc_indices, " (byte offset 26) need 34 + 4 x ",
             num_sequences, " + 8 x ", num_sequences, " + 8 x ", num_doc_indices, " = ", need.str(),
             " bytes, but the file has ", size, " (truncated, or not written by Megatron-Core?)");
  }
  const int64_t n = static_cast<int64_t>(num_sequences), d = static_cast<int64_t>(num_doc_indices);
  const int64_t lengths_at = kMegatronHeaderBytes, pointers_at = lengths_at + 4 * n, docs_at = pointers_at + 8 * n;
  const int64_t width = elem_size(dtype->elem);

  int64_t end = 0;  // byte where the sequences so far end in the .bin
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = load_le<int32_t>(p + lengths_at + 4 * i);
    const int64_t ptr = load_le<int64_t>(p + pointers_at + 8 * i);
    MOE_CHECK(len >= 0, "Megatron index '", idx, "': sequence_lengths[", i, "] = ", len, " (byte offset ",
              lengths_at + 4 * i, ") is negative");
    MOE_CHECK(ptr == end, "Megatron index '", idx, "': sequence_pointers[", i, "] = ", ptr, " (byte offset ",
              pointers_at + 8 * i, "), but sequence ", i, " starts at byte ", end, " of '", bin, "' (",
              i == 0 ? "the start of the file" : "where the previous sequence ends",
              "); moecore reads the .bin as the sequences in index order, end to end, as Megatron-Core writes it");
    end += len * width;
    MOE_CHECK(end <= bin_size, "truncated Megatron data '", bin, "': ", bin_size, " bytes, but sequence ", i,
              " of '", idx, "' (sequence_lengths[", i, "] = ", len, " ", dtype->name, " tokens at byte ", ptr,
              ") ends at byte ", end);
  }
  MOE_CHECK(end == bin_size, "Megatron data '", bin, "' has ", bin_size, " bytes, but the ", n,
            " sequence lengths of '", idx, "' sum to ", end / width, " ", dtype->name, " tokens = ", end,
            " bytes: the .bin and .idx do not belong together");

  MOE_CHECK(d >= 1, "Megatron index '", idx, "': document count 0 (byte offset 26); Megatron-Core writes the "
            "document indices 0, ..., ", n, " (at least one entry)");
  int64_t prev = 0;
  for (int64_t k = 0; k < d; ++k) {
    const int64_t at = docs_at + 8 * k;
    const int64_t v = load_le<int64_t>(p + at);
    MOE_CHECK(k > 0 || v == 0, "Megatron index '", idx, "': document_indices[0] = ", v, " (byte offset ", at,
              "), expected 0");
    MOE_CHECK(v >= prev && v <= n, "Megatron index '", idx, "': document_indices[", k, "] = ", v, " (byte offset ",
              at, ") is outside [", prev, ", ", n, "]: the indices must rise from 0 to the sequence count ", n);
    MOE_CHECK(k < d - 1 || v == n, "Megatron index '", idx, "': the last document index, document_indices[", k,
              "] = ", v, " (byte offset ", at, "), is not the sequence count ", n);
    prev = v;
  }
  seg.elem = dtype->elem;
  seg.format = std::string("megatron ") + dtype->name;
  seg.data_offset = 0;
  seg.num_tokens = end / width;
}

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// A Megatron dataset named by its prefix (no file of that name, PREFIX.bin or PREFIX.idx exists),
// its .idx, or its .bin with the .idx beside it. A .bin without an .idx is a headerless file.
struct MegatronPaths {
  std::string bin, idx;
};
std::optional<MegatronPaths> megatron_paths(const std::string& path) {
  const auto stem = [&] { return path.substr(0, path.size() - 4); };
  if (ends_with(path, ".idx")) return MegatronPaths{stem() + ".bin", path};
  if (ends_with(path, ".bin")) {
    if (path_exists(stem() + ".idx")) return MegatronPaths{path, stem() + ".idx"};
    return std::nullopt;
  }
  if (!path_exists(path) && (path_exists(path + ".bin") || path_exists(path + ".idx")))
    return MegatronPaths{path + ".bin", path + ".idx"};
  return std::nullopt;
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
    case Elem::kI8: return f(int8_t{});
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
    Segment seg;
    const uint8_t* bytes = nullptr;
    if (const std::optional<MegatronPaths> mp = megatron_paths(path)) {
      for (const std::string* f : {&mp->idx, &mp->bin})
        MOE_CHECK(path_exists(*f), "Megatron dataset '", path, "': '", *f, "' not found (", std::strerror(errno),
                  "); a Megatron-Core indexed dataset is PREFIX.bin and PREFIX.idx side by side");
      int64_t idx_size = 0, bin_size = 0;
      const std::unique_ptr<Mapping> idx = map_file(mp->idx, &idx_size);
      state->mappings.push_back(map_file(mp->bin, &bin_size));
      bytes = static_cast<const uint8_t*>(state->mappings.back()->addr);
      seg.name = mp->bin;
      parse_megatron(static_cast<const uint8_t*>(idx->addr), idx_size, mp->idx, bin_size, seg);
    } else {
      MOE_CHECK(path_exists(path) || errno != ENOENT, "cannot open token file '", path, "': ", std::strerror(ENOENT),
                ", nor is it the prefix of a Megatron dataset (no '", path, ".bin' or '", path,
                ".idx'); check [data] paths");
      int64_t size = 0;
      state->mappings.push_back(map_file(path, &size));
      bytes = static_cast<const uint8_t*>(state->mappings.back()->addr);
      seg.name = path;
      if (has_npy_magic(bytes, size)) {
        parse_npy(bytes, size, seg);
      } else if (!parse_llmc(bytes, size, seg)) {
        MOE_CHECK(!has_megatron_magic(bytes, size), "token file '", path,
                  "' is a Megatron index (magic \"MMIDIDX\\x00\\x00\"); name its dataset by the prefix of "
                  "PREFIX.idx and PREFIX.bin (or name PREFIX.idx) in [data] paths");
        MOE_CHECK(size % raw_size == 0, "truncated token file '", path, "': ", size,
                  " bytes is not a multiple of ", raw_size, " (", token_dtype,
                  "); the last whole token ends at byte offset ", size - size % raw_size,
                  " (wrong token_dtype, or an interrupted write?)");
        seg.elem = raw_elem;
        seg.format = "raw " + token_dtype;
        seg.data_offset = 0;
        seg.num_tokens = size / raw_size;
      }
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
