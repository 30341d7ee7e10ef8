// Small control messages: plain values through the tensor collectives on collective_device(group).
// Byte strings travel in two collectives: their lengths first, then the bytes padded to the longest.
#include <algorithm>
#include <cstring>

#include <ATen/ATen.h>

#include "dtrain/process_group.h"

namespace dtrain {
namespace {

template <typename T>
constexpr at::ScalarType kDtype = std::is_same_v<T, double> ? at::kDouble : at::kLong;

template <typename T>
at::Tensor on_device(const std::vector<T>& v, const Group& group) {
  return at::tensor(at::ArrayRef<T>(v), at::TensorOptions(kDtype<T>)).to(collective_device(group));
}

template <typename T>
std::vector<T> values_of(const at::Tensor& t) {
  const at::Tensor c = t.cpu().contiguous();
  const T* p = c.data_ptr<T>();
  return std::vector<T>(p, p + c.numel());
}

template <typename T>
std::vector<T> reduce_values(const std::vector<T>& mine, ReduceOp op, const Group& group) {
  at::Tensor t = on_device(mine, group);
  all_reduce(t, op, group);
  return values_of<T>(t);
}

template <typename T>
std::vector<std::vector<T>> gather_values(const std::vector<T>& mine, const Group& group) {
  const at::Tensor in = on_device(mine, group);
  std::vector<at::Tensor> out(group.size());
  for (auto& t : out) t = at::empty_like(in);
  all_gather(out, in, group);
  std::vector<std::vector<T>> all;
  for (const auto& t : out) all.push_back(values_of<T>(t));
  return all;
}

// `bytes` in a byte tensor of `size` (>= bytes.size(), zero-padded) on the group's device.
at::Tensor bytes_on_device(const std::string& bytes, int64_t size, const Group& group) {
  at::Tensor t = at::zeros({size}, at::kByte);
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t.to(collective_device(group));
}

std::string bytes_of(const at::Tensor& t, int64_t length) {
  const at::Tensor c = t.cpu().contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(length));
}

// Every member's length, and the longest (at least 1: no collective gets an empty tensor).
std::pair<std::vector<int64_t>, int64_t> lengths(const std::string& mine, const Group& group) {
  std::vector<int64_t> lens;
  for (const auto& v : gather_values(std::vector<int64_t>{static_cast<int64_t>(mine.size())}, group))
    lens.push_back(v[0]);
  return {lens, std::max<int64_t>(1, *std::max_element(lens.begin(), lens.end()))};
}

}  // namespace

std::vector<int64_t> all_reduce_values(const std::vector<int64_t>& mine, ReduceOp op, const Group& group) {
  return reduce_values(mine, op, group);
}
std::vector<double> all_reduce_values(const std::vector<double>& mine, ReduceOp op, const Group& group) {
  return reduce_values(mine, op, group);
}
std::vector<std::vector<int64_t>> all_gather_values(const std::vector<int64_t>& mine, const Group& group) {
  return gather_values(mine, group);
}
std::vector<std::vector<double>> all_gather_values(const std::vector<double>& mine, const Group& group) {
  return gather_values(mine, group);
}

std::string broadcast_bytes(const std::string& bytes, int src, const Group& group) {
  const bool is_src = rank() == src;
  at::Tensor len = on_device(std::vector<int64_t>{is_src ? static_cast<int64_t>(bytes.size()) : 0}, group);
  broadcast(len, src, group);
  const int64_t n = values_of<int64_t>(len)[0];
  if (n == 0) return "";
  at::Tensor t = bytes_on_device(is_src ? bytes : std::string(), n, group);
  broadcast(t, src, group);
  return is_src ? bytes : bytes_of(t, n);
}

std::vector<std::string> all_gather_bytes(const std::string& mine, const Group& group) {
  const auto [lens, longest] = lengths(mine, group);
  const at::Tensor in = bytes_on_device(mine, longest, group);
  std::vector<at::Tensor> out(group.size());
  for (auto& t : out) t = at::empty_like(in);
  all_gather(out, in, group);
  std::vector<std::string> all;
  for (size_t r = 0; r < out.size(); ++r) all.push_back(bytes_of(out[r], lens[r]));
  return all;
}

std::vector<std::string> gather_bytes(const std::string& mine, int dst, const Group& group) {
  const auto [lens, longest] = lengths(mine, group);
  const at::Tensor in = bytes_on_device(mine, longest, group);
  std::vector<at::Tensor> list;
  if (rank() == dst)
    for (int r = 0; r < group.size(); ++r) list.push_back(at::empty_like(in));
  gather(in, list, dst, group);
  std::vector<std::string> all;
  for (size_t r = 0; r < list.size(); ++r) all.push_back(bytes_of(list[r], lens[r]));
  return all;
}

}  // namespace dtrain
