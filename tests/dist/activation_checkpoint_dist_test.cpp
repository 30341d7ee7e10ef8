// Activation checkpointing on real ranks: a 16-block float64 MLP with dropout, every block wrapped
// by checkpoint_wrapper, trained some steps under DDP (default, find_unused_parameters, static_graph)
// and under fully_shard (each block a unit, checkpointed inside it, wrapped in a new Sequential or in
// place); tensor-parallel MLP blocks whose
// recompute repeats their all-reduces; pipeline stages of checkpointed blocks under 1F1B and ZB-H1
// (whose split backward recomputes each block once): each equal bit for bit to the same run without
// checkpointing.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "ac_models.h"
#include "comm/state.h"  // the group's count of checked collectives (DTRAIN_DEBUG=DETAIL)
#include "dist_main.h"
#include "dtrain/activation_checkpoint.h"
#include "dtrain/ddp.h"
#include "dtrain/device_mesh.h"
#include "dtrain/fsdp.h"
#include "dtrain/pipeline.h"
#include "dtrain/tensor_parallel.h"
#include "pipeline_models.h"
#include "tp_models.h"

namespace {

using ac_test::batch;
using ac_test::make_mlp;

constexpr int kSteps = 3;

// Trains `seq` through `forward` for kSteps; returns the losses, then every parameter as `state`
// gives it (whole for fully_shard), then the last step's gradients.
std::vector<at::Tensor> train(const torch::nn::Sequential& seq, const std::function<at::Tensor(at::Tensor)>& forward,
                              const std::function<std::vector<at::Tensor>()>& state) {
  const int rank = dtrain::rank();
  torch::optim::SGD opt(seq->parameters(), torch::optim::SGDOptions(0.05));
  std::vector<at::Tensor> out;
  for (int step = 0; step < kSteps; ++step) {
    at::Tensor x = batch(4 + rank, 12, 100 + 10 * step + rank);
    torch::manual_seed(1000 + rank * 10 + step);  // dropout differs per rank and step, alike per variant
    opt.zero_grad();
    at::Tensor loss = forward(x).pow(2).mean();
    loss.backward();
    opt.step();
    out.push_back(loss.detach());
  }
  for (auto& t : state()) out.push_back(t);
  for (auto& p : seq->parameters()) out.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return out;
}

void expect_all_equal(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& ref) {
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_EQ(got[i].defined(), ref[i].defined()) << "item " << i;
    if (ref[i].defined()) {
      EXPECT_TRUE(at::equal(got[i], ref[i])) << "item " << i << " (losses, parameters, grads)";
    }
  }
}

std::vector<at::Tensor> params_of(const torch::nn::Sequential& seq) {
  std::vector<at::Tensor> out;
  for (auto& p : seq->parameters()) out.push_back(p.detach().clone());
  return out;
}

std::vector<at::Tensor> ddp_run(dtrain::DDPOptions options, bool checkpointed) {
  auto seq = make_mlp(16, 12, 0.3);
  if (checkpointed)
    for (auto& element : *seq) dtrain::checkpoint_wrapper(element);
  dtrain::DistributedDataParallel<torch::nn::SequentialImpl> ddp(seq, options);
  return train(
      seq, [&](at::Tensor x) { return ddp(x); }, [&] { return params_of(seq); });
}

TEST(ActivationCheckpointDist, DDPEqualsUncheckpointed) {
  for (int mode = 0; mode < 3; ++mode) {
    SCOPED_TRACE(mode == 0 ? "default" : mode == 1 ? "find_unused_parameters" : "static_graph");
    auto options = dtrain::DDPOptions().find_unused_parameters(mode == 1).static_graph(mode == 2);
    expect_all_equal(ddp_run(options, true), ddp_run(options, false));
  }
}

enum class AcFsdpMode { kPlain, kPushed, kInPlace };

// kPushed: the wrappers are the Sequential's elements (registered, parameters under `module.`), so
// the root finds the units below it; each wrapper a unit, so the recompute runs inside it.
// kInPlace: each element checkpointed in place, then made a unit in place: the unit is the block the
// Sequential holds (its names), and the checkpoint runs inside it. `names`: the full state dict's.
std::vector<at::Tensor> fsdp_run(AcFsdpMode mode, std::vector<std::string>* names = nullptr) {
  auto seq = make_mlp(16, 12, 0.3);
  if (mode == AcFsdpMode::kPushed) {
    torch::nn::Sequential wrapped;
    for (size_t i = 0; i < seq->size(); ++i)
      wrapped->push_back(dtrain::checkpoint_wrapper(seq->ptr<ac_test::BlockImpl>(i)));
    seq = wrapped;
  }
  if (mode == AcFsdpMode::kInPlace)
    for (auto& element : *seq) dtrain::checkpoint_wrapper(element);
  for (auto& element : *seq) dtrain::fully_shard(element);
  auto root = dtrain::fully_shard(seq);
  auto state = [&] {
    std::vector<at::Tensor> out;
    for (auto& kv : root.full_state_dict()) {
      out.push_back(kv.second);
      if (names) names->push_back(kv.first);
    }
    return out;
  };
  return train(
      seq, [&](at::Tensor x) { return root(x); }, state);
}

TEST(ActivationCheckpointDist, FullyShardEqualsUncheckpointed) {
  expect_all_equal(fsdp_run(AcFsdpMode::kPushed), fsdp_run(AcFsdpMode::kPlain));
}

// Elements checkpointed in place, then each made a unit in place (Note [Elements wrapped in place]):
// the same training bit for bit as without checkpointing, the Sequential's parameter names, and the
// output comes out of the checkpoint's node (the blocks are recomputed in backward).
TEST(ActivationCheckpointDist, FullyShardOfElementsCheckpointedInPlaceEqualsUncheckpointed) {
  std::vector<std::string> names, plain_names;
  expect_all_equal(fsdp_run(AcFsdpMode::kInPlace, &names), fsdp_run(AcFsdpMode::kPlain, &plain_names));
  EXPECT_EQ(names, plain_names);

  auto seq = make_mlp(2, 12, 0.0);
  for (auto& element : *seq) dtrain::checkpoint_wrapper(element);
  for (auto& element : *seq) dtrain::fully_shard(element);
  auto root = dtrain::fully_shard(seq);
  at::Tensor y = root(batch(4, 12, 5));
  ASSERT_TRUE(y.grad_fn());
  EXPECT_NE(y.grad_fn()->name().find("CheckpointNode"), std::string::npos) << y.grad_fn()->name();
  y.sum().backward();
  for (auto& p : seq->parameters()) EXPECT_TRUE(p.grad().defined());
}

// Three MLP blocks (w1 column-parallel, w2 row-parallel: one all-reduce forward, one backward each)
// sharded over the world, every block wrapped in place. The input is whole on every rank and needs
// its gradient too. Returns the losses, this rank's parameters, then the last step's gradients and
// input gradient; *backward_collectives: the collectives of the last step's backward, counted from
// DTRAIN_DEBUG=DETAIL's record, which also compares every call across the ranks.
std::vector<at::Tensor> tp_run(bool checkpointed, uint64_t* backward_collectives) {
  dtrain::Group g = dtrain::init_device_mesh({dtrain::world_size()}, {"tp"}).get_group();
  torch::manual_seed(3);
  torch::nn::Sequential seq;
  for (int i = 0; i < 3; ++i) seq->push_back(tp_models::MLP(12, 16));
  seq->to(at::kDouble);
  dtrain::parallelize_module(*seq, g, {{"*.w1", dtrain::ColwiseParallel()}, {"*.w2", dtrain::RowwiseParallel()}});
  if (checkpointed)
    for (auto& element : *seq) dtrain::checkpoint_wrapper(element);
  torch::optim::SGD opt(seq->parameters(), torch::optim::SGDOptions(0.05));
  const auto& impl = dtrain::comm::resolve(g);
  const dtrain::DebugLevel before = dtrain::get_debug_level();
  dtrain::set_debug_level(dtrain::DebugLevel::DETAIL);
  std::vector<at::Tensor> out;
  at::Tensor x;
  for (int step = 0; step < kSteps; ++step) {
    x = batch(4, 12, 200 + step).requires_grad_(true);  // the same on every rank
    opt.zero_grad();
    at::Tensor loss = seq->forward(x).pow(2).mean();
    const uint64_t start = impl.debug_seq.load();
    loss.backward();
    *backward_collectives = impl.debug_seq.load() - start;
    opt.step();
    out.push_back(loss.detach());
  }
  dtrain::set_debug_level(before);
  for (auto& t : params_of(seq)) out.push_back(t);
  for (auto& p : seq->parameters()) out.push_back(p.grad().clone());
  out.push_back(x.grad());
  return out;
}

TEST(ActivationCheckpointDist, TensorParallelRecomputeRepeatsCollectives) {
  uint64_t checkpointed = 0, plain = 0;
  expect_all_equal(tp_run(true, &checkpointed), tp_run(false, &plain));
  EXPECT_EQ(plain, 3u) << "one all-reduce per block (the column-parallel input's gradient)";
  EXPECT_EQ(checkpointed, 6u) << "each block's recomputed forward all-reduce, then its backward one";
}

// A pipeline block that counts its forwards: tanh(fc(x)) through dropout.
struct AcPipeBlockImpl : torch::nn::Module {
  AcPipeBlockImpl(int64_t in, int64_t out)
      : fc(register_module("fc", torch::nn::Linear(in, out))), drop(register_module("drop", torch::nn::Dropout(0.1))) {}
  at::Tensor forward(at::Tensor x) {
    ++calls;
    return drop(torch::tanh(fc(x)));
  }
  torch::nn::Linear fc;
  torch::nn::Dropout drop;
  int64_t calls = 0;
};
TORCH_MODULE(AcPipeBlock);

constexpr int64_t kPipeChunks = 4;

// Four blocks, two per rank, each wrapped in place; kSteps steps of `schedule`. Returns the losses,
// this rank's parameters and the last step's gradients; *calls: the forwards of this rank's blocks.
std::vector<at::Tensor> pipeline_run(dtrain::Schedule schedule, bool checkpointed, int64_t* calls) {
  using namespace dtrain::test_pipeline;
  torch::manual_seed(7);
  torch::nn::Sequential model;
  std::vector<AcPipeBlock> blocks = {AcPipeBlock(kIn, kHidden), AcPipeBlock(kHidden, kHidden),
                                     AcPipeBlock(kHidden, kHidden), AcPipeBlock(kHidden, kOut)};
  for (auto& b : blocks) model->push_back(b);
  model->to(at::kDouble);
  if (checkpointed)
    for (auto& element : *model) dtrain::checkpoint_wrapper(element);
  auto options = dtrain::PipelineOptions().chunks(kPipeChunks).schedule(schedule).balance({2, 2});
  if (schedule == dtrain::Schedule::kInterleaved1F1B)  // two stages of one block on each rank
    options.virtual_stages(2).balance({1, 1, 1, 1});
  dtrain::Pipeline pipe(model, options);
  torch::optim::SGD opt(pipe.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<at::Tensor> out;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = dtrain::test_pipeline::batch(step);
    torch::manual_seed(300 + 10 * step + dtrain::rank());  // dropout: alike per variant
    opt.zero_grad();
    auto r = pipe.step(pipe.is_first() ? x : at::Tensor(), pipe.is_last() ? y : at::Tensor(), loss_fn);
    opt.step();
    out.push_back(at::scalar_tensor(r.loss, at::kDouble));
  }
  for (auto& p : pipe.parameters()) out.push_back(p.detach().clone());
  for (auto& p : pipe.parameters()) out.push_back(p.grad().clone());
  *calls = 0;
  for (auto& b : blocks) *calls += b->calls;
  return out;
}

// Every schedule. ZB-H1's B asks the checkpoint for the input's gradient only and its W for the
// weights': the recompute runs once, in B, and W takes the weights' gradients from it.
TEST(ActivationCheckpointDist, PipelineEqualsUncheckpointedAndRecomputesOnce) {
  for (auto schedule : {dtrain::Schedule::kGPipe, dtrain::Schedule::k1F1B, dtrain::Schedule::kInterleaved1F1B,
                        dtrain::Schedule::kZeroBubbleH1}) {
    SCOPED_TRACE(dtrain::to_string(schedule));
    int64_t checkpointed = 0, plain = 0;
    expect_all_equal(pipeline_run(schedule, true, &checkpointed), pipeline_run(schedule, false, &plain));
    const int64_t forwards = 2 * kPipeChunks * kSteps;  // two blocks per stage
    EXPECT_EQ(plain, forwards);
    EXPECT_EQ(checkpointed, 2 * forwards) << "one recompute per block and micro-batch";
  }
}

}  // namespace

DTRAIN_DIST_TEST_MAIN()
