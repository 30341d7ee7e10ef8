// The optimizer state map's key, which LibTorch changed: 1.13 keys a parameter's state by its
// TensorImpl address printed as a string, 2.x by the address itself.
#pragma once

#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include <torch/optim/optimizer.h>

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

}  // namespace dtrain::compat
