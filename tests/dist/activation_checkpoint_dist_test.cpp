// Activation checkpointing on real ranks: a 16-block float64 MLP with dropout, every block wrapped
// by checkpoint_wrapper, trained some steps under DDP (default, find_unused_parameters, static_graph)
// and under fully_shard (each block a unit, checkpointed inside it), equal bit for bit to the same
// run without checkpointing.
#include <functional>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include "ac_models.h"
#include "dist_main.h"
#include "dtrain/activation_checkpoint.h"
#include "dtrain/ddp.h"
#include "dtrain/fsdp.h"

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

// The wrappers are the Sequential's elements (registered, parameters under `module.`), so the
// root finds the units below it; each wrapper a unit, so the recompute runs inside it.
std::vector<at::Tensor> fsdp_run(bool checkpointed) {
  auto seq = make_mlp(16, 12, 0.3);
  if (checkpointed) {
    torch::nn::Sequential wrapped;
    for (size_t i = 0; i < seq->size(); ++i)
      wrapped->push_back(dtrain::checkpoint_wrapper(seq->ptr<ac_test::BlockImpl>(i)));
    seq = wrapped;
  }
  for (auto& element : *seq) dtrain::fully_shard(element);
  auto root = dtrain::fully_shard(seq);
  auto state = [&] {
    std::vector<at::Tensor> out;
    for (auto& kv : root.full_state_dict()) out.push_back(kv.second);
    return out;
  };
  return train(
      seq, [&](at::Tensor x) { return root(x); }, state);
}

TEST(ActivationCheckpointDist, FullyShardEqualsUncheckpointed) { expect_all_equal(fsdp_run(true), fsdp_run(false)); }

}  // namespace

DTRAIN_DIST_TEST_MAIN()
