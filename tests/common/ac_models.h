// The activation-checkpointing tests' model (unit and dist): residual float64 MLP blocks, each
// `tanh(fc(x))` through an optional dropout, in a torch::nn::Sequential, seeded alike everywhere.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

namespace ac_test {

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t width, double dropout)
      : fc(register_module("fc", torch::nn::Linear(width, width))),
        drop(register_module("drop", torch::nn::Dropout(dropout))) {}
  at::Tensor forward(at::Tensor x) { return drop(torch::tanh(fc(x))) + x; }
  torch::nn::Linear fc;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Block);

inline torch::nn::Sequential make_mlp(int64_t blocks = 16, int64_t width = 12, double dropout = 0.0,
                                      uint64_t seed = 7) {
  torch::manual_seed(seed);
  torch::nn::Sequential seq;
  for (int64_t i = 0; i < blocks; ++i) seq->push_back(Block(width, dropout));
  seq->to(at::kDouble);
  return seq;
}

// A batch of `rows` rows, the same for a seed.
inline at::Tensor batch(int64_t rows, int64_t width = 12, uint64_t seed = 11) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randn({rows, width}, gen, at::kDouble);
}

// Every parameter's gradient, in module order (undefined where there is none).
inline std::vector<at::Tensor> grads_of(const torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return out;
}

}  // namespace ac_test
