// split_group and DeviceMesh on real ranks: colors and keys as MPI_Comm_split, each mesh
// dimension's group holding exactly the ranks that differ along it (checked by an all-reduce of the
// global ranks inside it), coordinates, sub-meshes and flattening, and the bad inputs, each one line
// on every rank: a shape whose product is not the world size, an unknown name, ranks building
// meshes in different orders.
#include <gmock/gmock.h>

#include <ATen/ATen.h>

#include "dist_main.h"
#include "dtrain/device_mesh.h"
#include "matchers.h"

using namespace dtrain;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

namespace {

// The sum of the members' global ranks, by an all-reduce inside `group`: proves who is in it.
int64_t sum_of_ranks(const Group& group) {
  at::Tensor t = at::full({1}, static_cast<double>(rank()), at::kDouble);
  all_reduce(t, ReduceOp::SUM, group);
  return static_cast<int64_t>(t.item<double>());
}

int64_t sum(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

}  // namespace

TEST(SplitGroup, ColorsMakeDisjointGroupsOrderedByRank) {
  const int n = world_size(), r = rank();
  Group half = split_group(/*color=*/r % 2, /*key=*/r);
  ASSERT_TRUE(half.is_member());
  std::vector<int> expected;
  for (int i = r % 2; i < n; i += 2) expected.push_back(i);
  EXPECT_THAT(half.ranks(), ElementsAreArray(expected));
  EXPECT_EQ(half.rank(), r / 2);
  int64_t want = 0;
  for (int i : expected) want += i;
  EXPECT_EQ(sum_of_ranks(half), want);

  // A split of a subgroup: only its members call it.
  Group single = split_group(/*color=*/half.rank(), /*key=*/0, half);
  EXPECT_EQ(single.size(), 1);
  EXPECT_EQ(sum_of_ranks(single), r);
}

TEST(SplitGroup, NegativeColorJoinsNothing) {
  Group g = split_group(rank() == 0 ? -1 : 0, rank());
  EXPECT_EQ(g.is_member(), rank() != 0);
  if (g.is_member()) {
    EXPECT_EQ(sum_of_ranks(g), world_size() * (world_size() - 1) / 2);
  }
}

TEST(SplitGroup, KeysAgainstRankOrderAreRefused) {
  EXPECT_THAT([] { split_group(0, -rank()); }, ThrowsDtrainError(HasSubstr("pass keys that increase with the rank")));
  // The group is usable afterwards: nothing was built.
  EXPECT_EQ(sum_of_ranks(Group()), world_size() * (world_size() - 1) / 2);
}

TEST(DeviceMesh, EachDimensionGroupsTheRanksAlongIt) {
  const int n = world_size(), r = rank();
  const int64_t rows = n / 2, cols = 2;  // n is even in this program's runs
  DeviceMesh mesh = init_device_mesh({rows, cols}, {"dp", "tp"});
  EXPECT_EQ(mesh.ndim(), 2);
  EXPECT_THAT(mesh.shape(), ElementsAreArray({rows, cols}));
  EXPECT_THAT(mesh.get_coordinate(), ElementsAreArray({r / cols, r % cols}));
  EXPECT_EQ(mesh.get_local_rank("tp"), r % cols);
  // tp: the pair {2i, 2i+1}; dp: the ranks of this column.
  const int base = r - r % 2;
  EXPECT_EQ(sum_of_ranks(mesh.get_group("tp")), 2 * base + 1);
  EXPECT_THAT(mesh.get_group("tp").ranks(), ElementsAreArray({base, base + 1}));
  std::vector<int64_t> column;
  for (int i = r % 2; i < n; i += 2) column.push_back(i);
  EXPECT_EQ(sum_of_ranks(mesh.get_group("dp")), sum(column));
  EXPECT_THAT(mesh["dp"].ranks(), ElementsAreArray(column));
  EXPECT_EQ(mesh["tp"].get_group().rank(), r % cols);
  EXPECT_EQ((mesh[{"dp", "tp"}].size()), n);

  DeviceMesh flat = mesh.flatten();
  EXPECT_THAT(flat.dim_names(), ElementsAreArray({"dp_tp"}));
  EXPECT_EQ(flat.get_local_rank("dp_tp"), r);
  EXPECT_EQ(sum_of_ranks(flat.get_group()), n * (n - 1) / 2);
  EXPECT_EQ(mesh.flatten().get_group().name(), flat.get_group().name());  // built once
}

TEST(DeviceMesh, SubMeshOfThreeDimensions) {
  const int64_t n = world_size();
  DeviceMesh mesh = init_device_mesh({n / 2, 1, 2}, {"pp", "dp", "tp"});
  EXPECT_THAT(mesh.get_coordinate(), ElementsAreArray({rank() / 2, 0, rank() % 2}));
  EXPECT_EQ(mesh.get_group("dp").size(), 1);
  DeviceMesh sub = mesh[{"pp", "tp"}];
  std::vector<int64_t> all;
  for (int64_t i = 0; i < n; ++i) all.push_back(i);
  EXPECT_THAT(sub.ranks(), ElementsAreArray(all));
  EXPECT_EQ(sum_of_ranks(sub.flatten("pp_tp").get_group()), n * (n - 1) / 2);
  EXPECT_THAT(([&] { mesh[{"tp", "pp"}]; }), ThrowsDtrainError(HasSubstr("are not in the mesh's order")));
}

TEST(DeviceMesh, BadInputIsOneLine) {
  const int64_t n = world_size();
  EXPECT_THAT(
      [&] {
        init_device_mesh({n, 2}, {"dp", "tp"});
      },
      ThrowsDtrainError(HasSubstr("the product of the sizes must be the world size")));
  EXPECT_THAT([&] { init_device_mesh({n}, {"a", "b"}); }, ThrowsDtrainError(HasSubstr("give one name per dimension")));
  EXPECT_THAT([&] { init_device_mesh({1, n}, {"a", "a"}); }, ThrowsDtrainError(HasSubstr("names must be unique")));
  DeviceMesh mesh = init_device_mesh({n}, {"tp"});
  EXPECT_THAT([&] { mesh.get_group("dp"); },
              ThrowsDtrainError(HasSubstr("no dimension named 'dp' in mesh with dims [tp]")));
  EXPECT_THAT([&] { mesh["pp"]; }, ThrowsDtrainError(HasSubstr("no dimension named 'pp'")));
}

TEST(DeviceMesh, RanksBuildingMeshesInDifferentOrdersFailAlike) {
  const int64_t n = world_size();
  // Rank 0 builds ("x") then ("y"); the others ("y") then ("x"): the first call fails everywhere.
  const std::string first = rank() == 0 ? "x" : "y";
  EXPECT_THAT([&] { init_device_mesh({n}, {first}); },
              ThrowsDtrainError(HasSubstr("device meshes differ across ranks: rank 0 builds mesh #")));
  // Nothing was built, and the world still works.
  EXPECT_EQ(sum_of_ranks(Group()), n * (n - 1) / 2);
}

DTRAIN_DIST_TEST_MAIN()
