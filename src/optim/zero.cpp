// ZeroRedundancyOptimizer: partition, sharded step, broadcast, consolidation (see dtrain/zero.h).
#include "dtrain/zero.h"

#include <algorithm>
#include <numeric>
#include <sstream>

#include <ATen/ATen.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "compat/optim_compat.h"
#include "dtrain/errors.h"
#include "optim/state_device.h"

namespace dtrain {
namespace {

std::string to_bytes(const torch::optim::Optimizer& o) {
  torch::serialize::OutputArchive a;
  o.save(a);
  std::ostringstream s;
  a.save_to(s);
  return s.str();
}

void from_bytes(torch::optim::Optimizer& o, const std::string& bytes) {
  torch::serialize::InputArchive a = optim_state::parse_on_cpu(bytes);
  optim_state::load_onto_param_devices(o, a);
}

// Moves the states of `params` from one optimizer to another (both over these tensors).
void move_states(torch::optim::Optimizer& from, torch::optim::Optimizer& to, const std::vector<at::Tensor>& params) {
  for (const at::Tensor& p : params) {
    const auto key = compat::optimizer_state_key(p);
    auto it = from.state().find(key);
    if (it != from.state().end()) to.state()[key] = std::move(it->second);
  }
}

// numel * element_size over the tensors one parameter's state holds, whatever the optimizer: the
// state's own serialize() names them (Adam: exp_avg, exp_avg_sq; SGD: momentum_buffer), and the
// scalars it also writes (Adam's step) are not tensors.
int64_t state_tensor_bytes(const torch::optim::OptimizerParamState& state) {
  torch::serialize::OutputArchive out;
  state.serialize(out);
  std::ostringstream s;
  out.save_to(s);
  const std::string bytes = s.str();
  torch::serialize::InputArchive in;
  in.load_from(bytes.data(), bytes.size());
  int64_t total = 0;
  for (const std::string& key : in.keys()) {
    c10::IValue v;
    if (!in.try_read(key, v) || !v.isTensor() || !v.toTensor().defined()) continue;
    total += v.toTensor().numel() * static_cast<int64_t>(v.toTensor().element_size());
  }
  return total;
}

// Runs of `share` with one dtype and device, each [begin, end).
std::vector<std::pair<size_t, size_t>> uniform_runs(const std::vector<at::Tensor>& share) {
  std::vector<std::pair<size_t, size_t>> runs;
  for (size_t i = 0; i < share.size(); ++i) {
    if (i > 0 && share[i].scalar_type() == share[i - 1].scalar_type() && share[i].device() == share[i - 1].device())
      runs.back().second = i + 1;
    else
      runs.emplace_back(i, i + 1);
  }
  return runs;
}

// Note [ZeRO under Join]: `share`'s gradients as global rank `root` holds them, into the share's
// .grad() where `take`. One buffer per run of equal dtype and device: the values, then one flag per
// parameter (1: defined; 0: undefined there, which makes the optimizer skip it, so it is undefined
// here too).
void broadcast_grads(const std::vector<at::Tensor>& share, int root, bool take, const Group& group) {
  at::NoGradGuard ng;
  const bool is_root = dtrain::rank() == root;
  for (const auto& [begin, end] : uniform_runs(share)) {
    int64_t numel = 0;
    for (size_t i = begin; i < end; ++i) numel += share[i].numel();
    const int64_t count = static_cast<int64_t>(end - begin);
    at::Tensor flat = at::zeros({numel + count}, share[begin].options().requires_grad(false));
    int64_t offset = 0;
    for (size_t i = begin; i < end; ++i) {
      const at::Tensor& g = share[i].grad();
      if (is_root && g.defined()) {
        flat.narrow(0, offset, share[i].numel()).view(share[i].sizes()).copy_(g.is_sparse() ? g.to_dense() : g);
        flat[numel + static_cast<int64_t>(i - begin)] = 1;
      }
      offset += share[i].numel();
    }
    broadcast(flat, root, group);
    if (!take) continue;
    const at::Tensor flags = flat.narrow(0, numel, count).to(at::kCPU, at::kDouble);
    offset = 0;
    for (size_t i = begin; i < end; ++i) {
      at::Tensor p = share[i];
      const at::Tensor values = flat.narrow(0, offset, p.numel()).view(p.sizes());
      offset += p.numel();
      if (flags.data_ptr<double>()[i - begin] == 0)
        p.mutable_grad() = at::Tensor();
      else if (p.grad().defined() && p.grad().sizes() == p.sizes())
        p.mutable_grad().copy_(values);
      else
        p.mutable_grad() = values.clone();
    }
  }
}

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> params, OptimizerFactory factory,
                                                 ZeroOptions options)
    // An optimizer of the wrapped type over all parameters gives the defaults; it allocates no state
    // before its first step.
    : Optimizer(params, factory(params)->defaults().clone()),
      factory_(std::move(factory)),
      group_(options.process_group()),
      params_(std::move(params)) {
  DTRAIN_CHECK(!params_.empty(), "ZeroRedundancyOptimizer: no parameters given: pass the model's parameters()");
  DTRAIN_CHECK(group_.is_member(), "ZeroRedundancyOptimizer: rank ", dtrain::rank(), " is not a member of group '",
               group_.name(), "': construct it only on the group's ranks");
  // Step 1: PyTorch's partition. Largest first (stable, so equal sizes keep their order), each to
  // the first rank with the fewest elements so far.
  const int n = group_.size();
  std::vector<size_t> order(params_.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return params_[a].numel() > params_[b].numel(); });
  std::vector<int64_t> load(n, 0);
  owner_.assign(params_.size(), -1);
  shares_.assign(n, {});
  for (size_t i : order) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner_[i] = r;
    shares_[r].push_back(params_[i]);
    load[r] += params_[i].numel();
  }
  local_ = factory_(shares_[group_.rank()]);
}

// Note [ZeRO under Join]: a joined rank must step, and broadcast its share, exactly when the active
// ranks call step(), which is not once per DDP forward: no_sync micro-batches and no-grad forwards
// are forwards without a step, and GradScaler skips step() after an overflow. So every step() of an
// active rank starts with a Join exchange of its own (Join::notify_own_round; the iteration's
// exchange when ZeRO is the first joinable), and the joined rank runs its shadow step only for such
// a round: it learns from the exchange it posts anyway whether a step follows, and no decision the
// active ranks make before step() (GradScaler's, a user's) needs repeating. The shadow steps with
// the gradients its share has on the lowest active rank at that moment, broadcast to it then (once
// per joined share, only while some rank has joined): those are what the active ranks step with,
// after whatever they did since backward (GradScaler's unscale_, clipping), which the joined rank
// did not do. Then every rank broadcasts its share as in any step. A closure cannot be shadowed (it
// would run the active ranks' forward inside step()): step(closure) inside a Join is refused.
at::Tensor ZeroRedundancyOptimizer::step(LossClosure closure) {
  DTRAIN_CHECK(!closure || join_position() < 0, "ZeroRedundancyOptimizer::step: a closure inside a dtrain::Join ",
               "(rank ", dtrain::rank(), "): a rank that has joined cannot shadow it: run the forward and backward ",
               "before step() and call step() without a closure");
  if (const JoinIteration* it = Join::notify_own_round(*this)) send_joined_grads(*it);
  return step_and_broadcast(std::move(closure));
}

at::Tensor ZeroRedundancyOptimizer::step_and_broadcast(LossClosure closure) {
  // Step 2. A scheduler changes param_groups()[0]'s options: the wrapped optimizer follows.
  local_->param_groups()[0].set_options(param_groups()[0].options().clone());
  at::Tensor loss = local_->step(std::move(closure));
  broadcast_shares();
  return loss;
}

// Note [ZeRO under Join]: the gradients of every joined rank's share, from the lowest active rank
// to that rank; the same calls on every rank of the group, active or joined.
void ZeroRedundancyOptimizer::send_joined_grads(const JoinIteration& it) {
  const int root = it.authoritative_rank(group_);
  const int me = group_.rank();
  for (int r = 0; r < group_.size(); ++r) {
    if (std::binary_search(it.active.begin(), it.active.end(), r) || shares_[r].empty()) continue;
    broadcast_grads(shares_[r], root, /*take=*/r == me, group_);
  }
}

// Each share travels as one flat buffer (one broadcast per rank instead of
// one per parameter). The buffers are kept from step to step, as PyTorch's ZeRO keeps its buckets:
// allocating a model-sized buffer every step costs a fresh mapping and its page faults each time.
// They are re-made only when a share's size, dtype or device no longer matches (e.g. module.to()
// after construction); the partition itself is fixed at construction.
void ZeroRedundancyOptimizer::broadcast_shares() {
  at::NoGradGuard ng;
  const int me = group_.rank();
  flats_.resize(shares_.size());
  std::vector<bool> flat_used(shares_.size(), false);
  std::vector<Work> works;
  for (size_t r = 0; r < shares_.size(); ++r) {
    const auto& share = shares_[r];
    if (share.empty()) continue;
    const bool uniform = std::all_of(share.begin(), share.end(), [&](const at::Tensor& p) {
      return p.scalar_type() == share[0].scalar_type() && p.device() == share[0].device();
    });
    if (!uniform) {  // mixed dtypes: one broadcast per parameter
      for (const at::Tensor& p : share) {
        at::Tensor d = p.detach();
        works.push_back(broadcast(d, group_.ranks()[r], group_, /*async_op=*/true));
      }
      continue;
    }
    int64_t numel = 0;
    for (const at::Tensor& p : share) numel += p.numel();
    at::Tensor& flat = flats_[r];
    if (!flat.defined() || flat.numel() != numel || flat.scalar_type() != share[0].scalar_type() ||
        flat.device() != share[0].device())
      flat = at::empty({numel}, share[0].options().requires_grad(false));
    if (static_cast<int>(r) == me) {
      int64_t offset = 0;
      for (const at::Tensor& p : share) {
        flat.narrow(0, offset, p.numel()).view(p.sizes()).copy_(p.detach());
        offset += p.numel();
      }
    }
    flat_used[r] = true;
    works.push_back(broadcast(flat, group_.ranks()[r], group_, /*async_op=*/true));
  }
  // Every broadcast completes here, so the next step may refill the buffers.
  for (auto& w : works) w.wait();
  for (size_t r = 0; r < shares_.size(); ++r) {
    if (static_cast<int>(r) == me || !flat_used[r]) continue;
    int64_t offset = 0;
    for (const at::Tensor& p : shares_[r]) {
      p.detach().copy_(flats_[r].narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
    }
  }
}

void ZeroRedundancyOptimizer::shadow_step(const JoinIteration& it) {
  send_joined_grads(it);
  step_and_broadcast(nullptr);
}

namespace {

// Note [ZeRO under Join]: the joined rank's step, in the rounds that the active ranks' step()
// starts only (an iteration's hooks all run for every DDP forward: not ours, unless we are first).
class ZeroJoinHook : public JoinHook {
 public:
  ZeroJoinHook(int position, std::function<void(const JoinIteration&)> shadow)
      : position_(position), shadow_(std::move(shadow)) {}
  void main_hook(const JoinIteration& it) override {
    if (it.joinable == position_) shadow_(it);
  }

 private:
  int position_;
  std::function<void(const JoinIteration&)> shadow_;
};

}  // namespace

std::unique_ptr<JoinHook> ZeroRedundancyOptimizer::join_hook(const JoinOptions& options) {
  if (!options.enable()) return std::make_unique<JoinHook>();
  return std::make_unique<ZeroJoinHook>(join_position(), [this](const JoinIteration& it) { shadow_step(it); });
}

void ZeroRedundancyOptimizer::consolidate_state_dict(int to) {
  DTRAIN_CHECK(
      group_.is_member() && std::find(group_.ranks().begin(), group_.ranks().end(), to) != group_.ranks().end(),
      "ZeroRedundancyOptimizer::consolidate_state_dict: rank ", to, " is not a member of group '", group_.name(),
      "': consolidate to one of its ranks");
  local_->param_groups()[0].set_options(param_groups()[0].options().clone());
  const std::vector<std::string> all = gather_bytes(to_bytes(*local_), to, group_);
  consolidated_.reset();
  if (dtrain::rank() != to) return;
  // An unsharded optimizer of the wrapped type, given every share's state: its save() is the
  // format of a run without ZeRO.
  auto whole = factory_(params_);
  whole->param_groups()[0].set_options(local_->param_groups()[0].options().clone());
  for (size_t r = 0; r < shares_.size(); ++r) {
    auto part = factory_(shares_[r]);
    from_bytes(*part, all[r]);
    move_states(*part, *whole, shares_[r]);
  }
  consolidated_ = std::move(whole);
}

void ZeroRedundancyOptimizer::save(torch::serialize::OutputArchive& archive) const {
  DTRAIN_CHECK(consolidated_ != nullptr, "ZeroRedundancyOptimizer::save on rank ", dtrain::rank(),
               ", which does not hold the consolidated state: call consolidate_state_dict(", dtrain::rank(),
               ") on every rank of the group first (dtrain's CheckpointManager does)");
  consolidated_->save(archive);
}

void ZeroRedundancyOptimizer::load(torch::serialize::InputArchive& archive) {
  auto whole = factory_(params_);
  optim_state::load_onto_param_devices(*whole, archive);
  local_->state().clear();
  move_states(*whole, *local_, shares_[group_.rank()]);
  param_groups()[0].set_options(whole->param_groups()[0].options().clone());
  local_->param_groups()[0].set_options(whole->param_groups()[0].options().clone());
}

int64_t ZeroRedundancyOptimizer::local_state_bytes() const {
  int64_t bytes = 0;
  for (const auto& kv : local_->state()) bytes += state_tensor_bytes(*kv.second);
  return bytes;
}

}  // namespace dtrain
