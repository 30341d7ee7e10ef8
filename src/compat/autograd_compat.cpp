#include "compat/autograd_compat.h"

#include <unordered_set>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace dtrain::compat {
namespace {

struct CallbackPostHook : torch::autograd::FunctionPostHook {
  explicit CallbackPostHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }
  std::function<void()> fn_;
};

}  // namespace

NodePtr grad_accumulator(const at::Tensor& leaf) { return torch::autograd::impl::grad_accumulator(leaf); }

uintptr_t add_post_hook(const NodePtr& accumulator, std::function<void()> fn) {
  return accumulator->add_post_hook(std::make_unique<CallbackPostHook>(std::move(fn)));
}

void remove_post_hook(const NodePtr& accumulator, uintptr_t key) { accumulator->del_post_hook(key); }

void queue_end_of_backward_callback(std::function<void()> fn) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

std::vector<torch::autograd::Node*> reachable_nodes(const std::vector<at::Tensor>& outputs) {
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack, out;
  auto visit = [&](torch::autograd::Node* n) {
    if (n && seen.insert(n).second) {
      stack.push_back(n);
      out.push_back(n);
    }
  };
  for (const auto& t : outputs) {
    if (!t.defined() || !t.requires_grad()) continue;
    if (t.grad_fn())
      visit(t.grad_fn().get());
    else
      visit(torch::autograd::impl::try_get_grad_accumulator(t).get());  // the output is a leaf
  }
  while (!stack.empty()) {
    auto* n = stack.back();
    stack.pop_back();
    for (const auto& edge : n->next_edges()) visit(edge.function.get());
  }
  return out;
}

}  // namespace dtrain::compat
