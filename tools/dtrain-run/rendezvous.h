// Node rendezvous over the store hosted by node 0's launcher, and the job-wide failure/done
// signals that follow it.
//
// Protocol (keys live under "dtrain-run/"):
//   1. Node 0's launcher hosts a StoreServer on master_addr:master_port (main.cpp). Every launcher,
//      node 0 too, connects a StoreClient (retrying until --rdzv_timeout: node 0 may start later).
//   2. Each node takes an arrival number a = add("arrivals", 1) and sets "arrival/<a>" to
//      "<nnodes> <nproc_per_node> <node_rank> <hostname>".
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
#pragma once

#include "store/store.h"

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::run {

struct NodeInfo {
  int nnodes = 0;
  int nproc_per_node = 0;
  int node_rank = 0;
  int max_restarts = 0;
  std::string hostname;
};

class NodeRendezvous {
 public:
  // Connects to the store (step 1). Throws std::runtime_error naming host:port and the timeout.
  NodeRendezvous(const std::string& host, uint16_t port, std::chrono::milliseconds timeout);

  // Steps 2-4. Throws std::runtime_error with the verdict's line when the nodes disagree. Node 0 reports
  // its waiting through `say` (one line each, without the "dtrain-run: " prefix).
  using Say = std::function<void(const std::string&)>;
  void join(const NodeInfo& me, const Say& say);

  // Step 5. publish_failure returns false when another node's failure was first.
  // remote_failure: "node N (host) failed: <summary>" when a node other than `my_node_rank` failed.
  bool publish_failure(int attempt, int node_rank, const std::string& summary);
  std::optional<std::string> remote_failure(int attempt, int my_node_rank);

  // Step 6: every node's exit code of the attempt, by node_rank (only this node's own when it was
  // signalled). Throws std::runtime_error naming the nodes that did not report within the timeout.
  std::vector<int> attempt_outcomes(int attempt, int node_rank, int nnodes, int exit_code);

  // Step 7.
  void mark_done(int node_rank, int exit_code);
  void wait_all_done(int nnodes, std::chrono::milliseconds timeout);  // node 0; never throws

  dtrain::store::StoreClient& client() { return *client_; }

 private:
  std::string check_arrivals(const NodeInfo& me, const Say& say);  // node 0's verdict
  std::unique_ptr<dtrain::store::StoreClient> client_;
  std::chrono::milliseconds timeout_;
  std::string hostname_;  // this node's, from join(): named in the failures it publishes
};

}  // namespace dtrain::run
