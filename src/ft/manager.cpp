// dtrain::ft::Manager (dtrain/fault_tolerance.h): the quorum of each step through the job's store
// (ft/quorum.h), a Gloo group per quorum, healing from a peer, and the commit vote.
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "comm/replica_group.h"
#include "common/env.h"
#include "dtrain/fault_tolerance.h"
#include "dtrain/process_group.h"
#include "ft/quorum.h"

namespace dtrain::ft {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(3);
constexpr int kHealSizeTag = 1, kHealBytesTag = 2;
// A round's keys are deleted by the decider four rounds later: by then every member of that round
// has voted and read its outcome (the next rounds wait for each of them, alive or left out).
constexpr int64_t kKeepRounds = 4;

void ft_split_addr(const std::string& addr, std::string& host, uint16_t& port) {
  const auto colon = addr.rfind(':');
  DTRAIN_CHECK(colon != std::string::npos && colon > 0, "fault tolerance: store_addr '", addr,
               "' is not host:port: give e.g. 127.0.0.1:29500, or run under dtrain-run --ft");
  const std::string p = addr.substr(colon + 1);
  DTRAIN_CHECK(!p.empty() && p.size() <= 5 && std::all_of(p.begin(), p.end(), ::isdigit) && std::stoi(p) > 0 &&
                   std::stoi(p) < 65536,
               "fault tolerance: store_addr '", addr, "' has no valid port: give e.g. 127.0.0.1:29500");
  host = addr.substr(0, colon);
  port = static_cast<uint16_t>(std::stoi(p));
}

}  // namespace

struct Manager::Impl {
  ManagerOptions opts;
  StateDict state_dict;
  LoadStateDict load_state_dict;
  std::string id, host, secret;
  uint16_t port = 0;
  int64_t incarnation = 0;
  // A replica of several ranks is a dtrain world of its own (dtrain-run --ft --ft_replica_ranks K):
  // its rank 0, the leader, alone talks to the quorum and tells the others over the world; rank r
  // meets rank r of the other replicas in its own cross-replica group.
  bool inner = false, leader = true;
  int local = 0;
  std::unique_ptr<store::StoreClient> client;
  Liveness liveness{std::chrono::milliseconds(1000)};

  std::thread heartbeat;
  std::mutex hb_mu;
  std::condition_variable hb_cv;
  bool hb_stop = false;

  int64_t step = 0, round = 0;
  bool in_step = false;
  Decision decision;
  int my_index = -1, participant_rank = -1, participants = 0;
  bool healing = false, healed = false;
  std::string error;
  compat::BackendPtr pg;
  int64_t pg_quorum = -1;

  void beat();
  Decision join_round();
  void try_decide(int64_t r);
  void cleanup(int64_t r);
  void build_group();
  void heal(const std::vector<Member>& up);
  bool decide_outcome();
  void fail(const std::string& what) {
    if (error.empty()) error = what;
  }
};

void Manager::Impl::beat() {
  try {
    store::StoreClient own(host, port, opts.timeout(), secret);
    std::unique_lock<std::mutex> lock(hb_mu);
    while (!hb_stop) {
      own.add("ft/hb/" + id, 1);
      hb_cv.wait_for(lock, opts.heartbeat_interval());
    }
  } catch (const std::exception&) {
    // The store is gone: the job is over, and the main thread's next store call says so.
  }
}

Manager::Manager(StateDict state_dict, LoadStateDict load_state_dict, ManagerOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.opts = options;
  m.state_dict = std::move(state_dict);
  m.load_state_dict = std::move(load_state_dict);
  DTRAIN_CHECK(m.state_dict && m.load_state_dict,
               "fault tolerance: Manager needs both state_dict and load_state_dict functions (healing uses them)");
  DTRAIN_CHECK(options.min_replicas() >= 1, "fault tolerance: min_replicas is ", options.min_replicas(),
               ": give 1 or more");
  DTRAIN_CHECK(options.heartbeat_interval().count() > 0 && options.heartbeat_timeout() > options.heartbeat_interval(),
               "fault tolerance: heartbeat_timeout (", options.heartbeat_timeout().count(),
               " ms) must exceed heartbeat_interval (", options.heartbeat_interval().count(), " ms) > 0");
  m.id = options.replica_id().empty() ? env::text("DTRAIN_FT_REPLICA_ID").value_or("") : options.replica_id();
  DTRAIN_CHECK(
      !m.id.empty() && m.id.find_first_of(" \n/") == std::string::npos, "fault tolerance: replica id '", m.id,
      "' is empty or has a space, newline or '/': set ManagerOptions::replica_id or run under dtrain-run --ft");
  std::string addr = options.store_addr();
  if (addr.empty()) {
    auto h = env::host("MASTER_ADDR");
    auto p = env::port("MASTER_PORT");
    DTRAIN_CHECK(h && p,
                 "fault tolerance: no store: set ManagerOptions::store_addr, or MASTER_ADDR and MASTER_PORT "
                 "(dtrain-run --ft sets them)");
    addr = *h + ":" + std::to_string(*p);
  }
  ft_split_addr(addr, m.host, m.port);
  m.secret = env::text("DTRAIN_JOB_SECRET").value_or("");
  m.liveness = Liveness(options.heartbeat_timeout());
  m.inner = is_initialized() && world_size() > 1;
  m.leader = !m.inner || rank() == 0;
  m.local = m.inner ? rank() : 0;
  if (m.leader) {
    m.client = std::make_unique<store::StoreClient>(m.host, m.port, options.timeout(), m.secret);
    m.incarnation = m.client->add("ft/inc/" + m.id, 1);
    m.heartbeat = std::thread([this] { impl_->beat(); });
  }
  if (m.inner) m.incarnation = all_reduce_values(std::vector<int64_t>{m.incarnation}, ReduceOp::MAX)[0];
}

Manager::~Manager() {
  {
    std::lock_guard<std::mutex> g(impl_->hb_mu);
    impl_->hb_stop = true;
  }
  impl_->hb_cv.notify_all();
  if (impl_->heartbeat.joinable()) impl_->heartbeat.join();
}

// One round after another until one's decision holds this replica (a late slot waits for the next).
Decision Manager::Impl::join_round() {
  const auto deadline = Clock::now() + opts.quorum_timeout();
  if (round == 0) round = std::stoll(peek(*client, "ft/round").value_or("0")) + 1;
  for (;; ++round) {
    const int64_t slot = client->add(round_key(round, "n"), 1) - 1;
    client->set(round_key(round, detail::cat("s", slot)), bytes(encode(Member{id, step, incarnation})));
    for (;;) {
      if (auto q = peek(*client, round_key(round, "q"))) {
        Decision d = decode_decision(*q);
        for (const Member& x : d.members)
          if (x.id == id && x.incarnation == incarnation) return d;
        break;  // decided without this replica: the next round
      }
      DTRAIN_CHECK(Clock::now() < deadline, "fault tolerance: replica '", id, "' waited ",
                   opts.quorum_timeout().count(), " ms for a quorum of min_replicas=", opts.min_replicas(),
                   " replicas: start more replicas or lower min_replicas");
      try_decide(round);
      std::this_thread::sleep_for(kPoll);
    }
  }
}

// Decides round r when every member of round r-1 that is still alive has a slot and min_replicas
// have one; compare-and-set makes the first decider's list the round's.
void Manager::Impl::try_decide(int64_t r) {
  const int64_t n = client->add(round_key(r, "n"), 0);
  std::map<std::string, Member> joined;  // a later slot of an id (a relaunch) replaces an earlier one
  for (int64_t i = 0; i < n; ++i)
    if (auto slot = peek(*client, round_key(r, detail::cat("s", i)))) {  // written just after its add
      Member x = decode_member(*slot);
      joined[x.id] = x;
    }
  std::optional<Decision> prev;
  if (auto q = r > 1 ? peek(*client, round_key(r - 1, "q")) : std::nullopt) prev = decode_decision(*q);
  if (prev)
    for (const Member& x : prev->members)
      if (!joined.count(x.id) && liveness.alive(*client, x)) return;  // wait for it
  if (static_cast<int>(joined.size()) < opts.min_replicas()) return;
  Decision d;
  for (auto& [_, x] : joined) {
    d.members.push_back(x);
    d.max_step = std::max(d.max_step, x.step);
  }
  // The same group serves the next round only when its members are the same processes and its last
  // step committed; otherwise a new quorum id, so a new group under a new prefix.
  d.quorum_id = 1;
  if (prev) {
    bool same = prev->members.size() == d.members.size() && peek(*client, round_key(r - 1, "o")) == "1";
    for (size_t i = 0; same && i < d.members.size(); ++i)
      same = prev->members[i].id == d.members[i].id && prev->members[i].incarnation == d.members[i].incarnation;
    d.quorum_id = prev->quorum_id + (same ? 0 : 1);
  } else if (r > 1) {
    d.quorum_id = std::stoll(peek(*client, "ft/quorum_id").value_or("0")) + 1;
  }
  // Deciders that saw the same slots write the same text, and each of them goes on as the winner:
  // what follows is idempotent.
  const std::string mine = encode(d);
  if (text(client->compare_set(round_key(r, "q"), {}, bytes(mine))) != mine) return;
  client->set("ft/quorum_id", bytes(std::to_string(d.quorum_id)));
  client->set("ft/round", bytes(std::to_string(r)));
  cleanup(r - kKeepRounds);
}

void Manager::Impl::cleanup(int64_t r) {
  if (r < 1) return;
  if (auto q = peek(*client, round_key(r, "q")))
    for (const Member& x : decode_decision(*q).members) client->delete_key(round_key(r, "v/" + x.id));
  const int64_t n = client->add(round_key(r, "n"), 0);
  for (int64_t i = 0; i < n; ++i) client->delete_key(round_key(r, detail::cat("s", i)));
  for (const char* k : {"n", "q", "o"}) client->delete_key(round_key(r, k));
}

void Manager::Impl::build_group() {
  if (pg && pg_quorum == decision.quorum_id) return;
  pg.reset();
  pg_quorum = -1;
  comm::ReplicaGroupConfig c;
  c.host = host;
  c.port = port;
  c.secret = secret;
  c.prefix =
      inner ? detail::cat("ft/q", decision.quorum_id, "/l", local, "/") : detail::cat("ft/q", decision.quorum_id, "/");
  c.rank = my_index;
  c.size = static_cast<int>(decision.members.size());
  c.timeout = opts.timeout();
  pg = comm::make_replica_group(c);
  pg_quorum = decision.quorum_id;
}

// The k-th member that heals receives from up[k % up.size()]: a length, then the bytes.
void Manager::Impl::heal(const std::vector<Member>& up) {
  int k = 0;
  for (size_t i = 0; i < decision.members.size(); ++i) {
    const Member& x = decision.members[i];
    if (std::any_of(up.begin(), up.end(), [&](const Member& u) { return u.id == x.id; })) continue;
    const Member& src = up[k++ % up.size()];
    int src_index = 0;
    while (decision.members[src_index].id != src.id) ++src_index;
    if (src.id == id) {
      const std::string blob = state_dict();
      std::vector<at::Tensor> size{at::full({1}, static_cast<int64_t>(blob.size()), at::kLong)};
      pg->send(size, static_cast<int>(i), kHealSizeTag)->wait();
      std::vector<at::Tensor> data{at::empty({static_cast<int64_t>(blob.size())}, at::kByte)};
      std::memcpy(data[0].data_ptr(), blob.data(), blob.size());
      pg->send(data, static_cast<int>(i), kHealBytesTag)->wait();
    } else if (x.id == id) {
      std::vector<at::Tensor> size{at::zeros({1}, at::kLong)};
      pg->recv(size, src_index, kHealSizeTag)->wait();
      std::vector<at::Tensor> data{at::empty({size[0].item<int64_t>()}, at::kByte)};
      pg->recv(data, src_index, kHealBytesTag)->wait();
      load_state_dict(std::string(static_cast<const char*>(data[0].data_ptr()), data[0].numel()));
      step = decision.max_step;
      healed = true;
    }
  }
}

void Manager::start_quorum() {
  Impl& m = *impl_;
  DTRAIN_CHECK(!m.in_step,
               "fault tolerance: start_quorum() called twice without should_commit() between: "
               "call should_commit() at the end of every step");
  m.in_step = true;
  m.error.clear();
  m.healed = false;
  if (m.leader) m.decision = m.join_round();
  if (m.inner) m.decision = decode_decision(broadcast_bytes(m.leader ? encode(m.decision) : "", 0));
  const auto& members = m.decision.members;
  std::vector<Member> up;
  for (const Member& x : members)
    if (x.step == m.decision.max_step) up.push_back(x);
  if (m.opts.init_sync() && m.decision.max_step == 0) up.resize(1);  // members are sorted: the first one
  m.my_index = m.participant_rank = -1;
  m.participants = static_cast<int>(up.size());
  for (size_t i = 0; i < members.size(); ++i)
    if (members[i].id == m.id) m.my_index = static_cast<int>(i);
  for (size_t i = 0; i < up.size(); ++i)
    if (up[i].id == m.id) m.participant_rank = static_cast<int>(i);
  m.healing = m.participant_rank < 0;
  try {
    m.build_group();
    m.heal(up);
  } catch (const std::exception& e) {
    m.fail(detail::cat("quorum ", m.decision.quorum_id, " (group or healing): ", e.what()));
  }
}

void Manager::allreduce(std::vector<at::Tensor>& tensors) {
  Impl& m = *impl_;
  DTRAIN_CHECK(m.in_step, "fault tolerance: allreduce() outside a step: call start_quorum() first");
  if (!m.error.empty() || !m.pg || tensors.empty()) return;
  try {
    std::vector<at::Tensor> flat_parts;
    for (const at::Tensor& t : tensors) flat_parts.push_back(t.detach().reshape({-1}));
    at::Tensor flat = at::cat(flat_parts);
    if (m.healing) flat.zero_();  // sits the step out: its gradients are of stale parameters
    std::vector<at::Tensor> v{flat};
    m.pg->allreduce(v)->wait();
    flat.div_(m.participants);
    int64_t offset = 0;
    for (at::Tensor& t : tensors) {
      t.detach().copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  } catch (const std::exception& e) {
    m.fail(detail::cat("all_reduce on quorum ", m.decision.quorum_id, " failed: ", e.what()));
  }
}

// The first member that knows the outcome stores it; every member returns the stored one.
bool Manager::Impl::decide_outcome() {
  const std::string okey = round_key(round, "o");
  const auto deadline = Clock::now() + opts.timeout();
  for (;;) {
    if (auto o = peek(*client, okey)) return *o == "1";
    bool no = false, all_yes = true;
    for (const Member& x : decision.members) {
      auto v = peek(*client, round_key(round, "v/" + x.id));
      all_yes = all_yes && v.has_value();
      no = no || (v ? *v != "1" : !liveness.alive(*client, x));  // a silent voter that died votes no
    }
    const std::string verdict = no || (!all_yes && Clock::now() > deadline) ? "0" : all_yes ? "1" : "";
    if (!verdict.empty()) return text(client->compare_set(okey, {}, bytes(verdict))) == "1";
    std::this_thread::sleep_for(kPoll);
  }
}

bool Manager::should_commit() {
  Impl& m = *impl_;
  DTRAIN_CHECK(m.in_step, "fault tolerance: should_commit() outside a step: call start_quorum() first");
  bool ok = m.error.empty(), commit = false;
  if (m.inner) ok = all_reduce_values(std::vector<int64_t>{ok ? 1 : 0}, ReduceOp::MIN)[0] == 1;  // every rank's
  if (m.leader) {
    m.client->set(round_key(m.round, "v/" + m.id), bytes(ok ? "1" : "0"));
    commit = m.decide_outcome();
  }
  if (m.inner) commit = all_reduce_values(std::vector<int64_t>{commit ? 1 : 0}, ReduceOp::MAX)[0] == 1;
  m.in_step = false;
  ++m.round;
  if (commit) {
    m.step = m.decision.max_step + 1;
  } else {
    m.pg.reset();  // broken or not, the next quorum has a new id and group
    m.pg_quorum = -1;
  }
  return commit;
}

int64_t Manager::current_step() const { return impl_->step; }
int64_t Manager::quorum_id() const { return impl_->decision.quorum_id; }
int Manager::num_members() const { return static_cast<int>(impl_->decision.members.size()); }
int Manager::num_participants() const { return impl_->participants; }
int Manager::participant_rank() const { return impl_->participant_rank; }
bool Manager::is_healing() const { return impl_->healing; }
bool Manager::healed_this_step() const { return impl_->healed; }
std::string Manager::errored() const { return impl_->error; }
const std::string& Manager::replica_id() const { return impl_->id; }
int64_t Manager::incarnation() const { return impl_->incarnation; }

}  // namespace dtrain::ft
