// init_process_group / destroy_process_group / new_group.
//
// Rendezvous, step by step:
//   1. Read rank and world size (launch_env: dtrain-run, torchrun, mpirun, srun, or explicit).
//   2. Reach the store: file:// -> c10d::FileStore; env:// or tcp:// -> dtrain's store at the master
//      address (hosted by dtrain-run when DTRAIN_AGENT_STORE=1, else by rank 0 in this process,
//      bound to MASTER_ADDR only), or torchrun's c10d TCPStore when torchrun hosts it. Ranks started
//      by srun without MASTER_ADDR / MASTER_PORT take them from Slurm's job, and rank 0 says so
//      (Note [Rendezvous under Slurm] in common/slurm.h).
//   3. Every key lives under "dtrain/a<restart>/" so an elastic restart never sees stale keys.
//   4. Agree (rendezvous_check.cpp): world size, no duplicate ranks, local ranks from host names.
//   5. Build the default group's backend (Gloo: a full mesh of TCP pairs bound to the interface
//      that reaches the master).
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/backend.h"
#include "comm/launch_env.h"
#include "comm/pytorch_peers.h"
#include "comm/rendezvous_check.h"
#include "comm/state.h"
#include "comm/store_count.h"
#include "comm/debug_check.h"
#include "comm/store_adapter.h"
#include "common/util.h"
#include "compat/torchrun_store_compat.h"
#include "comm/flight_recorder.h"
#include "store/store.h"

namespace dtrain {
namespace comm {
namespace {

// The process group of this process. If the program exits without destroy_process_group() (an
// error on the way, say), this holder's destructor runs among the static destructors, after CUDA
// has begun shutting down: destroying an NCCL group then aborts the process ("driver shutting
// down") and hides the program's own error and exit status. At that point the state is left to the
// operating system instead, as it would be after a crash.
struct StateHolder : std::unique_ptr<WorldState> {
  ~StateHolder() {
    if (get() && get()->backend == "nccl") (void)release();
  }
};
StateHolder g_state;
std::mutex g_mu;

std::chrono::milliseconds resolve_timeout(const InitOptions& o) {
  if (o.timeout()) {
    DTRAIN_CHECK(o.timeout()->count() > 0, "timeout must be > 0 ms, got ", o.timeout()->count());
    return util::capped(*o.timeout());  // milliseconds::max(): forever, not a deadline in the past
  }
  // Unset, the table's fallback applies: kDefaultTimeout, PyTorch's 30 min (ctest env_test).
  return util::millis_of_seconds(*env::seconds("DTRAIN_TIMEOUT_S"));
}

// The local address of the interface that routes to host (a UDP connect sends nothing).
std::string local_address_towards(const std::string& host) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_DGRAM;
  if (getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || !res) return "127.0.0.1";
  std::string out = "127.0.0.1";
  int fd = socket(res->ai_family, SOCK_DGRAM, 0);
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    char buf[INET6_ADDRSTRLEN] = {0};
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0 &&
        getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) == 0)
      out = buf;
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  return out;
}

// Step 2: the store this job's ranks share.
//
// Note [Open stores]: a store anyone can reach is one anyone can read and write (the ranks' addresses,
// the rendezvous, a restart's keys), so every mode that hosts one without the job secret says so in
// one line at start, naming where it listens, whatever else the job prints: rank 0's own store with
// DTRAIN_JOB_SECRET unset (dtrain-run gives its workers one, so this is a job started without it),
// and the TCPStore a job with PyTorch peers needs, which binds every interface and has no
// authentication at all (PyTorch's protocol: the secret cannot apply, and a set one would otherwise
// be ignored in silence). Under torchrun, torchrun hosts the store; a set secret is said not to apply.
c10::intrusive_ptr<c10d::Store> connect_store(const InitOptions& o, const LaunchEnv& le, WorldState& st) {
  const std::string& m = o.init_method();
  if (m.rfind("file://", 0) == 0) {
    std::string path = m.substr(7);
    DTRAIN_CHECK(!path.empty(), "init_method '", m, "' has no path: use file:///shared/dir/file");
    auto master = env::host("MASTER_ADDR");
    st.bind_address = master ? local_address_towards(*master) : "127.0.0.1";
    return c10::make_intrusive<c10d::FileStore>(path, st.world_size);
  }
  Endpoint ep;
  if (m == "env://") {
    ep = master_from_env(env::process(), le.launcher == "srun");
    if (!ep.note.empty() && st.rank == 0) info("dtrain: " + ep.note);
  } else if (m.rfind("tcp://", 0) == 0)
    ep = parse_tcp_url(m);
  else
    DTRAIN_CHECK(false, "unknown init_method '", m, "': use env://, tcp://host:port or file:///path");

  // dtrain-run gives its workers the job's secret; a job started otherwise may set it itself.
  const std::optional<std::string> given = env::text(store::kSecretEnv);
  const bool secret_given = given && !given->empty();
  if (st.pytorch_peers) {
    st.bind_address = local_address_towards(ep.host);
    const bool torchrun_hosts = le.torchelastic_agent_store && !le.dtrain_agent_store;
    st.python_store = connect_pytorch_store(ep, st.rank, st.world_size, st.timeout, torchrun_hosts);
    // See Note [Open stores]: PyTorch's TCPStore binds every interface and has no authentication.
    if (st.rank == 0 && !torchrun_hosts)
      info(
          detail::cat("dtrain: rank 0 hosts this job's store as Python ranks need it, PyTorch's TCPStore: it "
                      "listens on every interface (0.0.0.0 and ::, port ",
                      ep.port, ") with no authentication, ",
                      secret_given ? "and DTRAIN_JOB_SECRET, which is set, does not apply to it"
                                   : "which DTRAIN_JOB_SECRET cannot change",
                      ": anyone who reaches the port can read and change the job's keys; run the job where only "
                      "its machines reach each other"));
    return st.python_store;
  }

  if (le.torchelastic_agent_store && !le.dtrain_agent_store) {
    if (secret_given && st.rank == 0)  // See Note [Open stores].
      info(
          "dtrain: DTRAIN_JOB_SECRET is set, but torchrun hosts this job's store (its TCPStore, with no "
          "authentication): the secret does not apply; start the job with dtrain-run to use it");
    compat::check_torchrun_store(ep.host, ep.port, st.rank);
    c10d::TCPStoreOptions opts;
    opts.port = ep.port;
    opts.isServer = false;
    opts.waitWorkers = false;
    opts.timeout = st.timeout;
    st.bind_address = local_address_towards(ep.host);
    return c10::make_intrusive<c10d::TCPStore>(ep.host, opts);
  }
  DTRAIN_CHECK(!util::is_wildcard_address(ep.host), "rank ", st.rank, ": MASTER_ADDR ", ep.host,
               " is the wildcard address, not rank 0's: the store would listen on every network this machine "
               "is on; give rank 0's own address or host name (127.0.0.1 on one machine)");
  const std::string secret = secret_given ? store::check_job_secret(*given, store::kSecretEnv) : "";
  if (!le.dtrain_agent_store && st.rank == 0) {
    // See Note [Open stores].
    if (secret.empty())
      info(detail::cat("dtrain: rank 0's store listens on ", ep.host, " port ", ep.port,
                       " with no job secret (DTRAIN_JOB_SECRET is unset): anyone who reaches that address can "
                       "read and change the job's keys; set DTRAIN_JOB_SECRET (32 bytes or more, one line) on "
                       "every rank, or start the job with dtrain-run, which makes one"));
    // Rank 0 binds its own name, which may not resolve yet (a pod's DNS record): it waits as the
    // others' clients do (Note [Names that resolve late] in src/store/resolve.cpp).
    store::resolve_waiting(ep.host, ep.port, st.timeout, "MASTER_ADDR",
                           [](const std::string& line) { warn_once("rank0-late-name", line); });
    st.server = std::make_unique<store::StoreServer>(ep.host, ep.port, secret);
  }
  auto client = c10::make_intrusive<ClientStore>(ep.host, ep.port, st.timeout, secret);
  st.bind_address = client->local_address();
  return client;
}

// Runs f(); a foreign exception (c10's, the socket's) becomes a dtrain::Error that starts with
// `context`; a dtrain::Error already names its rank and remedy and passes as it is.
template <class F>
auto with_context(const std::string& context, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const dtrain::Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(context + brief(e));
  }
}

}  // namespace

WorldState* world_state_or_null() { return g_state.get(); }

WorldState& world_state() {
  DTRAIN_CHECK(g_state, "dtrain is not initialized: call dtrain::init_process_group() first");
  return *g_state;
}

const detail::GroupImpl& resolve(const Group& group) {
  return group.is_default() ? *world_state().world : detail::GroupAccess::impl(group);
}

std::shared_ptr<detail::GroupImpl> make_group(WorldState& st, const std::string& name, std::vector<int> ranks,
                                              std::chrono::milliseconds timeout) {
  auto g = std::make_shared<detail::GroupImpl>();
  g->name = name;
  g->backend = st.backend;
  g->ranks = std::move(ranks);
  g->timeout = timeout;
  for (size_t i = 0; i < g->ranks.size(); ++i) {
    g->group_rank_of[g->ranks[i]] = static_cast<int>(i);
    if (g->ranks[i] == st.rank) g->rank = static_cast<int>(i);
  }
  if (g->rank >= 0) {
    BackendConfig c;
    c.name = st.backend;
    c.pytorch_peers = st.pytorch_peers;
    if (st.pytorch_peers) {
      c.python_group = name == "default" ? "0" : name;
      c.store = pytorch_group_store(st.python_store, c.python_group);
    } else {
      c.store = c10::make_intrusive<c10d::PrefixStore>("pg/" + name, st.store);
    }
    c.rank = g->rank;
    c.size = static_cast<int>(g->ranks.size());
    c.timeout = timeout;
    c.bind_address = st.bind_address;
    c.global_ranks = g->ranks;
    Backend made = with_context(detail::cat("rank ", st.rank, ": creating the ", st.backend, " process group '", name,
                                            "' (", g->ranks.size(), " ranks) failed: "),
                                [&] { return make_backend(c); });
    g->pg = std::move(made.pg);
    g->caps = made.caps;
    g->flight = make_flight_ring(name, st.backend, g->ranks, timeout.count());
  }
  return g;
}

void await_members(WorldState& st, const detail::GroupImpl& g, std::chrono::milliseconds timeout,
                   const std::string& remedy) {
  // Note [new_group barrier]: a member that finishes connecting first could drop the group (and
  // close its connections) while a peer is still completing its own handshake with it, which then
  // fails with "Connection closed by peer". Members return only once all of them have connected,
  // as PyTorch's store-based barrier after new_group.
  if (g.rank < 0 || g.ranks.size() < 2) return;
  const std::string key = "pg/" + g.name + "/connected";
  st.store->add(key, 1);
  wait_for_count(*st.store, key, static_cast<int64_t>(g.ranks.size()), timeout,
                 detail::cat("rank ", st.rank, ": creating group '", g.name, "'"), remedy);
}

}  // namespace comm

void init_process_group(const InitOptions& o) {
  using namespace comm;
  std::lock_guard<std::mutex> lock(g_mu);
  DTRAIN_CHECK(!g_state, "init_process_group was called twice: call destroy_process_group() first");
  init_debug_level();  // a bad DTRAIN_DEBUG fails here, not in the first collective
  auto st = std::make_unique<WorldState>();
  st->backend = !o.backend().empty() ? o.backend() : env::choice("DTRAIN_BACKEND");
  check_backend_name(st->backend);
  st->timeout = resolve_timeout(o);
  LaunchEnv le = read_launch_env(env::process(), o.rank(), o.world_size());
  st->rank = le.rank;
  st->world_size = le.world_size;
  start_flight_recorder(st->rank, st->world_size);  // a bad knob fails here; before any group: each gets a ring
  st->launcher = le.launcher;
  st->restart_count = le.restart_count;
  st->pytorch_peers = pytorch_peers_requested(o.pytorch_peers());
  if (st->pytorch_peers) {
    DTRAIN_CHECK(st->backend == "gloo", "rank ", st->rank,
                 ": with Python ranks in the job (DTRAIN_PYTORCH_PEERS) "
                 "the backend must be 'gloo', got '",
                 st->backend, "'");
    DTRAIN_CHECK(!detail_checks_on(), "rank ", st->rank,
                 ": DTRAIN_DEBUG=DETAIL compares calls through dtrain's "
                 "store keys, which Python ranks never write: unset DTRAIN_DEBUG when the job has Python ranks");
    DTRAIN_CHECK(o.init_method().rfind("file://", 0) != 0, "rank ", st->rank,
                 ": with Python ranks in the job "
                 "use init_method env:// or tcp://, got '",
                 o.init_method(), "'");
  }

  // The store's socket errors carry their remedy; they become dtrain::Errors naming the rank.
  c10::intrusive_ptr<c10d::Store> base =
      with_context(detail::cat("rank ", st->rank, ": init_process_group: "), [&] { return connect_store(o, le, *st); });
  // The replicas of dtrain-run --ft share the launcher's store, each its own world: a replica's keys
  // go under its id (and its relaunch count, which dtrain-run gives each replica as its restart count).
  const std::string replica = env::text("DTRAIN_FT_REPLICA_ID").value_or("");
  st->store = c10::make_intrusive<c10d::PrefixStore>(
      (replica.empty() ? "dtrain/a" : "dtrain/ft" + replica + "/a") + std::to_string(le.restart_count), base);
  if (st->pytorch_peers) {
    // Python ranks take part in no dtrain check: the launcher's local ranks, else one host.
    st->local_rank = le.local_rank >= 0 ? le.local_rank : st->rank;
    st->local_world_size = le.local_world_size > 0 ? le.local_world_size : st->world_size;
  } else {
    LocalRanks lr = rendezvous_check(*st->store, st->rank, st->world_size, st->bind_address, le.local_rank,
                                     le.local_world_size, st->timeout);
    st->local_rank = lr.local_rank;
    st->local_world_size = lr.local_world_size;
  }

  std::vector<int> all(st->world_size);
  for (int i = 0; i < st->world_size; ++i) all[i] = i;
  st->world = make_group(*st, "default", all, st->timeout);
  static_cast<std::unique_ptr<WorldState>&>(g_state) = std::move(st);
}

bool is_initialized() { return comm::world_state_or_null() != nullptr; }

void destroy_process_group() {
  using namespace comm;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_state) return;
  stop_flight_recorder();
  if (g_state->pytorch_peers) {  // Python ranks do not check out; their store needs no host after init
    g_state.reset();
    return;
  }
  // Note [Store lifetime]: rank 0 may host the store; leaving before every rank is done with it
  // would break a slower rank still rendezvousing. Everyone checks out; the host waits (bounded).
  try {
    g_state->store->add("destroy", 1);
    if (g_state->server)
      wait_for_count(*g_state->store, "destroy", g_state->world_size,
                     std::min<std::chrono::milliseconds>(g_state->timeout, std::chrono::seconds(10)),
                     detail::cat("rank ", g_state->rank, ": destroy_process_group"),
                     "every rank must call destroy_process_group");
  } catch (const std::exception&) {
    // The store is gone (host exited), or a rank never checked out (it failed, say): destroy goes on,
    // as it would after the wait.
  }
  g_state.reset();
}

int rank() { return comm::world_state().rank; }
int world_size() { return comm::world_state().world_size; }
int local_rank() { return comm::world_state().local_rank; }
int local_world_size() { return comm::world_state().local_world_size; }
int restart_count() { return comm::world_state().restart_count; }
std::string backend() { return comm::world_state().backend; }
c10::intrusive_ptr<c10d::Store> default_store() { return comm::world_state().store; }

Group new_group(std::vector<int> ranks, std::optional<std::chrono::milliseconds> timeout) {
  auto& st = comm::world_state();
  std::sort(ranks.begin(), ranks.end());
  DTRAIN_CHECK(std::adjacent_find(ranks.begin(), ranks.end()) == ranks.end(), "new_group: rank ",
               *std::adjacent_find(ranks.begin(), ranks.end()), " is listed twice: list each rank once");
  for (int r : ranks)
    DTRAIN_CHECK(r >= 0 && r < st.world_size, "new_group: rank ", r, " is out of range for world size ", st.world_size,
                 ": ranks go from 0 to ", st.world_size - 1);
  if (ranks.empty())
    for (int i = 0; i < st.world_size; ++i) ranks.push_back(i);
  const auto group_timeout = util::capped(timeout.value_or(st.timeout));
  if (st.pytorch_peers) {
    // Note [PyTorch peers]: Python's name for the group, and no dtrain keys Python would never write
    // (Gloo's own connection through the store is the members' meeting).
    auto g = comm::make_group(st, std::to_string(st.next_group_id++), std::move(ranks), group_timeout);
    return detail::GroupAccess::make(std::move(g));
  }
  std::string name = "group" + std::to_string(st.next_group_id++);
  auto g = comm::make_group(st, name, std::move(ranks), group_timeout);
  comm::await_members(st, *g, group_timeout, "every rank must call new_group with the same ranks in the same order");
  return detail::GroupAccess::make(std::move(g));
}

}  // namespace dtrain
