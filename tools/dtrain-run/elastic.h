// Elastic membership (--nnodes MIN:MAX) over the store hosted by node 0's launcher: which nodes run
// each attempt, the heartbeats that tell node 0 a node is gone, and node 0's decision after each
// attempt. The protocol is written out as numbered steps E1-E8 in rendezvous.h.
//
// Note [Elastic membership]: node 0's launcher (the one that hosts the store) decides everything: it
// forms each attempt's group, watches the other launchers' heartbeats and the queue of waiting nodes
// while the workers run, and after each attempt turns every node's outcome into one decision (done,
// restart with a new group, or stop). The others follow its keys. One decider means no consensus
// protocol, at the price torchrun's c10d rendezvous pays too: if node 0 dies the job ends.
//
// Note [Elastic restarts]: as in torchelastic, --max_restarts counts failures only. A restart node 0
// starts for a waiting node (the group below MAX) is free; a worker that fails, or a node that is
// lost, spends one (torchelastic's agents see their workers fail when a peer is gone, and count it).
// The workers' restart count (TORCHELASTIC_RESTART_COUNT, DTRAIN_RESTART_COUNT) is the attempt
// number all the same: it keys their rendezvous, so it moves on at every re-form. To tell a stop for a
// waiting node from a failure that happened at the same time, node 0 takes the attempt's failure slot
// before it stops the workers (NodeRendezvous::claim_for_membership_change): a worker that fails
// after that failed because its peers were stopped, and a failure that came first makes the attempt a
// failure.
#pragma once

#include "rendezvous.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace dtrain::run {

struct ElasticOptions {
  int min_nodes = 1;
  int max_nodes = 1;
  int nproc_per_node = 1;
  int max_restarts = 0;
  std::string hostname;
  bool host = false;  // this launcher hosts the store: it is node 0 and decides
  std::chrono::milliseconds beat_period{100};
  std::chrono::milliseconds rdzv_timeout{900000};
  std::chrono::milliseconds last_call{30000};
  std::string secret;                              // the job secret, or "" (secret.h)
  std::chrono::milliseconds close_timeout{30000};  // Note [Store deadlines and closing] in rendezvous.h
  // Node 0: where the workers reach the store, which it publishes to every node
  // (Note [Workers' store] in main.cpp): --local_addr and the port of a store there, else the endpoint.
  std::string master_addr;
  uint16_t master_port = 0;
};

// One attempt's membership, as this node sees it.
struct ElasticRound {
  int attempt = 0;
  int group_rank = 0;  // GROUP_RANK / NODE_RANK of this node, 0..nnodes-1, node 0 is always the host
  int nnodes = 0;      // GROUP_WORLD_SIZE
  std::string line;    // the transition, one line (without the "dtrain-run: " prefix)
};

// What follows an attempt (step E7): another round, or the end with an exit code and a line.
struct ElasticNext {
  std::optional<ElasticRound> round;
  int exit_code = 0;
  std::string message;
};

class ElasticRendezvous {
 public:
  // Takes this launcher's id and starts its heartbeat (E1). `base` is connected to the store.
  ElasticRendezvous(NodeRendezvous& base, const std::string& master_host, uint16_t port, const ElasticOptions& o);
  ~ElasticRendezvous();  // stops the heartbeat
  ElasticRendezvous(const ElasticRendezvous&) = delete;
  ElasticRendezvous& operator=(const ElasticRendezvous&) = delete;

  // E2-E3: join and wait for the first round this node is admitted to. Without a round, the exit code
  // and one line: the job cannot start (fewer than MIN nodes within --rdzv_timeout, a node whose flags
  // disagree with node 0's, node 0 gone), or it ended while this node waited for a place.
  ElasticNext join(const NodeRendezvous::Say& say);

  // E5, every --monitor_interval while the workers run: a reason to stop this node's workers because
  // the membership changes, or nothing.
  std::optional<std::string> watch(int attempt);

  // E6-E7: report this node's exit code of the attempt and learn what follows.
  ElasticNext finish_attempt(int attempt, int exit_code, const NodeRendezvous::Say& say);

  // E8, once the job has ended for this node: the others say they are done; node 0 keeps the store up
  // until every member of the last attempt is done or gone, bounded by --rdzv_timeout, and by
  // close_timeout when the job `failed` (Note [Store deadlines and closing]). Never throws.
  void finish_job(bool failed);

  // The workers' MASTER_ADDR and MASTER_PORT, as node 0 published them (valid once join() gave a round).
  const std::string& master_addr() const { return o_.master_addr; }
  uint16_t master_port() const { return o_.master_port; }

 private:
  struct Member {
    int64_t id = 0;
    std::string hostname;
  };
  struct Beat {
    std::string value;
    std::chrono::steady_clock::time_point changed;
  };
  void heartbeat_loop(std::string host, uint16_t port);
  void read_master();  // a member: node 0's published master_addr and master_port
  std::optional<std::string> await_admission(const NodeRendezvous::Say& say);  // nothing: not in time
  ElasticNext wait_for_admission(const NodeRendezvous::Say& say);
  // Node 0 only.
  void absorb_waiters();
  void drop_dead_waiters();
  void tell_waiters_full();
  bool stale(const Member& m);
  // `note` goes into the transition line after the attempt number (the restarts spent).
  ElasticNext form_round(int attempt, const std::vector<Member>& survivors, const std::string& why,
                         const std::string& note, const NodeRendezvous::Say& say);
  ElasticNext host_finish(int attempt, int exit_code, const NodeRendezvous::Say& say);
  std::vector<int> outcomes(int attempt, int exit_code);
  std::string failure_cause(int attempt);
  ElasticNext end_job(int attempt, int code, const std::string& message);
  std::string silent_host_text() const;
  std::string member_text(int group_rank) const;

  NodeRendezvous& base_;
  dtrain::store::StoreClient& store_;
  ElasticOptions o_;
  int64_t id_ = 0;
  std::chrono::milliseconds dead_after_;

  // A member's watch() waits dead_after_ at most for the store (Note [Silent host] in rendezvous.h):
  // past it node 0 is stopped or gone, and the member ends instead of hanging (host_silent_).
  std::string host_;
  uint16_t port_ = 0;
  bool host_silent_ = false;
  // This watch's finding or the node rendezvous's: a request of the supervisor's (a remote failure,
  // node 0's end) that node 0 left unanswered past the same deadline.
  bool silent() const { return host_silent_ || base_.host_silent(); }

  // Heartbeat thread (its own store connection: StoreClient is one caller at a time).
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread beat_thread_;

  // Node 0's state.
  std::vector<Member> members_;  // the current attempt's group, in group-rank order
  std::vector<Member> pending_;  // waiting nodes not admitted yet, in arrival order
  int64_t waiters_seen_ = 0;
  std::set<int64_t> told_full_;  // waiting nodes told that the job is at MAX
  std::map<int64_t, Beat> beats_;
  std::string stop_reason_;       // why node 0 stopped the current attempt (E5), for the transition line
  bool membership_stop_ = false;  // node 0 stopped the current attempt for a waiting node, before any failure
  int failures_ = 0;              // restarts spent (Note [Elastic restarts])
};

}  // namespace dtrain::run
