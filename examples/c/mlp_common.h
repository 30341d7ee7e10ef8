// The MLP that examples/c/ddp_train.c (through mlp_shim.cpp) and its C++ twin ddp_train_ref.cpp train:
// the same initial values, batches, forward and hash in both, so their parameters can be compared bit
// for bit.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

namespace mlp {

constexpr int64_t kIn = 8, kHidden = 16, kOut = 4, kBatch = 8;

// fc1.weight, fc1.bias, fc2.weight, fc2.bias: each rank draws its own (DDP starts them all from rank 0's).
inline std::vector<at::Tensor> init_params(uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<at::Tensor> p = {at::randn({kHidden, kIn}, gen) * 0.3, at::randn({kHidden}, gen) * 0.1,
                               at::randn({kOut, kHidden}, gen) * 0.3, at::randn({kOut}, gen) * 0.1};
  for (auto& t : p) t.set_requires_grad(true);
  return p;
}

// Each rank's batch of a step differs (DDP's average is what keeps the ranks equal); the targets are
// one fixed function of the inputs, which the model learns.
inline std::pair<at::Tensor, at::Tensor> batch(int step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(step) * 100 + rank + 7);
  at::Tensor x = at::randn({kBatch, kIn}, gen);
  auto target_gen = at::make_generator<at::CPUGeneratorImpl>(42);
  at::Tensor y = at::tanh(at::matmul(x, at::randn({kIn, kOut}, target_gen)));
  return {x, y};
}

inline at::Tensor loss(const std::vector<at::Tensor>& p, int step, int rank) {
  auto [x, y] = batch(step, rank);
  at::Tensor h = at::relu(at::linear(x, p[0], p[1]));
  return at::mse_loss(at::linear(h, p[2], p[3]), y);
}

// Plain SGD, as torch::optim::SGD without momentum (p -= lr * grad), then zero_grad(set_to_none=True).
inline void sgd_step(const std::vector<at::Tensor>& params, double lr) {
  at::NoGradGuard no_grad;
  for (auto p : params) {
    p.add_(p.grad(), -lr);
    p.mutable_grad().reset();
  }
}

inline uint64_t hash(const std::vector<at::Tensor>& p) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& t : p) {
    at::Tensor c = t.detach().contiguous();
    const auto* bytes = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0; i < c.nbytes(); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  }
  return h;
}

}  // namespace mlp
