// The quorum as keys of the job's store (docs/design.md, "Replica fault tolerance"):
//
//   ft/hb/<id>          the replica's heartbeat counter (add 1 every heartbeat_interval)
//   ft/inc/<id>         the replica's incarnation (add 1 by each process that takes the id)
//   ft/round            the last decided round
//   ft/quorum_id        the last decided round's quorum id
//   ft/r<R>/n           slots taken in round R (add)
//   ft/r<R>/s<i>        slot i: "<id> <step> <incarnation>"
//   ft/r<R>/q           the decision (compare-and-set): "<quorum id> <max step>\n<id> <step> <incarnation>\n..."
//   ft/r<R>/v/<id>      the member's vote on the step, "1" or "0"
//   ft/r<R>/o           the outcome (compare-and-set): "1" commit, "0" discard
//   ft/q<Q>/...         the Gloo rendezvous of quorum Q's group
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "store/store.h"

namespace dtrain::ft {

// A replica in a round: its id, its committed step, and its incarnation (ft/inc/<id>, counted up by
// each process that takes the id, so a relaunched replica's heartbeats do not vouch for the dead one).
struct Member {
  std::string id;
  int64_t step = 0;
  int64_t incarnation = 0;
};

struct Decision {
  int64_t quorum_id = 0;
  int64_t max_step = 0;
  std::vector<Member> members;  // sorted by id
};

std::string encode(const Member& m);
Member decode_member(const std::string& text);
std::string encode(const Decision& d);
Decision decode_decision(const std::string& text);

// Whether replicas are alive, as one observer sees it: a heartbeat counter that did not move for
// `timeout` of this observer's own clock (no clocks are compared across hosts).
class Liveness {
 public:
  explicit Liveness(std::chrono::milliseconds timeout) : timeout_(timeout) {}
  bool alive(store::StoreClient& store, const Member& m);

 private:
  struct Seen {
    int64_t count = -1;
    std::chrono::steady_clock::time_point since;
  };
  std::chrono::milliseconds timeout_;
  std::map<std::string, Seen> seen_;
};

std::string round_key(int64_t round, const std::string& what);
// The key's value, or nullopt when it is absent.
std::optional<std::string> peek(store::StoreClient& store, const std::string& key);
std::string text(const store::Bytes& b);
store::Bytes bytes(const std::string& s);

}  // namespace dtrain::ft
