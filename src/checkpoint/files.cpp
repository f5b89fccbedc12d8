// Regular-file reads and staged, renamed writes (files.h).
#include "checkpoint/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace moe {

namespace fs = std::filesystem;

namespace {

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  MOE_CHECK(fd >= 0, "cannot open directory '", dir, "' to fsync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  MOE_CHECK(rc == 0, "fsync of directory '", dir, "' failed: ", std::strerror(err));
}

}  // namespace

std::string write_error_hint(int err) {
  std::string s = std::strerror(err);
  if (err == ENOSPC || err == EDQUOT) s += " (free space on that filesystem or write elsewhere)";
  if (err == EROFS || err == EACCES || err == EPERM) s += " (make the directory writable or write elsewhere)";
  return s;
}

void require_regular_file(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    MOE_FAIL("cannot read ", what, " '", path, "': ", std::strerror(err));
  }
  MOE_CHECK(S_ISREG(st.st_mode), what, " '", path, "' is ", kind_of(st.st_mode), ": expected a regular file");
}

std::string read_regular_file(const std::string& path, int64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO for reading must not wait for a writer.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  MOE_CHECK(fd >= 0, "cannot open '", path, "': ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    MOE_FAIL("cannot stat '", path, "': ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    MOE_FAIL("'", path, "' is ", kind_of(st.st_mode), ": expected a regular file");
  }
  if (int64_t(st.st_size) > max_bytes) {
    ::close(fd);
    MOE_FAIL("'", path, "' is ", int64_t(st.st_size), " bytes, more than the ", max_bytes,
             " this reader takes: is it the right file?");
  }
  std::string out(size_t(st.st_size), '\0');
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t got = ::read(fd, out.data() + done, out.size() - done);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const int err = errno;
      ::close(fd);
      MOE_CHECK(got == 0, "read error in '", path, "': ", std::strerror(err));
      out.resize(done);  // shrank while being read
      return out;
    }
    done += size_t(got);
  }
  ::close(fd);
  return out;
}

std::string staging_path(const std::string& path) {
  const fs::path p(path);
  std::string name = ".";
  name.append(p.filename().string()).append(".tmp-").append(std::to_string(::getpid()));
  return (p.parent_path() / name).string();
}

void publish_file(const std::string& tmp, const std::string& path) {
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    MOE_FAIL("cannot rename '", tmp, "' to '", path, "': ", write_error_hint(err));
  }
  const fs::path parent = fs::path(path).parent_path();
  fsync_dir(parent.empty() ? "." : parent.string());
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  const std::string tmp = staging_path(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  MOE_CHECK(fd >= 0, "cannot write '", path, "' (creating '", tmp, "'): ", write_error_hint(errno));
  size_t done = 0;
  int err = 0;
  while (done < bytes.size() && err == 0) {
    const ssize_t put = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) err = put < 0 ? errno : EIO;
    else done += size_t(put);
  }
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    MOE_FAIL("cannot write '", path, "': ", write_error_hint(err), "; nothing was replaced");
  }
  publish_file(tmp, path);
}

}  // namespace moe
