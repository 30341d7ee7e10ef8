#include "compat/autograd_compat.h"

#include <algorithm>
#include <mutex>
#include <type_traits>
#include <unordered_set>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

#include "dtrain/errors.h"

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

struct CustomBackwardNode : torch::autograd::Node {
  CustomBackwardNode(std::string name, CustomBackward fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  std::string name() const override { return name_; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    DTRAIN_CHECK(fn_, name_, ": backward through this graph a second time, but its saved values were freed: ",
                 "pass retain_graph=true to the first backward");
    std::vector<bool> needs(num_outputs());
    for (size_t i = 0; i < needs.size(); ++i) needs[i] = should_compute_output(i);
    return fn_(grads.at(0), needs);
  }
  void release_variables() override { fn_ = nullptr; }

  std::string name_;
  CustomBackward fn_;
};

// 1.13 owns nodes by std::shared_ptr, recent 2.x by c10::intrusive_ptr: a template, so that only
// the matching branch compiles. (1.13's own nodes use the deleter deleteNode, which frees a long
// chain of nodes without deep recursion; this node is one link, and the nodes it points to have it.)
template <typename Ptr, typename NodeT = CustomBackwardNode>  // NodeT: keeps both branches dependent
Ptr make_node(std::string name, CustomBackward fn) {
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<torch::autograd::Node>>) {
    return Ptr(new NodeT(std::move(name), std::move(fn)));
  } else {
    return Ptr(c10::make_intrusive<NodeT>(std::move(name), std::move(fn)));
  }
}

}  // namespace

void set_custom_backward(at::Tensor& output, const std::vector<at::Tensor>& inputs, std::string name,
                         CustomBackward backward) {
  if (!torch::autograd::GradMode::is_enabled()) return;
  if (std::none_of(inputs.begin(), inputs.end(), [](const at::Tensor& t) { return t.defined() && t.requires_grad(); }))
    return;
  NodePtr node = make_node<NodePtr>(std::move(name), std::move(backward));
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  torch::autograd::set_history(output, node);
}

NodePtr grad_accumulator(const at::Tensor& leaf) { return torch::autograd::impl::grad_accumulator(leaf); }

void relink_grad_accumulator(const at::Tensor& leaf, const NodePtr& accumulator) {
  auto* meta = torch::autograd::impl::get_autograd_meta(leaf);
  if (!meta) return;
  std::lock_guard<std::mutex> lock(meta->mutex_);
  meta->grad_accumulator_ = decltype(meta->grad_accumulator_)(accumulator);
}

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
