// DistributedDataParallel for LibTorch modules: torch.nn.parallel.DistributedDataParallel in C++.
//
//   dtrain::init_process_group();
//   auto model = std::make_shared<Net>();                      // or a ModuleHolder: Net model;
//   dtrain::DistributedDataParallel ddp(model, dtrain::DDPOptions().bucket_cap_mb(25));
//   torch::optim::SGD opt(ddp.parameters(), 0.1);
//   auto loss = torch::mse_loss(ddp.forward(x), y);            // or ddp(x)
//   opt.zero_grad(); loss.backward();                          // grads now averaged over ranks
//   opt.step();
//   { auto guard = ddp.no_sync(); ddp(x2).sum().backward(); }  // accumulate locally, no communication
//
// What a caller may rely on (PyTorch's semantics):
// - Construction is collective: every rank must hold the same parameters (names, shapes, dtypes;
//   otherwise a clear error on every rank), and then holds rank 0's parameters and buffers.
// - After loss.backward() on every rank, every param.grad() holds the gradient averaged over the
//   group (summed and divided by its size, or whatever a registered communication hook returns,
//   dtrain/comm_hooks.h); the all-reduces overlap backward, bucket by bucket.
// - Under no_sync() backward only accumulates locally; the next synchronized backward averages
//   the sum. With find_unused_parameters, parameters no rank used keep their .grad() untouched.
// - DDPOptions::ignored_params are none of DDP's business: each rank keeps its own values and
//   gradients (e.g. experts sharded over an ep group, averaged by the caller where replicated).
// - Every rank runs forward and backward the same number of times (uneven inputs: dtrain/join.h).
// - With PyTorch peers (InitOptions::pytorch_peers: some ranks are Python programs) every call is
//   Python DDP's, so Python's DistributedDataParallel ranks and these train one model
//   (Note [DDP with PyTorch peers]);
//   register_comm_hook is refused there, and a Join follows Python's.
// The protocol: docs/design.md, "Data flow of a DDP step", and src/ddp/reducer.h.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "dtrain/comm_hooks.h"
#include "dtrain/detail/arg.h"
#include "dtrain/detail/collect_tensors.h"
#include "dtrain/join.h"
#include "dtrain/process_group.h"

namespace dtrain {

constexpr double kDefaultBucketCapMB = 25.0;      // PyTorch's bucket_cap_mb
constexpr double kDefaultFirstBucketCapMB = 1.0;  // PyTorch's _DEFAULT_FIRST_BUCKET_BYTES

struct DDPOptions {
  // Maximum size of a gradient bucket after the first, in MiB (> 0).
  DTRAIN_ARG(double, bucket_cap_mb, kDefaultBucketCapMB)
  // Size of the first bucket (the last layers' gradients, ready first), in MiB (> 0).
  DTRAIN_ARG(double, first_bucket_cap_mb, kDefaultFirstBucketCapMB)
  // Broadcast buffers (e.g. BatchNorm running stats) from rank 0 before each forward that follows a
  // synchronized one (PyTorch's require_forward_param_sync: not after a no_sync or no-grad forward).
  DTRAIN_ARG(bool, broadcast_buffers, true)
  // Search the autograd graph after each forward for parameters that will get no gradient and mark
  // them ready; without it, an unused parameter is an error naming it.
  DTRAIN_ARG(bool, find_unused_parameters, false)
  // Gradients become views into the communication buckets: no copy, less memory.
  DTRAIN_ARG(bool, gradient_as_bucket_view, false)
  // The set of used parameters never changes: it is found once (first iteration) and reused.
  DTRAIN_ARG(bool, static_graph, false)
  // The group to average over (default: the world).
  DTRAIN_ARG(Group, process_group, Group())
  // Parameters of the module that DDP leaves alone (PyTorch's
  // _set_params_and_buffers_to_ignore_for_model, FSDP2's ignored_params): not compared across
  // ranks, broadcast, bucketed nor averaged; their .grad() is what backward computed. E.g. an
  // expert-parallel MoE's experts, which differ between ranks (dtrain/expert_parallel.h). Each must
  // be a parameter of the module (the tensor itself, not a copy).
  DTRAIN_ARG(std::vector<at::Tensor>, ignored_params, {})
};

// One event of a synchronized backward (for tests, monitoring and timelines):
//   kGradReady       parameter `index`'s gradient is ready (in its bucket, unless the last bucket is
//                    reduced in the gradients themselves)
//   kBucketLaunched  bucket `index`'s asynchronous all-reduce started
//   kBackwardEnd     autograd produced the last gradient; DDP starts waiting for the buckets (index -1;
//                    time_ns: when the last bucket was launched, which DDP reduces on the backward
//                    thread, so the event is delivered once that reduction is done)
//   kBucketDone      bucket `index`'s all-reduce finished (time_ns: when the work completed, taken
//                    from its completion callback; the event itself is delivered after kBackwardEnd)
//   kGradsSynced     every .grad() holds the average; backward() returns next (index -1)
struct DDPEvent {
  enum class Kind { kGradReady, kBucketLaunched, kBucketDone, kBackwardEnd, kGradsSynced };
  Kind kind;
  int index;        // parameter index (kGradReady), bucket index, or -1
  int64_t time_ns;  // steady clock

  // The unscoped names of before, kept for one release: DDPEvent::kGradReady is DDPEvent::Kind::kGradReady.
  [[deprecated("use DDPEvent::Kind::kGradReady")]] static constexpr Kind kGradReady = Kind::kGradReady;
  [[deprecated("use DDPEvent::Kind::kBucketLaunched")]] static constexpr Kind kBucketLaunched = Kind::kBucketLaunched;
  [[deprecated("use DDPEvent::Kind::kBucketDone")]] static constexpr Kind kBucketDone = Kind::kBucketDone;
  [[deprecated("use DDPEvent::Kind::kBackwardEnd")]] static constexpr Kind kBackwardEnd = Kind::kBackwardEnd;
  [[deprecated("use DDPEvent::Kind::kGradsSynced")]] static constexpr Kind kGradsSynced = Kind::kGradsSynced;
};
// Called for every DDPEvent as it is recorded, on the thread that runs backward. Keep it cheap.
using DDPEventHook = std::function<void(const DDPEvent&)>;

template <typename ModuleType>
class DistributedDataParallel;

namespace detail {

// Not API: DistributedDataParallel's non-template core (buckets, hooks and collectives, src/ddp/),
// here only because the class template calls it.
class DDPCore {
 public:
  DDPCore(std::shared_ptr<torch::nn::Module> module, DDPOptions options);
  ~DDPCore();
  // self: the DistributedDataParallel around this core, as a Join knows it (null: no Join, e.g. a
  // pipeline's replicas).
  void pre_forward(Joinable* self = nullptr);
  // outputs: the tensors the forward produced (used for find_unused_parameters).
  void post_forward(const std::vector<at::Tensor>& outputs);
  void set_sync(bool enabled);
  bool sync() const;
  const DDPOptions& options() const;
  std::vector<std::vector<int>> bucket_param_indices() const;  // by bucket, parameter indices
  std::vector<DDPEvent> last_backward_events() const;
  void set_event_hook(DDPEventHook hook);
  void register_comm_hook(CommHook hook);
  // The shadow of a forward and backward for a rank that has joined (end of src/ddp/core.cpp).
  std::unique_ptr<JoinHook> join_hook(const JoinOptions& options, bool is_first_joinable);

  struct Impl;  // src/ddp/core.cpp (its join hook reaches it too)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace detail

// RAII scope from DistributedDataParallel::no_sync(): backward passes inside accumulate gradients
// locally; the first synchronized backward after it all-reduces the accumulated sum.
class NoSyncGuard {
 public:
  ~NoSyncGuard() {
    if (core_) core_->set_sync(prev_);
  }
  NoSyncGuard(NoSyncGuard&& o) noexcept : core_(o.core_), prev_(o.prev_) { o.core_ = nullptr; }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;

 private:
  template <typename ModuleType>
  friend class DistributedDataParallel;
  explicit NoSyncGuard(detail::DDPCore* core) : core_(core), prev_(core->sync()) { core_->set_sync(false); }
  detail::DDPCore* core_;
  bool prev_;
};

// A Joinable (dtrain/join.h): inside a dtrain::Join, where it must be the first joinable, a rank
// that has run out of batches shadows the others' forwards and backwards (buffer broadcasts and
// gradient all-reduces, with zeros as its gradients), and at the end every rank gets the model of
// the last rank to finish.
template <typename ModuleType>
class DistributedDataParallel : public Joinable {
 public:
  explicit DistributedDataParallel(std::shared_ptr<ModuleType> module, DDPOptions options = DDPOptions())
      : module_(std::move(module)), core_(std::make_unique<detail::DDPCore>(module_, std::move(options))) {}
  explicit DistributedDataParallel(torch::nn::ModuleHolder<ModuleType> holder, DDPOptions options = DDPOptions())
      : DistributedDataParallel(holder.ptr(), std::move(options)) {}

  // Runs the wrapped module's forward with DDP's pre/post steps.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    core_->pre_forward(this);
    auto out = module_->forward(std::forward<Args>(args)...);
    std::vector<at::Tensor> tensors;
    detail::collect_tensors(out, tensors);
    core_->post_forward(tensors);
    return out;
  }
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // The wrapped model (save it to get the model's own parameter names).
  const std::shared_ptr<ModuleType>& module() const { return module_; }
  std::vector<at::Tensor> parameters(bool recurse = true) const { return module_->parameters(recurse); }
  torch::OrderedDict<std::string, at::Tensor> named_parameters(bool recurse = true) const {
    return module_->named_parameters(recurse);
  }
  void train(bool on = true) { module_->train(on); }
  void eval() { module_->eval(); }

  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(core_.get()); }

  const DDPOptions& options() const { return core_->options(); }
  std::vector<std::vector<int>> bucket_param_indices() const { return core_->bucket_param_indices(); }
  std::vector<DDPEvent> last_backward_events() const { return core_->last_backward_events(); }
  // Sees every DDPEvent as it happens (dtrain::Monitor::watch uses it); an empty hook removes it.
  void set_event_hook(DDPEventHook hook) { core_->set_event_hook(std::move(hook)); }

  // PyTorch's register_comm_hook(state, hook): hook(state, bucket) -> dtrain::Future replaces the
  // averaging all-reduce of every bucket (dtrain/comm_hooks.h: built-ins, Note [Comm hook futures]).
  // Once, before the first backward. The state is kept by value (std::ref(s) keeps yours; Group and
  // PowerSGDState are handles whose copies share everything).
  //   ddp.register_comm_hook(dtrain::Group(), dtrain::fp16_compress_hook);
  template <typename State, typename Hook>
  void register_comm_hook(State state, Hook hook) {
    core_->register_comm_hook(detail::bind_comm_hook(std::move(state), std::move(hook)));
  }
  // A hook that carries its own state (a lambda or functor taking GradBucket&).
  void register_comm_hook(CommHook hook) { core_->register_comm_hook(std::move(hook)); }

  // Joinable: what a joined rank runs in place of a forward and backward.
  std::unique_ptr<JoinHook> join_hook(const JoinOptions& options) override {
    return core_->join_hook(options, is_first_joinable());
  }
  Group join_process_group() const override { return core_->options().process_group(); }

 private:
  std::shared_ptr<ModuleType> module_;
  std::unique_ptr<detail::DDPCore> core_;
};

template <typename M>
DistributedDataParallel(std::shared_ptr<M>, DDPOptions = DDPOptions()) -> DistributedDataParallel<M>;
template <typename M>
DistributedDataParallel(torch::nn::ModuleHolder<M>, DDPOptions = DDPOptions()) -> DistributedDataParallel<M>;

}  // namespace dtrain
