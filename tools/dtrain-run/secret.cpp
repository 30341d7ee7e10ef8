// The job secret's sources (see secret.h).
#include "secret.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/env.h"
#include "store/store.h"

namespace dtrain::run {

namespace {

// The one line of a secret file, without its line break; refuses a file others could read or plant.
std::string read_secret_file(const std::string& path) {
  const std::string flag = "--rdzv_conf secret_file=" + path;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0)
    throw UsageError(flag + ": cannot open it: " + std::strerror(errno) +
                     (errno == ELOOP ? " (a symbolic link: name the file itself)" : ""));
  struct stat st {};
  std::string text;
  try {
    if (fstat(fd, &st) != 0) throw UsageError(flag + ": " + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) throw UsageError(flag + " is not a regular file");
    if (st.st_uid != geteuid())
      throw UsageError(flag + " belongs to uid " + std::to_string(st.st_uid) + ", not to this user (uid " +
                       std::to_string(geteuid()) + "): use a secret file of your own");
    if (st.st_mode & 077) {
      char mode[8];
      std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
      throw UsageError(flag + " has mode " + mode + ": other users can read or change it; chmod 600 " + path);
    }
    char buf[4096];
    for (ssize_t n; (n = read(fd, buf, sizeof buf)) != 0;) {
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw UsageError(flag + ": cannot read it: " + std::strerror(errno));
      text.append(buf, static_cast<size_t>(n));
      if (text.size() > 65536) throw UsageError(flag + " is over 64 KiB: a job secret is one line");
    }
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  try {
    return store::check_job_secret(text, flag);
  } catch (const std::runtime_error& e) {
    throw UsageError(e.what());
  }
}

}  // namespace

void resolve_job_secret(LaunchOptions& o) {
  if (!o.secret_file.empty()) {
    o.secret = read_secret_file(o.secret_file);
    return;
  }
  if (const std::optional<std::string> given = env::text(store::kSecretEnv); given && !given->empty()) {
    try {
      o.secret = store::check_job_secret(*given, store::kSecretEnv);
    } catch (const std::runtime_error& e) {
      throw UsageError(e.what());
    }
  }
  if (o.secret.empty() && o.nnodes == 1 && !o.elastic) o.secret = store::new_job_secret();
}

std::string open_store_warning(const LaunchOptions& o) {
  return "no job secret was given (--rdzv_conf secret_file=PATH, or " + std::string(store::kSecretEnv) +
         "): the rendezvous store at " + o.master_addr + ":" + std::to_string(o.master_port) +
         " is open to anyone who can reach that port; give every node's launcher the same secret to close it";
}

}  // namespace dtrain::run
