// ZeroRedundancyOptimizer on 2 and 3 real processes: the partition of the parameters over the ranks
// is PyTorch's (tests/data/zero_partition_golden.json, made by
// tests/data/make_zero_partition_golden.py from torch.distributed.optim.ZeroRedundancyOptimizer:
// each parameter's owner and each rank's share in its local optimizer's order), for models whose
// parameters differ in size, including ties and ranks that own nothing; and a learning rate changed
// between steps (a scheduler, or by hand) reaches every rank's share as it reaches an unsharded
// optimizer, bit for bit.
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "dist_main.h"
#include "dtrain/zero.h"

using namespace dtrain;
using nlohmann::json;

namespace {

const json& golden() {
  static const json g = [] {
    std::ifstream in(DTRAIN_ZERO_PARTITION_GOLDEN);
    if (!in) throw std::runtime_error(std::string("cannot read ") + DTRAIN_ZERO_PARTITION_GOLDEN);
    return json::parse(in);
  }();
  return g;
}

// The position of `t` in `params` (by identity), or -1.
int index_in(const std::vector<at::Tensor>& params, const at::Tensor& t) {
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].is_same(t)) return static_cast<int>(i);
  return -1;
}

}  // namespace

TEST(ZeroPartition, OwnersAndSharesArePyTorchs) {
  const std::string world = std::to_string(world_size());
  ASSERT_GE(golden().at("models").size(), 5u);
  for (const auto& model : golden().at("models")) {
    const std::string name = model.at("name").get<std::string>();
    ASSERT_TRUE(model.at("partitions").contains(world)) << name << ": no golden for " << world << " ranks";
    const json& want = model.at("partitions").at(world);
    // Tensors of the model's shapes in its order: the partition depends on nothing else.
    std::vector<at::Tensor> params;
    for (const auto& shape : model.at("shapes"))
      params.push_back(at::ones(shape.get<std::vector<int64_t>>()).requires_grad_(true));
    ZeroRedundancyOptimizer opt(params, optimizer_factory<torch::optim::SGD>(torch::optim::SGDOptions(0.5)));
    EXPECT_EQ(opt.owners(), want.at("owners").get<std::vector<int>>()) << name << " on " << world << " ranks";
    // This rank's local optimizer holds its share in PyTorch's order (sorted by size, largest first).
    std::vector<int> share;
    for (const auto& p : opt.local_optimizer().param_groups()[0].params()) share.push_back(index_in(params, p));
    EXPECT_EQ(share, want.at("shares").at(rank()).get<std::vector<int>>()) << name << " on rank " << rank();
    // A step over that partition (ranks that own nothing included) updates every parameter on
    // every rank: gradient g_i = i + 1, so parameter i ends at 1 - 0.5 (i + 1).
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = at::full_like(params[i], double(i + 1));
    opt.step();
    for (size_t i = 0; i < params.size(); ++i)
      EXPECT_TRUE(params[i].detach().equal(at::full_like(params[i], 1 - 0.5 * double(i + 1))))
          << name << ": parameter " << i << " (owner " << opt.owners()[i] << ")";
  }
}

namespace {

torch::nn::Sequential make_model() {
  torch::manual_seed(11);
  torch::nn::Sequential m(torch::nn::Linear(6, 10), torch::nn::Tanh(), torch::nn::Linear(10, 7), torch::nn::Tanh(),
                          torch::nn::Linear(7, 2));
  m->to(at::kDouble);
  return m;
}

// Whole-batch gradients of step s, the same bits on every rank (no DDP: ZeRO's step alone is tested).
void backward(torch::nn::Sequential& m, int s) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(500 + s);
  at::Tensor x = at::randn({9, 6}, g, at::kDouble), y = at::randn({9, 2}, g, at::kDouble);
  for (auto& p : m->parameters()) p.mutable_grad() = at::Tensor();
  (m->forward(x) - y).pow(2).mean().backward();
}

bool bit_identical(torch::nn::Sequential& a, torch::nn::Sequential& b) {
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    if (!pa[i].equal(pb[i])) return false;
  return true;
}

// Trains 8 steps; before step s, `schedule(opt, s)` may change the learning rate.
template <typename Schedule>
torch::nn::Sequential train(bool sharded, const OptimizerFactory& factory, Schedule schedule) {
  auto m = make_model();
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (sharded)
    opt = std::make_unique<ZeroRedundancyOptimizer>(m->parameters(), factory);
  else
    opt = factory(m->parameters());
  schedule(*opt, -1);  // construction: e.g. a scheduler attached to this optimizer
  for (int s = 0; s < 8; ++s) {
    schedule(*opt, s);
    backward(m, s);
    opt->step();
    if (sharded) {
      // The share stepped with the learning rate just set.
      auto& zero = static_cast<ZeroRedundancyOptimizer&>(*opt);
      EXPECT_DOUBLE_EQ(zero.local_optimizer().param_groups()[0].options().get_lr(),
                       zero.param_groups()[0].options().get_lr())
          << "step " << s;
    }
  }
  return m;
}

}  // namespace

TEST(ZeroPartition, ALearningRateChangedBetweenStepsEqualsTheUnshardedOptimizer) {
  const std::vector<std::pair<std::string, OptimizerFactory>> factories = {
      {"adam", optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(0.02))},
      {"sgd", optimizer_factory<torch::optim::SGD>(torch::optim::SGDOptions(0.05).momentum(0.9))}};
  for (const auto& [kind, factory] : factories) {
    // torch::optim::StepLR halving param_groups()[0]'s lr every 2 steps, stepped after each step as
    // usual (here: before the next).
    auto with_step_lr = [](bool sharded, const OptimizerFactory& f) {
      std::unique_ptr<torch::optim::StepLR> sched;
      return train(sharded, f, [&](torch::optim::Optimizer& o, int s) {
        if (s == -1)
          sched = std::make_unique<torch::optim::StepLR>(o, 2, 0.5);
        else if (s > 0)
          sched->step();
      });
    };
    auto sharded = with_step_lr(true, factory), plain = with_step_lr(false, factory);
    EXPECT_TRUE(bit_identical(sharded, plain)) << kind << " with StepLR on rank " << rank();
    // By hand: the lr set on param_groups()[0] before steps 3 and 6.
    auto by_hand = [](torch::optim::Optimizer& o, int s) {
      if (s == 3) o.param_groups()[0].options().set_lr(o.param_groups()[0].options().get_lr() * 4);
      if (s == 6) o.param_groups()[0].options().set_lr(1e-3);
    };
    auto sharded_hand = train(true, factory, by_hand), plain_hand = train(false, factory, by_hand);
    EXPECT_TRUE(bit_identical(sharded_hand, plain_hand)) << kind << " with the lr set by hand on rank " << rank();
    // The check can fail: the same run without the changes ends elsewhere.
    auto unchanged = train(false, factory, [](torch::optim::Optimizer&, int) {});
    EXPECT_FALSE(bit_identical(unchanged, plain)) << kind;
    EXPECT_FALSE(bit_identical(unchanged, plain_hand)) << kind;
  }
}

DTRAIN_DIST_TEST_MAIN()
