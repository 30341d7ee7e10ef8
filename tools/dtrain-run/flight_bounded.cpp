// The flight records' analysis in a child process with a time and a memory limit (flight.h).
//
// Note [Bounded flight analysis]: the records the launcher analyses come from anywhere: node 0
// reads what every node put into the store, and `--analyze` reads a folder collected elsewhere.
// The reader bounds what a file expands to (Note [Pickle budget]), but linearly with a large
// factor, and the analysis compares every member's calls at every sequence number, so a hostile
// record still costs memory and time out of proportion to its size. The analysis therefore runs
// in a child process: this program again (`--analyze-child`, exec'd so that nothing of the
// launcher's threads is inherited), which limits its own address space to what it has mapped at
// start plus the memory limit (a sanitizer's reservations are mapped by then and do not count),
// and which the parent kills at the time limit. SIGINT, SIGTERM and SIGHUP stop it too: the
// launcher keeps them blocked (it reads them through a signalfd), so the parent looks for them
// pending every 50 ms, kills the child and leaves them pending for the caller.
#include "flight.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <stdexcept>

#include "common/util.h"
#include "output.h"

namespace dtrain::run {
namespace {

constexpr int kChildOutOfMemory = 3;

// The address space this process has mapped now (VmSize), in bytes; 0 if /proc cannot say.
uint64_t mapped_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmSize:", 0) == 0) return std::strtoull(line.c_str() + 7, nullptr, 10) * 1024;
  return 0;
}

[[noreturn]] void out_of_memory() { _exit(kChildOutOfMemory); }

bool stop_signal_pending() {
  sigset_t pending;
  if (sigpending(&pending) != 0) return false;
  return sigismember(&pending, SIGINT) == 1 || sigismember(&pending, SIGTERM) == 1 ||
         sigismember(&pending, SIGHUP) == 1;
}

pid_t start_child(const std::string& dir, int world_size, bool only_findings, const AnalysisLimits& limits,
                  int out_fd) {
  const std::string world = std::to_string(world_size), only = only_findings ? "1" : "0",
                    memory = std::to_string(limits.memory_mb);
  const char* args[] = {"dtrain-run", "--analyze-child", dir.c_str(), world.c_str(),
                        only.c_str(), memory.c_str(),    nullptr};
  const pid_t pid = fork();
  if (pid < 0)
    throw std::runtime_error(std::string("cannot start the flight-record analysis: ") + std::strerror(errno));
  if (pid == 0) {  // async-signal-safe calls only until exec
    dup2(out_fd, STDOUT_FILENO);
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // a launcher killed outright takes its analysis with it
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int s : {SIGINT, SIGTERM, SIGHUP}) sigaction(s, &dfl, nullptr);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execv("/proc/self/exe", const_cast<char* const*>(args));
    _exit(127);
  }
  return pid;
}

}  // namespace

std::vector<std::string> bounded_analysis_report(const std::string& dir, int world_size, bool only_findings,
                                                 const AnalysisLimits& limits) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0)
    throw std::runtime_error(std::string("cannot start the flight-record analysis: ") + std::strerror(errno));
  pid_t pid;
  try {
    pid = start_child(dir, world_size, only_findings, limits, fds[1]);
  } catch (...) {
    close(fds[0]);
    close(fds[1]);
    throw;
  }
  close(fds[1]);
  const int64_t deadline = util::now_ns() + int64_t{limits.seconds} * 1000000000;
  std::string out;
  std::string stopped;  // why the parent killed the child, if it did
  for (;;) {
    if (stop_signal_pending())
      stopped = "stopped: a signal interrupted it";
    else if (util::now_ns() > deadline)
      stopped = "stopped at its time limit of " + std::to_string(limits.seconds) + " s" +
                " (a hostile or damaged record? run dtrain-run --analyze DIR --time_limit S for longer)";
    if (!stopped.empty()) {
      kill(pid, SIGKILL);
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    char buf[4096];
    const ssize_t n = read(fds[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  const std::string what = "the analysis of the flight records in " + dir + " ";
  if (!stopped.empty()) throw std::runtime_error(what + stopped);
  if (WIFEXITED(status) && WEXITSTATUS(status) == kChildOutOfMemory)
    throw std::runtime_error(what + "stopped at its memory limit of " + std::to_string(limits.memory_mb) +
                             " MiB (a hostile or damaged record? run dtrain-run --analyze DIR --memory_limit_mb N " +
                             "for more)");
  const std::vector<std::string> lines = util::split(out);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 1 && !lines.empty()) throw std::runtime_error(lines[0]);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error(what + "failed (" +
                             (WIFSIGNALED(status) ? "signal " + std::to_string(WTERMSIG(status))
                                                  : "exit status " + std::to_string(WEXITSTATUS(status))) +
                             ")");
  return lines;
}

int run_analyze_child(int argc, char** argv) {
  if (argc != 6) return 2;
  const uint64_t limit = std::strtoull(argv[5], nullptr, 10) << 20;
  const uint64_t now = mapped_bytes();
  if (now > 0) {
    const rlimit r{now + limit, now + limit};
    setrlimit(RLIMIT_AS, &r);
  }
  std::set_new_handler(out_of_memory);
  try {
    for (const auto& line : analysis_report(argv[2], std::atoi(argv[3]), std::string(argv[4]) == "1")) {
      const std::string l = line + "\n";
      write_fully(STDOUT_FILENO, l.data(), l.size());
    }
    return 0;
  } catch (const std::bad_alloc&) {
    return kChildOutOfMemory;
  } catch (const std::exception& e) {
    const std::string l = std::string(e.what()) + "\n";
    write_fully(STDOUT_FILENO, l.data(), l.size());
    return 1;
  }
}

}  // namespace dtrain::run
