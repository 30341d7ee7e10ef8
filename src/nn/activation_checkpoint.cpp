// Activation checkpointing (see dtrain/activation_checkpoint.h): a custom autograd function whose
// forward runs fn without grad and whose backward runs it again with grad.
//
// Note [Checkpoint parameters as inputs]: PyTorch's non-reentrant checkpoint keeps the recompute in
// the backward pass that is running through saved-tensor hooks, which LibTorch 1.13's C++ API
// lacks. Here the named parameters are inputs of the checkpoint's node instead: the node's backward
// recomputes fn and asks autograd::grad for the gradients of the detached inputs and of the
// parameters, and returns them as its own, so the running backward pass accumulates them into
// .grad() through the parameters' own AccumulateGrad nodes. DDP's and fully_shard's hooks on those
// nodes fire as without checkpointing, DDP's unused-parameter search finds them behind the node,
// and fully_shard's unit, whose pre-backward hook on the node's output has gathered the parameters
// again, sees whole gradients of the whole shapes the node recorded in forward. Parameters fn
// captures without naming them can only be reached by a nested backward (torch::autograd::backward
// inside this node's, as PyTorch's reentrant checkpoint), which accumulates them outside the
// running pass: the fallback when none are named.
#include <algorithm>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/core/ivalue.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/autograd.h>
#include <torch/custom_class.h>

#include "compat/amp_compat.h"
#include "dtrain/activation_checkpoint.h"
#include "dtrain/detail/element_wrapper.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace {

// The RNG states of a forward: the default CPU generator's, and the default generator's of each
// CUDA device among the tensors (as torch.utils.checkpoint's get_device_states).
struct RngStates {
  std::vector<std::pair<at::Generator, at::Tensor>> states;

  static RngStates capture(const std::vector<at::Tensor>& tensors) {
    RngStates out;
    out.add(at::detail::getDefaultCPUGenerator());
    if (!at::detail::getCUDAHooks().hasCUDA()) return out;
    std::vector<c10::DeviceIndex> seen;
    for (const auto& t : tensors) {
      if (!t.defined() || !t.is_cuda()) continue;
      const auto index = t.device().index();
      if (std::find(seen.begin(), seen.end(), index) != seen.end()) continue;
      seen.push_back(index);
      out.add(at::globalContext().defaultGenerator(at::Device(at::kCUDA, index)));
    }
    return out;
  }
  void add(at::Generator gen) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    at::Tensor state = gen.get_state();
    states.emplace_back(std::move(gen), std::move(state));
  }
  void restore() {
    for (auto& [gen, state] : states) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }
};

// Puts the forward's RNG and autocast states in place for the recompute, and the current ones back
// after (also when fn throws): the RNG outside moves on as if the recompute had not run. The
// recompute is an autocast scope of its own, as PyTorch's `with torch.autocast(...)` around it: the
// casts of the parameters it caches are dropped when it ends, or the next forward, after the
// optimizer changed the parameters in place, would read the stale low-precision copies.
class ForwardStateScope {
 public:
  ForwardStateScope(RngStates* forward_rng, compat::AutocastState cpu, compat::AutocastState cuda, bool cache)
      : cpu_(compat::get_autocast(c10::DeviceType::CPU)),
        cuda_(compat::get_autocast(c10::DeviceType::CUDA)),
        cache_(compat::autocast_cache_enabled()) {
    if (forward_rng) {
      for (auto& [gen, state] : forward_rng->states) current_.add(gen);
      forward_rng->restore();
    }
    compat::set_autocast(c10::DeviceType::CPU, cpu);
    compat::set_autocast(c10::DeviceType::CUDA, cuda);
    compat::set_autocast_cache_enabled(cache);
    compat::autocast_increment_nesting();
  }
  ~ForwardStateScope() {
    compat::autocast_decrement_nesting();  // clears the cast cache at the outermost scope
    current_.restore();
    compat::set_autocast(c10::DeviceType::CPU, cpu_);
    compat::set_autocast(c10::DeviceType::CUDA, cuda_);
    compat::set_autocast_cache_enabled(cache_);
  }
  ForwardStateScope(const ForwardStateScope&) = delete;
  ForwardStateScope& operator=(const ForwardStateScope&) = delete;

 private:
  RngStates current_;
  compat::AutocastState cpu_, cuda_;
  bool cache_;
};

// What backward needs besides the saved tensors; held by the node through an IValue capsule.
struct CheckpointState : torch::CustomClassHolder {
  CheckpointFunction fn;
  size_t num_inputs = 0;
  bool named_parameters = false;
  bool preserve_rng = true;
  std::vector<bool> input_requires_grad;
  RngStates rng;
  compat::AutocastState cpu_autocast{}, cuda_autocast{};
  bool autocast_cache = true;
  // determinism_check "default": the forward output's metadata, compared with the recompute's.
  bool check_metadata = true;
  std::string forward_metadata;
  // Note [Checkpoint partial backward]: a recompute kept for the backward that asks for the rest.
  at::Tensor kept_out;
  std::vector<at::Tensor> kept_targets;  // the detached inputs, then the parameters
  std::vector<bool> served;              // which of them a backward since the recompute asked for
};

std::string describe_metadata(const at::Tensor& t) {
  std::ostringstream os;
  os << "shape " << t.sizes() << ", dtype " << t.scalar_type() << ", device " << t.device();
  return os.str();
}

bool valid_determinism_check(const std::string& mode) { return mode == "default" || mode == "none"; }

// Recomputes fn on detached copies of the inputs; returns its output, checked against the forward's.
at::Tensor recompute(CheckpointState& state, std::vector<at::Tensor>& detached) {
  at::Tensor out;
  {
    ForwardStateScope scope(state.preserve_rng ? &state.rng : nullptr, state.cpu_autocast, state.cuda_autocast,
                            state.autocast_cache);
    torch::AutoGradMode grad(true);
    out = state.fn(detached);
  }
  DTRAIN_CHECK(out.defined(),
               "checkpoint: fn returned an undefined tensor in the recompute: return the function's "
               "output");
  if (state.check_metadata) {
    const std::string now = describe_metadata(out);
    DTRAIN_CHECK(now == state.forward_metadata, "checkpoint: the recomputed output has ", now,
                 " but the forward's had ", state.forward_metadata,
                 ": fn must compute the same in backward as in forward (does it depend on state that changed?); "
                 "ActivationCheckpointOptions().determinism_check(\"none\") turns this check off");
  }
  DTRAIN_CHECK(out.requires_grad(),
               "checkpoint: fn's output does not require grad though its inputs or parameters do (fn detached it "
               "or ran under NoGradGuard): return a tensor computed from them with grad mode on");
  return out;
}

std::vector<at::Tensor> detached_inputs(const CheckpointState& state, const std::vector<at::Tensor>& saved) {
  std::vector<at::Tensor> detached;
  for (size_t i = 0; i < state.num_inputs; ++i) {
    at::Tensor d = saved[i].defined() ? saved[i].detach() : saved[i];
    if (d.defined()) d.requires_grad_(state.input_requires_grad[i]);
    detached.push_back(d);
  }
  return detached;
}

// No parameters named: a nested backward accumulates the captured ones (the reentrant way).
torch::autograd::variable_list nested_backward(CheckpointState& state, const std::vector<at::Tensor>& saved,
                                               const at::Tensor& grad_output) {
  std::vector<at::Tensor> detached = detached_inputs(state, saved);
  at::Tensor out = recompute(state, detached);
  torch::autograd::variable_list result(saved.size() + 1);
  torch::autograd::backward({out}, {grad_output});
  for (size_t i = 0; i < detached.size(); ++i)
    if (detached[i].defined() && detached[i].requires_grad()) result[i] = detached[i].grad();
  return result;
}

// Note [Checkpoint partial backward]: autograd asks a node only for the gradients its graph task
// needs (needs_input_grad). The zero-bubble pipeline's B asks for the input's, keeping the graph, and
// its W later for the parameters'. Recomputing in each would run fn three times; instead the first
// backward that leaves some differentiable tensor unasked keeps the recomputed output (and so its
// graph), and the next takes its gradients from it, releasing it once every one has been asked for.
// The parameters' gradients are computed only when asked for, as without checkpointing.
torch::autograd::variable_list named_backward(torch::autograd::AutogradContext* ctx, CheckpointState& state,
                                              const std::vector<at::Tensor>& saved, const at::Tensor& grad_output) {
  if (!state.kept_out.defined()) {
    std::vector<at::Tensor> targets = detached_inputs(state, saved);
    targets.insert(targets.end(), saved.begin() + static_cast<std::ptrdiff_t>(state.num_inputs), saved.end());
    state.kept_out = recompute(state, targets);
    state.kept_targets = std::move(targets);
    state.served.assign(saved.size(), false);
  }
  std::vector<at::Tensor> asked;
  std::vector<size_t> where;
  bool rest = false;  // a differentiable tensor no backward has asked for yet
  for (size_t i = 0; i < saved.size(); ++i) {
    const at::Tensor& t = state.kept_targets[i];
    if (!t.defined() || !t.requires_grad()) continue;
    if (ctx->needs_input_grad(i)) {
      asked.push_back(t);
      where.push_back(i);
      state.served[i] = true;
    } else if (!state.served[i]) {
      rest = true;
    }
  }
  torch::autograd::variable_list result(saved.size() + 1);  // one per tensor of forward, none for the state
  if (!asked.empty()) {
    auto grads = torch::autograd::grad({state.kept_out}, asked, {grad_output}, /*retain_graph=*/rest,
                                       /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t k = 0; k < grads.size(); ++k) result[where[k]] = grads[k];
  }
  if (!rest) {
    state.kept_out = at::Tensor();
    state.kept_targets.clear();
  }
  return result;
}

class CheckpointNode : public torch::autograd::Function<CheckpointNode> {
 public:
  // `tensors`: fn's inputs, then the named parameters.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList tensors,
                            const c10::intrusive_ptr<CheckpointState>& state) {
    std::vector<at::Tensor> all(tensors.begin(), tensors.end());
    std::vector<at::Tensor> inputs(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(state->num_inputs));
    if (state->preserve_rng) state->rng = RngStates::capture(all);
    state->cpu_autocast = compat::get_autocast(c10::DeviceType::CPU);
    state->cuda_autocast = compat::get_autocast(c10::DeviceType::CUDA);
    state->autocast_cache = compat::autocast_cache_enabled();
    at::Tensor out = state->fn(inputs);  // grad mode is off inside a Function's forward
    DTRAIN_CHECK(out.defined(), "checkpoint: fn returned an undefined tensor: return the function's output");
    if (state->check_metadata) state->forward_metadata = describe_metadata(out);
    ctx->save_for_backward(all);
    ctx->saved_data["state"] = at::IValue::make_capsule(state);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(ctx->saved_data["state"].toCapsule());
    std::vector<at::Tensor> saved = ctx->get_saved_variables();
    if (!state->named_parameters) return nested_backward(*state, saved, grad_outputs[0]);
    return named_backward(ctx, *state, saved, grad_outputs[0]);
  }
};

}  // namespace

at::Tensor checkpoint(CheckpointFunction fn, const std::vector<at::Tensor>& inputs,
                      const ActivationCheckpointOptions& options) {
  DTRAIN_CHECK(fn, "checkpoint: fn is empty: pass the function to run");
  DTRAIN_CHECK(valid_determinism_check(options.determinism_check()), "checkpoint: determinism_check is \"",
               options.determinism_check(), "\"; it must be \"default\" or \"none\" (PyTorch's two modes)");
  auto needs_grad = [](const at::Tensor& t) { return t.defined() && t.requires_grad(); };
  const auto& params = options.parameters();
  const bool any =
      std::any_of(inputs.begin(), inputs.end(), needs_grad) || std::any_of(params.begin(), params.end(), needs_grad);
  // Nothing to recompute for, or nothing that ties fn's unnamed parameters to the graph: run as is.
  if (!at::GradMode::is_enabled() || !any) return fn(inputs);
  auto state = c10::make_intrusive<CheckpointState>();
  state->fn = std::move(fn);
  state->num_inputs = inputs.size();
  state->named_parameters = !params.empty();
  state->preserve_rng = options.preserve_rng_state();
  state->check_metadata = options.determinism_check() == "default";
  for (const auto& t : inputs) state->input_requires_grad.push_back(needs_grad(t));
  std::vector<at::Tensor> tensors(inputs);
  tensors.insert(tensors.end(), params.begin(), params.end());
  return CheckpointNode::apply(at::TensorList(tensors), state);
}

CheckpointWrapperImpl::CheckpointWrapperImpl(torch::nn::AnyModule inner, ActivationCheckpointOptions options)
    : inner_(std::move(inner)), options_(std::move(options)) {
  DTRAIN_CHECK(!inner_.is_empty(), "checkpoint_wrapper: the module is empty: pass a module");
  // A wrapper inside a wrapper would recompute the inner recompute: twice the cost for nothing.
  if (auto wrapped = std::dynamic_pointer_cast<CheckpointWrapperImpl>(inner_.ptr())) {
    throw Error(detail::cat("checkpoint_wrapper: ", wrapped->inner().ptr()->name(),
                            " is already checkpointed (it is inside a CheckpointWrapper): checkpoint each module once; "
                            "pass the module itself, or use the wrapper you have"));
  }
  DTRAIN_CHECK(valid_determinism_check(options_.determinism_check()), "checkpoint_wrapper: determinism_check is \"",
               options_.determinism_check(), "\"; it must be \"default\" or \"none\" (PyTorch's two modes)");
  register_module("module", inner_.ptr());
}

at::Tensor CheckpointWrapperImpl::forward(at::Tensor x) {
  ActivationCheckpointOptions options = options_;
  options.parameters(inner_.ptr()->parameters());
  return checkpoint([this](const std::vector<at::Tensor>& in) { return inner_.forward(in[0]); }, {std::move(x)},
                    options);
}

namespace {

// A Sequential element checkpointed in place. The Sequential still registers the element itself, so
// its tree and parameter names are the element's; fully_shard(AnyModule&) of this wrapper makes the
// unit of the element and runs the wrapper inside the unit (Note [Elements wrapped in place]).
class InPlaceCheckpointWrapperImpl : public CheckpointWrapperImpl, public detail::ElementWrapper {
 public:
  using CheckpointWrapperImpl::CheckpointWrapperImpl;
  std::shared_ptr<torch::nn::Module> wrapped() const override { return inner().ptr(); }
};

}  // namespace

void checkpoint_wrapper(torch::nn::AnyModule& element, ActivationCheckpointOptions options) {
  DTRAIN_CHECK(!element.is_empty(), "checkpoint_wrapper: the Sequential element is empty");
  element =
      torch::nn::AnyModule(std::make_shared<InPlaceCheckpointWrapperImpl>(std::move(element), std::move(options)));
}

at::Tensor checkpoint_sequential(const torch::nn::Sequential& seq, int64_t segments, const at::Tensor& x,
                                 const ActivationCheckpointOptions& options) {
  auto impl = seq.ptr();
  const auto size = static_cast<int64_t>(impl->size());
  DTRAIN_CHECK(segments >= 1 && segments <= size, "checkpoint_sequential: segments is ", segments,
               "; it must be between 1 and the Sequential's size (", size, ")");
  // As PyTorch: segments - 1 checkpointed runs of size / segments elements, then the rest as is.
  const int64_t per = size / segments;
  auto run = [impl](int64_t begin, int64_t end, at::Tensor t) {
    for (int64_t i = begin; i < end; ++i) t = (impl->begin() + i)->forward(std::move(t));
    return t;
  };
  at::Tensor out = x;
  for (int64_t s = 0; s + 1 < segments; ++s) {
    const int64_t begin = s * per, end = begin + per;
    ActivationCheckpointOptions o = options;
    std::vector<at::Tensor> params;
    for (int64_t i = begin; i < end; ++i)
      for (auto& p : impl->ptr(static_cast<size_t>(i))->parameters()) params.push_back(p);
    o.parameters(std::move(params));
    out = checkpoint([run, begin, end](const std::vector<at::Tensor>& in) { return run(begin, end, in[0]); }, {out}, o);
  }
  return run((segments - 1) * per, size, out);
}

}  // namespace dtrain
