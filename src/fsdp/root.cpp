// A unit's forward and backward steps, and the root that orders them (see root.h and unit.h).
//
// Note [Gradients as their reduce-scatter lands]
// A unit's reduce-scatter leaves the shard's part of the gradients in an output of the unit's own,
// which finish_gradients() adds to the shard's .grad() (or makes it). Done only at the end of
// backward, every unit's output lived until then beside the gradients of the step before: a whole
// set of sharded gradients more at the peak of the step (40 MB of 21 M parameters on 2 ranks,
// bench_fsdp's peak RSS). So when a unit launches its reduce-scatter, the unit launched before it
// (whose reduce-scatter had this unit's backward to land) waits for it and takes its gradients, as
// FSDP2 adds a unit's reduce-scatter output to the sharded gradients right behind the collective;
// the end of backward takes the last unit's. The same additions on the same tensors, earlier: the
// gradients are the same bits. HSDP keeps them for the end: its all-reduces across the replicas go
// in launch order (Note [Replicate all-reduce in backward]).
#include "fsdp/root.h"

#include <torch/csrc/autograd/grad_mode.h>

#include "compat/autograd_compat.h"
#include "fsdp/unit.h"

namespace dtrain::detail::fsdp {
namespace {

// Units' forwards running on this thread, one inside the other: the outermost is the root's.
thread_local int forward_depth = 0;

std::shared_ptr<Unit> lock(const std::weak_ptr<Unit>& w) { return w.lock(); }

// Before a unit's backward: its parameters whole again, and the unit before it prefetched.
void pre_backward(Unit& unit) {
  if (unit.pre_backward_done) return;
  unit.pre_backward_done = true;
  if (unit.root) {
    unit.root->on_backward();
    unit.root->issue_replicate_all_reduces(/*wait=*/false);  // Note [Replicate all-reduce in backward]
  }
  unit.unshard();
  if (unit.root) {
    auto next = unit.root->before_in_forward(&unit);
    if (next && !next->pre_backward_done) next->issue_gather();
  }
}

// The root of `unit`: the one it already has, or a new one made of every unit below its module.
void ensure_root(Unit& unit, const std::shared_ptr<Unit>& self) {
  if (unit.root) return;
  std::vector<std::weak_ptr<Unit>> units;
  for (const auto& m : const_cast<torch::nn::Module*>(unit.module())->modules(/*include_self=*/false)) {
    auto u = find_unit(m.get());
    if (u && !u->root) units.push_back(u);
  }
  units.push_back(self);
  unit.own_root = std::make_shared<Root>(units);
  for (auto& w : units)
    if (auto u = w.lock()) u->root = unit.own_root.get();
  unit.make_root_default();
}

}  // namespace

void Root::begin_iteration() {
  if (!order_.empty()) last_order_ = std::move(order_);
  order_.clear();
  ends_.clear();
  if (queued_) return;       // a backward is still running (a forward inside backward): nothing to reset
  replicate_queue_.clear();  // of a backward an exception ended: finish_gradients issues what is left
  last_launched_.reset();
  for (auto& w : units_) {
    if (auto u = lock(w)) {
      u->drop_prefetch();      // prefetched for a unit the last forward did not run
      u->drop_post_forward();  // kept for a backward that did not come (Note [Post-forward groups])
      u->reset_backward();
    }
  }
}

std::shared_ptr<Unit> Root::record_forward(const std::shared_ptr<Unit>& unit) {
  order_.push_back(unit);
  const size_t i = order_.size();
  if (i < last_order_.size()) return lock(last_order_[i]);
  return nullptr;
}

void Root::record_forward_end(const std::shared_ptr<Unit>& unit) { ends_.push_back(unit); }

std::shared_ptr<Unit> Root::before_in_forward(const Unit* unit) const {
  // By the order forwards finished: a unit inside another finishes first, and backward reaches it
  // after the outer one (FSDP2 prefetches backward by its post-forward order, too).
  for (size_t i = ends_.size(); i-- > 1;)
    if (lock(ends_[i]).get() == unit) return lock(ends_[i - 1]);
  return nullptr;
}

void Root::on_backward() {
  if (queued_) return;
  queued_ = true;
  compat::queue_end_of_backward_callback([this] { end_of_backward(); });
}

void Root::queue_replicate_all_reduce(const std::shared_ptr<Unit>& unit) { replicate_queue_.push_back(unit); }

void Root::issue_replicate_all_reduces(bool wait) {
  size_t issued = 0;
  for (; issued < replicate_queue_.size(); ++issued) {
    auto u = lock(replicate_queue_[issued]);
    if (u && !u->issue_replicate_all_reduce(wait)) break;
  }
  replicate_queue_.erase(replicate_queue_.begin(), replicate_queue_.begin() + static_cast<std::ptrdiff_t>(issued));
}

void Root::on_reduce_scatter_launched(const std::shared_ptr<Unit>& unit) {
  auto before = lock(last_launched_);
  last_launched_ = unit;
  if (before && before != unit && !before->is_whole()) before->finish_gradients();
}

void Root::end_of_backward() {
  queued_ = false;
  last_launched_.reset();
  std::vector<std::shared_ptr<Unit>> units;
  for (auto& w : units_)
    if (auto u = lock(w)) units.push_back(u);
  // Launches in backward's order first (what backward would have done had every parameter been
  // used), then in module order for units the forward did not record.
  for (size_t i = ends_.size(); i-- > 0;)
    if (auto u = lock(ends_[i])) u->launch_if_pending();
  for (auto& u : units) u->launch_if_pending();
  issue_replicate_all_reduces(/*wait=*/true);  // in launch order, before any unit waits for its own
  for (auto& u : units) u->finish_gradients();
  for (auto& u : units) {
    u->drop_prefetch();  // gathered for a backward that did not reach the unit
    u->drop_post_forward();
    u->reset_backward();
  }
}

ForwardScope::ForwardScope(std::shared_ptr<Unit> unit) : unit_(std::move(unit)) {
  DTRAIN_CHECK(unit_ != nullptr, "internal: a forward scope without a unit");
  if (forward_depth == 0) {
    ensure_root(*unit_, unit_);
    unit_->root->begin_iteration();
  }
  ++forward_depth;
  unit_->unshard();
  if (unit_->root) {
    if (auto next = unit_->root->record_forward(unit_)) next->issue_gather();
  }
}

ForwardScope::~ForwardScope() { --forward_depth; }

void ForwardScope::finish(const std::vector<at::Tensor>& outputs) {
  finished_ = true;
  if (unit_->root) unit_->root->record_forward_end(unit_);
  unit_->post_forward();
  if (!torch::autograd::GradMode::is_enabled()) return;
  std::weak_ptr<Unit> weak = unit_;
  for (const at::Tensor& t : outputs) {
    if (!t.defined() || !t.requires_grad()) continue;
    at::Tensor out = t;
    out.register_hook([weak](const at::Tensor&) {
      if (auto u = weak.lock()) pre_backward(*u);
    });
  }
}

}  // namespace dtrain::detail::fsdp
