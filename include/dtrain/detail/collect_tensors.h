// The tensors inside a forward's result (a tensor, a vector, tuples and pairs of them), for wrappers
// that follow a module's outputs into autograd (DistributedDataParallel, fully_shard).
#pragma once

#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dtrain::detail {

inline void collect_tensors(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }
inline void collect_tensors(const std::vector<at::Tensor>& ts, std::vector<at::Tensor>& out) {
  out.insert(out.end(), ts.begin(), ts.end());
}
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& t, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... e) { (collect_tensors(e, out), ...); }, t);
}
template <typename A, typename B>
void collect_tensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out) {
  collect_tensors(p.first, out);
  collect_tensors(p.second, out);
}
template <typename T>
void collect_tensors(const T&, std::vector<at::Tensor>&) {}  // no tensors to follow

}  // namespace dtrain::detail
