// DistributedSampler::reshard_epoch (Note [Resharded epoch]): for many dataset sizes, world sizes,
// positions, drop_last and shuffle settings, the rest of an epoch on M ranks equals a brute-force
// reference built from the unresharded samplers of the old world, and over the whole epoch every
// dataset index is trained exactly once (plus each world's padding); chains of world changes,
// save/load, the DataLoader's copy and the errors.
#include <torch/data.h>
#include <torch/serialize.h>
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <sstream>

#include "dtrain/sampler.h"
#include "test_util.h"
#include "matchers.h"

using dtrain::DistributedSampler;
using dtrain::DistributedSamplerOptions;
using dtrain::EpochSegment;
using dtrain::test_util::dtrain_error_of;

namespace {

struct Config {
  size_t n;
  bool shuffle, drop_last;
  int64_t epoch = 3;
};

DistributedSamplerOptions opts(const Config& c, int64_t replicas, int64_t rank) {
  return DistributedSamplerOptions().num_replicas(replicas).rank(rank).seed(11).shuffle(c.shuffle).drop_last(
      c.drop_last);
}

// Every rank's list for the current epoch of a world of `replicas`, after `segments`.
std::vector<std::vector<int64_t>> world_lists(const Config& c, int64_t replicas,
                                              const std::vector<EpochSegment>& segments) {
  std::vector<std::vector<int64_t>> lists;
  for (int64_t r = 0; r < replicas; ++r) {
    DistributedSampler s(c.n, opts(c, replicas, r));
    s.set_epoch(c.epoch);
    for (const auto& seg : segments) s.reshard_epoch(seg);
    lists.push_back(s.indices());
  }
  return lists;
}

// The brute-force reference of one world change, from the old world's per-rank lists alone:
// interleave them back into the old list, mark the indices the ranks consumed, keep the others in
// list order once each, and deal them out to `new_replicas` ranks as DistributedSampler would.
std::vector<std::vector<int64_t>> reference(const std::vector<std::vector<int64_t>>& old_lists,
                                            const std::vector<int64_t>& positions, int64_t new_replicas,
                                            bool drop_last) {
  const size_t w = old_lists.size();
  std::vector<int64_t> list;  // old_lists[r][k] at r + k * w
  for (size_t k = 0; w > 0 && k < old_lists[0].size(); ++k)
    for (size_t r = 0; r < w; ++r) list.push_back(old_lists[r][k]);
  std::set<int64_t> consumed, seen;
  for (size_t r = 0; r < w; ++r)
    for (int64_t k = 0; k < positions[r]; ++k) consumed.insert(old_lists[r][k]);
  std::vector<int64_t> rest;
  for (int64_t v : list)
    if (!consumed.count(v) && seen.insert(v).second) rest.push_back(v);
  const auto m = static_cast<size_t>(new_replicas);
  const size_t per_rank = drop_last ? rest.size() / m : (rest.size() + m - 1) / m;
  std::vector<std::vector<int64_t>> out(m);
  for (size_t r = 0; r < m; ++r)
    for (size_t k = 0; k < per_rank; ++k) out[r].push_back(rest[(r + k * m) % rest.size()]);
  return out;
}

// How often each dataset index is trained over the epoch: the old world's consumed part plus the
// new world's lists.
std::map<int64_t, int> trained(const std::vector<std::vector<int64_t>>& old_lists,
                               const std::vector<int64_t>& positions,
                               const std::vector<std::vector<int64_t>>& new_lists) {
  std::map<int64_t, int> count;
  for (size_t r = 0; r < old_lists.size(); ++r)
    for (int64_t k = 0; k < positions[r]; ++k) ++count[old_lists[r][k]];
  for (const auto& l : new_lists)
    for (int64_t v : l) ++count[v];
  return count;
}

// A few positions between 0 and `per_rank`: all equal (what a DDP run has), and unequal.
std::vector<std::vector<int64_t>> position_cases(int64_t replicas, int64_t per_rank) {
  std::vector<std::vector<int64_t>> cases;
  for (int64_t p : std::set<int64_t>{0, 1, per_rank / 3, per_rank / 2, per_rank - 1, per_rank}) {
    if (p < 0 || p > per_rank) continue;
    cases.emplace_back(replicas, p);
    std::vector<int64_t> uneven(replicas);
    for (int64_t r = 0; r < replicas; ++r) uneven[r] = std::max<int64_t>(0, p - r % 2);
    cases.push_back(uneven);
  }
  return cases;
}

}  // namespace

TEST(SamplerReshard, MatchesTheBruteForceReferenceAndTrainsEachIndexOnce) {
  int cases = 0;
  for (size_t n : {0u, 1u, 2u, 3u, 5u, 7u, 10u, 12u, 31u, 64u, 101u}) {
    for (bool shuffle : {true, false}) {
      for (bool drop_last : {false, true}) {
        const Config c{n, shuffle, drop_last};
        for (int64_t from = 1; from <= 5; ++from) {
          const auto old_lists = world_lists(c, from, {});
          const auto per_rank = static_cast<int64_t>(old_lists[0].size());
          // The old world's list without padding: the indices an epoch of `from` ranks covers.
          std::set<int64_t> covered;
          for (const auto& l : old_lists) covered.insert(l.begin(), l.end());
          for (int64_t to = 1; to <= 5; ++to) {
            for (const auto& positions : position_cases(from, per_rank)) {
              const std::string what = "n=" + std::to_string(n) + " shuffle=" + std::to_string(shuffle) +
                                       " drop_last=" + std::to_string(drop_last) + " " + std::to_string(from) + " -> " +
                                       std::to_string(to) + " ranks, rank 0's position " +
                                       std::to_string(positions[0]) +
                                       (positions.size() > 1 && positions[1] != positions[0] ? " (uneven)" : "");
              const auto got = world_lists(c, to, {{from, positions}});
              ASSERT_EQ(got, reference(old_lists, positions, to, drop_last)) << what;
              // Every rank the same number of steps (DDP runs in lockstep).
              for (const auto& l : got) ASSERT_EQ(l.size(), got[0].size()) << what;
              // Over the epoch: every index of the old world's list is trained, none of them twice
              // except padded duplicates (fewer than `from` + `to` in all), nothing else is.
              const auto count = trained(old_lists, positions, got);
              int64_t extra = 0, missing = 0;
              for (int64_t v : covered) {
                const auto it = count.find(v);
                if (it == count.end())
                  ++missing;
                else
                  extra += it->second - 1;
              }
              for (const auto& [v, k] : count) ASSERT_TRUE(covered.count(v)) << what << ": index " << v;
              if (drop_last) {
                ASSERT_EQ(extra, 0) << what;     // nothing padded
                ASSERT_LT(missing, to) << what;  // only the new world's cut tail
              } else {
                ASSERT_EQ(missing, 0) << what;
                ASSERT_LT(extra, from + to) << what;
              }
              ++cases;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 5000);
}

TEST(SamplerReshard, AChainOfWorldChangesInOneEpochStillTrainsEachIndexOnce) {
  for (bool drop_last : {false, true}) {
    const Config c{103, true, drop_last};
    // 3 ranks take 5 each, then 2 ranks take 7 each, then 4 ranks finish.
    const auto first = world_lists(c, 3, {});
    const EpochSegment a{3, {5, 5, 5}};
    const auto second = world_lists(c, 2, {a});
    ASSERT_EQ(second, reference(first, a.positions, 2, drop_last));
    const EpochSegment b{2, {7, 7}};
    const auto third = world_lists(c, 4, {a, b});
    ASSERT_EQ(third, reference(second, b.positions, 4, drop_last));
    std::map<int64_t, int> count;
    for (const auto& l : first)
      for (int k = 0; k < 5; ++k) ++count[l[k]];
    for (const auto& l : second)
      for (int k = 0; k < 7; ++k) ++count[l[k]];
    for (const auto& l : third)
      for (int64_t v : l) ++count[v];
    int64_t total = 0;
    for (const auto& [v, k] : count) total += k;
    if (drop_last) {
      // 103 cut to 102 for 3 ranks, 15 consumed; 87 left, cut to 86 for 2 ranks, 14 consumed; 72 left
      // for 4 ranks.
      EXPECT_EQ(count.size(), 101u);
      EXPECT_EQ(total, 101);
    } else {
      // 103 padded to 105 for 3 ranks, 15 consumed; 88 left for 2 ranks, 14 consumed; 74 left, padded
      // to 76 for 4 ranks: 2 duplicates.
      EXPECT_EQ(count.size(), 103u);
      EXPECT_EQ(total, 105);
    }
  }
}

TEST(SamplerReshard, SaveLoadKeepsTheSegmentsAndLoadReshardedAddsOne) {
  const Config c{50, true, false};
  // 3 ranks consumed 4 each; 2 ranks take over and save mid-way through the rest.
  DistributedSampler two(c.n, opts(c, 2, 1));
  two.set_epoch(c.epoch);
  two.reshard_epoch({3, {4, 4, 4}});
  EXPECT_EQ(two.epoch_size(), 19u);  // 50 - 12 = 38 left, 19 each
  two.reset();
  two.next(5);
  torch::serialize::OutputArchive out;
  two.save(out);
  std::stringstream buf;
  out.save_to(buf);

  // The same world: the same segments, the same position.
  {
    DistributedSampler again(c.n, opts(c, 2, 1));
    torch::serialize::InputArchive in;
    buf.seekg(0);
    in.load_from(buf);
    again.load(in);
    EXPECT_EQ(again.epoch_segments().size(), 1u);
    EXPECT_EQ(again.indices(), two.indices());
    EXPECT_EQ(again.position(), 5u);
  }
  // Another world: plain load() refuses, load_resharded() stacks the 2-rank segment.
  for (int64_t r = 0; r < 3; ++r) {
    DistributedSampler three(c.n, opts(c, 3, r));
    torch::serialize::InputArchive in;
    buf.seekg(0);
    in.load_from(buf);
    const std::string msg = dtrain_error_of([&] { three.load(in); });
    EXPECT_THAT(msg, HasSubstr("saved with num_replicas = 2, loading into one with num_replicas = 3")) << msg;
    torch::serialize::InputArchive in2;
    buf.seekg(0);
    in2.load_from(buf);
    three.load_resharded(in2, {5, 5});
    EXPECT_EQ(three.epoch(), c.epoch);
    ASSERT_EQ(three.epoch_segments().size(), 2u);
    EXPECT_EQ(three.indices(), world_lists(c, 3, {{3, {4, 4, 4}}, {2, {5, 5}}})[r]);
  }
}

TEST(SamplerReshard, TheLoadersCopyTakesTheRestAndTheNextEpochIsNormal) {
  const Config c{40, true, false};
  DistributedSampler mine(c.n, opts(c, 2, 0));
  auto loader_copy = mine;  // what make_data_loader holds
  mine.set_epoch(c.epoch);
  mine.reshard_epoch({4, {3, 3, 3, 3}});
  loader_copy.reset();
  std::vector<int64_t> walked;
  while (auto batch = loader_copy.next(4))
    for (size_t i : *batch) walked.push_back(static_cast<int64_t>(i));
  EXPECT_EQ(walked, mine.indices());
  EXPECT_EQ(walked.size(), 14u);  // 40 - 12 = 28 left, 14 each
  mine.set_epoch(c.epoch + 1);
  EXPECT_TRUE(mine.epoch_segments().empty());
  EXPECT_EQ(mine.epoch_size(), mine.size());
  DistributedSampler fresh(c.n, opts(c, 2, 0));
  fresh.set_epoch(c.epoch + 1);
  EXPECT_EQ(mine.indices(), fresh.indices());
}

TEST(SamplerReshard, RejectsBadSegments) {
  const Config c{20, true, false};
  DistributedSampler s(c.n, opts(c, 2, 0));
  std::string msg = dtrain_error_of([&] { s.reshard_epoch({3, {1, 1}}); });
  EXPECT_THAT(msg, HasSubstr("2 positions given for num_replicas = 3")) << msg;
  msg = dtrain_error_of([&] { s.reshard_epoch({3, {1, 8, 1}}); });  // 7 per rank on 3 ranks
  EXPECT_THAT(msg, HasSubstr("rank 1's position 8 is outside [0, 7]")) << msg;
  msg = dtrain_error_of([&] { s.reshard_epoch({0, {}}); });
  EXPECT_THAT(msg, HasSubstr("num_replicas must be > 0, got 0")) << msg;
  EXPECT_TRUE(s.epoch_segments().empty());
}
