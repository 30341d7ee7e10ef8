#include "ddp/reducer.h"

#include <sstream>

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <c10/core/GradMode.h>

#include "common/util.h"

namespace dtrain::ddp {
namespace {

// A tensor shaped like `param` that aliases buffer[offset : offset + numel]. Built with set_() rather
// than narrow().view(): autograd must not see it as a view, because LibTorch's
// Optimizer::zero_grad() calls detach_() on every gradient, which views refuse
// (gradient_as_bucket_view makes these slots the gradients themselves).
at::Tensor slot(const at::Tensor& buffer, int64_t offset, const at::Tensor& param) {
  at::NoGradGuard ng;
  at::Tensor t = at::empty({0}, buffer.options());
  t.set_(buffer.storage(), buffer.storage_offset() + offset, param.sizes(), c10::contiguous_strides(param.sizes()));
  return t;
}

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 std::vector<std::vector<int>> assignment, Group group, bool gradient_as_bucket_view, bool track_unused,
                 bool pytorch_peers, bool static_graph)
    : params_(std::move(params)),
      names_(std::move(names)),
      group_(std::move(group)),
      group_size_(group_.size()),
      divisor_(0),
      as_view_(gradient_as_bucket_view),
      track_unused_(track_unused),
      pytorch_peers_(pytorch_peers),
      static_graph_(static_graph && pytorch_peers) {
  const int n = static_cast<int>(params_.size());
  set_buckets(std::move(assignment));
  for (int i = 0; i < n; ++i) {
    accumulators_.push_back(compat::grad_accumulator(params_[i]));
    hook_keys_.push_back(compat::add_post_hook(accumulators_.back(), [this, i] { on_grad_ready(i); }));
  }
  local_used_ = at::zeros({n}, at::TensorOptions().dtype(at::kInt));
  if (follows_python_ddp()) {
    local_used_dev_ = at::zeros({n}, at::TensorOptions().dtype(at::kInt));
    hook_counts_.assign(n, 0);
  }
  record_order_ = should_rebuild_buckets();
  set_divisor(group_size_);
}

void Reducer::set_buckets(std::vector<std::vector<int>> assignment) {
  const int n = static_cast<int>(params_.size());
  buckets_.clear();
  bucket_of_.assign(n, -1);
  slot_of_.assign(n, -1);
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket bucket;
    bucket.params = assignment[b];
    int64_t numel = 0;
    for (int i : bucket.params) numel += params_[i].numel();
    const at::Tensor& first = params_[bucket.params.front()];
    bucket.buffer = at::zeros({numel}, first.options().requires_grad(false));
    int64_t offset = 0;
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const int i = bucket.params[k];
      const at::Tensor& p = params_[i];
      bucket.views.push_back(slot(bucket.buffer, offset, p));
      offset += p.numel();
      bucket_of_[i] = static_cast<int>(b);
      slot_of_[i] = static_cast<int>(k);
      if (as_view_ && p.grad().defined()) {
        at::NoGradGuard ng;
        bucket.views.back().copy_(p.grad());
      }
      // Python leaves an undefined gradient undefined (a parameter no rank uses keeps none).
      if (as_view_ && (p.grad().defined() || !leaves_undefined_grads())) p.mutable_grad() = bucket.views.back();
    }
    buckets_.push_back(std::move(bucket));
  }
  for (int i = 0; i < n; ++i) DTRAIN_ASSERT(bucket_of_[i] >= 0, "parameter ", i, " is in no bucket");
  reset_iteration();
}

Reducer::~Reducer() {
  for (size_t i = 0; i < accumulators_.size(); ++i) compat::remove_post_hook(accumulators_[i], hook_keys_[i]);
}

void Reducer::reset_iteration() {
  armed_ = false;
  started_ = false;
  ready_.assign(params_.size(), false);
  unused_.assign(params_.size(), false);
  next_to_launch_ = 0;
  waiting_since_ns_ = 0;
  for (auto& b : buckets_) {
    b.pending = static_cast<int>(b.params.size());
    b.launched = false;
    b.work = Work();
    b.in_place = false;
    b.future = Future();
    b.grad_bucket.reset();
  }
}

void Reducer::set_divisor(int divisor) {
  if (divisor == divisor_) return;
  divisor_ = divisor;
  reciprocal_tensor_ = at::native::wrapped_scalar_tensor(at::Scalar(1.0 / divisor));
  // A wrapped number on the CPU, as div_(Scalar) makes it (also for CUDA buckets): the same type
  // promotion and the same bits as dividing by the integer.
  divisor_tensor_ = at::native::wrapped_scalar_tensor(at::Scalar(static_cast<int64_t>(divisor)));
}

void Reducer::record(DDPEvent::Kind kind, int index, int64_t time_ns) {
  events_.push_back(DDPEvent{kind, index, time_ns ? time_ns : util::now_ns()});
  if (hook_) hook_(events_.back());
}

void Reducer::set_event_hook(DDPEventHook hook) {
  std::lock_guard<std::mutex> g(mu_);
  hook_ = std::move(hook);
}

std::vector<DDPEvent> Reducer::events() const { return events_; }

void Reducer::prepare_for_backward(std::vector<bool> unused) {
  std::lock_guard<std::mutex> g(mu_);
  DTRAIN_CHECK(!started_,
               "DistributedDataParallel: a new forward started before the previous backward finished "
               "reducing gradients: call backward() once per forward");
  reset_iteration();
  unused_ = std::move(unused);
  unused_.resize(params_.size(), false);
  if (follows_python_ddp()) {
    ++iterations_;
    order_.clear();
    hooks_left_ = hook_counts_;
    for (int i : static_unused_) unused_[i] = true;  // static_graph after its first backward
  }
  rehook_replaced_parameters();
  armed_ = true;
}

// Note [Replaced parameters]: LibTorch's Module::load (InputArchive::read) set_()s every parameter,
// and a parameter whose data is replaced gets a new gradient accumulator: hooks on the old one never
// fire again, so this rank would silently stop synchronizing (every rank trains alone). The forward
// has just built the graph, so each parameter's current accumulator is the one backward will run.
void Reducer::rehook_replaced_parameters() {
  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = compat::grad_accumulator(params_[i]);
    if (acc == accumulators_[i]) continue;
    compat::remove_post_hook(accumulators_[i], hook_keys_[i]);
    accumulators_[i] = acc;
    const int index = static_cast<int>(i);
    hook_keys_[i] = compat::add_post_hook(acc, [this, index] { on_grad_ready(index); });
  }
}

void Reducer::on_grad_ready(int index) {
  std::lock_guard<std::mutex> g(mu_);
  if (follows_python_ddp()) {
    if (python_before_hook(index)) return;
  } else if (track_unused_ && params_[index].grad().defined()) {
    local_used_.data_ptr<int32_t>()[index] = 1;  // as PyTorch: no_sync backwards count as use
  }
  if (!armed_) return;  // no_sync, or a backward that DDP's forward did not set up
  if (!started_) begin_backward();
  if (static_graph_after_first_iteration() && !python_counted_down(index)) return;
  if (ready_[index]) return;  // e.g. a parameter used twice still has one accumulator call per pass
  if (record_order_) order_.push_back(index);
  // Step 3.
  record(DDPEvent::Kind::kGradReady, index);
  if (!defers_last_bucket() || bucket_of_[index] + 1 != static_cast<int>(buckets_.size())) fill_slot(index);
  mark_ready(index);
}

// Step 2: the first gradient of this backward.
void Reducer::begin_backward() {
  started_ = true;
  ever_started_ = true;
  events_.clear();
  compat::queue_end_of_backward_callback([this] { finalize(); });
  for (size_t i = 0; i < unused_.size(); ++i)
    if (unused_[i]) {
      at::NoGradGuard ng;
      // As PyTorch's reducer: a gradient left from no_sync backwards is reduced too (zeros if none).
      fill_slot(static_cast<int>(i));
      mark_ready(static_cast<int>(i));
    }
}

void Reducer::fill_slot(int index) {
  const at::Tensor& grad = params_[index].grad();
  at::Tensor& view = buckets_[bucket_of_[index]].views[slot_of_[index]];
  // DDP's own all-reduce sums, so each slot is divided by the group size on its way in: in the
  // same pass as the copy (PyTorch's reducer does the same), not in a second pass over the whole
  // bucket at launch. A communication hook gets the bucket undivided.
  at::NoGradGuard ng;
  const bool divide = !comm_hook_;
  if (!grad.defined()) {
    view.zero_();
  } else if (as_view_ && grad.data_ptr() == view.data_ptr()) {
    if (divide) view.div_(divisor_tensor_);
  } else if (divide && scales_by_reciprocal()) {
    at::mul_out(view, grad, reciprocal_tensor_);  // Python's reducer multiplies by 1/size
  } else if (divide) {
    at::div_out(view, grad, divisor_tensor_);
  } else {
    view.copy_(grad);
  }
}

// Note [Last bucket in place]: the last bucket is reduced on the backward thread as a blocking call,
// and nothing else reads its buffer: so its gradients need not pass through it. Their slots are not
// filled in the hooks; at launch all_reduce_divided reads the gradients, divides them on the way
// and writes the averages straight back into them (over shared memory; otherwise it goes through
// the bucket buffer as before). A 400 KB bucket's copy in and copy out were two of the few passes
// over memory that a small model's DDP step adds. Not with a communication hook (it gets the bucket),
// gradient_as_bucket_view (the gradients are the slots already) or unused-parameter tracking (unused
// parameters' slots are zeros, and their gradients must stay untouched).
bool Reducer::defers_last_bucket() const { return !comm_hook_ && !as_view_ && !track_unused_ && !follows_python_ddp(); }

// Whether the last bucket's gradients can be averaged in place: every one defined, plain (no
// graph of its own, as with create_graph) and of the bucket's dtype and device.
bool Reducer::reduce_last_in_place(Bucket& b) {
  std::vector<at::Tensor> grads;
  grads.reserve(b.params.size());
  for (int i : b.params) {
    const at::Tensor& g = params_[i].grad();
    if (!g.defined() || g.requires_grad() || g.scalar_type() != b.buffer.scalar_type() ||
        g.device() != b.buffer.device())
      return false;
    grads.push_back(g);
  }
  all_reduce_divided(grads, divisor_, group_, b.buffer);
  return true;
}

void Reducer::mark_ready(int index) {
  ready_[index] = true;
  --buckets_[bucket_of_[index]].pending;
  launch_ready_buckets();
}

void Reducer::launch_ready_buckets() {
  while (next_to_launch_ < buckets_.size() && buckets_[next_to_launch_].pending == 0) {
    Bucket& b = buckets_[next_to_launch_];
    if (comm_hook_) {
      launch_with_comm_hook(b, next_to_launch_);
      ++next_to_launch_;
      continue;
    }
    record(DDPEvent::Kind::kBucketLaunched, static_cast<int>(next_to_launch_));
    // The last bucket is ready only once backward has produced every gradient: nothing is left to
    // overlap it with, and finalize() would wait for it next. So it goes as a blocking call, which
    // the shared-memory group runs on this thread (Note [Inline blocking collectives]) instead of
    // handing it to its worker and sleeping until the worker is done: with one core per rank that
    // hand-off is a context switch each way, a large part of a small model's step. DDP's wait for
    // the other ranks now starts here, so kBackwardEnd is dated here too (the monitor's comm_wait).
    const bool last = next_to_launch_ + 1 == buckets_.size();
    if (last) waiting_since_ns_ = util::now_ns();
    try {
      if (last && defers_last_bucket()) {
        b.in_place = reduce_last_in_place(b);  // Note [Last bucket in place]
        if (!b.in_place)
          for (int i : b.params) fill_slot(i);
      }
      if (!b.in_place) b.work = all_reduce(b.buffer, ReduceOp::SUM, group_, /*async_op=*/!last);
    } catch (...) {
      abandon_iteration();  // autograd rethrows from backward(); the next forward starts afresh
      throw;
    }
    b.launched = true;
    b.done_ns = std::make_shared<std::atomic<int64_t>>(0);
    b.work.then([d = b.done_ns] { d->store(util::now_ns()); });
    ++next_to_launch_;
  }
}

void Reducer::set_comm_hook(CommHook hook) {
  std::lock_guard<std::mutex> g(mu_);
  DTRAIN_CHECK(hook, "DistributedDataParallel::register_comm_hook: the hook is empty: pass a function or functor");
  DTRAIN_CHECK(!comm_hook_,
               "DistributedDataParallel::register_comm_hook: a communication hook is already registered: register "
               "one hook, once (wrap two behaviours in one hook)");
  DTRAIN_CHECK(!ever_started_,
               "DistributedDataParallel::register_comm_hook: called after a synchronized backward: register the hook "
               "right after constructing DistributedDataParallel, before the first backward");
  comm_hook_ = std::move(hook);
}

// The hook averages, so the buffer goes to it undivided. Every bucket goes asynchronously: the hook
// decides what to issue, and its continuations run when finalize() waits (Note [Comm hook futures]).
void Reducer::launch_with_comm_hook(Bucket& b, size_t index) {
  record(DDPEvent::Kind::kBucketLaunched, static_cast<int>(index));
  if (index + 1 == buckets_.size()) waiting_since_ns_ = util::now_ns();
  std::vector<at::Tensor> params;
  for (int i : b.params) params.push_back(params_[i]);
  b.grad_bucket = std::make_shared<GradBucket>(static_cast<int>(index), static_cast<int>(buckets_.size()), b.buffer,
                                               b.views, std::move(params), b.params);
  try {
    b.future = comm_hook_(*b.grad_bucket);
    DTRAIN_CHECK(b.future.valid(), "rank ", dtrain::rank(),
                 ": DistributedDataParallel: the communication hook returned an empty Future for bucket ", index,
                 ": return the Future of its collective (or dtrain::Future(tensor) when the result is ready)");
  } catch (...) {
    abandon_iteration();
    throw;
  }
  b.launched = true;
  b.done_ns.reset();  // the bucket's end is when finalize() has its result
}

// The hook's result becomes the bucket's values, cast to the bucket's dtype when it differs (the
// compression wrappers return the compressed tensor, as in PyTorch).
void Reducer::take_hook_result(Bucket& b, size_t index) {
  at::Tensor result = b.future.wait();
  DTRAIN_CHECK(result.defined() && result.numel() == b.buffer.numel(), "rank ", dtrain::rank(),
               ": DistributedDataParallel: the communication hook's result for bucket ", index, " has ",
               result.defined() ? result.numel() : 0, " elements, expected ", b.buffer.numel(),
               " (bucket.buffer()'s): return a tensor with one value per element of the bucket");
  DTRAIN_CHECK(result.is_floating_point(), "rank ", dtrain::rank(),
               ": DistributedDataParallel: the communication hook's result for bucket ", index, " is of type ",
               result.scalar_type(), ": return a floating-point tensor (the averaged gradients)");
  if (!result.is_same(b.buffer)) {
    at::NoGradGuard ng;
    b.buffer.copy_(result.reshape({-1}));
  }
}

void Reducer::abandon_iteration() {
  for (auto& b : buckets_) {
    if (!b.launched) continue;
    try {
      if (b.future.valid())
        b.future.wait();
      else
        b.work.wait();  // leave no collective in flight on the buffers
    } catch (...) {
    }
  }
  reset_iteration();
}

void Reducer::finalize() {
  std::lock_guard<std::mutex> g(mu_);
  if (!started_) return;  // the iteration failed in a hook and was abandoned there
  if (static_graph_first_iteration()) python_launch_delayed();
  if (record_order_ && static_graph_after_first_iteration())
    order_.insert(order_.end(), static_unused_.begin(), static_unused_.end());
  record(DDPEvent::Kind::kBackwardEnd, -1, waiting_since_ns_);
  // Step 4.
  if (next_to_launch_ < buckets_.size()) {
    std::ostringstream missing;
    int count = 0;
    for (size_t i = 0; i < params_.size(); ++i)
      if (!ready_[i]) missing << (count++ ? ", " : "") << names_[i];
    abandon_iteration();
    throw Error(
        detail::cat("rank ", dtrain::rank(),
                    ": DistributedDataParallel: expected every parameter to receive a gradient in this backward, "
                    "but ",
                    count, " did not: ", missing.str(),
                    ". Pass DDPOptions().find_unused_parameters(true) if some parameters are unused in a forward, "
                    "and make sure every output that depends on them takes part in the loss"));
  }
  std::vector<int64_t> used_anywhere;
  if (follows_python_ddp()) {
    used_anywhere = python_used_anywhere();
  } else if (track_unused_) {
    // 1 where this rank produced a gradient since the last synchronized backward (no_sync ones
    // included, as PyTorch); MAX over ranks tells which were used anywhere.
    std::vector<int64_t> used(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) used[i] = local_used_.data_ptr<int32_t>()[i];
    local_used_.zero_();
    used_anywhere = all_reduce_values(used, ReduceOp::MAX, group_);
  }
  for (auto& b : buckets_) {
    if (b.future.valid()) {
      try {
        take_hook_result(b, static_cast<size_t>(&b - &buckets_[0]));
      } catch (...) {
        abandon_iteration();
        throw;
      }
    } else {
      b.work.wait();
    }
    // The completion callback may run just after wait() returns: then "now" is as good.
    record(DDPEvent::Kind::kBucketDone, static_cast<int>(&b - &buckets_[0]), b.done_ns ? b.done_ns->load() : 0);
    // Bucket by bucket (as PyTorch's reducer): a later bucket's hook continuation may wait on a
    // collective in flight (PowerSGD's last Q), and this copy passes meanwhile.
    write_grads(used_anywhere, static_cast<size_t>(&b - &buckets_[0]));
  }
  record(DDPEvent::Kind::kGradsSynced, -1);
  reset_iteration();
}

void Reducer::write_grads(const std::vector<int64_t>& used_anywhere, size_t bucket) {
  at::NoGradGuard ng;
  Bucket& b = buckets_[bucket];
  if (b.in_place) return;  // the gradients hold the averages already
  for (size_t k = 0; k < b.params.size(); ++k) {
    const int i = b.params[k];
    if (!used_anywhere.empty() && used_anywhere[i] == 0) continue;
    at::Tensor& view = b.views[k];
    at::Tensor& grad = params_[i].mutable_grad();
    if (as_view_) {
      if (!grad.defined() || grad.data_ptr() != view.data_ptr()) grad = view;
    } else if (!grad.defined()) {
      grad = view.clone();
    } else {
      grad.copy_(view);
    }
  }
}

void Reducer::shadow_backward() {
  std::lock_guard<std::mutex> g(mu_);
  DTRAIN_ASSERT(!started_, "a joined rank shadows a backward while its own is in progress");
  try {
    {
      at::NoGradGuard ng;
      for (auto& b : buckets_) b.buffer.zero_();  // a joined rank contributes nothing
    }
    // The same collectives, in the same order, as launch_ready_buckets() and finalize() issue.
    for (size_t i = 0; i < buckets_.size(); ++i) {
      Bucket& b = buckets_[i];
      if (comm_hook_) {
        std::vector<at::Tensor> params;
        for (int p : b.params) params.push_back(params_[p]);
        b.grad_bucket = std::make_shared<GradBucket>(static_cast<int>(i), static_cast<int>(buckets_.size()), b.buffer,
                                                     b.views, std::move(params), b.params);
        b.future = comm_hook_(*b.grad_bucket);
        DTRAIN_CHECK(b.future.valid(), "rank ", dtrain::rank(),
                     ": DistributedDataParallel: the communication hook returned an empty Future for bucket ", i,
                     " (while this rank shadowed the others under Join): return the Future of its collective");
      } else {
        b.work = all_reduce(b.buffer, ReduceOp::SUM, group_, /*async_op=*/true);
      }
      b.launched = true;
    }
    std::vector<int64_t> used_anywhere;
    if (track_unused_)
      used_anywhere = all_reduce_values(std::vector<int64_t>(params_.size(), 0), ReduceOp::MAX, group_);
    for (size_t i = 0; i < buckets_.size(); ++i) {
      if (buckets_[i].future.valid())
        take_hook_result(buckets_[i], i);
      else
        buckets_[i].work.wait();
      write_grads(used_anywhere, i);
    }
  } catch (...) {
    abandon_iteration();
    throw;
  }
  reset_iteration();
}

}  // namespace dtrain::ddp
