// DistributedSampler: PyTorch's own output (tests/data/sampler_golden.json, made by
// tests/data/make_sampler_golden.py), partition properties, epochs, DataLoader integration.
#include "dtrain/sampler.h"
#include "matchers.h"

#include <torch/data.h>
#include <torch/serialize.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "test_util.h"

using dtrain::DistributedSampler;
using dtrain::DistributedSamplerOptions;
using dtrain::test_util::dtrain_error_of;

namespace {

DistributedSamplerOptions opts(int64_t replicas, int64_t rank) {
  return DistributedSamplerOptions().num_replicas(replicas).rank(rank);
}

// Every index a sampler hands out through next(), batch by batch.
std::vector<int64_t> drain(DistributedSampler& s, size_t batch_size) {
  std::vector<int64_t> out;
  while (auto batch = s.next(batch_size)) {
    EXPECT_FALSE(batch->empty());
    EXPECT_LE(batch->size(), batch_size);
    for (size_t i : *batch) out.push_back(static_cast<int64_t>(i));
  }
  return out;
}

}  // namespace

TEST(DistributedSampler, MatchesPyTorchGolden) {
  std::ifstream in(DTRAIN_SAMPLER_GOLDEN);
  ASSERT_TRUE(in) << "cannot read " << DTRAIN_SAMPLER_GOLDEN;
  const auto golden = nlohmann::json::parse(in);
  const auto& cases = golden.at("cases");
  ASSERT_GT(cases.size(), 500u);
  size_t compared = 0;
  for (const auto& c : cases) {
    const auto n = c.at("n").get<size_t>();
    DistributedSampler s(n, opts(c.at("num_replicas").get<int64_t>(), c.at("rank").get<int64_t>())
                                .shuffle(c.at("shuffle").get<bool>())
                                .seed(c.at("seed").get<int64_t>())
                                .drop_last(c.at("drop_last").get<bool>()));
    s.set_epoch(c.at("epoch").get<int64_t>());
    const auto expected = c.at("indices").get<std::vector<int64_t>>();
    ASSERT_EQ(s.indices(), expected) << "case " << c.dump().substr(0, 160);
    ASSERT_EQ(s.size(), expected.size());
    s.reset();
    ASSERT_EQ(drain(s, 7), expected) << "next() of case " << c.dump().substr(0, 160);
    ++compared;
  }
  EXPECT_EQ(compared, cases.size());
}

// Over many combinations: equal counts on every rank; without drop_last every index appears and
// only the wrap-around padding repeats; with drop_last the shares are disjoint.
TEST(DistributedSampler, PartitionsAreCompleteDisjointAndEqual) {
  for (size_t n : {0, 1, 2, 3, 5, 8, 13, 31, 64, 97, 250}) {
    for (int64_t replicas = 1; replicas <= 7; ++replicas) {
      for (bool shuffle : {false, true}) {
        for (bool drop_last : {false, true}) {
          SCOPED_TRACE(testing::Message() << "n=" << n << " replicas=" << replicas << " shuffle=" << shuffle
                                          << " drop_last=" << drop_last);
          const size_t per_rank = drop_last ? n / replicas : (n + replicas - 1) / replicas;
          std::map<int64_t, int> seen;
          for (int64_t rank = 0; rank < replicas; ++rank) {
            DistributedSampler s(n, opts(replicas, rank).shuffle(shuffle).drop_last(drop_last).seed(7));
            s.set_epoch(3);
            const auto idx = s.indices();
            ASSERT_EQ(idx.size(), per_rank);
            ASSERT_EQ(s.size(), per_rank);
            for (int64_t i : idx) {
              ASSERT_GE(i, 0);
              ASSERT_LT(i, static_cast<int64_t>(n));
              ++seen[i];
            }
          }
          const size_t total = per_rank * replicas;
          size_t sum = 0;
          for (auto& [i, count] : seen) sum += count;
          ASSERT_EQ(sum, total);
          if (drop_last) {
            ASSERT_EQ(seen.size(), total);  // disjoint
          } else {
            ASSERT_EQ(seen.size(), n);  // complete
            // Padding repeats at most ceil(total / n) times each.
            for (auto& [i, count] : seen) ASSERT_LE(static_cast<size_t>(count), (total + n - 1) / n);
          }
        }
      }
    }
  }
}

TEST(DistributedSampler, NoShuffleIsStrided) {
  DistributedSampler s(10, opts(3, 1).shuffle(false));
  EXPECT_EQ(s.indices(), (std::vector<int64_t>{1, 4, 7, 0}));  // 10 padded with index 0 to 12
  DistributedSampler d(10, opts(3, 1).shuffle(false).drop_last(true));
  EXPECT_EQ(d.indices(), (std::vector<int64_t>{1, 4, 7}));
  DistributedSampler tiny(1, opts(4, 3).shuffle(false));  // wraps around several times
  EXPECT_EQ(tiny.indices(), (std::vector<int64_t>{0}));
}

TEST(DistributedSampler, SetEpochChangesOrderDeterministically) {
  DistributedSampler a(100, opts(2, 0).seed(42));
  DistributedSampler b(100, opts(2, 0).seed(42));
  EXPECT_EQ(a.indices(), b.indices());
  const auto e0 = a.indices();
  EXPECT_EQ(a.indices(), e0) << "without set_epoch the order repeats";
  a.set_epoch(1);
  const auto e1 = a.indices();
  EXPECT_NE(e1, e0);
  b.set_epoch(1);
  EXPECT_EQ(b.indices(), e1);
  a.set_epoch(0);
  EXPECT_EQ(a.indices(), e0);
  // seed + epoch is what matters (as PyTorch): seed 41 at epoch 1 == seed 42 at epoch 0.
  DistributedSampler c(100, opts(2, 0).seed(41));
  c.set_epoch(1);
  EXPECT_EQ(c.indices(), e0);
}

TEST(DistributedSampler, CopiesShareTheEpoch) {
  DistributedSampler a(50, opts(2, 1));
  DistributedSampler copy = a;
  a.set_epoch(4);
  EXPECT_EQ(copy.epoch(), 4);
  EXPECT_EQ(copy.indices(), a.indices());
}

TEST(DistributedSampler, RejectsBadArguments) {
  EXPECT_THAT(dtrain_error_of([] { DistributedSampler(10, opts(4, 4)); }), HasSubstr("got rank 4"));
  EXPECT_THAT(dtrain_error_of([] { DistributedSampler(10, opts(4, -1)); }), HasSubstr("got rank -1"));
  EXPECT_THAT(dtrain_error_of([] { DistributedSampler(10, opts(0, 0)); }),
              HasSubstr("num_replicas must be > 0, got 0"));
  EXPECT_THAT(dtrain_error_of([] { DistributedSampler(10, opts(-2, 0)); }), HasSubstr("got -2"));
  // No process group here: the defaults cannot be taken from it.
  const std::string msg = dtrain_error_of([] { DistributedSampler(10); });
  EXPECT_THAT(msg, HasSubstr("init_process_group")) << msg;
  EXPECT_THAT(dtrain_error_of([] { DistributedSampler(10, DistributedSamplerOptions().num_replicas(2)); }),
              HasSubstr("rank not given"));
}

TEST(DistributedSampler, NextWalksOnePassAndResetStartsAnother) {
  DistributedSampler s(23, opts(2, 1).seed(3));
  const auto all = s.indices();
  EXPECT_EQ(drain(s, 5), all);
  EXPECT_FALSE(s.next(5).has_value());
  s.set_epoch(2);
  s.reset();
  EXPECT_EQ(drain(s, 100), s.indices());
  EXPECT_NE(s.indices(), all);
  s.reset(7);  // a new dataset size
  EXPECT_EQ(s.dataset_size(), 7u);
  EXPECT_EQ(s.size(), 4u);
  EXPECT_EQ(drain(s, 3).size(), 4u);
}

TEST(DistributedSampler, SaveLoadResumesMidEpoch) {
  DistributedSampler s(40, opts(3, 2).seed(9));
  s.set_epoch(5);
  s.reset();
  std::vector<int64_t> first;
  for (int k = 0; k < 2; ++k) {
    const auto batch = s.next(4);  // not `: *s.next(4)`: the optional would die before the loop
    for (size_t i : *batch) first.push_back(static_cast<int64_t>(i));
  }
  torch::serialize::OutputArchive out;
  s.save(out);
  std::stringstream buf;
  out.save_to(buf);
  const auto rest = drain(s, 4);

  DistributedSampler restored(40, opts(3, 2).seed(9));
  torch::serialize::InputArchive in;
  in.load_from(buf);
  restored.load(in);
  EXPECT_EQ(restored.epoch(), 5);
  EXPECT_EQ(restored.position(), 8u);
  EXPECT_EQ(drain(restored, 4), rest);

  DistributedSampler other_seed(40, opts(3, 2).seed(10));
  std::stringstream buf2;
  out.save_to(buf2);
  torch::serialize::InputArchive in2;
  in2.load_from(buf2);
  const std::string msg = dtrain_error_of([&] { other_seed.load(in2); });
  EXPECT_THAT(msg, HasSubstr("seed = 9")) << msg;
}

namespace {
// data = the sample's index.
struct IndexDataset : torch::data::datasets::Dataset<IndexDataset> {
  explicit IndexDataset(size_t n) : n(n) {}
  torch::data::Example<> get(size_t i) override { return {torch::tensor(static_cast<int64_t>(i)), torch::tensor(0)}; }
  c10::optional<size_t> size() const override { return n; }
  size_t n;
};
}  // namespace

TEST(DistributedSampler, WorksWithDataLoaderWorkers) {
  const size_t n = 101;
  const int64_t replicas = 3;
  for (bool drop_last : {false, true}) {
    std::vector<std::vector<int64_t>> prev(replicas);
    for (int64_t epoch = 0; epoch < 3; ++epoch) {
      std::multiset<int64_t> all_ranks;
      for (int64_t rank = 0; rank < replicas; ++rank) {
        DistributedSampler sampler(n, opts(replicas, rank).drop_last(drop_last));
        auto loader = torch::data::make_data_loader(IndexDataset(n), sampler,
                                                    torch::data::DataLoaderOptions().batch_size(8).workers(3));
        sampler.set_epoch(epoch);  // after make_data_loader: reaches the loader's copy
        std::vector<int64_t> got;
        for (auto& batch : *loader) {
          for (auto& example : batch) got.push_back(example.data.item<int64_t>());
        }
        EXPECT_EQ(got, sampler.indices()) << "rank " << rank << " epoch " << epoch;
        std::set<int64_t> distinct(got.begin(), got.end());
        if (drop_last) {
          EXPECT_EQ(distinct.size(), got.size()) << "each index once";
        }
        EXPECT_NE(got, prev[rank]) << "epoch " << epoch << " repeats the previous order";
        prev[rank] = got;
        all_ranks.insert(got.begin(), got.end());
      }
      const std::set<int64_t> covered(all_ranks.begin(), all_ranks.end());
      EXPECT_EQ(covered.size(), drop_last ? n / replicas * replicas : n);
      EXPECT_EQ(all_ranks.size(), drop_last ? 99u : 102u);
    }
  }
}

TEST(DistributedSampler, LoaderReiteratesWithNewEpoch) {
  DistributedSampler sampler(30, opts(2, 0));
  auto loader = torch::data::make_data_loader(IndexDataset(30), sampler,
                                              torch::data::DataLoaderOptions().batch_size(4).workers(2));
  std::vector<std::vector<int64_t>> epochs;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    sampler.set_epoch(epoch);
    std::vector<int64_t> got;
    for (auto& batch : *loader)
      for (auto& example : batch) got.push_back(example.data.item<int64_t>());
    EXPECT_EQ(got, sampler.indices());
    epochs.push_back(got);
  }
  EXPECT_NE(epochs[0], epochs[1]);
  EXPECT_NE(epochs[1], epochs[2]);
}
