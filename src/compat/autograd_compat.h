// Autograd internals DDP relies on, in one place (their headers and signatures move between LibTorch
// versions). Verified against LibTorch 1.13 and 2.15.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/variable.h>

namespace dtrain::compat {

// How autograd owns its nodes: std::shared_ptr in LibTorch 1.13, c10::intrusive_ptr in recent 2.x.
// Taken from the accessor itself, so each LibTorch gets its own without a version table.
using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// The AccumulateGrad node of a leaf tensor that requires grad (created if needed). Keep the
// returned pointer alive: the variable holds it only weakly, and its hooks die with it.
NodePtr grad_accumulator(const at::Tensor& leaf);

// Makes `accumulator` the leaf's accumulator again. Changing a leaf's dtype or device with set_data
// drops autograd's (weak) link to its accumulator, so the next use would make a new one without
// the hooks; fully_shard, which moves parameters between dtypes (mixed precision), relinks the one
// it hooked and keeps alive. The accumulator's own metadata is not changed.
void relink_grad_accumulator(const at::Tensor& leaf, const NodePtr& accumulator);

// Calls fn() every time `accumulator` has accumulated a gradient into its variable's .grad().
// Returns a key for remove_post_hook.
uintptr_t add_post_hook(const NodePtr& accumulator, std::function<void()> fn);
void remove_post_hook(const NodePtr& accumulator, uintptr_t key);

// Runs fn at the end of the backward pass that is executing now (call from inside a hook).
void queue_end_of_backward_callback(std::function<void()> fn);

// Makes `output`, computed under NoGradGuard, differentiable with respect to `inputs` (undefined
// ones allowed): backward(grad_output, needs) returns one gradient per input, undefined where there
// is none; needs[i] says whether autograd wants input i's. For a function whose backward must hold
// more than tensors (a process group), which torch::autograd::Function's saved_data cannot. The
// function and what it captured are freed once backward has run without retain_graph. No-op when
// grad mode is off or no input requires grad.
using CustomBackward =
    std::function<std::vector<at::Tensor>(const at::Tensor& grad_output, const std::vector<bool>& needs)>;
void set_custom_backward(at::Tensor& output, const std::vector<at::Tensor>& inputs, std::string name,
                         CustomBackward backward);

// The autograd nodes reachable from `outputs` (their grad_fns and everything behind them).
std::vector<torch::autograd::Node*> reachable_nodes(const std::vector<at::Tensor>& outputs);

}  // namespace dtrain::compat
