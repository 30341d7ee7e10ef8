// Python DDP's construction-time and bucket collectives, as Note [DDP with PyTorch peers] lists them.
#include "ddp/pytorch_peers.h"

#include <algorithm>
#include <limits>
#include <map>
#include <utility>

#include <ATen/ATen.h>

#include "dtrain/errors.h"

namespace dtrain::ddp::pytorch_peers {
namespace {

int global_rank_of(const Group& group, int group_rank) { return group.ranks().at(static_cast<size_t>(group_rank)); }

// A key per (dtype, device), in the order first seen.
int key_of(const at::Tensor& t, std::vector<std::pair<at::ScalarType, at::Device>>& keys) {
  const auto k = std::make_pair(t.scalar_type(), t.device());
  const auto it = std::find(keys.begin(), keys.end(), k);
  if (it != keys.end()) return static_cast<int>(it - keys.begin());
  keys.push_back(k);
  return static_cast<int>(keys.size()) - 1;
}

// What rank 0 sent for the bucket rebuild must be a partition of this rank's `params` parameters.
void check_rebuild(bool ok, const Group& group, const std::string& what, int64_t params) {
  DTRAIN_CHECK(ok, "rank ", rank(), ": DistributedDataParallel with Python ranks: group rank 0 (rank ",
               global_rank_of(group, 0), ") sent a bucket rebuild with ", what, ", not a partition of the ", params,
               " parameters: run PyTorch's DistributedDataParallel (or dtrain's) over the same model on every rank");
}

}  // namespace

void verify_params(const std::vector<std::string>& names, const std::vector<at::Tensor>& params, const Group& group) {
  // Step 1: the counts first, so that ranks with different models never exchange metadata of
  // different sizes.
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  std::vector<at::Tensor> counts;
  for (int r = 0; r < group.size(); ++r) counts.push_back(at::empty({1}, i64));
  all_gather(counts, at::full({1}, static_cast<int64_t>(params.size()), i64), group);
  for (int r = 0; r < group.size(); ++r) {
    const int64_t theirs = counts[static_cast<size_t>(r)].item<int64_t>();
    DTRAIN_CHECK(theirs == static_cast<int64_t>(params.size()), "rank ", rank(),
                 ": DistributedDataParallel: this rank has ", params.size(), " parameters that require grad, rank ",
                 global_rank_of(group, r), " has ", theirs,
                 ": build the same model (same layers, in the same order) in every language");
  }
  // Step 2: sizes and strides of every parameter from group rank 0.
  std::vector<int64_t> meta;
  for (const auto& p : params) {
    meta.insert(meta.end(), p.sizes().begin(), p.sizes().end());
    meta.insert(meta.end(), p.strides().begin(), p.strides().end());
  }
  at::Tensor control = at::tensor(meta, i64);
  broadcast(control, global_rank_of(group, 0), group);
  const int64_t* got = control.data_ptr<int64_t>();
  size_t i = 0;
  for (size_t p = 0; p < params.size(); ++p) {
    const auto& t = params[p];
    bool same = true;
    for (int64_t s : t.sizes()) same = same && got[i++] == s;
    for (int64_t s : t.strides()) same = same && got[i++] == s;
    DTRAIN_CHECK(same, "rank ", rank(), ": DistributedDataParallel: parameter #", p, " '", names[p], "' has sizes ",
                 t.sizes(), " and strides ", t.strides(), ", which differ from rank ", global_rank_of(group, 0),
                 "'s: build the same model (same shapes, contiguous parameters) in every language");
  }
}

std::vector<std::vector<int>> assign_buckets(const std::vector<at::Tensor>& tensors, const std::vector<size_t>& limits,
                                             const std::vector<int>& order) {
  DTRAIN_ASSERT(!limits.empty() && !tensors.empty(), "bucket assignment of nothing");
  struct Open {
    std::vector<int> members;
    size_t bytes = 0;
    size_t limit_index = 0;
  };
  std::vector<std::pair<at::ScalarType, at::Device>> keys;
  std::vector<Open> open;
  std::vector<std::vector<int>> closed;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const at::Tensor& t = tensors[k];
    const int key = key_of(t, keys);
    if (key >= static_cast<int>(open.size())) open.resize(static_cast<size_t>(key) + 1);
    Open& b = open[static_cast<size_t>(key)];
    b.members.push_back(order.empty() ? static_cast<int>(k) : order[k]);
    b.bytes += static_cast<size_t>(t.numel()) * t.element_size();
    if (b.bytes >= limits[b.limit_index]) {
      closed.push_back(std::move(b.members));
      b.members.clear();
      b.bytes = 0;
      if (b.limit_index + 1 < limits.size()) ++b.limit_index;
    }
  }
  // Python adds the open buckets in its hash table's order: with one (dtype, device) there is one.
  DTRAIN_CHECK(order.empty() || keys.size() == 1, "rank ", rank(),
               ": DistributedDataParallel with Python ranks: the parameters have ", keys.size(),
               " (dtype, device) kinds, and Python's DDP orders the rebuilt buckets of several kinds by its hash "
               "table: use one dtype and device for the parameters, or find_unused_parameters(true) (no rebuild)");
  for (auto& b : open)
    if (!b.members.empty()) closed.push_back(std::move(b.members));
  if (order.empty())
    std::stable_sort(closed.begin(), closed.end(), [](const auto& a, const auto& b) {
      return *std::min_element(a.begin(), a.end()) < *std::min_element(b.begin(), b.end());
    });
  return closed;
}

void broadcast_coalesced(const std::vector<at::Tensor>& tensors, size_t bucket_bytes, int src_group_rank,
                         const Group& group) {
  if (tensors.empty()) return;
  at::NoGradGuard ng;
  for (const auto& bucket : assign_buckets(tensors, {bucket_bytes})) {
    std::vector<at::Tensor> parts;
    for (int i : bucket) parts.push_back(tensors[static_cast<size_t>(i)].detach().contiguous().view({-1}));
    at::Tensor flat = at::cat(parts);
    broadcast(flat, global_rank_of(group, src_group_rank), group);
    int64_t offset = 0;
    for (int i : bucket) {
      at::Tensor t = tensors[static_cast<size_t>(i)].detach();
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

std::vector<std::vector<int>> initial_buckets(const std::vector<at::Tensor>& params, size_t first_cap, size_t cap,
                                              bool find_unused_parameters, bool static_graph) {
  std::vector<size_t> limits;
  if (static_graph || !find_unused_parameters)
    limits = {std::numeric_limits<size_t>::max()};  // one bucket until the rebuild
  else if (first_cap < cap)
    limits = {first_cap, cap};
  else
    limits = {cap};
  auto buckets = assign_buckets(params, limits);
  std::reverse(buckets.begin(), buckets.end());
  return buckets;
}

std::vector<std::vector<int>> rebuilt_buckets(const std::vector<at::Tensor>& params, const std::vector<int>& order,
                                              size_t first_cap, size_t cap, const Group& group) {
  DTRAIN_ASSERT(order.size() == params.size(), "gradient-ready order of ", order.size(), " parameters, expected ",
                params.size());
  std::vector<at::Tensor> ordered;
  for (int i : order) ordered.push_back(params[static_cast<size_t>(i)]);
  const auto mine = assign_buckets(ordered, {first_cap, cap}, order);
  // Python's sync_bucket_indices: every index then the bucket count, then (sized by rank 0's count)
  // the bucket sizes, both int32 from group rank 0.
  const auto i32 = at::TensorOptions().dtype(at::kInt);
  at::Tensor indices = at::empty({static_cast<int64_t>(params.size()) + 1}, i32);
  int32_t* ix = indices.data_ptr<int32_t>();
  size_t k = 0;
  for (const auto& b : mine)
    for (int i : b) ix[k++] = i;
  ix[k] = static_cast<int32_t>(mine.size());
  broadcast(indices, global_rank_of(group, 0), group);
  // Rank 0's numbers size an allocation and index the parameters: checked before either, as
  // PyTorch's reducer checks them (a peer that is not DDP, or runs another model, sends anything).
  const int64_t n = static_cast<int64_t>(params.size());
  const int64_t count = ix[k];
  check_rebuild(count >= 1 && count <= n, group, "a bucket count of " + std::to_string(count), n);
  std::vector<bool> seen(params.size(), false);
  for (int64_t j = 0; j < n; ++j) {
    const int32_t i = ix[j];
    check_rebuild(i >= 0 && i < n && !seen[static_cast<size_t>(i)], group,
                  "parameter index " + std::to_string(i) + " at position " + std::to_string(j) +
                      (i >= 0 && i < n ? " twice" : ""),
                  n);
    seen[static_cast<size_t>(i)] = true;
  }
  at::Tensor sizes = at::empty({count}, i32);
  for (int64_t b = 0; b < count; ++b)
    sizes.data_ptr<int32_t>()[b] = static_cast<int32_t>(mine[std::min(static_cast<size_t>(b), mine.size() - 1)].size());
  broadcast(sizes, global_rank_of(group, 0), group);
  const int32_t* size = sizes.data_ptr<int32_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < count; ++b) {
    check_rebuild(
        size[b] >= 1 && size[b] <= n - total, group,
        "bucket " + std::to_string(b) + " of " + std::to_string(size[b]) + " parameters after " + std::to_string(total),
        n);
    total += size[b];
  }
  check_rebuild(total == n, group, "buckets of " + std::to_string(total) + " parameters in all", n);
  std::vector<std::vector<int>> out(static_cast<size_t>(count));
  k = 0;
  for (int64_t b = 0; b < count; ++b)
    for (int32_t j = 0; j < size[b]; ++j) out[static_cast<size_t>(b)].push_back(ix[k++]);
  return out;
}

}  // namespace dtrain::ddp::pytorch_peers
