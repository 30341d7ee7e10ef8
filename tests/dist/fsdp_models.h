// What the fully_shard tests share: a float64 model whose dimensions 2, 3 and 4 ranks do not
// divide, with units of every kind (Sequential elements, a member declared FSDPModule, a unit inside
// a unit, a unit holding a parameter that backward never reaches, the root's own parameters), and
// the batches every rank draws alike.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "dtrain/fsdp.h"
#include "dtrain/process_group.h"

namespace fsdp_models {

constexpr int kGlobalBatch = 12;  // divisible by 2, 3 and 4

// A block with its own parameter (`a`), a unit inside it (`b`) and a parameter no forward uses.
struct InnerImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr};
  dtrain::FSDPModule<torch::nn::LinearImpl> b{nullptr};
  torch::Tensor unused;
  InnerImpl() {
    a = register_module("a", torch::nn::Linear(7, 9));
    b = dtrain::FSDPModule<torch::nn::LinearImpl>(register_module("b", std::make_shared<torch::nn::LinearImpl>(9, 11)));
    unused = register_parameter("unused", torch::randn({5, 2}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::tanh(a(x))); }
};
TORCH_MODULE(Inner);

struct NetImpl : torch::nn::Module {
  torch::nn::Linear inp{nullptr};
  torch::nn::Sequential blocks{nullptr};
  dtrain::FSDPModule<InnerImpl> inner{nullptr};
  torch::nn::Linear out{nullptr};
  NetImpl() {
    inp = register_module("inp", torch::nn::Linear(8, 13));
    // The second block's weights are drawn before the first's: the order GCC gave the arguments of
    // Sequential(...) (right to left; clang goes left to right), kept so that every compiler builds
    // the weights the checked-in checkpoints hold.
    torch::nn::Linear second(5, 7);
    torch::nn::Linear first(13, 5);
    blocks = register_module("blocks", torch::nn::Sequential(first, torch::nn::Tanh(), second, torch::nn::Tanh()));
    inner = dtrain::FSDPModule<InnerImpl>(register_module("inner", std::make_shared<InnerImpl>()));
    out = register_module("out", torch::nn::Linear(11, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return out(torch::tanh(inner(blocks->forward(torch::tanh(inp(x))))));
  }
};
TORCH_MODULE(Net);

inline Net make_net() {
  torch::manual_seed(5);
  Net net;
  net->to(at::kDouble);
  return net;
}

// Makes every kind of unit, bottom-up, and returns the root's handle.
inline dtrain::FSDPModule<NetImpl> shard(Net& net, dtrain::FullyShardOptions options = dtrain::FullyShardOptions()) {
  for (auto& element : *net->blocks)
    if (!element.ptr()->parameters().empty()) dtrain::fully_shard(element, options);
  dtrain::fully_shard(net->inner.module()->b, options);
  dtrain::fully_shard(net->inner, options);
  return dtrain::fully_shard(net.ptr(), options);
}

// The whole batch of `step`, the same on every rank.
inline std::pair<at::Tensor, at::Tensor> batch(int step) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  return {at::randn({kGlobalBatch, 8}, g, at::kDouble), at::randn({kGlobalBatch, 3}, g, at::kDouble)};
}

// This rank's rows of a batch split among the ranks of `group` (a model sharded over it trains the
// whole batch).
inline void keep_this_ranks_part(at::Tensor& x, at::Tensor& y, const dtrain::Group& group = dtrain::Group()) {
  x = x.chunk(group.size())[group.rank()];
  y = y.chunk(group.size())[group.rank()];
}

// The largest difference between the whole parameters and the reference's, relative to the
// reference's largest magnitude, over every parameter (a parameter missing from `whole` fails).
inline double max_rel_diff(const std::vector<std::pair<std::string, at::Tensor>>& whole, torch::nn::Module& ref) {
  std::map<std::string, at::Tensor> mine(whole.begin(), whole.end());
  double worst = 0;
  for (const auto& kv : ref.named_parameters()) {
    auto it = mine.find(kv.key());
    EXPECT_TRUE(it != mine.end()) << kv.key() << " is missing from the full state dict";
    if (it == mine.end()) return 1e300;
    EXPECT_EQ(it->second.sizes(), kv.value().sizes()) << kv.key();
    const double scale = std::max(kv.value().abs().max().item<double>(), 1e-6);
    worst = std::max(worst, (it->second.to(at::kDouble) - kv.value()).abs().max().item<double>() / scale);
  }
  return worst;
}

}  // namespace fsdp_models
