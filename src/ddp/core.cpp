// DistributedDataParallel's non-template core: construction (checks, broadcast, buckets, hooks) and
// the per-forward steps. The protocol is described in include/dtrain/ddp.h and src/ddp/reducer.h.
#include <cstdlib>
#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include "ddp/buckets.h"
#include "comm/param_claims.h"
#include "comm/state.h"
#include "comm/model_sync.h"
#include "ddp/pytorch_peers.h"
#include "ddp/reducer.h"
#include "dtrain/ddp.h"

namespace dtrain::detail {
using namespace ddp;   // Reducer
using namespace comm;  // the model checks and state broadcasts
namespace {

bool debug_info() { return get_debug_level() != DebugLevel::OFF; }  // INFO or DETAIL

// DDPOptions::ignored_params as a set, each checked to be one of the module's parameters: a copy
// would be ignored to no effect while the parameter itself got averaged.
std::unordered_set<const c10::TensorImpl*> ddp_ignored_set(const torch::nn::Module& module,
                                                           const std::vector<at::Tensor>& ignored) {
  std::unordered_set<const c10::TensorImpl*> own;
  for (const auto& p : module.parameters()) own.insert(p.unsafeGetTensorImpl());
  std::unordered_set<const c10::TensorImpl*> out;
  for (size_t i = 0; i < ignored.size(); ++i) {
    const at::Tensor& t = ignored[i];
    DTRAIN_CHECK(t.defined() && own.count(t.unsafeGetTensorImpl()), "DistributedDataParallel: ignored_params[", i, "] ",
                 t.defined() ? detail::cat("(shape ", t.sizes(), ")") : std::string("(undefined)"),
                 " is not a parameter of the module: pass the module's own parameter tensors (e.g. "
                 "model->moe->w1), not copies or tensors of another module");
    out.insert(t.unsafeGetTensorImpl());
  }
  return out;
}

}  // namespace

struct DDPCore::Impl {
  std::shared_ptr<torch::nn::Module> module;
  DDPOptions options;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;  // parameters that require grad, registration order, less the ignored
  std::unordered_set<const c10::TensorImpl*> ignored;  // DDPOptions::ignored_params
  bool claimed = false;                                // comm::claim_parameters; released also when construction throws
  ~Impl() {
    if (claimed) comm::release_parameters(params, "DistributedDataParallel");
  }
  std::vector<at::Tensor> buffers;
  std::unique_ptr<Reducer> reducer;
  bool sync = true;
  bool track_unused = false;
  // static_graph: the unused set found on the first iteration, reused afterwards.
  bool have_static_unused = false;
  std::vector<bool> static_unused;
  // From the Join this DDP is in (JoinOptions::divide_by_initial_world_size).
  bool join_divide_by_initial_world_size = true;
  // Note [DDP with PyTorch peers]: this rank's calls are Python DDP's.
  bool pytorch_peers = false;
  bool last_forward_synced = true;  // Python's require_forward_param_sync: the buffers go before the next
  size_t first_cap = 0, cap = 0;    // bucket limits in bytes

  // Every parameter DDP broadcasts (those without a gradient too), less the ignored.
  std::vector<at::Tensor> synced_parameters() const {
    std::vector<at::Tensor> out;
    for (const auto& p : module->parameters())
      if (!ignored.count(p.unsafeGetTensorImpl())) out.push_back(p);
    return out;
  }

  std::vector<bool> find_unused(const std::vector<at::Tensor>& outputs) const {
    std::unordered_set<torch::autograd::Node*> reached;
    for (auto* n : compat::reachable_nodes(outputs)) reached.insert(n);
    std::vector<bool> unused(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      auto acc = torch::autograd::impl::try_get_grad_accumulator(params[i]);
      unused[i] = !acc || reached.count(acc.get()) == 0;
    }
    return unused;
  }
};

DDPCore::DDPCore(std::shared_ptr<torch::nn::Module> module, DDPOptions options) : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  DTRAIN_CHECK(module, "DistributedDataParallel: the module is null: pass a constructed model");
  DTRAIN_CHECK(is_initialized(),
               "DistributedDataParallel needs a process group: call dtrain::init_process_group() first");
  DTRAIN_CHECK(options.bucket_cap_mb() > 0, "bucket_cap_mb must be > 0, got ", options.bucket_cap_mb());
  DTRAIN_CHECK(options.first_bucket_cap_mb() > 0, "first_bucket_cap_mb must be > 0, got ",
               options.first_bucket_cap_mb());
  s.module = std::move(module);
  s.options = std::move(options);
  const Group& group = s.options.process_group();
  s.pytorch_peers = comm::world_state().pytorch_peers;
  DTRAIN_CHECK(group.is_member(), "DistributedDataParallel: rank ", rank(),
               " is not a member of the given process_group: wrap the model only on the group's ranks");
  s.track_unused = s.options.find_unused_parameters() || s.options.static_graph();

  s.ignored = ddp_ignored_set(*s.module, s.options.ignored_params());
  for (const auto& kv : s.module->named_parameters()) {
    if (!kv.value().requires_grad() || s.ignored.count(kv.value().unsafeGetTensorImpl())) continue;
    s.names.push_back(kv.key());
    s.params.push_back(kv.value());
  }
  for (const auto& b : s.module->buffers()) s.buffers.push_back(b);
  DTRAIN_CHECK(!s.params.empty(),
               "DistributedDataParallel: the module has no parameter that requires a gradient: nothing to "
               "synchronize");
  comm::claim_parameters(s.names, s.params, "DistributedDataParallel",
                         "a model is either wrapped by DDP or fully_shard'ed, not both (fully_shard "
                         "already averages the gradients over its group)");
  s.claimed = true;
  s.first_cap = static_cast<size_t>(s.options.first_bucket_cap_mb() * 1048576.0);
  s.cap = static_cast<size_t>(s.options.bucket_cap_mb() * 1048576.0);
  std::vector<std::vector<int>> assignment;
  if (s.pytorch_peers) {
    pytorch_peers::verify_params(s.names, s.params, group);
    std::vector<at::Tensor> state = s.synced_parameters();
    if (s.options.broadcast_buffers()) state.insert(state.end(), s.buffers.begin(), s.buffers.end());
    pytorch_peers::broadcast_coalesced(state, pytorch_peers::kBroadcastBucketBytes, 0, group);
    assignment = pytorch_peers::initial_buckets(s.params, s.first_cap, s.cap, s.options.find_unused_parameters(),
                                                s.options.static_graph());
  } else {
    // Note [Group-agreed ids]: the keys through which the members explain a model mismatch.
    verify_same_model(s.names, s.params, group,
                      detail::cat("ddp/", group.name(), "/", group.next_object_index(), "/model/"));
    std::vector<at::Tensor> state = s.params;
    state.insert(state.end(), s.buffers.begin(), s.buffers.end());
    broadcast_from_first_rank(state, group);
    assignment = assign_buckets(s.params, s.first_cap, s.cap);
  }
  s.reducer = std::make_unique<Reducer>(s.params, s.names, assignment, group, s.options.gradient_as_bucket_view(),
                                        s.track_unused, s.pytorch_peers, s.options.static_graph());
  if (debug_info() && group.rank() == 0) {
    const auto& o = s.options;
    info(detail::cat("[dtrain DDP] ", s.params.size(), " parameters in ", assignment.size(), " buckets (first ",
                     o.first_bucket_cap_mb(), " MB, then ", o.bucket_cap_mb(), " MB), group of ", group.size(),
                     " ranks (", group.backend(), group.uses_shared_memory() ? ", shared memory" : "", "), ",
                     s.buffers.size(), " buffers | broadcast_buffers=", o.broadcast_buffers(),
                     " find_unused_parameters=", o.find_unused_parameters(),
                     " gradient_as_bucket_view=", o.gradient_as_bucket_view(), " static_graph=", o.static_graph(),
                     " ignored_params=", s.ignored.size(), " debug=", to_string(get_debug_level())));
    for (size_t b = 0; b < assignment.size(); ++b) {
      std::string line =
          detail::cat("[dtrain DDP]   bucket ", b, ": ",
                      s.reducer->buckets()[b].buffer.numel() * s.params[assignment[b][0]].element_size(), " bytes:");
      for (int i : assignment[b]) line += " " + s.names[i];
      info(line);
    }
  }
}

DDPCore::~DDPCore() = default;

namespace {

// Python DDP's _find_common_rank: the highest group rank that offers itself (-1: not this one).
int python_common_rank(const Group& group, bool offer) {
  const int64_t r = all_reduce_values(std::vector<int64_t>{offer ? group.rank() : -1}, ReduceOp::MAX, group)[0];
  DTRAIN_CHECK(r >= 0, "rank ", rank(), ": DistributedDataParallel under Join: no rank of the group offered its model");
  // A Python rank's offer is its own business: a value outside the group would name no source for
  // the broadcast that follows.
  DTRAIN_CHECK(r < group.size(), "rank ", rank(),
               ": DistributedDataParallel under Join: the ranks agreed on group rank ", r,
               " (the largest offer) as the one to take the model from, but the group has ", group.size(),
               " ranks (0 to ", group.size() - 1,
               "): a Python rank offered a rank outside it; run the same DistributedDataParallel under Join on every "
               "rank");
  return static_cast<int>(r);
}

// Python DDP's rebuild at the start of an iteration (step 5), an active or a joined rank's.
void python_maybe_rebuild(DDPCore::Impl& s) {
  const auto order = s.reducer->ready_order();
  if (order.empty()) return;
  s.reducer->set_buckets(
      pytorch_peers::rebuilt_buckets(s.params, order, s.first_cap, s.cap, s.options.process_group()));
  s.reducer->stop_recording_order();
}

// Python's buffer broadcast (step 6): from rank 0, or under Join from the rank python_common_rank
// picks (the highest active one).
void python_sync_buffers(DDPCore::Impl& s, bool under_join, bool active) {
  const Group& group = s.options.process_group();
  if (!s.last_forward_synced || !s.options.broadcast_buffers()) return;
  s.buffers = s.module->buffers();  // Python reads them anew: a module may have replaced one
  if (s.buffers.empty()) return;
  const int src = under_join ? python_common_rank(group, active) : 0;
  pytorch_peers::broadcast_coalesced(s.buffers, pytorch_peers::kBroadcastBucketBytes, src, group);
}

// Python DDP's _pre_forward (Note [DDP with PyTorch peers], steps 5-6); under Join (after its
// notification) the buffers' root is agreed on, and whether this iteration synchronizes is told to
// the joined ranks (an all-reduce in the default dtype, as Python's torch.ones(1)).
void python_pre_forward(DDPCore::Impl& s, const JoinIteration* it) {
  const Group& group = s.options.process_group();
  if (at::GradMode::is_enabled()) python_maybe_rebuild(s);
  python_sync_buffers(s, it != nullptr, /*active=*/true);
  if (it) {
    at::Tensor will_sync = at::full({1}, s.sync ? 1.0 : 0.0, at::TensorOptions().dtype(at::get_default_dtype()));
    all_reduce(will_sync, ReduceOp::SUM, group);
  }
  s.reducer->set_divisor(it && !s.join_divide_by_initial_world_size ? it->active_count() : group.size());
}

}  // namespace

void DDPCore::pre_forward(Joinable* self) {
  auto& s = *impl_;
  const Group& group = s.options.process_group();
  const JoinIteration* it = self ? Join::notify_join_context(*self) : nullptr;
  if (s.pytorch_peers) return python_pre_forward(s, it);
  if (!it) {
    s.reducer->set_divisor(group.size());
    // As PyTorch's require_forward_param_sync: not after a no_sync or no-grad forward.
    if (s.options.broadcast_buffers() && !s.buffers.empty() && s.last_forward_synced)
      broadcast_from_first_rank(s.buffers, group);
    return;
  }
  // Under Join (Note [DDP under Join]): whether this iteration synchronizes, then the buffers from
  // the lowest active rank (rank 0 may have joined and stopped updating its own).
  s.reducer->set_divisor(s.join_divide_by_initial_world_size ? group.size() : it->active_count());
  const bool will_sync = s.sync && at::GradMode::is_enabled();
  all_reduce_values(std::vector<int64_t>{will_sync ? 1 : 0}, ReduceOp::SUM, group);
  if (s.options.broadcast_buffers() && !s.buffers.empty() && s.last_forward_synced)
    broadcast_from(s.buffers, it->authoritative_rank(group), group);
}

void DDPCore::post_forward(const std::vector<at::Tensor>& outputs) {
  auto& s = *impl_;
  s.last_forward_synced = s.sync && at::GradMode::is_enabled();
  if (s.pytorch_peers && s.options.static_graph() && s.last_forward_synced) {
    s.reducer->prepare_for_backward({});  // Python's static_graph finds the unused set from the hooks
    return;
  }
  if (!s.sync || !at::GradMode::is_enabled()) {
    s.reducer->disarm();
    return;
  }
  std::vector<bool> unused;
  if (s.options.static_graph() && s.have_static_unused) {
    unused = s.static_unused;
  } else if (s.track_unused) {
    if (outputs.empty())
      warn_once("ddp-no-outputs",
                "DistributedDataParallel: the forward returned no tensor to search for unused parameters; "
                "all parameters are assumed used");
    else
      unused = s.find_unused(outputs);
    if (s.options.static_graph()) {
      s.static_unused = unused;
      s.have_static_unused = true;
    }
  }
  s.reducer->prepare_for_backward(std::move(unused));
}

void DDPCore::set_sync(bool enabled) { impl_->sync = enabled; }
bool DDPCore::sync() const { return impl_->sync; }
const DDPOptions& DDPCore::options() const { return impl_->options; }

std::vector<std::vector<int>> DDPCore::bucket_param_indices() const {
  std::vector<std::vector<int>> out;
  for (const auto& b : impl_->reducer->buckets()) out.push_back(b.params);
  return out;
}

std::vector<DDPEvent> DDPCore::last_backward_events() const { return impl_->reducer->events(); }
void DDPCore::set_event_hook(DDPEventHook hook) { impl_->reducer->set_event_hook(std::move(hook)); }
void DDPCore::register_comm_hook(CommHook hook) {
  DTRAIN_CHECK(!impl_->pytorch_peers, "rank ", rank(),
               ": DistributedDataParallel::register_comm_hook is not available in a job with Python ranks "
               "(DTRAIN_PYTORCH_PEERS): Python's hooks send other collectives; train without a communication hook");
  impl_->reducer->set_comm_hook(std::move(hook));
}

// Note [DDP under Join]: per iteration an active rank's DDP issues, after Join's exchange of the
// active set (its first collective, from pre_forward): (a) a SUM all-reduce of "I synchronize
// gradients this iteration" (no_sync and no-grad forwards say no), (b) the buffers' broadcast from
// the lowest active rank when broadcast_buffers and the previous iteration synchronized, (c) in backward, when
// synchronizing, every bucket's all-reduce (or communication hook) in bucket order, the unused-parameter exchange when
// tracked. The joined rank's main_hook issues the same: (a) with 0, whose sum tells it whether (c) follows, (b), and
// (c) with zeros as its gradients, the results written to its .grad() as the active ranks' are
// (ZeroRedundancyOptimizer's shadow step gets its share's gradients as they are at the active ranks' step() instead:
// Note [ZeRO under Join]). post_hook broadcasts parameters (and buffers when broadcast_buffers) from the lowest rank of
// the last iteration, so every rank ends with the model of a rank that saw every iteration (PyTorch's
// _sync_final_model; Note [Authoritative rank under Join] in dtrain/join.h).
namespace {

class DDPJoinHook : public JoinHook {
 public:
  explicit DDPJoinHook(DDPCore::Impl* impl) : s_(*impl) {}
  void main_hook(const JoinIteration& it) override {
    const Group& group = s_.options.process_group();
    const bool sync = all_reduce_values(std::vector<int64_t>{0}, ReduceOp::SUM, group)[0] > 0;  // (a)
    // (b) as the active ranks decide it: after an iteration that synchronized.
    if (s_.options.broadcast_buffers() && !s_.buffers.empty() && s_.last_forward_synced)
      broadcast_from(s_.buffers, it.authoritative_rank(group), group);
    s_.last_forward_synced = sync;
    if (sync) s_.reducer->shadow_backward();  // (c)
  }
  void post_hook(bool, const JoinIteration& last) override {
    const Group& group = s_.options.process_group();
    std::vector<at::Tensor> state = s_.params;
    if (s_.options.broadcast_buffers()) state.insert(state.end(), s_.buffers.begin(), s_.buffers.end());
    broadcast_from(state, last.authoritative_rank(group), group);
  }

 private:
  DDPCore::Impl& s_;
};

// Python DDP's _DDPJoinHook: a joined rank's iteration (rebuild, buffers from the highest active
// rank, the "synchronize?" all-reduce, then zeros for every bucket and the used map), and
// at the end the model of the highest rank that was active last.
class DDPPythonJoinHook : public JoinHook {
 public:
  explicit DDPPythonJoinHook(DDPCore::Impl* impl) : s_(*impl) {}
  void main_hook(const JoinIteration&) override {
    const Group& group = s_.options.process_group();
    python_maybe_rebuild(s_);
    python_sync_buffers(s_, /*under_join=*/true, /*active=*/false);
    at::Tensor will_sync = at::zeros({1}, at::TensorOptions().dtype(at::get_default_dtype()));
    all_reduce(will_sync, ReduceOp::SUM, group);
    s_.last_forward_synced = will_sync.item<double>() != 0;
    if (!s_.last_forward_synced) return;
    s_.reducer->python_shadow_backward(s_.options.find_unused_parameters());
    s_.reducer->python_offer_registration_order();
  }
  void post_hook(bool is_last_joiner, const JoinIteration&) override {
    const Group& group = s_.options.process_group();
    const int src = python_common_rank(group, is_last_joiner);
    std::vector<at::Tensor> state = s_.synced_parameters();
    if (s_.options.broadcast_buffers()) {
      auto buffers = s_.module->buffers();
      state.insert(state.end(), buffers.begin(), buffers.end());
    }
    pytorch_peers::broadcast_coalesced(state, pytorch_peers::kBroadcastBucketBytes, src, group);
  }

 private:
  DDPCore::Impl& s_;
};

}  // namespace

std::unique_ptr<JoinHook> DDPCore::join_hook(const JoinOptions& options, bool is_first_joinable) {
  if (!options.enable()) return std::make_unique<JoinHook>();
  DTRAIN_CHECK(is_first_joinable,
               "dtrain::Join: DistributedDataParallel must be the first joinable (its forward is the first "
               "collective of an iteration): list it first, e.g. Join({&ddp, &optimizer})");
  impl_->join_divide_by_initial_world_size = options.divide_by_initial_world_size();
  if (impl_->pytorch_peers) return std::make_unique<DDPPythonJoinHook>(impl_.get());
  return std::make_unique<DDPJoinHook>(impl_.get());
}

}  // namespace dtrain::detail
