// ShmProcessGroup's rooted collectives (reduce, gather, scatter) over the segment when the group is
// on one host, on Gloo otherwise (Note [Guarded Gloo collectives]); and which calls the group can
// run at all, asked by the front end before anything is sent.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include "comm/gloo_backend.h"
#include "comm/shm/shm_pg_impl.h"
#include "dtrain/errors.h"

namespace dtrain::comm {

bool ShmProcessGroup::shm_reduces(const at::Tensor& t, const c10d::ReduceOp& op, bool all) const {
  if (!shm_dtype(t) || !shm_op(op)) return false;
  // all_reduce spans hosts too: the segment inside each host, Gloo between the host leaders (in
  // float32 for bfloat16, which Gloo 1.13 lacks).
  return all ? (local_ != nullptr || leaders_ != nullptr) : (topo_.hosts == 1 && local_ != nullptr);
}

bool ShmProcessGroup::shm_moves(const at::Tensor& t) const {
  return topo_.hosts == 1 && local_ != nullptr && plain_cpu(t);
}

std::string ShmProcessGroup::unsupported(c10d::OpType type, const at::Tensor& t, const c10d::ReduceOp& op) const {
  const bool reduces = type == c10d::OpType::ALLREDUCE || type == c10d::OpType::REDUCE;
  const bool moves = type == c10d::OpType::BROADCAST || type == c10d::OpType::ALLGATHER ||
                     type == c10d::OpType::GATHER || type == c10d::OpType::SCATTER;
  if (reduces && shm_reduces(t, op, type == c10d::OpType::ALLREDUCE)) return "";
  if (moves && shm_moves(t)) return "";
  std::string why = gloo_unsupported(t);
  if (why.empty()) return why;
  // Would shared memory take the call, were the group's ranks on one host with a segment?
  const bool segment_would = plain_cpu(t) && (reduces ? shm_dtype(t) && shm_op(op) : moves);
  if (segment_would)
    why += local_ ? ", or keep the group's ranks on one host, where shared memory takes it"
                  : ", or run the ranks of one host over shared memory, which takes it (this group has none: "
                    "DTRAIN_SHM=0, one rank per host, or its setup failed)";
  return why;
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) {
  if (t.size() != 1 || o.rootTensor != 0 || !shm_reduces(t[0], o.reduceOp, /*all=*/false))
    return on_gloo(t, c10d::OpType::REDUCE, call_of(kReduce, t, o.rootRank, &o.reduceOp), o.timeout,
                   [gloo = gloo(), t, o]() mutable { return gloo->reduce(t, o); });
  at::Tensor x = t[0];
  return enqueue({x}, c10d::OpType::REDUCE,
                 [this, x, d = *shm_dtype(x), op = *shm_op(o.reduceOp), root = static_cast<int>(o.rootRank)] {
                   local_->reduce(x.data_ptr(), static_cast<size_t>(x.numel()), d, op, root);
                 });
}

namespace {

// A CPU tensor holding `t`'s data that the segment can read or write: `t` itself when it is one.
at::Tensor segment_view(const at::Tensor& t) { return plain_cpu(t) ? t : t.cpu().contiguous(); }

}  // namespace

// The decision is made from the input alone, which every rank passes alike; the root's list (the
// same shapes and dtype, checked by the front end) is copied through CPU tensors if it must be.
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::gather(std::vector<std::vector<at::Tensor>>& out,
                                                       std::vector<at::Tensor>& in, const c10d::GatherOptions& o) {
  const bool root = rank_ == o.rootRank;
  if (in.size() != 1 || !shm_moves(in[0]))
    return on_gloo(out.empty() ? std::vector<at::Tensor>{} : out[0], c10d::OpType::GATHER,
                   call_of(kGather, in, o.rootRank), o.timeout,
                   [gloo = gloo(), out, in, o]() mutable { return gloo->gather(out, in, o); });
  at::Tensor x = in[0];
  std::vector<at::Tensor> outs = root && !out.empty() ? out[0] : std::vector<at::Tensor>{};
  return enqueue(outs, c10d::OpType::GATHER, [this, x, outs, root, root_rank = static_cast<int>(o.rootRank)] {
    // The front end passes the root one tensor per rank: a failure here breaks the group on every rank.
    DTRAIN_ASSERT(!root || static_cast<int>(outs.size()) == size_, "gather: the root's list has ", outs.size(),
                  " tensors for ", size_, " ranks");
    std::vector<at::Tensor> bufs;
    std::vector<void*> ptrs;
    for (const auto& t : outs) {
      bufs.push_back(plain_cpu(t) ? t : at::empty_like(x));
      ptrs.push_back(bufs.back().data_ptr());
    }
    local_->gather(x.data_ptr(), static_cast<size_t>(x.numel()) * x.element_size(), ptrs.data(), root_rank);
    for (size_t k = 0; k < outs.size(); ++k)
      if (!bufs[k].is_same(outs[k])) outs[k].copy_(bufs[k]);
  });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::scatter(std::vector<at::Tensor>& out,
                                                        std::vector<std::vector<at::Tensor>>& in,
                                                        const c10d::ScatterOptions& o) {
  const bool root = rank_ == o.rootRank;
  if (out.size() != 1 || !shm_moves(out[0]))
    return on_gloo(out, c10d::OpType::SCATTER, call_of(kScatter, out, o.rootRank), o.timeout,
                   [gloo = gloo(), out, in, o]() mutable { return gloo->scatter(out, in, o); });
  at::Tensor y = out[0];
  std::vector<at::Tensor> parts;
  if (root && !in.empty())
    for (const auto& t : in[0]) parts.push_back(segment_view(t));
  return enqueue({y}, c10d::OpType::SCATTER, [this, y, parts, root, root_rank = static_cast<int>(o.rootRank)] {
    DTRAIN_ASSERT(!root || static_cast<int>(parts.size()) == size_, "scatter: the root's list has ", parts.size(),
                  " tensors for ", size_, " ranks");
    std::vector<const void*> ptrs;
    for (const auto& p : parts) ptrs.push_back(p.data_ptr());
    local_->scatter(ptrs.data(), static_cast<size_t>(y.numel()) * y.element_size(), y.data_ptr(), root_rank);
  });
}

bool ShmProcessGroup::takes_base(c10d::OpType type, const at::Tensor& t, const c10d::ReduceOp& op) const {
  if (type == c10d::OpType::_ALLGATHER_BASE) return shm_moves(t);
  return type == c10d::OpType::_REDUCE_SCATTER_BASE && shm_reduces(t, op, /*all=*/false);
}

// Every rank's `in` lands in its slice of `out` (Comm::all_gather: each rank copies its part into
// the segment once and reads the others'); `in` may be this rank's slice of `out` itself.
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::_allgather_base(at::Tensor& out, at::Tensor& in,
                                                                const c10d::AllgatherOptions& o) {
  const bool fits = takes_base(c10d::OpType::_ALLGATHER_BASE, in, c10d::ReduceOp::SUM) && plain_cpu(out) &&
                    out.scalar_type() == in.scalar_type() && out.numel() == in.numel() * size_;
  if (!fits) return allgather_base_on_gloo(out, in, o);
  return enqueue({out}, c10d::OpType::_ALLGATHER_BASE, [this, out, in] {
    const size_t bytes = static_cast<size_t>(in.numel()) * in.element_size();
    std::vector<void*> outs;
    for (int k = 0; k < size_; ++k) outs.push_back(static_cast<char*>(out.data_ptr()) + k * bytes);
    local_->all_gather(in.data_ptr(), bytes, outs.data());
  });
}

// Each rank reduces only its own slice (Comm::reduce_scatter). An output inside the input (the
// in-place form) is reduced into a temporary first: the segment reads this rank's slice of the
// input while it writes the output.
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::_reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                                     const c10d::ReduceScatterOptions& o) {
  const bool fits = takes_base(c10d::OpType::_REDUCE_SCATTER_BASE, in, o.reduceOp) && plain_cpu(out) &&
                    out.scalar_type() == in.scalar_type() && in.numel() == out.numel() * size_;
  if (!fits) return reduce_scatter_base_on_gloo(out, in, o);
  return enqueue({out}, c10d::OpType::_REDUCE_SCATTER_BASE,
                 [this, out, in, d = *shm_dtype(in), op = *shm_op(o.reduceOp)] {
                   const bool overlaps = at::get_overlap_status(out, in) != at::MemOverlapStatus::No;
                   at::Tensor dst = overlaps ? at::empty_like(out) : out;
                   local_->reduce_scatter(in.data_ptr(), dst.data_ptr(), static_cast<size_t>(out.numel()), d, op);
                   if (overlaps) out.copy_(dst);
                 });
}

// The segment's, or else the wrapped Gloo's where this LibTorch's Gloo has them (compat/c10d_compat.h).
bool ShmProcessGroup::takes_base_collective(c10d::OpType type, const at::Tensor& t, const c10d::ReduceOp& op) const {
  return takes_base(type, t, op) || DTRAIN_GLOO_HAS_TENSOR_COLLECTIVES;
}

}  // namespace dtrain::comm
