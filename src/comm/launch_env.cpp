#include "comm/launch_env.h"

#include "common/slurm.h"
#include "common/util.h"
#include "dtrain/errors.h"

namespace dtrain::comm {
namespace {

const char* kRankRemedy =
    "start the program with dtrain-run (or torchrun, mpirun, srun), or set RANK and WORLD_SIZE, "
    "or pass InitOptions().rank(r).world_size(n)";

struct Source {
  const char* launcher;
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size;
};

// In order of precedence: RANK/WORLD_SIZE win (torchrun and dtrain-run also run under srun/mpirun).
constexpr Source kSources[] = {
    {"env", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {"srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr},
};

// The table bounds these below 2^24, so they fit an int.
std::optional<int> read_int(const EnvLookup& from, const char* name, const std::string& remedy) {
  if (!name) return std::nullopt;
  auto v = env::integer(name, from, remedy);
  if (!v) return std::nullopt;
  return static_cast<int>(*v);
}

}  // namespace

LaunchEnv read_launch_env(const EnvLookup& from, int explicit_rank, int explicit_world) {
  LaunchEnv out;
  for (const Source& s : kSources) {
    auto r = read_int(from, s.rank, kRankRemedy);
    auto w = read_int(from, s.size, kRankRemedy);
    if (!r && !w) continue;
    DTRAIN_CHECK(r || explicit_rank >= 0, s.rank, " is not set but ", s.size, "=", *w, " is: set both, or ",
                 kRankRemedy);
    DTRAIN_CHECK(w || explicit_world >= 0, s.size, " is not set but ", s.rank, "=", *r, " is: set both, or ",
                 kRankRemedy);
    out.rank = r.value_or(-1);
    out.world_size = w.value_or(-1);
    out.local_rank = read_int(from, s.local_rank, "set it to the rank within this host").value_or(-1);
    out.local_world_size = read_int(from, s.local_size, "set it to the number of ranks on this host").value_or(-1);
    out.launcher = s.launcher;
    break;
  }
  // Slurm writes "2(x3)" for 2 tasks on each of 3 nodes, and "2,1" for uneven nodes: only a plain
  // number says how many ranks this host has.
  if (auto v = env::text("SLURM_NTASKS_PER_NODE", from); v && out.launcher == "srun")
    if (v->size() <= 7 && util::is_digits(*v)) out.local_world_size = std::stoi(*v);
  out.dtrain_agent_store = env::flag("DTRAIN_AGENT_STORE", from);
  out.torchelastic_agent_store = env::choice("TORCHELASTIC_USE_AGENT_STORE", from) == "True";
  if (out.dtrain_agent_store)
    out.launcher = "dtrain-run";
  else if (out.torchelastic_agent_store)
    out.launcher = "torchrun";
  // The attempt number keys the rendezvous (a restarted group must not meet the keys of the failed
  // one in a store that outlives it): dtrain-run's, else torchrun's.
  if (auto v = read_int(from, "DTRAIN_RESTART_COUNT", ""))
    out.restart_count = *v;
  else if (auto t = read_int(from, "TORCHELASTIC_RESTART_COUNT", ""))
    out.restart_count = *t;

  // A batch script carries the job's SLURM_PROCID=0 and SLURM_NTASKS=N but is no
  // step: ranks 1..N-1 will never come, so say so now rather than wait out the timeout.
  if (out.launcher == "srun" && out.world_size > 1 && explicit_world < 0 && !env::text("SLURM_STEP_ID", from))
    throw Error(detail::cat("SLURM_NTASKS=", out.world_size,
                            " but SLURM_STEP_ID is not set: this is a batch script, not an srun "
                            "step, so no other rank will start; start the program with srun (or dtrain-run)"));
  if (explicit_rank >= 0) out.rank = explicit_rank;
  if (explicit_world >= 0) out.world_size = explicit_world;
  DTRAIN_CHECK(out.rank >= 0, "RANK is not set: ", kRankRemedy);
  DTRAIN_CHECK(out.world_size >= 0, "WORLD_SIZE is not set: ", kRankRemedy);
  DTRAIN_CHECK(out.world_size > 0, "WORLD_SIZE=0 is invalid: the world needs at least one rank");
  DTRAIN_CHECK(out.rank < out.world_size, "RANK=", out.rank, " is out of range for WORLD_SIZE=", out.world_size,
               ": ranks go from 0 to ", out.world_size - 1);
  if (out.local_rank >= 0 && out.local_world_size > 0) {
    DTRAIN_CHECK(out.local_rank < out.local_world_size, "LOCAL_RANK=", out.local_rank,
                 " is out of range for LOCAL_WORLD_SIZE=", out.local_world_size);
  }
  return out;
}

Endpoint master_from_env(const EnvLookup& from, bool under_srun) {
  if (under_srun)
    if (auto m = slurm::master(from, "set MASTER_ADDR to the address of the rank-0 host"))
      return Endpoint{m->host, m->port, m->note};
  auto addr = env::host("MASTER_ADDR", from);
  DTRAIN_CHECK(addr,
               "MASTER_ADDR is not set: set it to the address of the rank-0 host "
               "(127.0.0.1 on one machine), or launch with dtrain-run");
  auto port = env::port("MASTER_PORT", from);
  DTRAIN_CHECK(port,
               "MASTER_PORT is not set: set it to a free port on the rank-0 host (e.g. 29500), "
               "or launch with dtrain-run");
  return Endpoint{*addr, *port, ""};
}

Endpoint parse_tcp_url(const std::string& url) {
  const std::string prefix = "tcp://";
  DTRAIN_CHECK(url.rfind(prefix, 0) == 0, "init_method '", url, "' is not tcp://host:port");
  std::string rest = url.substr(prefix.size());
  std::string host, port;
  if (!rest.empty() && rest[0] == '[') {
    auto close = rest.find(']');
    DTRAIN_CHECK(close != std::string::npos && close + 1 < rest.size() && rest[close + 1] == ':', "init_method '", url,
                 "' is not tcp://[ipv6]:port");
    host = rest.substr(1, close - 1);
    port = rest.substr(close + 2);
  } else {
    auto colon = rest.rfind(':');
    DTRAIN_CHECK(colon != std::string::npos && colon > 0, "init_method '", url,
                 "' has no port: use tcp://host:port, e.g. tcp://127.0.0.1:29500");
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
  }
  auto slash = port.find('/');
  if (slash != std::string::npos) port = port.substr(0, slash);  // tolerate a trailing path
  return Endpoint{host, env::parse_port(port, "the port of init_method '" + url + "'"), ""};
}

}  // namespace dtrain::comm
