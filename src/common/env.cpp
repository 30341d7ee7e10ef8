// The table of environment variables and their accessors (see env.h).
#include "common/env.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "common/util.h"
#include "dtrain/errors.h"

extern char** environ;

namespace dtrain::env {
namespace {

using R = Reader;

Knob flag_row(const char* name, Reader r, const char* fallback, const char* allowed, const char* meaning) {
  return {name, r, Type::kFlag, fallback, allowed, "", meaning, {"0", "1"}};
}
Knob choice_row(const char* name, Reader r, std::vector<std::string> choices, const char* fallback, const char* allowed,
                const char* meaning) {
  return {name, r, Type::kChoice, fallback, allowed, "", meaning, std::move(choices)};
}
// Launch variables: ranks and sizes up to 2^24, far above any job and far below int's range.
Knob rank_row(const char* name, Reader r, const char* remedy, const char* meaning) {
  return {name, r, Type::kInteger, "", "a non-negative integer", remedy, meaning, {}, 0, 1 << 24, 1};
}
// torchrun's PET_<FLAG>: the flag's default, checked as the flag is (its error names the variable).
Knob pet_row(const char* name, const char* flag) {
  return {name, Reader::kLauncher, Type::kText, "", "what the flag takes", "", flag, {}};
}
Knob row(const char* name, Reader r, Type t, const char* fallback, const char* allowed, const char* remedy,
         const char* meaning) {
  return {name, r, t, fallback, allowed, remedy, meaning, {}};
}

std::vector<Knob> make_table() {
  const char* kRankSet = "";  // the caller names the launcher that sets it
  return {
      // libdtrain: every program that links dtrain.
      choice_row("DTRAIN_BACKEND", R::kLibrary, {"gloo", "nccl"}, "gloo",
                 "gloo (CPU tensors) or nccl (CUDA tensors, CUDA builds)",
                 "Backend when `InitOptions::backend` is empty."),
      row("DTRAIN_TIMEOUT_S", R::kLibrary, Type::kSeconds, "1800", "a positive number of seconds", "",
          "Process-group timeout (fractions allowed, rounded up to whole milliseconds; from 10^9 s on, "
          "forever) when `InitOptions::timeout` is unset: store connection, rendezvous and every "
          "collective. 1800 s is PyTorch's 30 min."),
      choice_row("DTRAIN_DEBUG", R::kLibrary, {"OFF", "INFO", "DETAIL"}, "OFF", "OFF, INFO or DETAIL",
                 "Debug level, as PyTorch's `TORCH_DISTRIBUTED_DEBUG`: `INFO` logs DDP's setup and buckets, "
                 "`DETAIL` compares every collective's call across ranks."),
      {"DTRAIN_FLIGHT_ENTRIES",
       R::kLibrary,
       Type::kInteger,
       "2000",
       "an integer from 0 to 1000000",
       "use 0 to turn the flight recorder off, or leave it unset for 2000",
       "Calls the flight recorder keeps per group (the last ones; `0` turns it off). Dumped on a failed or "
       "timed-out call, a stall, SIGUSR1 and dtrain-run's request (docs/troubleshooting.md, \"My job hangs\").",
       {},
       0,
       1000000,
       1},
      row("DTRAIN_FLIGHT_STALL_S", R::kLibrary, Type::kSeconds, "300", "a positive number of seconds",
          "leave it unset for 300, or give 1e9 to never dump on a stall",
          "The flight recorder's watchdog dumps the record when no call of any group changed state for this long "
          "while one is pending (from 10^9 s on, never)."),
      row("DTRAIN_FLIGHT_DIR", R::kLibrary, Type::kText, "", "a folder this user can write", "",
          "Where each rank writes its flight record `dtrain_trace_rank_<rank>` (set by dtrain-run: "
          "`attempt_<k>/flight` in the run's log folder, or without `--log_dir` in a temporary folder under "
          "`TMPDIR`, removed at exit unless it holds a record). Unset: `/tmp/dtrain-flight-<uid>`, used only as "
          "this user's own folder (not a link, writable by no one else)."),
      choice_row("DTRAIN_SHM", R::kLibrary, {"auto", "0", "1"}, "auto",
                 "0 (Gloo only), 1 (require shared memory) or leave it unset (shared memory where ranks "
                 "share a host)",
                 "Shared-memory collectives for ranks on one host (backend gloo): `auto` where ranks share "
                 "a host, `0` never, `1` required (an error if they cannot be set up)."),
      {"DTRAIN_SHM_SLOT_BYTES",
       R::kLibrary,
       Type::kInteger,
       "1048576",
       "a multiple of 64 between 4096 and 268435456",
       "",
       "Chunk size of the shared-memory collectives, in bytes.",
       {},
       4096,
       int64_t{1} << 28,
       64},
      flag_row("DTRAIN_SHM_SINGLE_COPY", R::kLibrary, "1", "1 or 0",
               "`0`: a shared-memory group's all_to_all goes through Gloo instead of writing into the peers' "
               "outputs directly (process_vm_writev, probed at the group's first all_to_all)."),
      row("DTRAIN_SHM_HOST", R::kLibrary, Type::kText, "", "any text", "",
          "Overrides the key of \"the same host\" (unset: host name, boot id and the identity of "
          "`/dev/shm`), e.g. to make the processes of one machine act as separate hosts."),
      flag_row("DTRAIN_MALLOC_TUNING", R::kLibrary, "1", "1 or 0",
               "`0` makes `reduce_allocator_churn()` a no-op (a bad value warns and leaves it on)."),
      {"DTRAIN_FSDP_MMAP_THRESHOLD",
       R::kLibrary,
       Type::kInteger,
       "1048576",
       "0, or bytes up to 33554432",
       "use 0 to leave glibc's threshold as it is, or at most 33554432 (glibc's maximum on 64-bit)",
       "glibc's mmap threshold that the first `fully_shard` of CPU parameters pins (blocks this large and "
       "larger are given back to the kernel at free, for a lower peak RSS; their pages are faulted in again "
       "each step); `0` leaves glibc's own. Not applied where the program tuned malloc itself "
       "(`reduce_allocator_churn()`, `MALLOC_MMAP_THRESHOLD_`, `GLIBC_TUNABLES`).",
       {},
       0,
       int64_t{1} << 25,
       1},
      flag_row("DTRAIN_PYTORCH_PEERS", R::kLibrary, "0", "1 (some ranks are Python programs) or 0",
               "`1`: the job has Python ranks, as `InitOptions::pytorch_peers(true)`."),
      flag_row("DTRAIN_AGENT_STORE", R::kLibrary, "0", "1 or 0",
               "`1` (set by dtrain-run): the launcher hosts the store at `MASTER_ADDR:MASTER_PORT`, so rank 0 "
               "connects to it instead of hosting one."),
      row("DTRAIN_JOB_SECRET", R::kLibrary, Type::kText, "", "at least 32 bytes, one line", "",
          "The job secret (set by dtrain-run for its workers; read by dtrain-run itself when no "
          "`--rdzv_conf secret_file` is given): the store serves only processes that prove they know it, "
          "and they talk only to a store that proves it too. Unset: the store is open (SECURITY.md)."),
      row("DTRAIN_FT_REPLICA_ID", R::kLibrary, Type::kText, "", "a name without spaces, newlines or '/'", "",
          "This replica's id for `dtrain::ft::Manager` (set by `dtrain-run --ft`: the worker's rank divided by "
          "`--ft_replica_ranks`), the same after a relaunch; its world's store keys go under it."),
      flag_row("DTRAIN_PROGRESS_TTY", R::kLibrary, "0", "1 or 0",
               "`1` (set by dtrain-run for rank 0 when the launcher's stdout is a terminal): `Progress` on "
               "stdout sends its bar to the launcher, which draws it in place; `0`: plain lines."),
      choice_row("TORCHELASTIC_USE_AGENT_STORE", R::kLibrary, {"True", "False"}, "False", "True or False",
                 "`True` (set by torchrun): connect to torchrun's c10d `TCPStore`."),
      rank_row("DTRAIN_RESTART_COUNT", R::kLibrary, "it is set by dtrain-run",
               "Attempt number (set by dtrain-run, 0 first; under `--ft` the replica's relaunches); keys the "
               "rendezvous (`dtrain/a<N>/`). Unset: `TORCHELASTIC_RESTART_COUNT`, else 0."),
      rank_row("TORCHELASTIC_RESTART_COUNT", R::kLibrary, "it is set by torchrun",
               "torchrun's attempt number, used when `DTRAIN_RESTART_COUNT` is unset."),
      row("GLOO_SOCKET_IFNAME", R::kLibrary, Type::kList, "", "interface names, comma-separated", "",
          "Interfaces Gloo binds to, as in PyTorch. Unset: the interface that routes to the master."),
      rank_row("RANK", R::kLibrary, kRankSet,
               "This process's rank (dtrain-run, torchrun), unless `InitOptions::rank` is set."),
      rank_row("WORLD_SIZE", R::kLibrary, kRankSet, "Number of ranks, unless `InitOptions::world_size` is set."),
      rank_row("LOCAL_RANK", R::kLibrary, kRankSet, "Rank within this host (unset: derived from host names)."),
      rank_row("LOCAL_WORLD_SIZE", R::kLibrary, kRankSet, "Ranks on this host (unset: derived from host names)."),
      rank_row("OMPI_COMM_WORLD_RANK", R::kLibrary, kRankSet, "OpenMPI's mpirun: the rank, when `RANK` is unset."),
      rank_row("OMPI_COMM_WORLD_SIZE", R::kLibrary, kRankSet, "OpenMPI's mpirun: the world size."),
      rank_row("OMPI_COMM_WORLD_LOCAL_RANK", R::kLibrary, kRankSet, "OpenMPI's mpirun: the local rank."),
      rank_row("OMPI_COMM_WORLD_LOCAL_SIZE", R::kLibrary, kRankSet, "OpenMPI's mpirun: the ranks on this host."),
      rank_row("PMI_RANK", R::kLibrary, kRankSet,
               "MPICH and Intel MPI: the rank, when `RANK` and OpenMPI's are unset."),
      rank_row("PMI_SIZE", R::kLibrary, kRankSet, "MPICH and Intel MPI: the world size."),
      rank_row("MPI_LOCALRANKID", R::kLibrary, kRankSet, "MPICH and Intel MPI: the local rank."),
      rank_row("MPI_LOCALNRANKS", R::kLibrary, kRankSet, "MPICH and Intel MPI: the ranks on this host."),
      rank_row("SLURM_PROCID", R::kLibrary, kRankSet,
               "Slurm's srun: the rank, when no MPI or torchrun variable is set."),
      rank_row("SLURM_NTASKS", R::kLibrary, kRankSet, "Slurm's srun: the world size."),
      rank_row("SLURM_LOCALID", R::kLibrary, kRankSet, "Slurm's srun: the local rank."),
      row("SLURM_NTASKS_PER_NODE", R::kLibrary, Type::kText, "", "a number, or Slurm's `N(xK)` form", "",
          "Slurm's srun: the ranks on this host, when it is a plain number."),
      {"SLURM_JOB_ID",
       R::kLibrary,
       Type::kInteger,
       "",
       "a non-negative integer",
       "",
       "Slurm's job id: without `MASTER_PORT`, srun's ranks and dtrain-run in a step meet at port 15000 + its "
       "last four digits.",
       {},
       0,
       int64_t{1} << 40,
       1},
      row("SLURM_STEP_NODELIST", R::kLibrary, Type::kText, "", "a Slurm host list, e.g. `node[01-04],gpu7`", "",
          "Hosts of the srun step: without `MASTER_ADDR`, srun's ranks and dtrain-run in a step meet on the first."),
      row("SLURM_JOB_NODELIST", R::kLibrary, Type::kText, "", "a Slurm host list", "",
          "Hosts of the job, when `SLURM_STEP_NODELIST` is unset."),
      row("SLURM_STEP_ID", R::kLibrary, Type::kText, "", "any text", "",
          "Set in an srun step: a program that finds `SLURM_PROCID` without it runs in a batch script, "
          "not in a step, and refuses to wait for ranks nobody starts."),
      row("MASTER_ADDR", R::kLibrary, Type::kHost, "", "a host name or address", "use e.g. 127.0.0.1 or node0.example",
          "Host of the rendezvous store (`env://`); Gloo binds to the interface that routes to it."),
      row("MASTER_PORT", R::kLibrary, Type::kPort, "", "a valid port",
          "use a number from 1 to 65535 (29500 is PyTorch's default)", "Port of the rendezvous store (`env://`)."),
      // dtrain-run.
      row("DTRAIN_RUN_RDZV_REPORT_S", R::kLauncher, Type::kSeconds, "30", "a positive number of seconds", "",
          "Seconds between node 0's lines naming the nodes it still waits for. For the launcher's tests, "
          "which cannot wait 30 s; not a user setting."),
      row("PATH", R::kLauncher, Type::kText, "/usr/local/bin:/usr/bin:/bin", "folders, colon-separated", "",
          "Where the program is looked up when its name has no `/`."),
      row("OMP_NUM_THREADS", R::kLauncher, Type::kText, "", "any text", "",
          "Left alone when set; unset, each worker gets cores / `--nproc_per_node` (at least 1)."),
      rank_row("SLURM_STEP_NUM_TASKS", R::kLauncher, "it is set by srun",
               "Tasks of the srun step: more than one makes each task's dtrain-run one node of the job."),
      rank_row("SLURM_NODEID", R::kLauncher, "it is set by srun",
               "This task's node in the step (indexes `SLURM_STEP_TASKS_PER_NODE`)."),
      row("SLURM_STEP_TASKS_PER_NODE", R::kLauncher, Type::kText, "", "Slurm's task counts, e.g. `2(x3),1`", "",
          "Tasks of the step on each node: with `SLURM_LOCALID`, the workers' `LOCAL_RANK` across the tasks "
          "that share a host."),
      // torchrun's flags from the environment (Note [torchrun's command line] in tools/dtrain-run/cluster.h).
      pet_row("PET_NNODES", "The default of `--nnodes`, as torchrun reads it; the flag wins."),
      pet_row("PET_NPROC_PER_NODE", "The default of `--nproc_per_node`, as torchrun reads it; the flag wins."),
      pet_row("PET_NODE_RANK", "The default of `--node_rank`, as torchrun reads it; the flag wins."),
      pet_row("PET_MASTER_ADDR", "The default of `--master_addr`, as torchrun reads it; the flag wins."),
      pet_row("PET_MASTER_PORT", "The default of `--master_port`, as torchrun reads it; the flag wins."),
      pet_row("PET_RDZV_BACKEND", "The default of `--rdzv_backend`, as torchrun reads it; the flag wins."),
      pet_row("PET_RDZV_ENDPOINT", "The default of `--rdzv_endpoint`, as torchrun reads it; the flag wins."),
      pet_row("PET_RDZV_ID", "The default of `--rdzv_id` (`--run_id`), as torchrun reads it; the flag wins."),
      pet_row("PET_RDZV_CONF", "The default of `--rdzv_conf`, as torchrun reads it; the flag wins."),
      pet_row("PET_STANDALONE",
              "The default of `--standalone` (a non-zero integer: on), as torchrun reads it; the flag wins."),
      pet_row("PET_MAX_RESTARTS", "The default of `--max_restarts`, as torchrun reads it; the flag wins."),
      pet_row("PET_MONITOR_INTERVAL", "The default of `--monitor_interval`, as torchrun reads it; the flag wins."),
      pet_row("PET_ROLE", "The default of `--role`, as torchrun reads it; the flag wins."),
      pet_row("PET_LOCAL_ADDR", "The default of `--local_addr`, as torchrun reads it; the flag wins."),
      pet_row("PET_LOG_DIR", "The default of `--log_dir`, as torchrun reads it; the flag wins."),
      pet_row("PET_REDIRECTS", "The default of `--redirects`, as torchrun reads it; the flag wins."),
      pet_row("PET_TEE", "The default of `--tee`, as torchrun reads it; the flag wins."),
      pet_row("PET_LOCAL_RANKS_FILTER", "The default of `--local_ranks_filter`, as torchrun reads it; the flag wins."),
      pet_row("PET_NO_PYTHON",
              "The default of `--no_python` (a non-zero integer: on), as torchrun reads it; the flag wins."),
      pet_row("PET_MODULE", "torchrun's `-m`: a non-zero integer is refused, as `-m` is."),
      row("TMPDIR", R::kLauncher, Type::kText, "/tmp", "a folder", "",
          "Where `--tee`/`--redirects` without `--log_dir` make the log folder, as torchrun does, and where "
          "the workers' flight records go without `--log_dir`."),
      row("CUDA_VISIBLE_DEVICES", R::kLauncher, Type::kText, "", "device numbers or UUIDs, comma-separated", "",
          "The GPUs `--nproc_per_node gpu` and `auto` count (CUDA stops at the first entry that is not one)."),
      // Set by dtrain-run for the program; dtrain reads neither.
      row("DTRAIN_RUN_ID", R::kNobody, Type::kText, "", "any text", "", "`--run_id`, also as `TORCHELASTIC_RUN_ID`."),
      row("DTRAIN_MAX_RESTARTS", R::kNobody, Type::kText, "", "a non-negative integer", "",
          "`--max_restarts`, also as `TORCHELASTIC_MAX_RESTARTS`."),
  };
}

const char* type_name(Type t) {
  switch (t) {
    case Type::kFlag:
      return "flag";
    case Type::kChoice:
      return "choice";
    case Type::kInteger:
      return "integer";
    case Type::kSeconds:
      return "seconds";
    case Type::kPort:
      return "port";
    case Type::kHost:
      return "host";
    case Type::kText:
      return "text";
    case Type::kList:
      return "list";
  }
  return "?";
}

const Knob& typed(const char* name, Type t) {
  const Knob& k = knob(name);
  DTRAIN_ASSERT(k.type == t, name, " is read as ", type_name(t), " but its row in src/common/env.cpp says ",
                type_name(k.type));
  return k;
}

// The value, or the row's fallback; nullopt when both are absent.
std::optional<std::string> value_of(const Knob& k, const Lookup& from) {
  if (auto v = from(k.name)) return v;
  if (*k.fallback) return std::string(k.fallback);
  return std::nullopt;
}

bool is_number_like(Type t) {
  return t == Type::kInteger || t == Type::kSeconds || t == Type::kPort || t == Type::kHost;
}

[[noreturn]] void invalid(const Knob& k, const std::string& value, const std::string& remedy = "") {
  if (is_number_like(k.type)) {
    const std::string& r = remedy.empty() ? std::string(k.remedy) : remedy;
    throw Error(detail::cat(k.name, "='", value, "' is not ", k.allowed, r.empty() ? "" : ": ", r));
  }
  // DTRAIN_DEBUG's message is older than this table, unquoted; tests and docs match it as it is.
  if (std::strcmp(k.name, "DTRAIN_DEBUG") == 0)
    throw Error(detail::cat(k.name, "=", value, " is not a debug level: use ", k.allowed));
  throw Error(detail::cat(k.name, "='", value, "' is invalid: use ", k.allowed));
}

std::string one_of(const Knob& k, const Lookup& from) {
  const std::string v = value_of(k, from).value_or("");
  for (const std::string& c : k.choices)
    if (v == c) return v;
  invalid(k, v);
}

}  // namespace

const std::vector<Knob>& knobs() {
  static const std::vector<Knob> table = make_table();
  return table;
}

const Knob& knob(const std::string& name) {
  for (const Knob& k : knobs())
    if (name == k.name) return k;
  DTRAIN_ASSERT(false, "the environment variable ", name, " has no row in src/common/env.cpp's table");
  std::abort();  // unreachable: the assertion throws
}

Lookup process() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v || !*v) return std::nullopt;
    return std::string(v);
  };
}

bool flag(const char* name, const Lookup& from) { return one_of(typed(name, Type::kFlag), from) == "1"; }

std::string choice(const char* name, const Lookup& from) { return one_of(typed(name, Type::kChoice), from); }

std::optional<int64_t> integer(const char* name, const Lookup& from, const std::string& remedy) {
  const Knob& k = typed(name, Type::kInteger);
  auto v = value_of(k, from);
  if (!v) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long n = std::strtoll(v->c_str(), &end, 10);
  const bool ok = end && *end == '\0' && errno == 0 && n >= k.min && n <= k.max && n % k.multiple == 0;
  if (!ok) invalid(k, *v, remedy);
  return n;
}

std::optional<double> seconds(const char* name, const Lookup& from) {
  const Knob& k = typed(name, Type::kSeconds);
  auto v = value_of(k, from);
  if (!v) return std::nullopt;
  char* end = nullptr;
  const double s = std::strtod(v->c_str(), &end);
  if (!(end && *end == '\0' && std::isfinite(s) && s > 0)) invalid(k, *v);
  // Converted to milliseconds in int64: more than 31 years means "never", and cannot overflow.
  return std::min(s, 1e9);
}

uint16_t parse_port(const std::string& value, const std::string& what) {
  long v = -1;
  if (util::is_digits(value) && value.size() <= 5) v = std::strtol(value.c_str(), nullptr, 10);
  if (v < 1 || v > 65535) {
    const Knob& k = knob("MASTER_PORT");  // every port is checked as MASTER_PORT is
    throw Error(detail::cat(what, "='", value, "' is not ", k.allowed, ": ", k.remedy));
  }
  return static_cast<uint16_t>(v);
}

std::optional<uint16_t> port(const char* name, const Lookup& from) {
  const Knob& k = typed(name, Type::kPort);
  auto v = value_of(k, from);
  if (!v) return std::nullopt;
  return parse_port(*v, k.name);
}

std::optional<std::string> host(const char* name, const Lookup& from) {
  const Knob& k = typed(name, Type::kHost);
  auto v = value_of(k, from);
  if (v && v->find_first_of(" /\t") != std::string::npos) invalid(k, *v);
  return v;
}

std::optional<std::string> text(const char* name, const Lookup& from) {
  return value_of(typed(name, Type::kText), from);
}

std::vector<std::string> list(const char* name, const Lookup& from) {
  std::vector<std::string> out;
  auto v = value_of(typed(name, Type::kList), from);
  if (!v) return out;
  for (const std::string& item : util::split(*v, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

std::map<std::string, std::string> all_variables() {
  std::map<std::string, std::string> out;
  for (char** e = environ; *e; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq) out[std::string(*e, static_cast<size_t>(eq - *e))] = eq + 1;
  }
  return out;
}

std::string markdown_tables() {
  struct Section {
    Reader reader;
    const char* title;
  };
  const Section sections[] = {
      {Reader::kLibrary, "Read by the library (every program that links dtrain)"},
      {Reader::kLauncher, "Read by the launcher `dtrain-run`"},
      {Reader::kNobody, "Set by `dtrain-run` for the program (dtrain reads neither)"},
  };
  std::ostringstream os;
  for (const Section& s : sections) {
    os << "### " << s.title << "\n\n| Variable | Type | Default | Allowed | Meaning |\n|---|---|---|---|---|\n";
    for (const Knob& k : knobs()) {
      if (k.reader != s.reader) continue;
      const std::string fallback = *k.fallback ? detail::cat("`", k.fallback, "`") : "unset";
      const std::string remedy = *k.remedy ? detail::cat(": ", k.remedy) : "";
      os << "| `" << k.name << "` | " << type_name(k.type) << " | " << fallback << " | " << k.allowed << remedy << " | "
         << k.meaning << " |\n";
    }
    os << "\n";
  }
  return os.str();
}

}  // namespace dtrain::env
