// The process-wide distributed state behind dtrain's free functions (as torch.distributed's
// default group): set by init_process_group, cleared by destroy_process_group.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "compat/c10d_compat.h"
#include "dtrain/process_group.h"

namespace dtrain::store {
class StoreServer;
}
namespace dtrain::comm {
class Capabilities;
class FlightRing;
}  // namespace dtrain::comm

namespace dtrain {

// What a Group handle points to (null in a default Group(): the world, resolved at each call).
struct detail::GroupImpl {
  std::string name;  // "default" or "group<N>"
  std::string backend;
  compat::BackendPtr pg;                       // null for non-members
  comm::Capabilities* caps = nullptr;          // answers for pg (comm/capabilities.h); lives as long as pg
  int rank = -1;                               // rank inside the group
  std::vector<int> ranks;                      // global ranks, sorted
  std::unordered_map<int, int> group_rank_of;  // global -> group rank
  std::chrono::milliseconds timeout{0};
  // DTRAIN_DEBUG=DETAIL: collectives checked on this group so far (src/comm/debug_check.h).
  mutable std::atomic<uint64_t> debug_seq{0};
  // Objects built on this group so far (Note [Group-agreed ids]).
  mutable std::atomic<int64_t> objects{0};
  // The flight recorder's calls on this group (comm/flight_recorder.h); null for non-members or when off.
  std::shared_ptr<comm::FlightRing> flight;
};

// The library's only way to build a Group or to reach what it points to (the handle keeps both
// private, so that callers see a contract and no internals).
struct detail::GroupAccess {
  static Group make(std::shared_ptr<GroupImpl> impl) { return Group(std::move(impl)); }
  // Throws (an internal error) on the default group, which has no GroupImpl of its own.
  static const GroupImpl& impl(const Group& group);
};

namespace comm {

struct WorldState {
  int rank = -1;
  int world_size = 0;
  int local_rank = -1;
  int local_world_size = 0;
  int restart_count = 0;  // the launcher's attempt number (0 on the first start)
  std::string backend;
  std::string launcher;
  std::chrono::milliseconds timeout{0};
  std::string bind_address;
  std::unique_ptr<store::StoreServer> server;  // when rank 0 hosts the rendezvous
  c10::intrusive_ptr<c10d::Store> store;       // job store, prefixed with this restart attempt
  std::shared_ptr<detail::GroupImpl> world;
  int next_group_id = 1;
  // Python ranks share the default group (Note [PyTorch peers]); `python_store` is the unprefixed
  // store their init_process_group uses.
  bool pytorch_peers = false;
  c10::intrusive_ptr<c10d::Store> python_store;
};

// The state; throws "dtrain is not initialized: call dtrain::init_process_group() first" if unset.
WorldState& world_state();
// nullptr when not initialized.
WorldState* world_state_or_null();
// The group's implementation (the world for a default Group()).
const detail::GroupImpl& resolve(const Group& group);
// What the group's backend answers (Note [One backend interface] in comm/capabilities.h), for
// callers above comm/ that choose an algorithm (DDP's hooks); throws for a non-member.
const Capabilities& capabilities(const Group& group);

}  // namespace comm
}  // namespace dtrain

namespace dtrain {
// The message of an exception without c10's backtrace lines.
std::string brief(const std::exception& e);
}  // namespace dtrain

namespace dtrain::comm {
// A backend's failure of the collective `what` ("rank 1: all_reduce on group ..."), as Work::wait
// reports it: a timeout said plainly, anything else "failed: <message>".
Error collective_failure(const std::string& what, const std::exception& e);
}  // namespace dtrain::comm

namespace dtrain::comm {
// Builds a group over `ranks` (global, sorted); members construct their backend.
std::shared_ptr<detail::GroupImpl> make_group(WorldState& st, const std::string& name, std::vector<int> ranks,
                                              std::chrono::milliseconds timeout);
// Returns once every member of g has built its backend (Note [new_group barrier]); `remedy` ends the
// timeout's message.
void await_members(WorldState& st, const detail::GroupImpl& g, std::chrono::milliseconds timeout,
                   const std::string& remedy);
}  // namespace dtrain::comm
