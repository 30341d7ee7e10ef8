// ShmProcessGroup's send, recv and recvAnysource: over the segment between ranks of one host
// (Note [Shared-memory point-to-point] in p2p.h), over Gloo otherwise.
//
// Both sides choose the transport from the pair alone (same host: shared memory), never from the
// tensor, so they always choose alike. A receive from any source needs one transport for every
// possible sender: shared memory when the whole group is on this host, Gloo when nothing is
// shared; a group that spans hosts with shared memory on this one has no such transport, and says so.
#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <algorithm>

#include "comm/shm/shm_pg_impl.h"
#include "dtrain/errors.h"

namespace dtrain::comm {
namespace {

// Completes in wait() (or isCompleted()), on the caller's thread: point-to-point has no worker.
class P2pWork : public c10d::Work {
 public:
  P2pWork(std::shared_ptr<shm::P2p> p2p, std::shared_ptr<shm::P2p::Op> op, at::Tensor tensor, c10d::OpType type,
          std::vector<int> host_ranks)
      : c10d::Work(-1, type),
        p2p_(std::move(p2p)),
        op_(std::move(op)),
        tensor_(std::move(tensor)),
        host_ranks_(std::move(host_ranks)) {}

  bool isCompleted() override { return p2p_->test(*op_); }

  bool wait(std::chrono::milliseconds /*timeout: the group's applies*/) override {
    try {
      p2p_->wait(*op_);
    } catch (...) {
      finish(std::current_exception());
      throw;
    }
    finish();
    return true;
  }

  int sourceRank() const override { return host_ranks_.at(shm::P2p::source(*op_)); }
  std::vector<at::Tensor> result() override { return {tensor_}; }

 private:
  std::shared_ptr<shm::P2p> p2p_;
  std::shared_ptr<shm::P2p::Op> op_;
  at::Tensor tensor_;  // keeps the memory the operation reads or writes alive
  std::vector<int> host_ranks_;
};

std::string describe(const shm::MsgDesc& d) {
  std::string shape = "[";
  for (int i = 0; i < d.ndim; ++i) shape += (i ? ", " : "") + std::to_string(d.sizes[i]);
  shape += "]";
  const bool known = d.dtype >= 0 && d.dtype < static_cast<int32_t>(c10::ScalarType::NumOptions);
  return detail::cat(known ? c10::toString(static_cast<c10::ScalarType>(d.dtype)) : "dtype ?", " ", shape);
}

}  // namespace

std::shared_ptr<shm::P2p> make_p2p(std::shared_ptr<shm::Comm> local) {
  return std::make_shared<shm::P2p>(std::move(local), describe);
}

int ShmProcessGroup::local_rank_of(int r) const {
  if (!p2p_ || r == rank_) return -1;
  auto it = std::find(topo_.host_ranks.begin(), topo_.host_ranks.end(), r);
  return it == topo_.host_ranks.end() ? -1 : static_cast<int>(it - topo_.host_ranks.begin());
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::p2p(std::vector<at::Tensor>& t, int peer_local, int tag, bool is_send) {
  const char* op = is_send ? "send" : "recv";
  DTRAIN_CHECK(t.size() == 1, "rank ", labels_[rank_], ": ", op, " takes one tensor, got ", t.size());
  const at::Tensor& x = t[0];
  DTRAIN_CHECK(x.defined() && x.device().is_cpu() && x.is_contiguous() && !x.is_sparse(), "rank ", labels_[rank_], ": ",
               op, " takes a dense, contiguous CPU tensor: call .contiguous() (or .cpu()) first");
  DTRAIN_CHECK(x.dim() <= shm::kMaxDims, "rank ", labels_[rank_], ": ", op, " of a tensor with ", x.dim(),
               " dimensions: point-to-point takes at most ", shm::kMaxDims, "; reshape it (and view it back)");
  shm::MsgDesc d;
  d.tag = tag;
  d.dtype = static_cast<int32_t>(x.scalar_type());
  d.ndim = static_cast<int32_t>(x.dim());
  for (int i = 0; i < d.ndim; ++i) d.sizes[i] = x.size(i);
  d.bytes = static_cast<uint64_t>(x.nbytes());
  auto handle = is_send ? p2p_->send(peer_local, x.data_ptr(), d) : p2p_->recv(peer_local, x.data_ptr(), d);
  return c10::make_intrusive<P2pWork>(p2p_, std::move(handle), x, is_send ? c10d::OpType::SEND : c10d::OpType::RECV,
                                      topo_.host_ranks);
}

// Point-to-point is not awaited by barrier() (as in Gloo, whose barrier skips send/recv). A broken
// group has dropped its Gloo (Note [Broken groups]): enqueue() then hands back a Work that failed
// with the group's first failure.
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::send(std::vector<at::Tensor>& t, int dst, int tag) {
  const int peer = local_rank_of(dst);
  if (peer >= 0) return p2p(t, peer, tag, true);
  if (auto g = gloo()) return g->send(t, dst, tag);
  return enqueue({}, c10d::OpType::SEND, [] {});
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::recv(std::vector<at::Tensor>& t, int src, int tag) {
  const int peer = local_rank_of(src);
  if (peer >= 0) return p2p(t, peer, tag, false);
  if (auto g = gloo()) return g->recv(t, src, tag);
  return enqueue({}, c10d::OpType::RECV, [] {});
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::recvAnysource(std::vector<at::Tensor>& t, int tag) {
  if (!p2p_) {
    if (auto g = gloo()) return g->recvAnysource(t, tag);
    return enqueue({}, c10d::OpType::RECVANYSOURCE, [] {});
  }
  DTRAIN_CHECK(topo_.hosts == 1, "rank ", labels_[rank_], ": recv from any source in a group that spans ", topo_.hosts,
               " hosts: ranks on this host send over shared memory and the others over Gloo, so pass the source "
               "rank (or set DTRAIN_SHM=0 for this job)");
  return p2p(t, -1, tag, false);
}

}  // namespace dtrain::comm
