// --ft on several nodes (fixed --nnodes N): which nodes' launchers are still there.
//
// Note [Replicas on several nodes]: under --ft every node's launcher runs its workers as replicas
// (globally numbered: node_rank * nproc_per_node / K + the local replica, env.h) that meet in node
// 0's store, where the quorum lives. A node is then a set of replicas, not a part of one world:
//   - a replica that fails is relaunched by its own node's launcher (Note [Replica relaunch]); no
//     other node hears of it, the quorum drops it for a step and takes it back healed;
//   - a node whose launcher dies (SIGKILL, the machine gone) takes its workers with it (they die
//     with their launcher); its replicas' heartbeats in the quorum stop and the others go on. Node 0
//     learns that the launcher is gone from the launcher heartbeat below and says so in one line,
//     and does not wait for it at the end of the job (rendezvous.h's step 7 waits for the nodes
//     still beating only);
//   - node 0's launcher hosts the store, hence the quorum: when it dies the job ends, every other
//     node stopping its workers with one line naming the lost store (check_remote in supervisor.cpp),
//     instead of relaunching replicas that could only fail to reach it;
//   - a worker failure past --max_restarts (counted per node) still ends the whole job, as on one
//     node, and the group is never restarted (step 6 is skipped: nodes do not wait for each other's
//     outcomes, which a dead node would never give).
// Heartbeat: every launcher but node 0's sets "dtrain-run/ft_beat/<node_rank>" to a counter each
// --monitor_interval from a thread with its own connection; node 0 counts a node gone when its
// counter has not moved for silent_host_after(--monitor_interval) on node 0's own clock (no clocks
// compared), unless the node said it is done.
#pragma once

#include "rendezvous.h"

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dtrain::run {

class FtNodes {
 public:
  // Starts this node's heartbeat (a node other than 0) to the store at host:port.
  FtNodes(NodeRendezvous& rdzv, int node_rank, int nnodes, const std::string& host, uint16_t port,
          const std::string& secret, std::chrono::milliseconds beat_period);
  ~FtNodes();  // stops the heartbeat
  FtNodes(const FtNodes&) = delete;
  FtNodes& operator=(const FtNodes&) = delete;

  // Node 0, each monitor interval: one line for each node whose launcher was found gone since the
  // last call (never for one that said it is done).
  std::vector<std::string> newly_gone();
  // Node 0 at the job's end: waits until each other node is done or gone, `timeout` at most, saying
  // the line of each one found gone here.
  void wait_done_or_gone(std::chrono::milliseconds timeout, const NodeRendezvous::Say& say);

 private:
  struct Seen {
    std::string value;
    std::chrono::steady_clock::time_point changed;
  };
  void beat_loop(std::string host, uint16_t port, std::string secret);
  bool gone(int node_rank);              // its counter has not moved for dead_after_
  std::string gone_line(int node_rank);  // marks it reported

  NodeRendezvous& rdzv_;
  int node_rank_, nnodes_;
  std::chrono::milliseconds beat_period_, dead_after_;
  std::map<int, Seen> seen_;
  std::vector<bool> reported_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread beat_thread_;
};

}  // namespace dtrain::run
