#include "comm/model_sync.h"

#include <algorithm>
#include <functional>
#include <map>
#include <sstream>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "common/util.h"

namespace dtrain::comm {
namespace {

std::vector<std::string> describe(const std::vector<std::string>& names, const std::vector<at::Tensor>& params) {
  std::vector<std::string> out;
  for (size_t i = 0; i < params.size(); ++i) {
    std::ostringstream os;
    os << "'" << names[i] << "' " << params[i].sizes() << " " << params[i].scalar_type();
    out.push_back(os.str());
  }
  return out;
}

// Step 3: the same message on every rank.
std::string explain(const std::vector<std::vector<std::string>>& all, const std::vector<int>& ranks,
                    const std::string& who) {
  const auto& ref = all[0];
  for (size_t r = 1; r < all.size(); ++r) {
    const auto& mine = all[r];
    if (mine == ref) continue;
    const size_t n = std::min(ref.size(), mine.size());
    size_t i = 0;
    while (i < n && ref[i] == mine[i]) ++i;
    std::ostringstream os;
    os << who << ": ranks disagree on the model: rank " << ranks[0] << " has " << ref.size() << " parameters, rank "
       << ranks[r] << " has " << mine.size() << "; first difference at parameter #" << i << ": rank " << ranks[0] << " "
       << (i < ref.size() ? ref[i] : "(none)") << " vs rank " << ranks[r] << " "
       << (i < mine.size() ? mine[i] : "(none)")
       << ": build the same model (same layers, shapes and dtypes) on every rank";
    return os.str();
  }
  return who + ": ranks disagree on the model (hash mismatch)";
}

}  // namespace

void verify_same_model(const std::vector<std::string>& names, const std::vector<at::Tensor>& params, const Group& group,
                       const std::string& key_prefix, const std::string& who) {
  const auto lines = describe(names, params);
  const std::string text = util::join(lines, "\n");
  // Step 1-2.
  const int64_t h = static_cast<int64_t>(std::hash<std::string>{}(text));
  const auto hashes = all_gather_values(std::vector<int64_t>{h}, group);
  if (std::all_of(hashes.begin(), hashes.end(), [&](const auto& v) { return v[0] == h; })) return;
  // Step 3.
  auto store = default_store();
  store->set(key_prefix + std::to_string(rank()), std::vector<uint8_t>(text.begin(), text.end()));
  std::vector<std::vector<std::string>> all;
  for (int r : group.ranks()) {
    auto v = store->get(key_prefix + std::to_string(r));
    all.push_back(util::split(std::string(v.begin(), v.end())));
  }
  throw Error(detail::cat("rank ", rank(), ": ", explain(all, group.ranks(), who)));
}

void broadcast_from_first_rank(const std::vector<at::Tensor>& tensors, const Group& group) {
  broadcast_from(tensors, group.ranks()[0], group);
}

void broadcast_from(const std::vector<at::Tensor>& tensors, int src, const Group& group) {
  if (tensors.empty() || group.size() == 1) return;
  at::NoGradGuard ng;
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> by_type;
  for (const auto& t : tensors) by_type[{static_cast<int>(t.scalar_type()), t.device().str()}].push_back(t);
  for (auto& kv : by_type) {
    std::vector<at::Tensor> flat_parts;
    for (const auto& t : kv.second) flat_parts.push_back(t.reshape({-1}));
    at::Tensor flat = at::cat(flat_parts);
    broadcast(flat, src, group);
    int64_t offset = 0;
    for (auto& t : kv.second) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace dtrain::comm
