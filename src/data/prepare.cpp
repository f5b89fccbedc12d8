// prepare_data: the reader (this thread) cuts the inputs into batches of whole lines (about
// 1 MiB of text each; a whole .txt file is one batch), worker threads tokenize batches, and this
// thread writes finished batches strictly in batch order into each input's temporary .npy (a
// 128-byte header rewritten with the final count when the file is done). At most 2 x jobs + 2
// batches are in flight. The first error in input order wins (a worker's error is raised when
// its batch's turn to be written comes), so the message does not depend on the thread count.
#include "data/prepare.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/signals.h"

#if MOECORE_HAS_TOKENIZER
#include "data/tokenizer.h"
#endif

namespace moe {

const std::vector<std::string>& eos_token_names() {
  static const std::vector<std::string> names = {"<|endoftext|>", "<|end_of_text|>", "</s>",   "<eos>",
                                                 "<|eos|>",       "[EOS]",           "<|im_end|>"};
  return names;
}

#if !MOECORE_HAS_TOKENIZER

PrepareResult prepare_data(const std::vector<std::string>&, const PrepareOptions&, std::ostream&) {
  MOE_FAIL("data prepare: this build of moecore has no tokenizer: PCRE2 and ICU were not found when it was ",
           "configured (CMake said 'Tokenizer: OFF'); install libpcre2-dev and libicu-dev (scripts/setup.sh), ",
           "configure again and rebuild");
}

#else

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr size_t kBatchBytes = size_t{1} << 20;
constexpr size_t kReadChunk = size_t{1} << 20;
constexpr size_t kNpyHeaderBytes = 128;  // magic, version, length and the padded dict: a multiple of 64

std::string errno_text() { return std::strerror(errno); }

enum class InputKind { kJsonl, kJsonlGz, kText };

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The kind by suffix and the stem the output is named after.
InputKind kind_of(const std::string& path, std::string* stem) {
  const std::string name = fs::path(path).filename().string();
  static const std::pair<std::string, InputKind> kSuffixes[] = {
      {".jsonl.gz", InputKind::kJsonlGz}, {".jsonl", InputKind::kJsonl}, {".txt", InputKind::kText}};
  for (const auto& [suffix, kind] : kSuffixes) {
    if (ends_with(name, suffix) && name.size() > suffix.size()) {
      *stem = name.substr(0, name.size() - suffix.size());
      return kind;
    }
  }
  MOE_FAIL("data prepare: input '", path, "': expected a .jsonl, .jsonl.gz or .txt file");
}

// One input read in chunks: plain files with read(2) (FIFOs too), .gz through zlib (gzread
// reads concatenated gzip members and plain bytes alike, so the suffix is checked by the magic).
class InputReader {
 public:
  InputReader(const std::string& path, bool gz) : path_(path), gz_(gz) {
    struct stat st {};
    MOE_CHECK(::stat(path.c_str(), &st) == 0, "data prepare: cannot open input '", path, "': ", errno_text());
    MOE_CHECK(!S_ISDIR(st.st_mode), "data prepare: input '", path, "' is a directory; list its files ",
              "(e.g. DIR/*.jsonl)");
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    MOE_CHECK(fd_ >= 0, "data prepare: cannot open input '", path, "': ", errno_text());
    if (gz_) {
      unsigned char magic[2] = {0, 0};
      const ssize_t got = ::pread(fd_, magic, 2, 0);
      MOE_CHECK(got == 2 && magic[0] == 0x1f && magic[1] == 0x8b, "data prepare: input '", path,
                "' is named .gz but is not gzip data (no 1f 8b magic at byte 0)");
      gz_file_ = gzdopen(fd_, "rb");
      MOE_CHECK(gz_file_ != nullptr, "data prepare: cannot read gzip input '", path, "'");
      fd_ = -1;  // owned by zlib now
      gzbuffer(gz_file_, 1 << 18);
    }
  }
  ~InputReader() {
    if (gz_file_) gzclose(gz_file_);
    if (fd_ >= 0) ::close(fd_);
  }
  InputReader(const InputReader&) = delete;
  InputReader& operator=(const InputReader&) = delete;

  // Appends up to n bytes to `out`; returns how many (0 at the end).
  size_t read(std::string& out, size_t n) {
    const size_t old = out.size();
    out.resize(old + n);
    size_t got = 0;
    if (gz_) {
      const int r = gzread(gz_file_, out.data() + old, static_cast<unsigned>(n));
      if (r < 0) {
        int err = 0;
        const char* msg = gzerror(gz_file_, &err);
        MOE_FAIL("data prepare: gzip input '", path_, "' is corrupt or truncated after ", text_bytes_,
                 " bytes of text: ", msg ? msg : "zlib error");
      }
      got = static_cast<size_t>(r);
      int err = Z_OK;
      const char* msg = gzerror(gz_file_, &err);
      MOE_CHECK(err == Z_OK, "data prepare: gzip input '", path_, "' is corrupt or truncated after ", text_bytes_ + r,
                " bytes of text: ", msg ? msg : "zlib error");
      MOE_CHECK(got > 0 || gzeof(gz_file_), "data prepare: read error in gzip input '", path_, "'");
      compressed_ = gzoffset(gz_file_);
    } else {
      for (;;) {
        const ssize_t r = ::read(fd_, out.data() + old, n);
        if (r < 0 && errno == EINTR) continue;
        MOE_CHECK(r >= 0, "data prepare: read error in '", path_, "' at byte offset ", text_bytes_, ": ", errno_text());
        got = static_cast<size_t>(r);
        break;
      }
      compressed_ += static_cast<int64_t>(got);
    }
    out.resize(old + got);
    text_bytes_ += static_cast<int64_t>(got);
    return got;
  }
  // Bytes of the file consumed so far (compressed for .gz): progress against its size.
  int64_t file_bytes_read() const { return compressed_; }

 private:
  std::string path_;
  bool gz_;
  int fd_ = -1;
  gzFile gz_file_ = nullptr;
  int64_t text_bytes_ = 0, compressed_ = 0;
};

// A unit of work: whole lines of one input (or a whole .txt file), and what tokenizing made of it.
struct TextBatch {
  size_t file = 0;
  int64_t first_line = 1;            // line number of the first line (1-based)
  bool whole_file = false;           // a .txt read as one document
  bool last = false;                 // the input's last batch
  std::string text;                  // the lines, each ending in '\n' (the last maybe not)
  // Filled by a worker:
  std::vector<uint32_t> tokens;
  int64_t documents = 0;
  std::string error;
  bool done = false;
};

struct Job {
  const Tokenizer* tok = nullptr;
  std::vector<std::string> inputs;
  std::vector<InputKind> kinds;
  std::string text_key;
  bool lines = false;
  uint32_t eos = 0;
};

// "file:line: " for messages.
std::string where(const Job& job, const TextBatch& b, int64_t line) {
  if (b.whole_file) return job.inputs[b.file];
  return job.inputs[b.file] + ":" + std::to_string(line);
}

const char* json_type_name(const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null:
      return "null";
    case nlohmann::json::value_t::boolean:
      return "a boolean";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned:
    case nlohmann::json::value_t::number_float:
      return "a number";
    case nlohmann::json::value_t::array:
      return "an array";
    case nlohmann::json::value_t::object:
      return "an object";
    default:
      return "a string";
  }
}

void encode_document(const Job& job, const TextBatch& b, int64_t line, std::string_view text, TextBatch& out) {
  try {
    job.tok->encode(text, out.tokens);
  } catch (const Error& e) {
    MOE_FAIL(where(job, b, line), ": ", e.what());
  }
  out.tokens.push_back(job.eos);
  ++out.documents;
}

// Tokenizes a batch in place; an error is kept in b.error (the first in the batch).
void tokenize_batch(const Job& job, TextBatch& b) {
  try {
    if (b.whole_file) {
      encode_document(job, b, 0, b.text, b);
      return;
    }
    const InputKind kind = job.kinds[b.file];
    size_t at = 0;
    int64_t line = b.first_line;
    while (at < b.text.size()) {
      size_t end = b.text.find('\n', at);
      if (end == std::string::npos) end = b.text.size();
      std::string_view l(b.text.data() + at, end - at);
      if (!l.empty() && l.back() == '\r') l.remove_suffix(1);
      const bool blank = l.find_first_not_of(" \t") == std::string_view::npos;
      if (!blank) {
        if (kind == InputKind::kText) {
          encode_document(job, b, line, l, b);
        } else {
          nlohmann::json obj;
          try {
            obj = nlohmann::json::parse(l);
          } catch (const nlohmann::json::exception& e) {
            MOE_FAIL(where(job, b, line), ": not valid JSON: ", e.what());
          }
          MOE_CHECK(obj.is_object(), where(job, b, line), ": expected a JSON object with the text key \"",
                    job.text_key, "\", got ", json_type_name(obj));
          const auto it = obj.find(job.text_key);
          if (it == obj.end()) {
            std::string keys;
            for (auto k = obj.begin(); k != obj.end() && keys.size() < 200; ++k) keys += (keys.empty() ? "" : ", ") + k.key();
            MOE_FAIL(where(job, b, line), ": the object has no key \"", job.text_key, "\" (--text-key); its keys: ",
                     keys.empty() ? "none" : keys);
          }
          MOE_CHECK(it->is_string(), where(job, b, line), ": key \"", job.text_key, "\" holds ", json_type_name(*it),
                    "; expected a string");
          encode_document(job, b, line, it->get_ref<const std::string&>(), b);
        }
      }
      at = end + 1;
      ++line;
    }
  } catch (const std::exception& e) {
    b.error = e.what();
    b.tokens.clear();
  }
}

// Worker threads over a queue of batches; stop() (also the destructor) joins them.
class Workers {
 public:
  Workers(const Job& job, int64_t n) : job_(job) {
    for (int64_t i = 0; i < n; ++i) threads_.emplace_back([this] { run(); });
  }
  ~Workers() { stop(); }
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;

  void push(std::shared_ptr<TextBatch> b) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(b));
    }
    work_cv_.notify_one();
  }
  // Waits until `b` is done or `timeout` passes; returns whether it is done.
  bool wait_done(const TextBatch& b, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return done_cv_.wait_for(lock, timeout, [&] { return b.done; });
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
      queue_.clear();
    }
    work_cv_.notify_all();
    for (std::thread& t : threads_)
      if (t.joinable()) t.join();
    threads_.clear();
  }

 private:
  void run() {
    for (;;) {
      std::shared_ptr<TextBatch> b;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [&] { return closing_ || !queue_.empty(); });
        if (closing_) return;
        b = std::move(queue_.front());
        queue_.pop_front();
      }
      tokenize_batch(job_, *b);
      {
        std::lock_guard<std::mutex> lock(mu_);
        b->done = true;
      }
      done_cv_.notify_all();
    }
  }

  const Job& job_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::shared_ptr<TextBatch>> queue_;
  bool closing_ = false;
  std::vector<std::thread> threads_;
};

// "<dir>/.<name>.tmp.<pid>.<n>", created with O_EXCL (never an existing file).
int create_temporary(const fs::path& target, std::string* tmp) {
  for (int n = 0;; ++n) {
    *tmp = (target.parent_path() / ("." + target.filename().string() + ".tmp." + std::to_string(::getpid()) + "." +
                                    std::to_string(n)))
               .string();
    const int fd = ::open(tmp->c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) return fd;
    MOE_CHECK(errno == EEXIST && n < 1000, "data prepare: cannot create a temporary file '", *tmp, "' in '",
              target.parent_path().string(), "': ", errno_text());
  }
}

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    MOE_CHECK(w > 0, "data prepare: write error on '", path, "': ", errno_text());
    p += w;
    n -= static_cast<size_t>(w);
  }
}

// The NumPy 1.0 header of a 1-D little-endian array of `count` items, kNpyHeaderBytes long.
std::string npy_header(const std::string& descr, int64_t count) {
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" + std::to_string(count) + ",), }";
  const size_t dict_len = kNpyHeaderBytes - 10;
  MOE_CHECK(dict.size() + 1 <= dict_len, "npy header too long for ", count, " items");
  dict.append(dict_len - 1 - dict.size(), ' ');
  dict += '\n';
  std::string h = "\x93NUMPY";
  h += '\x01';
  h += '\x00';
  h += static_cast<char>(dict_len & 0xff);
  h += static_cast<char>(dict_len >> 8);
  return h + dict;
}

// Temporaries of one run: removed unless published.
class Outputs {
 public:
  ~Outputs() {
    if (fd_ >= 0) ::close(fd_);
    if (!published_)
      for (const auto& [tmp, final_path] : staged_) std::remove(tmp.c_str());
  }

  void open(const fs::path& target, const std::string& descr) {
    std::string tmp;
    fd_ = create_temporary(target, &tmp);
    staged_.emplace_back(tmp, target.string());
    descr_ = descr;
    count_ = 0;
    const std::string h = npy_header(descr_, 0);
    write_all(fd_, h.data(), h.size(), tmp);
  }
  void append(const std::vector<uint32_t>& tokens, bool u16) {
    static_assert(std::endian::native == std::endian::little, "token files are written little-endian");
    const std::string& tmp = staged_.back().first;
    if (u16) {
      buf16_.resize(tokens.size());
      for (size_t i = 0; i < tokens.size(); ++i) buf16_[i] = static_cast<uint16_t>(tokens[i]);
      write_all(fd_, buf16_.data(), buf16_.size() * 2, tmp);
    } else {
      write_all(fd_, tokens.data(), tokens.size() * 4, tmp);
    }
    count_ += static_cast<int64_t>(tokens.size());
  }
  // The header with the final count, then flushed to disk and closed.
  void finish() {
    const std::string& tmp = staged_.back().first;
    const std::string h = npy_header(descr_, count_);
    MOE_CHECK(::pwrite(fd_, h.data(), h.size(), 0) == static_cast<ssize_t>(h.size()), "data prepare: write error on '",
              tmp, "': ", errno_text());
    MOE_CHECK(::fsync(fd_) == 0, "data prepare: cannot flush '", tmp, "' to disk: ", errno_text());
    MOE_CHECK(::close(fd_) == 0, "data prepare: cannot finish writing '", tmp, "': ", errno_text());
    fd_ = -1;
  }
  // A small file (summary.json) staged whole.
  void stage_text(const fs::path& target, const std::string& text) {
    std::string tmp;
    const int fd = create_temporary(target, &tmp);
    staged_.emplace_back(tmp, target.string());
    fd_ = fd;
    write_all(fd_, text.data(), text.size(), tmp);
    MOE_CHECK(::fsync(fd_) == 0, "data prepare: cannot flush '", tmp, "' to disk: ", errno_text());
    MOE_CHECK(::close(fd_) == 0, "data prepare: cannot finish writing '", tmp, "': ", errno_text());
    fd_ = -1;
  }
  // Renames every temporary to its name (summary.json, staged last, is renamed last).
  void publish(const fs::path& dir) {
    for (const auto& [tmp, final_path] : staged_)
      MOE_CHECK(std::rename(tmp.c_str(), final_path.c_str()) == 0, "data prepare: cannot rename '", tmp, "' to '",
                final_path, "': ", errno_text());
    published_ = true;
    const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
  }

 private:
  std::vector<std::pair<std::string, std::string>> staged_;  // (temporary, final path)
  int fd_ = -1;
  std::string descr_;
  int64_t count_ = 0;
  std::vector<uint16_t> buf16_;
  bool published_ = false;
};

std::string format_fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

// "12.3 s", "4 min 5 s", "2 h 3 min".
std::string format_duration(double s) {
  if (s < 60) return format_fixed(s, 0) + " s";
  if (s < 3600) return std::to_string(int64_t(s) / 60) + " min " + std::to_string(int64_t(s) % 60) + " s";
  return std::to_string(int64_t(s) / 3600) + " h " + std::to_string(int64_t(s) % 3600 / 60) + " min";
}

}  // namespace

PrepareResult prepare_data(const std::vector<std::string>& inputs, const PrepareOptions& opt, std::ostream& log) {
  const auto t0 = Clock::now();
  MOE_CHECK(!inputs.empty(), "data prepare: no inputs given (.jsonl, .jsonl.gz or .txt files)");
  MOE_CHECK(!opt.out_dir.empty(), "data prepare: --out needs a directory");
  MOE_CHECK(!opt.text_key.empty(), "data prepare: --text-key must not be empty");

  // Everything checked before anything is read or written.
  Job job;
  job.inputs = inputs;
  job.text_key = opt.text_key;
  job.lines = opt.lines;
  std::map<std::string, std::string> stems;  // stem -> input
  std::vector<std::string> stem_of(inputs.size());
  int64_t total_input_bytes = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    struct stat st {};
    MOE_CHECK(::stat(inputs[i].c_str(), &st) == 0, "data prepare: cannot open input '", inputs[i], "': ", errno_text());
    MOE_CHECK(!S_ISDIR(st.st_mode), "data prepare: input '", inputs[i], "' is a directory; list its files ",
              "(e.g. DIR/*.jsonl)");
    job.kinds.push_back(kind_of(inputs[i], &stem_of[i]));
    if (S_ISREG(st.st_mode)) total_input_bytes += st.st_size;
    const auto [it, fresh] = stems.emplace(stem_of[i], inputs[i]);
    MOE_CHECK(fresh, "data prepare: inputs '", it->second, "' and '", inputs[i], "' would both be written to '",
              stem_of[i], ".npy'; rename one or prepare them into different --out directories");
  }

  const Tokenizer tok = Tokenizer::from_file(opt.tokenizer);
  job.tok = &tok;
  PrepareResult res;
  res.vocab_size = tok.vocab_size();
  if (opt.eos_id) {
    MOE_CHECK(*opt.eos_id >= 0 && *opt.eos_id < res.vocab_size, "data prepare: --eos-id ", *opt.eos_id,
              " is not a token of '", opt.tokenizer, "': expected an id in [0, ", res.vocab_size, ")");
    res.eos_id = *opt.eos_id;
    for (const AddedToken& a : tok.added_tokens())
      if (a.id == res.eos_id) res.eos_token = a.content;
  } else {
    std::optional<uint32_t> found;
    for (const std::string& name : eos_token_names()) {
      for (const AddedToken& a : tok.added_tokens())
        if (!found && a.content == name) found = a.id, res.eos_token = name;
      if (found) break;
    }
    for (const std::string& name : eos_token_names()) {
      if (found) break;
      if (auto id = tok.token_to_id(name)) found = *id, res.eos_token = name;
    }
    std::string tried;
    for (const std::string& name : eos_token_names()) tried += (tried.empty() ? "" : ", ") + name;
    MOE_CHECK(found.has_value(), "data prepare: '", opt.tokenizer, "' has no end-of-document token under the usual ",
              "names (", tried, "); give its id with --eos-id N");
    res.eos_id = *found;
  }
  job.eos = static_cast<uint32_t>(res.eos_id);
  const bool u16 = res.vocab_size <= 65536;
  res.dtype = u16 ? "uint16" : "uint32";
  const std::string descr = u16 ? "<u2" : "<u4";
  res.jobs = opt.jobs > 0 ? opt.jobs : std::max<int64_t>(1, std::thread::hardware_concurrency());

  const fs::path dir(opt.out_dir);
  std::error_code ec;
  // A directory made here goes again unless the run completes (when it is still empty).
  struct RemoveIfMade {
    fs::path dir;
    bool made = false, keep = false;
    ~RemoveIfMade() {
      std::error_code e;
      if (made && !keep && fs::is_empty(dir, e)) fs::remove(dir, e);
    }
  } made_dir{dir, !fs::exists(dir)};
  fs::create_directories(dir, ec);
  MOE_CHECK(fs::is_directory(dir), "data prepare: cannot create the output directory '", opt.out_dir, "'",
            ec ? ": " + ec.message() : std::string());

  Outputs outputs;  // declared after made_dir (its temporaries go first) and before the workers: they stop first, then the temporaries go
  Workers workers(job, res.jobs);
  std::deque<std::shared_ptr<TextBatch>> in_flight;
  const size_t max_in_flight = static_cast<size_t>(2 * res.jobs + 2);
  int64_t bytes_done_files = 0;  // input bytes of the files read completely
  int64_t current_read = 0;      // of the file being read
  auto last_progress = Clock::now();
  res.files.resize(inputs.size());

  auto progress = [&](bool force) {
    if (!opt.progress) return;
    const auto now = Clock::now();
    if (!force && now - last_progress < std::chrono::milliseconds(500)) return;
    last_progress = now;
    const double s = std::chrono::duration<double>(now - t0).count();
    const double mbs = s > 0 ? double(res.bytes) / 1e6 / s : 0.0;
    std::string line = "\r\033[Kdata prepare: " + std::to_string(res.documents) + " documents, " +
                       std::to_string(res.tokens) + " tokens, " + format_fixed(mbs, 1) + " MB/s";
    const double frac = total_input_bytes > 0 ? double(bytes_done_files + current_read) / double(total_input_bytes) : 0;
    if (frac > 0.001 && frac <= 1) line += ", " + format_fixed(100 * frac, 0) + "%, ETA " + format_duration(s * (1 - frac) / frac);
    log << line << std::flush;
  };

  // Writes the oldest batch once it is done (true), or returns false after `wait` without it.
  size_t open_file = SIZE_MAX;
  auto write_front = [&](std::chrono::milliseconds wait) -> bool {
    const std::shared_ptr<TextBatch> b = in_flight.front();
    if (!workers.wait_done(*b, wait)) return false;
    in_flight.pop_front();
    if (!b->error.empty()) MOE_FAIL("data prepare: ", b->error);
    if (open_file != b->file) {
      outputs.open(dir / (stem_of[b->file] + ".npy"), descr);
      open_file = b->file;
    }
    outputs.append(b->tokens, u16);
    PreparedFile& f = res.files[b->file];
    f.documents += b->documents;
    f.tokens += static_cast<int64_t>(b->tokens.size());
    res.documents += b->documents;
    res.tokens += static_cast<int64_t>(b->tokens.size());
    if (b->last) outputs.finish();
    return true;
  };
  auto stopped = [&] { return (res.stopped_by = StopSignals::requested()) != 0; };
  // Hands a batch to the workers, writing finished ones while too many are in flight.
  auto submit = [&](std::shared_ptr<TextBatch> b) {
    res.bytes += static_cast<int64_t>(b->text.size());
    res.files[b->file].bytes += static_cast<int64_t>(b->text.size());
    in_flight.push_back(b);
    workers.push(std::move(b));
    while (!in_flight.empty() && (in_flight.size() >= max_in_flight || in_flight.front()->done)) {
      if (stopped()) return;
      write_front(std::chrono::milliseconds(100));
      progress(false);
    }
  };

  for (size_t i = 0; i < inputs.size() && !stopped(); ++i) {
    PreparedFile& f = res.files[i];
    f.input = inputs[i];
    f.output = (dir / (stem_of[i] + ".npy")).string();
    InputReader in(inputs[i], job.kinds[i] == InputKind::kJsonlGz);
    current_read = 0;
    const bool whole = job.kinds[i] == InputKind::kText && !opt.lines;
    auto batch = std::make_shared<TextBatch>();
    batch->file = i;
    batch->whole_file = whole;
    int64_t next_line = 1;
    for (;;) {
      if (stopped()) break;
      const size_t got = in.read(batch->text, kReadChunk);
      current_read = in.file_bytes_read();
      if (got == 0) break;
      if (whole || batch->text.size() < kBatchBytes) continue;
      // Hand over the whole lines; the partial last line starts the next batch.
      const size_t cut = batch->text.rfind('\n');
      if (cut == std::string::npos) continue;
      auto next = std::make_shared<TextBatch>();
      next->file = i;
      next->text.assign(batch->text, cut + 1, std::string::npos);
      batch->text.resize(cut + 1);
      batch->first_line = next_line;
      next_line += static_cast<int64_t>(std::count(batch->text.begin(), batch->text.end(), '\n'));
      submit(std::move(batch));
      batch = std::move(next);
      progress(false);
    }
    if (stopped()) break;
    batch->first_line = next_line;
    batch->last = true;
    submit(std::move(batch));
    bytes_done_files += current_read;
    current_read = 0;
  }
  while (!in_flight.empty() && !stopped()) {
    write_front(std::chrono::milliseconds(100));
    progress(false);
  }
  if (stopped()) {
    workers.stop();
    if (opt.progress) log << "\r\033[K" << std::flush;
    return res;  // ~Outputs removes the temporaries
  }
  workers.stop();

  nlohmann::json sources = nlohmann::json::array();
  for (const PreparedFile& f : res.files)
    sources.push_back({{"input", f.input},
                       {"output", fs::path(f.output).filename().string()},
                       {"documents", f.documents},
                       {"tokens", f.tokens},
                       {"text_bytes", f.bytes}});
  const nlohmann::json summary = {
      {"documents", res.documents},
      {"tokens", res.tokens},
      {"text_bytes", res.bytes},
      {"dtype", res.dtype},
      {"format", "npy " + descr},
      {"eos_id", res.eos_id},
      {"eos_token", res.eos_token},
      {"tokenizer", {{"path", opt.tokenizer}, {"sha256", opt.tokenizer_sha256}, {"vocab_size", res.vocab_size}}},
      {"text_key", opt.text_key},
      {"lines", opt.lines},
      {"sources", sources}};
  outputs.stage_text(dir / "summary.json", summary.dump(2) + "\n");
  outputs.publish(dir);
  made_dir.keep = true;
  res.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (opt.progress) {
    progress(true);
    log << "\n" << std::flush;
  }
  return res;
}

#endif  // MOECORE_HAS_TOKENIZER

}  // namespace moe
