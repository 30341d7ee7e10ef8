// Node rendezvous over the store hosted by node 0's launcher, and the job-wide failure/done
// signals that follow it.
//
// Protocol (keys live under "dtrain-run/"):
//   1. Node 0's launcher hosts a StoreServer on master_addr:master_port (main.cpp). Every launcher,
//      node 0 too, connects a StoreClient (retrying until --rdzv_timeout: node 0 may start later).
//   2. Each node takes an arrival number a = add("arrivals", 1) and sets "arrival/<a>" to
//      "<nnodes> <nproc_per_node> <node_rank> <max_restarts> <ft_replica_ranks, 0 without --ft> <hostname>".
//   3. Node 0 waits for "arrival/1".."arrival/<nnodes>" one by one within --rdzv_timeout, checking
//      each against its own --nnodes/--nproc_per_node and for a node_rank seen twice; at the first
//      problem (or the timeout) it stops waiting. It sets "verdict" to "ok" or to the one-line error.
//      While nodes are missing it says so: once at the start, then every 30 s naming the node ranks
//      still missing (a node that never comes would otherwise look like a hang).
//   4. Every launcher waits for "verdict", sets "verdict_read/<a>" and proceeds only on "ok". On an
//      error node 0 keeps the store up until every arrived node has read it (bounded). A node whose
//      arrival number exceeds nnodes (one node too many) fails by itself.
//   5. While the workers of attempt k run, a node whose worker fails sets "failure/<k>"
//      (compare_set: the first one wins) to "<node_rank> <hostname>\n<summary>"; the others poll it
//      each --monitor_interval and stop.
//   6. With --max_restarts > 0, after attempt k every node sets "outcome/<k>/<node_rank>" to its
//      exit code (0 done, 1 a worker failed, 128+signo its launcher was signalled) and, unless it was
//      signalled, waits for every node's (within --rdzv_timeout). Every node then takes the same
//      decision from the same codes: all 0 -> done; any signal -> stop; else restart while restarts
//      remain. The wait is also the barrier of the restart: no worker of attempt k is alive anywhere
//      when attempt k+1's workers start (their store keys carry k+1 besides).
//   7. When its workers are done each node sets "done/<node_rank>"; node 0 keeps the store up
//      until all nodes are done (bounded wait), so late pollers do not see it vanish.
//
// Elastic protocol (--nnodes MIN:MAX; elastic.h, Note [Elastic membership]; keys under
// "dtrain-run/e/"). Steps 1-4 and 6-7 above are not used; step 5's failure keys are, with the group
// rank of the attempt as node_rank. --nnodes N keeps the protocol above unchanged.
//   E1. The launcher that hosts the store is node 0: --node_rank 0, or without --node_rank the one
//       that can bind master_addr:master_port. Every launcher takes an id = add("ids", 1) and
//       starts a heartbeat thread (its own connection) that sets "beat/<id>" to a counter every
//       --monitor_interval. Node 0 declares a node gone when its counter has not changed for 10
//       intervals (at least 3 s), measured on node 0's clock only (no clock sync needed). The
//       heartbeat, not the connection's close, also covers a machine that vanishes without a FIN.
//   E2. Every other launcher queues up: it appends the line "<id> <nproc_per_node> <max_restarts>
//       <min> <max> <hostname>" to "queue" in one compare-and-set (a node killed while it queues is
//       queued whole or not at all), then waits for "admit/<id>": an attempt number,
//       "error <line>" (its flags disagree with node 0's, or its heartbeat stopped while it waited),
//       or "end <exit code> <line>" (the job ended first). While the group is at MAX, node 0 sets
//       "full/<id>" = "<node 0's id>\n<line>": the node prints the line and waits for a place as long
//       as node 0's heartbeat goes on (torchelastic's redundancy list), else 2 x --rdzv_timeout.
//   E3. Node 0 forms attempt k's group: the survivors of attempt k-1 in their order (node 0 first),
//       then waiting nodes in arrival order, up to MAX. Once MIN are there it waits --rdzv_last_call
//       for more (not when MAX are there); for attempt 0 it waits up to --rdzv_timeout for MIN, after
//       a change fewer than MIN end the job (E7). It sets "round/<k>" = the transition line, then one
//       "<id> <hostname>" row per node in group-rank order, and "admit/<id>" = k for the new nodes.
//       Each node's GROUP_RANK is its row, WORLD_SIZE = rows * nproc_per_node: ranks are contiguous.
//   E4. Every node prints the transition line and starts attempt k's workers (restart count k).
//   E5. While they run, node 0 checks every --monitor_interval each member's heartbeat and the
//       waiting queue, the waiting nodes' heartbeats too (one that stopped is dropped: a node long
//       dead would look alive at a first look when a place frees up). A member gone, or a node
//       waiting while the group is below MAX (torchrun's "waiting nodes" rule), makes node 0 set
//       "stop/<k>" to the reason; every node polls it and stops its workers (SIGTERM, SIGKILL after
//       --grace_period): survivors blocked in a collective with the dead rank do not wait for the
//       collective's timeout. For a waiting node node 0 first takes "failure/<k>" (compare_set to
//       "membership change"): when a failure holds it already, there is no stop, the failure stops
//       the attempt. A worker failure still goes through step 5 (failure/<k>).
//   E6. When its workers are reaped each node sets "outcome/<k>/<id>" to its exit code (0, 1, or
//       128+signo: a signalled launcher leaves the job and exits). Node 0 waits for every member's
//       outcome, counting a member whose heartbeat stops (or that is silent for --rdzv_timeout) as gone.
//   E7. Node 0 decides and sets "decision/<k>": "done" when every member exited 0; else it forms
//       attempt k+1 (E3) and sets "restart", as long as at least MIN nodes remain and, for a failure,
//       a restart is left; otherwise "stop <line>", which every node prints before exiting 1. Only
//       failures spend --max_restarts (Note [Elastic restarts] in elastic.h): a stop for a waiting
//       node, with every member still there, is free; a failed worker or a member gone spends one.
//       A signal to node 0's launcher stops the job. If node 0 itself dies, the others lose the
//       store and end with a line that says so: the rendezvous lives on node 0 only.
//   E8. Node 0 answers "admit/<id>" with "end <exit code> <line>" for nodes still waiting when the
//       job ends (exit code 0 when the job succeeded, else 1); the others set "done/<id>", and node
//       0 keeps the store up until each member of the last attempt is done or gone (bounded by
//       --rdzv_timeout).
//
// Note [Store deadlines and closing] (--rdzv_conf read_timeout and close_timeout, torchrun's meanings):
//   - read_timeout (the c10d backend's store timeout, 60 s): every launcher's connection to node 0's
//     store has it as the deadline of each request, the handshake included, from the moment it is
//     connected (reaching a node 0 that starts later still waits --rdzv_timeout). Long waits
//     (node 0's verdict, the other nodes' outcomes, an elastic decision or admission) ask with short
//     requests, so a store host that stops answering (SIGSTOP, a machine gone without a FIN) makes a
//     joining or re-rendezvousing node fail after read_timeout with one line naming the host and what
//     the node was doing (NodeRendezvous::answered), instead of waiting out --rdzv_timeout. While the
//     workers run, Note [Silent host]'s shorter deadline applies.
//   - close_timeout (torchrun's RendezvousTimeout.close, 30 s: the time within which the rendezvous is
//     expected to close after shutdown()): when this node's job failed, its launcher closes the
//     rendezvous within it. A node other than node 0 says it is done (step 7, E8) with requests of that
//     deadline; node 0, which published the failure so that the others stop, keeps the store up for
//     them to stop and leave for at most close_timeout (never more than --rdzv_timeout), then exits,
//     taking the store with it. After a success node 0 waits for the others as torchrun's exit barrier
//     does, up to --rdzv_timeout: their workers may still be using the store.
#pragma once

#include "store/store.h"

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtrain::run {

// "1.5s": a duration as the launcher's messages print it.
std::string seconds_text(std::chrono::milliseconds ms);

// Note [Silent host]: node 0's store lives in node 0's launcher, so a store that stops answering is
// node 0 stopped (SIGSTOP: the kernel still holds the connection) or gone without a FIN. While the
// workers run, every other node asks it with this deadline: 10 monitor intervals, never under 3 s
// (a loaded launcher may be slow). Past it the node ends its workers with silent_host_text()
// instead of waiting --rdzv_timeout. Elastic jobs take the same deadline as their heartbeats'.
std::chrono::milliseconds silent_host_after(std::chrono::milliseconds monitor_interval);
// "node 0's launcher (the rendezvous host at H:P) did not answer within 3s: it is stopped or gone"
std::string silent_host_text(const std::string& host, uint16_t port, std::chrono::milliseconds after);

struct NodeInfo {
  int nnodes = 0;
  int nproc_per_node = 0;
  int node_rank = 0;
  int max_restarts = 0;
  int ft_replica_ranks = 0;  // --ft: its --ft_replica_ranks; 0 without --ft
  std::string hostname;
};

class NodeRendezvous {
 public:
  // Connects to the store (step 1) within `timeout`; each request then has `read_timeout`
  // (Note [Store deadlines and closing]). Throws std::runtime_error naming host:port and the timeout.
  NodeRendezvous(const std::string& host, uint16_t port, std::chrono::milliseconds timeout, const std::string& secret,
                 std::chrono::milliseconds read_timeout);

  // Runs f, turning a store that did not answer within read_timeout into one std::runtime_error line
  // naming node 0's launcher, its address and `doing` ("joining the rendezvous").
  template <class F>
  auto answered(const std::string& doing, F f) -> decltype(f()) {
    try {
      return f();
    } catch (const dtrain::store::TimeoutError&) {
      throw std::runtime_error(no_answer_text(doing));
    }
  }
  std::string no_answer_text(const std::string& doing) const;

  // Steps 2-4. Throws std::runtime_error with the verdict's line when the nodes disagree. Node 0 reports
  // its waiting through `say` (one line each, without the "dtrain-run: " prefix).
  using Say = std::function<void(const std::string&)>;
  void join(const NodeInfo& me, const Say& say);

  // Step 5 on a node other than node 0: its requests wait `after` at most (Note [Silent host]). A
  // store silent that long makes publish_failure, remote_failure and node0_done throw
  // store::TimeoutError, and host_silent() true.
  void watch_host(std::chrono::milliseconds after) { silent_after_ = after; }
  bool host_silent() const { return host_silent_; }
  std::string silent_host_line() const { return silent_host_text(host_, port_, silent_after_); }
  // Whether node 0 said that its workers are done (step 7).
  bool node0_done();
  // Node 0: whether node `node_rank` said so (step 7).
  bool node_done(int node_rank);

  // Step 5. publish_failure returns false when another node's failure was first.
  // remote_failure: "node N (host) failed: <summary>" when a node other than `my_node_rank` failed.
  bool publish_failure(int attempt, int node_rank, const std::string& summary);
  std::optional<std::string> remote_failure(int attempt, int my_node_rank);
  // Step E5: node 0 takes the attempt's failure slot for a membership change it is about to make, so
  // that a worker that fails after the stop (its peers stopped under it) reads as a consequence, not
  // as the cause; false when a failure came first. remote_failure() does not report the claim.
  bool claim_for_membership_change(int attempt);

  // Step 6: every node's exit code of the attempt, by node_rank (only this node's own when it was
  // signalled). Throws std::runtime_error naming the nodes that did not report within the timeout.
  std::vector<int> attempt_outcomes(int attempt, int node_rank, int nnodes, int exit_code);

  // Step 7. mark_done's requests wait `close_timeout` at most (Note [Store deadlines and closing]).
  void mark_done(int node_rank, int exit_code, std::chrono::milliseconds close_timeout);
  void wait_all_done(int nnodes, std::chrono::milliseconds timeout);  // node 0; never throws

  dtrain::store::StoreClient& client() { return *client_; }
  // The name published with failures when join() is not used (elastic jobs, elastic.h).
  void set_hostname(const std::string& hostname) { hostname_ = hostname; }

 private:
  void join_steps(const NodeInfo& me, const Say& say);                                  // steps 2-4
  std::vector<int> outcomes_of(int attempt, int node_rank, int nnodes, int exit_code);  // step 6
  std::string check_arrivals(const NodeInfo& me, const Say& say);                       // node 0's verdict
  std::unique_ptr<dtrain::store::StoreClient> client_;
  std::chrono::milliseconds timeout_;
  std::chrono::milliseconds read_timeout_;
  std::string hostname_;  // this node's, from join(): named in the failures it publishes
  std::string host_;
  uint16_t port_ = 0;
  std::chrono::milliseconds silent_after_{0};  // 0: requests wait the rendezvous timeout
  bool host_silent_ = false;
  // Runs f with the step-5 deadline; a TimeoutError marks the host silent.
  template <class F>
  auto polled(F f) -> decltype(f());
};

}  // namespace dtrain::run
