// The groups over which parameters' gradients are sharded (see shard_groups.h).
#include "comm/shard_groups.h"

#include <algorithm>
#include <mutex>
#include <unordered_map>

namespace dtrain::comm {
namespace {

struct ShardRecord {
  c10::weak_intrusive_ptr<c10::TensorImpl> tensor;
  std::vector<Group> groups;
};

std::mutex shard_groups_mu;
std::unordered_map<const c10::TensorImpl*, ShardRecord>& shard_records() {
  static std::unordered_map<const c10::TensorImpl*, ShardRecord> r;
  return r;
}

bool has_group(const std::vector<Group>& groups, const Group& g) {
  return std::any_of(groups.begin(), groups.end(), [&](const Group& x) { return x.name() == g.name(); });
}

}  // namespace

void add_shard_group(const at::Tensor& param, const Group& group) {
  std::lock_guard<std::mutex> lock(shard_groups_mu);
  auto& r = shard_records();
  auto it = r.find(param.unsafeGetTensorImpl());
  // A record whose tensor died belongs to an earlier tensor at the same address.
  if (it == r.end() || it->second.tensor.expired())
    it = r.insert_or_assign(param.unsafeGetTensorImpl(),
                            ShardRecord{c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()), {}})
             .first;
  if (!has_group(it->second.groups, group)) it->second.groups.push_back(group);
}

std::vector<Group> shard_groups(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(shard_groups_mu);
  auto& r = shard_records();
  auto it = r.find(param.unsafeGetTensorImpl());
  return it == r.end() || it->second.tensor.expired() ? std::vector<Group>() : it->second.groups;
}

std::vector<Group> shard_groups(const std::vector<at::Tensor>& params) {
  std::vector<Group> out;
  for (const at::Tensor& p : params)
    for (const Group& g : shard_groups(p))
      if (!has_group(out, g)) out.push_back(g);
  return out;
}

}  // namespace dtrain::comm
