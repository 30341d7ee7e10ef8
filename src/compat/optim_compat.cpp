// restore_param_group_options (compat/optim_compat.h): what LibTorch 2.x's Optimizer::load() does
// with the saved param groups' options, for LibTorch 1.13, whose load() drops them.
#include "compat/optim_compat.h"

#include <algorithm>
#include <memory>
#include <string>

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/version.h>

namespace dtrain::compat {
namespace {

// The archive's options of group i, read as the optimizer's own options type (as LibTorch's
// serialize() reads them: a default-constructed options object filled by its serialize()).
template <typename Optimizer, typename Options>
bool restore_options_as(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& groups) {
  if (dynamic_cast<Optimizer*>(&optimizer) == nullptr) return false;
  torch::Tensor size;
  groups.read("param_groups/size", size);
  const int64_t n = std::min<int64_t>(size.item<int64_t>(), static_cast<int64_t>(optimizer.param_groups().size()));
  for (int64_t i = 0; i < n; ++i) {
    torch::serialize::InputArchive group, saved;
    groups.read("param_groups/" + std::to_string(i), group);
    group.read("options", saved);
    Options options(0);
    options.serialize(saved);
    optimizer.param_groups()[static_cast<size_t>(i)].set_options(std::make_unique<Options>(options));
  }
  return true;
}

}  // namespace

void restore_param_group_options(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive) {
  if constexpr (TORCH_VERSION_MAJOR >= 2) return;  // load() has set them
  torch::serialize::InputArchive groups;
  if (!archive.try_read("param_groups", groups)) return;
  namespace o = torch::optim;
  restore_options_as<o::SGD, o::SGDOptions>(optimizer, groups) ||
      restore_options_as<o::Adam, o::AdamOptions>(optimizer, groups) ||
      restore_options_as<o::AdamW, o::AdamWOptions>(optimizer, groups) ||
      restore_options_as<o::Adagrad, o::AdagradOptions>(optimizer, groups) ||
      restore_options_as<o::RMSprop, o::RMSpropOptions>(optimizer, groups) ||
      restore_options_as<o::LBFGS, o::LBFGSOptions>(optimizer, groups);
}

}  // namespace dtrain::compat
