// ShmProcessGroup's guard for the collectives it hands to Gloo (Note [Guarded Gloo collectives]):
// the ranks exchange a fixed-size description of each call before Gloo starts it; and the
// collectives that always run on Gloo.
#include <ATen/ATen.h>

#include <cstring>

#include "comm/shm/shm_pg_impl.h"
#include "dtrain/errors.h"

namespace dtrain::comm {
namespace {

// Note [Guarded Gloo collectives]: Gloo's TCP transport checks on its own I/O thread that an
// incoming message fits the buffer posted for it. Ranks that pass different sizes to a collective
// therefore make Gloo throw where no caller can catch it (std::terminate: the process dies of
// SIGABRT), or, when the message is smaller, leave garbage in the output or hang. So before a
// collective starts on Gloo, the ranks all-gather a fixed-size description of it (GlooCall: an
// exchange that itself cannot mismatch; on the group's own Gloo it has room for all_to_all_single's
// splits and addresses, zeros for every other call, so that call is checked in one exchange) and
// start it only if every rank describes the same call;
// otherwise every rank throws (the caller's Work names the rank and the operation) and no data has
// moved, so the group stays usable. The exchange and the collective run in the queue's order (the
// worker, or the caller for a blocking call): Gloo numbers its collectives as they start, so every
// rank must start them in the same order. Point-to-point needs no check: send and recv match by tag.

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
    case kAllToAllSingle:
      return "all_to_all_single";
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

GlooCall call_of(GlooCallKind kind, const std::vector<at::Tensor>& ts, int64_t root, const c10d::ReduceOp* op) {
  GlooCall c;
  c.op = kind;
  c.dtype = ts.empty() || !ts[0].defined() ? -1 : static_cast<int64_t>(ts[0].scalar_type());
  c.count = numel(ts);
  c.root = root;
  c.redop = op ? static_cast<int64_t>(op->op_) : -1;
  return c;
}

std::vector<at::Tensor> ShmProcessGroup::exchange(compat::Backend& pg, const at::Tensor& mine,
                                                  std::chrono::milliseconds timeout) {
  std::vector<at::Tensor> all;
  for (int r = 0; r < pg.getSize(); ++r) all.push_back(at::empty_like(mine));
  if (&pg == gloo().get() && local_ && topo_.hosts == 1) {
    // One host: the segment carries the exchange (microseconds instead of a TCP round trip).
    std::vector<void*> outs;
    for (auto& t : all) outs.push_back(t.data_ptr());
    local_->all_gather(mine.data_ptr(), mine.nbytes(), outs.data());
  } else {
    std::vector<std::vector<at::Tensor>> out{all};
    std::vector<at::Tensor> in{mine};
    c10d::AllgatherOptions opts;
    opts.timeout = timeout;
    pg.allgather(out, in, opts)->wait();
  }
  return all;
}

size_t ShmProcessGroup::call_tail(const compat::Backend& pg) const {
  return &pg == gloo().get() ? 2 * static_cast<size_t>(size_) + 3 : 0;
}

std::vector<at::Tensor> ShmProcessGroup::agree(compat::Backend& pg, int me, const std::vector<int>& labels,
                                               const GlooCall& call, std::chrono::milliseconds timeout,
                                               const std::vector<int64_t>& tail) {
  constexpr int64_t kFields = sizeof(GlooCall) / sizeof(int64_t);
  const int n = pg.getSize();
  const auto tail_len = static_cast<int64_t>(call_tail(pg));
  // Every rank exchanges the same size whatever it calls, so the exchange itself cannot mismatch.
  DTRAIN_ASSERT(static_cast<int64_t>(tail.size()) <= tail_len, "a call's tail longer than the group's");
  at::Tensor mine = at::zeros({kFields + tail_len}, at::kLong);
  std::memcpy(mine.data_ptr(), &call, sizeof(call));
  std::copy(tail.begin(), tail.end(), mine.data_ptr<int64_t>() + kFields);
  std::vector<at::Tensor> all = exchange(pg, mine, timeout);
  for (int r = 0; r < n; ++r) {
    GlooCall theirs;
    std::memcpy(&theirs, all[r].data_ptr(), sizeof(theirs));
    if (std::memcmp(&theirs, &call, sizeof(call)) == 0) continue;
    // Not a dtrain::Error: dtrain::Work prefixes it with the rank, the operation and the group.
    throw CallMismatch(
        detail::cat("mismatched collectives over Gloo: rank ", labels.at(me), " calls ", describe(call, labels),
                    " but rank ", labels.at(r), " calls ", describe(theirs, labels),
                    ": every rank must call the same collectives in the same order with the same shapes and dtypes"));
  }
  for (auto& t : all) t = t.narrow(0, kFields, tail_len);
  return all;
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::on_gloo(std::vector<at::Tensor> outputs, c10d::OpType type,
                                                        GlooCall call, std::chrono::milliseconds timeout,
                                                        std::function<c10::intrusive_ptr<c10d::Work>()> start) {
  GlooStart with_table;
  if (start) with_table = [start = std::move(start)](const std::vector<at::Tensor>&) { return start(); };
  return on_gloo(std::move(outputs), type, call, {}, timeout, std::move(with_table));
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::on_gloo(std::vector<at::Tensor> outputs, c10d::OpType type,
                                                        GlooCall call, std::vector<int64_t> tail,
                                                        std::chrono::milliseconds timeout, GlooStart start) {
  return enqueue(std::move(outputs), type, [this, call, tail = std::move(tail), timeout, start = std::move(start)] {
    const std::vector<at::Tensor> tails = agree(*gloo(), rank_, labels_, call, timeout, tail);  // not broken: checked
    // Every rank agreed on the count: with nothing to move, Gloo is not asked at all (its all_gather
    // divides by the element count and kills the process with SIGFPE on empty tensors).
    if (!start || call.count == 0) return;
    if (const auto work = start(tails)) work->wait();  // null: the job moved the data itself
  });
}

// The rest always runs on Gloo, checked first (Note [Guarded Gloo collectives]).
#define DTRAIN_ON_GLOO(outputs, type, call, timeout, ...) \
  return on_gloo(outputs, c10d::OpType::type, call, timeout, [=, gloo = gloo()]() mutable { return gloo->__VA_ARGS__; })

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allreduce_coalesced(std::vector<at::Tensor>& t,
                                                                    const c10d::AllreduceCoalescedOptions& o) {
  DTRAIN_ON_GLOO(t, ALLREDUCE_COALESCED, call_of(kAllReduce, t, -1, &o.reduceOp), o.timeout, allreduce_coalesced(t, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allgather_base_on_gloo(at::Tensor& out, at::Tensor& in,
                                                                       const c10d::AllgatherOptions& o) {
  DTRAIN_ON_GLOO({out}, _ALLGATHER_BASE, call_of(kAllGather, {in}), o.timeout, _allgather_base(out, in, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allgather_coalesced(std::vector<std::vector<at::Tensor>>& out,
                                                                    std::vector<at::Tensor>& in,
                                                                    const c10d::AllgatherOptions& o) {
  DTRAIN_ON_GLOO({}, ALLGATHER_COALESCED, call_of(kAllGather, in), o.timeout, allgather_coalesced(out, in, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::reduce_scatter(std::vector<at::Tensor>& out,
                                                               std::vector<std::vector<at::Tensor>>& in,
                                                               const c10d::ReduceScatterOptions& o) {
  DTRAIN_ON_GLOO(out, REDUCE_SCATTER, call_of(kReduceScatter, out, -1, &o.reduceOp), o.timeout,
                 reduce_scatter(out, in, o));
}
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::reduce_scatter_base_on_gloo(at::Tensor& out, at::Tensor& in,
                                                                            const c10d::ReduceScatterOptions& o) {
  DTRAIN_ON_GLOO({out}, _REDUCE_SCATTER_BASE, call_of(kReduceScatter, {out}, -1, &o.reduceOp), o.timeout,
                 _reduce_scatter_base(out, in, o));
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
  enqueue({}, c10d::OpType::BARRIER, [this, o, wait_all_ranks] {
    gloo()->monitoredBarrier(o, wait_all_ranks);
  })->wait();
}
// A broken group has no Gloo left (Note [Broken groups]); its calls fail on their own.
void ShmProcessGroup::setSequenceNumberForGroup() {
  if (auto g = gloo()) g->setSequenceNumberForGroup();
}
uint64_t ShmProcessGroup::getSequenceNumberForGroup() {
  auto g = gloo();
  return g ? g->getSequenceNumberForGroup() : 0;
}

}  // namespace dtrain::comm
