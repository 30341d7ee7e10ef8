// dtrain-run's command line (see options.h for the steps).
#include "options.h"

#include <CLI/App.hpp>
#include <CLI/Config.hpp>
#include <CLI/Formatter.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>

#include "common/env.h"
#include "cluster.h"
#include "common/util.h"
#include "secret.h"
#include "slurm_step.h"

namespace dtrain::run {

namespace {

bool parse_int(const std::string& s, long long* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  *out = v;
  return true;
}

bool parse_double(const std::string& s, double* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(s.c_str(), &end);
  if (errno != 0 || *end != '\0' || v != v) return false;
  *out = v;
  return true;
}

// Resolves `program` like execvp does: names with a '/' as given, others through PATH.
std::string resolve_program(const std::string& program) {
  auto usable = [](const std::string& p) {
    struct stat st {};
    return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(p.c_str(), X_OK) == 0;
  };
  if (program.find('/') != std::string::npos) {
    struct stat st {};
    if (stat(program.c_str(), &st) != 0)
      throw UsageError("program '" + program + "' not found: " + std::strerror(errno));
    if (!usable(program))
      throw UsageError("program '" + program +
                       "' is not an executable file (chmod +x it, or run it through its interpreter)");
    return program;
  }
  const std::string dirs = *env::text("PATH");  // the table's fallback when unset
  size_t start = 0;
  for (;;) {
    size_t end = dirs.find(':', start);
    std::string dir = dirs.substr(start, end == std::string::npos ? std::string::npos : end - start);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
    if (usable(candidate)) return candidate;
    if (end == std::string::npos) break;
    start = end + 1;
  }
  throw UsageError("program '" + program + "' not found in PATH (give its path, e.g. ./" + program + ")");
}

// A flag whose value is a number in a range. The table below holds each one's names, help, default
// and rule, so that its check and its error message are written once:
// "<first name> must be <rule>, got '<value>'".
struct NumericFlag {
  const char* names;  // CLI11's, the first one named in errors
  const char* help;
  const char* fallback;  // the default, as the command line would give it
  const char* rule;
  bool integer;
  double lo, hi;  // the value lies in [lo, hi], or in (lo, hi] when lo_open
  bool lo_open;
  int LaunchOptions::*count;       // an integer flag's field, or
  double LaunchOptions::*seconds;  // a number of seconds' field
};

// A duration flag takes any number of seconds up to `inf`: from 10^9 s (31.7 years) on it means
// forever (util::millis_of_seconds), so no value overflows a deadline.
constexpr double kNoLimit = std::numeric_limits<double>::infinity();
constexpr double kIntMax = 2147483647.0;

// In --help's order among the other flags; validated in this order too.
const NumericFlag kNodeRank{"--node_rank,--node-rank",
                            "this node's rank, 0..nnodes-1 (default 0)",
                            "0",
                            "an integer >= 0",
                            true,
                            0,
                            kIntMax,
                            false,
                            &LaunchOptions::node_rank,
                            nullptr};
const NumericFlag kMasterPort{"--master_port,--master-port",
                              "port of the rendezvous on node 0 (default 29500)",
                              "29500",
                              "a port number 1..65535",
                              true,
                              1,
                              65535,
                              false,
                              &LaunchOptions::master_port,
                              nullptr};
const NumericFlag kTimings[] = {
    {"--ft_replica_ranks,--ft-replica-ranks",
     "--ft: ranks per replica, consecutive workers, relaunched together (default 1)", "1", "an integer >= 1", true, 1,
     kIntMax, false, &LaunchOptions::ft_replica_ranks, nullptr},
    {"--max_restarts,--max-restarts", "restarts allowed after failures (default 0)", "0", "an integer >= 0", true, 0,
     kIntMax, false, &LaunchOptions::max_restarts, nullptr},
    {"--monitor_interval,--monitor-interval", "seconds between checks (default 0.1)", "0.1", "a number of seconds > 0",
     false, 0, 3600, true, nullptr, &LaunchOptions::monitor_interval},
    {"--rdzv_timeout,--rdzv-timeout", "seconds nodes wait for each other (default 900)", "900",
     "a number of seconds > 0 (inf: forever)", false, 0, kNoLimit, true, nullptr, &LaunchOptions::rdzv_timeout},
    {"--rdzv_last_call,--rdzv-last-call", "elastic: seconds to wait for more nodes once MIN have joined (default 30)",
     "30", "a number of seconds >= 0 (inf: forever)", false, 0, kNoLimit, false, nullptr,
     &LaunchOptions::rdzv_last_call},
    {"--grace_period,--grace-period", "seconds between SIGTERM and SIGKILL (default 5)", "5",
     "a number of seconds >= 0 (inf: forever)", false, 0, kNoLimit, false, nullptr, &LaunchOptions::grace_period},
};

// The flag's first name: "--node_rank" of "--node_rank,--node-rank".
std::string primary(const NumericFlag& f) {
  std::string names = f.names;
  return names.substr(0, names.find(','));
}

// The value given (or the default) for each numeric flag, bound to CLI11 and checked after parsing.
class NumericValues {
 public:
  void add(CLI::App& app, const NumericFlag& f) { app.add_option(f.names, slot(f) = f.fallback, f.help); }

  // Stores the checked value into `o`, or throws the flag's one-line error.
  void check(const NumericFlag& f, LaunchOptions& o) {
    const std::string& text = slot(f);
    long long n = 0;
    double x = 0;
    bool ok = f.integer ? parse_int(text, &n) : parse_double(text, &x);
    if (f.integer) x = static_cast<double>(n);
    ok = ok && (f.lo_open ? x > f.lo : x >= f.lo) && x <= f.hi;
    if (!ok) throw UsageError(primary(f) + " must be " + f.rule + ", got '" + text + "'");
    if (f.count) o.*f.count = static_cast<int>(n);
    if (f.seconds) o.*f.seconds = x;
  }

  const std::string& given(const NumericFlag& f) { return slot(f); }

 private:
  std::string& slot(const NumericFlag& f) { return values_[f.names]; }
  std::map<std::string, std::string> values_;
};

// --nnodes: N, or torchrun's MIN:MAX for an elastic job (nnodes is then MAX until the rendezvous).
void parse_nnodes(const std::string& nnodes, LaunchOptions& o) {
  long long v = 0;
  if (const size_t colon = nnodes.find(':'); colon != std::string::npos) {
    long long lo = 0, hi = 0;
    if (!parse_int(nnodes.substr(0, colon), &lo) || !parse_int(nnodes.substr(colon + 1), &hi) || lo < 1 || hi < lo ||
        hi > 100000)
      throw UsageError("--nnodes MIN:MAX needs 1 <= MIN <= MAX (e.g. --nnodes 2:4), got '" + nnodes + "'");
    o.elastic = true;
    o.min_nodes = static_cast<int>(lo);
    o.max_nodes = static_cast<int>(hi);
    v = hi;
  } else if (!parse_int(nnodes, &v) || v < 1 || v > 100000) {
    throw UsageError("--nnodes must be a positive integer or MIN:MAX, got '" + nnodes + "'");
  }
  o.nnodes = static_cast<int>(v);
}

}  // namespace

int online_cores() {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

namespace {

// The values CLI11 fills in: text flags go straight into LaunchOptions, the others are checked after.
struct Given {
  std::string nproc = "1", nnodes = "1", run_id, rdzv_conf, rdzv_backend = "static", rdzv_endpoint, ranks_filter;
  std::string redirects = "0", tee = "0";
  bool no_python = false;  // accepted: dtrain-run starts programs, never `python` in front of them
  NumericValues numbers;
  std::vector<const CLI::Option*> on_command_line;  // the options given before the program
  std::vector<std::string> from_environment;        // "PET_NNODES=2": defaults torchrun's way (cluster.h)
};

// Every flag, in --help's order.
void add_flags(CLI::App& app, LaunchOptions& o, Given& g) {
  app.footer(
      "Usage: dtrain-run [OPTIONS] PROGRAM [ARGS...]   (everything after PROGRAM goes to it)\n"
      "Each of torchrun's flags takes its default from PET_<FLAG> (e.g. PET_NNODES, PET_NPROC_PER_NODE), as torchrun "
      "does; the flag wins.");
  app.add_option("--nproc_per_node,--nproc-per-node", g.nproc,
                 "workers per node: a number, cpu (the CPUs), gpu (the GPUs) or auto (GPUs if any, else CPUs)");
  app.add_option("--nnodes", g.nnodes, "number of nodes N, or MIN:MAX for an elastic job (default 1)");
  g.numbers.add(app, kNodeRank);
  app.add_option("--master_addr,--master-addr", o.master_addr,
                 "address of node 0; its launcher serves the rendezvous there only (default 127.0.0.1)");
  g.numbers.add(app, kMasterPort);
  app.add_flag("--standalone", o.standalone, "single node on 127.0.0.1 with a free port");
  app.add_flag("--ft", o.ft,
               "replica fault tolerance: each worker is a replica (dtrain::ft::Manager); a failed one is "
               "relaunched alone, --max_restarts times per node, while the others go on; several nodes: a fixed "
               "--nnodes N with --node_rank, node 0's store holding the quorum");
  for (const NumericFlag& f : kTimings) g.numbers.add(app, f);
  app.add_option("--log_dir,--log-dir", o.log_dir,
                 "write <log_dir>/<run_id>_<random>/attempt_<restart>/<local_rank>/{stdout,stderr}.log "
                 "(--tee/--redirects without it: a new folder under TMPDIR)");
  app.add_option("--redirects,-r", g.redirects,
                 "streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both; or per local rank, e.g. 0:3,1:2 "
                 "(local ranks not named: none)");
  app.add_option("--tee,-t", g.tee,
                 "streams to log files and console: 0 none, 1 stdout, 2 stderr, 3 both; or per local rank, e.g. "
                 "0:3,1:2");
  app.add_flag("--use_local_rank_arg,--use-local-rank-arg", o.use_local_rank_arg,
               "pass --local_rank=N as the program's first argument");
  app.add_option("--run_id,--run-id,--rdzv_id,--rdzv-id", g.run_id,
                 "job id exported as TORCHELASTIC_RUN_ID (default none)");
  app.add_option("--rdzv_conf,--rdzv-conf", g.rdzv_conf,
                 "KEY=VALUE,...: join_timeout, last_call_timeout, close_timeout (30), read_timeout (60) in seconds, "
                 "is_host (0/1), secret_file=PATH (the job secret every node's launcher shares, a mode-0600 file)");
  app.add_option("--rdzv_backend,--rdzv-backend", g.rdzv_backend,
                 "static (default: --node_rank says who is who) or c10d (node ranks assigned in the rendezvous)");
  app.add_option("--rdzv_endpoint,--rdzv-endpoint", g.rdzv_endpoint,
                 "HOST[:PORT] of the rendezvous store (c10d: port 29400 unless given; static: instead of "
                 "--master_addr/--master_port)");
  app.add_option("--role", o.role, "the workers' ROLE_NAME (default 'default')");
  app.add_option("--local_addr,--local-addr", o.local_addr,
                 "this node's address in the rendezvous and its lines (default: its host name); c10d: node 0's "
                 "is the workers' MASTER_ADDR, with a store there");
  app.add_option("--local_ranks_filter,--local-ranks-filter", g.ranks_filter,
                 "LOCAL,...: only these local ranks' output on the console (the log files keep all)");
  app.add_flag("--no_python,--no-python", g.no_python,
               "accepted for torchrun's command lines: programs always run as given");
}

// Step 1: the launcher's arguments (a flag and its value), up to the program; the program and its
// arguments go into `o`.
std::vector<std::string> split_at_program(const CLI::App& app, int argc, char** argv, LaunchOptions& o, Given& g) {
  std::vector<std::string> launcher_args;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a == "-h" || a == "--help") throw HelpRequested{app.help()};
    if (a == "--version") throw HelpRequested{"dtrain-run " DTRAIN_VERSION "\n"};
    if (a.size() < 2 || a[0] != '-') break;  // the program
    std::string name = a.substr(0, a.find('='));
    const CLI::Option* opt = app.get_option_no_throw(name);
    if (!opt) {
      refuse_torchrun_only_flag(name);  // a torchrun flag: its own line, saying what to use
      throw UsageError("unknown option '" + name +
                       "' before the program (see dtrain-run --help; options after the program go to it)");
    }
    launcher_args.push_back(a);
    g.on_command_line.push_back(opt);
    if (a.find('=') == std::string::npos && opt->get_items_expected_max() > 0) {  // takes a value
      if (i + 1 >= argc) throw UsageError(name + " needs a value");
      launcher_args.push_back(argv[++i]);
    }
  }
  if (i >= argc)
    throw UsageError(
        "no program given: dtrain-run [OPTIONS] PROGRAM [ARGS...] (e.g. dtrain-run --nproc_per_node 2 ./train)");
  o.program = argv[i];
  for (++i; i < argc; ++i) o.program_args.push_back(argv[i]);
  return launcher_args;
}

// Step 2's checks: each value on its own, then the ones that depend on each other.
void check_values(Given& g, LaunchOptions& o) {
  o.nproc_per_node = parse_nproc(g.nproc);
  parse_nnodes(g.nnodes, o);
  g.numbers.check(kNodeRank, o);
  g.numbers.check(kMasterPort, o);
  for (const NumericFlag& f : kTimings) g.numbers.check(f, o);
  o.redirects = parse_std_streams("--redirects", g.redirects);
  o.tee = parse_std_streams("--tee", g.tee);
  if (g.rdzv_backend != "static" && g.rdzv_backend != "c10d")
    throw UsageError("--rdzv_backend must be static or c10d, got '" + g.rdzv_backend +
                     "' (etcd and etcd-v2 need an etcd server: use c10d, whose store dtrain-run hosts)");
  o.c10d = g.rdzv_backend == "c10d";
  for (const std::string& item :
       g.ranks_filter.empty() ? std::vector<std::string>{} : util::split(g.ranks_filter, ',')) {
    if (!util::is_digits(item) || item.size() > 6)
      throw UsageError("--local_ranks_filter must be local ranks separated by commas (e.g. 0,1), got '" +
                       g.ranks_filter + "'");
    o.local_ranks_filter.push_back(std::stoi(item));
  }
  if (o.master_addr.empty()) throw UsageError("--master_addr must not be empty (e.g. --master_addr 127.0.0.1)");
  if (util::is_wildcard_address(o.master_addr))
    throw UsageError("--master_addr " + o.master_addr +
                     " is the wildcard address, not node 0's: the store would listen on every network this "
                     "machine is on; give node 0's own address or host name (127.0.0.1 on one node)");
  if (!g.run_id.empty()) o.run_id = g.run_id;
  parse_rdzv_conf(g.rdzv_conf, o);
  if (o.run_id.find('/') != std::string::npos || o.run_id == "." || o.run_id == "..")
    throw UsageError("--run_id must not contain '/', got '" + o.run_id + "'");
}

// --rdzv_endpoint, --rdzv_conf's timeouts (Note [torchrun's command line] in cluster.h).
void apply_rendezvous_form(const CLI::App& app, Given& g, LaunchOptions& o) {
  if (!g.rdzv_endpoint.empty() || o.c10d) {
    parse_endpoint(g.rdzv_endpoint, o.c10d ? 29400 : o.master_port, &o.master_addr, &o.master_port);
    if (util::is_wildcard_address(o.master_addr))
      throw UsageError("--rdzv_endpoint " + g.rdzv_endpoint +
                       " is the wildcard address, not the rendezvous host's: give that host's name or address");
  }
  if (o.join_timeout > 0) {
    if (app.count("--rdzv_timeout") > 0)
      throw UsageError("--rdzv_timeout and --rdzv_conf join_timeout say the same thing: give one of them");
    o.rdzv_timeout = o.join_timeout;
  } else if (o.c10d && app.count("--rdzv_timeout") == 0) {
    o.rdzv_timeout = 600;  // torchrun's join_timeout
  }
  if (o.last_call_timeout >= 0) {
    if (app.count("--rdzv_last_call") > 0)
      throw UsageError("--rdzv_last_call and --rdzv_conf last_call_timeout say the same thing: give one of them");
    o.rdzv_last_call = o.last_call_timeout;
  }
}

// --rdzv_backend c10d on several nodes: the elastic form, MIN = MAX for --nnodes N; no --node_rank
// (torchrun ignores it there), but is_host=1 hosts and is_host=0 never does.
void as_c10d_rendezvous(Given& g, LaunchOptions& o) {
  if (o.master_port == 0)
    throw UsageError("--rdzv_endpoint " + g.rdzv_endpoint +
                     ": port 0 (a free port) works on one node only; give the port every node can reach");
  if (!o.elastic) o.min_nodes = o.max_nodes = o.nnodes;
  o.elastic = true;
  o.node_rank_given = o.is_host >= 0;
  o.node_rank = o.is_host == 0 ? 1 : 0;
}

// Step 4, before --standalone's own settings (in a step of several tasks it is an error), then the
// checks of the node count against the node rank and --standalone.
void apply_placement(const CLI::App& app, Given& g, LaunchOptions& o) {
  apply_rendezvous_form(app, g, o);
  GivenFlags given;
  given.nnodes = app.count("--nnodes") > 0;
  given.node_rank = app.count("--node_rank") > 0;
  given.standalone = o.standalone;
  given.master_addr = app.count("--master_addr") > 0;
  given.master_port = app.count("--master_port") > 0;
  o.node_rank_given = given.node_rank && !o.c10d;
  apply_slurm_step(o, given, env::process());
  if (o.slurm_note.empty()) {
    const bool placed = given.nnodes || given.node_rank || given.standalone || given.master_addr || given.master_port ||
                        app.count("--rdzv_endpoint") > 0 || app.count("--rdzv_backend") > 0;
    o.launch_note = apply_pod_environment(o, !placed, env::process());
  }
  if (o.c10d && !o.standalone && (o.elastic || o.nnodes > 1)) as_c10d_rendezvous(g, o);
  const std::string& nnodes = g.nnodes;
  if (o.elastic && !o.slurm_note.empty())
    throw UsageError("--nnodes " + nnodes +
                     " (elastic) cannot run inside an srun step of several tasks: the step "
                     "fixes the nodes; give --nnodes N or run dtrain-run outside srun");
  if (o.elastic && o.standalone)
    throw UsageError("--standalone runs one node, but --nnodes is " + nnodes + " (drop one of them)");
  // Note [Replicas on several nodes] (ft_nodes.h): a fixed set of nodes, replica ids fixed by node rank.
  if (o.ft && o.c10d && o.elastic && g.nnodes.find(':') == std::string::npos)
    throw UsageError(
        "--ft on several nodes needs fixed node ranks, but --rdzv_backend c10d assigns them in an "
        "elastic rendezvous: drop --rdzv_backend c10d and give each node --node_rank with the same "
        "--rdzv_endpoint (or --master_addr/--master_port)");
  if (o.ft && o.elastic)
    throw UsageError("--ft needs a fixed node count, but --nnodes is " + nnodes +
                     " (elastic): give --nnodes N; replicas leave and rejoin inside the job, nodes do not");
  if (o.ft_replica_ranks > 1 && (!o.ft || o.nproc_per_node % o.ft_replica_ranks != 0))
    throw UsageError("--ft_replica_ranks " + std::to_string(o.ft_replica_ranks) +
                     " needs --ft and a --nproc_per_node " + "that is a multiple of it (got " +
                     std::to_string(o.nproc_per_node) + ")");
  if (o.node_rank >= o.nnodes)
    throw UsageError("--node_rank " + g.numbers.given(kNodeRank) + " is out of range for --nnodes " + nnodes +
                     ": node ranks go from 0 to " + std::to_string(o.nnodes - 1));
  if (o.standalone) {
    o.c10d = false;
    if (o.nnodes != 1)
      throw UsageError("--standalone runs one node, but --nnodes is " + nnodes + " (drop one of them)");
    o.master_addr = "127.0.0.1";
    o.master_port = 0;  // the store binds a free port
  }
  // The address the store binds, whichever form gave it: the flags are checked as they are read,
  // the pod's MASTER_ADDR and the srun step's only here.
  if (util::is_wildcard_address(o.master_addr)) {
    const std::string from = !o.slurm_note.empty()    ? "this srun step's MASTER_ADDR"
                             : !o.launch_note.empty() ? "MASTER_ADDR (a Kubeflow PyTorchJob pod's)"
                                                      : "the master address";
    throw UsageError(from + " " + o.master_addr +
                     " is the wildcard address, not node 0's: the store would listen on every network this "
                     "machine is on; give node 0's own address or host name (127.0.0.1 on one node)");
  }
}

}  // namespace

LaunchOptions parse_options(int argc, char** argv) {
  LaunchOptions o;
  Given g;
  CLI::App app{
      "dtrain-run: start N worker processes per node with torchrun's environment "
      "(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...).",
      "dtrain-run"};
  add_flags(app, o, g);
  std::vector<std::string> launcher_args = split_at_program(app, argc, argv, o, g);
  for (std::string& a : pet_defaults(app, g.on_command_line, env::process(), &g.from_environment))
    launcher_args.push_back(std::move(a));
  // 2. CLI11 parses the launcher part (it expects the arguments in reverse order).
  std::vector<std::string> reversed(launcher_args.rbegin(), launcher_args.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    throw UsageError(e.what());
  }
  try {
    check_values(g, o);
    apply_placement(app, g, o);
    resolve_job_secret(o);  // once the node count is known
  } catch (const UsageError& e) {
    if (g.from_environment.empty()) throw;
    throw UsageError(std::string(e.what()) + " (from the environment: " + util::join(g.from_environment, " ") + ")");
  }
  // 3. The program must exist now, not after the rendezvous.
  o.program_path = resolve_program(o.program);
  return o;
}

}  // namespace dtrain::run
