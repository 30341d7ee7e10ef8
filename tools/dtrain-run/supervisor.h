// Supervising one attempt: start the node's workers, multiplex their output, watch for failures
// and signals, and stop everything cleanly.
//
// Steps of Supervisor::run_attempt():
//   1. Create the log files (with --log_dir) and spawn every worker (worker.h), each in its own
//      process group. A worker that cannot be started stops the ones already started.
//   2. Loop on poll() over the workers' pipes and the launcher's signalfd, waking at least every
//      --monitor_interval:
//      a. pipe data -> OutputStream (output.h); EOF closes the stream.
//      b. SIGCHLD -> waitid(WNOHANG | WNOWAIT): an exited worker stays a zombie until 3
//         (Note [Held zombies] in supervisor.cpp). The first worker that exits non-zero or by a
//         signal is the failure: SIGTERM to every worker's process group, SIGKILL after
//         --grace_period. A multi-node job also publishes it in the store (rendezvous.h step 5).
//      c. SIGINT/SIGTERM/SIGHUP -> forwarded to every worker's process group, same grace/kill;
//         a second such signal kills at once. The attempt ends with exit code 128+signo.
//      d. Each --monitor_interval a multi-node job checks the store for another node's failure
//         (and an elastic job for a membership change) and stops this node's workers the same way.
//      e. Before b, c's failure or d stops the workers, their flight records are collected (flight.h).
//   3. When every worker has exited: SIGKILL each process group (grandchildren left behind by a
//      worker die too: no orphans), reap the workers, drain the pipes (bounded), flush partial
//      lines, and leave rank 0's progress bar (if any) as an ordinary line.
// Note [Restart loop]: run_attempt() leaves nothing running, so main.cpp's --max_restarts loop calls
// it again with attempt+1 on a fresh Supervisor (log paths: attempt_<k>/; workers see
// DTRAIN_RESTART_COUNT=k and the job store's keys are prefixed with it, so a new attempt never reads
// the last one's rendezvous keys). Workers resume from their own checkpoints (dtrain/checkpoint.h).
// Several nodes agree on each new attempt through the node rendezvous (rendezvous.h, steps 5-6).
#pragma once

#include "options.h"
#include "output.h"
#include "rendezvous.h"
#include "worker.h"

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::run {

struct AttemptResult {
  int exit_code = 0;           // 0 all good, 1 a worker (here or remote) failed, 128+signo on a signal
  std::string summary;         // one line for stderr (without the "dtrain-run: " prefix), empty on success
  bool worker_failed = false;  // a worker of this node failed (not a remote stop or a signal)
  int tail_rank = -1;          // without --log_dir: the failed rank's last stderr lines
  std::vector<std::string> tail;
};

class Supervisor {
 public:
  // signal_fd: a signalfd for SIGCHLD, SIGINT, SIGTERM, SIGHUP (blocked in the launcher).
  // rdzv may be null (single node). watch, when set, runs with step 2d and returns a reason to stop
  // this node's workers (an elastic membership change, elastic.h).
  using Watch = std::function<std::optional<std::string>()>;
  Supervisor(const LaunchOptions& options, uint16_t master_port, int signal_fd, NodeRendezvous* rdzv, Watch watch = {});
  ~Supervisor();
  AttemptResult run_attempt(int attempt);

 private:
  struct Worker;
  void start_workers(int attempt);
  void poll_once(int timeout_ms);
  void read_pipe(int& fd, OutputStream& stream);
  void handle_signals();
  void reap();
  void stop_all(int signo);  // begin stopping: signo to every group, SIGKILL after the grace period
  void kill_groups(int signo);
  void check_remote();
  void collect_flight_records();  // flight.h, steps 1-3
  void report_flight_records();   // flight.h, step 4
  void drain_pipes();
  void relaunch(Worker& w);
  void make_streams(Worker& w, int attempt,
                    const std::string& suffix);  // --ft: this worker alone (Note [Replica relaunch])
  std::string log_path(int attempt, int local_rank) const;
  std::string failure_summary(const Worker& w, int attempt, bool for_remote = false) const;

  const LaunchOptions& opts_;
  uint16_t master_port_;
  int signal_fd_;
  NodeRendezvous* rdzv_;
  Watch watch_;
  Console console_;  // the terminal's one writer (before workers_: their streams point to it)
  std::vector<std::unique_ptr<Worker>> workers_;

  // State of the attempt.
  bool stopping_ = false;
  double kill_deadline_ = 0;  // monotonic seconds; 0 = none
  int forwarded_signal_ = 0;
  int failed_index_ = -1;
  int ft_relaunches_ = 0;                     // --ft: replicas relaunched alone so far
  std::map<int, int> ft_replica_relaunches_;  // --ft: relaunches per replica
  std::string remote_summary_;
  bool node0_done_seen_ = false;
  int attempt_ = 0;
  std::string flight_dir_;  // the workers' DTRAIN_FLIGHT_DIR
  bool flight_collected_ = false;
};

}  // namespace dtrain::run
