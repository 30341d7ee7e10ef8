// DDP + Autocast + GradScaler on real ranks: the tutorial's train_epoch (scale, backward, unscale_,
// clip_grad_norm_, step, update) with an overflow injected on ONE rank.
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>

#include "dist_main.h"
#include "dtrain/amp.h"
#include "dtrain/ddp.h"
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

DTRAIN_DIST_TEST_MAIN()
