// Checkpoint framing (header + CRC-32) and the atomic write.
#include "checkpoint/file_io.h"

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "dtrain/checkpoint.h"
#include "dtrain/errors.h"

namespace dtrain::ckpt {

uint32_t crc32_of(const std::string& bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto* p = reinterpret_cast<const Bytef*>(bytes.data());
  size_t left = bytes.size();
  while (left > 0) {  // zlib's length is a uInt: feed it in chunks
    const uInt n = static_cast<uInt>(std::min<size_t>(left, 1u << 30));
    crc = crc32(crc, p, n);
    p += n;
    left -= n;
  }
  return static_cast<uint32_t>(crc);
}

namespace {

constexpr const char* kMagic = "DTRAIN-CHECKPOINT";

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

// The header line is at most this long, newline included.
constexpr size_t kMaxHeader = 96;

struct Header {
  size_t eol = 0;  // where its newline is
  size_t length = 0;
  std::string crc_hex;
  int64_t write_stamp = 0;  // 0: written before stamps existed
};

// Throws dtrain::Error with the reason for a header line that cannot be read. Readers of the four
// fields of format version 1 skip the fifth (the write stamp), so files stay version 1 both ways.
Header parse_header(const std::string& bytes) {
  Header h;
  h.eol = bytes.find('\n');
  DTRAIN_CHECK(bytes.compare(0, std::strlen(kMagic), kMagic) == 0 && h.eol != std::string::npos && h.eol < kMaxHeader,
               "not a dtrain checkpoint (no \"", kMagic, "\" header line)");
  std::istringstream header(bytes.substr(std::strlen(kMagic), h.eol - std::strlen(kMagic)));
  int version = 0;
  header >> version >> h.length >> h.crc_hex;
  DTRAIN_CHECK(!header.fail() && h.crc_hex.size() == 8, "malformed header line");
  DTRAIN_CHECK(version >= 1 && version <= kCheckpointFormatVersion, "format version ", version,
               " is not supported (this dtrain reads versions 1 to ", kCheckpointFormatVersion, ")");
  long long stamp = 0;
  if (header >> stamp) h.write_stamp = stamp;
  DTRAIN_CHECK(h.write_stamp >= 0, "malformed header line (write stamp ", h.write_stamp, ")");
  return h;
}

}  // namespace

std::optional<int64_t> read_write_stamp(const std::string& path, std::string* why) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    *why = detail::cat("cannot open checkpoint file ", path, ": ", std::strerror(errno));
    return std::nullopt;
  }
  std::string head(kMaxHeader, '\0');
  f.read(&head[0], static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(f.gcount()));
  try {
    return parse_header(head).write_stamp;
  } catch (const Error& e) {
    *why = e.what();
    return std::nullopt;
  }
}

std::string frame(const std::string& payload, int64_t write_stamp, int version) {
  char header[kMaxHeader];
  std::snprintf(header, sizeof header, "%s %d %zu %08x %lld\n", kMagic, version, payload.size(), crc32_of(payload),
                static_cast<long long>(write_stamp));
  return header + payload;
}

std::string unframe(const std::string& file_bytes) {
  const Header h = parse_header(file_bytes);
  const size_t eol = h.eol;
  const size_t length = h.length;
  const std::string& crc_hex = h.crc_hex;
  const size_t have = file_bytes.size() - eol - 1;
  DTRAIN_CHECK(have >= length, "truncated: ", have, " of ", length, " payload bytes");
  DTRAIN_CHECK(have == length, "has ", have - length, " bytes after the payload's ", length);
  std::string payload = file_bytes.substr(eol + 1);
  char actual[16];
  std::snprintf(actual, sizeof actual, "%08x", crc32_of(payload));
  DTRAIN_CHECK(crc_hex == actual, "corrupt: CRC-32 of the payload is ", actual, ", the header says ", crc_hex);
  return payload;
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
