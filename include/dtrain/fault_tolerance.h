// Per-step replica fault tolerance, as torchft: data-parallel replicas that go on training when one of
// them dies, and a relaunched replica that heals from a live peer instead of a checkpoint file.
//
//   dtrain::ft::Manager manager(
//       [&] { return dtrain::ft::save_state(*model, opt, sampler.state()); },          // what a joiner gets
//       [&](const std::string& s) { sampler.load_state(dtrain::ft::load_state(*model, opt, s)); },
//       dtrain::ft::ManagerOptions().min_replicas(2));   // replica id, store: from dtrain-run --ft
//   while (manager.current_step() < steps) {
//     manager.start_quorum();                             // the step's members; heals this replica if behind
//     auto idx = sampler.indices(manager.participant_rank(), manager.num_participants(), batch);
//     opt.zero_grad();
//     loss(model, idx).backward();
//     auto grads = gradients(*model);
//     manager.allreduce(grads);                           // average over the participants; never throws
//     if (manager.should_commit()) {                      // every member finished the all-reduce
//       opt.step();
//       sampler.advance(manager.num_participants(), batch);
//     }                                                   // else: nobody applies the step; it is retried
//   }
//
// Contract:
// - A replica is one failure unit (here one process; the id is ManagerOptions::replica_id, or
//   $DTRAIN_FT_REPLICA_ID, which dtrain-run --ft sets). Every replica's Manager talks to one store
//   (the launcher's node-0 store: $MASTER_ADDR:$MASTER_PORT and $DTRAIN_JOB_SECRET), where the quorum
//   lives as keys (docs/design.md, "Replica fault tolerance"). No process of a replica calls
//   init_process_group for the cross-replica traffic: the Manager builds its own group per quorum.
// - A replica of several ranks (dtrain-run --ft --ft_replica_ranks K) is a dtrain world of its own:
//   every rank calls init_process_group() (its replica's ranks only), then constructs a Manager and
//   calls its methods in the same order; rank 0 talks to the quorum for the replica and tells the
//   others, and rank r's allreduce and healing run with rank r of the other replicas. A failure of
//   any rank of a replica takes the whole replica out (dtrain-run relaunches all its ranks).
// - start_quorum(), once per step, before anything the step computes: returns when the step's members
//   are agreed (the replicas alive now: a replica whose heartbeat stopped for heartbeat_timeout is
//   left out; one that arrived before the decision is in). Members behind the highest step (a
//   relaunched replica, a late starter; with init_sync all but one member at step 0) receive the
//   state of a member at that step (state_dict() there, load_state_dict() here) over the quorum's
//   group, point to point, and sit the step out (is_healing(); their allreduce contributes zeros);
//   they take part from the next step on.
// - allreduce(tensors): the sum over the quorum's members divided by num_participants(), written
//   back; one flat all-reduce. A failure (a peer died, the group's timeout) is recorded, not thrown:
//   the tensors are then garbage and should_commit() returns false.
// - should_commit(): every member votes (its all-reduce and healing succeeded); the first member to
//   know the outcome (all voted yes, a no, a missing voter whose heartbeat stopped, or `timeout`)
//   stores it with compare-and-set, and every member returns that one outcome. True: apply the step;
//   current_step() has moved on. False: nobody applies it; the next start_quorum() forms a new group
//   (new quorum id) of those alive, and the same step is tried again.
// - Errors: bad options and an unreachable store throw dtrain::Error; everything during a step is
//   recorded and answered by should_commit().
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/detail/arg.h"
#include "dtrain/errors.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace dtrain::ft {

struct ManagerOptions {
  // This replica's id, unique in the job and the same after a relaunch. "": $DTRAIN_FT_REPLICA_ID.
  DTRAIN_ARG(std::string, replica_id, "")
  // The store as host:port. "": $MASTER_ADDR:$MASTER_PORT (dtrain-run's node-0 store).
  DTRAIN_ARG(std::string, store_addr, "")
  // A step starts only with at least this many replicas.
  DTRAIN_ARG(int, min_replicas, 1)
  // Heartbeats every interval; a replica silent for the timeout is dead to the quorum and the vote.
  DTRAIN_ARG(std::chrono::milliseconds, heartbeat_interval, std::chrono::milliseconds(100))
  DTRAIN_ARG(std::chrono::milliseconds, heartbeat_timeout, std::chrono::milliseconds(1000))
  // The quorum group's build, collectives and healing, and the vote.
  DTRAIN_ARG(std::chrono::milliseconds, timeout, std::chrono::seconds(10))
  // How long start_quorum() waits for min_replicas before it throws.
  DTRAIN_ARG(std::chrono::milliseconds, quorum_timeout, std::chrono::seconds(60))
  // At step 0 every member but one heals from it, so that replicas start from the same parameters.
  DTRAIN_ARG(bool, init_sync, true)
};

class Manager {
 public:
  using StateDict = std::function<std::string()>;
  using LoadStateDict = std::function<void(const std::string&)>;
  // Connects to the store and starts heartbeating. Throws on bad options or an unreachable store.
  Manager(StateDict state_dict, LoadStateDict load_state_dict, ManagerOptions options = ManagerOptions());
  ~Manager();
  Manager(const Manager&) = delete;
  Manager& operator=(const Manager&) = delete;

  void start_quorum();
  void allreduce(std::vector<at::Tensor>& tensors);
  bool should_commit();

  // Committed steps (the same on every member after start_quorum()).
  int64_t current_step() const;
  // Changes whenever the members change or a step failed; the group is rebuilt for each.
  int64_t quorum_id() const;
  // This step's members, and those of them that train (not healing): the sampler's world and rank.
  int num_members() const;
  int num_participants() const;
  int participant_rank() const;  // -1 while healing
  bool is_healing() const;
  // Whether this replica received a peer's state in this step's start_quorum().
  bool healed_this_step() const;
  // The first failure recorded in this step ("" when none).
  std::string errored() const;
  const std::string& replica_id() const;
  // How many processes have taken this replica id in the job, this one included: 1 on the first start.
  int64_t incarnation() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The state a joining replica needs, in LibTorch's archive format: the module's parameters and
// buffers, the optimizer's state (its serialize(): SGD's momentum, Adam's moments and step), and
// `extra` bytes of the caller's (its sampler position). load_state restores the first two in place
// and returns `extra`.
std::string save_state(const torch::nn::Module& module, const torch::optim::Optimizer& optimizer,
                       const std::string& extra = "");
std::string load_state(torch::nn::Module& module, torch::optim::Optimizer& optimizer, const std::string& bytes);

// The samples of a job whose replicas come and go: an epoch's order (randperm seeded with
// seed + epoch, as DistributedSampler) is consumed from a position that moves only on committed
// steps. A step takes the next num_participants * batch indices (fewer at the epoch's end) and the
// participant r gets every num_participants-th of them from r. A step that does not commit moves
// nothing: its samples are the next step's, split among the replicas then alive, so each sample of
// an epoch is trained exactly once by the committed steps.
class ReplicaSampler {
 public:
  ReplicaSampler(int64_t size, uint64_t seed = 0, bool shuffle = true);
  std::vector<int64_t> indices(int participant_rank, int num_participants, int64_t batch) const;
  // After a committed step.
  void advance(int num_participants, int64_t batch);
  int64_t epoch() const { return epoch_; }
  int64_t position() const { return position_; }
  std::string state() const;  // "epoch position", for save_state's extra
  void load_state(const std::string& state);

 private:
  void make_order();
  int64_t size_;
  uint64_t seed_;
  bool shuffle_;
  int64_t epoch_ = 0, position_ = 0;
  std::vector<int64_t> order_;
};

}  // namespace dtrain::ft
