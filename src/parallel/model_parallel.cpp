// Model parallelism: a Sequential split into stages on devices, and the balanced partition that the
// pipeline uses too.
#include <ATen/ATen.h>

#include <limits>
#include <numeric>

#include "dtrain/data_parallel.h"

namespace dtrain {

std::vector<int64_t> balance_by_size(const std::vector<int64_t>& sizes, int64_t parts) {
  const int64_t n = static_cast<int64_t>(sizes.size());
  DTRAIN_CHECK(parts >= 1, "balance: the number of stages must be >= 1, got ", parts);
  DTRAIN_CHECK(n >= parts, "balance: ", n, " layers cannot fill ", parts,
               " stages (each needs at least one layer): use fewer devices or ranks");
  // best[k][i]: the smallest possible largest stage when the first i layers form k stages.
  std::vector<int64_t> prefix(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + sizes[i];
  const int64_t inf = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> best(parts + 1, std::vector<int64_t>(n + 1, inf)), cut = best;
  best[0][0] = 0;
  for (int64_t k = 1; k <= parts; ++k)
    for (int64_t i = k; i <= n; ++i)
      for (int64_t j = k - 1; j < i; ++j) {
        if (best[k - 1][j] == inf) continue;
        const int64_t worst = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        // Ties: prefer the cut that keeps earlier stages shorter in layers (later j).
        if (worst < best[k][i] || (worst == best[k][i] && j > cut[k][i])) {
          best[k][i] = worst;
          cut[k][i] = j;
        }
      }
  std::vector<int64_t> counts(parts);
  for (int64_t k = parts, i = n; k >= 1; --k) {
    const int64_t j = cut[k][i];
    counts[k - 1] = i - j;
    i = j;
  }
  return counts;
}

ModelParallelSequentialImpl::ModelParallelSequentialImpl(torch::nn::Sequential sequential,
                                                         std::vector<c10::Device> devices, std::vector<int64_t> balance)
    : devices_(std::move(devices)) {
  DTRAIN_CHECK(!devices_.empty(), "ModelParallelSequential: no devices given: pass one device per stage");
  const int64_t layers = static_cast<int64_t>(sequential->size());
  if (balance.empty()) {
    std::vector<int64_t> sizes;
    for (const auto& layer : *sequential) {
      int64_t numel = 0;
      for (const auto& p : layer.ptr()->parameters()) numel += p.numel();
      sizes.push_back(numel);
    }
    balance = balance_by_size(sizes, static_cast<int64_t>(devices_.size()));
  }
  DTRAIN_CHECK(balance.size() == devices_.size(), "ModelParallelSequential: balance has ", balance.size(),
               " stages but ", devices_.size(), " devices were given: give one count per device");
  int64_t total = 0;
  for (int64_t b : balance) {
    DTRAIN_CHECK(b > 0, "ModelParallelSequential: every stage needs at least one layer, balance has ", b);
    total += b;
  }
  DTRAIN_CHECK(total == layers, "ModelParallelSequential: balance sums to ", total, " layers but the Sequential has ",
               layers, ": make the counts add up");
  balance_ = balance;
  auto it = sequential->begin();
  for (size_t s = 0; s < balance_.size(); ++s) {
    torch::nn::Sequential stage;
    for (int64_t k = 0; k < balance_[s]; ++k, ++it) stage->push_back(*it);
    stage->to(devices_[s]);
    stages_.push_back(register_module("stage" + std::to_string(s), stage));
  }
}

at::Tensor ModelParallelSequentialImpl::forward(at::Tensor x) {
  for (size_t s = 0; s < stages_.size(); ++s) x = stages_[s]->forward(x.to(devices_[s]));
  return x;
}

}  // namespace dtrain
