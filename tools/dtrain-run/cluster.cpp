// torchrun's command line and environment, and Kubeflow's pods (see cluster.h).
#include "cluster.h"

#include <dirent.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>

#include "common/util.h"

namespace dtrain::run {

namespace {

// "--start-method" and "--start_method" alike: the name without dashes, '-' as '_'.
std::string canonical(const std::string& flag) {
  const size_t start = flag.find_first_not_of('-');
  std::string s = start == std::string::npos ? "" : flag.substr(start);
  std::replace(s.begin(), s.end(), '-', '_');
  return s;
}

constexpr const char* kModule =
    "runs a Python module (python -m) and dtrain-run starts programs, not modules: give the program instead, e.g. "
    "dtrain-run [OPTIONS] python3 -m MODULE ARGS";

// torchrun's flags that dtrain-run does not take, and what to do instead.
const std::map<std::string, const char*>& torchrun_only() {
  static const std::map<std::string, const char*> table = {
      {"m", kModule},
      {"module", kModule},
      {"start_method", "is Python multiprocessing's; dtrain-run forks and execs each worker: drop it"},
      {"run_path", "runs a script inside torchrun's interpreter; dtrain-run starts programs: drop it"},
      {"event_log_handler", "is torchrun's Python event log; dtrain-run has none: drop it"},
      {"log_line_prefix_template", "is not taken: dtrain-run prefixes each console line with [rank N]; drop it"},
      {"duplicate_stdout_filters", "is not taken: use --tee with --log_dir and search the log files"},
      {"duplicate_stderr_filters", "is not taken: use --tee with --log_dir and search the log files"},
      {"logs_specs", "is a Python entry point; dtrain-run writes torchrun's default log layout: drop it"},
      {"numa_binding", "is not taken: bind in the program, or start it through numactl as the program"},
      {"signals_to_handle", "is not taken: dtrain-run forwards SIGINT, SIGTERM and SIGHUP to the workers; drop it"},
      {"shutdown_timeout", "is not taken: use --grace_period SECONDS (between SIGTERM and SIGKILL)"},
      {"virtual_local_rank", "is not taken: drop it and choose the device from LOCAL_RANK in the program"},
      {"print_completion", "is not taken: dtrain-run has no shell completion"},
      {"use_env",
       "is torch.distributed.launch's: dtrain-run always sets LOCAL_RANK in the environment (and passes "
       "--local_rank=N with --use_local_rank_arg); drop it"},
  };
  return table;
}

// The options whose default torchrun reads from PET_<dest>, by dtrain-run's first long name.
const std::map<std::string, const char*>& pet_names() {
  static const std::map<std::string, const char*> table = {
      {"nproc_per_node", "PET_NPROC_PER_NODE"},
      {"nnodes", "PET_NNODES"},
      {"node_rank", "PET_NODE_RANK"},
      {"master_addr", "PET_MASTER_ADDR"},
      {"master_port", "PET_MASTER_PORT"},
      {"standalone", "PET_STANDALONE"},
      {"max_restarts", "PET_MAX_RESTARTS"},
      {"monitor_interval", "PET_MONITOR_INTERVAL"},
      {"log_dir", "PET_LOG_DIR"},
      {"redirects", "PET_REDIRECTS"},
      {"tee", "PET_TEE"},
      {"run_id", "PET_RDZV_ID"},
      {"rdzv_conf", "PET_RDZV_CONF"},
      {"rdzv_backend", "PET_RDZV_BACKEND"},
      {"rdzv_endpoint", "PET_RDZV_ENDPOINT"},
      {"role", "PET_ROLE"},
      {"local_addr", "PET_LOCAL_ADDR"},
      {"local_ranks_filter", "PET_LOCAL_RANKS_FILTER"},
      {"no_python", "PET_NO_PYTHON"},
  };
  return table;
}

bool parse_count(const std::string& s, long long* out) {
  if (!util::is_digits(s) || s.size() > 9) return false;
  *out = std::atoll(s.c_str());
  return true;
}

// The CPUs this process may run on (torch._utils.cpu_count: the affinity mask, as taskset and cgroups set it).
int affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return online_cores();
}

// NVIDIA GPUs the driver lists, as many of them as CUDA_VISIBLE_DEVICES leaves (CUDA stops reading
// that list at its first entry that is not a device).
int visible_gpus() {
  int found = 0;
  if (DIR* d = opendir("/proc/driver/nvidia/gpus")) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') ++found;
    closedir(d);
  }
  const std::optional<std::string> visible = env::text("CUDA_VISIBLE_DEVICES");
  if (!visible) return found;
  int listed = 0;
  for (const std::string& item : util::split(*visible, ',')) {
    if (!util::is_digits(item) && item.rfind("GPU-", 0) != 0 && item.rfind("MIG-", 0) != 0) break;
    ++listed;
  }
  return std::min(found, listed);
}

double conf_seconds(const std::string& key, const std::string& value) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(value.c_str(), &end);
  if (value.empty() || errno != 0 || *end != '\0' || !(v > 0))
    throw UsageError("--rdzv_conf " + key + "=" + value + ": give a number of seconds > 0 (e.g. " + key + "=600)");
  return v;
}

}  // namespace

void refuse_torchrun_only_flag(const std::string& name) {
  const auto it = torchrun_only().find(canonical(name));
  if (it == torchrun_only().end()) return;
  throw UsageError(name + " is torchrun's and dtrain-run does not take it: it " + it->second);
}

std::string pet_variable(const CLI::Option& opt) {
  const auto& lnames = opt.get_lnames();
  if (lnames.empty()) return "";
  const auto it = pet_names().find(lnames.front());
  return it == pet_names().end() ? "" : it->second;
}

std::vector<std::string> pet_defaults(const CLI::App& app, const std::vector<const CLI::Option*>& given,
                                      const env::Lookup& from, std::vector<std::string>* used) {
  if (const std::optional<std::string> module = env::text("PET_MODULE", from); module && *module != "0")
    refuse_torchrun_only_flag("--module");
  std::vector<std::string> args;
  for (const CLI::Option* opt : app.get_options()) {
    const std::string pet = pet_variable(*opt);
    if (pet.empty() || std::find(given.begin(), given.end(), opt) != given.end()) continue;
    const std::optional<std::string> value = env::text(pet.c_str(), from);
    if (!value) continue;
    const std::string flag = "--" + opt->get_lnames().front();
    if (opt->get_items_expected_max() == 0) {  // on/off: check_env's bool(int(value))
      long long n = 0;
      if (!parse_count(*value, &n))
        throw UsageError(pet + "='" + *value + "' must be an integer (0: off, else on), as torchrun reads it for " +
                         flag);
      if (n != 0) args.push_back(flag);
    } else {
      args.push_back(flag + "=" + *value);
    }
    used->push_back(pet + "=" + *value);
  }
  return args;
}

int parse_nproc(const std::string& nproc) {
  long long v = 0;
  if (nproc == "cpu") return affinity_cpus();
  if (nproc == "gpu" || nproc == "auto") {
    const int gpus = visible_gpus();
    if (gpus > 0) return gpus;
    if (nproc == "auto") return affinity_cpus();
    throw UsageError(
        "--nproc_per_node gpu: this machine has no GPU that CUDA could see (no /proc/driver/nvidia/gpus entry, or "
        "CUDA_VISIBLE_DEVICES hides them): give a number, cpu or auto");
  }
  if (!parse_count(nproc, &v) || v < 1 || v > 4096)
    throw UsageError("--nproc_per_node must be a positive integer, auto, cpu or gpu, got '" + nproc + "'");
  return static_cast<int>(v);
}

StdStreams parse_std_streams(const std::string& flag, const std::string& value) {
  auto mask = [](const std::string& v) { return v.size() == 1 && v[0] >= '0' && v[0] <= '3' ? v[0] - '0' : -1; };
  const std::string example = flag + " 0:3,1:2";
  const auto bad = [&] {
    return UsageError(flag + " must be 0 (none), 1 (stdout), 2 (stderr), 3 (both), or LOCAL_RANK:MASK,... for some " +
                      "local ranks (e.g. " + example + "), got '" + value + "'");
  };
  StdStreams s;
  if (value.find(':') == std::string::npos) {
    s.all = mask(value);
    if (s.all < 0) throw bad();
    return s;
  }
  s.mapped = true;
  // torchrun's "^(\d:[0-3],)*(\d:[0-3])$", any number of digits in a local rank; split() drops a
  // last empty item, which the regex refuses.
  if (value.back() == ',') throw bad();
  for (const std::string& item : util::split(value, ',')) {
    const size_t colon = item.find(':');
    const std::string rank = item.substr(0, colon);
    const int m = colon == std::string::npos ? -1 : mask(item.substr(colon + 1));
    if (!util::is_digits(rank) || rank.size() > 6 || m < 0) throw bad();
    if (!s.by_local.emplace(std::stoi(rank), m).second)
      throw UsageError(flag + " names local rank " + rank + " twice in '" + value + "': give each local rank once");
  }
  return s;
}

void parse_rdzv_conf(const std::string& conf, LaunchOptions& o) {
  size_t from = 0;
  while (from <= conf.size()) {
    const size_t comma = std::min(conf.find(',', from), conf.size());
    const std::string item = conf.substr(from, comma - from);
    from = comma + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    if (eq == std::string::npos || eq + 1 == item.size())
      throw UsageError("--rdzv_conf " + item + ": give KEY=VALUE (e.g. --rdzv_conf join_timeout=600)");
    const std::string value = item.substr(eq + 1);
    if (key == "secret_file") {
      o.secret_file = value;
    } else if (key == "join_timeout" || key == "timeout") {
      o.join_timeout = conf_seconds(key, value);
    } else if (key == "last_call_timeout") {
      o.last_call_timeout = conf_seconds(key, value);
    } else if (key == "close_timeout") {
      o.close_timeout = conf_seconds(key, value);
    } else if (key == "read_timeout") {
      o.read_timeout = conf_seconds(key, value);
    } else if (key == "is_host") {  // torchrun's get_as_bool
      std::string v = value;
      std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
      if (v == "1" || v == "true" || v == "t" || v == "yes" || v == "y")
        o.is_host = 1;
      else if (v == "0" || v == "false" || v == "f" || v == "no" || v == "n")
        o.is_host = 0;
      else
        throw UsageError("--rdzv_conf is_host=" + value + ": give 1 (this node hosts the store) or 0");
    } else {
      throw UsageError("--rdzv_conf key '" + key +
                       "' is not one dtrain-run takes (it takes join_timeout, last_call_timeout, close_timeout, "
                       "read_timeout, timeout, is_host and secret_file)");
    }
  }
}

void parse_endpoint(const std::string& endpoint, int default_port, std::string* host, int* port) {
  std::string h = endpoint, p;
  if (!h.empty() && h.front() == '[') {  // [v6] or [v6]:PORT
    const size_t close = h.find(']');
    if (close == std::string::npos || (close + 1 < h.size() && h[close + 1] != ':'))
      throw UsageError("--rdzv_endpoint '" + endpoint + "': write an IPv6 address as [ADDRESS]:PORT");
    if (close + 1 < h.size()) p = h.substr(close + 2);
    h = h.substr(1, close - 1);
  } else if (const size_t colon = h.rfind(':'); colon != std::string::npos) {
    p = h.substr(colon + 1);
    h = h.substr(0, colon);
  }
  if (h.empty()) h = "localhost";
  long long n = default_port;
  if (!p.empty() || endpoint.find(':') != std::string::npos) {
    if (!parse_count(p, &n) || n > 65535)
      throw UsageError("--rdzv_endpoint '" + endpoint + "': the port must be a number 0..65535 (HOST:PORT)");
  }
  if (h.find_first_of(" /,;@") != std::string::npos)
    throw UsageError("--rdzv_endpoint '" + endpoint + "': give HOST[:PORT], a host name or address and a port");
  *host = h;
  *port = static_cast<int>(n);
}

std::string apply_pod_environment(LaunchOptions& o, bool free, const env::Lookup& from) {
  if (!free) return "";
  try {
    const auto world = env::integer("WORLD_SIZE", from);
    const auto rank = env::integer("RANK", from);
    const auto addr = env::host("MASTER_ADDR", from);
    const auto port = env::port("MASTER_PORT", from);
    if (!world || !rank || !addr || !port || env::integer("LOCAL_RANK", from)) return "";
    if (*world < 1 || *rank >= *world)
      throw UsageError("RANK=" + std::to_string(*rank) + " and WORLD_SIZE=" + std::to_string(*world) +
                       " (a Kubeflow PyTorchJob pod's) do not fit: RANK must be below WORLD_SIZE; give --nnodes and "
                       "--node_rank to say which node this is");
    o.nnodes = static_cast<int>(*world);
    o.node_rank = static_cast<int>(*rank);
    o.node_rank_given = true;
    o.master_addr = *addr;
    o.master_port = *port;
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception& e) {
    throw UsageError(std::string(e.what()) + " (read as a Kubeflow PyTorchJob pod's; give --nnodes to ignore it)");
  }
  return "taking --nnodes " + std::to_string(o.nnodes) + " --node_rank " + std::to_string(o.node_rank) +
         " --master_addr " + o.master_addr + " --master_port " + std::to_string(o.master_port) +
         " from WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT (a Kubeflow PyTorchJob pod's); flags or PET_ "
         "variables override them";
}

}  // namespace dtrain::run
