// gather_named_tensors (dtrain/safetensors.h): every member's named tensors on one rank.
//
// Two rounds: gather_bytes carries each member's list (name, dtype, shape per tensor) to dst, so
// that dst allocates what it receives; then each member sends its tensors to dst in its order, and
// dst receives them member by member in group-rank order. A name is written with its length first:
// any bytes may be in it.
#include <algorithm>
#include <sstream>

#include <ATen/ATen.h>

#include "dtrain/errors.h"
#include "dtrain/safetensors.h"

namespace dtrain {
namespace {

std::string gather_named_describe(const NamedTensors& tensors) {
  std::ostringstream out;
  for (const auto& [name, t] : tensors) {
    out << name.size() << ':' << name << ' ' << static_cast<int>(t.scalar_type()) << ' ' << t.dim();
    for (int64_t d : t.sizes()) out << ' ' << d;
    out << '\n';
  }
  return out.str();
}

// The tensors a member described, allocated (empty) with `options`.
NamedTensors gather_named_allocate(const std::string& desc, const at::TensorOptions& options) {
  NamedTensors out;
  std::istringstream in(desc);
  for (size_t len = 0; in >> len;) {
    in.get();  // ':'
    std::string name(len, '\0');
    in.read(name.data(), static_cast<std::streamsize>(len));
    int dtype = 0;
    int64_t dim = 0;
    in >> dtype >> dim;
    std::vector<int64_t> shape(static_cast<size_t>(dim));
    for (auto& d : shape) in >> d;
    out.emplace_back(std::move(name), at::empty(shape, options.dtype(static_cast<at::ScalarType>(dtype))));
  }
  return out;
}

}  // namespace

NamedTensors gather_named_tensors(const NamedTensors& mine, int dst, const Group& group) {
  DTRAIN_CHECK(group.is_member(), "gather_named_tensors: rank ", rank(), " is not a member of group '", group.name(),
               "': call it on the group's ranks only");
  const std::vector<int>& ranks = group.ranks();
  DTRAIN_CHECK(std::find(ranks.begin(), ranks.end(), dst) != ranks.end(), "gather_named_tensors: dst is rank ", dst,
               ", which is not in group '", group.name(), "': pass a global rank of its members");
  const std::vector<std::string> all = gather_bytes(gather_named_describe(mine), dst, group);
  if (rank() != dst) {
    for (const auto& [name, t] : mine) send(t.contiguous(), dst, group);
    return {};
  }
  const at::TensorOptions options =
      at::TensorOptions().device(mine.empty() ? at::Device(at::kCPU) : mine.front().second.device());
  NamedTensors out;
  for (size_t m = 0; m < ranks.size(); ++m) {
    if (ranks[m] == dst) {
      out.insert(out.end(), mine.begin(), mine.end());
      continue;
    }
    for (auto& [name, t] : gather_named_allocate(all[m], options)) {
      recv(t, ranks[m], group);
      out.emplace_back(std::move(name), std::move(t));
    }
  }
  return out;
}

}  // namespace dtrain
