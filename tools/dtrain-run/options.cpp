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

#include "common/env.h"
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

std::string std_mask_text(const std::string& flag) {
  return flag + " must be 0 (none), 1 (stdout), 2 (stderr) or 3 (both)";
}

}  // namespace

int online_cores() {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

LaunchOptions parse_options(int argc, char** argv) {
  LaunchOptions o;
  std::string nproc = "1", nnodes = "1", node_rank = "0", port = "29500", max_restarts = "0";
  std::string monitor = "0.1", rdzv_timeout = "900", last_call = "30", grace = "5", redirects = "0", tee = "0";
  std::string run_id;

  CLI::App app{
      "dtrain-run: start N worker processes per node with torchrun's environment "
      "(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...).",
      "dtrain-run"};
  app.footer("Usage: dtrain-run [OPTIONS] PROGRAM [ARGS...]   (everything after PROGRAM goes to it)");
  app.add_option("--nproc_per_node,--nproc-per-node", nproc, "workers per node: a number or 'auto' (= CPU cores)");
  app.add_option("--nnodes", nnodes, "number of nodes N, or MIN:MAX for an elastic job (default 1)");
  app.add_option("--node_rank,--node-rank", node_rank, "this node's rank, 0..nnodes-1 (default 0)");
  app.add_option("--master_addr,--master-addr", o.master_addr,
                 "address of node 0; its launcher serves the rendezvous there only (default 127.0.0.1)");
  app.add_option("--master_port,--master-port", port, "port of the rendezvous on node 0 (default 29500)");
  app.add_flag("--standalone", o.standalone, "single node on 127.0.0.1 with a free port");
  app.add_option("--max_restarts,--max-restarts", max_restarts, "restarts allowed after failures (default 0)");
  app.add_option("--monitor_interval,--monitor-interval", monitor, "seconds between checks (default 0.1)");
  app.add_option("--rdzv_timeout,--rdzv-timeout", rdzv_timeout, "seconds nodes wait for each other (default 900)");
  app.add_option("--rdzv_last_call,--rdzv-last-call", last_call,
                 "elastic: seconds to wait for more nodes once MIN have joined (default 30)");
  app.add_option("--grace_period,--grace-period", grace, "seconds between SIGTERM and SIGKILL (default 5)");
  app.add_option("--log_dir,--log-dir", o.log_dir,
                 "write <log_dir>/<run_id>/attempt_<restart>/<rank>/{stdout,stderr}.log");
  app.add_option("--redirects,-r", redirects, "streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both");
  app.add_option("--tee,-t", tee, "streams to log files and console: 0 none, 1 stdout, 2 stderr, 3 both");
  app.add_flag("--use_local_rank_arg,--use-local-rank-arg", o.use_local_rank_arg,
               "pass --local_rank=N as the program's first argument");
  app.add_option("--run_id,--run-id,--rdzv_id,--rdzv-id", run_id,
                 "job id exported as TORCHELASTIC_RUN_ID (default none)");

  // 1. Split at the program.
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
    if (!opt)
      throw UsageError("unknown option '" + name +
                       "' before the program (see dtrain-run --help; options after the program go to it)");
    launcher_args.push_back(a);
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

  // 2. CLI11 parses the launcher part (it expects the arguments in reverse order).
  std::vector<std::string> reversed(launcher_args.rbegin(), launcher_args.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    throw UsageError(e.what());
  }

  long long v = 0;
  if (nproc == "auto") {
    o.nproc_per_node = online_cores();
  } else if (!parse_int(nproc, &v) || v < 1 || v > 4096) {
    throw UsageError("--nproc_per_node must be a positive integer or 'auto', got '" + nproc + "'");
  } else {
    o.nproc_per_node = static_cast<int>(v);
  }
  if (const size_t colon = nnodes.find(':'); colon != std::string::npos) {  // torchrun's MIN:MAX
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
  if (!parse_double(last_call, &o.rdzv_last_call) || o.rdzv_last_call < 0)
    throw UsageError("--rdzv_last_call must be a number of seconds >= 0, got '" + last_call + "'");
  if (!parse_int(node_rank, &v) || v < 0)
    throw UsageError("--node_rank must be an integer >= 0, got '" + node_rank + "'");
  o.node_rank = static_cast<int>(v);
  if (!parse_int(port, &v) || v < 1 || v > 65535)
    throw UsageError("--master_port must be a port number 1..65535, got '" + port + "'");
  o.master_port = static_cast<int>(v);
  if (!parse_int(max_restarts, &v) || v < 0)
    throw UsageError("--max_restarts must be an integer >= 0, got '" + max_restarts + "'");
  o.max_restarts = static_cast<int>(v);
  if (!parse_double(monitor, &o.monitor_interval) || o.monitor_interval <= 0 || o.monitor_interval > 3600)
    throw UsageError("--monitor_interval must be a number of seconds > 0, got '" + monitor + "'");
  if (!parse_double(rdzv_timeout, &o.rdzv_timeout) || o.rdzv_timeout <= 0)
    throw UsageError("--rdzv_timeout must be a number of seconds > 0, got '" + rdzv_timeout + "'");
  if (!parse_double(grace, &o.grace_period) || o.grace_period < 0)
    throw UsageError("--grace_period must be a number of seconds >= 0, got '" + grace + "'");
  if (!parse_int(redirects, &v) || v < 0 || v > 3)
    throw UsageError(std_mask_text("--redirects") + ", got '" + redirects + "'");
  o.redirects = static_cast<int>(v);
  if (!parse_int(tee, &v) || v < 0 || v > 3) throw UsageError(std_mask_text("--tee") + ", got '" + tee + "'");
  o.tee = static_cast<int>(v);
  if ((o.redirects || o.tee) && o.log_dir.empty())
    throw UsageError(std::string(o.redirects ? "--redirects" : "--tee") +
                     " needs --log_dir DIR to write the log files to");
  if (o.master_addr.empty()) throw UsageError("--master_addr must not be empty (e.g. --master_addr 127.0.0.1)");
  if (!run_id.empty()) o.run_id = run_id;
  if (o.run_id.find('/') != std::string::npos || o.run_id == "." || o.run_id == "..")
    throw UsageError("--run_id must not contain '/', got '" + o.run_id + "'");
  // 4. Before --standalone's own settings: in a step of several tasks it is an error.
  GivenFlags given;
  given.nnodes = app.count("--nnodes") > 0;
  given.node_rank = app.count("--node_rank") > 0;
  given.standalone = o.standalone;
  given.master_addr = app.count("--master_addr") > 0;
  given.master_port = app.count("--master_port") > 0;
  o.node_rank_given = given.node_rank;
  apply_slurm_step(o, given, env::process());
  if (o.elastic && !o.slurm_note.empty())
    throw UsageError("--nnodes " + nnodes +
                     " (elastic) cannot run inside an srun step of several tasks: the step "
                     "fixes the nodes; give --nnodes N or run dtrain-run outside srun");
  if (o.elastic && o.standalone)
    throw UsageError("--standalone runs one node, but --nnodes is " + nnodes + " (drop one of them)");
  if (o.node_rank >= o.nnodes)
    throw UsageError("--node_rank " + node_rank + " is out of range for --nnodes " + nnodes +
                     ": node ranks go from 0 to " + std::to_string(o.nnodes - 1));
  if (o.standalone) {
    if (o.nnodes != 1)
      throw UsageError("--standalone runs one node, but --nnodes is " + nnodes + " (drop one of them)");
    o.master_addr = "127.0.0.1";
    o.master_port = 0;  // the store binds a free port
  }

  // 3. The program must exist now, not after the rendezvous.
  o.program_path = resolve_program(o.program);
  return o;
}

}  // namespace dtrain::run
