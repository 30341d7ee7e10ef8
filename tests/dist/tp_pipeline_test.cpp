// Pipeline stages whose layers are tensor-parallel, on 4 ranks as a {pp, tp} = {2, 2} mesh: each
// stage's MLP blocks column-then-row parallel over its tp group, the stages linked by the pipeline
// over the "pp" group (matching tp ranks of adjacent stages: global ranks {0, 2} and {1, 3}). Every
// schedule against one process training the whole model on the whole batch, in float64: the loss,
// the last stage's output and every parameter gradient (this rank's part) at the first step, the
// parameters after 3 Adam steps, within 1e-10 relative. Also a model that ends in a class head whose
// logits stay sharded over tp on the last stage, with parallel_cross_entropy as the pipeline's loss.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include <vector>

#include "dist_main.h"
#include "matchers.h"
#include "dtrain/device_mesh.h"
#include "dtrain/pipeline.h"
#include "dtrain/tensor_parallel.h"
#include "tp_compare.h"
#include "tp_models.h"

using namespace dtrain;
using tp_compare::part_of;
using tp_compare::rel_diff;

namespace {

using tp_compare::kTol;
constexpr int64_t kDim = 8, kHidden = 16, kBatch = 8, kChunks = 4, kClasses = 6;
constexpr int kSteps = 3;

// One MLP block per global stage, the same weights on every rank (and for the reference); with
// `head`, the last stage ends in a class head (Linear to kClasses, Colwise: logits sharded by class).
std::vector<torch::nn::Sequential> make_stages(int count, bool head) {
  torch::manual_seed(7);
  std::vector<torch::nn::Sequential> stages;
  for (int k = 0; k < count; ++k) {
    torch::nn::Sequential s(tp_models::MLP(kDim, kHidden));
    if (head && k == count - 1) s->push_back(ParallelLinear(kDim, kClasses));
    s->to(at::kDouble);
    stages.push_back(s);
  }
  return stages;
}

at::Tensor mse(const at::Tensor& out, const at::Tensor& target) { return (out - target).pow(2).mean(); }

// The plan of global stage k of `total`: its block column-then-row, and the head column-parallel.
ParallelizePlan plan_of(int k, int total, bool head) {
  ParallelizePlan plan = tp_models::mlp_plan("0.");
  if (head && k == total - 1) plan.push_back({"1", ColwiseParallel()});
  return plan;
}

// This rank's stages' parameters (or gradients) against their parts of the reference's stages.
void expect_stages_match(const Pipeline& pipe, const std::vector<torch::nn::Sequential>& ref, const Group& tp,
                         bool grads, const std::string& when) {
  for (int c = 0; c < pipe.virtual_stages(); ++c) {
    auto whole = ref[c * pipe.num_stages() + pipe.stage()]->named_parameters();
    for (const auto& p : pipe.stage_modules()[c]->named_parameters()) {
      const at::Tensor mine = grads ? p.value().grad() : p.value();
      const at::Tensor theirs = grads ? whole[p.key()].grad() : whole[p.key()];
      ASSERT_TRUE(mine.defined() && theirs.defined()) << p.key() << " " << when;
      EXPECT_LT(rel_diff(mine, part_of(theirs, mine, tp)), kTol)
          << "stage chunk " << c << " " << p.key() << (grads ? " grad " : " ") << when;
    }
  }
}

// head: the model ends in a class head whose logits stay sharded on the last stage, and the loss is
// parallel_cross_entropy over the tp group (Megatron's vocab-parallel output layer); else the MLP
// blocks' output and a mean squared error.
void expect_equals_one_process(Schedule schedule, bool head = false) {
  ASSERT_EQ(world_size(), 4) << "registered on 4 ranks";
  const int v = schedule == Schedule::kInterleaved1F1B ? 2 : 1, total = 2 * v;
  std::vector<torch::nn::Sequential> stages = make_stages(total, head), ref = make_stages(total, head);
  // doc:begin tp_pipeline
  auto mesh = dtrain::init_device_mesh({2, 2}, {"pp", "tp"});  // ranks {0, 1}: stage 0, {2, 3}: stage 1
  const int64_t pp = mesh.get_local_rank("pp");
  for (int c = 0; c < v; ++c)  // this rank's stages only (one, or v interleaved): sharded over its tp group
    dtrain::parallelize_module(*stages[c * 2 + pp], mesh["tp"], plan_of(c * 2 + pp, total, head));
  auto options = dtrain::PipelineOptions().chunks(kChunks).schedule(schedule).virtual_stages(v);
  dtrain::Pipeline pipe(stages, options.mesh(mesh["pp"]));  // {0, 2} or {1, 3}
  // doc:end tp_pipeline
  const int64_t tp_rank = mesh.get_local_rank("tp");
  // The boundaries join the same tp rank of each stage: the activations after a Rowwise layer are
  // whole on every tp rank, so each sends its own copy, as each receives the gradient it needs.
  EXPECT_EQ(pipe.pipeline_group().ranks(),
            (std::vector<int>{static_cast<int>(tp_rank), static_cast<int>(2 + tp_rank)}));
  EXPECT_EQ(pipe.stage(), pp);

  torch::optim::Adam opt(pipe.parameters(), torch::optim::AdamOptions(1e-2));
  std::vector<at::Tensor> ref_params;
  for (const auto& s : ref)
    for (const auto& p : s->parameters()) ref_params.push_back(p);
  torch::optim::Adam ref_opt(ref_params, torch::optim::AdamOptions(1e-2));
  const Group tp = mesh.get_group("tp");
  auto loss_fn = [&](const at::Tensor& out, const at::Tensor& y) {
    return head ? parallel_cross_entropy(out, y, tp) : mse(out, y);
  };
  torch::manual_seed(11);
  for (int step = 0; step < kSteps; ++step) {
    at::Tensor x = at::randn({kBatch, kDim}, at::kDouble);
    at::Tensor y = head ? at::randint(kClasses, {kBatch}, at::kLong) : at::randn({kBatch, kDim}, at::kDouble);
    opt.zero_grad();
    ref_opt.zero_grad();
    auto r = pipe.step(pipe.is_first() ? x : at::Tensor(), pipe.is_last() ? y : at::Tensor(), loss_fn);
    at::Tensor out = x;
    for (auto& s : ref) out = s->forward(out);
    at::Tensor loss = head ? torch::nn::functional::cross_entropy(out, y) : mse(out, y);
    loss.backward();
    if (step == 0) {
      EXPECT_LT(std::abs(r.loss - loss.item<double>()), kTol * loss.item<double>()) << "loss";
      if (pipe.is_last()) {
        EXPECT_LT(rel_diff(r.output, part_of(out, r.output, tp)), kTol) << "output (this rank's classes)";
      }
      expect_stages_match(pipe, ref, tp, /*grads=*/true, "at step 0");
    }
    opt.step();
    ref_opt.step();
  }
  expect_stages_match(pipe, ref, tp, /*grads=*/false, "after 3 Adam steps");
}

}  // namespace

// A pipeline runs over a 1-D mesh: the whole mesh, or a mesh with replicas(R) (which lays out the world
// itself), is refused in one line naming the remedy, on every rank.
TEST(TensorParallelPipeline, AMeshMustBeThePipelineDimension) {
  auto mesh = dtrain::init_device_mesh({2, 2}, {"pp", "tp"});
  auto model = [] { return torch::nn::Sequential(torch::nn::Linear(2, 2), torch::nn::Linear(2, 2)); };
  EXPECT_THAT([&] { dtrain::Pipeline(model(), dtrain::PipelineOptions().mesh(mesh)); },
              ThrowsDtrainError(::testing::HasSubstr("mesh has 2 dimensions; a pipeline runs over a 1-D mesh")));
  EXPECT_THAT([&] { dtrain::Pipeline(model(), dtrain::PipelineOptions().mesh(mesh["pp"]).replicas(2)); },
              ThrowsDtrainError(::testing::HasSubstr("mesh and replicas(2) are both set")));
}

TEST(TensorParallelPipeline, GPipeEqualsOneProcess) { expect_equals_one_process(Schedule::kGPipe); }
TEST(TensorParallelPipeline, OneFOneBEqualsOneProcess) { expect_equals_one_process(Schedule::k1F1B); }
TEST(TensorParallelPipeline, InterleavedEqualsOneProcess) { expect_equals_one_process(Schedule::kInterleaved1F1B); }
TEST(TensorParallelPipeline, ZeroBubbleEqualsOneProcess) { expect_equals_one_process(Schedule::kZeroBubbleH1); }
TEST(TensorParallelPipeline, ShardedLogitsAndParallelCrossEntropyEqualOneProcess) {
  expect_equals_one_process(Schedule::k1F1B, /*head=*/true);
}

DTRAIN_DIST_TEST_MAIN()
