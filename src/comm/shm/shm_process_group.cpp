#include "comm/shm/shm_pg_impl.h"
#include "comm/shm/shm_process_group.h"
#include "comm/call_hint.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

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

// Note [Guarded Gloo collectives]: Gloo's TCP transport checks on its own I/O thread that an
// incoming message fits the buffer posted for it. Ranks that pass different sizes to a collective
// therefore make Gloo throw where no caller can catch it (std::terminate: the process dies of
// SIGABRT), or, when the message is smaller, leave garbage in the output or hang. So before a
// collective starts on Gloo, the ranks all-gather a fixed-size description of it (GlooCall: an
// exchange that itself cannot mismatch) and start it only if every rank describes the same call;
// otherwise every rank throws (the caller's Work names the rank and the operation) and no data has
// moved, so the group stays usable. The exchange and the collective run in the queue's order (the
// worker, or the caller for a blocking call): Gloo numbers its collectives as they start, so every
// rank must start them in the same order. Point-to-point needs no check: send and recv match by tag.
enum GlooCallKind : int64_t {
  kAllReduce = 1,
  kBroadcast,
  kReduce,
  kAllGather,
  kGather,
  kScatter,
  kReduceScatter,
  kAllToAll,
  kBarrier
};

const char* kind_name(int64_t k) {
  switch (k) {
    case kAllReduce:
      return "all_reduce";
    case kBroadcast:
      return "broadcast";
    case kReduce:
      return "reduce";
    case kAllGather:
      return "all_gather";
    case kGather:
      return "gather";
    case kScatter:
      return "scatter";
    case kReduceScatter:
      return "reduce_scatter";
    case kAllToAll:
      return "all_to_all";
    case kBarrier:
      return "barrier";
  }
  return "an unknown collective";
}

const char* redop_name(int64_t op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
      return "SUM";
    case c10d::ReduceOp::AVG:
      return "AVG";
    case c10d::ReduceOp::PRODUCT:
      return "PRODUCT";
    case c10d::ReduceOp::MIN:
      return "MIN";
    case c10d::ReduceOp::MAX:
      return "MAX";
    case c10d::ReduceOp::BAND:
      return "BAND";
    case c10d::ReduceOp::BOR:
      return "BOR";
    case c10d::ReduceOp::BXOR:
      return "BXOR";
  }
  return "?";
}

int64_t numel(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts) n += t.numel();
  return n;
}

GlooCall call_of(GlooCallKind kind, const std::vector<at::Tensor>& ts, int64_t root = -1,
                 const c10d::ReduceOp* op = nullptr) {
  GlooCall c;
  c.op = kind;
  c.dtype = ts.empty() || !ts[0].defined() ? -1 : static_cast<int64_t>(ts[0].scalar_type());
  c.count = numel(ts);
  c.root = root;
  c.redop = op ? static_cast<int64_t>(op->op_) : -1;
  return c;
}

// "all_reduce of 4 Float elements (SUM)", "broadcast of 5 Float elements with root rank 1"
std::string describe(const GlooCall& c, const std::vector<int>& labels) {
  std::string s = kind_name(c.op);
  if (c.dtype >= 0 && c.dtype < static_cast<int64_t>(c10::ScalarType::NumOptions)) {
    const char* dtype = c10::toString(static_cast<c10::ScalarType>(c.dtype));
    s += c.count >= 0 ? detail::cat(" of ", c.count, " ", dtype, " elements") : detail::cat(" of ", dtype);
  }
  if (c.root >= 0)
    s += detail::cat(" with root rank ", c.root < static_cast<int64_t>(labels.size()) ? labels[c.root] : c.root);
  if (c.redop >= 0) s += detail::cat(" (", redop_name(c.redop), ")");
  return s;
}

}  // namespace

ShmProcessGroup::ShmProcessGroup(int rank, int size, compat::BackendPtr gloo, std::unique_ptr<shm::Comm> local,
                                 compat::BackendPtr leaders, ShmTopology topo, std::vector<int> labels)
    : compat::Backend(rank, size),
      gloo_(std::move(gloo)),
      local_(std::move(local)),
      leaders_(std::move(leaders)),
      topo_(std::move(topo)),
      labels_(std::move(labels)) {
  if (local_) p2p_ = make_p2p(local_);
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

void ShmProcessGroup::agree(compat::Backend& pg, int me, const std::vector<int>& labels, const GlooCall& call,
                            std::chrono::milliseconds timeout) {
  constexpr int64_t kFields = sizeof(GlooCall) / sizeof(int64_t);
  const int n = pg.getSize();
  at::Tensor mine = at::empty({kFields}, at::kLong);
  std::memcpy(mine.data_ptr(), &call, sizeof(call));
  std::vector<at::Tensor> all;
  for (int r = 0; r < n; ++r) all.push_back(at::empty({kFields}, at::kLong));
  if (&pg == gloo_.get() && local_ && topo_.hosts == 1) {
    // One host: the segment carries the exchange (microseconds instead of a TCP round trip).
    std::vector<void*> outs;
    for (auto& t : all) outs.push_back(t.data_ptr());
    local_->all_gather(mine.data_ptr(), sizeof(call), outs.data());
  } else {
    std::vector<std::vector<at::Tensor>> out{all};
    std::vector<at::Tensor> in{mine};
    c10d::AllgatherOptions opts;
    opts.timeout = timeout;
    pg.allgather(out, in, opts)->wait();
  }
  for (int r = 0; r < n; ++r) {
    GlooCall theirs;
    std::memcpy(&theirs, all[r].data_ptr(), sizeof(theirs));
    if (std::memcmp(&theirs, &call, sizeof(call)) == 0) continue;
    // Not a dtrain::Error: dtrain::Work prefixes it with the rank, the operation and the group.
    throw std::runtime_error(
        detail::cat("mismatched collectives over Gloo: rank ", labels.at(me), " calls ", describe(call, labels),
                    " but rank ", labels.at(r), " calls ", describe(theirs, labels),
                    ": every rank must call the same collectives in the same order with the same shapes and dtypes"));
  }
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::on_gloo(std::vector<at::Tensor> outputs, c10d::OpType type,
                                                        GlooCall call, std::chrono::milliseconds timeout,
                                                        std::function<c10::intrusive_ptr<c10d::Work>()> start) {
  return enqueue(std::move(outputs), type, [this, call, timeout, start = std::move(start)] {
    agree(*gloo_, rank_, labels_, call, timeout);
    if (start) start()->wait();
  });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  auto dtype = tensors.size() == 1 ? shm_dtype(tensors[0]) : std::nullopt;
  auto op = shm_op(opts.reduceOp);
  if (!dtype || !op || (!local_ && !leaders_))
    return on_gloo(tensors, c10d::OpType::ALLREDUCE, call_of(kAllReduce, tensors, -1, &opts.reduceOp), opts.timeout,
                   [this, tensors, opts]() mutable { return gloo_->allreduce(tensors, opts); });
  at::Tensor t = tensors[0];
  return enqueue({t}, c10d::OpType::ALLREDUCE, [this, t, d = *dtype, o = *op, opts] {
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
  if (topo_.hosts > 1 || !local_ || tensors.size() != 1 || !plain_cpu(tensors[0]) || opts.rootTensor != 0)
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
  bool ok = topo_.hosts == 1 && local_ && inputs.size() == 1 && outputs.size() == 1 && plain_cpu(inputs[0]) &&
            static_cast<int>(outputs[0].size()) == size_;
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

// The rest always runs on Gloo, checked first (Note [Guarded Gloo collectives]).
#define DTRAIN_ON_GLOO(outputs, type, call, timeout, ...) \
  return on_gloo(outputs, c10d::OpType::type, call, timeout, [=, gloo = gloo_]() mutable { return gloo->__VA_ARGS__; })

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allreduce_coalesced(std::vector<at::Tensor>& t,
                                                                    const c10d::AllreduceCoalescedOptions& o) {
  DTRAIN_ON_GLOO(t, ALLREDUCE_COALESCED, call_of(kAllReduce, t, -1, &o.reduceOp), o.timeout, allreduce_coalesced(t, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) {
  DTRAIN_ON_GLOO(t, REDUCE, call_of(kReduce, t, o.rootRank, &o.reduceOp), o.timeout, reduce(t, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::_allgather_base(at::Tensor& out, at::Tensor& in,
                                                                const c10d::AllgatherOptions& o) {
  DTRAIN_ON_GLOO({out}, _ALLGATHER_BASE, call_of(kAllGather, {in}), o.timeout, _allgather_base(out, in, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allgather_coalesced(std::vector<std::vector<at::Tensor>>& out,
                                                                    std::vector<at::Tensor>& in,
                                                                    const c10d::AllgatherOptions& o) {
  DTRAIN_ON_GLOO({}, ALLGATHER_COALESCED, call_of(kAllGather, in), o.timeout, allgather_coalesced(out, in, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::gather(std::vector<std::vector<at::Tensor>>& out,
                                                       std::vector<at::Tensor>& in, const c10d::GatherOptions& o) {
  DTRAIN_ON_GLOO(out.empty() ? std::vector<at::Tensor>{} : out[0], GATHER, call_of(kGather, in, o.rootRank), o.timeout,
                 gather(out, in, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::scatter(std::vector<at::Tensor>& out,
                                                        std::vector<std::vector<at::Tensor>>& in,
                                                        const c10d::ScatterOptions& o) {
  DTRAIN_ON_GLOO(out, SCATTER, call_of(kScatter, out, o.rootRank), o.timeout, scatter(out, in, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::reduce_scatter(std::vector<at::Tensor>& out,
                                                               std::vector<std::vector<at::Tensor>>& in,
                                                               const c10d::ReduceScatterOptions& o) {
  DTRAIN_ON_GLOO(out, REDUCE_SCATTER, call_of(kReduceScatter, out, -1, &o.reduceOp), o.timeout,
                 reduce_scatter(out, in, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::_reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                                     const c10d::ReduceScatterOptions& o) {
  DTRAIN_ON_GLOO({out}, _REDUCE_SCATTER_BASE, call_of(kReduceScatter, {out}, -1, &o.reduceOp), o.timeout,
                 _reduce_scatter_base(out, in, o));
}
// all_to_all: ranks may legitimately send different amounts, so only the operation and dtype are
// checked (count -1).
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& os,
                                                              std::vector<int64_t>& is,
                                                              const c10d::AllToAllOptions& o) {
  GlooCall c = call_of(kAllToAll, {in});
  c.count = -1;
  DTRAIN_ON_GLOO({out}, ALLTOALL_BASE, c, o.timeout, alltoall_base(out, in, os, is, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                                         const c10d::AllToAllOptions& o) {
  GlooCall c = call_of(kAllToAll, in);
  c.count = -1;
  DTRAIN_ON_GLOO(out, ALLTOALL, c, o.timeout, alltoall(out, in, o));
}
#undef DTRAIN_ON_GLOO

// Queued, unchecked (it exists to report the ranks that do not come, within its own timeout): Gloo
// numbers it among the collectives, which start on the worker in the queue's order.
void ShmProcessGroup::monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) {
  enqueue({}, c10d::OpType::BARRIER, [this, o, wait_all_ranks] { gloo_->monitoredBarrier(o, wait_all_ranks); })->wait();
}
void ShmProcessGroup::setSequenceNumberForGroup() { gloo_->setSequenceNumberForGroup(); }
uint64_t ShmProcessGroup::getSequenceNumberForGroup() { return gloo_->getSequenceNumberForGroup(); }

bool has_shared_memory_segment(const compat::BackendPtr& pg) {
  auto* s = dynamic_cast<ShmProcessGroup*>(pg.get());
  return s && s->has_local();
}

}  // namespace dtrain::comm
