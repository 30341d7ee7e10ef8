#include "comm/shm/shm_pg_impl.h"
#include "comm/shm/shm_process_group.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <optional>

#include "dtrain/errors.h"

namespace dtrain::comm {
namespace {

thread_local bool t_blocking_call = false;

// Completes like Gloo's works: wait() rethrows the error; getFuture() is completed with the outputs
// (or the error) on the worker thread, so completion callbacks run there.
class ShmWork : public c10d::Work {
 public:
  ShmWork(std::vector<at::Tensor> outputs, c10d::OpType type)
      : c10d::Work(-1, type), outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  void complete(std::exception_ptr e) {
    finish(e);
    if (e) future_->setError(e);
    else future_->markCompleted(c10::IValue(outputs_));
  }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

std::optional<shm::DType> shm_dtype(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || !t.is_contiguous() || t.is_sparse()) return std::nullopt;
  switch (t.scalar_type()) {
    case at::kFloat: return shm::DType::F32;
    case at::kDouble: return shm::DType::F64;
    case at::kHalf: return shm::DType::F16;
    case at::kBFloat16: return shm::DType::BF16;
    default: return std::nullopt;
  }
}

std::optional<shm::RedOp> shm_op(const c10d::ReduceOp& op) {
  if (op == c10d::ReduceOp::SUM) return shm::RedOp::SUM;
  if (op == c10d::ReduceOp::PRODUCT) return shm::RedOp::PROD;
  if (op == c10d::ReduceOp::MIN) return shm::RedOp::MIN;
  if (op == c10d::ReduceOp::MAX) return shm::RedOp::MAX;
  return std::nullopt;
}

bool plain_cpu(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.is_contiguous() && !t.is_sparse();
}

}  // namespace

BlockingCallScope::BlockingCallScope(bool blocking) : previous_(t_blocking_call) {
  t_blocking_call = blocking;
}
BlockingCallScope::~BlockingCallScope() { t_blocking_call = previous_; }

ShmProcessGroup::ShmProcessGroup(int rank, int size, compat::BackendPtr gloo,
                                 std::unique_ptr<shm::Comm> local, compat::BackendPtr leaders,
                                 ShmTopology topo)
    : compat::Backend(rank, size), gloo_(std::move(gloo)), local_(std::move(local)),
      leaders_(std::move(leaders)), topo_(topo) {
  worker_ = std::thread([this] { run(); });
}

ShmProcessGroup::~ShmProcessGroup() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void ShmProcessGroup::run() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    {
      std::lock_guard<std::mutex> exec(exec_mu_);
      job();
    }
    std::lock_guard<std::mutex> lock(mu_);
    --pending_;
  }
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::enqueue(std::vector<at::Tensor> outputs,
                                                        c10d::OpType type, std::function<void()> job) {
  auto work = c10::make_intrusive<ShmWork>(std::move(outputs), type);
  auto task = [work, job = std::move(job)] {
    std::exception_ptr error;
    try {
      job();
    } catch (...) {
      error = std::current_exception();
    }
    work->complete(error);
  };
  std::unique_lock<std::mutex> lock(mu_);
  if (t_blocking_call && pending_ == 0) {  // Note [Inline blocking collectives]
    ++pending_;  // later calls queue behind this one and the worker waits for exec_mu_
    lock.unlock();
    {
      std::lock_guard<std::mutex> exec(exec_mu_);
      task();
    }
    lock.lock();
    --pending_;
    return work;
  }
  ++pending_;
  queue_.emplace_back(std::move(task));
  lock.unlock();
  cv_.notify_one();
  return work;
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::fallback(c10::intrusive_ptr<c10d::Work> w) {
  std::lock_guard<std::mutex> lock(fallback_mu_);
  fallbacks_.erase(std::remove_if(fallbacks_.begin(), fallbacks_.end(),
                                  [](const auto& f) { return f->isCompleted(); }),
                   fallbacks_.end());
  fallbacks_.push_back(w);
  return w;
}

void ShmProcessGroup::wait_fallbacks() {
  std::vector<c10::intrusive_ptr<c10d::Work>> pending;
  {
    std::lock_guard<std::mutex> lock(fallback_mu_);
    pending.swap(fallbacks_);
  }
  for (auto& w : pending) w->wait();
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  auto dtype = tensors.size() == 1 ? shm_dtype(tensors[0]) : std::nullopt;
  auto op = shm_op(opts.reduceOp);
  if (!dtype || !op) return fallback(gloo_->allreduce(tensors, opts));
  at::Tensor t = tensors[0];
  return enqueue({t}, c10d::OpType::ALLREDUCE, [this, t, d = *dtype, o = *op, opts] {
    // Hierarchical: reduce inside the host, then across host leaders, then spread inside the host.
    if (local_) local_->all_reduce(t.data_ptr(), static_cast<size_t>(t.numel()), d, o);
    if (leaders_) {
      try {
        // Gloo 1.13 cannot all-reduce bfloat16: the leaders exchange float32 and round once.
        std::vector<at::Tensor> v{d == shm::DType::BF16 ? t.to(at::kFloat) : t};
        leaders_->allreduce(v, opts)->wait();
        if (!v[0].is_same(t)) t.copy_(v[0]);
      } catch (const std::exception& e) {
        // The host's other ranks wait in the broadcast below: fail them too, now.
        if (local_) local_->abort(detail::cat("rank ", rank_, " (host leader): all_reduce between hosts failed: ", e.what()));
        throw;
      }
    }
    if (local_ && topo_.hosts > 1)
      local_->broadcast(t.data_ptr(), t.numel() * t.element_size(), topo_.leader_local);
  });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  if (topo_.hosts > 1 || !local_ || tensors.size() != 1 || !plain_cpu(tensors[0]) || opts.rootTensor != 0)
    return fallback(gloo_->broadcast(tensors, opts));
  at::Tensor t = tensors[0];
  const int root = static_cast<int>(opts.rootRank);  // one host: local index == group rank
  return enqueue({t}, c10d::OpType::BROADCAST, [this, t, root] {
    local_->broadcast(t.data_ptr(), t.numel() * t.element_size(), root);
  });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  bool ok = topo_.hosts == 1 && local_ && inputs.size() == 1 && outputs.size() == 1 &&
            plain_cpu(inputs[0]) && static_cast<int>(outputs[0].size()) == size_;
  if (ok)
    for (const auto& o : outputs[0])
      ok = ok && plain_cpu(o) && o.scalar_type() == inputs[0].scalar_type() && o.numel() == inputs[0].numel();
  if (!ok) return fallback(gloo_->allgather(outputs, inputs, opts));
  at::Tensor in = inputs[0];
  std::vector<at::Tensor> outs = outputs[0];
  return enqueue(outs, c10d::OpType::ALLGATHER, [this, in, outs] {
    std::vector<void*> ptrs;
    for (const auto& o : outs) ptrs.push_back(o.data_ptr());
    local_->all_gather(in.data_ptr(), in.numel() * in.element_size(), ptrs.data());
  });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::barrier(const c10d::BarrierOptions& opts) {
  // Like Gloo's barrier, it completes after this rank's earlier collectives (the queue's order, and
  // the Gloo fallbacks still in flight).
  return enqueue({}, c10d::OpType::BARRIER, [this, opts] {
    wait_fallbacks();
    if (topo_.hosts == 1 && local_) {
      local_->barrier();
    } else {
      gloo_->barrier(opts)->wait();
    }
  });
}

#define DTRAIN_SHM_FORWARD(call) return fallback(gloo_->call)

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allreduce_coalesced(std::vector<at::Tensor>& t,
                                                                    const c10d::AllreduceCoalescedOptions& o) {
  DTRAIN_SHM_FORWARD(allreduce_coalesced(t, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) {
  DTRAIN_SHM_FORWARD(reduce(t, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::_allgather_base(at::Tensor& out, at::Tensor& in,
                                                                const c10d::AllgatherOptions& o) {
  DTRAIN_SHM_FORWARD(_allgather_base(out, in, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allgather_coalesced(std::vector<std::vector<at::Tensor>>& out,
                                                                    std::vector<at::Tensor>& in,
                                                                    const c10d::AllgatherOptions& o) {
  DTRAIN_SHM_FORWARD(allgather_coalesced(out, in, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::gather(std::vector<std::vector<at::Tensor>>& out,
                                                       std::vector<at::Tensor>& in, const c10d::GatherOptions& o) {
  DTRAIN_SHM_FORWARD(gather(out, in, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::scatter(std::vector<at::Tensor>& out,
                                                        std::vector<std::vector<at::Tensor>>& in,
                                                        const c10d::ScatterOptions& o) {
  DTRAIN_SHM_FORWARD(scatter(out, in, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::reduce_scatter(std::vector<at::Tensor>& out,
                                                               std::vector<std::vector<at::Tensor>>& in,
                                                               const c10d::ReduceScatterOptions& o) {
  DTRAIN_SHM_FORWARD(reduce_scatter(out, in, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::_reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                                     const c10d::ReduceScatterOptions& o) {
  DTRAIN_SHM_FORWARD(_reduce_scatter_base(out, in, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::alltoall_base(at::Tensor& out, at::Tensor& in,
                                                              std::vector<int64_t>& os, std::vector<int64_t>& is,
                                                              const c10d::AllToAllOptions& o) {
  DTRAIN_SHM_FORWARD(alltoall_base(out, in, os, is, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                                         const c10d::AllToAllOptions& o) {
  DTRAIN_SHM_FORWARD(alltoall(out, in, o));
}
#undef DTRAIN_SHM_FORWARD

// Point-to-point is not awaited by barrier() (as in Gloo, whose barrier skips send/recv).
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::send(std::vector<at::Tensor>& t, int dst, int tag) {
  return gloo_->send(t, dst, tag);
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::recv(std::vector<at::Tensor>& t, int src, int tag) {
  return gloo_->recv(t, src, tag);
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::recvAnysource(std::vector<at::Tensor>& t, int tag) {
  return gloo_->recvAnysource(t, tag);
}

void ShmProcessGroup::monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) {
  gloo_->monitoredBarrier(o, wait_all_ranks);
}
void ShmProcessGroup::setSequenceNumberForGroup() { gloo_->setSequenceNumberForGroup(); }
uint64_t ShmProcessGroup::getSequenceNumberForGroup() { return gloo_->getSequenceNumberForGroup(); }

bool uses_shared_memory(const compat::BackendPtr& pg) {
  auto* s = dynamic_cast<ShmProcessGroup*>(pg.get());
  return s && s->has_local();
}

}  // namespace dtrain::comm
