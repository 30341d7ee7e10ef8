#include "ddp/buckets.h"

#include <map>
#include <string>
#include <utility>

namespace dtrain::ddp {

std::vector<std::vector<int>> assign_buckets(const std::vector<at::Tensor>& params, size_t first_cap_bytes,
                                             size_t cap_bytes) {
  struct Open {
    std::vector<int> members;
    size_t bytes = 0;
    size_t order = 0;         // visit order of its first member
    bool closed_one = false;  // this (dtype, device) already closed its first bucket
  };
  std::map<std::pair<int, std::string>, Open> open;  // (dtype, device) -> open bucket
  std::vector<std::pair<size_t, std::vector<int>>> closed;
  size_t visit = 0;
  for (int i = static_cast<int>(params.size()) - 1; i >= 0; --i, ++visit) {
    const at::Tensor& p = params[i];
    auto key = std::make_pair(static_cast<int>(p.scalar_type()), p.device().str());
    Open& b = open[key];
    if (b.members.empty()) b.order = visit;
    b.members.push_back(i);
    b.bytes += p.numel() * p.element_size();
    const size_t limit = b.closed_one ? cap_bytes : first_cap_bytes;
    if (b.bytes >= limit) {
      closed.emplace_back(b.order, std::move(b.members));
      b = Open{};
      b.closed_one = true;
    }
  }
  for (auto& kv : open)
    if (!kv.second.members.empty()) closed.emplace_back(kv.second.order, std::move(kv.second.members));
  std::stable_sort(closed.begin(), closed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::vector<int>> out;
  for (auto& c : closed) out.push_back(std::move(c.second));
  return out;
}

}  // namespace dtrain::ddp
