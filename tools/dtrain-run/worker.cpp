// Starting one worker process (see worker.h for the steps).
#include "worker.h"

#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <stdexcept>

namespace dtrain::run {

namespace {

std::vector<char*> c_array(const std::vector<std::string>& v) {
  std::vector<char*> out;
  out.reserve(v.size() + 1);
  for (const auto& s : v) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

void close_pair(int p[2]) {
  if (p[0] >= 0) close(p[0]);
  if (p[1] >= 0) close(p[1]);
}

[[noreturn]] void child_fail(int report_fd, int err) {
  ssize_t ignored = write(report_fd, &err, sizeof(err));
  (void)ignored;
  _exit(127);
}

}  // namespace

std::string signal_name(int signo) {
  const char* abbrev = sigabbrev_np(signo);
  if (abbrev) return std::string("SIG") + abbrev;
  return "signal " + std::to_string(signo);
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    std::string s = "was killed by " + signal_name(WTERMSIG(status));
    if (WCOREDUMP(status)) s += " (core dumped)";
    return s;
  }
  return "ended with status " + std::to_string(status);
}

SpawnedWorker spawn_worker(const WorkerSpec& spec) {
  // 1. Everything before fork.
  std::vector<char*> argv = c_array(spec.argv);
  std::vector<char*> envp = c_array(spec.env);
  int out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1}, report[2] = {-1, -1};
  if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0 || pipe2(report, O_CLOEXEC) != 0) {
    int e = errno;
    close_pair(out_pipe), close_pair(err_pipe), close_pair(report);
    throw std::runtime_error(std::string("cannot create pipes for a worker: ") + strerror(e));
  }
  const pid_t launcher = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    int e = errno;
    close_pair(out_pipe), close_pair(err_pipe), close_pair(report);
    throw std::runtime_error(std::string("cannot fork a worker: ") + strerror(e));
  }
  if (pid == 0) {
    // 2. Child: async-signal-safe calls only.
    setpgid(0, 0);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) child_fail(report[1], errno);
    if (getppid() != launcher) _exit(127);  // the launcher died before prctl took effect
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int s = 1; s < NSIG; ++s) sigaction(s, &dfl, nullptr);  // fails harmlessly for KILL/STOP
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (dup2(out_pipe[1], STDOUT_FILENO) < 0 || dup2(err_pipe[1], STDERR_FILENO) < 0) child_fail(report[1], errno);
    execve(spec.program_path.c_str(), argv.data(), envp.data());
    child_fail(report[1], errno);  // 3.
  }
  // 4. Parent.
  setpgid(pid, pid);  // may fail with EACCES after exec: then the child already did it
  close(out_pipe[1]);
  close(err_pipe[1]);
  close(report[1]);
  int child_errno = 0;
  ssize_t n;
  do {
    n = read(report[0], &child_errno, sizeof(child_errno));
  } while (n < 0 && errno == EINTR);
  close(report[0]);
  if (n > 0) {
    int status = 0;
    waitpid(pid, &status, 0);
    close(out_pipe[0]);
    close(err_pipe[0]);
    std::string hint;
    if (child_errno == ENOENT) hint = " (the file exists: is its #! interpreter missing?)";
    if (child_errno == ENOEXEC) hint = " (not a binary for this machine, and no #! line)";
    throw std::runtime_error("cannot start '" + spec.program_path + "' for rank " + std::to_string(spec.rank) + ": " +
                             strerror(child_errno) + hint);
  }
  fcntl(out_pipe[0], F_SETFL, fcntl(out_pipe[0], F_GETFL) | O_NONBLOCK);
  fcntl(err_pipe[0], F_SETFL, fcntl(err_pipe[0], F_GETFL) | O_NONBLOCK);
  return SpawnedWorker{pid, out_pipe[0], err_pipe[0]};
}

}  // namespace dtrain::run
