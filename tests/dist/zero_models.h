// What the ZeroRedundancyOptimizer tests share: a model whose parameters differ in size (so 2 and 3
// ranks partition them differently), the float64 batches every rank draws alike, and the optimizers
// under test.
#pragma once

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <string>
#include <utility>

#include "dtrain/process_group.h"
#include "dtrain/zero.h"

namespace zero_models {

constexpr int kGlobalBatch = 12;  // divisible by 2 and 3

inline torch::nn::Sequential make_model() {
  torch::manual_seed(3);
  torch::nn::Sequential m(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 12), torch::nn::Tanh(),
                          torch::nn::Linear(12, 4));
  m->to(at::kDouble);
  return m;
}

// The whole batch of `step`: the same on every rank; `seed` keeps the tests' data apart.
inline std::pair<at::Tensor, at::Tensor> batch(int seed, int step) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed + step);
  return {at::randn({kGlobalBatch, 8}, g, at::kDouble), at::randn({kGlobalBatch, 4}, g, at::kDouble)};
}

// Keeps this rank's rows of a batch (all of them when `whole`: the one-process reference).
inline void keep_this_ranks_part(at::Tensor& x, at::Tensor& y, bool whole) {
  if (whole) return;
  x = x.chunk(dtrain::world_size())[dtrain::rank()];
  y = y.chunk(dtrain::world_size())[dtrain::rank()];
}

// "sgd": SGD with momentum; anything else: Adam.
inline dtrain::OptimizerFactory factory(const std::string& kind) {
  if (kind == "sgd") return dtrain::optimizer_factory<torch::optim::SGD>(torch::optim::SGDOptions(0.05).momentum(0.9));
  return dtrain::optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(1e-2));
}

}  // namespace zero_models
