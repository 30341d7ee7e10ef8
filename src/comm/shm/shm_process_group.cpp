#include "comm/shm/shm_pg_impl.h"
#include "comm/shm/shm_process_group.h"
#include "comm/call_hint.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <cctype>
#include <cstring>
#include <optional>
#include <stdexcept>

#include "dtrain/errors.h"

namespace dtrain::comm {
namespace {

// Completes like Gloo's works: wait() rethrows the error; getFuture() is completed with the outputs
// (or the error) on the worker thread, so completion callbacks run there.
class ShmWork : public c10d::Work {
 public:
  ShmWork(std::vector<at::Tensor> outputs, c10d::OpType type)
      : c10d::Work(-1, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  void complete(std::exception_ptr e) {
    finish(e);
    if (e)
      future_->setError(e);
    else
      future_->markCompleted(c10::IValue(outputs_));
  }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// The text of an exception without c10's backtrace, first line only.
std::string first_line(const std::exception& e) {
  auto* ce = dynamic_cast<const c10::Error*>(&e);
  std::string s = ce ? ce->what_without_backtrace() : e.what();
  return s.substr(0, s.find('\n'));
}

// "allreduce", "barrier": c10d's name of the operation.
std::string op_name(c10d::OpType type) {
  std::string name = c10d::opTypeToString(type);
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

std::string unusable(const std::string& why) {
  return detail::cat(kUnusableGroup, " (", why, "): destroy the process group and create it again, or restart the job");
}

}  // namespace

std::optional<shm::DType> shm_dtype(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || !t.is_contiguous() || t.is_sparse()) return std::nullopt;
  switch (t.scalar_type()) {
    case at::kFloat:
      return shm::DType::F32;
    case at::kDouble:
      return shm::DType::F64;
    case at::kHalf:
      return shm::DType::F16;
    case at::kBFloat16:
      return shm::DType::BF16;
    default:
      return std::nullopt;
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

ShmProcessGroup::ShmProcessGroup(int rank, int size, compat::BackendPtr gloo, std::unique_ptr<shm::Comm> local,
                                 compat::BackendPtr leaders, ShmTopology topo, std::vector<int> labels)
    : compat::Backend(rank, size),
      gloo_(std::move(gloo)),
      local_(std::move(local)),
      leaders_(std::move(leaders)),
      topo_(std::move(topo)),
      labels_(std::move(labels)) {
  if (local_) {
    p2p_ = make_p2p(local_);
    // The collectives' waits move point-to-point on (Comm::set_idle). Weak: the Comm outlives the
    // P2p that holds it.
    local_->set_idle([w = std::weak_ptr<shm::P2p>(p2p_)] {
      if (auto p = w.lock()) p->progress();
    });
  }
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

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::enqueue(std::vector<at::Tensor> outputs, c10d::OpType type,
                                                        std::function<void()> job) {
  auto work = c10::make_intrusive<ShmWork>(std::move(outputs), type);
  // Note [Broken groups]: on a broken group a call fails at once, without queueing behind others.
  if (std::string why = broken(); !why.empty()) {
    work->complete(std::make_exception_ptr(std::runtime_error(unusable(why))));
    return work;
  }
  auto task = [this, work, type, job = std::move(job)] {
    std::exception_ptr error;
    try {
      // Queued before the group broke: fail without touching the transports.
      if (std::string why = broken(); !why.empty()) throw std::runtime_error(unusable(why));
      job();
    } catch (const CallMismatch&) {
      error = std::current_exception();  // no data moved: the group stays usable
    } catch (const std::exception& e) {
      error = std::current_exception();
      mark_broken(detail::cat("rank ", labels_.at(rank_), ": ", op_name(type), " failed: ", first_line(e)));
    } catch (...) {
      error = std::current_exception();
      mark_broken(detail::cat("rank ", labels_.at(rank_), ": ", op_name(type), " failed"));
    }
    work->complete(error);
  };
  std::unique_lock<std::mutex> lock(mu_);
  if (caller_waits_at_once() && pending_ == 0) {  // Note [Inline blocking collectives]
    ++pending_;                                   // later calls queue behind this one and the worker waits for exec_mu_
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

// Note [Broken groups]: a collective that fails once data may have moved (a transport error, a
// timeout, a rank that died, calls that differ over shared memory, where the check comes after the
// first copy) leaves the ranks at different points of it; what they would exchange next is
// undefined, and Gloo's barrier would even rethrow the old failure on some ranks only. So, as
// PyTorch 2.x aborts a failed communicator, the group is marked broken: every later call on it fails
// at once, on this rank and (through the segment's abort flag) on every rank of this host, with one
// line that carries the first failure. A rank on another host learns it when its own next exchange
// with a broken rank fails (Gloo's error, or the timeout). Failures found before anything is sent
// leave the group usable, on every rank alike: a call the backend cannot run (rejected by the front
// end, comm::unsupported), a DTRAIN_DEBUG=DETAIL mismatch, and a mismatch caught by the guard of
// Note [Guarded Gloo collectives] (CallMismatch).
std::string ShmProcessGroup::broken() const {
  {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (!broken_.empty()) return broken_;
  }
  return local_ ? local_->failure() : std::string();
}

void ShmProcessGroup::mark_broken(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (!broken_.empty()) return;
    broken_ = why;
  }
  if (local_) local_->abort(why);  // a no-op when the segment already failed
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  if (tensors.size() != 1 || !shm_reduces(tensors[0], opts.reduceOp, /*all=*/true))
    return on_gloo(tensors, c10d::OpType::ALLREDUCE, call_of(kAllReduce, tensors, -1, &opts.reduceOp), opts.timeout,
                   [this, tensors, opts]() mutable { return gloo_->allreduce(tensors, opts); });
  at::Tensor t = tensors[0];
  return enqueue({t}, c10d::OpType::ALLREDUCE, [this, t, d = *shm_dtype(t), o = *shm_op(opts.reduceOp), opts] {
    // Hierarchical: reduce inside the host, then across host leaders, then spread inside the host.
    if (local_) local_->all_reduce(t.data_ptr(), static_cast<size_t>(t.numel()), d, o);
    if (leaders_) {
      try {
        // Gloo 1.13 cannot all-reduce bfloat16: the leaders exchange float32 and round once.
        std::vector<at::Tensor> v{d == shm::DType::BF16 ? t.to(at::kFloat) : t};
        agree(*leaders_, topo_.host_index, topo_.leader_labels, call_of(kAllReduce, v, -1, &opts.reduceOp),
              opts.timeout);
        leaders_->allreduce(v, opts)->wait();
        if (!v[0].is_same(t)) t.copy_(v[0]);
      } catch (const std::exception& e) {
        // The host's other ranks wait in the broadcast below: fail them too, now.
        if (local_)
          local_->abort(detail::cat("rank ", rank_, " (host leader): all_reduce between hosts failed: ", e.what()));
        throw;
      }
    }
    if (local_ && topo_.hosts > 1) local_->broadcast(t.data_ptr(), t.numel() * t.element_size(), topo_.leader_local);
  });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  if (tensors.size() != 1 || opts.rootTensor != 0 || !shm_moves(tensors[0]))
    return on_gloo(tensors, c10d::OpType::BROADCAST, call_of(kBroadcast, tensors, opts.rootRank), opts.timeout,
                   [this, tensors, opts]() mutable { return gloo_->broadcast(tensors, opts); });
  at::Tensor t = tensors[0];
  const int root = static_cast<int>(opts.rootRank);  // one host: local index == group rank
  return enqueue({t}, c10d::OpType::BROADCAST,
                 [this, t, root] { local_->broadcast(t.data_ptr(), t.numel() * t.element_size(), root); });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  bool ok =
      inputs.size() == 1 && outputs.size() == 1 && shm_moves(inputs[0]) && static_cast<int>(outputs[0].size()) == size_;
  if (ok)
    for (const auto& o : outputs[0])
      ok = ok && plain_cpu(o) && o.scalar_type() == inputs[0].scalar_type() && o.numel() == inputs[0].numel();
  if (!ok)
    return on_gloo(outputs.empty() ? std::vector<at::Tensor>{} : outputs[0], c10d::OpType::ALLGATHER,
                   call_of(kAllGather, inputs), opts.timeout,
                   [this, outputs, inputs, opts]() mutable { return gloo_->allgather(outputs, inputs, opts); });
  at::Tensor in = inputs[0];
  std::vector<at::Tensor> outs = outputs[0];
  return enqueue(outs, c10d::OpType::ALLGATHER, [this, in, outs] {
    std::vector<void*> ptrs;
    for (const auto& o : outs) ptrs.push_back(o.data_ptr());
    local_->all_gather(in.data_ptr(), in.numel() * in.element_size(), ptrs.data());
  });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::barrier(const c10d::BarrierOptions& opts) {
  // Like Gloo's barrier, it completes after this rank's earlier collectives: the queue runs them in
  // order, each to its end.
  if (topo_.hosts == 1 && local_) return enqueue({}, c10d::OpType::BARRIER, [this] { local_->barrier(); });
  // Gloo: the check's all-gather is the barrier (no rank finishes it before every rank has joined).
  return on_gloo({}, c10d::OpType::BARRIER, call_of(kBarrier, {}), opts.timeout, nullptr);
}

bool has_shared_memory_segment(const compat::BackendPtr& pg) {
  auto* s = dynamic_cast<ShmProcessGroup*>(pg.get());
  return s && s->has_local();
}

bool shm_group_unsupported(const compat::BackendPtr& pg, c10d::OpType type, const at::Tensor& t,
                           const c10d::ReduceOp& op, std::string* why_not) {
  auto* s = dynamic_cast<ShmProcessGroup*>(pg.get());
  if (!s) return false;
  *why_not = s->unsupported(type, t, op);
  return true;
}

}  // namespace dtrain::comm
