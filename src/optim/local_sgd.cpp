// LocalSGD and DiLoCo (dtrain/local_sgd.h): the algorithms of torchft's local_sgd.py over a dtrain
// Group, one flat all-reduce per sync.
#include "dtrain/local_sgd.h"

#include <ATen/ATen.h>
#include <torch/types.h>

#include <exception>
#include <string>
#include <unordered_set>
#include <utility>

#include "dtrain/errors.h"

namespace dtrain {
namespace {

// One floating-point dtype and one device, so that the parameters travel as one flat tensor.
void local_sgd_check_params(const std::vector<at::Tensor>& params, const char* who, const std::string& what) {
  DTRAIN_CHECK(!params.empty(), who, ": no parameters in ", what, ": pass the model's parameters()");
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    DTRAIN_CHECK(p.defined() && p.is_floating_point(), who, ": parameter ", i, " of ", what,
                 " is not a floating-point tensor: pass the model's parameters()");
    DTRAIN_CHECK(p.scalar_type() == params[0].scalar_type() && p.device() == params[0].device(), who, ": parameter ", i,
                 " of ", what, " is ", p.scalar_type(), " on ", p.device(), " but parameter 0 is ",
                 params[0].scalar_type(), " on ", params[0].device(),
                 ": cast the model to one dtype and device (model->to(...)) first");
  }
}

void local_sgd_check_group(const Group& group, int64_t sync_every, const char* who) {
  DTRAIN_CHECK(sync_every >= 1, who, ": sync_every is ", sync_every, ": it must be at least 1 (optimizer steps)");
  DTRAIN_CHECK(group.is_member(), who, ": rank ", rank(), " is not a member of group '", group.name(),
               "': build it only on the group's ranks");
}

std::unordered_set<const void*> local_sgd_impls(const torch::optim::Optimizer& opt) {
  std::unordered_set<const void*> out;
  for (const auto& g : opt.param_groups())
    for (const auto& p : g.params()) out.insert(p.unsafeGetTensorImpl());
  return out;
}

// Every parameter of `params` is one `opt` steps: DiLoCo sets their grads for it.
void local_sgd_check_holds(const torch::optim::Optimizer& opt, const std::vector<at::Tensor>& params,
                           const std::string& opt_name, const std::string& what) {
  const auto held = local_sgd_impls(opt);
  for (size_t i = 0; i < params.size(); ++i)
    DTRAIN_CHECK(held.count(params[i].unsafeGetTensorImpl()), "DiLoCo: parameter ", i, " of ", what, " is not in the ",
                 opt_name, "'s param_groups: build the ", opt_name, " over the same parameters");
}

at::Tensor local_sgd_flat(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> parts;
  parts.reserve(ts.size());
  for (const auto& t : ts) parts.push_back(t.detach().reshape({-1}));
  return at::cat(parts);
}

// A failure of the sync's all-reduce as one line: the rank, what was being done, what is true now.
[[noreturn]] void local_sgd_rethrow(const std::string& what, const std::string& now, const std::exception& e) {
  std::string cause = e.what();
  for (char& c : cause)
    if (c == '\n' || c == '\r') c = ' ';
  // An Average's loop may have no process group (a fault-tolerant replica of one process): no rank.
  const std::string who = is_initialized() ? detail::cat("rank ", rank(), ": ") : std::string();
  throw Error(detail::cat(who, what, " failed; ", now, ": ", cause));
}

std::string local_sgd_op(int64_t numel, const Group& group, bool by_function) {
  if (by_function) return detail::cat("average of ", numel, " elements");
  return detail::cat("all_reduce of ", numel, " elements on group '", group.name(), "'");
}

// all_reduce(SUM) then a division by the group's size: torchft's manager averages this way.
// With an Average instead, its answer: false when the replicas refused the sync.
bool local_sgd_average(at::Tensor& flat, const Group& group, const LocalSgdAverage& average) {
  if (average) return average(flat);
  all_reduce(flat, ReduceOp::SUM, group);
  flat.div_(group.size());
  return true;
}

void local_sgd_check_average(const LocalSgdAverage& average, int64_t sync_every, const char* who) {
  DTRAIN_CHECK(sync_every >= 1, who, ": sync_every is ", sync_every, ": it must be at least 1 (optimizer steps)");
  DTRAIN_CHECK(static_cast<bool>(average), who,
               ": the Average function is empty: pass a function that averages over the replicas, or a Group");
}

}  // namespace

// --- LocalSGD ----------------------------------------------------------------------------------------

LocalSGD::LocalSGD(std::vector<at::Tensor> params, int64_t sync_every, Group group)
    : params_(std::move(params)), sync_every_(sync_every), group_(std::move(group)) {
  local_sgd_check_group(group_, sync_every_, "LocalSGD");
  local_sgd_check_params(params_, "LocalSGD", "the parameters");
}

LocalSGD::LocalSGD(std::vector<at::Tensor> params, int64_t sync_every, LocalSgdAverage average)
    : params_(std::move(params)), sync_every_(sync_every), average_(std::move(average)) {
  local_sgd_check_average(average_, sync_every_, "LocalSGD");
  local_sgd_check_params(params_, "LocalSGD", "the parameters");
}

bool LocalSGD::step() {
  if (++local_step_ < sync_every_) return false;
  return sync();
}

bool LocalSGD::sync() {
  torch::NoGradGuard no_grad;
  local_step_ = 0;
  at::Tensor flat = local_sgd_flat(params_);
  try {
    if (!local_sgd_average(flat, group_, average_)) return false;  // each rank keeps its own
  } catch (const std::exception& e) {
    local_sgd_rethrow("LocalSGD sync (" + local_sgd_op(flat.numel(), group_, static_cast<bool>(average_)) + ")",
                      "the parameters are this rank's own, not averaged", e);
  }
  int64_t offset = 0;
  for (auto& p : params_) {
    p.copy_(flat.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
  return true;
}

// --- DiLoCo ------------------------------------------------------------------------------------------

DiLoCo::DiLoCo(std::vector<at::Tensor> params, torch::optim::Optimizer& inner, torch::optim::Optimizer& outer,
               int64_t sync_every, Group group, DiLoCoOptions options)
    : DiLoCo(std::vector<std::vector<at::Tensor>>{std::move(params)}, inner,
             std::vector<torch::optim::Optimizer*>{&outer}, sync_every, std::move(group), options) {}

DiLoCo::DiLoCo(std::vector<at::Tensor> params, torch::optim::Optimizer& inner, torch::optim::Optimizer& outer,
               int64_t sync_every, LocalSgdAverage average, DiLoCoOptions options)
    : DiLoCo(std::vector<std::vector<at::Tensor>>{std::move(params)}, inner,
             std::vector<torch::optim::Optimizer*>{&outer}, sync_every, std::move(average), options) {}

DiLoCo::DiLoCo(std::vector<std::vector<at::Tensor>> fragments, torch::optim::Optimizer& inner,
               std::vector<torch::optim::Optimizer*> outers, int64_t sync_every, Group group, DiLoCoOptions options)
    : sync_every_(sync_every), group_(std::move(group)) {
  local_sgd_check_group(group_, sync_every, "DiLoCo");
  make_fragments(std::move(fragments), inner, std::move(outers), options);
}

DiLoCo::DiLoCo(std::vector<std::vector<at::Tensor>> fragments, torch::optim::Optimizer& inner,
               std::vector<torch::optim::Optimizer*> outers, int64_t sync_every, LocalSgdAverage average,
               DiLoCoOptions options)
    : sync_every_(sync_every), average_(std::move(average)) {
  local_sgd_check_average(average_, sync_every, "DiLoCo");
  make_fragments(std::move(fragments), inner, std::move(outers), options);
}

DiLoCo::~DiLoCo() { drop_pending(); }

void DiLoCo::make_fragments(std::vector<std::vector<at::Tensor>> fragments, torch::optim::Optimizer& inner,
                            std::vector<torch::optim::Optimizer*> outers, DiLoCoOptions options) {
  const int64_t sync_every = sync_every_;
  const auto F = static_cast<int64_t>(fragments.size());
  DTRAIN_CHECK(F >= 1, "DiLoCo: no fragments: pass the model's parameters()");
  DTRAIN_CHECK(outers.size() == fragments.size(), "DiLoCo: ", outers.size(), " outer optimizers for ", F,
               " fragments: pass one outer optimizer per fragment");
  DTRAIN_CHECK(sync_every % F == 0, "DiLoCo: sync_every is ", sync_every, " with ", F,
               " fragments: it must be a multiple of the number of fragments (one fragment syncs every sync_every / ",
               F, " steps)");
  sync_every_ = sync_every / F;
  const int64_t delay = options.fragment_sync_delay();
  DTRAIN_CHECK(delay >= 0 && delay < sync_every_, "DiLoCo: fragment_sync_delay is ", delay, " with sync_every ",
               sync_every, " and ", F, " fragment(s): it must be in [0, ", sync_every_,
               ") (a fragment's sync must finish before its next one starts)");
  const double alpha = options.fragment_update_alpha();
  DTRAIN_CHECK(alpha >= 0.0 && alpha <= 1.0, "DiLoCo: fragment_update_alpha is ", alpha,
               ": it must be in [0, 1] (the share of the replica's own parameters kept)");
  const auto reduce_dtype = options.reduce_dtype();
  DTRAIN_CHECK(!reduce_dtype || at::isFloatingType(*reduce_dtype), "DiLoCo: reduce_dtype is ", *reduce_dtype,
               ": pass a floating-point dtype (at::kBFloat16, at::kHalf, at::kFloat) or none");
  options_ = options;
  std::unordered_set<const void*> seen;
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < F; ++i) {
    const std::string what = F == 1 ? "the parameters" : "fragment " + std::to_string(i);
    local_sgd_check_params(fragments[i], "DiLoCo", what);
    DTRAIN_CHECK(outers[i] != nullptr, "DiLoCo: outer optimizer ", i, " is null: pass one per fragment");
    local_sgd_check_holds(inner, fragments[i], "inner optimizer", what);
    local_sgd_check_holds(*outers[i], fragments[i], F == 1 ? "outer optimizer" : "outer optimizer " + std::to_string(i),
                          what);
    Fragment f;
    f.params = std::move(fragments[i]);
    f.outer = outers[i];
    for (const auto& p : f.params) {
      DTRAIN_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, "DiLoCo: a parameter of ", what,
                   " is also in an earlier fragment: give each parameter to one fragment");
      f.original.push_back(p.detach().clone());  // the last sync's parameters: at first, the initial ones
      f.numel += p.numel();
    }
    fragments_.push_back(std::move(f));
  }
}

const std::vector<at::Tensor>& DiLoCo::original_parameters(size_t fragment) const {
  DTRAIN_CHECK(fragment < fragments_.size(), "DiLoCo::original_parameters: fragment ", fragment, " of ",
               fragments_.size(), ": pass 0 to ", fragments_.size() - 1);
  return fragments_[fragment].original;
}

bool DiLoCo::step() {
  ++local_step_;
  const bool start = local_step_ == sync_every_ - options_.fragment_sync_delay();
  const bool finish = local_step_ >= sync_every_;
  if (finish) local_step_ = 0;
  // The same fragment on every replica: the count of successful syncs is the same everywhere, and a
  // failed sync is retried on the same fragment, as torchft keys it on the manager's step.
  if (start) start_sync(static_cast<size_t>(sync_count_ % static_cast<int64_t>(fragments_.size())));
  if (!finish || !finish_sync()) return false;
  ++sync_count_;
  return true;
}

void DiLoCo::save_parameters() {
  drop_pending();
  torch::NoGradGuard no_grad;
  for (Fragment& f : fragments_)
    for (size_t i = 0; i < f.params.size(); ++i) f.original[i].copy_(f.params[i].detach());
}

void DiLoCo::restore(const Fragment& f) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < f.params.size(); ++i) f.params[i].copy_(f.original[i]);
}

void DiLoCo::drop_pending() noexcept {
  if (!pending_.flat.defined()) return;
  Pending dropped = std::move(pending_);
  pending_ = Pending();
  if (average_) return;  // an Average function's sync has already run
  try {
    dropped.work.wait();
  } catch (...) {  // the sync is dropped, and with it its outcome
  }
}

// 1. The pseudo-gradient, original - current, of the whole fragment in one flat tensor; 2. its
// average over the replicas starts (over a Group asynchronously; an Average function runs now, and
// may heal this replica through save_parameters(): nothing is pending until it returns).
void DiLoCo::start_sync(size_t index) {
  Fragment& f = fragments_[index];
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> deltas;
  deltas.reserve(f.params.size());
  for (size_t i = 0; i < f.params.size(); ++i) deltas.push_back(f.original[i] - f.params[i].detach());
  at::Tensor flat = local_sgd_flat(deltas);
  deltas.clear();
  if (options_.reduce_dtype()) flat = flat.to(*options_.reduce_dtype());
  Pending p;
  p.index = index;
  try {
    if (average_)
      p.agreed = average_(flat);
    else
      p.work = all_reduce(flat, ReduceOp::SUM, group_, /*async_op=*/true);
  } catch (const std::exception& e) {
    sync_failed(index, flat.numel(), e);
  }
  p.flat = std::move(flat);
  pending_ = std::move(p);
}

// On failure the inner steps since the last sync are discarded: the fragment goes back to it, and
// the round starts again from there.
void DiLoCo::sync_failed(size_t index, int64_t numel, const std::exception& e) {
  pending_ = Pending();
  local_step_ = 0;
  restore(fragments_[index]);
  local_sgd_rethrow(
      detail::cat("DiLoCo sync (fragment ", index, ", ", local_sgd_op(numel, group_, static_cast<bool>(average_)), ")"),
      "the parameters are back to the last sync's", e);
}

bool DiLoCo::finish_sync() {
  if (!pending_.flat.defined()) return false;  // dropped by save_parameters() while in flight
  torch::NoGradGuard no_grad;
  try {
    if (!average_) pending_.work.wait();
  } catch (const std::exception& e) {
    sync_failed(pending_.index, pending_.flat.numel(), e);
  }
  Fragment& f = fragments_[pending_.index];
  // Back in the parameters' dtype (a reduce_dtype's sum), then the mean over the group.
  at::Tensor flat = pending_.flat.to(f.params[0].scalar_type());
  if (!average_) flat.div_(group_.size());
  const bool agreed = pending_.agreed;
  pending_ = Pending();
  // The fragment as the delayed inner steps left it, for the mix below (torchft's local parameters).
  const double alpha = options_.fragment_update_alpha();
  std::vector<at::Tensor> local;
  if (alpha > 0.0)
    for (const auto& p : f.params) local.push_back(p.detach().clone());
  // 3. Back to the last sync's parameters, which the outer optimizer moves along the average; a sync
  // refused on every replica stops here, as a failure, silently.
  restore(f);
  if (!agreed) return false;
  // 4. The averaged pseudo-gradient as the gradient of the outer step, then no gradient at all
  // (torchft's outer zero_grad(), set_to_none).
  int64_t offset = 0;
  for (auto& p : f.params) {
    p.mutable_grad() = flat.narrow(0, offset, p.numel()).view(p.sizes());
    offset += p.numel();
  }
  f.outer->step();
  for (auto& p : f.params) p.mutable_grad() = at::Tensor();
  // 5. The new global parameters are the next round's original; the replica's own share mixed in.
  for (size_t i = 0; i < f.params.size(); ++i) {
    f.original[i].copy_(f.params[i].detach());
    if (alpha > 0.0) f.params[i].detach().lerp_(local[i], alpha);
  }
  return true;
}

}  // namespace dtrain
