// convert_sync_batchnorm: BatchNorm{1,2,3}d -> SyncBatchNorm in a module tree (see dtrain/sync_batchnorm.h).
//
// PyTorch's version walks the children and setattr()s replacements: Python calls children through
// attributes, so swapping the attribute swaps what forward() calls. In C++ a module calls its
// children through typed members that nothing outside it can reassign, so the only places where a
// swap changes what runs are the module itself (returned anew) and torch::nn::Sequential, whose
// forward calls its list of modules (rebuilt here with the same names; LibTorch's Sequential cannot
// hold another Sequential, so there is one level). A BatchNorm anywhere else
// would keep running unsynchronized while parameters() already showed the replacement: an error
// naming it instead.
#include <string>

#include <torch/nn/modules/batchnorm.h>

#include "dtrain/errors.h"
#include "dtrain/sync_batchnorm.h"

namespace dtrain {
namespace {

// The BatchNorm options of `m`, or nullptr if it is not a BatchNorm{1,2,3}d.
const torch::nn::BatchNormOptions* batchnorm_options(const torch::nn::Module& m) {
  if (auto* b = dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m)) return &b->options;
  if (auto* b = dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m)) return &b->options;
  if (auto* b = dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&m)) return &b->options;
  return nullptr;
}

// A SyncBatchNorm sharing the BatchNorm's parameter and buffer tensors (PyTorch's convert does the same).
SyncBatchNorm to_sync(const torch::nn::Module& bn, const torch::nn::BatchNormOptions& o, const Group& group) {
  return SyncBatchNorm(std::make_shared<SyncBatchNormImpl>(SyncBatchNormOptions(o).process_group(group), bn));
}

// A module that is neither a BatchNorm nor a Sequential: an error if it holds a BatchNorm.
void refuse_held_batchnorm(const torch::nn::Module& m, const std::string& path) {
  for (const auto& c : m.named_modules(path, /*include_self=*/false))
    if (batchnorm_options(*c.value()))
      throw Error(detail::cat("convert_sync_batchnorm: '", c.key(), "' is a BatchNorm held by a C++ module (", m.name(),
                              " at '", path,
                              "'), which calls it through its own member and cannot be rewired from outside: ",
                              "declare that member as a dtrain::SyncBatchNorm, or build the model as one "
                              "torch::nn::Sequential"));
}

// A Sequential's element at `path`, converted.
torch::nn::AnyModule convert_any(const torch::nn::AnyModule& any, const Group& group, const std::string& path) {
  const std::shared_ptr<torch::nn::Module> m = any.ptr();
  if (const auto* o = batchnorm_options(*m)) return torch::nn::AnyModule(to_sync(*m, *o, group));
  // Not a Sequential: AnyModule cannot hold one (its forward is a template), so a Sequential's
  // element is a module of its own, with typed members.
  refuse_held_batchnorm(*m, path);
  return any;
}

torch::nn::Sequential convert_sequential(const torch::nn::Sequential& seq, const Group& group,
                                         const std::string& path) {
  torch::nn::Sequential out;
  const auto names = seq->named_children();
  size_t i = 0;
  for (const auto& any : *seq) {
    const std::string& name = names[i++].key();
    out->push_back(name, convert_any(any, group, path.empty() ? name : path + "." + name));
  }
  out->train(seq->is_training());
  return out;
}

}  // namespace

torch::nn::Sequential convert_sync_batchnorm(const torch::nn::Sequential& module, const Group& group) {
  return convert_sequential(module, group, "");
}

std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(std::shared_ptr<torch::nn::Module> module,
                                                          const Group& group) {
  DTRAIN_CHECK(module != nullptr, "convert_sync_batchnorm: the module is null: pass a constructed module");
  if (const auto* o = batchnorm_options(*module)) return to_sync(*module, *o, group).ptr();
  if (auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(module))
    return convert_sequential(torch::nn::Sequential(seq), group, "").ptr();
  refuse_held_batchnorm(*module, module->name());
  return module;
}

}  // namespace dtrain
