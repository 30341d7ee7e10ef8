// ShmProcessGroup's declaration (internal to comm/shm).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/capabilities.h"
#include "comm/shm/comm.h"
#include "comm/shm/p2p.h"
#include "compat/c10d_compat.h"

namespace dtrain::comm {

struct ShmTopology {
  int hosts = 1;                   // distinct hosts in the group
  int host_index = 0;              // this rank's host, in order of first rank
  bool leader = true;              // lowest rank of its host
  int leader_local = 0;            // the leader's index among this host's ranks
  std::vector<int> leader_labels;  // the global rank of each host's leader, for error messages
  std::vector<int> host_ranks;     // the group ranks on this rank's host, in order (local rank -> group rank)
};

// What every rank must agree on before a collective starts on Gloo: a fixed number of int64, so
// that the exchange itself can never mismatch (Note [Guarded Gloo collectives]).
struct GlooCall {
  int64_t op = 0;      // GlooCallKind
  int64_t dtype = -1;  // c10::ScalarType of the tensors, -1 for none
  int64_t count = 0;   // elements this rank sends or receives per peer
  int64_t root = -1;   // group rank of the root, -1 for none
  int64_t redop = -1;  // c10d::ReduceOp, -1 for none
};

// Note [Guarded Gloo collectives] (shm_gloo_guard.cpp): the kinds a GlooCall names.
enum GlooCallKind : int64_t {
  kAllReduce = 1,
  kBroadcast,
  kReduce,
  kAllGather,
  kGather,
  kScatter,
  kReduceScatter,
  kAllToAll,
  kBarrier,
  kAllToAllSingle  // its own kind: its check carries the splits, all_to_all's does not
};
// agree()'s verdict that the ranks describe different calls: raised before any data moved, so the
// group stays usable (everything else that fails a job breaks it: Note [Broken groups]).
class CallMismatch : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

GlooCall call_of(GlooCallKind kind, const std::vector<at::Tensor>& ts, int64_t root = -1,
                 const c10d::ReduceOp* op = nullptr);

// What the segment's kernels take: a dense contiguous CPU tensor (and, to reduce, one of their dtypes
// and reduce ops).
std::optional<shm::DType> shm_dtype(const at::Tensor& t);
std::optional<shm::RedOp> shm_op(const c10d::ReduceOp& op);
bool plain_cpu(const at::Tensor& t);

// Point-to-point over `local`'s segment, naming dtypes and shapes as c10 does ("Float [4, 5]").
std::shared_ptr<shm::P2p> make_p2p(std::shared_ptr<shm::Comm> local);

// What a ShmProcessGroup is made of (make_shm_process_group builds it).
struct ShmGroupParts {
  compat::BackendPtr gloo;                // the whole group over Gloo
  std::unique_ptr<shm::Comm> local;       // this host's segment (null: alone on the host, or no shared memory)
  compat::BackendPtr leaders;             // Gloo among host leaders (null unless a leader of several hosts)
  ShmTopology topo;                       // hosts and leaders
  std::vector<int> labels;                // the global rank of each group rank, for error messages
  c10::intrusive_ptr<c10d::Store> store;  // the group's store: where the first failure is left
};

// The group answers for itself (Note [One backend interface] in comm/capabilities.h): the segment's
// paths where it has them, Gloo's answers otherwise.
class ShmProcessGroup : public compat::Backend, public Capabilities {
 public:
  ShmProcessGroup(int rank, int size, ShmGroupParts parts);
  ~ShmProcessGroup() override;

  const std::string getBackendName() const override { return "gloo"; }
  // Capabilities: decided from what every rank knows alike, so every rank gets the same answer.
  bool uses_shared_memory() const override { return local_ != nullptr; }
  bool small_calls_are_cheap() const override { return topo_.hosts == 1 && local_ != nullptr; }
  std::string unsupported(c10d::OpType type, const at::Tensor& t, const c10d::ReduceOp& op) const override;
  bool takes_base_collective(c10d::OpType type, const at::Tensor& t, const c10d::ReduceOp& op) const override;
  // A blocking all_reduce run here, without Work or Future; one host only.
  bool all_reduce_here(at::Tensor& t, const c10d::ReduceOp& op) override;
  // The same for several tensors as one, each rank's values divided by `divisor` on their way in.
  bool all_reduce_divided_here(std::vector<at::Tensor>& ts, int64_t divisor) override;
  // With a segment none (its all-reduce is fast already); without one, Gloo's.
  int64_t exchange_sum_bytes() const override;
  // Why the group is unusable ("" while it is usable): Note [Broken groups] in shm_process_group.cpp.
  std::string broken() const;

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // all_gather_into_tensor and reduce_scatter_tensor: over the segment where takes_base() says so
  // (shm_rooted_ops.cpp), on Gloo otherwise.
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& o) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& o) override;
  // Whether _allgather_base (type _ALLGATHER_BASE) or _reduce_scatter_base (_REDUCE_SCATTER_BASE,
  // with `op`) of tensors like `t` runs over the segment; the front end has checked the other
  // tensor's dtype, device, layout and size against `t`.
  bool takes_base(c10d::OpType type, const at::Tensor& t, const c10d::ReduceOp& op) const;

  // Gloo for the rest.
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& t,
                                                     const c10d::AllreduceCoalescedOptions& o) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& out,
                                                     std::vector<at::Tensor>& in,
                                                     const c10d::AllgatherOptions& o) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                        const c10d::GatherOptions& o) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                                         const c10d::ScatterOptions& o) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                                                const c10d::ReduceScatterOptions& o) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& os,
                                               std::vector<int64_t>& is, const c10d::AllToAllOptions& o) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                          const c10d::AllToAllOptions& o) override;
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override;
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& t, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& t, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& t, int tag) override;

 private:
  // This host's local rank of group rank `r`, or -1 when r is on another host or there is no segment.
  int local_rank_of(int r) const;
  // Whether the call runs over the segment (the entry points and unsupported() ask alike).
  bool shm_reduces(const at::Tensor& t, const c10d::ReduceOp& op, bool all) const;
  bool shm_moves(const at::Tensor& t) const;
  // The Gloo side of _allgather_base and _reduce_scatter_base (shm_gloo_guard.cpp).
  c10::intrusive_ptr<c10d::Work> allgather_base_on_gloo(at::Tensor& out, at::Tensor& in,
                                                        const c10d::AllgatherOptions& o);
  c10::intrusive_ptr<c10d::Work> reduce_scatter_base_on_gloo(at::Tensor& out, at::Tensor& in,
                                                             const c10d::ReduceScatterOptions& o);
  // Marks the group unusable after a failure that may have left data half moved (`why`: this
  // rank's), and tells the other ranks: the segment's abort flag, the store's key, and the Gloo
  // connections closed (Note [Broken groups]). Returns the group's first failure: `why`, or what
  // another rank left in the store before.
  std::string mark_broken(const std::string& why);
  // The group's Gloo; null once the group broke (Note [Broken groups]): the caller then fails.
  compat::BackendPtr gloo() const;
  // A point-to-point operation over the segment (Note [Shared-memory point-to-point]).
  c10::intrusive_ptr<c10d::Work> p2p(std::vector<at::Tensor>& t, int peer_local, int tag, bool is_send);

  c10::intrusive_ptr<c10d::Work> enqueue(std::vector<at::Tensor> outputs, c10d::OpType type, std::function<void()> job);
  // Runs `job` (the caller holds exec_mu_) and returns its failure, after marking the group broken
  // where it must (Note [Broken groups]).
  template <class Job>
  std::exception_ptr run_job(c10d::OpType type, Job& job);
  template <class Task>
  bool run_here_if_idle(Task& task);
  template <class Job>
  bool run_inline(c10d::OpType type, Job& job);
  // A collective on Gloo: queued, checked (agree()), then started and awaited on the worker.
  c10::intrusive_ptr<c10d::Work> on_gloo(std::vector<at::Tensor> outputs, c10d::OpType type, GlooCall call,
                                         std::chrono::milliseconds timeout,
                                         std::function<c10::intrusive_ptr<c10d::Work>()> start);
  // The same with `tail` exchanged alongside the call's description: `start` gets every rank's.
  using GlooStart = std::function<c10::intrusive_ptr<c10d::Work>(const std::vector<at::Tensor>& tails)>;
  c10::intrusive_ptr<c10d::Work> on_gloo(std::vector<at::Tensor> outputs, c10d::OpType type, GlooCall call,
                                         std::vector<int64_t> tail, std::chrono::milliseconds timeout, GlooStart start);
  // Throws unless every rank of `pg` (this rank is `me`; labels: their global ranks) describes `call`.
  // Each rank's `tail` (int64, at most call_tail(pg) of them, zeros after) travels in the same
  // exchange; returns every rank's tail, in group-rank order.
  std::vector<at::Tensor> agree(compat::Backend& pg, int me, const std::vector<int>& labels, const GlooCall& call,
                                std::chrono::milliseconds timeout, const std::vector<int64_t>& tail = {});
  // How many int64 of tail every call's check over `pg` carries: on the group's own Gloo, room for
  // all_to_all's (a_to_a_tail()), so that its check and the splits' are one exchange; none elsewhere.
  size_t call_tail(const compat::Backend& pg) const;
  // Every rank's `mine` (one size on every rank) in group-rank order: over the segment when `pg` is
  // the group's Gloo on one host, else Gloo's all_gather.
  std::vector<at::Tensor> exchange(compat::Backend& pg, const at::Tensor& mine, std::chrono::milliseconds timeout);
  // all_to_all's part of its call check (agree()'s tail): [row size, input splits (n), output
  // splits (n), pid, input address], splits as c10d reads them (empty = equal parts).
  std::vector<int64_t> a_to_a_tail(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& os,
                                   const std::vector<int64_t>& is) const;
  // all_to_all's check before anything moves: every rank's splits and row size in `tails` agree;
  // throws CallMismatch naming the first pair that does not.
  void agree_splits(const std::vector<at::Tensor>& tails) const;
  // Note [Single-copy all_to_all] (shm_all_to_all.cpp): whether every rank may write into its peers'
  // memory (probed by the first call, collective over the segment), and the exchange itself.
  bool single_copy_usable();
  void all_to_all_single_copy(const at::Tensor& out, const at::Tensor& in, const std::vector<at::Tensor>& tails);
  void run();

  mutable std::mutex gloo_mu_;  // gloo_ and leaders_ are dropped when the group breaks
  compat::BackendPtr gloo_;
  std::shared_ptr<shm::Comm> local_;
  std::shared_ptr<shm::P2p> p2p_;  // with local_; shared with the point-to-point works it hands out
  compat::BackendPtr leaders_;
  ShmTopology topo_;
  std::vector<int> labels_;
  c10::intrusive_ptr<c10d::Store> store_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  int pending_ = 0;     // queued or running jobs
  std::mutex exec_mu_;  // one job at a time on the segment (worker or inline caller)
  mutable std::mutex broken_mu_;
  std::string broken_;  // the failure that made the group unusable (Note [Broken groups])
  bool stop_ = false;
  int cma_ = -1;  // single_copy_usable(): -1 not probed yet, 0 no, 1 yes (jobs only, under exec_mu_)
  std::thread worker_;
};

}  // namespace dtrain::comm
