// Starting one worker process and describing how it ended.
//
// Steps of spawn_worker() (fork + exec):
//   1. Everything the child needs (argv, envp, pipe fds) is built BEFORE fork: node 0's launcher
//      runs the store thread, and after fork only async-signal-safe calls are allowed.
//   2. Child: setpgid(0,0) (own process group, so signals reach its whole tree), then
//      prctl(PR_SET_PDEATHSIG, SIGKILL) and a getppid() check (the launcher may already have died
//      before prctl), default signal dispositions and an empty signal mask (the launcher blocks
//      signals for its signalfd and ignores SIGPIPE), stdout/stderr onto the pipes, execve.
//   3. An exec failure is written as errno into a CLOEXEC pipe; the parent reads that pipe until
//      EOF (exec succeeded) or an errno (reported as a clear error, not a silent exit 127).
//   4. The parent also calls setpgid(pid, pid), so the group exists before it is ever signalled.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace dtrain::run {

struct WorkerSpec {
  int rank = 0;
  int local_rank = 0;
  std::string program_path;
  std::vector<std::string> argv;  // argv[0] = the program as the user named it
  std::vector<std::string> env;   // "KEY=VALUE"
};

struct SpawnedWorker {
  pid_t pid = -1;
  int stdout_fd = -1;  // read ends, non-blocking, CLOEXEC
  int stderr_fd = -1;
};

// Throws std::runtime_error naming the program when it cannot be started.
SpawnedWorker spawn_worker(const WorkerSpec& spec);

// "exited with code 3" / "was killed by SIGSEGV" from a waitpid status.
std::string describe_status(int status);

// "SIGSEGV" for 11.
std::string signal_name(int signo);

}  // namespace dtrain::run
