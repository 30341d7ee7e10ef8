// Collectives over one host's shared-memory segment (torch-free; the process-group layer in
// shm_process_group.h maps tensors and options onto it).
//
// Every collective is a sequence of steps over chunks of at most one slot. Step s of rank r:
//   0. Wait until every rank finished step s-2 (its gather counter), so buffer s % 2 is free.
//   1. scatter: copy the parts that the other ranks reduce into r's slot; publish the op descriptor
//      (first step of an op); counter A = s.
//   2. reduce: wait for A of every rank; check their descriptors against r's own (a mismatch fails
//      every rank with both calls named, instead of corrupting memory or hanging); reduce part r in
//      rank order 0..n-1 (so every rank gets the same bits) into r's tensor and r's slot; B = s.
//   3. gather: wait for B of every rank; copy their reduced parts into r's tensor; C = s.
// An all_reduce of at most 64 KB (and one slot) is one step with one wait instead (reduce_whole):
// every rank copies its whole tensor into its slot, A = s; waits for A of every rank, checks the
// descriptors and reduces the whole tensor in rank order from the slots into its tensor; C = s. The
// operations and operands are those of the steps above, so the bits are too.
// reduce is all_reduce whose step 3 only the root runs (the others' tensors are only read), gather
// is all_gather that only the root copies out of, scatter is broadcast of one part per rank, and
// reduce_scatter is steps 1 and 2 alone, part r being rank r's output (reduce_scatter.cpp).
// broadcast, all_gather, gather and scatter use the same counters with one copy in and one copy out.
//
// Waiting: spin briefly, then yield, then sleep on a futex (woken by the signalling rank); every
// wait checks the abort flag, the group timeout, and whether the awaited process still exists.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/shm/kernels.h"
#include "comm/shm/segment.h"

namespace dtrain::shm {

// What an operation descriptor (OpDesc::op) names; every rank checks its peers' against its own.
enum OpKind : uint32_t {
  kAllReduce = 1,
  kBroadcast = 2,
  kAllGather = 3,
  kBarrier = 4,
  kReduce = 5,
  kGather = 6,
  kScatter = 7,
  kReduceScatter = 8
};

class Comm {
 public:
  // labels[k]: the global rank of local rank k, used in error messages.
  Comm(Segment segment, int rank, std::vector<int> labels, std::chrono::milliseconds timeout);
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  void all_reduce(void* data, size_t count, DType dtype, RedOp op);
  // `count` elements at `data`.
  struct Piece {
    void* data;
    size_t count;
  };
  // SUM of `pieces` (float32 or float64) as if they were one tensor, in place: each rank's values are
  // divided by its `divisor` on their way in (DDP's average, without copying the gradients into a
  // bucket and back). Peers may call all_reduce(SUM) on their part instead, with their values already
  // divided: the descriptors are the same, and so are the bits (division, then the sum in rank order).
  void all_reduce_divided(const Piece* pieces, size_t npieces, DType dtype, double divisor);
  // The result lands in root's `data` only; the other ranks' `data` is left as it was.
  void reduce(void* data, size_t count, DType dtype, RedOp op, int root);
  void broadcast(void* data, size_t bytes, int root);
  // outs[k] receives rank k's `bytes` bytes (outs[rank] may equal in).
  void all_gather(const void* in, size_t bytes, void* const* outs);
  // `in` holds n x `count` elements; rank r's `out` receives the reduction, in rank order, of every
  // rank's part r of `in` (reduce_scatter.cpp). `out` must not overlap `in`.
  void reduce_scatter(const void* in, void* out, size_t count, DType dtype, RedOp op);
  // On root, outs[k] receives rank k's `bytes` bytes; `outs` is ignored elsewhere.
  void gather(const void* in, size_t bytes, void* const* outs, int root);
  // Rank k receives root's ins[k] (`bytes` bytes) in `out`; `ins` is ignored off the root.
  void scatter(const void* const* ins, size_t bytes, void* out, int root);
  void barrier();
  // Fails the segment for every rank (their waits throw with `message`), e.g. when this rank's part
  // of a hierarchical all-reduce failed outside shared memory. Throws nothing.
  void abort(const std::string& message);
  // Why the segment is unusable ("" while it is usable): the first failure of any rank, which
  // aborted it. Safe to call from any thread.
  std::string failure() const;

  // Called while a collective waits for a peer (after the first spin, then at least every futex
  // timeout): the point-to-point channels of the same segment move on there too, because a send
  // larger than its ring advances only while its sender runs point-to-point code, and the sender
  // may be waiting in a collective for the very rank that needs the rest of that message. Set once,
  // before any collective; must not throw or block.
  void set_idle(std::function<void()> idle) { idle_ = std::move(idle); }

  int rank() const { return rank_; }
  int size() const { return n_; }
  const std::vector<int>& labels() const { return labels_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const Segment& segment() const { return seg_; }

 private:
  enum Phase { A = 0, B = 1, C = 2 };
  // all_reduce (root -1) and reduce.
  void reduce_into(const Piece* pieces, size_t npieces, size_t count, DType dtype, RedOp op, int root, uint32_t kind,
                   double divisor);
  struct Reduction;  // one reduce_into call (comm.cpp)
  void reduce_whole(const Reduction& r, size_t done, size_t m, uint32_t s, bool first);
  void reduce_parts(const Reduction& r, size_t done, size_t m, uint32_t s, bool first);
  void check_peers_once(bool first);
  void announce(uint32_t s, bool first);
  void take_from_root(int root, uint32_t s, bool first, char* dst, size_t offset, size_t m);
  // all_gather (root -1) and gather.
  void gather_into(const void* in, size_t bytes, void* const* outs, int root, uint32_t kind);
  uint32_t begin_step();
  void signal(Phase p, uint32_t s);
  // Waits until counter p of `peer` reaches s (await_counter), and notes what that shows of its C.
  void wait_for(int peer, Phase p, uint32_t s);
  void await_counter(int peer, Phase p, uint32_t s);
  void wait_all(Phase p, uint32_t s);
  void publish(const OpDesc& d);
  void check_peer(int peer, const OpDesc& mine);
  void check_usable() const;
  [[noreturn]] void fail(const std::string& message);
  std::string describe(const OpDesc& d) const;
  int root_label(int32_t root) const;
  std::string op_name() const;

  Segment seg_;
  int rank_;
  int n_;
  std::vector<int> labels_;
  std::chrono::milliseconds timeout_;
  std::function<void()> idle_;  // set_idle
  uint32_t seq_ = 0;
  // Per peer, a value its C counter is known to have reached (seen by wait_for): begin_step loads
  // the peer's C line only when this does not already show the step it needs, which spares a 4 KB
  // all_reduce one cache miss on a line the peer has just written.
  std::vector<uint32_t> c_known_;
  uint64_t op_id_ = 0;
  OpDesc current_;
  bool broken_ = false;
};

}  // namespace dtrain::shm
