// Checkpoint files: the header line read alone, and the atomic write (the framing: frame.cpp).
#include "checkpoint/file_io.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "dtrain/checkpoint.h"
#include "dtrain/errors.h"

namespace dtrain::ckpt {

static_assert(kNewestFrameVersion == kCheckpointFormatVersion,
              "frame.h's newest version must be dtrain/checkpoint.h's kCheckpointFormatVersion");

namespace {

std::string remedy(int err) {
  if (err == ENOSPC || err == EDQUOT || err == EFBIG) return "free space there or choose another checkpoint folder";
  if (err == EACCES || err == EPERM || err == EROFS)
    return "make the folder writable or choose another checkpoint folder";
  return "check the checkpoint folder";
}

[[noreturn]] void fail(const std::string& what, const std::string& file, int err) {
  throw Error(detail::cat("cannot ", what, " checkpoint file ", file, ": ", std::strerror(err), ": ", remedy(err),
                          " (the previous checkpoints are untouched)"));
}

}  // namespace

std::optional<int64_t> read_write_stamp(const std::string& path, std::string* why) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    *why = detail::cat("cannot open checkpoint file ", path, ": ", std::strerror(errno));
    return std::nullopt;
  }
  std::string head(kMaxHeaderBytes, '\0');
  f.read(&head[0], static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(f.gcount()));
  try {
    return header_write_stamp(head);
  } catch (const Error& e) {
    *why = e.what();
    return std::nullopt;
  }
}

int open_regular(const std::string& path, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0 && errno == ELOOP)
    throw Error(
        detail::cat(path, " is a symbolic link (", what,
                    "): a load reads only the folder's own regular files; copy the file itself into the folder"));
  DTRAIN_CHECK(fd >= 0, "cannot open ", path, " (", what, "): ", std::strerror(errno));
  const auto give_up = [&](const std::string& why) {
    ::close(fd);
    throw Error(detail::cat(path, why));
  };
  struct stat st {};
  if (::fstat(fd, &st) != 0) give_up(detail::cat(": cannot read it (", what, "): ", std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) {
    const char* kind = S_ISFIFO(st.st_mode)   ? "a FIFO"
                       : S_ISDIR(st.st_mode)  ? "a folder"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "a device";
    give_up(
        detail::cat(" is ", kind, " (", what,
                    "), not a regular file: a checkpoint's files are regular files; restore the folder from a copy"));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0)
    give_up(detail::cat(": cannot read it (", what, "): ", std::strerror(errno)));
  return fd;
}

namespace {

// Temporary files are "." + <target's name> + kTempMark + 16 random hex digits: a name nobody can
// guess ahead and plant (a symlink there would redirect the write), and one sweep_temp_files knows.
constexpr const char* kTempMark = ".tmp.";

std::string random_hex16() {
  uint64_t r = 0;
  size_t got = 0;
  while (got < sizeof r) {
    const ssize_t n = ::getrandom(reinterpret_cast<char*>(&r) + got, sizeof r - got, 0);
    if (n < 0 && errno == EINTR) continue;
    DTRAIN_CHECK(n > 0, "getrandom failed: ", std::strerror(errno), ": the kernel must provide getrandom(2)");
    got += static_cast<size_t>(n);
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(r));
  return hex;
}

// Creates a fresh temporary file beside `target` and returns its descriptor and path. O_EXCL: never
// a file or link that is already there; O_NOFOLLOW: never through a link.
int create_temp(const std::filesystem::path& dir, const std::filesystem::path& target, std::string* tmp) {
  for (int attempt = 0;; ++attempt) {
    *tmp = (dir / ("." + target.filename().string() + kTempMark + random_hex16())).string();
    const int fd = ::open(tmp->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0) return fd;
    if (errno != EEXIST || attempt == 3) fail("create", *tmp, errno);
  }
}

// The folder's entry for the renamed file is durable only once the folder is synced. The data is
// in place either way, so a failure is a warning (once per folder), not a failed save.
void sync_folder(const std::filesystem::path& dir) {
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  const int err = dfd < 0 ? errno : (::fsync(dfd) == 0 ? 0 : errno);
  if (dfd >= 0) ::close(dfd);
  if (err != 0)
    warn_once("checkpoint-folder-fsync " + dir.string(),
              detail::cat("checkpoint folder ", dir.string(), ": fsync failed (", std::strerror(err),
                          "): the checkpoints are written but their names may not survive a crash of the machine"));
}

}  // namespace

void write_atomic(const std::string& path, const std::string& bytes) {
  // 1. a fresh temporary file beside the target (same file system, so rename is atomic);
  // 2. write + fsync; 3. rename over the target; 4. fsync the folder so the rename is durable.
  const std::filesystem::path target(path);
  const std::filesystem::path dir = target.has_parent_path() ? target.parent_path() : ".";
  std::string tmp;
  const int fd = create_temp(dir, target, &tmp);
  auto give_up = [&](const char* what, int err) {
    ::close(fd);
    ::unlink(tmp.c_str());
    fail(what, tmp, err);
  };
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) give_up("write", n < 0 ? errno : ENOSPC);
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) give_up("write", errno);
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail("write", tmp, err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail("rename into place the", path, err);
  }
  sync_folder(dir);
}

int sweep_temp_files(const std::string& dir, const std::string& name_prefix) {
  namespace fs = std::filesystem;
  const std::string head = "." + name_prefix;
  int removed = 0;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.compare(0, head.size(), head) != 0 || name.find(kTempMark, head.size()) == std::string::npos) continue;
    std::error_code kind;
    if (fs::is_directory(it->symlink_status(kind))) continue;  // not ours: a link is removed, never followed
    std::error_code gone;
    if (fs::remove(it->path(), gone)) ++removed;
  }
  return removed;
}

}  // namespace dtrain::ckpt
