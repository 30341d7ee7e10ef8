// The one interface between comm/'s front end and a backend, beside c10d's collectives: what the
// front end (and DDP's hooks, through it) may ask or tell a backend. The lowest layer of comm/: every
// backend includes it; it includes nothing of comm/ but backend_config.h.
//
// Note [One backend interface]: a backend is a c10d process group (compat::Backend, which moves the
// bytes) and a Capabilities (which answers for it), made together by the factory (comm/backend.h)
// and kept together in the group. Like NCCL's transport table, one interface serves every
// backend: the front end never asks which backend it talks to, and a new backend (or a new fast path
// inside one) overrides a method here instead of adding a side door to the factory. The answers
// depend only on the call's arguments and facts every rank shares (the group's hosts, LibTorch's
// version), so every rank of a correct program takes the same path.
//
//   backend               moves                        answers
//   NCCL                  ProcessGroupNCCL             backend.cpp: CUDA tensors, base collectives
//   Gloo alone            ProcessGroupGloo             gloo_backend.cpp: Gloo's dtypes, exchanges
//   shared memory + Gloo  shm/ShmProcessGroup          the group itself: the segment's paths, else Gloo's
//
// Example (the front end's all_reduce, shortened):
//   if (!async_op && g.caps->all_reduce_here(t, op)) return Work();   // no Work at all
//   BlockingCallScope blocking(!async_op);
//   return Work(g.pg->allreduce(ts, opts), ...);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/backend_config.h"

namespace dtrain::comm {

class Capabilities {
 public:
  virtual ~Capabilities() = default;

  // "" when the backend can run the collective `type` on tensors like `t` with `op` (SUM when the
  // collective does not reduce); otherwise what it cannot do and the remedy, e.g. "Gloo in LibTorch
  // 1.13.0 has no BFloat16 collectives: convert the tensor ...". The front end rejects the call on
  // every rank before anything is sent (Note [Broken groups] in shm/shm_process_group.cpp says what
  // becomes of the calls that fail later).
  virtual std::string unsupported(c10d::OpType type, const at::Tensor& t, const c10d::ReduceOp& op) const = 0;

  // Whether c10d's _allgather_base (type _ALLGATHER_BASE) or _reduce_scatter_base
  // (_REDUCE_SCATTER_BASE, with `op`) runs on tensors like `t` itself; false: the front end composes
  // the collective from all_gather or all_reduce (Note [Tensor collectives on Gloo]).
  virtual bool takes_base_collective(c10d::OpType type, const at::Tensor& t, const c10d::ReduceOp& op) const = 0;

  // Whether collectives run over shared memory on this rank's host.
  virtual bool uses_shared_memory() const { return false; }

  // Whether a small collective of the group costs less than copying a few megabytes once: the
  // segment of a group on one host (a call costs microseconds), not a network's round trip (Gloo)
  // nor a kernel launch (NCCL). The same answer on every rank (fully_shard asks it:
  // Note [Collectives per parameter] in src/fsdp/unit.cpp).
  virtual bool small_calls_are_cheap() const { return false; }

  // Note [Inline blocking collectives]: all-reduces `t` in place on this thread and returns true
  // when the backend can without a c10d Work (nothing queued, a tensor and op it reduces); returns
  // false, having done nothing, otherwise. Throws the backend's failure.
  virtual bool all_reduce_here(at::Tensor& /*t*/, const c10d::ReduceOp& /*op*/) { return false; }

  // The same for `ts` as one flat tensor (float32 or float64, one dtype, plain CPU tensors), SUM of
  // every rank's values divided by its `divisor` first: DDP's average, read from and written to the
  // gradients themselves instead of a bucket. A peer may all-reduce (SUM) a flat copy of its values,
  // already divided, in the same call: the bits are the same.
  virtual bool all_reduce_divided_here(std::vector<at::Tensor>& /*ts*/, int64_t /*divisor*/) { return false; }

  // Note [Small sums as exchanges] (src/ddp/comm_hooks.cpp): the most bytes a rank may send (its
  // tensor times the number of other ranks) for which a sum costs less as point-to-point messages to
  // every other rank than as this backend's all-reduce; 0 when it never does.
  virtual int64_t exchange_sum_bytes() const { return 0; }
};

// What the factory makes: `pg` moves the bytes, `caps` answers for it. `caps` is never null and
// lives as long as `pg` (it is `pg` itself, or a backend's stateless table).
struct Backend {
  compat::BackendPtr pg;
  Capabilities* caps = nullptr;
};

// Note [Inline blocking collectives]: a caller that waits at once (async_op=false) marks the call
// with a BlockingCallScope, the one thing the front end tells a backend through c10d's calls; the
// shared-memory group then runs it on the calling thread when nothing is queued, saving two thread
// hand-offs (tens of microseconds; far more on a loaded machine). Asynchronous calls (DDP's buckets
// during backward) still run on the worker thread; DDP launches its last bucket, ready only when
// backward is done, as a blocking call. A backend may ignore the mark: the collectives are correct
// either way.
class BlockingCallScope {
 public:
  explicit BlockingCallScope(bool blocking);
  ~BlockingCallScope();
  BlockingCallScope(const BlockingCallScope&) = delete;
  BlockingCallScope& operator=(const BlockingCallScope&) = delete;

 private:
  bool previous_;
};

// Whether the innermost BlockingCallScope on this thread says the caller waits at once.
bool caller_waits_at_once();

// How a backend's error for a call on a broken group begins (Note [Broken groups] in
// shm/shm_process_group.cpp): the front end then reports the earlier failure it carries, not a
// timeout of this call.
inline constexpr const char kUnusableGroup[] = "the group is unusable since an earlier collective failed";

}  // namespace dtrain::comm
