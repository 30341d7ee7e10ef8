// DistributedSampler on 2 and 3 real processes: rank/num_replicas default to the process group's,
// and the shares the ranks compute independently partition the dataset (same permutation everywhere).
#include <ATen/ATen.h>

#include "dist_main.h"
#include "dtrain/sampler.h"

using namespace dtrain;

namespace {
// Every rank's indices, gathered everywhere: (world, per_rank).
at::Tensor gather_indices(const DistributedSampler& s) {
  const auto mine = s.indices();
  at::Tensor t = at::tensor(mine, at::kLong);
  std::vector<at::Tensor> all;
  for (int r = 0; r < world_size(); ++r) all.push_back(at::empty_like(t));
  all_gather(all, t);
  return at::stack(all);
}
}  // namespace

TEST(SamplerDist, DefaultsComeFromTheProcessGroup) {
  DistributedSampler s(100);
  EXPECT_EQ(s.num_replicas(), world_size());
  EXPECT_EQ(s.rank(), rank());
  EXPECT_EQ(s.size(), static_cast<size_t>((100 + world_size() - 1) / world_size()));
}

TEST(SamplerDist, RanksPartitionTheDatasetEveryEpoch) {
  for (bool drop_last : {false, true}) {
    DistributedSampler s(1001, DistributedSamplerOptions().seed(42).drop_last(drop_last));
    at::Tensor previous;
    for (int64_t epoch = 0; epoch < 3; ++epoch) {
      s.set_epoch(epoch);
      at::Tensor all = gather_indices(s);  // (world, per_rank)
      const int64_t total = all.numel();
      at::Tensor distinct = std::get<0>(at::_unique(all.flatten()));
      if (drop_last) {
        EXPECT_EQ(distinct.numel(), total) << "shares overlap";
        EXPECT_EQ(total, 1001 / world_size() * world_size());
      } else {
        EXPECT_EQ(distinct.numel(), 1001) << "some index is on no rank";
      }
      if (previous.defined()) {
        EXPECT_FALSE(at::equal(all, previous)) << "epoch " << epoch;
      }
      previous = all;
    }
  }
}

DTRAIN_DIST_TEST_MAIN()
