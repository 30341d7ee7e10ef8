// Activation checkpointing in one process: gradients bit-identical to the same model run as is,
// with and without dropout, through every way to checkpoint; the RNG and autocast states kept; the
// bad inputs refused in one line.
#include "dtrain/activation_checkpoint.h"

#include <functional>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include "ac_models.h"
#include "dtrain/amp.h"
#include "matchers.h"

namespace {

using ac_test::batch;
using ac_test::grads_of;
using ac_test::make_mlp;

// Gradients of every parameter (and of the input) after one forward and backward of `forward`.
struct Result {
  std::vector<at::Tensor> grads;
  at::Tensor input_grad;
  at::Tensor after;  // the next random numbers: the RNG state backward left
};
Result run(const torch::nn::Sequential& seq, const std::function<at::Tensor(at::Tensor)>& forward,
           bool input_requires_grad = false) {
  at::Tensor x = batch(5).requires_grad_(input_requires_grad);
  torch::manual_seed(99);
  forward(x).pow(2).sum().backward();
  return {grads_of(*seq), input_requires_grad ? x.grad() : at::Tensor(), at::rand({4}, at::kDouble)};
}

void expect_equal(const Result& a, const Result& b) {
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    ASSERT_TRUE(a.grads[i].defined() && b.grads[i].defined()) << "parameter " << i;
    EXPECT_TRUE(at::equal(a.grads[i], b.grads[i])) << "parameter " << i;
  }
  EXPECT_EQ(a.input_grad.defined(), b.input_grad.defined());
  if (a.input_grad.defined()) {
    EXPECT_TRUE(at::equal(a.input_grad, b.input_grad));
  }
  EXPECT_TRUE(at::equal(a.after, b.after)) << "the RNG after backward differs";
}

Result plain(double dropout, bool input_requires_grad = false) {
  auto seq = make_mlp(16, 12, dropout);
  return run(
      seq, [&](at::Tensor x) { return seq->forward(x); }, input_requires_grad);
}

Result wrapped(double dropout, bool input_requires_grad = false) {
  auto seq = make_mlp(16, 12, dropout);
  for (auto& element : *seq) dtrain::checkpoint_wrapper(element);
  return run(
      seq, [&](at::Tensor x) { return seq->forward(x); }, input_requires_grad);
}

TEST(ActivationCheckpoint, WrapperGradsEqualPlain) { expect_equal(wrapped(0.0), plain(0.0)); }

TEST(ActivationCheckpoint, WrapperGradsEqualPlainWithDropout) {
  expect_equal(wrapped(0.3), plain(0.3));
  expect_equal(wrapped(0.3, true), plain(0.3, true));
}

// Without the RNG restored, the recompute drops other elements than the forward did: the test above
// would fail (which shows it tests the restore).
TEST(ActivationCheckpoint, NoRngRestoreChangesDropoutGrads) {
  auto seq = make_mlp(16, 12, 0.3);
  for (auto& element : *seq)
    dtrain::checkpoint_wrapper(element, dtrain::ActivationCheckpointOptions().preserve_rng_state(false));
  Result off = run(seq, [&](at::Tensor x) { return seq->forward(x); });
  Result ref = plain(0.3);
  bool all_equal = true;
  for (size_t i = 0; i < ref.grads.size(); ++i) all_equal = all_equal && at::equal(off.grads[i], ref.grads[i]);
  EXPECT_FALSE(all_equal);
}

TEST(ActivationCheckpoint, SharedPtrWrapperNamesParametersUnderModule) {
  auto seq = make_mlp(1, 12, 0.3);
  auto block = seq->ptr<ac_test::BlockImpl>(0);
  auto wrapper = dtrain::checkpoint_wrapper(block);
  EXPECT_EQ(wrapper->named_parameters().keys(), (std::vector<std::string>{"module.fc.weight", "module.fc.bias"}));
  Result got = run(
      seq, [&](at::Tensor x) { return wrapper(x); }, true);
  auto ref_seq = make_mlp(1, 12, 0.3);
  Result ref = run(
      ref_seq, [&](at::Tensor x) { return ref_seq->ptr<ac_test::BlockImpl>(0)->forward(x); }, true);
  expect_equal(got, ref);
}

// checkpoint() on a function that captures the blocks: named parameters, or none (the nested backward).
void checkpoint_function(double dropout, bool name_parameters, bool input_requires_grad) {
  auto seq = make_mlp(16, 12, dropout);
  Result got = run(
      seq,
      [&](at::Tensor x) {
        for (size_t i = 0; i < seq->size(); i += 4) {
          dtrain::ActivationCheckpointOptions o;
          std::vector<at::Tensor> params;
          for (size_t j = i; j < i + 4; ++j)
            for (auto& p : seq->ptr(j)->parameters()) params.push_back(p);
          if (name_parameters) o.parameters(params);
          x = dtrain::checkpoint(
              [&, i](const std::vector<at::Tensor>& in) {
                at::Tensor t = in[0];
                for (size_t j = i; j < i + 4; ++j) t = seq->ptr<ac_test::BlockImpl>(j)->forward(t);
                return t;
              },
              {x}, o);
        }
        return x;
      },
      input_requires_grad);
  expect_equal(got, plain(dropout, input_requires_grad));
}

TEST(ActivationCheckpoint, FunctionNamedParametersGradsEqualPlain) {
  checkpoint_function(0.3, true, false);
  checkpoint_function(0.3, true, true);
}

TEST(ActivationCheckpoint, FunctionCapturedParametersGradsEqualPlain) { checkpoint_function(0.3, false, true); }

TEST(ActivationCheckpoint, SequentialGradsEqualPlain) {
  for (int64_t segments : {1, 2, 5, 16}) {
    auto seq = make_mlp(16, 12, 0.3);
    Result got = run(
        seq, [&](at::Tensor x) { return dtrain::checkpoint_sequential(seq, segments, x); }, true);
    SCOPED_TRACE(segments);
    expect_equal(got, plain(0.3, true));
  }
}

TEST(ActivationCheckpoint, KeepsAutocastOfForward) {
  auto grads = [](bool checkpointed) {
    auto seq = make_mlp(4, 12, 0.0);
    seq->to(at::kFloat);
    if (checkpointed)
      for (auto& element : *seq) dtrain::checkpoint_wrapper(element);
    at::Tensor loss;
    {
      dtrain::Autocast autocast(c10::DeviceType::CPU, at::kBFloat16);
      loss = seq->forward(batch(5).to(at::kFloat)).to(at::kFloat).pow(2).sum();
    }
    loss.backward();  // outside autocast: the recompute must bring the forward's back
    return grads_of(*seq);
  };
  auto got = grads(true), ref = grads(false);
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(at::equal(got[i], ref[i])) << "parameter " << i;
}

TEST(ActivationCheckpoint, NoGradRunsAsIs) {
  auto seq = make_mlp(2, 12, 0.0);
  torch::NoGradGuard no_grad;
  at::Tensor out = dtrain::checkpoint([&](const std::vector<at::Tensor>& in) { return seq->forward(in[0]); },
                                      {batch(3)}, dtrain::ActivationCheckpointOptions().parameters(seq->parameters()));
  EXPECT_FALSE(out.requires_grad());
  EXPECT_TRUE(at::equal(out, seq->forward(batch(3))));
}

TEST(ActivationCheckpoint, RefusesSegmentsOutOfRange) {
  auto seq = make_mlp(16, 12, 0.0);
  EXPECT_THAT([&] { dtrain::checkpoint_sequential(seq, 0, batch(2)); },
              ThrowsDtrainError(HasSubstr("segments is 0; it must be between 1 and the Sequential's size (16)")));
  EXPECT_THAT([&] { dtrain::checkpoint_sequential(seq, 17, batch(2)); },
              ThrowsDtrainError(HasSubstr("segments is 17; it must be between 1 and the Sequential's size (16)")));
}

TEST(ActivationCheckpoint, RefusesOutputThatDoesNotRequireGrad) {
  auto seq = make_mlp(2, 12, 0.0);
  at::Tensor x = batch(3).requires_grad_(true);
  at::Tensor out = dtrain::checkpoint([&](const std::vector<at::Tensor>& in) { return seq->forward(in[0]).detach(); },
                                      {x}, dtrain::ActivationCheckpointOptions().parameters(seq->parameters()));
  EXPECT_THAT([&] { out.sum().backward(); },
              ThrowsDtrainError(HasSubstr("fn's output does not require grad though its inputs or parameters do")));
}

}  // namespace
