// model_parallel: the tutorial's section 5.1 ModelParallel class in C++ — one model's layers split
// over two devices, the activations moved at the boundaries — trained a few steps; then the same
// split done by dtrain::ModelParallelSequential, which balances a Sequential over the devices itself.
//
//   ./build/bin/model_parallel [--steps 20]
//
// Python (the tutorial):                          C++ (dtrain):
//   self.features1 = nn.Sequential(...).to(d0)      features1 = register_module("features1", Sequential(...));
//                                                   features1->to(d0);
//   x = x.to("cuda:0"); x = self.features1(x)       x = features1->forward(x.to(d0));
//   x = x.to("cuda:1"); x = self.features2(x)       x = features2->forward(x.to(d1));
//   x = x.to("cuda:0"); x = self.classifier(x)      x = classifier->forward(x.to(d0));
//   (by hand, per model)                            dtrain::ModelParallelSequential mp(seq, {d0, d1});
// Devices: cuda:0 and cuda:1 when there are 2 CUDA devices, else CPU and CPU (the same code path:
// the moves are no-ops). Model parallelism runs the stages one after the other, so it makes a model
// fit, not run faster; the pipeline (section 5.2, include/dtrain/pipeline.h) overlaps the stages.
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include "cli_checks.h"
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>
#include <torch/optim/adam.h>

#include "dtrain/data_parallel.h"

namespace {

using namespace torch::nn;

// doc:begin model-parallel-class
// The tutorial's ModelParallel: features1 on d0, features2 on d1, classifier on d0.
struct ModelParallelImpl : Module {
  ModelParallelImpl(c10::Device d0, c10::Device d1) : d0(d0), d1(d1) {
    features1 =
        register_module("features1", Sequential(Conv2d(Conv2dOptions(3, 64, 3).padding(1)), ReLU(), MaxPool2d(2)));
    features2 = register_module(
        "features2", Sequential(Conv2d(Conv2dOptions(64, 128, 3).padding(1)), ReLU(), AdaptiveAvgPool2d(1), Flatten()));
    classifier = register_module("classifier", Linear(128, 10));
    features1->to(d0);
    features2->to(d1);
    classifier->to(d0);
  }
  at::Tensor forward(at::Tensor x) {       // (B, 3, 32, 32)
    x = features1->forward(x.to(d0));      // (B, 64, 16, 16) on d0
    x = features2->forward(x.to(d1));      // (B, 128) on d1
    return classifier->forward(x.to(d0));  // (B, 10) on d0
  }
  c10::Device d0, d1;
  Sequential features1{nullptr}, features2{nullptr};
  Linear classifier{nullptr};
};
TORCH_MODULE(ModelParallel);
// doc:end model-parallel-class

// The same layers as one Sequential, for ModelParallelSequential.
Sequential make_sequential() {
  return Sequential(Conv2d(Conv2dOptions(3, 64, 3).padding(1)), ReLU(), MaxPool2d(2),
                    Conv2d(Conv2dOptions(64, 128, 3).padding(1)), ReLU(), AdaptiveAvgPool2d(1), Flatten(),
                    Linear(128, 10));
}

// A fixed synthetic task: 10 classes, each with its own colour (per-channel mean) under noise.
struct Task {
  at::Tensor class_means = at::randn({10, 3, 1, 1}, at::make_generator<at::CPUGeneratorImpl>(7));
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  std::pair<at::Tensor, at::Tensor> batch(int64_t b) {
    at::Tensor labels = at::randint(0, 10, {b}, gen);
    at::Tensor inputs =
        class_means.index_select(0, labels).expand({b, 3, 32, 32}) + 0.5 * at::randn({b, 3, 32, 32}, gen);
    return {inputs, labels};
  }
};

// doc:begin train
// The tutorial's loop; returns the first and the last loss. The input starts on the CPU (the model
// moves it).
template <typename Model>
std::pair<double, double> train(Model& model, c10::Device out_device, int steps, int64_t batch_size, const char* name) {
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  Task task;
  model->train();
  double first_loss = 0, loss_value = 0;
  for (int s = 0; s < steps; ++s) {
    auto [inputs, labels] = task.batch(batch_size);
    opt.zero_grad();
    at::Tensor out = model->forward(inputs);  // (B, 10)
    if (s == 0) std::printf("%s: output device %s\n", name, out.device().str().c_str());
    at::Tensor loss = torch::nn::functional::cross_entropy(out, labels.to(out_device));
    loss.backward();  // autograd carries the gradients back across the device boundaries
    opt.step();
    loss_value = loss.item<double>();
    if (s == 0) first_loss = loss_value;
    if (s == 0 || (s + 1) % 5 == 0 || s + 1 == steps) std::printf("%s: step %3d loss=%.4f\n", name, s + 1, loss_value);
  }
  return {first_loss, loss_value};
}
// doc:end train

std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"model_parallel: the tutorial's ModelParallel (section 5.1) in C++"};
  int steps = 20;
  int64_t batch_size = 16;
  app.add_option("--steps", steps, "training steps per model (default 20)")->check(dtrain_cli::positive());
  app.add_option("--batch_size", batch_size, "samples per step (default 16)")->check(dtrain_cli::positive());
  CLI11_PARSE(app, argc, argv);
  try {
    // doc:begin devices
    const bool two_gpus = torch::cuda::device_count() >= 2;
    const c10::Device d0 = two_gpus ? c10::Device(at::kCUDA, 0) : c10::Device(at::kCPU);
    const c10::Device d1 = two_gpus ? c10::Device(at::kCUDA, 1) : c10::Device(at::kCPU);
    std::printf("devices: %s, %s\n", d0.str().c_str(), d1.str().c_str());
    // doc:end devices

    // 1. The tutorial's class, as written there; the output comes back on d0.
    torch::manual_seed(0);
    ModelParallel model(d0, d1);
    const double loss1 = train(model, d0, steps, batch_size, "ModelParallel").second;

    // doc:begin sequential
    // 2. The same layers in one Sequential, split by ModelParallelSequential (balance by parameter
    // count: {conv 1792, -, -, conv 73856, -, -, -, linear 1290} -> stages of 3 and 5 layers). The
    // output stays on the last stage's device.
    torch::manual_seed(0);
    dtrain::ModelParallelSequential mp(make_sequential(), std::vector<c10::Device>{d0, d1});
    std::printf("ModelParallelSequential: balance %s\n", join(mp->balance()).c_str());
    // doc:end sequential
    for (size_t s = 0; s < mp->stages().size(); ++s) {
      std::string layers;
      for (const auto& m : mp->stages()[s]->children()) {
        std::string n = m->name();  // "torch::nn::Conv2dImpl" -> "Conv2d"
        n = n.substr(n.rfind(':') + 1);
        layers += " " + n.substr(0, n.size() - (n.size() > 4 && n.compare(n.size() - 4, 4, "Impl") == 0 ? 4 : 0));
      }
      std::printf("  stage %zu on %s:%s\n", s, mp->devices()[s].str().c_str(), layers.c_str());
    }
    const auto [first_loss, loss2] = train(mp, mp->devices().back(), steps, batch_size, "ModelParallelSequential");

    std::printf("final losses: ModelParallel %.4f, ModelParallelSequential %.4f\n", loss1, loss2);
    std::printf("RESULT steps=%d first_loss=%.4f final_loss=%.4f\n", steps, first_loss, loss2);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "model_parallel: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
