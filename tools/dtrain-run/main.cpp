// dtrain-run: the torchrun-style launcher. Starts --nproc_per_node workers on this node with
// torchrun's environment (env.h), after a rendezvous with the other nodes (rendezvous.h), and
// supervises them (supervisor.h). It does not link LibTorch and starts in milliseconds.
//
// Steps:
//   1. Parse the command line (options.h); usage errors exit 2 with one "dtrain-run: " line. Under
//      srun, node 0 says which node rank, world and master the step gave (slurm_step.h).
//   2. Block SIGINT/SIGTERM/SIGHUP/SIGCHLD before any thread exists (the store thread inherits
//      the mask), ignore SIGPIPE. Node 0 starts the StoreServer on master_addr:master_port
//      (--standalone: port 0, a free port; bind errors exit 1).
//   3. Rendezvous with the other nodes (multi-node only; the main thread takes SIGINT etc.
//      with their default action meanwhile: there is nothing to clean up yet).
//   4. Re-block the signals, read them through a signalfd, run the attempt; after a worker failure
//      run a fresh attempt (all workers restarted) up to --max_restarts times.
//   5. Report: a failed rank's last stderr lines (without --log_dir) and ONE summary line; node 0
//      waits (bounded) for every node to finish before its store goes away. Exit 0, 1 or 128+signo.
// With --nnodes MIN:MAX (elastic.h) steps 3-5 follow node 0's elastic rendezvous instead
// (run_elastic: who hosts, one transition line per attempt, node 0's decision after each).
#include "common/env.h"
#include "common/util.h"
#include "elastic.h"
#include "flight.h"
#include "ft_nodes.h"
#include "options.h"
#include "output.h"
#include "rendezvous.h"
#include "secret.h"
#include "store/store.h"
#include "supervisor.h"

#include <signal.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>

using namespace dtrain::run;

namespace {

void say(const std::string& line) {
  std::string s = "dtrain-run: " + line + "\n";
  write_fully(STDERR_FILENO, s.data(), s.size());
}

sigset_t handled_signals(bool with_chld) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  if (with_chld) sigaddset(&set, SIGCHLD);
  return set;
}

// Without --log_dir: the failed rank's last stderr lines.
void show_tail(const AttemptResult& result) {
  if (result.tail.empty()) return;
  say("last " + std::to_string(result.tail.size()) + " lines of rank " + std::to_string(result.tail_rank) +
      "'s stderr:");
  std::string block;
  for (const auto& l : result.tail) block += "[rank " + std::to_string(result.tail_rank) + "] " + l + "\n";
  write_fully(STDERR_FILENO, block.data(), block.size());
}

// Several nodes with --max_restarts: every node learns every node's exit code of the attempt
// (rendezvous.h, step 6) and turns it into the same decision. Returns false when this node must stop
// now (it was signalled, or another node was); else `result` holds the job's outcome: 1 when any node
// failed (so every node restarts together while restarts remain), 0 when all succeeded.
bool job_wide_outcome(NodeRendezvous& rdzv, const LaunchOptions& o, int attempt, AttemptResult& result) {
  std::vector<int> codes;
  try {
    codes = rdzv.attempt_outcomes(attempt, o.node_rank, o.nnodes, result.exit_code);
  } catch (const std::exception& e) {
    result.exit_code = 1;
    result.summary = e.what();
    return false;
  }
  if (result.exit_code != 0 && result.exit_code != 1) return false;
  for (int r = 0; r < o.nnodes; ++r) {
    const int c = codes[static_cast<size_t>(r)];
    if (c != 0 && c != 1) {
      result.exit_code = 1;
      result.summary = "node " + std::to_string(r) + "'s launcher was stopped by a signal (exit " + std::to_string(c) +
                       "): no restart";
      return false;
    }
    if (c == 1 && result.exit_code == 0) {
      result.exit_code = 1;
      result.summary = "node " + std::to_string(r) + " failed in attempt " + std::to_string(attempt) +
                       " (this node's workers had finished)";
    }
  }
  return true;
}

std::chrono::milliseconds seconds(double s) { return dtrain::util::millis_of_seconds(s); }

// How long node 0 keeps the store up for the other nodes once its job ended
// (Note [Store deadlines and closing] in rendezvous.h): after a failure it closes the rendezvous
// within close_timeout; after a success it waits for them as torchrun's exit barrier does. Never more
// than --rdzv_timeout.
std::chrono::milliseconds node0_linger(const LaunchOptions& o, int exit_code) {
  return seconds(exit_code == 0 ? o.rdzv_timeout : std::min(o.close_timeout, o.rdzv_timeout));
}

// The name other nodes are told this node by: --local_addr, else the host name.
std::string node_name(const LaunchOptions& o) {
  return o.local_addr.empty() ? dtrain::util::host_name() : o.local_addr;
}

// Note [Names that resolve late] (src/store/resolve.cpp): before node 0 binds the master's name and the
// others connect to it, a name that does not resolve yet (a pod's DNS record) is waited for, within
// --rdzv_timeout, with one line. Signals are not blocked yet, so Ctrl-C ends the wait.
void wait_for_master_name(const LaunchOptions& o) {
  dtrain::store::resolve_waiting(o.master_addr, uint16_t(o.master_port),
                                 dtrain::util::millis_of_seconds(o.rdzv_timeout),
                                 o.c10d ? "--rdzv_endpoint" : "--master_addr", say);
}

// A folder made with mkdtemp from `pattern` (ending in XXXXXX).
std::string make_temp_folder(const std::string& pattern) {
  std::string path = pattern;
  if (!mkdtemp(path.data()))
    throw std::runtime_error("cannot create the log folder '" + pattern + "': " + std::strerror(errno) +
                             " (choose another --log_dir)");
  return path;
}

// torchrun's log layout: every attempt's files under <log_dir>/<run_id>_<random>/ (a fresh folder, so
// two runs with one --run_id never mix); --tee or --redirects without --log_dir write to a new folder
// under TMPDIR, as torchrun does, and say where.
void prepare_log_dir(LaunchOptions& o) {
  if (o.log_dir.empty() && !o.tee.any() && !o.redirects.any()) return;
  if (o.log_dir.empty()) {
    o.log_dir = make_temp_folder(dtrain::env::text("TMPDIR").value_or("/tmp") + "/dtrain-run_XXXXXX");
    say("the log files of --tee/--redirects go to " + o.log_dir + " (no --log_dir was given)");
  }
  for (size_t pos = 1; pos <= o.log_dir.size(); ++pos) {  // mkdir -p
    if (pos != o.log_dir.size() && o.log_dir[pos] != '/') continue;
    const std::string part = o.log_dir.substr(0, pos);
    if (mkdir(part.c_str(), 0755) != 0 && errno != EEXIST)
      throw std::runtime_error("cannot create log directory '" + part + "': " + std::strerror(errno) +
                               " (choose another --log_dir)");
  }
  o.run_log_dir = make_temp_folder(o.log_dir + "/" + o.run_id + "_XXXXXX");
}

// Note [Workers' store]: torchrun's rank-0 node publishes its address, --local_addr or else its FQDN, in
// the rendezvous with the port of a store it serves there, and every worker gets them as MASTER_ADDR
// and MASTER_PORT (RendezvousStoreInfo.build). Node 0 of a c10d job, elastic or on one node, does the
// same with --local_addr: it serves the workers a store of their own at that address (a free port;
// the address must be this machine's), into *addr and *port, which an elastic node 0 publishes to
// the others. Without --local_addr the workers keep the rendezvous endpoint, where the launchers'
// store already is and which every node reached: an FQDN that other machines may not resolve (a
// pod's) would make the job fail where torchrun's own default does. The static form keeps torchrun's
// meaning: --local_addr names the node, nothing more.
std::unique_ptr<dtrain::store::StoreServer> workers_store(const LaunchOptions& given, std::string* addr,
                                                          uint16_t* port) {
  if (given.local_addr.empty()) return nullptr;
  std::unique_ptr<dtrain::store::StoreServer> store;
  try {
    store = std::make_unique<dtrain::store::StoreServer>(given.local_addr, 0, given.secret);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error("--local_addr " + given.local_addr +
                             ": node 0 serves the workers' store at its --local_addr, and cannot: " + e.what() +
                             " (give an address of this machine, or leave --local_addr out)");
  }
  *addr = given.local_addr;
  *port = store->port();
  return store;
}

int run(const LaunchOptions& o) {
  if (o.nnodes > 1) wait_for_master_name(o);
  // 2.
  signal(SIGPIPE, SIG_IGN);
  sigset_t all = handled_signals(true), terminating = handled_signals(false);
  sigprocmask(SIG_BLOCK, &all, nullptr);
  std::unique_ptr<dtrain::store::StoreServer> server;
  if (o.node_rank == 0)
    server = std::make_unique<dtrain::store::StoreServer>(o.master_addr, uint16_t(o.master_port), o.secret);
  const uint16_t port = server ? server->port() : uint16_t(o.master_port);
  // Note [Workers' store]: --rdzv_backend c10d on one node (several run as run_elastic).
  LaunchOptions workers = o;
  uint16_t workers_port = port;
  std::unique_ptr<dtrain::store::StoreServer> for_workers;
  if (o.c10d && server) for_workers = workers_store(o, &workers.master_addr, &workers_port);

  // 3.
  std::optional<NodeRendezvous> rdzv;
  std::unique_ptr<FtNodes> ft_nodes;  // --ft on several nodes (Note [Replicas on several nodes] in ft_nodes.h)
  Supervisor::Watch watch;
  if (o.nnodes > 1) {
    pthread_sigmask(SIG_UNBLOCK, &terminating, nullptr);
    const auto timeout = dtrain::util::millis_of_seconds(o.rdzv_timeout);
    if (o.secret.empty()) say(open_store_warning(o));
    rdzv.emplace(o.master_addr, port, timeout, o.secret, seconds(o.read_timeout));
    rdzv->join(
        NodeInfo{o.nnodes, o.nproc_per_node, o.node_rank, o.max_restarts, o.ft ? o.ft_replica_ranks : 0, node_name(o)},
        say);
    if (!server) rdzv->watch_host(silent_host_after(dtrain::util::millis_of_seconds(o.monitor_interval)));
    pthread_sigmask(SIG_BLOCK, &terminating, nullptr);
    if (o.ft) {
      ft_nodes = std::make_unique<FtNodes>(*rdzv, o.node_rank, o.nnodes, o.master_addr, port, o.secret,
                                           seconds(o.monitor_interval));
      if (server)  // node 0 says which nodes it lost; their replicas' loss is the quorum's business
        watch = [&]() -> std::optional<std::string> {
          for (const std::string& line : ft_nodes->newly_gone()) say(line);
          return std::nullopt;
        };
    }
  }

  // 4.
  int sfd = signalfd(-1, &all, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sfd < 0) throw std::runtime_error(std::string("signalfd failed: ") + std::strerror(errno));
  // Note [Restart loop] in supervisor.h: a failed attempt (exit code 1: a worker failed) is followed
  // by a fresh one, with every worker restarted, until --max_restarts is used up. A signal to the
  // launcher (128+signo) or success ends the loop.
  AttemptResult result;
  int attempt = 0;
  for (;; ++attempt) {
    {
      Supervisor supervisor(workers, workers_port, sfd, rdzv ? &*rdzv : nullptr, watch);
      result = supervisor.run_attempt(attempt);
    }
    if (rdzv && rdzv->host_silent()) {  // nobody to agree with: the job ends here
      if (result.summary.find(rdzv->silent_host_line()) == std::string::npos)
        result.summary += (result.summary.empty() ? "" : "; ") + rdzv->silent_host_line() + ", so the job ends";
      result.exit_code = result.exit_code == 0 ? 1 : result.exit_code;
      break;
    }
    // --ft never restarts the group, so its nodes do not wait for each other's outcomes (a node that
    // is gone would never give one).
    if (rdzv && o.max_restarts > 0 && !o.ft && !job_wide_outcome(*rdzv, o, attempt, result)) break;
    // --ft spent its restarts on single replicas inside the attempt (supervisor.h, Note [Replica relaunch]).
    if (result.exit_code != 1 || attempt >= o.max_restarts || o.ft) break;
    show_tail(result);
    say("restarting all workers (restart " + std::to_string(attempt + 1) + " of " + std::to_string(o.max_restarts) +
        ") after: " + result.summary);
  }
  close(sfd);

  // 5.
  show_tail(result);
  if (server && server->rejected_connections() > 0)
    say("the rendezvous store refused " + std::to_string(server->rejected_connections()) +
        " connection(s) that did not prove the job's secret");
  if (!result.summary.empty())
    say(result.summary + (result.exit_code == 1 && attempt > 0
                              ? " (the last failure, after " + std::to_string(attempt) +
                                    " restart(s) of --max_restarts " + std::to_string(o.max_restarts) + ")"
                              : ""));
  if (rdzv && !rdzv->host_silent()) {
    try {  // Note [Store deadlines and closing] in rendezvous.h
      rdzv->mark_done(o.node_rank, result.exit_code, seconds(o.close_timeout));
      if (server && ft_nodes)
        ft_nodes->wait_done_or_gone(node0_linger(o, result.exit_code), say);
      else if (server)
        rdzv->wait_all_done(o.nnodes, node0_linger(o, result.exit_code));
    } catch (const std::exception&) {
      // The store is gone (node 0 finished first): nothing left to tell.
    }
  }
  return result.exit_code;
}

// Who hosts the elastic rendezvous: --node_rank 0 does and any other --node_rank does not; without
// --node_rank the launcher that can bind master_addr:master_port does (torchrun's c10d rendezvous
// decides the same way), so identical command lines on every node work. Null: this one joins.
std::unique_ptr<dtrain::store::StoreServer> host_rendezvous(const LaunchOptions& given) {
  const uint16_t port = uint16_t(given.master_port);
  bool warned = false;
  std::unique_ptr<dtrain::store::StoreServer> server;
  if (given.node_rank_given && given.node_rank == 0) {
    server = std::make_unique<dtrain::store::StoreServer>(given.master_addr, port, given.secret);
  } else if (!given.node_rank_given) {
    try {
      server = std::make_unique<dtrain::store::StoreServer>(given.master_addr, port, given.secret);
    } catch (const std::runtime_error&) {
      // Not this machine's address, or node 0 already serves it: this launcher joins as a client.
      // With a secret, the handshake proves the store there is this job's before it joins; without
      // one nothing can prove it, and it says so.
      if (given.secret.empty()) {
        say("could not host the rendezvous at " + given.master_addr + ":" + std::to_string(port) +
            ", so joins the store there, which nothing proves is this job's: give every launcher the same "
            "secret (--rdzv_conf secret_file=PATH) to make sure");
        warned = true;
      }
    }
  }
  if (given.secret.empty() && !warned) say(open_store_warning(given));
  return server;
}

ElasticOptions elastic_options(const LaunchOptions& given, bool host) {
  ElasticOptions eo;
  eo.min_nodes = given.min_nodes;
  eo.max_nodes = given.max_nodes;
  eo.nproc_per_node = given.nproc_per_node;
  eo.max_restarts = given.max_restarts;
  eo.hostname = node_name(given);
  eo.host = host;
  eo.beat_period = seconds(given.monitor_interval);
  eo.rdzv_timeout = seconds(given.rdzv_timeout);
  eo.last_call = seconds(given.rdzv_last_call);
  eo.secret = given.secret;
  eo.close_timeout = seconds(given.close_timeout);
  return eo;
}

// --nnodes MIN:MAX (elastic.h; protocol steps E1-E8 in rendezvous.h). Every attempt runs the group
// node 0 formed; after it, node 0's decision says: done, restart with a new group, or stop.
int run_elastic(const LaunchOptions& given) {
  wait_for_master_name(given);
  signal(SIGPIPE, SIG_IGN);
  sigset_t all = handled_signals(true), terminating = handled_signals(false);
  sigprocmask(SIG_BLOCK, &all, nullptr);
  const std::unique_ptr<dtrain::store::StoreServer> server = host_rendezvous(given);
  const uint16_t port = uint16_t(given.master_port);
  NodeRendezvous rdzv(given.master_addr, port, seconds(given.rdzv_timeout), given.secret, seconds(given.read_timeout));
  ElasticOptions eo = elastic_options(given, server != nullptr);
  rdzv.set_hostname(eo.hostname);
  eo.master_addr = given.master_addr;
  eo.master_port = port;
  const auto for_workers = server ? workers_store(given, &eo.master_addr, &eo.master_port) : nullptr;
  // Every request of a member's supervisor to node 0 (a remote failure, node 0's end) waits as long
  // as the elastic watch's: node 0 stopped between two of them must not hold this node for the
  // rendezvous's read_timeout (60 s) instead of a few heartbeats.
  if (!server) rdzv.watch_host(silent_host_after(eo.beat_period));
  ElasticRendezvous elastic(rdzv, given.master_addr, port, eo);
  pthread_sigmask(SIG_UNBLOCK, &terminating, nullptr);
  ElasticNext first = elastic.join(say);
  pthread_sigmask(SIG_BLOCK, &terminating, nullptr);
  if (!first.round) {  // the job could not start, or it ended while this node waited for a place
    say(first.message);
    return first.exit_code;
  }
  ElasticRound round = *first.round;

  int sfd = signalfd(-1, &all, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sfd < 0) throw std::runtime_error(std::string("signalfd failed: ") + std::strerror(errno));
  LaunchOptions o = given;
  o.master_addr = elastic.master_addr();  // the workers' (Note [Workers' store])
  int exit_code = 0;
  for (;;) {
    say(round.line);  // one line per transition
    o.nnodes = round.nnodes;
    o.node_rank = round.group_rank;
    AttemptResult result;
    {
      Supervisor supervisor(o, elastic.master_port(), sfd, &rdzv, [&] { return elastic.watch(round.attempt); });
      result = supervisor.run_attempt(round.attempt);
    }
    if (result.worker_failed) {
      show_tail(result);  // a worker of this node failed: say how, whatever node 0 decides
      say(result.summary);
    }
    ElasticNext next = elastic.finish_attempt(round.attempt, result.exit_code, say);
    if (!next.round) {
      exit_code = next.exit_code;
      if (!next.message.empty())
        say(next.message);
      else if (exit_code != 0 && !result.summary.empty() && !result.worker_failed)
        say(result.summary);  // a signal to this launcher
      break;
    }
    round = *next.round;
  }
  close(sfd);
  elastic.finish_job(exit_code != 0);
  return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  // `dtrain-run --analyze DIR`: the flight records' analysis alone (flight.h), no job.
  if (argc >= 2 && std::string(argv[1]) == "--analyze-child") return run_analyze_child(argc, argv);
  if (argc >= 2 && std::string(argv[1]).rfind("--analyze", 0) == 0) return run_analyze(argc, argv);
  LaunchOptions options;
  try {  // 1.
    options = parse_options(argc, argv);
  } catch (const HelpRequested& h) {
    std::fputs(h.text.c_str(), stdout);
    return 0;
  } catch (const UsageError& e) {
    say(e.what());
    return 2;
  }
  // A terminal that shows rank 0's stdout gets its progress bar drawn in place (Note [Launcher bar]).
  const int rank0 = options.local_rank_base;  // the local rank of rank 0 when this node has it
  options.progress_bar =
      isatty(STDOUT_FILENO) && (!(options.redirects.of(rank0) & kStdOut) || (options.tee.of(rank0) & kStdOut));
  if (!options.slurm_note.empty() && options.node_rank == 0) say(options.slurm_note);
  if (!options.launch_note.empty() && options.node_rank == 0) say(options.launch_note);
  struct RemoveTempFlightDir {
    ~RemoveTempFlightDir() { remove_temp_flight_dir(); }
  } at_exit;
  try {
    prepare_log_dir(options);
    return options.elastic ? run_elastic(options) : run(options);
  } catch (const std::exception& e) {
    say(e.what());
    return 1;
  }
}
