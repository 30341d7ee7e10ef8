#include "comm/shm/shm_pg_impl.h"
#include "comm/shm/shm_process_group.h"
#include "comm/capabilities.h"
#include "comm/gloo_backend.h"

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

// Where the first rank to break the group leaves its line, in the group's store (Note [Broken groups]).
constexpr const char kBrokenKey[] = "broken";

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

ShmProcessGroup::ShmProcessGroup(int rank, int size, ShmGroupParts parts)
    : compat::Backend(rank, size),
      gloo_(std::move(parts.gloo)),
      local_(std::move(parts.local)),
      leaders_(std::move(parts.leaders)),
      topo_(std::move(parts.topo)),
      labels_(std::move(parts.labels)),
      store_(std::move(parts.store)) {
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
  auto task = [this, work, type, job = std::move(job)]() mutable { work->complete(run_job(type, job)); };
  if (caller_waits_at_once() && run_here_if_idle(task)) return work;  // Note [Inline blocking collectives]
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++pending_;
    queue_.emplace_back(std::move(task));
  }
  cv_.notify_one();
  return work;
}

// Note [Inline blocking collectives]: runs `task` (which does not throw) on this thread when nothing
// is queued; later calls queue behind it and the worker waits for exec_mu_. False: nothing ran.
template <class Task>
bool ShmProcessGroup::run_here_if_idle(Task& task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (pending_ != 0) return false;
    ++pending_;
  }
  {
    std::lock_guard<std::mutex> exec(exec_mu_);
    task();
  }
  std::lock_guard<std::mutex> lock(mu_);
  --pending_;
  return true;
}

template <class Job>
std::exception_ptr ShmProcessGroup::run_job(c10d::OpType type, Job& job) {
  try {
    // Queued before the group broke: fail without touching the transports.
    if (std::string why = broken(); !why.empty()) throw std::runtime_error(unusable(why));
    job();
    return nullptr;
  } catch (const CallMismatch&) {
    return std::current_exception();  // no data moved: the group stays usable
  } catch (const std::exception& e) {
    const std::string mine = detail::cat("rank ", labels_.at(rank_), ": ", op_name(type), " failed: ", first_line(e));
    const std::string first = mark_broken(mine);
    // Another rank broke the group first (every line starts with the rank that wrote it): what
    // failed here ("Connection closed by peer", the segment's abort) is its consequence, so the
    // call says what broke the group. This rank's own failure keeps its words (a timeout, say).
    const bool mine_first = first.rfind(detail::cat("rank ", labels_.at(rank_), ":"), 0) == 0;
    return mine_first ? std::current_exception() : std::make_exception_ptr(std::runtime_error(unusable(first)));
  } catch (...) {
    mark_broken(detail::cat("rank ", labels_.at(rank_), ": ", op_name(type), " failed"));
    return std::current_exception();
  }
}

// A blocking call's job run here when nothing is queued (run_here_if_idle), failing as run_job
// fails it; false: nothing ran.
template <class Job>
bool ShmProcessGroup::run_inline(c10d::OpType type, Job& job) {
  std::exception_ptr error;
  auto task = [&] { error = run_job(type, job); };
  if (!run_here_if_idle(task)) return false;
  if (error) std::rethrow_exception(error);
  return true;
}

// Note [Inline blocking collectives], without the c10d Work, its Future and their allocations (a
// blocking all-reduce of DDP's last bucket pays them every step): the same job as allreduce()'s on
// one host, the same failures, the same queue discipline (only when nothing is queued).
bool ShmProcessGroup::all_reduce_here(at::Tensor& t, const c10d::ReduceOp& op) {
  if (!local_ || topo_.hosts != 1 || !shm_reduces(t, op, /*all=*/true)) return false;
  auto job = [&] { local_->all_reduce(t.data_ptr(), static_cast<size_t>(t.numel()), *shm_dtype(t), *shm_op(op)); };
  return run_inline(c10d::OpType::ALLREDUCE, job);
}

// The gradients of DDP's last bucket, in place: one float32 or float64 all-reduce over the segment,
// read from and written to the tensors themselves (Comm::all_reduce_divided). Anything else (another
// dtype, a tensor that is not a plain CPU one, mixed dtypes, more than one host) does nothing.
bool ShmProcessGroup::all_reduce_divided_here(std::vector<at::Tensor>& ts, int64_t divisor) {
  if (!local_ || topo_.hosts != 1 || ts.empty() || divisor <= 0) return false;
  const auto dtype = shm_dtype(ts[0]);
  if (!dtype || (*dtype != shm::DType::F32 && *dtype != shm::DType::F64)) return false;
  std::vector<shm::Comm::Piece> pieces;
  pieces.reserve(ts.size());
  for (auto& t : ts) {
    if (shm_dtype(t) != dtype) return false;
    pieces.push_back({t.data_ptr(), static_cast<size_t>(t.numel())});
  }
  auto job = [&] { local_->all_reduce_divided(pieces.data(), pieces.size(), *dtype, static_cast<double>(divisor)); };
  return run_inline(c10d::OpType::ALLREDUCE, job);
}

// Note [Broken groups]: a collective that fails once data may have moved (a transport error, a
// timeout, a rank that died, calls that differ over shared memory, where the check comes after the
// first copy) leaves the ranks at different points of it; what they would exchange next is
// undefined, and Gloo's barrier would even rethrow the old failure on some ranks only. So, as
// PyTorch 2.x aborts a failed communicator, the group is marked broken, and every rank learns it
// within milliseconds, not at its timeout:
//   1. The rank that fails first leaves its line ("rank 2: allreduce failed: Timed out ...") in the
//      group's store under kBrokenKey (compare-and-set: the first rank to fail wins), before it
//      closes anything, so every rank that comes to look finds it.
//   2. It sets the segment's abort flag: the ranks of its host fail their current and next calls
//      over shared memory at once.
//   3. It drops its Gloo groups (the group's and, on a host leader, the leaders'): the connections
//      close, so a peer's next Gloo call fails at once ("Connection closed by peer") instead of
//      waiting for the timeout. A peer already waiting inside a Gloo collective is not always
//      released: in a ring it may be waiting on another rank, which never comes; it then fails at
//      its own timeout, and still reports the first failure (tests/dist/broken_group_test.cpp, 3
//      ranks: the rank in between waited for its timeout; the late rank failed at once).
//   4. A rank whose call fails by 2 or 3 runs the same steps: step 1 hands it the first rank's line,
//      which its call reports, and its own steps 2 and 3 pass the news on (a rank that exchanges
//      only with it, another host's ranks behind their leader).
// After that every call on the group fails at once, on every rank, with one line that carries the
// first failure (the rank, the operation, what went wrong); the same line ends a call that was
// waiting. The steps cost nothing while the group
// is healthy: the store is touched only on failure. A rank that neither calls nor waits on the
// group learns it at its next call. Point-to-point between two ranks that have not failed yet still
// runs until one of them fails a call; a rank that died without a word leaves no line in the
// store, and the first rank to see its connection close names itself and that error. Failures
// found before anything is sent leave the group usable, on every rank alike: a call the backend
// cannot run (rejected by the front end, Capabilities::unsupported), a DTRAIN_DEBUG=DETAIL mismatch, and a
// mismatch caught by the guard of Note [Guarded Gloo collectives] (CallMismatch).
std::string ShmProcessGroup::broken() const {
  {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (!broken_.empty()) return broken_;
  }
  return local_ ? local_->failure() : std::string();
}

std::string ShmProcessGroup::mark_broken(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (!broken_.empty()) return broken_;
  }
  // Step 1. A rank of this host that failed first left its line in the segment; the store has the
  // group's (and, were the store gone, this rank's own line still breaks the group).
  std::string first = local_ && !local_->failure().empty() ? local_->failure() : why;
  if (store_) {
    try {
      const std::vector<uint8_t> mine(first.begin(), first.end());
      const std::vector<uint8_t> stored = store_->compareSet(kBrokenKey, {}, mine);
      if (!stored.empty()) first.assign(stored.begin(), stored.end());
    } catch (const std::exception&) {
      // The store is unreachable (its host died): the line stays this rank's own. No exception may
      // leave the worker thread.
    }
  }
  {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (!broken_.empty()) return broken_;
    broken_ = first;
  }
  if (local_) local_->abort(first);  // step 2; a no-op when the segment already failed
  // Step 3. The closures of this job and of queued ones may hold copies of the Gloo group (the calls
  // of shm_gloo_guard.cpp and shm_rooted_ops.cpp); the queued ones fail before using it, and the
  // connections close when the last closure is dropped, right after its job.
  compat::BackendPtr gloo, leaders;
  {
    std::lock_guard<std::mutex> lock(gloo_mu_);
    gloo = std::move(gloo_);
    leaders = std::move(leaders_);
  }
  gloo.reset();  // ~ProcessGroupGloo: its queue is empty (one job at a time), its threads end
  leaders.reset();
  return first;
}

compat::BackendPtr ShmProcessGroup::gloo() const {
  std::lock_guard<std::mutex> lock(gloo_mu_);
  return gloo_;
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  if (tensors.size() != 1 || !shm_reduces(tensors[0], opts.reduceOp, /*all=*/true))
    return on_gloo(tensors, c10d::OpType::ALLREDUCE, call_of(kAllReduce, tensors, -1, &opts.reduceOp), opts.timeout,
                   [this, tensors, opts]() mutable { return gloo()->allreduce(tensors, opts); });
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
        // The host's ranks have already reduced into the segment and wait in the broadcast below:
        // even a mismatch found by agree() breaks the group now (the task's catch fails them at once).
        throw std::runtime_error(detail::cat("(host leader) all_reduce between hosts failed: ", first_line(e)));
      }
    }
    if (local_ && topo_.hosts > 1) local_->broadcast(t.data_ptr(), t.numel() * t.element_size(), topo_.leader_local);
  });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  if (tensors.size() != 1 || opts.rootTensor != 0 || !shm_moves(tensors[0]))
    return on_gloo(tensors, c10d::OpType::BROADCAST, call_of(kBroadcast, tensors, opts.rootRank), opts.timeout,
                   [this, tensors, opts]() mutable { return gloo()->broadcast(tensors, opts); });
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
                   [this, outputs, inputs, opts]() mutable { return gloo()->allgather(outputs, inputs, opts); });
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

int64_t ShmProcessGroup::exchange_sum_bytes() const { return local_ ? 0 : gloo_capabilities().exchange_sum_bytes(); }

}  // namespace dtrain::comm
