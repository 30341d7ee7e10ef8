// dtrain-run's command line: torchrun's flags, parsed with CLI11, validated into LaunchOptions.
//
// Steps of parse_options():
//   1. Split argv at the program: the first argument that is not a launcher flag or a flag's value
//      (or the one after `--`). Everything from the program on is passed to it untouched, so
//      `dtrain-run --nproc_per_node 2 prog --lr 0.1 --nproc_per_node 7` gives prog the last four.
//      An unknown flag before the program is a usage error naming it (a torchrun-only one with what
//      to use instead, cluster.h).
//   2. Each torchrun flag not on the command line takes its PET_<FLAG> value when set (cluster.h).
//      CLI11 parses the launcher's part; values are then checked: each numeric flag against its row
//      of options.cpp's flag table (its range and the rule its error states), then the ones that
//      depend on each other (node_rank < nnodes, ...). --redirects and --tee are a mask or a per-local-rank
//      map (StdStreams).
//   3. The program is looked up in PATH here, so a missing program fails before anything starts.
//   4. --rdzv_endpoint and --rdzv_conf's timeouts; inside an srun step of several tasks, the step
//      decides --nnodes, --node_rank and the master (slurm_step.h), a flag that contradicts it being a
//      usage error; else in a Kubeflow PyTorchJob pod its WORLD_SIZE/RANK/MASTER_* when nothing else
//      placed the job; then --rdzv_backend c10d on several nodes becomes the elastic form (cluster.h).
// Every problem is a UsageError with one line: the flag, the value given, the remedy.
#pragma once

#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtrain::run {

// A usage error: main prints "dtrain-run: <what>" and exits 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Thrown for --help / --version: the text is printed to stdout and main exits 0.
struct HelpRequested {
  std::string text;
};

// Bit mask for --redirects / --tee (torchrun's Std): 1 stdout, 2 stderr, 3 both.
enum StdMask : int { kStdNone = 0, kStdOut = 1, kStdErr = 2, kStdBoth = 3 };

// --redirects / --tee as torchrun's Std.from_str reads them: one mask for every local rank ("3"), or
// a map "LOCAL_RANK:MASK,..." ("0:3,1:2") in which a local rank not named gets none (to_map).
struct StdStreams {
  int all = kStdNone;           // the mask of every local rank, when not `mapped`
  bool mapped = false;          // given as a map: only its local ranks get a mask
  std::map<int, int> by_local;  // local rank -> mask
  int of(int local_rank) const {
    if (!mapped) return all;
    const auto it = by_local.find(local_rank);
    return it == by_local.end() ? kStdNone : it->second;
  }
  bool any() const {
    for (const auto& kv : by_local)
      if (kv.second != kStdNone) return true;
    return all != kStdNone;
  }
};

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  // --nnodes MIN:MAX (elastic membership, elastic.h): the job runs on MIN..MAX nodes and re-forms when
  // one leaves or arrives. nnodes and node_rank then hold the current attempt's group size and rank.
  bool elastic = false;
  int min_nodes = 1, max_nodes = 1;
  bool node_rank_given = false;  // elastic: an explicit --node_rank only says who hosts (0) or not
  double rdzv_last_call = 30;    // elastic: seconds to wait for more nodes once MIN are there
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool standalone = false;
  // --ft: each worker is a data-parallel replica of one rank (dtrain::ft::Manager, DTRAIN_FT_REPLICA_ID
  // = its global rank); a worker that fails is relaunched alone while the others train on, --max_restarts
  // relaunches per node. Several nodes: a fixed --nnodes N (Note [Replicas on several nodes], ft_nodes.h).
  bool ft = false;
  int ft_replica_ranks = 1;       // --ft: consecutive workers that form one replica (its own world)
  int max_restarts = 0;           // restarts of the whole group after a failure (one-node jobs)
  double monitor_interval = 0.1;  // seconds
  double rdzv_timeout = 900;      // seconds
  double grace_period = 5;        // seconds between SIGTERM and SIGKILL
  std::string log_dir;            // empty: no log files
  StdStreams redirects;           // streams sent to the log files only
  StdStreams tee;                 // streams sent to the log files and the console
  bool use_local_rank_arg = false;
  std::string run_id = "none";  // torchrun's default rdzv id
  // torchrun's rendezvous form (cluster.h, Note [torchrun's command line]).
  bool c10d = false;                    // --rdzv_backend c10d: node ranks come from the rendezvous
  std::string role = "default";         // --role, the workers' ROLE_NAME
  std::string local_addr;               // --local_addr: this node's address (default: host name), cluster.h
  std::vector<int> local_ranks_filter;  // --local_ranks_filter: the local ranks shown on the console (empty: all)
  // --rdzv_conf's join_timeout and last_call_timeout in seconds (< 0: not given), is_host (-1 not given, 0, 1).
  double join_timeout = -1, last_call_timeout = -1;
  int is_host = -1;
  // --rdzv_conf close_timeout (torchrun's RendezvousTimeout.close, 30 s): how long closing the rendezvous
  // may take once this node's job failed (Note [Store deadlines and closing] in rendezvous.h); read_timeout
  // (the c10d backend's store timeout, 60 s): the deadline of each rendezvous store request.
  double close_timeout = 30, read_timeout = 60;
  std::string run_log_dir;  // <log_dir>/<run_id>_<random>, made when the job starts (main.cpp)
  std::string launch_note;  // node 0's line when the environment placed the job (cluster.h)
  // --rdzv_conf secret_file=PATH, and the job secret (secret.h): "" when the job runs open.
  std::string secret_file;
  std::string secret;
  // Not an option: the launcher's stdout is a terminal and shows rank 0's stdout, so rank 0 gets
  // DTRAIN_PROGRESS_TTY=1 and its progress bar is drawn in place (output.h, Note [Launcher bar]).
  bool progress_bar = false;

  // Inside an srun step of several tasks (slurm_step.h): the first local rank of this launcher's
  // workers and the workers on this host (0: nproc_per_node), and the line node 0 prints.
  int local_rank_base = 0;
  int local_world_size = 0;
  std::string slurm_note;

  std::string program;                    // as given
  std::string program_path;               // resolved through PATH
  std::vector<std::string> program_args;  // everything after the program
};

// Parses and validates argv. Throws UsageError or HelpRequested.
LaunchOptions parse_options(int argc, char** argv);

// Number of online CPU cores (>= 1).
int online_cores();

}  // namespace dtrain::run
