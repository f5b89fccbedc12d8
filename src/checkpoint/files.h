// Whole-file reads and writes for checkpoints, the HF interop and the CLI. Reads open with
// O_NONBLOCK and refuse anything but a regular file at once, naming the path (a FIFO would
// block the reader, a directory fails late and obscurely). Writes go to a temporary name in
// the target's directory (".<name>.tmp-<pid>"), are fsynced and renamed over the target, so a
// reader sees the old file or the new one and an interrupted write leaves only the temporary.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moe {

// Throws unless `path` names a regular file (after symlinks); `what` says what it is for
// ("config.json of the HF model"). A missing file, a directory, a FIFO or a device is named.
void require_regular_file(const std::string& path, const std::string& what);

// The whole regular file, at most `max_bytes` long (refused naming the size otherwise).
std::string read_regular_file(const std::string& path, int64_t max_bytes = int64_t(1) << 30);

// "<dir>/.<name>.tmp-<pid>": where write_file_atomic stages `path`.
std::string staging_path(const std::string& path);

// Renames the staged `tmp` onto `path` and fsyncs the directory; on failure removes `tmp`.
void publish_file(const std::string& tmp, const std::string& path);

// Writes `bytes` to `path` through staging_path + fsync + publish_file. A failure (disk full,
// read-only directory) throws naming the path and leaves any earlier `path` as it was.
void write_file_atomic(const std::string& path, std::string_view bytes);

// The text of an errno for a failed write, with what to do for the usual causes.
std::string write_error_hint(int err);

}  // namespace moe
