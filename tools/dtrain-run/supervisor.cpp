// Supervising one attempt (see supervisor.h for the steps).
#include "supervisor.h"

#include "common/util.h"
#include "env.h"
#include "flight.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace dtrain::run {

namespace {

double now_s() { return dtrain::util::now_ns() * 1e-9; }

// The waitpid status of the exit waitid reported in `si` (Linux's encoding, which WIFEXITED,
// WEXITSTATUS and WTERMSIG read).
int wait_status(const siginfo_t& si) {
  if (si.si_code == CLD_EXITED) return (si.si_status & 0xff) << 8;
  return (si.si_status & 0x7f) | (si.si_code == CLD_DUMPED ? 0x80 : 0);
}

// The folder `path` and those above it. The ones dtrain-run makes below --log_dir
// (<run_id>/attempt_<k>/<rank>) must be real folders of this user, each checked before the next is
// made inside it: one planted as a link (or by someone else) would take the logs wherever it points.
void make_log_folders(const std::string& log_dir, const std::string& path) {
  for (size_t pos = 1; pos <= path.size(); ++pos) {
    if (pos != path.size() && path[pos] != '/') continue;
    const std::string part = path.substr(0, pos);
    if (mkdir(part.c_str(), 0755) != 0 && errno != EEXIST)
      throw std::runtime_error("cannot create log directory '" + part + "': " + std::strerror(errno) +
                               " (choose another --log_dir)");
    if (pos <= log_dir.size()) continue;
    struct stat sb {};
    if (lstat(part.c_str(), &sb) != 0 || !S_ISDIR(sb.st_mode) || sb.st_uid != geteuid())
      throw std::runtime_error("log directory '" + part + "' is " +
                               (S_ISLNK(sb.st_mode) ? "a symbolic link" : "not a folder of this user") +
                               ": remove it, or choose another --log_dir");
  }
}

// A fresh file, never through a link (O_EXCL | O_NOFOLLOW). A log of an earlier run with the same
// --run_id is replaced: unlink removes a link itself, never what it points to.
int open_log(const std::string& path) {
  for (int attempt = 0;; ++attempt) {
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0) return fd;
    if (errno != EEXIST || attempt == 1 || unlink(path.c_str()) != 0)
      throw std::runtime_error("cannot open log file '" + path + "': " + std::strerror(errno));
  }
}

}  // namespace

struct Supervisor::Worker {
  WorkerSpec spec;
  pid_t pid = -1;
  bool alive = false;   // running
  bool zombie = false;  // exited, not reaped yet (Note [Held zombies])
  int status = 0;
  int out_fd = -1, err_fd = -1;
  std::unique_ptr<OutputStream> out, err;
};

Supervisor::Supervisor(const LaunchOptions& options, uint16_t master_port, int signal_fd, NodeRendezvous* rdzv,
                       Watch watch)
    : opts_(options),
      master_port_(master_port),
      signal_fd_(signal_fd),
      rdzv_(rdzv),
      watch_(std::move(watch)),
      console_(options.progress_bar ? STDOUT_FILENO : -1) {}

Supervisor::~Supervisor() {
  kill_groups(SIGKILL);  // only reached with live workers if an exception escaped
  for (auto& w : workers_) {
    if (w->alive || w->zombie) waitpid(w->pid, nullptr, 0);
    if (w->out_fd >= 0) close(w->out_fd);
    if (w->err_fd >= 0) close(w->err_fd);
  }
}

std::string Supervisor::log_path(int attempt, int local_rank) const {
  return opts_.run_log_dir + "/attempt_" + std::to_string(attempt) + "/" + std::to_string(local_rank);
}

void Supervisor::start_workers(int attempt) {
  for (auto& spec : make_worker_specs(opts_, master_port_, attempt)) {
    auto w = std::make_unique<Worker>();
    w->spec = std::move(spec);
    // Where the worker writes its flight record: the user's DTRAIN_FLIGHT_DIR, else the attempt's.
    auto dir = std::find_if(w->spec.env.begin(), w->spec.env.end(),
                            [](const std::string& kv) { return kv.rfind("DTRAIN_FLIGHT_DIR=", 0) == 0; });
    if (dir != w->spec.env.end()) {
      flight_dir_ = dir->substr(std::strlen("DTRAIN_FLIGHT_DIR="));
    } else {
      if (flight_dir_.empty() && !opts_.log_dir.empty()) {  // beside the logs, made as safely as they are
        flight_dir_ = opts_.run_log_dir + "/attempt_" + std::to_string(attempt) + "/flight";
        make_log_folders(opts_.log_dir, flight_dir_);
      } else if (flight_dir_.empty()) {
        flight_dir_ = make_temp_flight_dir(attempt);
      }
      w->spec.env.push_back("DTRAIN_FLIGHT_DIR=" + flight_dir_);
    }
    make_streams(*w, attempt, "");
    SpawnedWorker s = spawn_worker(w->spec);  // throws: the destructor stops those already started
    w->pid = s.pid;
    w->alive = true;
    w->out_fd = s.stdout_fd;
    w->err_fd = s.stderr_fd;
    workers_.push_back(std::move(w));
  }
}

// The worker's output streams: the console and, with --log_dir, <attempt>/<local rank>/std{out,err}<suffix>.log.
void Supervisor::make_streams(Worker& worker, int attempt, const std::string& suffix) {
  Worker* w = &worker;
  int out_log = -1, err_log = -1;
  bool out_console = true, err_console = true;
  if (!opts_.log_dir.empty()) {
    const std::string dir = log_path(attempt, w->spec.local_rank);
    make_log_folders(opts_.log_dir, dir);
    out_log = open_log(dir + "/stdout" + suffix + ".log");
    err_log = open_log(dir + "/stderr" + suffix + ".log");
    // torchrun's to_map: a per-local-rank --redirects/--tee gives the local ranks it does not name none.
    const int redirects = opts_.redirects.of(w->spec.local_rank), tee = opts_.tee.of(w->spec.local_rank);
    out_console = !(redirects & kStdOut) || (tee & kStdOut);
    err_console = !(redirects & kStdErr) || (tee & kStdErr);
  }
  const auto& shown = opts_.local_ranks_filter;  // --local_ranks_filter: the console only
  if (!shown.empty() && std::find(shown.begin(), shown.end(), w->spec.local_rank) == shown.end())
    out_console = err_console = false;
  w->out = std::make_unique<OutputStream>(w->spec.rank, out_console ? STDOUT_FILENO : -1, out_log, false, &console_,
                                          opts_.progress_bar && w->spec.rank == 0);
  w->err = std::make_unique<OutputStream>(w->spec.rank, err_console ? STDERR_FILENO : -1, err_log, true, &console_);
}

AttemptResult Supervisor::run_attempt(int attempt) {
  attempt_ = attempt;
  start_workers(attempt);  // 1.
  const int interval_ms = std::max(1, static_cast<int>(opts_.monitor_interval * 1000));
  double next_monitor = now_s() + opts_.monitor_interval;
  for (;;) {  // 2.
    bool any_alive = false;
    for (auto& w : workers_) any_alive |= w->alive;
    if (!any_alive) break;
    int timeout_ms = interval_ms;
    // In double: --grace_period inf puts the deadline at infinity, which no int holds.
    if (kill_deadline_ > 0)
      timeout_ms = static_cast<int>(std::min<double>(timeout_ms, std::max(0.0, (kill_deadline_ - now_s()) * 1000 + 1)));
    poll_once(timeout_ms);
    handle_signals();
    reap();
    if (kill_deadline_ > 0 && now_s() >= kill_deadline_) {
      kill_groups(SIGKILL);
      kill_deadline_ = 0;
    }
    if (rdzv_ && now_s() >= next_monitor) {
      check_remote();
      next_monitor = now_s() + opts_.monitor_interval;
    }
  }
  kill_groups(SIGKILL);  // 3.
  for (auto& w : workers_)
    if (w->zombie) {
      waitpid(w->pid, nullptr, 0);
      w->zombie = false;
    }
  drain_pipes();
  console_.end_bar();
  report_flight_records();

  AttemptResult r;
  if (forwarded_signal_) {
    r.exit_code = 128 + forwarded_signal_;
    r.summary = "received " + signal_name(forwarded_signal_) + ": forwarded it to the workers and stopped them";
  } else if (failed_index_ >= 0) {
    r.exit_code = 1;
    r.worker_failed = true;
    const Worker& w = *workers_[static_cast<size_t>(failed_index_)];
    r.summary = failure_summary(w, attempt);
    if (opts_.log_dir.empty()) {
      r.tail_rank = w.spec.rank;
      r.tail.assign(w.err->tail().begin(), w.err->tail().end());
    }
  } else if (!remote_summary_.empty()) {
    r.exit_code = 1;
    r.summary = remote_summary_;
  }
  return r;
}

void Supervisor::poll_once(int timeout_ms) {
  std::vector<pollfd> fds;
  fds.push_back({signal_fd_, POLLIN, 0});
  for (auto& w : workers_) {
    if (w->out_fd >= 0) fds.push_back({w->out_fd, POLLIN, 0});
    if (w->err_fd >= 0) fds.push_back({w->err_fd, POLLIN, 0});
  }
  if (poll(fds.data(), fds.size(), timeout_ms) <= 0) return;
  for (auto& w : workers_) {
    read_pipe(w->out_fd, *w->out);
    read_pipe(w->err_fd, *w->err);
  }
}

void Supervisor::read_pipe(int& fd, OutputStream& stream) {
  if (fd < 0) return;
  char buf[65536];
  for (int rounds = 0; rounds < 16; ++rounds) {  // bounded, so one chatty worker can't starve the rest
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n > 0) {
      stream.consume(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    close(fd);  // EOF (or error)
    fd = -1;
    stream.finish();
    return;
  }
}

void Supervisor::handle_signals() {
  signalfd_siginfo si{};
  while (read(signal_fd_, &si, sizeof(si)) == ssize_t(sizeof(si))) {
    int signo = static_cast<int>(si.ssi_signo);
    if (signo == SIGCHLD) continue;        // reap() runs every iteration anyway
    if (forwarded_signal_ || stopping_) {  // a second signal: no more grace
      if (!forwarded_signal_) forwarded_signal_ = signo;
      kill_groups(SIGKILL);
      continue;
    }
    forwarded_signal_ = signo;
    if (rdzv_) {
      try {
        rdzv_->publish_failure(attempt_, opts_.node_rank, "its launcher received " + signal_name(signo));
      } catch (const std::exception&) {
      }
    }
    stop_all(signo);
  }
}

void Supervisor::reap() {
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker& w = *workers_[i];
    if (!w.alive) continue;
    siginfo_t si{};
    const int r = waitid(P_PID, static_cast<id_t>(w.pid), &si, WEXITED | WNOHANG | WNOWAIT);
    if ((r == 0 && si.si_pid == 0) || (r < 0 && errno == EINTR)) continue;
    w.alive = false;
    w.zombie = r == 0;
    const int status = r == 0 ? wait_status(si) : 0;
    w.status = status;
    const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (failed && !stopping_ && failed_index_ < 0 && opts_.ft && ft_relaunches_ < opts_.max_restarts) {
      // On several nodes a replica may have died because node 0's store (the quorum's) is gone: then
      // this node stops with that one line, not with replicas relaunched to fail again.
      if (rdzv_) check_remote();
      if (stopping_) continue;
      relaunch(w);
      continue;
    }
    if (failed && !stopping_ && failed_index_ < 0) {
      failed_index_ = static_cast<int>(i);
      if (rdzv_) {
        try {
          rdzv_->publish_failure(attempt_, opts_.node_rank, failure_summary(w, attempt_, /*for_remote=*/true));
        } catch (const std::exception&) {
        }
      }
      collect_flight_records();
      stop_all(SIGTERM);
    }
  }
}

void Supervisor::stop_all(int signo) {
  stopping_ = true;
  kill_groups(signo);
  // A worker frozen with SIGSTOP would only see the signal at SIGKILL time: wake it so it can act on
  // signo within the grace period.
  kill_groups(SIGCONT);
  kill_deadline_ = now_s() + opts_.grace_period;
}

// Note [Held zombies]: a worker that exits is seen with waitid(WNOWAIT) and reaped only after the
// attempt's last SIGKILL to its process group (or when --ft relaunches it): the zombie keeps its pid,
// and so the number of its group, from being given to another process. Reaped at once, the number of
// a group its children have left could go, after the kernel's pids wrap around (pid_max is 32768 on
// many machines), to an unrelated process that leads a group of its own, and the attempt's SIGTERM,
// SIGCONT and SIGKILL to the group would reach that process instead.
void Supervisor::kill_groups(int signo) {
  // The group of a worker that exited may still hold its children; an empty group gives ESRCH. A
  // worker already reaped is skipped: its number may be another process's now.
  for (auto& w : workers_)
    if (w->pid > 0 && (w->alive || w->zombie)) killpg(w->pid, signo);
}

void Supervisor::check_remote() {
  if (stopping_) return;
  try {
    // The elastic watch first: its requests wait a few heartbeats at most, so a node 0 that stopped
    // answering is noticed there, not after the rendezvous client's --rdzv_timeout.
    if (watch_) {
      if (auto why = watch_()) {
        remote_summary_ = *why;
        stop_all(SIGTERM);
        return;
      }
    }
    if (auto f = rdzv_->remote_failure(attempt_, opts_.node_rank)) {
      remote_summary_ = "stopped this node's workers: " + *f;
      collect_flight_records();
      stop_all(SIGTERM);
      return;
    }
    if (!node0_done_seen_ && opts_.node_rank != 0) node0_done_seen_ = rdzv_->node0_done();
  } catch (const dtrain::store::TimeoutError&) {
    if (node0_done_seen_) return;
    remote_summary_ = "stopping this node's workers: " + rdzv_->silent_host_line() + ", so the job ends";
    stop_all(SIGTERM);
  } catch (const std::exception& e) {
    if (node0_done_seen_) return;  // node 0 finished cleanly and took its store: keep going
    remote_summary_ = "stopping this node's workers: lost the rendezvous at " + rdzv_->client().host() + ":" +
                      std::to_string(rdzv_->client().port()) + " (did node 0's launcher die?): " + e.what();
    stop_all(SIGTERM);
  }
}

// Note [Replica relaunch]: under --ft a failed worker belongs to one replica of the job's
// fault-tolerant training (dtrain::ft::Manager); the other replicas go on without it, so only its
// replica is started again: its workers (--ft_replica_ranks consecutive ones, one failure unit) are
// killed, their process groups too, what their pipes still hold is shown, and each is respawned with
// the same environment but DTRAIN_RESTART_COUNT = the replica's relaunches, which keys the replica's
// own rendezvous afresh. The new processes heal from a live replica.
void Supervisor::relaunch(Worker& failed) {
  ++ft_relaunches_;
  const int k = opts_.ft_replica_ranks, replica = failed.spec.rank / k;
  const int count = ++ft_replica_relaunches_[replica];
  console_.write(STDERR_FILENO, "dtrain-run: rank " + std::to_string(failed.spec.rank) + " (pid " +
                                    std::to_string(failed.pid) + ") " + describe_status(failed.status) +
                                    "; relaunching its replica " + std::to_string(replica) + " alone (--ft, relaunch " +
                                    std::to_string(ft_relaunches_) + " of " + std::to_string(opts_.max_restarts) +
                                    ")\n");
  for (auto& wp : workers_) {
    Worker& w = *wp;
    if (w.spec.rank / k != replica) continue;
    if (w.alive || w.zombie) {  // its number is still its own
      ::kill(-w.pid, SIGKILL);
      waitpid(w.pid, &w.status, 0);  // reaped here, so reap() never counts it as a failure
    }
    w.alive = w.zombie = false;  // until it is spawned again below
    const double deadline = now_s() + 1.0;
    while ((w.out_fd >= 0 || w.err_fd >= 0) && now_s() < deadline) {
      read_pipe(w.out_fd, *w.out);
      read_pipe(w.err_fd, *w.err);
      if (w.out_fd >= 0 || w.err_fd >= 0) usleep(5000);
    }
    for (int* fd : {&w.out_fd, &w.err_fd})
      if (*fd >= 0) close(*fd), *fd = -1;
    for (std::string& kv : w.spec.env)
      if (kv.rfind("DTRAIN_RESTART_COUNT=", 0) == 0 || kv.rfind("TORCHELASTIC_RESTART_COUNT=", 0) == 0)
        kv = kv.substr(0, kv.find('=') + 1) + std::to_string(count);
    make_streams(w, attempt_, ".relaunch" + std::to_string(count));
    SpawnedWorker sp = spawn_worker(w.spec);
    w.pid = sp.pid;
    w.alive = true;
    w.out_fd = sp.stdout_fd;
    w.err_fd = sp.stderr_fd;
  }
}

void Supervisor::drain_pipes() {
  const double deadline = now_s() + 2.0;  // grandchildren are dead; a setsid'd one may still hold a pipe
  for (;;) {
    bool open = false;
    for (auto& w : workers_) open |= w->out_fd >= 0 || w->err_fd >= 0;
    if (!open || now_s() >= deadline) break;
    poll_once(50);
  }
  for (auto& w : workers_) {
    for (int* fd : {&w->out_fd, &w->err_fd})
      if (*fd >= 0) close(*fd), *fd = -1;
    w->out->finish();
    w->err->finish();
  }
}

std::string Supervisor::failure_summary(const Worker& w, int attempt, bool for_remote) const {
  std::string s = "rank " + std::to_string(w.spec.rank) + " (local rank " + std::to_string(w.spec.local_rank) +
                  ", pid " + std::to_string(w.pid) + ") failed first: it " + describe_status(w.status);
  if (!opts_.log_dir.empty()) {
    const std::string dir = log_path(attempt, w.spec.local_rank);
    s += "; logs" + std::string(for_remote ? " on that node" : "") + ": " + dir + "/stderr.log and " + dir +
         "/stdout.log";
  } else if (for_remote) {
    s += "; see that node's console";
  } else if (w.err->tail().empty()) {
    s += "; it wrote nothing to stderr (no --log_dir)";
  } else {
    s += "; no --log_dir: last lines shown above";
  }
  return s;
}

}  // namespace dtrain::run

namespace dtrain::run {

void Supervisor::collect_flight_records() {
  if (flight_collected_ || flight_dir_.empty()) return;
  flight_collected_ = true;
  std::vector<std::pair<pid_t, int>> live;
  std::vector<int> ranks;
  for (auto& w : workers_) {
    ranks.push_back(w->spec.rank);
    if (w->alive) live.emplace_back(w->pid, w->spec.rank);
  }
  request_dumps(flight_dir_, live, [this] { poll_once(50); });
  if (!rdzv_) return;
  try {
    // A node 0 that stopped answering must not hold this node's stop for a whole request deadline.
    dtrain::store::ScopedTimeout quick(rdzv_->client(), std::chrono::seconds(3));
    share_dumps(rdzv_->client(), attempt_, flight_dir_, ranks);
  } catch (const std::exception&) {
    // The store is gone: node 0 analyses what it has.
  }
}

void Supervisor::report_flight_records() {
  if (!flight_collected_ || (rdzv_ && opts_.node_rank != 0)) return;
  const int world = opts_.nnodes * opts_.nproc_per_node;
  try {
    // Workers without dtrain leave no records: then nothing is gathered (a stopped node's would be
    // waited for in vain) and nothing is printed.
    if (!has_records(flight_dir_)) return;
    if (rdzv_) {
      dtrain::store::ScopedTimeout quick(rdzv_->client(), std::chrono::seconds(3));
      gather_dumps(rdzv_->client(), attempt_, flight_dir_, world);
    }
    // Node 0 analyses records other nodes sent: bounded (see Note [Bounded flight analysis]).
    for (const auto& line : bounded_analysis_report(flight_dir_, world, /*only_findings=*/true, AnalysisLimits{}))
      std::fprintf(stderr, "dtrain-run: %s\n", line.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain-run: the flight records in %s could not be analysed: %s\n", flight_dir_.c_str(),
                 e.what());
  }
}

}  // namespace dtrain::run
