// Activation checkpointing in one process: gradients bit-identical to the same model run as is,
// with and without dropout, through every way to checkpoint; the RNG and autocast states kept; the
// bad inputs refused in one line.
#include "dtrain/activation_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/optim/sgd.h>

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

// A declared member, registered: the way a module of one's own holds a checkpointed block (as it
// holds an FSDPModule<Block>). Its parameters are the block's, under `<member>.module.`.
struct AcTwoBlocksImpl : torch::nn::Module {
  AcTwoBlocksImpl(const torch::nn::Sequential& seq)
      : first(register_module("first", dtrain::checkpoint_wrapper(seq->ptr<ac_test::BlockImpl>(0)))),
        second(seq->ptr<ac_test::BlockImpl>(1)) {}
  at::Tensor forward(const at::Tensor& x) { return second->forward(first(x)); }
  dtrain::CheckpointWrapper first;
  std::shared_ptr<ac_test::BlockImpl> second;
};

TEST(ActivationCheckpoint, RegisteredMemberWrapperGradsEqualPlain) {
  for (double dropout : {0.0, 0.3}) {
    auto seq = make_mlp(2, 12, dropout);
    AcTwoBlocksImpl model(seq);
    EXPECT_EQ(model.named_parameters().keys().front(), "first.module.fc.weight");
    Result got = run(
        seq, [&](at::Tensor x) { return model.forward(x); }, true);
    auto ref_seq = make_mlp(2, 12, dropout);
    Result ref = run(
        ref_seq, [&](at::Tensor x) { return ref_seq->forward(x); }, true);
    expect_equal(got, ref);
  }
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

// The MLP in float32 (autocast's input type), each element wrapped in place when checkpointed.
torch::nn::Sequential ac_float_mlp(int64_t blocks, double dropout, bool checkpointed) {
  auto seq = make_mlp(blocks, 12, dropout);
  seq->to(at::kFloat);
  if (checkpointed)
    for (auto& element : *seq) dtrain::checkpoint_wrapper(element);
  return seq;
}

TEST(ActivationCheckpoint, KeepsAutocastOfForward) {
  auto grads = [](bool checkpointed) {
    auto seq = ac_float_mlp(4, 0.0, checkpointed);
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

namespace {

// A backward that asks for the input's gradient alone, keeping the graph (the zero-bubble pipeline's
// B), then one for the parameters' (its W): fn runs once in forward and once in the recompute, and
// the gradients are those of the same two calls without checkpointing.
TEST(ActivationCheckpointSplit, InputThenWeightGradsRecomputeOnce) {
  auto split = [](bool checkpointed, int* calls) {
    auto seq = make_mlp(4, 12, 0.3);
    at::Tensor x = batch(5).requires_grad_(true);
    torch::manual_seed(99);
    auto fn = [&](const std::vector<at::Tensor>& in) {
      ++*calls;
      return seq->forward(in[0]);
    };
    at::Tensor out =
        checkpointed ? dtrain::checkpoint(fn, {x}, dtrain::ActivationCheckpointOptions().parameters(seq->parameters()))
                     : fn({x});
    at::Tensor loss = out.pow(2).sum();
    auto input_grad = torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true)[0];
    EXPECT_TRUE(grads_of(*seq)[0].defined() == false) << "B accumulated a parameter's gradient";
    torch::autograd::backward({loss}, {}, /*retain_graph=*/false, /*create_graph=*/false, seq->parameters());
    return Result{grads_of(*seq), input_grad, at::rand({4}, at::kDouble)};
  };
  int checkpointed_calls = 0, plain_calls = 0;
  Result got = split(true, &checkpointed_calls), ref = split(false, &plain_calls);
  expect_equal(got, ref);
  EXPECT_EQ(plain_calls, 1);
  EXPECT_EQ(checkpointed_calls, 2) << "forward, then one recompute shared by B and W";
}

// Under CPU bfloat16 autocast the recompute replays the forward's kernels in the forward's precision:
// the checkpointed gradients equal the plain ones bit for bit, and both are as far from the float64
// gradients as bfloat16 makes them.
TEST(ActivationCheckpointAmp, AutocastGradsEqualPlainAndFloat64Reference) {
  auto grads = [](bool checkpointed, bool autocast) {
    auto seq = make_mlp(6, 12, 0.2);
    if (autocast) seq->to(at::kFloat);
    if (checkpointed)
      for (auto& element : *seq) dtrain::checkpoint_wrapper(element);
    at::Tensor x = batch(5).to(autocast ? at::kFloat : at::kDouble);
    torch::manual_seed(5);
    at::Tensor loss;
    if (autocast) {
      dtrain::Autocast scope(c10::DeviceType::CPU, at::kBFloat16);
      loss = seq->forward(x).to(at::kFloat).pow(2).mean();
    } else {
      loss = seq->forward(x).pow(2).mean();
    }
    loss.backward();
    return grads_of(*seq);
  };
  auto got = grads(true, true), plain = grads(false, true), ref = grads(false, false);
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_TRUE(at::equal(got[i], plain[i])) << "parameter " << i;
    const double scale = std::max(ref[i].abs().max().item<double>(), 1e-3);
    worst = std::max(worst, (got[i].to(at::kDouble) - ref[i]).abs().max().item<double>() / scale);
  }
  EXPECT_GT(worst, 0.0) << "autocast did not run in bfloat16";
  EXPECT_LT(worst, 0.1) << "bfloat16's 8 bits of mantissa, through 6 blocks";
}

// GradScaler's whole step (scale, backward, unscale_, found_inf, step, update), the first step
// overflowing (an inf in its input) and skipped: the scales, the skips, the
// parameters and the gradients equal those without checkpointing.
TEST(ActivationCheckpointAmp, GradScalerStepsEqualPlain) {
  auto train = [](bool checkpointed) {
    auto seq = ac_float_mlp(6, 0.2, checkpointed);
    torch::optim::SGD opt(seq->parameters(), torch::optim::SGDOptions(0.1));
    dtrain::GradScaler scaler(dtrain::GradScalerOptions().growth_interval(2));
    std::vector<double> trace;
    for (int step = 0; step < 4; ++step) {
      opt.zero_grad();
      torch::manual_seed(20 + step);
      at::Tensor loss;
      {
        dtrain::Autocast scope(c10::DeviceType::CPU, at::kBFloat16);
        at::Tensor x = batch(5, 12, 30 + step).to(at::kFloat);
        if (step == 0) x[0][0] = std::numeric_limits<float>::infinity();
        loss = seq->forward(x).to(at::kFloat).pow(2).mean();
      }
      scaler.scale(loss).backward();
      scaler.unscale_(opt);
      trace.push_back(scaler.step(opt) ? 1.0 : 0.0);
      scaler.update();
      trace.push_back(scaler.get_scale());
    }
    std::vector<at::Tensor> out = grads_of(*seq);
    for (auto& p : seq->parameters()) out.push_back(p.detach().clone());
    return std::make_pair(trace, out);
  };
  auto [got_trace, got] = train(true);
  auto [ref_trace, ref] = train(false);
  EXPECT_EQ(got_trace, ref_trace);
  EXPECT_EQ(ref_trace[0], 0.0) << "the first step should overflow and be skipped";
  EXPECT_EQ(ref_trace[1], 32768.0) << "backed off once";
  EXPECT_EQ(ref_trace[2], 1.0) << "the second step should step";
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(at::equal(got[i], ref[i])) << "item " << i;
}

TEST(ActivationCheckpointErrors, RefusesCheckpointingTwice) {
  auto seq = make_mlp(2, 12, 0.0);
  auto wrapper = dtrain::checkpoint_wrapper(seq->ptr<ac_test::BlockImpl>(0));
  EXPECT_THAT([&] { dtrain::checkpoint_wrapper(wrapper.ptr()); },
              ThrowsDtrainError(HasSubstr("checkpoint_wrapper: ac_test::BlockImpl is already checkpointed (it is "
                                          "inside a CheckpointWrapper): checkpoint each module once")));
  for (auto& element : *seq) dtrain::checkpoint_wrapper(element);
  EXPECT_THAT([&] { dtrain::checkpoint_wrapper(*seq->begin()); },
              ThrowsDtrainError(HasSubstr("checkpoint_wrapper: ac_test::BlockImpl is already checkpointed")));
}

TEST(ActivationCheckpointErrors, RefusesUnknownDeterminismCheck) {
  auto seq = make_mlp(1, 12, 0.0);
  auto o = dtrain::ActivationCheckpointOptions().determinism_check("shapes");
  EXPECT_THAT([&] { dtrain::checkpoint_wrapper(seq->ptr<ac_test::BlockImpl>(0), o); },
              ThrowsDtrainError(HasSubstr(
                  "checkpoint_wrapper: determinism_check is \"shapes\"; it must be \"default\" or \"none\"")));
  EXPECT_THAT([&] { dtrain::checkpoint([&](const std::vector<at::Tensor>& in) { return in[0]; }, {batch(2)}, o); },
              ThrowsDtrainError(HasSubstr("checkpoint: determinism_check is \"shapes\"")));
}

// fn whose recompute differs from its forward (it reads a counter): a narrower output in the
// recompute, or another dtype.
at::Tensor ac_changing_run(const std::string& mode, bool change_dtype) {
  auto seq = make_mlp(2, 12, 0.0);
  at::Tensor x = batch(3).requires_grad_(true);
  int calls = 0;
  at::Tensor out = dtrain::checkpoint(
      [&](const std::vector<at::Tensor>& in) {
        at::Tensor y = seq->forward(in[0]);
        if (++calls == 1) return y;
        return change_dtype ? y.to(at::kFloat) : y.narrow(1, 0, 7);
      },
      {x}, dtrain::ActivationCheckpointOptions().parameters(seq->parameters()).determinism_check(mode));
  out.sum().backward();
  return x.grad();
}

TEST(ActivationCheckpointErrors, RecomputeOfAnotherShapeNamesBoth) {
  EXPECT_THAT([&] { ac_changing_run("default", false); },
              ThrowsDtrainError(HasSubstr("checkpoint: the recomputed output has shape [3, 7], dtype Double, device "
                                          "cpu but the forward's had shape [3, 12], dtype Double, device cpu")));
  EXPECT_THAT([&] { ac_changing_run("default", true); },
              ThrowsDtrainError(HasSubstr("checkpoint: the recomputed output has shape [3, 12], dtype Float, device "
                                          "cpu but the forward's had shape [3, 12], dtype Double, device cpu")));
}

// "none": no check, as PyTorch's; a float32 recompute then gives float32-rounded gradients.
TEST(ActivationCheckpointErrors, DeterminismCheckNoneSkipsTheCheck) {
  at::Tensor got = ac_changing_run("none", true);
  ASSERT_TRUE(got.defined());
  auto seq = make_mlp(2, 12, 0.0);
  at::Tensor x = batch(3).requires_grad_(true);
  seq->forward(x).sum().backward();
  EXPECT_TRUE(at::allclose(got, x.grad(), 1e-5, 1e-6));
}

}  // namespace
