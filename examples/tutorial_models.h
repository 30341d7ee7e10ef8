// The tutorial's models in LibTorch, shared by the examples, tests and benchmarks.
//   SimpleModel: MLP 128-256-256-10 (tutorial section 2).
//   TrainModel:  CNN on 3x32x32 — conv 64, pool, conv 128, global pool, linear 10 (section 3).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>
#include <torch/nn/modules/container/functional.h>

namespace tutorial {

// doc:begin simple-model
struct SimpleModelImpl : torch::nn::Module {
  SimpleModelImpl() {
    net = register_module(
        "net", torch::nn::Sequential(torch::nn::Linear(128, 256), torch::nn::ReLU(), torch::nn::Linear(256, 256),
                                     torch::nn::ReLU(), torch::nn::Linear(256, 10)));
  }
  at::Tensor forward(const at::Tensor& x) { return net->forward(x); }  // (B, 128) -> (B, 10)
  torch::nn::Sequential net{nullptr};
};
TORCH_MODULE(SimpleModel);
// doc:end simple-model

// doc:begin train-model
struct TrainModelImpl : torch::nn::Module {
  TrainModelImpl() {
    using namespace torch::nn;
    net = register_module("net", Sequential(Conv2d(Conv2dOptions(3, 64, 3).padding(1)), ReLU(), MaxPool2d(2),
                                            Conv2d(Conv2dOptions(64, 128, 3).padding(1)), ReLU(), AdaptiveAvgPool2d(1),
                                            Flatten(), Linear(128, 10)));
  }
  at::Tensor forward(const at::Tensor& x) { return net->forward(x); }  // (B, 3, 32, 32) -> (B, 10)
  torch::nn::Sequential net{nullptr};
};
TORCH_MODULE(TrainModel);
// doc:end train-model

}  // namespace tutorial
