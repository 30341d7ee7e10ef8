// Where LibTorch's optimizers changed between 1.13 and 2.x: the state map's key (1.13 keys a
// parameter's state by its TensorImpl address printed as a string, 2.x by the address itself), and
// what load() restores (1.13 reads the param groups' options from the archive and drops them).
#pragma once

#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>

namespace dtrain::compat {

using OptimizerStateKey =
    typename std::remove_reference_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

namespace detail {
template <typename Key>
Key state_key_of(c10::TensorImpl* impl) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream s;  // what 1.13's c10::guts::to_string(pointer) prints
    s << static_cast<void*>(impl);
    return s.str();
  } else {
    return impl;
  }
}
}  // namespace detail

// The key of `param`'s entry in an optimizer's state().
inline OptimizerStateKey optimizer_state_key(const at::Tensor& param) {
  return detail::state_key_of<OptimizerStateKey>(param.unsafeGetTensorImpl());
}

// After Optimizer::load(archive): each param group's options (lr, betas, weight decay, ...) as the
// archive saved them, as PyTorch's load_state_dict and LibTorch 2.x's load() set them (a resumed run
// whose schedule changed the lr goes on with the saved lr). LibTorch 1.13's load() reads them and
// keeps the optimizer's own: this sets them for LibTorch's optimizers (SGD, Adam, AdamW, Adagrad,
// RMSprop, LBFGS); another optimizer's options stay as they are. Nothing to do on LibTorch 2.x.
void restore_param_group_options(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive);

}  // namespace dtrain::compat
