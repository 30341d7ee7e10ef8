// A torch::nn::Sequential element replaced in place by a module that runs it (checkpoint_wrapper and
// fully_shard of an AnyModule&): the Sequential's module tree still holds the element itself, under
// its own name, while its forward calls the wrapper. A layer that meets the wrapper in the
// Sequential finds the module the tree holds through it (Note [Elements wrapped in place]).
#pragma once

#include <memory>

#include <torch/nn/module.h>

namespace dtrain::detail {

class ElementWrapper {
 public:
  virtual ~ElementWrapper() = default;
  // The module the wrapper runs, as the wrapper holds it (which may be another such wrapper).
  virtual std::shared_ptr<torch::nn::Module> wrapped() const = 0;
};

// The module the Sequential's tree holds behind any wrappers put in its place: `module` itself when
// it is no such wrapper.
inline std::shared_ptr<torch::nn::Module> module_in_tree(std::shared_ptr<torch::nn::Module> module) {
  while (auto* w = dynamic_cast<const ElementWrapper*>(module.get())) module = w->wrapped();
  return module;
}

}  // namespace dtrain::detail
