// DDP + Autocast + GradScaler on real ranks: the tutorial's train_epoch (scale, backward, unscale_,
// clip_grad_norm_, step, update) with an overflow injected on ONE rank. Then sharded gradients
// (fully_shard, tensor parallelism, both on a 2-D mesh) with an inf in one rank's own part of a
// gradient: every rank must skip that step and back off, with no option set (PyTorch's
// test_fully_shard_grad_scaler).
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <functional>

#include "dist_main.h"
#include "matchers.h"
#include "dtrain/amp.h"
#include "dtrain/ddp.h"
#include "dtrain/device_mesh.h"
#include "dtrain/fsdp.h"
#include "dtrain/join.h"
#include "dtrain/tensor_parallel.h"
#include "tp_models.h"
#include "tutorial_models.h"

using namespace dtrain;

namespace {
at::Tensor all_params(torch::nn::Module& m) {
  std::vector<at::Tensor> flat;
  for (auto& p : m.parameters()) flat.push_back(p.detach().reshape({-1}));
  return at::cat(flat);
}
}  // namespace

TEST(AmpDist, OverflowOnOneRankSkipsTheSameStepEverywhere) {
  torch::manual_seed(rank());
  tutorial::TrainModel model;
  DistributedDataParallel ddp(model);
  torch::optim::Adam opt(ddp.parameters(), 1e-3);
  GradScaler scaler(GradScalerOptions().init_scale(1024).growth_interval(4));
  constexpr int kOverflowStep = 2;
  std::vector<int> stepped;
  for (int s = 0; s < 6; ++s) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(100 * s + rank());
    at::Tensor x = at::randn({4, 3, 32, 32}, g), y = at::randint(0, 10, {4}, g);
    opt.zero_grad();
    at::Tensor loss;
    {
      Autocast ac(at::kCPU);
      at::Tensor logits = ddp(x);
      EXPECT_EQ(logits.scalar_type(), at::kBFloat16);
      loss = torch::nn::functional::cross_entropy(logits, y);
      EXPECT_EQ(loss.scalar_type(), at::kFloat);
    }
    if (s == kOverflowStep && rank() == world_size() - 1) loss = loss * std::numeric_limits<float>::infinity();
    scaler.scale(loss).backward();
    scaler.unscale_(opt);
    torch::nn::utils::clip_grad_norm_(ddp.parameters(), 1.0);
    stepped.push_back(scaler.step(opt) ? 1 : 0);
    scaler.update();
  }
  EXPECT_EQ(stepped, (std::vector<int>{1, 1, 0, 1, 1, 1}));
  // Backed off once at the overflow (1024 -> 512), then 3 clean steps: no growth yet (interval 4).
  EXPECT_DOUBLE_EQ(scaler.get_scale(), 512.0);
  at::Tensor mine = all_params(*model);
  std::vector<at::Tensor> all;
  for (int i = 0; i < world_size(); ++i) all.push_back(at::empty_like(mine));
  all_gather(all, mine);
  for (auto& t : all) EXPECT_TRUE(at::equal(t, all[0])) << "ranks diverged";
}

TEST(AmpDist, SyncGroupMakesRanksAgreeWithoutDdp) {
  // Without DDP the gradients differ per rank; process_group shares the overflow flag.
  torch::nn::Linear lin(4, 2);
  torch::optim::Adam opt(lin->parameters(), 1e-3);
  GradScaler scaler(GradScalerOptions().process_group(Group()));
  at::Tensor loss = lin(at::ones({2, 4})).sum();
  if (rank() == 0) loss = loss * std::numeric_limits<float>::quiet_NaN();
  scaler.scale(loss).backward();
  EXPECT_FALSE(scaler.step(opt));
  scaler.update();
}

namespace {

// Five SGD steps under a GradScaler with no process_group; at step 2 rank `bad` alone writes an inf
// into the first element of its own part of `poisoned`'s gradient. Returns which steps ran, and
// checks on this rank that a skipped step left every parameter as it was and a taken one did not.
std::vector<int> train_with_one_ranks_inf(torch::nn::Module& model, const at::Tensor& poisoned,
                                          const std::function<at::Tensor(const at::Tensor&)>& forward, int bad,
                                          GradScaler& scaler) {
  torch::optim::SGD opt(model.parameters(), 0.1);
  std::vector<int> stepped;
  for (int s = 0; s < 5; ++s) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(7 + s);  // the same batch on every rank (tp's input)
    at::Tensor x = at::randn({6, 8}, g);
    opt.zero_grad();
    at::Tensor loss = forward(x).pow(2).mean();
    scaler.scale(loss).backward();
    if (s == 2 && rank() == bad) {
      EXPECT_GT(poisoned.grad().numel(), 0) << "rank " << bad << " holds no part of the poisoned gradient";
      poisoned.mutable_grad().view({-1})[0] = std::numeric_limits<float>::infinity();
    }
    at::Tensor before = all_params(model).clone();
    const bool took = scaler.step(opt);
    EXPECT_EQ(took, !at::equal(before, all_params(model))) << "step " << s << ": step() said " << took;
    stepped.push_back(took ? 1 : 0);
    scaler.update();
  }
  return stepped;
}

void expect_every_rank_skipped_step_2(const std::vector<int>& stepped, const GradScaler& scaler) {
  EXPECT_EQ(stepped, (std::vector<int>{1, 1, 0, 1, 1})) << "rank " << rank();
  EXPECT_DOUBLE_EQ(scaler.get_scale(), 512.0) << "rank " << rank() << ": backed off once from 1024";
  at::Tensor mine = at::tensor({scaler.get_scale()}, at::kDouble);
  std::vector<at::Tensor> all;
  for (int i = 0; i < world_size(); ++i) all.push_back(at::empty_like(mine));
  all_gather(all, mine);
  for (int i = 0; i < world_size(); ++i) EXPECT_TRUE(at::equal(all[i], mine)) << "rank " << i << "'s scale differs";
}

GradScalerOptions small_scale() { return GradScalerOptions().init_scale(1024).growth_interval(100); }

}  // namespace

// fully_shard: each rank unscales only its rows; the inf sits in the last rank's rows of w1.weight.
TEST(AmpDist, FullyShardInfInOneRanksRowsSkipsEverywhere) {
  torch::manual_seed(3);
  tp_models::MLP mlp(8, 4 * world_size());
  auto root = fully_shard(mlp);
  GradScaler scaler(small_scale());
  auto stepped = train_with_one_ranks_inf(
      *mlp, mlp->w1->weight, [&](const at::Tensor& x) { return root(x); }, world_size() - 1, scaler);
  expect_every_rank_skipped_step_2(stepped, scaler);
}

// Tensor parallelism over the world: the inf sits in rank 0's columns of w1 (Colwise).
TEST(AmpDist, TensorParallelInfInOneRanksPartSkipsEverywhere) {
  torch::manual_seed(3);
  tp_models::MLP mlp(8, 4 * world_size());
  parallelize_module(*mlp, Group(), tp_models::mlp_plan());
  GradScaler scaler(small_scale());
  auto stepped = train_with_one_ranks_inf(
      *mlp, mlp->w1->weight, [&](const at::Tensor& x) { return mlp(x); }, 0, scaler);
  expect_every_rank_skipped_step_2(stepped, scaler);
}

// Both on a {dp, tp} mesh (tp 2 where the world divides, else 1): parallelize over "tp", then
// fully_shard over "dp"; the inf in the last rank's part, which shares neither group with rank 0.
TEST(AmpDist, TensorParallelInsideFullyShardInfInOneRanksPartSkipsEverywhere) {
  const int64_t tp = world_size() % 2 == 0 ? 2 : 1;
  DeviceMesh mesh = init_device_mesh({world_size() / tp, tp}, {"dp", "tp"});
  torch::manual_seed(3);
  tp_models::MLP mlp(8, 4 * world_size());
  parallelize_module(*mlp, mesh["tp"], tp_models::mlp_plan());
  auto root = fully_shard(mlp, FullyShardOptions().mesh(mesh["dp"]));
  GradScaler scaler(small_scale());
  auto stepped = train_with_one_ranks_inf(
      *mlp, mlp->w2->weight, [&](const at::Tensor& x) { return root(x); }, world_size() - 1, scaler);
  expect_every_rank_skipped_step_2(stepped, scaler);
}

// The overflow flag of sharded gradients is all-reduced over their group, which no joinable
// shadows: inside a Join whose ranks share that group a rank that has joined would leave the others
// waiting, so unscale_ refuses in one line on every rank instead (the Join itself still closes).
TEST(AmpDist, ShardedGradientsInsideAJoinAreRefusedInOneLine) {
  torch::manual_seed(3);
  tp_models::MLP mlp(8, 4 * world_size());
  auto root = fully_shard(mlp);
  torch::nn::Linear other(4, 2);
  DistributedDataParallel ddp(other);  // the Join's joinable, over the world
  torch::optim::SGD opt(mlp->parameters(), 0.1);
  GradScaler scaler(small_scale());
  scaler.scale(root(at::ones({6, 8})).pow(2).mean()).backward();
  Join join({&ddp});
  EXPECT_THAT([&] { scaler.unscale_(opt); },
              ThrowsDtrainError(HasSubstr("GradScaler: sharded gradients on rank " + std::to_string(rank()) +
                                          " inside a dtrain::Join")));
  join.join();
}

DTRAIN_DIST_TEST_MAIN()
