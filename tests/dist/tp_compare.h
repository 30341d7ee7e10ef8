// Comparisons of a tensor-parallel model with the one process computing the whole model (the tests
// of tests/dist/ on tensor parallelism): a relative difference, this rank's part of a whole tensor,
// and a model pair compared over 10 Adam steps, within kTol relative in float64.
#pragma once

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <torch/nn/module.h>
#include <torch/optim/adam.h>

#include <algorithm>
#include <functional>
#include <string>
#include <utility>

#include "dtrain/process_group.h"

namespace tp_compare {

// Relative to b's largest magnitude, at least 1e-6: a gradient that is zero but for rounding (the
// keys' bias under softmax) is compared absolutely.
inline double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-6);
  return (a - b).abs().max().item<double>() / scale;
}

// This rank's part of `whole`, shaped like `local`: the whole where the shapes agree, else the
// group-rank chunk along the one dimension that differs (torch.chunk's cut).
inline at::Tensor part_of(const at::Tensor& whole, const at::Tensor& local, const dtrain::Group& g) {
  if (whole.sizes() == local.sizes()) return whole;
  for (int64_t d = 0; d < whole.dim(); ++d)
    if (whole.size(d) != local.size(d)) return whole.chunk(g.size(), d)[g.rank()];
  ADD_FAILURE() << "shapes " << whole.sizes() << " and " << local.sizes();
  return whole;
}

constexpr double kTol = 1e-10;

inline void copy_params(torch::nn::Module& dst, torch::nn::Module& src) {
  at::NoGradGuard no_grad;
  auto from = src.named_parameters();
  for (auto& p : dst.named_parameters()) p.value().copy_(from[p.key()]);
}

// Every parameter (or its gradient) of the TP model against its part of the reference's.
inline void expect_params_match(torch::nn::Module& tp, torch::nn::Module& ref, const dtrain::Group& g, bool grads,
                                const std::string& when) {
  auto whole = ref.named_parameters();
  for (const auto& p : tp.named_parameters()) {
    const at::Tensor mine = grads ? p.value().grad() : p.value();
    const at::Tensor theirs = grads ? whole[p.key()].grad() : whole[p.key()];
    ASSERT_TRUE(mine.defined() && theirs.defined()) << p.key() << " " << when;
    EXPECT_LT(rel_diff(mine, part_of(theirs, mine, g)), kTol) << p.key() << (grads ? " grad " : " ") << when;
  }
}

// One model pair: `run(module, is_tp)` computes (output, loss). Checks outputs, input gradients
// (`input` on both sides), parameter gradients, then parameters after 10 Adam steps.
inline void expect_equivalent(torch::nn::Module& tp, torch::nn::Module& ref, const dtrain::Group& g,
                              const std::function<std::pair<at::Tensor, at::Tensor>(torch::nn::Module&, bool)>& run,
                              const std::function<at::Tensor(bool)>& input_grad = nullptr) {
  torch::optim::Adam opt(tp.parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam ref_opt(ref.parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < 10; ++step) {
    opt.zero_grad();
    ref_opt.zero_grad();
    auto [out, loss] = run(tp, true);
    auto [ref_out, ref_loss] = run(ref, false);
    loss.backward();
    ref_loss.backward();
    if (step == 0) {
      EXPECT_LT(rel_diff(out, part_of(ref_out, out, g)), kTol) << "output";
      EXPECT_LT(rel_diff(loss, ref_loss), kTol) << "loss";
      if (input_grad) {
        EXPECT_LT(rel_diff(input_grad(true), input_grad(false)), kTol) << "input grad";
      }
      expect_params_match(tp, ref, g, /*grads=*/true, "at step 0");
    }
    opt.step();
    ref_opt.step();
  }
  expect_params_match(tp, ref, g, /*grads=*/false, "after 10 Adam steps");
}

// 10 Adam steps of both models; `losses()` computes this step's (TP model's loss, reference's).
inline void adam_steps(torch::nn::Module& tp, torch::nn::Module& ref,
                       const std::function<std::pair<at::Tensor, at::Tensor>()>& losses) {
  torch::optim::Adam opt(tp.parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam ref_opt(ref.parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < 10; ++step) {
    opt.zero_grad();
    ref_opt.zero_grad();
    auto [loss, ref_loss] = losses();
    loss.backward();
    ref_loss.backward();
    opt.step();
    ref_opt.step();
  }
}

}  // namespace tp_compare
