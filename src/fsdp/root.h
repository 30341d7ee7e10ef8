// The root of fully_shard units: the unit whose forward runs with no other unit's forward active.
// It starts each iteration, records the order units run in (for prefetching one unit ahead), and
// at the end of backward (one callback per backward pass) has every unit launch what is pending,
// wait for its reduce-scatter and leave the shards' gradients in .grad().
#pragma once

#include <memory>
#include <vector>

namespace dtrain::detail::fsdp {

class Unit;

class Root {
 public:
  explicit Root(std::vector<std::weak_ptr<Unit>> units) : units_(std::move(units)) {}
  // A forward of the root: a new iteration; gradients of an earlier backward that never ended
  // (an exception inside it) are dropped.
  void begin_iteration();
  // `unit` runs its forward now; returns the unit that ran after it last iteration, if any.
  std::shared_ptr<Unit> record_forward(const std::shared_ptr<Unit>& unit);
  // `unit`'s forward has finished (the order backward runs the units in is its reverse).
  void record_forward_end(const std::shared_ptr<Unit>& unit);
  // The unit whose forward finished before `unit`'s in this iteration (the next in backward), if any.
  std::shared_ptr<Unit> before_in_forward(const Unit* unit) const;
  // Called from autograd hooks: queues the end of this backward pass once.
  void on_backward();
  // HSDP (Note [Replicate all-reduce in backward]): `unit` has launched its reduce-scatter; its
  // all-reduce across the replicas waits in the queue.
  void queue_replicate_all_reduce(const std::shared_ptr<Unit>& unit);
  // Issues the queued all-reduces in launch order (the same on every rank): each whose
  // reduce-scatter has landed, stopping at the first that has not, or, with `wait`, all of them.
  void issue_replicate_all_reduces(bool wait);
  // `unit` has launched its reduce-scatter: the unit that launched one before it in this backward
  // takes its gradients now (Note [Gradients as their reduce-scatter lands] in root.cpp).
  void on_reduce_scatter_launched(const std::shared_ptr<Unit>& unit);

 private:
  void end_of_backward();

  std::vector<std::weak_ptr<Unit>> units_;
  std::vector<std::weak_ptr<Unit>> order_, last_order_;  // forwards started, this and last iteration
  std::vector<std::weak_ptr<Unit>> ends_;                // forwards finished, this iteration
  std::vector<std::weak_ptr<Unit>> replicate_queue_;     // reduce-scatters launched, all-reduce not issued
  std::weak_ptr<Unit> last_launched_;                    // its gradients not yet taken
  bool queued_ = false;
};

}  // namespace dtrain::detail::fsdp
