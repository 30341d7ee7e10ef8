#include "common/util.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "dtrain/errors.h"

namespace dtrain::util {

std::string read_file(const std::string& path, const std::string& what) {
  std::ifstream f(path, std::ios::binary);
  DTRAIN_CHECK(f, "cannot open ", what, " ", path, ": ", std::strerror(errno));
  std::ostringstream os;
  os << f.rdbuf();
  DTRAIN_CHECK(!f.bad(), "cannot read ", what, " ", path, ": ", std::strerror(errno));
  return os.str();
}

void make_own_folder(const std::string& path, const std::string& what, const std::string& remedy) {
  if (mkdir(path.c_str(), 0755) != 0 && errno != EEXIST)
    DTRAIN_CHECK(false, "cannot create ", what, " ", path, ": ", std::strerror(errno), ": ", remedy);
  struct stat sb {};
  DTRAIN_CHECK(lstat(path.c_str(), &sb) == 0, "cannot inspect ", what, " ", path, ": ", std::strerror(errno), ": ",
               remedy);
  const bool folder = S_ISDIR(sb.st_mode), own = sb.st_uid == geteuid(), shared = (sb.st_mode & 022) != 0;
  if (folder && own && !shared) return;
  char mode[8];
  std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(sb.st_mode & 07777));
  std::string why = std::string("mode ") + mode + ": others may write in it";
  if (!folder)
    why = S_ISLNK(sb.st_mode) ? "a symbolic link" : "not a folder";
  else if (!own)
    why = "owner uid " + std::to_string(sb.st_uid) + ", not " + std::to_string(geteuid());
  DTRAIN_CHECK(false, what, " ", path, " is not this user's own folder (", why, "): remove it, or ", remedy);
}

std::FILE* create_file(const std::string& path) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) return nullptr;
  std::FILE* f = fdopen(fd, "wb");
  if (!f) {
    const int err = errno;
    close(fd);
    errno = err;
  }
  return f;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::chrono::milliseconds capped(std::chrono::milliseconds d) { return std::min(d, kForever); }

std::chrono::milliseconds millis_of_seconds(double seconds) {
  // Up from a millionth of a millisecond above a whole one: 2.3 s is 2300 ms, not 2301 for the last
  // bit of 2.3 * 1000; and any positive wait is at least 1 ms.
  double ms = std::ceil(seconds * 1000 - 1e-6);
  if (seconds > 0 && ms < 1) ms = 1;
  if (!(ms < static_cast<double>(kForever.count()))) return kForever;  // +inf, and NaN if one slips through
  return std::chrono::milliseconds(static_cast<int64_t>(ms));
}

std::string host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "unknown-host";
  return buf;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string piece; std::getline(in, piece, sep);) out.push_back(piece);
  return out;
}

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? sep : "") + parts[i];
  return out;
}

std::string one_line(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  for (char& c : s)
    if (c == '\n') c = ' ';
  return s;
}

bool is_digits(const std::string& s) { return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos; }

bool is_wildcard_address(const std::string& host) {
  std::string h = host;
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST;  // numbers only: a name is never the wildcard, and no DNS here
  addrinfo* res = nullptr;
  if (getaddrinfo(h.c_str(), nullptr, &hints, &res) != 0) return false;
  bool any = false;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    if (ai->ai_family == AF_INET)
      any |= reinterpret_cast<const sockaddr_in*>(ai->ai_addr)->sin_addr.s_addr == htonl(INADDR_ANY);
    else if (ai->ai_family == AF_INET6)
      any |= IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(ai->ai_addr)->sin6_addr);
  }
  freeaddrinfo(res);
  return any;
}

}  // namespace dtrain::util
