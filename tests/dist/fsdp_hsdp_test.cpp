// HSDP: fully_shard over a 2-D mesh {replicate 2, shard 2} on 4 real processes, against one process
// training the whole batch in float64: each rank holds its shard group's chunk of every parameter
// (as FSDP2, torch.chunk on dim 0) and the same rows as its replica, with a ShardSpec cut over the
// shard group only; parameters within 1e-10 after 20 Adam steps (ZeRO-3 and ZeRO-2, float64's
// pre- and post-divided sums), and within float32's rounding with a float32 reduce dtype (the
// averaging collectives); gradient accumulation without sync; GradScaler's skip agreed by all four
// ranks when one sees an inf; a checkpoint saved on {2, 2} loaded by fully_shard over the 4 ranks
// and by an unsharded model on every rank, which get the very whole parameters.
#include <torch/optim/adam.h>

#include <unistd.h>

#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dist_main.h"
#include "dtrain/amp.h"
#include "dtrain/checkpoint.h"
#include "dtrain/device_mesh.h"
#include "dtrain/fsdp.h"
#include "dtrain/shard_spec.h"
#include "fsdp_models.h"
#include "matchers.h"

using namespace dtrain;
using fsdp_models::Net;

namespace {

using fsdp_models::max_rel_diff;

// The mesh every test shards over: 4 ranks as {replicate 2, shard 2} (shard groups {0, 1} and
// {2, 3}, replicate groups {0, 2} and {1, 3}), as FSDP2's init_device_mesh((2, 2),
// mesh_dim_names=("replicate", "shard")).
DeviceMesh hsdp_mesh() {
  static DeviceMesh mesh = init_device_mesh({2, 2}, {"replicate", "shard"});
  return mesh;
}

std::unique_ptr<torch::optim::Optimizer> make_adam(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
}

// The HSDP model and one process's, trained alike: every rank of the world its part of the batch.
struct Pair {
  Net net = fsdp_models::make_net();
  Net ref = fsdp_models::make_net();
  FSDPModule<fsdp_models::NetImpl> fsdp{nullptr};
  std::unique_ptr<torch::optim::Optimizer> opt, ref_opt;

  explicit Pair(FullyShardOptions options = FullyShardOptions()) {
    fsdp = fsdp_models::shard(net, options.mesh(hsdp_mesh()));
    opt = make_adam(net->parameters());
    ref_opt = make_adam(ref->parameters());
  }
  // micro > 1: that many backward passes per step, all but the last without sync.
  void step(int s, int micro = 1) {
    auto [x, y] = fsdp_models::batch(s);
    ref_opt->zero_grad();
    (ref->forward(x) - y).pow(2).mean().backward();
    ref_opt->step();
    fsdp_models::keep_this_ranks_part(x, y);
    opt->zero_grad();
    auto xs = x.chunk(micro), ys = y.chunk(micro);
    for (int m = 0; m < micro; ++m) {
      fsdp.set_requires_gradient_sync(m + 1 == micro);
      ((fsdp(xs[m]) - ys[m]).pow(2).mean() / micro).backward();
    }
    opt->step();
  }
};

}  // namespace

TEST(Hsdp, EachRankHoldsItsShardGroupsChunkAndTheSameRowsAsItsReplica) {
  ASSERT_EQ(world_size(), 4) << "HSDP's tests run on a {2, 2} mesh";
  Net net = fsdp_models::make_net();
  std::map<std::string, at::Tensor> whole;
  for (const auto& kv : net->named_parameters()) whole[kv.key()] = kv.value().detach().clone();
  fsdp_models::shard(net, FullyShardOptions().mesh(hsdp_mesh()));
  const Group shard = hsdp_mesh().get_group("shard"), replicate = hsdp_mesh().get_group("replicate");
  for (const auto& kv : net->named_parameters()) {
    const at::Tensor& w = whole.at(kv.key());
    at::Tensor expected = w.chunk(2, 0)[shard.rank()];  // every parameter here has 2 rows or more
    EXPECT_EQ(kv.value().sizes(), expected.sizes()) << kv.key() << ": half of " << w.size(0) << " rows";
    EXPECT_TRUE(kv.value().equal(expected)) << kv.key() << ": the shard group's chunk " << shard.rank();
    // The same rows as the replica: the replicate group's sum is twice this rank's.
    at::Tensor sum = kv.value().detach().clone();
    all_reduce(sum, ReduceOp::SUM, replicate);
    EXPECT_TRUE(sum.equal(kv.value() * 2)) << kv.key() << ": the replicas hold the same rows";
    auto spec = shard_spec_of(kv.value());
    ASSERT_TRUE(spec.has_value()) << kv.key();
    ASSERT_EQ(spec->cuts().size(), 1u) << kv.key() << ": " << spec->to_string();
    EXPECT_EQ(spec->cuts()[0].group.name(), shard.name()) << kv.key() << ": cut over the shard group only";
    EXPECT_EQ(spec->offsets()[0], shard.rank() * ((w.size(0) + 1) / 2)) << kv.key();
  }
}

TEST(Hsdp, TwentyAdamStepsEqualOneProcessOnTheWholeBatch) {
  for (bool zero3 : {true, false}) {
    Pair pair(FullyShardOptions().reshard_after_forward(zero3));
    for (int s = 0; s < 20; ++s) pair.step(s);
    EXPECT_LT(max_rel_diff(pair.fsdp.full_state_dict(), *pair.ref), 1e-10) << (zero3 ? "ZeRO-3" : "ZeRO-2");
  }
}

// A float32 reduce dtype takes FSDP2's other arithmetic: an averaging reduce-scatter, then an
// averaging all-reduce; float32's rounding of the gradients is all that differs from one process.
TEST(Hsdp, Float32ReduceDtypeAveragesInBothCollectives) {
  Pair pair(FullyShardOptions().mp_policy(MixedPrecisionPolicy().reduce_dtype(at::kFloat)));
  for (int s = 0; s < 5; ++s) pair.step(s);
  const double diff = max_rel_diff(pair.fsdp.full_state_dict(), *pair.ref);
  EXPECT_LT(diff, 1e-4) << "gradients averaged in float32";
  EXPECT_GT(diff, 0) << "the gradients went through float32";
}

TEST(Hsdp, GradientAccumulationWithoutSyncEqualsTheLargeBatch) {
  Pair pair;
  for (int s = 0; s < 6; ++s) pair.step(s, /*micro=*/3);
  EXPECT_LT(max_rel_diff(pair.fsdp.full_state_dict(), *pair.ref), 1e-10);
}

// An inf that only rank 3 sees (put into its shard's gradient after backward) makes every rank skip:
// the overflow flag is reduced over the shard group and the replicate group.
TEST(Hsdp, GradScalerSkipsOnEveryRankWhenOneRankSeesAnInf) {
  Net net = fsdp_models::make_net();
  auto fsdp = fsdp_models::shard(net, FullyShardOptions().mesh(hsdp_mesh()));
  auto opt = make_adam(net->parameters());
  GradScaler scaler;
  auto [x, y] = fsdp_models::batch(0);
  fsdp_models::keep_this_ranks_part(x, y);
  scaler.scale((fsdp(x) - y).pow(2).mean()).backward();
  if (rank() == 3) net->out->weight.mutable_grad()[0][0] = std::numeric_limits<double>::infinity();
  const at::Tensor before = net->out->weight.detach().clone();
  EXPECT_FALSE(scaler.step(*opt)) << "rank " << rank() << " stepped although rank 3 saw an inf";
  EXPECT_TRUE(net->out->weight.equal(before)) << "rank " << rank();
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 32768.0) << "every rank backed off alike";
}

// Saved on {2, 2}, where replicas hold the same chunks; loaded by fully_shard over the 4 ranks and
// by an unsharded model on every rank: both get the saver's very whole parameters.
TEST(Hsdp, ACheckpointSavedOn2x2LoadsOnFourRanksAndUnsharded) {
  const int64_t pid0 = all_reduce_values(std::vector<int64_t>{rank() == 0 ? ::getpid() : 0}, ReduceOp::MAX)[0];
  const std::string dir = "/tmp/dtrain_hsdp_ckpt_" + std::to_string(pid0);
  Pair pair;
  for (int s = 0; s < 4; ++s) pair.step(s);
  const auto saved = pair.fsdp.full_state_dict();
  {
    CheckpointManager ckpt(dir);
    TrainingState st;
    st.model = pair.net.ptr().get();
    st.optimizer = pair.opt.get();
    st.step = 4;
    ckpt.save(st);
  }
  auto expect_equal = [&](const std::vector<std::pair<std::string, at::Tensor>>& got, const std::string& what) {
    ASSERT_EQ(got.size(), saved.size()) << what;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].first, saved[i].first) << what;
      EXPECT_TRUE(got[i].second.equal(saved[i].second)) << what << ": " << got[i].first;
    }
  };
  {
    Net flat = fsdp_models::make_net();
    auto root = fsdp_models::shard(flat);  // over the world's 4 ranks
    auto opt = make_adam(flat->parameters());
    TrainingState st;
    st.model = flat.ptr().get();
    st.optimizer = opt.get();
    ASSERT_TRUE(CheckpointManager(dir).load_latest(st).has_value());
    expect_equal(root.full_state_dict(), "fully_shard over 4 ranks");
  }
  {
    Net plain = fsdp_models::make_net();
    auto opt = make_adam(plain->parameters());
    TrainingState st;
    st.model = plain.ptr().get();
    st.optimizer = opt.get();
    ASSERT_TRUE(CheckpointManager(dir).load_latest(st).has_value());
    std::vector<std::pair<std::string, at::Tensor>> mine;
    for (const auto& kv : plain->named_parameters()) mine.emplace_back(kv.key(), kv.value().detach());
    expect_equal(mine, "an unsharded model");
  }
  barrier();
  if (rank() == 0) std::filesystem::remove_all(dir);
}

TEST(Hsdp, AThreeDimensionalMeshIsRefusedInOneLine) {
  DeviceMesh mesh = init_device_mesh({1, 2, 2}, {"pp", "replicate", "shard"});
  auto lin = std::make_shared<torch::nn::LinearImpl>(4, 4);
  EXPECT_THAT([&] { dtrain::fully_shard(lin, FullyShardOptions().mesh(mesh)); },
              ThrowsDtrainError(AllOf(HasSubstr("mesh has 3 dimensions (pp, replicate, shard)"),
                                      HasSubstr("as mesh[{\"replicate\", \"shard\"}]"), Not(HasSubstr("\n")))));
}

DTRAIN_DIST_TEST_MAIN()
