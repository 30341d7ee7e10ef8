// Node rendezvous (see rendezvous.h for the numbered protocol).
#include "rendezvous.h"

#include <sstream>
#include <vector>

#include "common/env.h"
#include "common/util.h"
#include "store_keys.h"

namespace dtrain::run {

namespace {

const StoreKeys node_key("dtrain-run/");
constexpr Millis kVerdictLinger{5000};  // node 0 waits this long for nodes to read a failed verdict
// The value of "failure/<k>" when node 0 stopped attempt k for a membership change (step E5). A failure
// is "<node_rank> <hostname>\n<summary>", so the two cannot be confused.
const std::string kMembershipChange = "membership change";

// How often node 0 names the nodes it still waits for: often enough that a wait of --rdzv_timeout
// (900 s by default) never looks like a hang, rarely enough not to flood the console. 30 s, the
// fallback of DTRAIN_RUN_RDZV_REPORT_S in src/common/env.cpp, which the launcher's tests lower.
Millis report_period() { return util::millis_of_seconds(*env::seconds("DTRAIN_RUN_RDZV_REPORT_S")); }

}  // namespace

std::string seconds_text(std::chrono::milliseconds ms) {
  if (ms >= util::kForever) return "inf (forever)";
  std::ostringstream s;
  s << ms.count() / 1000.0 << "s";
  return s.str();
}

Millis silent_host_after(Millis monitor_interval) {
  constexpr int kMissedIntervals = 10;
  constexpr Millis kAtLeast{3000};
  return std::max(kAtLeast, Millis(std::min<int64_t>(monitor_interval.count(), int64_t{1} << 40) * kMissedIntervals));
}

std::string silent_host_text(const std::string& host, uint16_t port, Millis after) {
  return "node 0's launcher (the rendezvous host at " + host + ":" + std::to_string(port) + ") did not answer within " +
         seconds_text(after) + ": it is stopped or gone";
}

namespace {

std::string world_text(const NodeInfo& n) {
  return "--nnodes " + std::to_string(n.nnodes) + " --nproc_per_node " + std::to_string(n.nproc_per_node) + " (world " +
         std::to_string(n.nnodes * n.nproc_per_node) + ")";
}

// "0, 2": the node ranks named in an error.
std::string comma_list(const std::vector<int>& v) {
  std::string out;
  for (int x : v) out += (out.empty() ? "" : ", ") + std::to_string(x);
  return out;
}

std::string node_text(const NodeInfo& n) { return "node " + std::to_string(n.node_rank) + " (" + n.hostname + ")"; }

std::string ft_text(const NodeInfo& n) {
  return n.ft_replica_ranks == 0 ? "no --ft" : "--ft --ft_replica_ranks " + std::to_string(n.ft_replica_ranks);
}

NodeInfo parse_info(const std::string& s) {
  NodeInfo n;
  std::istringstream in(s);
  in >> n.nnodes >> n.nproc_per_node >> n.node_rank >> n.max_restarts >> n.ft_replica_ranks;
  std::getline(in >> std::ws, n.hostname);
  return n;
}

}  // namespace

NodeRendezvous::NodeRendezvous(const std::string& host, uint16_t port, Millis timeout, const std::string& secret,
                               Millis read_timeout)
    : timeout_(timeout), read_timeout_(read_timeout), host_(host), port_(port) {
  try {
    client_ = std::make_unique<dtrain::store::StoreClient>(host, port, timeout, secret, read_timeout);
  } catch (const dtrain::store::TimeoutError&) {  // connected, but the handshake got no answer
    throw std::runtime_error(no_answer_text("connecting to it"));
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    if (what.rfind("cannot reach", 0) != 0) throw;  // reached, but refused: the line says why
    throw std::runtime_error(what +
                             " (is node 0's dtrain-run running with this --master_addr and "
                             "--master_port? --rdzv_timeout sets how long to wait for it)");
  }
}

std::string NodeRendezvous::no_answer_text(const std::string& doing) const {
  return "node 0's launcher (the rendezvous host at " + host_ + ":" + std::to_string(port_) +
         ") did not answer within read_timeout " + seconds_text(read_timeout_) + " while this node was " + doing +
         ": it is stopped or gone (--rdzv_conf read_timeout=SECONDS sets how long a store request may take)";
}

void NodeRendezvous::join(const NodeInfo& me, const Say& say) {
  hostname_ = me.hostname;
  answered("joining the rendezvous", [&] { join_steps(me, say); });
}

void NodeRendezvous::join_steps(const NodeInfo& me, const Say& say) {
  // 2. Arrive.
  const int64_t arrival = client_->add(node_key("arrivals"), 1);
  client_->set(node_key("arrival", arrival),
               to_bytes(std::to_string(me.nnodes) + " " + std::to_string(me.nproc_per_node) + " " +
                        std::to_string(me.node_rank) + " " + std::to_string(me.max_restarts) + " " +
                        std::to_string(me.ft_replica_ranks) + " " + me.hostname));
  // 3. Node 0 judges.
  if (me.node_rank == 0) client_->set(node_key("verdict"), to_bytes(check_arrivals(me, say)));
  // 4. Everyone follows the verdict. Node 0 may take the whole timeout collecting nodes.
  const std::optional<std::string> given = poll_key(*client_, node_key("verdict"), timeout_ * 2 + Millis(5000));
  if (!given)
    throw std::runtime_error("node 0 gave no rendezvous verdict within " + seconds_text(timeout_ * 2) + " at " +
                             client_->host() + ":" + std::to_string(client_->port()));
  const std::string& verdict = *given;
  client_->set(node_key("verdict_read", arrival), to_bytes("1"));
  if (verdict != "ok") {
    if (me.node_rank == 0) {  // keep the store up until the nodes that arrived have read it
      std::vector<std::string> keys;
      for (int64_t a = 1, n = client_->add(node_key("arrivals"), 0); a <= n; ++a)
        keys.push_back(node_key("verdict_read", a));
      try {
        client_->wait(keys, kVerdictLinger);
      } catch (const dtrain::store::TimeoutError&) {
      }
    }
    throw std::runtime_error(verdict);
  }
  if (arrival > me.nnodes)
    throw std::runtime_error("more nodes joined than --nnodes " + std::to_string(me.nnodes) +
                             ": this node (node_rank " + std::to_string(me.node_rank) + ") arrived as number " +
                             std::to_string(arrival) + "; give each node a distinct --node_rank below --nnodes");
}

std::string NodeRendezvous::check_arrivals(const NodeInfo& me, const Say& say) {
  const auto start = Clock::now(), deadline = start + timeout_;
  const Millis period = report_period();
  auto next_report = start + period;
  const std::string where = client_->host() + ":" + std::to_string(client_->port());
  std::vector<NodeInfo> nodes;
  std::vector<int> seen(static_cast<size_t>(me.nnodes), -1);  // node_rank -> index in nodes
  auto missing = [&] {  // node ranks not seen yet, but never this node's own (it is here)
    std::vector<int> ranks;
    for (int r = 0; r < me.nnodes; ++r)
      if (r != me.node_rank && seen[static_cast<size_t>(r)] < 0) ranks.push_back(r);
    return comma_list(ranks);
  };
  const int64_t arrived = client_->add(node_key("arrivals"), 0);  // this node and any earlier ones
  if (arrived < me.nnodes)
    say("node 0 waiting for " + std::to_string(me.nnodes - arrived) + " more node(s) of --nnodes " +
        std::to_string(me.nnodes) + " at " + where + " (--rdzv_timeout " + seconds_text(timeout_) + ")");
  for (int a = 1; a <= me.nnodes; ++a) {
    std::string info;
    for (;;) {  // wait for arrival a, waking at each report time until the deadline
      const bool last_wait = deadline <= next_report;
      const auto left = std::chrono::duration_cast<Millis>((last_wait ? deadline : next_report) - Clock::now());
      try {
        info = to_string(client_->get(node_key("arrival", a), std::max(left, Millis(1))));
        break;
      } catch (const dtrain::store::TimeoutError&) {
        if (last_wait)
          return "only " + std::to_string(a - 1) + " of " + std::to_string(me.nnodes) +
                 " nodes joined the rendezvous at " + where + " within --rdzv_timeout " + seconds_text(timeout_) +
                 " (missing node_rank " + missing() + ")";
      }
      const auto waited = std::chrono::duration_cast<Millis>(Clock::now() - start);
      say("node 0 still waiting for node_rank " + missing() + " of --nnodes " + std::to_string(me.nnodes) + " after " +
          seconds_text(Millis((waited.count() + 50) / 100 * 100)) + " (--rdzv_timeout " + seconds_text(timeout_) +
          "): is dtrain-run running there with --master_addr " + client_->host() + " --master_port " +
          std::to_string(client_->port()) + "?");
      next_report += period;
    }
    NodeInfo n = parse_info(info);
    if (n.nnodes != me.nnodes || n.nproc_per_node != me.nproc_per_node)
      return "nodes disagree on the world size: node 0 has " + world_text(me) + ", " + node_text(n) + " has " +
             world_text(n);
    if (n.max_restarts != me.max_restarts)  // every node must take the same restart decisions
      return "nodes disagree on --max_restarts: node 0 has " + std::to_string(me.max_restarts) + ", " + node_text(n) +
             " has " + std::to_string(n.max_restarts) + "; give every node the same --max_restarts";
    if (n.ft_replica_ranks != me.ft_replica_ranks)  // replica ids and worlds follow from both
      return "nodes disagree on --ft: node 0 has " + ft_text(me) + ", " + node_text(n) + " has " + ft_text(n) +
             "; give every node the same --ft and --ft_replica_ranks";
    if (n.node_rank < 0 || n.node_rank >= me.nnodes)
      return node_text(n) + " has a --node_rank outside 0.." + std::to_string(me.nnodes - 1);
    int& slot = seen[static_cast<size_t>(n.node_rank)];
    if (slot >= 0)
      return "two nodes have --node_rank " + std::to_string(n.node_rank) + ": " +
             nodes[static_cast<size_t>(slot)].hostname + " and " + n.hostname +
             "; give each node a distinct --node_rank";
    slot = static_cast<int>(nodes.size());
    nodes.push_back(n);
  }
  return "ok";
}

template <class F>
auto NodeRendezvous::polled(F f) -> decltype(f()) {
  if (silent_after_.count() <= 0) return f();
  dtrain::store::ScopedTimeout quick(*client_, silent_after_);
  try {
    return f();
  } catch (const dtrain::store::TimeoutError&) {
    host_silent_ = true;
    throw;
  }
}

bool NodeRendezvous::node0_done() {
  return polled([&] { return client_->check({node_key("done", 0)}); });
}

bool NodeRendezvous::node_done(int node_rank) { return client_->check({node_key("done", node_rank)}); }

bool NodeRendezvous::publish_failure(int attempt, int node_rank, const std::string& summary) {
  std::string mine = std::to_string(node_rank) + " " + hostname_ + "\n" + summary;
  return polled([&] { return to_string(client_->compare_set(node_key("failure", attempt), {}, to_bytes(mine))); }) ==
         mine;
}

bool NodeRendezvous::claim_for_membership_change(int attempt) {
  const std::string v = to_string(client_->compare_set(node_key("failure", attempt), {}, to_bytes(kMembershipChange)));
  return v == kMembershipChange;
}

namespace {

// A failure slot's value as the line a node prints; nothing for this node's own or node 0's claim.
std::optional<std::string> describe_failure(const std::string& v, int my_node_rank) {
  if (v == kMembershipChange) return std::nullopt;  // node 0's stop, not a failure: "stop/<k>" says why
  const size_t space = v.find(' '), nl = v.find('\n');
  if (space == std::string::npos || nl == std::string::npos || space > nl) return "a node failed: " + v;
  const std::string node = v.substr(0, space);
  if (node == std::to_string(my_node_rank)) return std::nullopt;  // our own
  return "node " + node + " (" + v.substr(space + 1, nl - space - 1) + ") failed: " + v.substr(nl + 1);
}

}  // namespace

std::optional<std::string> NodeRendezvous::remote_failure(int attempt, int my_node_rank) {
  const std::string failure = node_key("failure", attempt);
  const auto v = polled([&]() -> std::optional<std::string> {
    if (!client_->check({failure})) return std::nullopt;
    return to_string(client_->get(failure, Millis(1000)));
  });
  if (!v) return std::nullopt;
  return describe_failure(*v, my_node_rank);
}

std::vector<int> NodeRendezvous::attempt_outcomes(int attempt, int node_rank, int nnodes, int exit_code) {
  return answered("agreeing with the other nodes on the end of attempt " + std::to_string(attempt),
                  [&] { return outcomes_of(attempt, node_rank, nnodes, exit_code); });
}

std::vector<int> NodeRendezvous::outcomes_of(int attempt, int node_rank, int nnodes, int exit_code) {
  client_->set(node_key("outcome", attempt, node_rank), to_bytes(std::to_string(exit_code)));
  std::vector<int> codes(static_cast<size_t>(nnodes), -1);
  codes[static_cast<size_t>(node_rank)] = exit_code;
  if (exit_code != 0 && exit_code != 1) return codes;  // signalled: this node stops whatever the others do
  const auto deadline = Clock::now() + timeout_;
  std::vector<int> missing;
  for (int r = 0; r < nnodes; ++r) {
    if (r == node_rank) continue;
    const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    const std::string k = node_key("outcome", attempt, r);
    if (const auto code = poll_key(*client_, k, std::max(left, Millis(1))))
      codes[static_cast<size_t>(r)] = static_cast<int>(int_value(k, *code));
    else
      missing.push_back(r);
  }
  if (!missing.empty())
    throw std::runtime_error("node_rank " + comma_list(missing) + " did not report the end of attempt " +
                             std::to_string(attempt) + " within --rdzv_timeout " + seconds_text(timeout_) +
                             " (did its dtrain-run die?): the nodes cannot agree on a restart");
  return codes;
}

void NodeRendezvous::mark_done(int node_rank, int exit_code, Millis close_timeout) {
  dtrain::store::ScopedTimeout closing(*client_, std::min(close_timeout, client_->timeout()));
  client_->set(node_key("done", node_rank), to_bytes(std::to_string(exit_code)));
}

void NodeRendezvous::wait_all_done(int nnodes, Millis timeout) {
  std::vector<std::string> keys;
  for (int r = 0; r < nnodes; ++r) keys.push_back(node_key("done", r));
  try {
    client_->wait(keys, timeout);
  } catch (const std::exception&) {
    // A node that never reports (crashed launcher) must not keep node 0 forever.
  }
}

}  // namespace dtrain::run
