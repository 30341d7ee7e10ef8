// The pipeline tests' model and data: a float64 MLP every rank builds with the same weights, batches
// every rank generates alike, and the comparison of a stage with the same layers of one process's model.
// Float64: micro-batching changes the order of the gradient sums, which in float32 moves parameters by
// ~1e-6 relative after a few steps, too close to the tests' bars to tell a bug from rounding.
#pragma once

#include <algorithm>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include "dtrain/pipeline.h"

namespace dtrain::test_pipeline {

constexpr int kBatch = 16;  // divisible by chunks 1, 2, 4, 8 and by 2 replicas
constexpr int kIn = 12, kHidden = 24, kOut = 6;

// The unsplit model: `linears` Linear layers with a ReLU between each two (3: Linear, ReLU, Linear, ReLU,
// Linear; 5 makes 9 layers, enough for 4 ranks x 2 virtual stages) in float64, the same weights on
// every rank.
inline torch::nn::Sequential make_model(int linears = 3) {
  using torch::nn::Linear;
  using torch::nn::ReLU;
  torch::manual_seed(7);
  torch::nn::Sequential m(Linear(kIn, kHidden));
  for (int k = 0; k < linears - 2; ++k) {
    m->push_back(ReLU());
    m->push_back(Linear(kHidden, kHidden));
  }
  m->push_back(ReLU());
  m->push_back(Linear(kHidden, kOut));
  m->to(at::kDouble);
  return m;
}

// The batch of a step, the same on every rank.
inline std::pair<at::Tensor, at::Tensor> batch(int step) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  return {at::randn({kBatch, kIn}, g, at::kDouble), at::randint(0, kOut, {kBatch}, g)};
}

inline at::Tensor loss_fn(const at::Tensor& out, const at::Tensor& target) {
  return torch::nn::functional::cross_entropy(out, target);
}

// Largest relative difference between the pipeline's stages on this rank and the same layers of the
// reference.
inline double stage_diff(const Pipeline& pipe, const torch::nn::Sequential& ref) {
  std::vector<at::Tensor> want;
  for (int c = 0; c < pipe.virtual_stages(); ++c) {
    const int64_t first = pipe.first_layer(c), n = pipe.balance()[c * pipe.num_stages() + pipe.stage()];
    for (int64_t k = first; k < first + n; ++k)
      for (const auto& p : (*ref)[k]->parameters()) want.push_back(p);
  }
  const auto got = pipe.parameters();
  EXPECT_EQ(got.size(), want.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    const double scale = std::max(want[i].abs().max().item<double>(), 1e-3);
    worst = std::max(worst, (got[i] - want[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

}  // namespace dtrain::test_pipeline
