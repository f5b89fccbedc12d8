// Checkpoint directory store. Save protocol: write every file into CKPT_DIR/.tmp-step_<N>-<pid>
// and fsync it, write manifest.json last and fsync the directory, rename it to step_<N>
// (renameat2 RENAME_EXCHANGE when step_<N> exists, so the name never disappears), fsync CKPT_DIR,
// then replace `latest` through latest.tmp + fsync + rename. A crash at any point leaves every
// complete step directory intact and `latest` naming one of them (or absent before the first).
// Sliced saves (several ranks) follow the same protocol; rank 0 publishes only after every rank
// reported its files written and fsynced.
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

#include "checkpoint/files.h"
#include "checkpoint/json_fields.h"
#include "checkpoint/sha256.h"
#include "core/checked_math.h"
#include "core/config_io.h"
#include "core/error.h"
#include "parallel/comm.h"

namespace moe {

std::string step_dir_name(int64_t step);

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
  MOE_CHECK(fd >= 0, "cannot create '", path, "': ", write_error_hint(errno));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t put = ::write(fd, text.data() + done, text.size() - done);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) {
      const int err = errno;
      ::close(fd);
      MOE_FAIL("write to '", path, "' failed: ", write_error_hint(put < 0 ? err : EIO));
    }
    done += size_t(put);
  }
  const int rc = ::fsync(fd);
  const int err = errno;
  MOE_CHECK(::close(fd) == 0 && rc == 0, "fsync/close of '", path, "' failed: ", write_error_hint(rc ? err : errno));
}

std::string read_text(const std::string& path) { return read_regular_file(path, kMaxTextFileBytes); }

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

// Creates CKPT_DIR if needed, removes what interrupted saves and prunes left there, and creates
// the save's temporary directory; errors say whether the directory can be written at all.
void open_for_writing(const std::string& ckpt_dir, const std::string& tmp_dir) {
  std::error_code ec;
  fs::create_directories(ckpt_dir, ec);
  MOE_CHECK(!ec, "cannot create checkpoint directory '", ckpt_dir, "': ", ec.message(),
            " (set checkpoint.dir to a writable directory)");
  MOE_CHECK(is_directory(ckpt_dir), "checkpoint directory '", ckpt_dir, "' is not a directory");
  remove_stale(ckpt_dir);
  if (::mkdir(tmp_dir.c_str(), 0755) != 0) {
    const int err = errno;
    MOE_FAIL("cannot write into checkpoint directory '", ckpt_dir, "' (creating '", tmp_dir,
             "'): ", std::strerror(err), " (make it writable, or set checkpoint.dir to a writable directory)");
  }
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

void point_latest_and_prune(const std::string& ckpt_dir, int64_t step, int64_t keep_last) {
  const std::string latest = join(ckpt_dir, kLatestFile);
  write_text_synced(latest + ".tmp", step_dir_name(step) + "\n");
  rename_checked(latest + ".tmp", latest);
  fsync_path(ckpt_dir, true);
  prune(ckpt_dir, step, keep_last);
}

std::string rank_file(const char* kind, int rank, int world) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s-%05d-of-%05d.safetensors", kind, rank, world);
  return buf;
}

// Checks that `slices` ({offset, numel}, any order) tile [0, numel(shape)) exactly.
void check_tiling(const std::string& name, const Shape& shape, std::vector<std::pair<int64_t, int64_t>> slices,
                  const std::string& where) {
  std::sort(slices.begin(), slices.end());
  int64_t next = 0;
  for (const auto& [offset, numel] : slices) {
    MOE_CHECK(offset == next && numel > 0, where, ": the slices of tensor '", name, "' do not tile it: expected a ",
              "slice at flat offset ", next, ", got one at ", offset, " of ", numel, " elements");
    next = checked_add(next, numel, where + ": the slices of tensor '" + name + "'");
  }
  MOE_CHECK(next == shape_numel(shape), where, ": the slices of tensor '", name, "' cover ", next, " of its ",
            shape_numel(shape), " elements (shape ", shape_str(shape), ")");
}

std::vector<TensorRef> slice_refs(const std::vector<TensorSlice>& slices) {
  std::vector<TensorRef> refs;
  for (const TensorSlice& t : slices) refs.push_back({t.name, DType::kF32, {t.numel}, t.data});
  return refs;
}

}  // namespace

std::string step_dir_name(int64_t step) { return "step_" + std::to_string(step); }

void remove_stale_temporaries(const std::string& ckpt_dir) {
  if (is_directory(ckpt_dir)) remove_stale(ckpt_dir);
}

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

  const std::string name = step_dir_name(step);
  const std::string pid = std::to_string(::getpid());
  const std::string tmp_dir = join(ckpt_dir, kTmpPrefix + name + "-" + pid);
  const std::string final_dir = join(ckpt_dir, name);
  try {
    open_for_writing(ckpt_dir, tmp_dir);
  } catch (const std::exception& e) {
    MOE_FAIL("cannot save the checkpoint of step ", step, ": ", e.what());
  }

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
  } catch (const std::exception& e) {
    std::error_code ignored;
    fs::remove_all(tmp_dir, ignored);
    MOE_FAIL("cannot save the checkpoint of step ", step, ": ", e.what(), "; nothing was published, and the ",
             "earlier checkpoints in '", ckpt_dir, "' are as they were");
  }
  point_latest_and_prune(ckpt_dir, step, keep_last);
  return final_dir;
}

std::string save_checkpoint_sliced(Comm& comm, const std::string& ckpt_dir, int64_t step,
                                   const SlicedCheckpointFiles& mine, int64_t keep_last) {
  MOE_CHECK(step >= 0, "checkpoint step must be >= 0, got ", step);
  const int rank = comm.rank(), world = comm.size();
  const std::string name = step_dir_name(step);
  const std::string final_dir = join(ckpt_dir, name);
  std::string error;

  // 1. Rank 0 prepares the temporary directory; every rank learns its name (rank 0's pid).
  int64_t head[2] = {0, int64_t(::getpid())};
  if (rank == 0) {
    try {
      MOE_CHECK(mine.train_state.is_object() || mine.train_state.is_null(), "train_state must be a JSON object, got ",
                mine.train_state.type_name());
      open_for_writing(ckpt_dir, join(ckpt_dir, kTmpPrefix + name + "-" + std::to_string(head[1])));
    } catch (const std::exception& e) {
      head[0] = 1;
      error = e.what();
    }
  }
  comm.broadcast(head, 2, 0);
  MOE_CHECK(head[0] == 0, "checkpoint save of step ", step, " failed",
            rank == 0 ? ": " + error : std::string(" on rank 0 (its error says why)"));
  const std::string tmp_dir = join(ckpt_dir, kTmpPrefix + name + "-" + std::to_string(head[1]));
  auto fail_all = [&](int64_t failed, const char* phase) {
    comm.all_reduce(&failed, 1, ReduceOp::kMax);
    if (failed == 0) return;
    if (rank == 0) {
      std::error_code ignored;
      fs::remove_all(tmp_dir, ignored);
    }
    MOE_FAIL("checkpoint save of step ", step, " failed while ", phase,
             error.empty() ? std::string(" on another rank (its error says why)") : " on rank " +
                                 std::to_string(rank) + ": " + error,
             "; nothing was published");
  };

  // 2. Every rank writes its slices, checksums them and lists them in part-<r>.json.
  int64_t failed = 0;
  try {
    const std::map<std::string, std::string> meta = {
        {"step", std::to_string(step)}, {"rank", std::to_string(rank)}, {"world_size", std::to_string(world)}};
    json part;
    part["files"] = json::object();
    part["slices"] = json::array();
    for (const char* kind : {"model", "optim"}) {
      const std::vector<TensorSlice>& slices = std::string(kind) == "model" ? mine.model : mine.optim;
      if (slices.empty()) continue;
      const std::string file = rank_file(kind, rank, world);
      for (const TensorSlice& t : slices) {
        MOE_CHECK(t.offset >= 0 && t.numel > 0 && t.offset + t.numel <= shape_numel(t.global_shape),
                  "slice of '", t.name, "' at offset ", t.offset, " with ", t.numel, " elements does not fit its ",
                  "global shape ", shape_str(t.global_shape));
        part["slices"].push_back({{"kind", kind}, {"file", file}, {"name", t.name}, {"shape", t.global_shape},
                                  {"offset", t.offset}, {"numel", t.numel}});
      }
      write_safetensors(join(tmp_dir, file), slice_refs(slices), meta);
      part["files"][file] = file_entry(join(tmp_dir, file));
    }
    write_text_synced(join(tmp_dir, "part-" + std::to_string(rank) + ".json"), to_text(part, "a slice list"));
  } catch (const std::exception& e) {
    failed = 1;
    error = e.what();
  }
  fail_all(failed, "writing the slices");

  // 3. Rank 0 merges the lists into the manifest and publishes the step.
  failed = 0;
  if (rank == 0) {
    try {
      json train_state = mine.train_state.is_null() ? json::object() : mine.train_state;
      if (train_state.contains("step"))
        MOE_CHECK(train_state["step"] == step, "train_state step ", describe(train_state["step"]),
                  " differs from the checkpoint step ", step);
      else
        train_state["step"] = step;
      nlohmann::ordered_json manifest;
      manifest["format"] = kCheckpointFormat;
      manifest["version"] = kSlicedCheckpointVersion;
      manifest["step"] = step;
      manifest["world_size"] = world;
      manifest["files"] = nlohmann::ordered_json::object();
      nlohmann::ordered_json tensors = {{"model", nlohmann::ordered_json::object()},
                                        {"optim", nlohmann::ordered_json::object()}};
      std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> tiles;
      for (int r = 0; r < world; ++r) {
        const std::string part_path = join(tmp_dir, "part-" + std::to_string(r) + ".json");
        const json part = json::parse(read_text(part_path));
        for (const auto& [file, entry] : part.at("files").items()) manifest["files"][file] = entry;
        for (const json& sl : part.at("slices")) {
          const std::string kind = sl.at("kind"), tname = sl.at("name");
          auto& t = tensors[kind][tname];
          if (t.is_null()) {
            t["shape"] = sl.at("shape");
            t["slices"] = nlohmann::ordered_json::array();
          }
          MOE_CHECK(t["shape"] == sl.at("shape"), "rank ", r, " wrote tensor '", tname, "' with global shape ",
                    sl.at("shape").dump(), ", another rank with ", t["shape"].dump());
          t["slices"].push_back({{"file", sl.at("file")}, {"offset", sl.at("offset")}, {"numel", sl.at("numel")}});
          tiles[kind + "/" + tname].push_back({sl.at("offset").get<int64_t>(), sl.at("numel").get<int64_t>()});
        }
        remove_all_checked(part_path);
      }
      for (const char* kind : {"model", "optim"})
        for (const auto& [tname, t] : tensors[kind].items())
          check_tiling(tname, t["shape"].get<Shape>(), tiles[std::string(kind) + "/" + tname],
                       "sliced checkpoint of step " + std::to_string(step));
      write_text_synced(join(tmp_dir, kTrainStateFile), to_text(train_state, "train_state"));
      manifest["files"][kTrainStateFile] = file_entry(join(tmp_dir, kTrainStateFile));
      manifest["tensors"] = tensors;
      write_text_synced(join(tmp_dir, kManifestFile), to_text(manifest, "the manifest"));
      fsync_path(tmp_dir, true);
      publish_dir(tmp_dir, final_dir,
                  join(ckpt_dir, kTmpPrefix + std::string("old-") + name + "-" + std::to_string(head[1])));
      fsync_path(ckpt_dir, true);
      point_latest_and_prune(ckpt_dir, step, keep_last);
    } catch (const std::exception& e) {
      failed = 1;
      error = e.what();
    }
  }
  fail_all(failed, "publishing the step");
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
  MOE_CHECK(*version == kCheckpointVersion || *version == kSlicedCheckpointVersion, "'", manifest_path,
            "': version ", describe(*version), " is not supported (this build reads versions ", kCheckpointVersion,
            " and ", kSlicedCheckpointVersion, ")");
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
    MOE_CHECK(is_regular_file(path), "checkpoint file '", path,
              "' listed in the manifest is missing or not a regular file");
    std::error_code ec;
    const uint64_t actual_bytes = fs::file_size(path, ec);
    MOE_CHECK(!ec, "cannot stat '", path, "': ", ec.message());
    MOE_CHECK(actual_bytes == bytes->get<uint64_t>(), "checkpoint file '", path, "' is ", actual_bytes,
              " bytes, the manifest expects ", bytes->get<uint64_t>(), " (truncated or modified)");
    const std::string actual_sha = sha256_file(path);
    MOE_CHECK(actual_sha == sha->get<std::string>(), "checksum mismatch for checkpoint file '", path,
              "': manifest sha256 ", sha->get<std::string>(), ", file has ", actual_sha, " (corrupted)");
  }
  MOE_CHECK(listed->contains(kTrainStateFile), "'", manifest_path, "' does not list ", kTrainStateFile);

  LoadedCheckpoint ck;
  ck.dir_ = step_dir;
  ck.step_ = int64_t(step->get<uint64_t>());
  ck.version_ = version->get<int>();
  const std::string ts_path = join(step_dir, kTrainStateFile);
  ck.train_state_ = json::parse(read_text(ts_path), nullptr, /*allow_exceptions=*/false);
  MOE_CHECK(!ck.train_state_.is_discarded() && ck.train_state_.is_object(), "'", ts_path, "' is not a JSON object");

  // Whole tensors of one file: one slice each.
  auto index_file = [&](int file, Index& index, std::vector<std::string>& order) {
    const std::vector<TensorInfo>& ts = ck.files_[size_t(file)].tensors();
    for (size_t t = 0; t < ts.size(); ++t) {
      Global g;
      g.info = {ts[t].name, ts[t].dtype_name, ts[t].shape, ts[t].bytes(), 1};
      g.slices.push_back({file, t, 0, ts[t].numel()});
      order.push_back(ts[t].name);
      index.emplace(ts[t].name, std::move(g));
    }
  };
  if (ck.version_ == kCheckpointVersion) {
    MOE_CHECK(listed->contains(kModelFile), "'", manifest_path, "' does not list ", kModelFile);
    ck.files_.push_back(SafetensorsFile::open(join(step_dir, kModelFile)));
    ck.model_file_ = 0;
    index_file(0, ck.model_index_, ck.model_order_);
    if (listed->contains(kOptimFile)) {
      ck.files_.push_back(SafetensorsFile::open(join(step_dir, kOptimFile)));
      ck.optim_file_ = 1;
      index_file(1, ck.optim_index_, ck.optim_order_);
    }
    return ck;
  }

  // Sliced: "tensors": {"model"|"optim": {name: {"shape": [...], "slices": [{file, offset, numel}]}}}.
  const auto world = m.find("world_size");
  MOE_CHECK(world != m.end() && world->is_number_unsigned() && world->get<uint64_t>() >= 1 &&
                world->get<uint64_t>() <= uint64_t(kMaxRanks),
            "'", manifest_path, "': a sliced checkpoint needs an integer 'world_size' in [1, ", kMaxRanks, "]");
  ck.world_size_ = int(world->get<uint64_t>());
  const auto tensors = m.find("tensors");
  MOE_CHECK(tensors != m.end() && tensors->is_object() && tensors->contains("model"), "'", manifest_path,
            "': a sliced checkpoint needs a 'tensors' object with a 'model' map");
  std::map<std::string, int> file_ids;
  auto file_id = [&](const std::string& fname) {
    auto it = file_ids.find(fname);
    if (it != file_ids.end()) return it->second;
    MOE_CHECK(listed->contains(fname), "'", manifest_path, "' maps a slice to '", fname,
              "', which its 'files' does not list");
    ck.files_.push_back(SafetensorsFile::open(join(step_dir, fname)));
    return file_ids[fname] = int(ck.files_.size() - 1);
  };
  for (const char* kind : {"model", "optim"}) {
    if (!tensors->contains(kind)) continue;
    const json& map = (*tensors)[kind];
    MOE_CHECK(map.is_object(), "'", manifest_path, "': tensors.", kind, " must be an object");
    Index& index = std::string(kind) == "model" ? ck.model_index_ : ck.optim_index_;
    std::vector<std::string>& order = std::string(kind) == "model" ? ck.model_order_ : ck.optim_order_;
    for (const auto& [tname, t] : map.items()) {
      MOE_CHECK(t.is_object() && t.contains("shape") && t["shape"].is_array() && t.contains("slices") &&
                    t["slices"].is_array(),
                "'", manifest_path, "': tensor '", tname, "' needs 'shape' and 'slices' arrays");
      Global g;
      g.info.name = tname;
      g.info.dtype_name = "F32";
      int64_t numel = 1;
      for (const json& d : t["shape"]) {
        MOE_CHECK(d.is_number_unsigned() && d.get<uint64_t>() <= uint64_t(INT64_MAX), "'", manifest_path,
                  "': tensor '", tname, "' has the dimension ", describe(d),
                  " in its shape: expected integers in [0, 2^63 - 1]");
        g.info.shape.push_back(d.get<int64_t>());
        numel = checked_mul(numel, g.info.shape.back(), "'" + manifest_path + "': the element count of tensor '" +
                                                             tname + "'");
      }
      std::vector<std::pair<int64_t, int64_t>> tiles;
      for (const json& sl : t["slices"]) {
        MOE_CHECK(sl.is_object() && sl.contains("file") && sl["file"].is_string() && sl.contains("offset") &&
                      sl["offset"].is_number_unsigned() && sl["offset"].get<uint64_t>() <= uint64_t(numel) &&
                      sl.contains("numel") && sl["numel"].is_number_unsigned() &&
                      sl["numel"].get<uint64_t>() <= uint64_t(numel),
                  "'", manifest_path, "': a slice of '", tname, "' must be {\"file\", \"offset\", \"numel\"} ",
                  "within its ", numel, " elements, got ", describe(sl));
        Slice s;
        s.file = file_id(sl["file"].get<std::string>());
        s.offset = sl["offset"].get<int64_t>();
        s.numel = sl["numel"].get<int64_t>();
        const SafetensorsFile& f = ck.files_[size_t(s.file)];
        const TensorInfo* info = f.find(tname);
        MOE_CHECK(info != nullptr, "slice of tensor '", tname, "' not found in '", f.path(), "'");
        MOE_CHECK(info->numel() == s.numel && info->dtype_name == "F32", "slice of tensor '", tname, "' in '",
                  f.path(), "' holds ", info->numel(), " ", info->dtype_name, " elements; the manifest says ",
                  s.numel, " F32");
        s.tensor = size_t(info - f.tensors().data());
        g.info.bytes += info->bytes();
        tiles.push_back({s.offset, s.numel});
        g.slices.push_back(s);
      }
      check_tiling(tname, g.info.shape, tiles, "'" + manifest_path + "'");
      std::sort(g.slices.begin(), g.slices.end(), [](const Slice& a, const Slice& b) { return a.offset < b.offset; });
      g.info.num_slices = int(g.slices.size());
      order.push_back(tname);
      index.emplace(tname, std::move(g));
    }
  }
  return ck;
}

const SafetensorsFile& LoadedCheckpoint::model() const {
  MOE_CHECK(model_file_ >= 0, "checkpoint '", dir_, "' is sliced over ", world_size_,
            " ranks and has no single ", kModelFile, " (read tensors with read_model)");
  return files_[size_t(model_file_)];
}

const SafetensorsFile& LoadedCheckpoint::optim() const {
  MOE_CHECK(has_optim(), "checkpoint '", dir_, "' has no optimizer state (no ", kOptimFile, ")");
  MOE_CHECK(optim_file_ >= 0, "checkpoint '", dir_, "' is sliced over ", world_size_,
            " ranks and has no single ", kOptimFile, " (read tensors with read_optim)");
  return files_[size_t(optim_file_)];
}

std::vector<GlobalTensorInfo> LoadedCheckpoint::list(const Index& index, const std::vector<std::string>& order) const {
  std::vector<GlobalTensorInfo> out;
  for (const std::string& n : order) out.push_back(index.at(n).info);
  return out;
}

std::vector<GlobalTensorInfo> LoadedCheckpoint::model_tensors() const { return list(model_index_, model_order_); }
std::vector<GlobalTensorInfo> LoadedCheckpoint::optim_tensors() const { return list(optim_index_, optim_order_); }

std::vector<std::string> LoadedCheckpoint::data_files() const {
  std::vector<std::string> out;
  for (const SafetensorsFile& f : files_) out.push_back(fs::path(f.path()).filename().string());
  return out;
}

void LoadedCheckpoint::read_range(const Index& index, const char* kind, const std::string& name, const Shape& shape,
                                  int64_t offset, int64_t numel, float* out) const {
  if (std::string(kind) == "optim")
    MOE_CHECK(has_optim(), "checkpoint '", dir_, "' has no optimizer state (no ", kOptimFile, ")");
  auto it = index.find(name);
  const std::string where = version_ == kCheckpointVersion
                                ? files_[size_t(std::string(kind) == "model" ? model_file_ : optim_file_)].path()
                                : dir_ + " (" + kind + " slices)";
  MOE_CHECK(it != index.end(), "tensor '", name, "' not found in '", where, "'");
  const Global& g = it->second;
  MOE_CHECK(g.info.shape == shape, "tensor '", name, "' in '", where, "' has shape ", shape_str(g.info.shape),
            ", expected ", shape_str(shape), " (does the config match the checkpoint?)");
  MOE_CHECK(offset >= 0 && numel >= 0 && offset + numel <= shape_numel(shape), "range [", offset, ", ",
            offset + numel, ") is outside tensor '", name, "' of ", shape_numel(shape), " elements");
  for (const Slice& s : g.slices) {
    const int64_t lo = std::max(offset, s.offset), hi = std::min(offset + numel, s.offset + s.numel);
    if (lo >= hi) continue;
    const SafetensorsFile& f = files_[size_t(s.file)];
    const TensorInfo& t = f.tensors()[s.tensor];
    if (lo == s.offset && hi == s.offset + s.numel) {
      f.read_f32(t.name, out + (lo - offset), s.numel);  // the whole slice: the checked reader
      continue;
    }
    const int64_t elt = t.numel() ? t.bytes() / t.numel() : 0;
    safetensors_to_f32(static_cast<const uint8_t*>(f.data(t)) + (lo - s.offset) * elt, t.dtype_name,
                       out + (lo - offset), hi - lo);
  }
}

void LoadedCheckpoint::read_model(const std::string& name, const Shape& shape, float* out) const {
  read_range(model_index_, "model", name, shape, 0, shape_numel(shape), out);
}

void LoadedCheckpoint::read_optim(const std::string& name, const Shape& shape, float* out) const {
  read_range(optim_index_, "optim", name, shape, 0, shape_numel(shape), out);
}

void LoadedCheckpoint::read_model_range(const std::string& name, const Shape& shape, int64_t offset, int64_t numel,
                                        float* out) const {
  read_range(model_index_, "model", name, shape, offset, numel, out);
}

void LoadedCheckpoint::read_optim_range(const std::string& name, const Shape& shape, int64_t offset, int64_t numel,
                                        float* out) const {
  read_range(optim_index_, "optim", name, shape, offset, numel, out);
}

TrainState read_train_state(const LoadedCheckpoint& ck) {
  const std::string file = join(ck.dir(), kTrainStateFile);
  const json& st = ck.train_state();
  TrainState t;
  t.step = json_int_required(st, "step", file, 0, kMaxSteps);
  MOE_CHECK(t.step == ck.step(), "'", file, "': 'step' is ", t.step, " but the manifest's step is ", ck.step(),
            " (a train_state.json from another step?)");
  t.data_position = json_int(st, "data_position", file, 0, kMaxSteps).value_or(t.step);
  t.optimizer_steps = json_int(st, "optimizer_steps", file, 0, t.step).value_or(t.step);
  t.config = json_string(st, "config", file);
  return t;
}

Config checkpoint_config(const LoadedCheckpoint& ck) {
  const std::string file = join(ck.dir(), kTrainStateFile);
  const std::optional<std::string> text = read_train_state(ck).config;
  MOE_CHECK(text.has_value(), "'", file, "' has no 'config' (the run's resolved config as TOML text), so the ",
            "checkpoint's model is unknown");
  return parse_config_toml(*text, file + " (its 'config')");
}

void check_resume_config(const LoadedCheckpoint& ck, const Config& run) {
  const Config saved = checkpoint_config(ck);
  std::vector<std::string> lines;
  for (const ConfigDifference& d : config_differences(saved, run, {"model", "moe"})) {
    if (d.key == "model.dense_hidden" && saved.model.dense_layers.empty() && run.model.dense_layers.empty()) continue;
    lines.push_back(d.key + ": " + d.a + " in the checkpoint, " + d.b + " in this run");
  }
  if (lines.empty()) return;
  std::string list;
  for (const std::string& l : lines) list += "\n  " + l;
  MOE_FAIL("cannot resume from '", ck.dir(), "': this run's model differs from the checkpoint's in ", lines.size(),
           lines.size() == 1 ? " key:" : " keys:", list,
           "\nset them to the checkpoint's values (`moecore inspect ", ck.dir(),
           "` prints its config), or start fresh with checkpoint.resume = \"none\"");
}

}  // namespace moe
