// Autograd internals DDP relies on, in one place (their headers and signatures move between LibTorch
// versions; DESIGN.md "compat layer"). Verified against LibTorch 1.13; the same calls exist in 2.x.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::autograd {
struct Node;
}

namespace dtrain::compat {

using NodePtr = std::shared_ptr<torch::autograd::Node>;

// The AccumulateGrad node of a leaf tensor that requires grad (created if needed). Keep the
// returned pointer alive: the variable holds it only weakly, and its hooks die with it.
NodePtr grad_accumulator(const at::Tensor& leaf);

// Calls fn() every time `accumulator` has accumulated a gradient into its variable's .grad().
// Returns a key for remove_post_hook.
uintptr_t add_post_hook(const NodePtr& accumulator, std::function<void()> fn);
void remove_post_hook(const NodePtr& accumulator, uintptr_t key);

// Runs fn at the end of the backward pass that is executing now (call from inside a hook).
void queue_end_of_backward_callback(std::function<void()> fn);

// The autograd nodes reachable from `outputs` (their grad_fns and everything behind them).
std::vector<torch::autograd::Node*> reachable_nodes(const std::vector<at::Tensor>& outputs);

}  // namespace dtrain::compat
