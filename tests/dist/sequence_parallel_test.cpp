// Sequence parallelism on real ranks, in float64 against one process computing the whole block
// (sp_models.h: LayerNorm -> column-parallel -> relu -> row-parallel -> the Llama RMSNorm):
//   - on each rank's positions (inputs and outputs Shard(1)), the outputs, input gradients and
//     every parameter gradient (the norms' summed over the ranks) equal this rank's part of the one
//     process's within 1e-10 relative, and the parameters after 10 Adam steps;
//   - the norms' parameters stay whole (no ShardSpec), so clip_grad_norm_ counts them once;
//   - whole inputs and outputs around the block (PrepareModuleInput Replicate() -> Shard(1),
//     PrepareModuleOutput Shard(1) -> Replicate()) give the one process's loss and input gradient;
//   - with DDP over "dp" on a dp x tp mesh, and inside fully_shard over "dp", equal one process;
//   - redistribute between two shardings, and bad plans and calls, each one line.
#include <gmock/gmock.h>

#include <ATen/ATen.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>

#include <functional>
#include <limits>
#include <memory>

#include "dist_main.h"
#include "dtrain/ddp.h"
#include "dtrain/device_mesh.h"
#include "dtrain/fsdp.h"
#include "dtrain/tensor_parallel.h"
#include "matchers.h"
#include "sp_models.h"
#include "tp_compare.h"

using namespace dtrain;
using ::testing::HasSubstr;

namespace {

using tp_compare::kTol;
using tp_compare::part_of;
using tp_compare::rel_diff;

Group sp_group() { return init_device_mesh({world_size()}, {"tp"}).get_group(); }

// A reference block with every parameter random (the norms' too: the ones init would hide a
// wrong sum), and a copy of it parallelized with `plan`.
std::pair<sp_models::SPNet, sp_models::SPNet> sp_pair(int seed, const ParallelizePlan& plan, const Group& g) {
  torch::manual_seed(seed);
  sp_models::SPNet ref, tp;
  ref->to(at::kDouble);
  tp->to(at::kDouble);
  {
    at::NoGradGuard no_grad;
    for (auto& p : ref->parameters()) p.copy_(at::randn_like(p));
  }
  tp_compare::copy_params(*tp, *ref);
  parallelize_module(*tp, g, plan);
  return {ref, tp};
}

}  // namespace

TEST(SequenceParallel, BlockOnSequencePartsEqualsOneProcess) {
  Group g = sp_group();
  const int64_t n = g.size(), r = g.rank(), seq = 3 * n;
  const auto models = sp_pair(21, sp_models::sp_plan(/*whole=*/false), g);
  sp_models::SPNet ref = models.first, tp = models.second;  // named: lambdas capture them
  EXPECT_FALSE(shard_spec_of(tp->block->norm1->weight).has_value()) << "whole on every rank";
  EXPECT_FALSE(shard_spec_of(tp->block->norm2->weight).has_value()) << "whole on every rank";
  torch::optim::Adam opt(tp->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < 10; ++step) {
    opt.zero_grad();
    ref_opt.zero_grad();
    at::Tensor x = at::randn({2, seq, sp_models::kDim}, at::kDouble), t = at::randn_like(x);
    at::Tensor x_ref = x.clone().requires_grad_(true), x_tp = x.chunk(n, 1)[r].clone().requires_grad_(true);
    at::Tensor ref_out = ref(x_ref), out = tp(x_tp);
    (ref_out - t).pow(2).sum().backward();
    (out - t.chunk(n, 1)[r]).pow(2).sum().backward();  // this rank's positions: the sum is the whole loss
    if (step == 0) {
      EXPECT_LT(rel_diff(out, ref_out.chunk(n, 1)[r]), kTol) << "output";
      EXPECT_LT(rel_diff(x_tp.grad(), x_ref.grad().chunk(n, 1)[r]), kTol) << "input grad";
      tp_compare::expect_params_match(*tp, *ref, g, /*grads=*/true, "at step 0");
      const double inf = std::numeric_limits<double>::infinity();
      const double total = clip_grad_norm_(tp->parameters(), inf);
      const double ref_total = torch::nn::utils::clip_grad_norm_(ref->parameters(), inf);
      EXPECT_NEAR(total, ref_total, kTol * ref_total) << "the norms' gradients counted once";
    }
    opt.step();
    ref_opt.step();
  }
  tp_compare::expect_params_match(*tp, *ref, g, /*grads=*/false, "after 10 Adam steps");
}

TEST(SequenceParallel, WholeAroundTheBlockEqualsOneProcess) {
  Group g = sp_group();
  const auto models = sp_pair(22, sp_models::sp_plan(/*whole=*/true), g);
  sp_models::SPNet ref = models.first, tp = models.second;  // named: lambdas capture them
  at::Tensor x = at::randn({2, 3 * g.size(), sp_models::kDim}, at::kDouble), target = at::randn_like(x);
  at::Tensor x_tp = x.clone().requires_grad_(true), x_ref = x.clone().requires_grad_(true);
  tp_compare::expect_equivalent(
      *tp, *ref, g,
      [&](torch::nn::Module&, bool is_tp) {
        at::Tensor out = is_tp ? tp(x_tp) : ref(x_ref);
        return std::make_pair(out, (out - target).pow(2).mean());
      },
      [&](bool is_tp) { return (is_tp ? x_tp : x_ref).grad(); });
}

// dp x tp: the block sequence-parallel over "tp" (whole around it), DDP averaging over "dp" (the
// norms' gradients summed over tp by their hooks before DDP's buckets read them), or inside
// fully_shard over "dp"; each dp row on its part of the batch, against one process on all of it.
void expect_sp_with_data_parallel_equals_one_process(bool fsdp) {
  DeviceMesh mesh = init_device_mesh({world_size() / 2, 2}, {"dp", "tp"});
  Group dp = mesh.get_group("dp");
  const auto models = sp_pair(24, sp_models::sp_plan(/*whole=*/true), mesh.get_group("tp"));
  sp_models::SPNet ref = models.first, model = models.second;  // named: lambdas capture them
  std::function<at::Tensor(const at::Tensor&)> run;
  std::shared_ptr<DistributedDataParallel<sp_models::SPNetImpl>> ddp;
  std::shared_ptr<FSDPModule<sp_models::SPNetImpl>> sharded;
  if (fsdp) {
    sharded =
        std::make_shared<FSDPModule<sp_models::SPNetImpl>>(fully_shard(model, FullyShardOptions().process_group(dp)));
    run = [&](const at::Tensor& x) { return (*sharded)(x); };
  } else {
    ddp = std::make_shared<DistributedDataParallel<sp_models::SPNetImpl>>(model, DDPOptions().process_group(dp));
    run = [&](const at::Tensor& x) { return (*ddp)(x); };
  }
  at::Tensor x = at::randn({2 * dp.size(), 6, sp_models::kDim}, at::kDouble), target = at::randn_like(x);
  at::Tensor my_x = x.chunk(dp.size())[dp.rank()], my_target = target.chunk(dp.size())[dp.rank()];
  tp_compare::adam_steps(*model, *ref, [&] {
    return std::make_pair((run(my_x) - my_target).pow(2).mean(), (ref(x) - target).pow(2).mean());
  });
  auto whole = ref->named_parameters();
  for (const auto& [name, t] : full_state_dict(*model))  // the dp rows and the TP parts put together
    EXPECT_LT(rel_diff(t, whole[name]), kTol) << name << " after 10 Adam steps";
}

TEST(SequenceParallel, TwoDimensionalWithDDPEqualsOneProcess) {
  expect_sp_with_data_parallel_equals_one_process(false);
}

TEST(SequenceParallel, InsideFullyShardEqualsOneProcess) { expect_sp_with_data_parallel_equals_one_process(true); }

// Shard(1) -> Shard(2): this rank's part along 2 of the whole; the gradient of the loss
// sum(w * out) over ranks is w put back in place (part of dim 1, whole along 2).
TEST(SequenceParallel, RedistributeBetweenShardings) {
  Group g = sp_group();
  const int64_t n = g.size(), r = g.rank();
  torch::manual_seed(23);
  at::Tensor whole = at::randn({2, 2 * n, 3 * n}, at::kDouble), w = at::randn({2, 2 * n, 3 * n}, at::kDouble);
  at::Tensor x = whole.chunk(n, 1)[r].clone().requires_grad_(true);
  at::Tensor out = redistribute(x, Shard(1), Shard(2), g);
  EXPECT_LT(rel_diff(out, whole.chunk(n, 2)[r]), kTol);
  (out * w.chunk(n, 2)[r]).sum().backward();
  EXPECT_LT(rel_diff(x.grad(), w.chunk(n, 1)[r]), kTol);
  EXPECT_TRUE(redistribute(x, Shard(-2), Shard(1), g).is_same(x)) << "the same layout";
}

TEST(SequenceParallel, BadPlansAndCallsAreOneLine) {
  Group g = sp_group();
  sp_models::SPNet net;
  parallelize_module(*net, g, {{"block.norm1", SequenceParallel()}});
  EXPECT_THAT(
      [&] {
        parallelize_module(*net, g, {{"block.norm1", SequenceParallel()}});
      },
      ThrowsDtrainError(HasSubstr("'block.norm1.weight' has SequenceParallel already")));
  EXPECT_THAT(
      [&] {
        parallelize_module(*net, g,
                           {{"block", PrepareModuleInput().input_layouts({Shard(1)}).desired_input_layouts({})}});
      },
      ThrowsDtrainError(HasSubstr("PrepareModuleInput has 1 layouts and 0 desired layouts")));
  parallelize_module(*net, g,
                     {{"block", PrepareModuleInput().input_layouts({Replicate()}).desired_input_layouts({Shard(1)})}});
  at::Tensor x = at::randn({2, 3 * g.size() + 1, sp_models::kDim});
  EXPECT_THAT(
      [&] {
        prepare_input(*net->block, {x, x});
      },
      ThrowsDtrainError(HasSubstr("module 'block' was given 2 tensors but its layouts name 1")));
  EXPECT_THAT([&] { net(x); }, ThrowsDtrainError(HasSubstr("is not divisible by the group size")));
  EXPECT_TRUE(prepare_output(*net->block, x).is_same(x)) << "no PrepareModuleOutput: unchanged";
}

DTRAIN_DIST_TEST_MAIN()
