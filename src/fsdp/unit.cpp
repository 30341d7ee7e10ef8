// A fully_shard unit's storage and collectives (see unit.h).
//
// Note [Sharded storage]
// C++ cannot swap a module's attribute as FSDP2 does (setattr between the sharded DTensor and the
// unsharded parameter): a module's forward reads its own member tensors (Linear::weight). So each
// parameter keeps its identity, and what changes is the data behind it (set_data), between
//   - `shard`: this rank's rows, a view of the unit's flat shard (every parameter's chunk of
//     ceil(d0 / n) rows, padded with zeros, back to back), which is what the optimizer updates and
//     what the all-gather sends, without a copy when the param dtype is the parameters' own; and
//   - `full`: the whole parameter, a view of its own storage of n chunks (`padded`), where the
//     all-gather leaves it (Note [Collectives per parameter]). Resharding does not drop that
//     storage, it empties it (zero bytes, as FSDP2's storage resize_(0)): autograd keeps views of
//     the whole weight for backward (Linear saves weight.t()), so a fresh tensor at the next gather
//     would leave those views on the old one. Gathering refills the same storage, and the views see it.
// A gradient accumulates into the whole parameter (autograd's AccumulateGrad). Once every
// parameter of the unit that takes a gradient has one, the unit starts an asynchronous
// reduce-scatter (AVG) and reshards at once. At the end of backward the reduced chunk becomes the
// shard's .grad(), added to the one the shard held before (set aside while the parameter was whole,
// since a whole gradient cannot accumulate into it).
//
// Note [Collectives per parameter]
// FSDP2 makes a unit whole with one all-gather into a buffer whose part r holds chunk r of every
// parameter, then copies each parameter out of it, and lays the gradients out the same way for one
// reduce-scatter: on a GPU a copy is nearly free and a collective is a kernel launch. On the
// shared-memory segment of one host it is the other way round: a collective costs microseconds, and
// copying every parameter out (twice a step under ZeRO-3) and every gradient in was 3 bytes copied
// per parameter byte per step on the main thread (bench_fsdp's step: 1.14 of DDP's with them, 1.05
// without). So where the group says small calls are cheap (Capabilities, the same answer on
// every rank), a unit runs one all-gather per parameter, from its chunk of the flat shard straight
// into its whole storage (n chunks: the padding rows past the end come along and are not part of
// the parameter), and one reduce-scatter per parameter, of the whole gradient itself when its n
// chunks cover it exactly, into its chunk of the unit's output. Elsewhere (Gloo between hosts,
// NCCL) a unit keeps FSDP2's one collective each way, whose calls would otherwise cost a network
// round trip per parameter.
//
// Note [Hybrid sharding]
// HSDP, FSDP2's fully_shard(mesh=2-D (replicate, shard)): parameters are cut over the shard group
// (the mesh's inner dimension) exactly as over a 1-D one, and every replica (the outer dimension)
// holds the same rows, so a ShardSpec has no cut for the replicate group and DCP writes the
// replicas' identical chunks once (Note [Replicas cut unlike]). In backward the reduce-scatter over
// the shard group is followed by an all-reduce of the shard's gradient over the replicate group,
// once the reduce-scatter has landed (Note [Replicate all-reduce in backward]), and the result is
// the mean over all shard * replicate ranks. The division follows FSDP2's
// _get_gradient_divide_factors: float32 and bfloat16 average in each collective (AVG, AVG); other
// reduce dtypes (float64, float16) sum in both, having divided by a power of two near sqrt(N) before
// and by the rest after, against overflow.
// The 1-D path keeps its one AVG reduce-scatter. GradScaler's overflow flag is reduced over both
// groups (each rank's found_inf reaches every rank of the mesh), whatever the all-reduce carried.
//
// Note [Replicate all-reduce in backward]
// FSDP2 issues a unit's all-reduce across the replicas right behind its reduce-scatter, on a stream
// of its own that waits for the reduce-scatter's event, and waits for it only when the gradients are
// finalized: the all-reduce runs while backward goes on. On the CPU a collective cannot be queued
// behind another one's result, and a completion callback runs on the backend's thread, where ranks
// would issue the all-reduces in different orders. So the root keeps the units whose reduce-scatter
// is in flight in launch order (the same on every rank), and the main thread issues their
// all-reduces, asynchronously, in that order: at each unit's pre-backward and each gradient
// accumulated, those whose reduce-scatter has landed (stopping at the first that has not: a poll of
// the handles), and before a unit launches its own reduce-scatter, all of them (waiting: the earlier
// unit's reduce-scatter had this unit's backward to land). So the all-reduce of a unit is in flight
// before the reduce-scatter of the unit backward reaches next, and the end of backward waits for it,
// as for the reduce-scatters. The same collective on the same tensor as a synchronous one: the
// gradients are the same bits.
#include "fsdp/unit.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "dtrain/errors.h"
#include "comm/capabilities.h"
#include "comm/scratch_collectives.h"
#include "comm/shard_groups.h"
#include "comm/shard_specs.h"
#include "comm/state.h"
#include "fsdp/buffer_pool.h"
#include "fsdp/root.h"

namespace dtrain::detail::fsdp {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Empties a tensor's storage (zero bytes) and refills it (bytes allocated again, contents undefined),
// keeping the StorageImpl that views share.
void free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == 0) return;
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}
void alloc_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() == bytes) return;
  s->set_data_ptr_noswap(s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

// A view of `t`'s bytes where a gather moves 16-bit floats: a gather moves bits without arithmetic,
// and Gloo in LibTorch 1.13 has no BFloat16 (nor int16) collectives.
at::Tensor as_gathered(const at::Tensor& t) { return t.element_size() == 2 ? t.view(at::kByte) : t; }

}  // namespace

std::optional<Group> replicate_group(const FullyShardOptions& options) {
  const DeviceMesh& mesh = options.mesh();
  if (mesh.ndim() != 2) return std::nullopt;
  return mesh.get_group(mesh.dim_names().front());
}

std::vector<ShardedParam> shard_parameters(std::vector<std::pair<std::string, at::Tensor>> named, const Group& group,
                                           const std::optional<Group>& replicas, at::Tensor& flat_shard) {
  const int64_t n = group.size(), r = group.rank();
  std::vector<ShardedParam> out;
  int64_t offset = 0;
  for (auto& [name, t] : named) {
    ShardedParam p;
    p.name = name;
    p.param = t;
    p.full_shape = t.sizes().vec();
    // Note [Published shard specs]: this unit's cut of dim 0 comes after any cut before it (TP's).
    p.base = shard_spec_of(t);
    DTRAIN_ASSERT(!p.base || p.base->local_sizes() == p.full_shape, "'", name, "' is ", t.sizes(),
                  " but its published spec is ", p.base->to_string());
    p.spec = (p.base ? *p.base : ShardSpec(p.full_shape)).cut(0, group);
    p.rows = t.dim() == 0 ? 1 : t.size(0);
    p.row_numel = p.rows == 0 ? 0 : t.numel() / p.rows;
    p.chunk_rows = ceil_div(p.rows, n);
    p.local_rows = std::max<int64_t>(0, std::min(p.chunk_rows, p.rows - r * p.chunk_rows));
    p.offset = offset;
    offset += p.chunk_numel();
    out.push_back(std::move(p));
  }
  const at::Tensor first = out.empty() ? at::Tensor() : out[0].param;
  flat_shard = at::zeros({offset}, first.defined() ? first.options().requires_grad(false) : at::TensorOptions());
  torch::NoGradGuard no_grad;
  for (ShardedParam& p : out) {
    at::Tensor whole = p.param.detach().reshape({-1});
    // A rank past the last chunk holds no rows (its start may lie past the end).
    const int64_t start = std::min(r * p.chunk_numel(), whole.numel());
    flat_shard.narrow(0, p.offset, p.local_numel()).copy_(whole.narrow(0, start, p.local_numel()));
    std::vector<int64_t> shape = p.full_shape;
    if (shape.empty())
      shape = {p.local_rows};
    else
      shape[0] = p.local_rows;
    p.shard = flat_shard.narrow(0, p.offset, p.local_numel()).view(shape);
    DTRAIN_ASSERT(p.spec.local_sizes() == p.shard.sizes(), "'", p.name, "': ", p.spec.to_string(), " for a shard of ",
                  p.shard.sizes());
    p.param.set_data(p.shard);
    comm::publish_shard_spec(p.param, p.spec);
    p.param.mutable_grad() = at::Tensor();
    comm::add_shard_group(p.param, group);                    // GradScaler's overflow flag spans the group
    if (replicas) comm::add_shard_group(p.param, *replicas);  // and the replicas (Note [Hybrid sharding])
  }
  return out;
}

Unit::Unit(const std::shared_ptr<torch::nn::Module>& module, std::vector<ShardedParam> params, at::Tensor flat_shard,
           const FullyShardOptions& o)
    : label_(module->name()),
      module_(module.get()),
      group_(o.process_group()),
      replicas_(replicate_group(o)),
      params_(std::move(params)),
      mp_(o.mp_policy()),
      reshard_option_(o.reshard_after_forward() ? std::optional<bool>(o.reshard_after_forward()->reshard())
                                                : std::nullopt),
      flat_shard_(std::move(flat_shard)) {
  per_rank_ = flat_shard_.defined() ? flat_shard_.numel() : 0;
  for (const ShardedParam& p : params_) takes_grad_ += p.param.requires_grad() ? 1 : 0;
  reshard_after_forward_ = reshard_option_.value_or(true);
  hook_keys_.assign(params_.size(), 0);
  set_divide_factors();
  per_param_ =
      comm::capabilities(group_).small_calls_are_cheap() && (!flat_shard_.defined() || flat_shard_.device().is_cpu());
  reserve_pool_for(pooled_bytes());
}

// What the unit holds at once from the pool (Note [Buffer pool]): the whole (padded) parameters (and
// the one gather's output they are copied from, where the unit gathers once), the shard cast to the
// param dtype where it differs, and the reduce-scatter's padded input where the gradients cannot go
// as they are (one collective for the unit, padding, another dtype on the wire).
size_t Unit::pooled_bytes() {
  const size_t n = static_cast<size_t>(group_.size()), per_rank = static_cast<size_t>(per_rank_);
  const size_t param_bytes = c10::elementSize(param_dtype()), reduce_bytes = c10::elementSize(wire_dtype());
  size_t bytes = (per_param_ ? 1 : 2) * n * per_rank * param_bytes;
  if (flat_shard_.defined() && flat_shard_.scalar_type() != param_dtype()) bytes += per_rank * param_bytes;
  bool padded_inputs = !per_param_ || wire_dtype() != param_dtype();
  for (const ShardedParam& p : params_) padded_inputs |= group_.size() * p.chunk_numel() != p.param.numel();
  if (padded_inputs) bytes += n * per_rank * reduce_bytes;
  return bytes;
}

// Note [Hybrid sharding]: FSDP2's _get_gradient_divide_factors, for HSDP only (the 1-D path keeps
// its AVG reduce-scatter in every dtype).
void Unit::set_divide_factors() {
  const at::ScalarType r = reduce_dtype();
  if (!replicas_ || r == at::kFloat || r == at::kBFloat16) return;  // AVG in both collectives
  const int64_t size = group_.size() * replicas_->size();
  int64_t pre = 1;
  while (size % pre == 0 && size / pre > pre) pre *= 2;
  predivide_ = static_cast<double>(pre);
  postdivide_ = static_cast<double>(size) / static_cast<double>(pre);
  reduce_op_ = ReduceOp::SUM;
}

Unit::~Unit() {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].accumulator) compat::remove_post_hook(params_[i].accumulator, hook_keys_[i]);
}

// Autograd fixes the shape and dtype a leaf's gradient must have when it creates the leaf's
// accumulator, so the accumulators are made while the parameters are whole, and kept (the parameter
// holds its accumulator only weakly, and set_data to another dtype drops even that link: unshard
// relinks it): every backward then accumulates whole gradients into the hooked accumulator.
void Unit::hook_accumulators() {
  for (size_t i = 0; i < params_.size(); ++i) {
    ShardedParam& p = params_[i];
    if (p.accumulator || !p.param.requires_grad()) continue;
    p.accumulator = compat::grad_accumulator(p.param);
    std::weak_ptr<Unit> self = weak_from_this();
    hook_keys_[i] = compat::add_post_hook(p.accumulator, [self, i] {
      if (auto u = self.lock()) u->on_grad_ready(u->params_[i]);
    });
  }
}

at::ScalarType Unit::param_dtype() const {
  return mp_.param_dtype().value_or(flat_shard_.defined() ? flat_shard_.scalar_type() : at::kFloat);
}
at::ScalarType Unit::reduce_dtype() const { return mp_.reduce_dtype().value_or(param_dtype()); }

// Note [A reduce dtype the backend lacks]: Gloo in LibTorch 1.13 has no bfloat16 (nor float16 on
// some builds) collectives, so between hosts a reduce_dtype of bf16 could not be reduce-scattered at
// all. There the gradients, rounded to the reduce dtype as FSDP2 casts them, travel as float32, and
// the average is rounded to the reduce dtype once on arrival: the same numbers a bf16 sum rounded
// once gives (the shared-memory backend combines 16-bit floats the same way), at twice the bytes.
at::TensorOptions Unit::device_options() const {
  return at::TensorOptions().device(flat_shard_.defined() ? flat_shard_.device() : at::Device(at::kCPU));
}

at::ScalarType Unit::wire_dtype() {
  if (!wire_dtype_) {
    const at::ScalarType r = reduce_dtype();
    const bool lacks =
        !comm::capabilities(group_)
             .unsupported(c10d::OpType::REDUCE_SCATTER, at::empty({0}, device_options().dtype(r)), c10d::ReduceOp::SUM)
             .empty();
    wire_dtype_ = lacks && at::isFloatingType(r) && c10::elementSize(r) < 4 ? at::kFloat : r;
  }
  return *wire_dtype_;
}

// The whole parameter's storage of n chunks, refilled (its bytes from the pool).
void Unit::fill_storage(ShardedParam& p, const at::TensorOptions& options) {
  if (!p.padded.defined()) {
    p.padded = pooled_empty({group_.size() * p.chunk_numel()}, options);
    p.full = p.padded.narrow(0, 0, p.rows * p.row_numel).view(p.full_shape);
  }
  alloc_storage(p.padded);
}

// Note [Collectives per parameter]: with per_param_, one all-gather per parameter straight into its
// whole storage; otherwise one for the unit into a gathered buffer, copied out in unshard().
// Note [Post-forward groups]: from the part kept after forward, when there is one, over its group
// of n ranks; otherwise from the shard over the unit's group.
void Unit::issue_gather() {
  if (whole_ || !gathers_.empty() || params_.empty()) return;
  const bool from_part = post_forward_shard_.defined();
  const Group& group = from_part ? *post_forward_group_ : group_;
  // Parts of the unit's group each rank of `group` sends: its chunk, or k = N / n chunks of the part.
  const int64_t k = group_.size() / group.size();
  // The input lives until the gathers are waited for: an asynchronous collective reads it meanwhile.
  if (from_part) {
    gather_in_ = post_forward_shard_;
  } else if (flat_shard_.scalar_type() == param_dtype()) {
    gather_in_ = flat_shard_;
  } else {
    gather_in_ = pooled_empty({per_rank_}, flat_shard_.options().dtype(param_dtype()));
    gather_in_.copy_(flat_shard_);
  }
  const int64_t n = group.size();
  received_bytes_ += (n - 1) * k * per_rank_ * static_cast<int64_t>(gather_in_.element_size());
  if (!per_param_) {
    gathered_ = pooled_empty({group_.size() * per_rank_}, gather_in_.options());
    at::Tensor out = as_gathered(gathered_);
    gathers_.push_back(all_gather_into_tensor(out, as_gathered(gather_in_), group, /*async_op=*/true));
    return;
  }
  for (ShardedParam& p : params_) {
    if (p.chunk_numel() == 0) continue;
    fill_storage(p, gather_in_.options());
    at::Tensor out = as_gathered(p.padded);
    at::Tensor in = gather_in_.narrow(0, k * p.offset, k * p.chunk_numel());
    gathers_.push_back(all_gather_into_tensor(out, as_gathered(in), group, /*async_op=*/true));
  }
}

// Note [Post-forward groups]
// reshard_after_forward(n), as FSDP2's post_forward_mesh_info: after its forward a unit keeps part j
// of its whole (padded) parameters, j being the rank's place in its group of n ranks consecutive in
// the shard group of N: chunks j * k .. j * k + k - 1 (k = N / n) of each parameter, 1/n of the unit.
// Backward's all-gather then runs over the group of n from that part, and returns every chunk in
// order: the same bits the gather over N gives, for (n - 1) / n of the part's bytes received instead
// of (N - 1) / N of the whole. The part is laid out as the gather over the group of n takes it: per
// parameter (its k chunks at k times its offset) where the unit gathers per parameter, and as k parts
// of the unit's flat layout where it gathers once (Note [Collectives per parameter]). It is a copy,
// dropped once backward gathered from it, when a unit reshards fully (reshard()), and when the next
// iteration begins (a forward without backward: the optimizer may have changed the shards since).
void Unit::post_forward() {
  if (!reshard_after_forward_) {
    watch_zero_grad();
    return;
  }
  if (!post_forward_group_ || !whole_ || params_.empty()) {
    reshard();
    return;
  }
  const int64_t k = group_.size() / post_forward_group_->size(), j = post_forward_group_->rank();
  torch::NoGradGuard no_grad;
  at::Tensor part = at::empty({k * per_rank_}, flat_shard_.options().dtype(param_dtype()));
  for (ShardedParam& p : params_) {
    const int64_t c = p.chunk_numel();
    if (c == 0) continue;
    const at::Tensor mine = p.padded.narrow(0, j * k * c, k * c);
    if (per_param_)
      part.narrow(0, k * p.offset, k * c).copy_(mine);
    else
      part.view({k, per_rank_}).narrow(1, p.offset, c).copy_(mine.view({k, c}));
  }
  reshard();
  post_forward_shard_ = part;
}

int64_t Unit::gathered_bytes() const {
  int64_t bytes = post_forward_shard_.defined() ? post_forward_shard_.numel() * post_forward_shard_.element_size() : 0;
  for (const ShardedParam& p : params_)
    if (p.padded.defined()) bytes += static_cast<int64_t>(p.padded.storage().nbytes());
  return bytes;
}

void Unit::drop_prefetch() {
  if (gathers_.empty()) return;
  for (Work& w : gathers_) w.wait();
  gathers_.clear();
  gather_in_ = at::Tensor();
  gathered_ = at::Tensor();
  for (ShardedParam& p : params_)
    if (p.padded.defined()) free_storage(p.padded);
}

void Unit::unshard() {
  if (whole_ || params_.empty()) {
    whole_ = true;
    return;
  }
  if (!gathers_.empty()) ++prefetched_;
  issue_gather();
  for (Work& w : gathers_) w.wait();
  gathers_.clear();
  post_forward_shard_ = at::Tensor();  // gathered from (Note [Post-forward groups])
  torch::NoGradGuard no_grad;
  if (gathered_.defined()) {  // one gather for the unit: part r holds chunk r of every parameter
    const at::Tensor parts = gathered_.view({group_.size(), per_rank_});
    for (ShardedParam& p : params_) {
      if (p.chunk_numel() == 0) continue;
      fill_storage(p, gathered_.options());
      p.padded.view({group_.size(), p.chunk_numel()}).copy_(parts.narrow(1, p.offset, p.chunk_numel()));
    }
    gathered_ = at::Tensor();
  }
  gather_in_ = at::Tensor();
  for (ShardedParam& p : params_) {
    if (!p.full.defined()) fill_storage(p, flat_shard_.options().dtype(param_dtype()));  // no rows at all
    // Set the shard's gradient aside: a whole gradient accumulates into .grad() now.
    if (p.param.grad().defined()) p.sharded_grad = p.param.grad();
    p.param.mutable_grad() = at::Tensor();
    p.param.set_data(p.full);
    comm::publish_shard_spec(p.param, p.base);  // whole over the group: only the cuts before the unit's
    if (p.accumulator) compat::relink_grad_accumulator(p.param, p.accumulator);
  }
  whole_ = true;
  hook_accumulators();
}

// Note [zero_grad while whole]: while a unit is whole its shards' gradients wait in sharded_grad,
// to be added to the new ones after the reduce-scatter (or put back when no backward comes), as
// torch accumulates .grad(). An optimizer.zero_grad() in that time (between the forward of a unit
// kept whole and backward: the root by default, every unit under reshard_after_forward(false))
// must still clear them, as it clears FSDP2's sharded parameters' gradients at any time. It reaches
// only the whole parameter's .grad(), so that .grad() is a placeholder of zeros while a shard's
// gradient waits: zero_grad() resets it (set_to_none) or zeroes it in place (its version moves on
// once more than the accumulations of the backward, which add in place). Either way the gradient
// set aside is dropped. The placeholder is put where user code runs while the unit is whole: after a
// forward that keeps it whole, and after unshard(); a unit gathered inside backward needs none.
// Cost there: one whole gradient from the unit's forward on, where it would exist from its backward on.
namespace {
bool cleared_while_whole(ShardedParam& p, int64_t accumulations) {
  if (!p.placeholder.defined()) return false;
  const at::Tensor g = p.param.grad();
  const bool cleared = !g.defined() || !g.is_same(p.placeholder) ||
                       static_cast<int64_t>(p.placeholder._version()) > p.placeholder_version + accumulations;
  p.placeholder = at::Tensor();
  return cleared;
}
}  // namespace

void Unit::watch_zero_grad() {
  if (!whole_) return;
  torch::NoGradGuard no_grad;
  for (ShardedParam& p : params_) {
    if (!p.sharded_grad.defined() || p.placeholder.defined() || p.param.grad().defined()) continue;
    p.placeholder = at::zeros_like(p.full);
    p.param.mutable_grad() = p.placeholder;
    p.placeholder_version = static_cast<int64_t>(p.placeholder._version());
  }
}

void Unit::reshard(bool restore_grads) {
  post_forward_shard_ = at::Tensor();  // the shards alone (Note [Post-forward groups])
  if (!whole_) return;
  torch::NoGradGuard no_grad;
  for (ShardedParam& p : params_) {
    if (cleared_while_whole(p, 0)) p.sharded_grad = at::Tensor();
    p.param.mutable_grad() = at::Tensor();
    p.param.set_data(p.shard);
    comm::publish_shard_spec(p.param, p.spec);
    if (p.padded.defined()) free_storage(p.padded);
    if (restore_grads && p.sharded_grad.defined()) {
      p.param.mutable_grad() = p.sharded_grad;
      p.sharded_grad = at::Tensor();
    }
  }
  whole_ = false;
}

void Unit::on_grad_ready(ShardedParam& p) {
  if (root) {
    root->on_backward();
    root->issue_replicate_all_reduces(/*wait=*/false);  // Note [Replicate all-reduce in backward]
  }
  if (p.got_grad || !whole_) return;
  if (cleared_while_whole(p, 1)) p.sharded_grad = at::Tensor();
  p.got_grad = true;
  if (++ready_ == takes_grad_) launch_reduce_scatter();
}

void Unit::launch_if_pending() {
  if (ready_ > 0 && !launched_) launch_reduce_scatter();
  reshard();  // a unit gathered for backward whose parameters took no gradient
}

void Unit::launch_reduce_scatter() {
  launched_ = true;
  torch::NoGradGuard no_grad;
  const int64_t n = group_.size();
  if (!requires_sync_) {  // accumulate the whole gradients; nothing goes over the wire
    for (ShardedParam& p : params_) {
      if (!p.got_grad) continue;
      at::Tensor g = p.param.grad().to(reduce_dtype());
      p.accumulated = p.accumulated.defined() ? p.accumulated.add_(g) : g.clone();
    }
    reshard();
    return;
  }
  // The earlier units' all-reduces across the replicas go first
  // (Note [Replicate all-reduce in backward]).
  if (replicas_ && root) root->issue_replicate_all_reduces(/*wait=*/true);
  // Chunk r of each parameter's gradient goes to rank r (Note [Collectives per parameter]): one
  // reduce-scatter per parameter into its chunk of the unit's output, or one for the unit whose
  // part r holds chunk r of every parameter.
  const at::TensorOptions options = flat_shard_.options().dtype(wire_dtype());
  // Not from the pool: every unit's output lives until the end of backward, and they would come back
  // to it all at once, blocks of a size the next forward does not take (Note [Buffer pool]).
  scatter_out_ = at::empty({per_rank_}, options);
  at::Tensor parts;
  if (!per_param_) parts = pooled_empty({n, per_rank_}, options);
  for (ShardedParam& p : params_) {
    if (p.chunk_numel() == 0) continue;
    at::Tensor g = p.got_grad ? p.param.grad().to(reduce_dtype()) : at::Tensor();
    if (p.accumulated.defined()) g = g.defined() ? g.add(p.accumulated) : p.accumulated;
    p.accumulated = at::Tensor();
    if (g.defined()) p.got_grad = true;  // a gradient accumulated without sync counts as this backward's
    at::Tensor in = padded_gradient(p, g, options);
    if (per_param_) {
      if (predivide_ != 1) in = in.div(predivide_);  // not in place: `in` may be the gradient itself
      at::Tensor out = scatter_out_.narrow(0, p.offset, p.chunk_numel());
      scatters_.push_back(reduce_scatter_tensor(out, in, reduce_op_, group_, /*async_op=*/true));
      // Read by the collective until it completes, then given back at once: backward's next
      // gradients are then allocated where these were, not in fresh pages.
      scatters_.back().then([keep = at::Tensor(in)]() mutable { keep = at::Tensor(); });
    } else {
      parts.narrow(1, p.offset, p.chunk_numel()).copy_(in.view({n, p.chunk_numel()}));
    }
  }
  if (!per_param_) {
    if (predivide_ != 1) parts.div_(predivide_);
    // Scratch of the unit's: composed on Gloo, the reduce-scatter all-reduces it in place, not a copy.
    at::Tensor flat = parts.view({-1});
    scatters_.push_back(comm::reduce_scatter_tensor_of_scratch(scatter_out_, flat, reduce_op_, group_, true));
    scatter_inputs_.push_back(parts);
  }
  received_bytes_ += (n - 1) * per_rank_ * static_cast<int64_t>(scatter_out_.element_size());
  scattering_ = true;
  if (replicas_ && root) root->queue_replicate_all_reduce(shared_from_this());
  reshard(/*restore_grads=*/false);  // the shard's old gradient waits in sharded_grad for the new one
  if (!replicas_ && root) root->on_reduce_scatter_launched(shared_from_this());
}

// A parameter's gradient as n chunks back to back: the gradient itself when they cover it exactly
// (no copy), otherwise a copy padded with zeros; zeros for a parameter without a gradient on this
// rank (every rank calls the same collectives, whatever its backward reached).
at::Tensor Unit::padded_gradient(const ShardedParam& p, const at::Tensor& g, const at::TensorOptions& options) const {
  const int64_t padded = group_.size() * p.chunk_numel();
  if (g.defined() && g.is_contiguous() && g.numel() == padded && g.scalar_type() == options.dtype().toScalarType())
    return g.view({-1});
  at::Tensor in = pooled_empty({padded}, options);
  const int64_t filled = g.defined() ? g.numel() : 0;
  if (filled > 0) in.narrow(0, 0, filled).copy_(g.reshape({-1}));
  in.narrow(0, filled, padded - filled).zero_();
  return in;
}

bool Unit::issue_replicate_all_reduce(bool wait) {
  if (!scattering_) return true;
  if (!wait)
    for (Work& w : scatters_)
      if (!w.is_completed()) return false;
  for (Work& w : scatters_) w.wait();
  scatters_.clear();
  scatter_inputs_.clear();
  scattering_ = false;
  // Note [Hybrid sharding]: the replicas' shards of the gradient, once the reduce-scatter has landed.
  if (replicas_) replicate_reduces_.push_back(all_reduce(scatter_out_, reduce_op_, *replicas_, /*async_op=*/true));
  return true;
}

void Unit::finish_gradients() {
  if (!scatter_out_.defined()) return;
  issue_replicate_all_reduce(/*wait=*/true);
  for (Work& w : replicate_reduces_) w.wait();
  replicate_reduces_.clear();
  torch::NoGradGuard no_grad;
  for (ShardedParam& p : params_) {
    at::Tensor old = p.sharded_grad;
    p.sharded_grad = at::Tensor();
    if (!p.got_grad) {
      if (old.defined()) p.param.mutable_grad() = old;
      continue;
    }
    // Rounded to the reduce dtype first where it travelled as float32 (a no-op otherwise).
    at::Tensor g = scatter_out_.narrow(0, p.offset, p.local_numel()).view(p.shard.sizes()).to(reduce_dtype());
    if (postdivide_ != 1) g = g.div(postdivide_);
    g = g.to(p.shard.scalar_type());
    if (old.defined()) {
      old.add_(g);
      p.param.mutable_grad() = old;
    } else {
      // A tensor of its own, not a view of the reduce-scatter's output: LibTorch 1.13's zero_grad()
      // detaches gradients in place, which a view refuses.
      p.param.mutable_grad() = g.clone();
    }
  }
  scatter_out_ = at::Tensor();
}

void Unit::reset_backward() {
  ready_ = 0;
  launched_ = false;
  pre_backward_done = false;
  for (ShardedParam& p : params_) p.got_grad = false;
}

}  // namespace dtrain::detail::fsdp
