// Checkpoint directory store. Save protocol: write every file into CKPT_DIR/.tmp-step_<N>-<pid>
// and fsync it, write manifest.json last and fsync the directory, rename it to step_<N>
// (renameat2 RENAME_EXCHANGE when step_<N> exists, so the name never disappears), fsync CKPT_DIR,
// then replace `latest` through latest.tmp + fsync + rename. A crash at any point leaves every
// complete step directory intact and `latest` naming one of them (or absent before the first).
#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "checkpoint/sha256.h"
#include "core/error.h"

namespace moe {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimFile = "optim.safetensors";
constexpr const char* kTrainStateFile = "train_state.json";
constexpr const char* kManifestFile = "manifest.json";
constexpr const char* kLatestFile = "latest";
constexpr const char* kTmpPrefix = ".tmp-";
constexpr int64_t kMaxTextFileBytes = int64_t(1) << 30;

std::string join(const std::string& dir, const std::string& name) { return (fs::path(dir) / name).string(); }

void fsync_path(const std::string& path, bool is_dir) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (is_dir ? O_DIRECTORY : 0));
  MOE_CHECK(fd >= 0, "cannot open '", path, "' to fsync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  MOE_CHECK(rc == 0, "fsync of '", path, "' failed: ", std::strerror(err));
}

void write_text_synced(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  MOE_CHECK(fd >= 0, "cannot create '", path, "': ", std::strerror(errno));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t put = ::write(fd, text.data() + done, text.size() - done);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) {
      const int err = errno;
      ::close(fd);
      MOE_FAIL("write to '", path, "' failed: ", std::strerror(err), " (is the disk full?)");
    }
    done += size_t(put);
  }
  const int rc = ::fsync(fd);
  const int err = errno;
  MOE_CHECK(::close(fd) == 0 && rc == 0, "fsync/close of '", path, "' failed: ", std::strerror(rc ? err : errno));
}

std::string read_text(const std::string& path) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  MOE_CHECK(!ec, "cannot read '", path, "': ", ec.message());
  MOE_CHECK(int64_t(size) <= kMaxTextFileBytes, "'", path, "' is ", size, " bytes; expected a small text file");
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), "cannot open '", path, "'");
  std::ostringstream os;
  os << in.rdbuf();
  MOE_CHECK(!in.bad(), "read error in '", path, "'");
  return os.str();
}

void rename_checked(const std::string& from, const std::string& to) {
  MOE_CHECK(::rename(from.c_str(), to.c_str()) == 0, "cannot rename '", from, "' to '", to, "': ",
            std::strerror(errno));
}

void remove_all_checked(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  MOE_CHECK(!ec, "cannot remove '", path, "': ", ec.message());
}

// "step_<N>" with N in canonical decimal (no sign, no leading zeros) -> N.
std::optional<int64_t> parse_step_name(std::string_view name) {
  constexpr std::string_view kPrefix = "step_";
  if (name.size() <= kPrefix.size() || name.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  const std::string_view digits = name.substr(kPrefix.size());
  if (digits.size() > 1 && digits[0] == '0') return std::nullopt;
  for (char c : digits)
    if (c < '0' || c > '9') return std::nullopt;
  int64_t step = 0;
  const auto [ptr, err] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  if (err != std::errc() || ptr != digits.data() + digits.size()) return std::nullopt;
  return step;
}

bool is_regular_file(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec);
}

bool is_directory(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec);
}

// Removes what interrupted saves and prunes leave behind: ".tmp-*" entries and latest.tmp.
void remove_stale(const std::string& ckpt_dir) {
  std::error_code ec;
  std::vector<std::string> stale;
  for (const auto& entry : fs::directory_iterator(ckpt_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(kTmpPrefix, 0) == 0 || name == std::string(kLatestFile) + ".tmp")
      stale.push_back(entry.path().string());
  }
  MOE_CHECK(!ec, "cannot list checkpoint directory '", ckpt_dir, "': ", ec.message());
  for (const auto& p : stale) remove_all_checked(p);
}

// Moves the finished temporary directory to `final_dir`. An existing final_dir is swapped out
// atomically (RENAME_EXCHANGE) and then deleted; filesystems without the exchange fall back
// to rename-aside + rename, which leaves a short window where final_dir is absent.
void publish_dir(const std::string& tmp_dir, const std::string& final_dir, const std::string& aside) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(final_dir, ec))) {
    rename_checked(tmp_dir, final_dir);
    return;
  }
  MOE_CHECK(is_directory(final_dir), "'", final_dir, "' exists and is not a directory; remove it");
  if (::renameat2(AT_FDCWD, tmp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    remove_all_checked(tmp_dir);  // now holds the replaced step
    return;
  }
  MOE_CHECK(errno == EINVAL || errno == ENOSYS || errno == ENOTSUP, "cannot exchange '", tmp_dir, "' with '",
            final_dir, "': ", std::strerror(errno));
  rename_checked(final_dir, aside);
  rename_checked(tmp_dir, final_dir);
  remove_all_checked(aside);
}

void prune(const std::string& ckpt_dir, int64_t saved_step, int64_t keep_last) {
  if (keep_last <= 0) return;
  std::vector<int64_t> others;
  for (int64_t s : list_steps(ckpt_dir))
    if (s != saved_step) others.push_back(s);
  std::sort(others.rbegin(), others.rend());
  bool removed = false;
  for (size_t i = size_t(keep_last - 1); i < others.size(); ++i) {
    const std::string name = step_dir_name(others[i]);
    // Rename first so that a crash mid-delete never leaves a half-deleted step_<N>.
    const std::string grave = join(ckpt_dir, kTmpPrefix + std::string("prune-") + name + "-" +
                                                 std::to_string(::getpid()));
    rename_checked(join(ckpt_dir, name), grave);
    remove_all_checked(grave);
    removed = true;
  }
  if (removed) fsync_path(ckpt_dir, true);
}

// File size and checksum entry for the manifest.
nlohmann::ordered_json file_entry(const std::string& path) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  MOE_CHECK(!ec, "cannot stat '", path, "': ", ec.message());
  nlohmann::ordered_json e;
  e["bytes"] = uint64_t(size);
  e["sha256"] = sha256_file(path);
  return e;
}

// A manifest value for an error message (flat values only; printing nested JSON recurses).
std::string describe(const json& v) {
  if (v.is_structured()) return std::string("a JSON ") + v.type_name();
  return v.dump(-1, ' ', false, json::error_handler_t::replace);
}

// Serialises JSON, turning nlohmann's errors (strings that are not UTF-8) into moe::Error.
template <typename Json>
std::string to_text(const Json& j, const std::string& what) {
  try {
    return j.dump(2) + "\n";
  } catch (const nlohmann::json::exception& e) {
    MOE_FAIL("cannot encode ", what, " as JSON: ", e.what());
  }
}

bool is_hex_digest(const std::string& s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

void read_checked(const SafetensorsFile& f, const std::string& name, const Shape& shape, float* out) {
  const TensorInfo* t = f.find(name);
  MOE_CHECK(t != nullptr, "tensor '", name, "' not found in '", f.path(), "'");
  MOE_CHECK(t->shape == shape, "tensor '", name, "' in '", f.path(), "' has shape ", shape_str(t->shape),
            ", expected ", shape_str(shape), " (does the config match the checkpoint?)");
  f.read_f32(name, out, shape_numel(shape));
}

}  // namespace

std::string step_dir_name(int64_t step) { return "step_" + std::to_string(step); }

std::vector<int64_t> list_steps(const std::string& ckpt_dir) {
  std::vector<int64_t> steps;
  if (!is_directory(ckpt_dir)) return steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(ckpt_dir, ec)) {
    const auto step = parse_step_name(entry.path().filename().string());
    if (step && is_directory(entry.path().string()) &&
        is_regular_file((entry.path() / kManifestFile).string()))
      steps.push_back(*step);
  }
  MOE_CHECK(!ec, "cannot list checkpoint directory '", ckpt_dir, "': ", ec.message());
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::string save_checkpoint(const std::string& ckpt_dir, int64_t step, const CheckpointFiles& files,
                            int64_t keep_last) {
  MOE_CHECK(step >= 0, "checkpoint step must be >= 0, got ", step);
  MOE_CHECK(files.train_state.is_object() || files.train_state.is_null(),
            "train_state must be a JSON object, got ", files.train_state.type_name());
  json train_state = files.train_state.is_null() ? json::object() : files.train_state;
  if (train_state.contains("step"))
    MOE_CHECK(train_state["step"] == step, "train_state step ", describe(train_state["step"]),
              " differs from the checkpoint step ", step);
  else
    train_state["step"] = step;

  std::error_code ec;
  fs::create_directories(ckpt_dir, ec);
  MOE_CHECK(!ec, "cannot create checkpoint directory '", ckpt_dir, "': ", ec.message());
  remove_stale(ckpt_dir);

  const std::string name = step_dir_name(step);
  const std::string pid = std::to_string(::getpid());
  const std::string tmp_dir = join(ckpt_dir, kTmpPrefix + name + "-" + pid);
  const std::string final_dir = join(ckpt_dir, name);
  fs::create_directory(tmp_dir, ec);
  MOE_CHECK(!ec, "cannot create '", tmp_dir, "': ", ec.message());

  try {
    const std::map<std::string, std::string> meta = {{"step", std::to_string(step)}};
    std::vector<std::string> written;
    write_safetensors(join(tmp_dir, kModelFile), files.model, meta);
    written.push_back(kModelFile);
    if (!files.optim.empty()) {
      write_safetensors(join(tmp_dir, kOptimFile), files.optim, meta);
      written.push_back(kOptimFile);
    }
    write_text_synced(join(tmp_dir, kTrainStateFile), to_text(train_state, "train_state"));
    written.push_back(kTrainStateFile);

    nlohmann::ordered_json manifest;
    manifest["format"] = kCheckpointFormat;
    manifest["version"] = kCheckpointVersion;
    manifest["step"] = step;
    manifest["files"] = nlohmann::ordered_json::object();
    for (const auto& f : written) manifest["files"][f] = file_entry(join(tmp_dir, f));
    write_text_synced(join(tmp_dir, kManifestFile), to_text(manifest, "the manifest"));
    fsync_path(tmp_dir, true);

    publish_dir(tmp_dir, final_dir, join(ckpt_dir, kTmpPrefix + std::string("old-") + name + "-" + pid));
    fsync_path(ckpt_dir, true);
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(tmp_dir, ignored);
    throw;
  }

  const std::string latest = join(ckpt_dir, kLatestFile);
  write_text_synced(latest + ".tmp", name + "\n");
  rename_checked(latest + ".tmp", latest);
  fsync_path(ckpt_dir, true);

  prune(ckpt_dir, step, keep_last);
  return final_dir;
}

std::optional<std::string> resolve_checkpoint(const std::string& ckpt_dir_or_path) {
  const std::string& p = ckpt_dir_or_path;
  MOE_CHECK(!p.empty(), "empty checkpoint path");
  std::error_code ec;
  if (!fs::exists(p, ec)) return std::nullopt;
  MOE_CHECK(is_directory(p), "checkpoint path '", p, "' is not a directory: expected a step_<N> directory or a ",
            "checkpoint directory");
  if (is_regular_file(join(p, kManifestFile))) return p;

  const std::string latest = join(p, kLatestFile);
  if (is_regular_file(latest)) {
    std::string name = read_text(latest);
    while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) name.pop_back();
    MOE_CHECK(parse_step_name(name).has_value(), "'", latest, "' holds '", name.substr(0, 64),
              "': expected step_<N>");
    const std::string dir = join(p, name);
    MOE_CHECK(is_regular_file(join(dir, kManifestFile)), "'", latest, "' names '", dir,
              "' but that is not a complete checkpoint (no manifest.json); pass a step directory to resume from");
    return dir;
  }
  const auto steps = list_steps(p);
  if (!steps.empty()) return join(p, step_dir_name(steps.back()));
  MOE_CHECK(!parse_step_name(fs::path(p).filename().string()).has_value(), "'", p,
            "' looks like a step directory but has no manifest.json (an interrupted save?)");
  return std::nullopt;
}

LoadedCheckpoint LoadedCheckpoint::open(const std::string& step_dir) {
  const std::string manifest_path = join(step_dir, kManifestFile);
  MOE_CHECK(is_regular_file(manifest_path), "checkpoint '", step_dir,
            "' has no manifest.json: not a complete checkpoint");
  const json m = json::parse(read_text(manifest_path), nullptr, /*allow_exceptions=*/false);
  MOE_CHECK(!m.is_discarded() && m.is_object(), "'", manifest_path, "' is not a JSON object");
  const auto format = m.find("format");
  MOE_CHECK(format != m.end() && format->is_string() && *format == kCheckpointFormat, "'", manifest_path,
            "': format must be \"", kCheckpointFormat, "\", got ", format == m.end() ? "nothing" : describe(*format));
  const auto version = m.find("version");
  MOE_CHECK(version != m.end() && version->is_number_integer(), "'", manifest_path, "': missing integer 'version'");
  MOE_CHECK(*version == kCheckpointVersion, "'", manifest_path, "': version ", describe(*version),
            " is not supported (this build reads version ", kCheckpointVersion, ")");
  const auto step = m.find("step");
  MOE_CHECK(step != m.end() && step->is_number_unsigned(), "'", manifest_path,
            "': 'step' must be a non-negative integer, got ", step == m.end() ? "nothing" : describe(*step));
  MOE_CHECK(step->get<uint64_t>() <= uint64_t(INT64_MAX), "'", manifest_path, "': step out of range");
  const auto listed = m.find("files");
  MOE_CHECK(listed != m.end() && listed->is_object(), "'", manifest_path, "': 'files' must be an object");

  for (const auto& [fname, entry] : listed->items()) {
    MOE_CHECK(!fname.empty() && fname != "." && fname != ".." && fname.find('/') == std::string::npos, "'",
              manifest_path, "' lists '", fname, "': expected a plain file name");
    const auto bytes = entry.find("bytes");
    const auto sha = entry.find("sha256");
    MOE_CHECK(entry.is_object() && bytes != entry.end() && bytes->is_number_unsigned() && sha != entry.end() &&
                  sha->is_string() && is_hex_digest(sha->get<std::string>()),
              "'", manifest_path, "': entry for '", fname, "' must be {\"bytes\": n, \"sha256\": 64 hex}, got ",
              describe(entry));
    const std::string path = join(step_dir, fname);
    MOE_CHECK(is_regular_file(path), "checkpoint file '", path, "' listed in the manifest is missing");
    std::error_code ec;
    const uint64_t actual_bytes = fs::file_size(path, ec);
    MOE_CHECK(!ec, "cannot stat '", path, "': ", ec.message());
    MOE_CHECK(actual_bytes == bytes->get<uint64_t>(), "checkpoint file '", path, "' is ", actual_bytes,
              " bytes, the manifest expects ", bytes->get<uint64_t>(), " (truncated or modified)");
    const std::string actual_sha = sha256_file(path);
    MOE_CHECK(actual_sha == sha->get<std::string>(), "checksum mismatch for checkpoint file '", path,
              "': manifest sha256 ", sha->get<std::string>(), ", file has ", actual_sha, " (corrupted)");
  }
  MOE_CHECK(listed->contains(kModelFile), "'", manifest_path, "' does not list ", kModelFile);
  MOE_CHECK(listed->contains(kTrainStateFile), "'", manifest_path, "' does not list ", kTrainStateFile);

  const std::string ts_path = join(step_dir, kTrainStateFile);
  json train_state = json::parse(read_text(ts_path), nullptr, /*allow_exceptions=*/false);
  MOE_CHECK(!train_state.is_discarded() && train_state.is_object(), "'", ts_path, "' is not a JSON object");

  SafetensorsFile model = SafetensorsFile::open(join(step_dir, kModelFile));
  std::optional<SafetensorsFile> optim;
  if (listed->contains(kOptimFile)) optim = SafetensorsFile::open(join(step_dir, kOptimFile));
  return LoadedCheckpoint(step_dir, int64_t(step->get<uint64_t>()), std::move(train_state), std::move(model),
                          std::move(optim));
}

const SafetensorsFile& LoadedCheckpoint::optim() const {
  MOE_CHECK(optim_.has_value(), "checkpoint '", dir_, "' has no optimizer state (no ", kOptimFile, ")");
  return *optim_;
}

void LoadedCheckpoint::read_model(const std::string& name, const Shape& shape, float* out) const {
  read_checked(model_, name, shape, out);
}

void LoadedCheckpoint::read_optim(const std::string& name, const Shape& shape, float* out) const {
  read_checked(optim(), name, shape, out);
}

}  // namespace moe
