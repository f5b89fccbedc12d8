// Embedded corpus generator and byte-level tokenizer. Each document draws from its own
// std::mt19937_64 seeded by mix_seed(mix_seed(seed, split tag), index), with integer ranges by
// rejection (uniform_below), so the text is identical on every machine and compiler. Documents
// mix context-free templates with parts that only context predicts (a name introduced first,
// codes defined then recalled, a packed list repeated, sums of the operands just read).
#include "data/embedded.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <memory>

#include "core/error.h"
#include "core/signals.h"
#include "data/dataset.h"
#include "data/token_file.h"

namespace moe {
namespace {

struct Noun {
  const char* one;
  const char* many;
};

constexpr Noun kAgents[] = {{"cat", "cats"},       {"dog", "dogs"},         {"bird", "birds"},
                            {"fox", "foxes"},      {"child", "children"},   {"horse", "horses"},
                            {"mouse", "mice"},     {"owl", "owls"},         {"teacher", "teachers"},
                            {"farmer", "farmers"}, {"sailor", "sailors"},   {"robot", "robots"}};
constexpr Noun kThings[] = {{"ball", "balls"},   {"apple", "apples"},     {"box", "boxes"},
                            {"tree", "trees"},   {"house", "houses"},     {"river", "rivers"},
                            {"book", "books"},   {"cup", "cups"},         {"egg", "eggs"},
                            {"ship", "ships"},   {"lamp", "lamps"},       {"orange", "oranges"},
                            {"umbrella", "umbrellas"}, {"hat", "hats"},   {"letter", "letters"},
                            {"stone", "stones"}};
struct Verb {
  const char* one;   // third person singular
  const char* many;  // plural
};
constexpr Verb kVerbs[] = {{"sees", "see"},       {"likes", "like"},     {"finds", "find"},
                           {"wants", "want"},     {"holds", "hold"},     {"watches", "watch"},
                           {"carries", "carry"},  {"paints", "paint"},   {"follows", "follow"},
                           {"has", "have"},       {"brings", "bring"},   {"loses", "lose"}};
constexpr const char* kAdjectives[] = {"small", "big",  "red",    "green", "old",   "new",
                                       "happy", "quiet", "bright", "dark", "empty", "yellow",
                                       "blue",  "soft",  "heavy",  "orange"};
constexpr const char* kPlaces[] = {"garden", "forest", "city",   "village",
                                   "market", "school", "harbor", "valley"};
constexpr const char* kKeys[] = {"alpha", "beta",  "gamma", "delta", "omega",
                                 "zeta",  "sigma", "kappa", "theta", "lambda"};
constexpr const char* kAttributes[] = {"code", "number", "price"};
constexpr const char* kNumberWords[] = {"two", "three", "four", "five", "six"};
constexpr const char* kOnsets[] = {"b", "d", "f", "g", "k", "l", "m", "n", "p", "r",
                                   "s", "t", "v", "z", "br", "tr", "st", "kl"};
constexpr const char* kVowels[] = {"a", "e", "i", "o", "u", "ai", "ea"};

bool starts_with_vowel(const char* w) {
  const char c = w[0];
  return c == 'a' || c == 'e' || c == 'i' || c == 'o' || c == 'u';
}

// Writes one document into `out` from its own generator.
class DocumentWriter {
 public:
  explicit DocumentWriter(uint64_t doc_seed) : rng_(doc_seed) {}

  std::string write() {
    // Context that later sentences refer back to.
    name_ = make_name();
    const int64_t num_codes = 1 + pick(3);
    // Distinct keys, so each (attribute, key) has one value in the document.
    int64_t key = pick(std::size(kKeys));
    for (int64_t i = 0; i < num_codes; ++i) {
      key = (key + 1 + pick(3)) % static_cast<int64_t>(std::size(kKeys));
      codes_.push_back({kKeys[key], kAttributes[pick(std::size(kAttributes))],
                        static_cast<int>(100 + pick(900))});
    }
    const int64_t num_items = 2 + pick(3);
    for (int64_t i = 0; i < num_items; ++i) items_.push_back(pick(std::size(kThings)));

    sentence_start();
    if (pick(2)) {
      put("This is a story about ");
      put(name_);
      put(".");
    } else {
      put(name_);
      put(" lives in the ");
      put(kPlaces[pick(std::size(kPlaces))]);
      put(".");
    }
    for (const Code& c : codes_) {
      sentence_start();
      put("The ");
      put(c.attribute);
      put(" of ");
      put(c.key);
      put(" is ");
      put(std::to_string(c.value));
      put(".");
    }
    sentence_start();
    put(name_);
    put(" packs ");
    put_item_list();
    put(".");
    out_ += '\n';
    first_in_paragraph_ = true;

    const int64_t num_sentences = 5 + pick(8);
    bool list_repeated = false;
    for (int64_t i = 0; i < num_sentences; ++i) {
      if (i > 0 && pick(4) == 0) {
        out_ += '\n';
        first_in_paragraph_ = true;
      }
      switch (pick(9)) {
        case 0: case 1: simple_sentence(); break;
        case 2: name_sentence(); break;
        case 3: arithmetic(); break;
        case 4: counting(); break;
        case 5: spelling(); break;
        case 6: case 7: recall(); break;
        default:
          list_sentence();
          list_repeated = true;
          break;
      }
    }
    if (!list_repeated) list_sentence();
    recall();
    sentence_start();
    put("The end.");
    return std::move(out_);
  }

 private:
  struct Code {
    const char* key;
    const char* attribute;
    int value;
  };

  int64_t pick(uint64_t n) { return static_cast<int64_t>(uniform_below(rng_, n)); }
  // Literal text (already capitalised where it starts a sentence).
  void put(const char* s) {
    out_ += s;
    capitalize_ = false;
  }
  void put(const std::string& s) {
    out_ += s;
    capitalize_ = false;
  }
  void sentence_start() {
    if (!first_in_paragraph_) out_ += ' ';
    first_in_paragraph_ = false;
    capitalize_ = true;
  }
  // First word of a sentence: capitalised.
  void put_word(const char* w) {
    if (capitalize_) {
      out_ += static_cast<char>(w[0] - 'a' + 'A');
      out_ += w + 1;
      capitalize_ = false;
    } else {
      out_ += w;
    }
  }

  std::string make_name() {
    std::string n;
    const int64_t syllables = 2 + pick(2);
    for (int64_t i = 0; i < syllables; ++i) {
      n += kOnsets[pick(std::size(kOnsets))];
      n += kVowels[pick(std::size(kVowels))];
    }
    if (pick(2)) n += "n";
    n[0] = static_cast<char>(n[0] - 'a' + 'A');
    return n;
  }

  // "the old cat", "a bright egg", "an orange box", "three dogs", "the happy children".
  // Returns whether the phrase is plural.
  bool noun_phrase(const Noun& noun, bool allow_plural) {
    const bool plural = allow_plural && pick(3) == 0;
    const bool adjective = pick(2) == 0;
    const char* adj = adjective ? kAdjectives[pick(std::size(kAdjectives))] : nullptr;
    const char* head = plural ? noun.many : noun.one;
    const char* next = adj ? adj : head;
    if (plural) {
      put_word(pick(2) ? "the" : kNumberWords[pick(std::size(kNumberWords))]);
    } else if (pick(2)) {
      put_word("the");
    } else {
      put_word(starts_with_vowel(next) ? "an" : "a");
    }
    out_ += ' ';
    if (adj) {
      put(adj);
      out_ += ' ';
    }
    put(head);
    return plural;
  }

  void simple_sentence() {
    sentence_start();
    const bool plural = noun_phrase(kAgents[pick(std::size(kAgents))], true);
    const Verb& v = kVerbs[pick(std::size(kVerbs))];
    out_ += ' ';
    put(plural ? v.many : v.one);
    out_ += ' ';
    noun_phrase(kThings[pick(std::size(kThings))], true);
    if (pick(3) == 0) {
      put(" in the ");
      put(kPlaces[pick(std::size(kPlaces))]);
    }
    put(".");
  }

  void name_sentence() {
    sentence_start();
    const Verb& v = kVerbs[pick(std::size(kVerbs))];
    if (pick(2)) {
      put(name_);
      out_ += ' ';
      put(v.one);
      out_ += ' ';
      noun_phrase(kThings[pick(std::size(kThings))], true);
    } else {
      const bool plural = noun_phrase(kAgents[pick(std::size(kAgents))], true);
      out_ += ' ';
      put(plural ? v.many : v.one);
      out_ += ' ';
      put(name_);
    }
    put(".");
  }

  void arithmetic() {
    sentence_start();
    const int64_t a = pick(100), b = pick(100);
    switch (pick(3)) {
      case 0:
        put(std::to_string(a) + " + " + std::to_string(b) + " = " + std::to_string(a + b) + ".");
        break;
      case 1: {
        const int64_t hi = std::max(a, b), lo = std::min(a, b);
        put(std::to_string(hi) + " - " + std::to_string(lo) + " = " + std::to_string(hi - lo) + ".");
        break;
      }
      default: {
        const int64_t x = 1 + pick(12), y = 1 + pick(12);
        put(std::to_string(x) + " x " + std::to_string(y) + " = " + std::to_string(x * y) + ".");
        break;
      }
    }
  }

  void counting() {
    sentence_start();
    const int64_t from = pick(90), len = 4 + pick(4);
    put(name_);
    put(" counts from " + std::to_string(from) + " to " + std::to_string(from + len - 1) + ":");
    for (int64_t i = 0; i < len; ++i) put(std::string(" ").append(std::to_string(from + i)));
    put(".");
  }

  void spelling() {
    sentence_start();
    const char* w = pick(2) ? kThings[pick(std::size(kThings))].one : kPlaces[pick(std::size(kPlaces))];
    put_word("spell");
    put(" ");
    put(w);
    put(":");
    for (const char* c = w; *c; ++c) {
      out_ += c == w ? ' ' : '-';
      out_ += *c;
    }
    put(".");
  }

  void recall() {
    const Code& c = codes_[pick(codes_.size())];
    sentence_start();
    if (pick(2)) {
      put("What is the ");
      put(c.attribute);
      put(" of ");
      put(c.key);
      put("? It is ");
    } else {
      put("Remember, the ");
      put(c.attribute);
      put(" of ");
      put(c.key);
      put(" is ");
    }
    put(std::to_string(c.value));
    put(".");
  }

  void list_sentence() {
    sentence_start();
    put(pick(2) ? "Later " : "At home ");
    put(name_);
    put(" unpacks ");
    put_item_list();
    put(".");
  }

  // "a cup, an egg and a lamp": the document's items in their fixed order.
  void put_item_list() {
    for (size_t i = 0; i < items_.size(); ++i) {
      if (i > 0) put(i + 1 == items_.size() ? " and " : ", ");
      const char* w = kThings[items_[i]].one;
      put(starts_with_vowel(w) ? "an " : "a ");
      put(w);
    }
  }

  std::mt19937_64 rng_;
  std::string out_;
  std::string name_;
  std::vector<Code> codes_;
  std::vector<int64_t> items_;
  bool first_in_paragraph_ = true;
  bool capitalize_ = false;
};

uint64_t split_tag(const std::string& split) {
  if (split == "train") return 0x747261696e;  // "train"
  if (split == "eval") return 0x6576616c;     // "eval"
  MOE_FAIL("embedded corpus split must be \"train\" or \"eval\", got \"", split, "\"");
}

}  // namespace

std::string embedded_document(const std::string& split, int64_t index, uint64_t seed) {
  MOE_CHECK(index >= 0, "embedded document index must be >= 0, got ", index);
  const uint64_t split_seed = mix_seed(seed, split_tag(split));
  return DocumentWriter(mix_seed(split_seed, static_cast<uint64_t>(index))).write();
}

std::vector<uint32_t> embedded_corpus(const std::string& split, int64_t num_tokens, uint64_t seed) {
  MOE_CHECK(num_tokens >= 0, "embedded corpus size must be >= 0 tokens, got ", num_tokens);
  std::vector<uint32_t> out;
  out.reserve(static_cast<size_t>(num_tokens));
  for (int64_t doc = 0; static_cast<int64_t>(out.size()) < num_tokens; ++doc) {
    const std::string text = embedded_document(split, doc, seed);
    for (const char c : text) {
      if (static_cast<int64_t>(out.size()) == num_tokens) break;
      out.push_back(static_cast<uint8_t>(c));
    }
    if (static_cast<int64_t>(out.size()) < num_tokens) out.push_back(kEmbeddedEosId);
  }
  return out;
}

namespace {

std::string errno_text() { return std::strerror(errno); }

// Creates `output`.tmp.<pid>.<n> in the output's directory with O_EXCL (never an existing file);
// mode 0666 less the umask, as a plain fopen would give the output.
int create_temporary(const std::string& output, std::string* tmp) {
  for (int n = 0;; ++n) {
    *tmp = output + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(n);
    const int fd = ::open(tmp->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) return fd;
    MOE_CHECK(errno == EEXIST && n < 1000, "tokenize: cannot create the temporary file '", *tmp, "' beside '",
              output, "': ", errno_text());
  }
}

}  // namespace

void tokenize_text_files(const std::vector<std::string>& inputs, const std::string& output,
                         const std::string& token_dtype, int64_t eos_id) {
  MOE_CHECK(!inputs.empty(), "tokenize: no input text files given");
  MOE_CHECK(!output.empty(), "tokenize: no output file given");
  const int64_t width = token_dtype_size(token_dtype);
  const int64_t max_id = width == 2 ? 0xFFFF : 0x7FFFFFFF;
  MOE_CHECK(eos_id >= 0 && eos_id <= max_id, "eos_id must be in [0, ", max_id, "] for token_dtype ",
            token_dtype, ", got ", eos_id);

  // The output may exist (it is replaced when the new one is complete) but must be a regular file
  // and none of the inputs, by identity (device, inode): a link or another spelling counts.
  struct stat out_st {};
  const bool out_exists = ::stat(output.c_str(), &out_st) == 0;
  MOE_CHECK(!out_exists || S_ISREG(out_st.st_mode), "tokenize: output '", output, "' exists and is not a regular ",
            "file", S_ISDIR(out_st.st_mode) ? " (a directory)" : "", "; name the file to write");
  for (const std::string& path : inputs) {
    struct stat st {};
    MOE_CHECK(::stat(path.c_str(), &st) == 0, "tokenize: cannot open input text file '", path, "': ", errno_text());
    MOE_CHECK(!S_ISDIR(st.st_mode), "tokenize: input '", path, "' is a directory; list the text files in it");
    MOE_CHECK(!(out_exists && st.st_dev == out_st.st_dev && st.st_ino == out_st.st_ino), "tokenize: output '", output,
              "' is the input '", path, "' (the same file); writing it would replace the text with its tokens: "
              "choose another --out");
  }

  std::string tmp;
  const int fd = create_temporary(output, &tmp);
  struct RemoveOnError {
    const std::string& path;
    bool done = false;
    ~RemoveOnError() {
      if (!done) std::remove(path.c_str());
    }
  } cleanup{tmp};
  auto close_file = [](std::FILE* f) {
    if (f) std::fclose(f);
  };
  std::unique_ptr<std::FILE, decltype(close_file)> out(::fdopen(fd, "wb"), close_file);
  if (!out) ::close(fd);
  MOE_CHECK(out, "tokenize: cannot write '", tmp, "': ", errno_text());

  constexpr size_t kChunk = size_t{1} << 20;
  std::vector<uint8_t> bytes(kChunk);
  std::vector<uint8_t> encoded(kChunk * static_cast<size_t>(width));
  auto encode = [&](const uint32_t id, uint8_t* dst) {
    for (int64_t b = 0; b < width; ++b) dst[b] = static_cast<uint8_t>(id >> (8 * b));
  };
  for (const std::string& path : inputs) {
    std::unique_ptr<std::FILE, decltype(close_file)> in(std::fopen(path.c_str(), "rb"), close_file);
    MOE_CHECK(in, "tokenize: cannot open input text file '", path, "': ", errno_text());
    int64_t offset = 0;
    for (;;) {
      // Ctrl-C / SIGTERM (while the command holds a StopSignals): stop here; the temporary goes.
      MOE_CHECK(StopSignals::requested() == 0, "tokenize: stopped by ", StopSignals::name(StopSignals::requested()),
                "; '", output, "' was not written");
      const size_t got = std::fread(bytes.data(), 1, kChunk, in.get());
      MOE_CHECK(!std::ferror(in.get()), "tokenize: read error in '", path, "' at byte offset ", offset);
      for (size_t i = 0; i < got; ++i) {
        MOE_CHECK(bytes[i] != eos_id, "tokenize: input '", path, "' contains byte ",
                  static_cast<int>(bytes[i]), " = eos_id at byte offset ", offset + static_cast<int64_t>(i),
                  "; byte-level documents must not contain the EOS id (remove it, or pick an eos_id >= 256 "
                  "and a vocab_size above it)");
        encode(bytes[i], encoded.data() + i * width);
      }
      MOE_CHECK(std::fwrite(encoded.data(), static_cast<size_t>(width), got, out.get()) == got,
                "tokenize: write error on '", tmp, "': ", errno_text());
      offset += static_cast<int64_t>(got);
      if (got < kChunk) break;
    }
    encode(static_cast<uint32_t>(eos_id), encoded.data());
    MOE_CHECK(std::fwrite(encoded.data(), static_cast<size_t>(width), 1, out.get()) == 1,
              "tokenize: write error on '", tmp, "': ", errno_text());
  }
  // Complete on disk before it takes the output's name.
  MOE_CHECK(std::fflush(out.get()) == 0 && ::fsync(::fileno(out.get())) == 0, "tokenize: cannot finish writing '",
            tmp, "': ", errno_text());
  MOE_CHECK(std::fclose(out.release()) == 0, "tokenize: cannot finish writing '", tmp, "': ", errno_text());
  MOE_CHECK(std::rename(tmp.c_str(), output.c_str()) == 0, "tokenize: cannot rename '", tmp, "' to '", output, "': ",
            errno_text());
  cleanup.done = true;
}

}  // namespace moe
