// ddp_amp_train: the tutorial's train_ddp_amp.py in C++ — DDP + autocast + GradScaler, with gradient
// clipping between unscale_ and step.
//
//   ./build/bin/dtrain-run --standalone --nproc_per_node 2 ./build/bin/ddp_amp_train --steps 20
//
// Python (the tutorial):                          C++ (dtrain):
//   model = DDP(AMPModel().cuda(rank), ...)         DistributedDataParallel ddp(model)
//   scaler = GradScaler()                           dtrain::GradScaler scaler;
//   with autocast(device_type='cuda'):              { dtrain::Autocast ac(device.type());
//       loss = criterion(model(inputs), labels)         loss = cross_entropy(ddp(inputs), labels); }
//   scaler.scale(loss).backward()                   scaler.scale(loss).backward();
//   scaler.unscale_(optimizer)                      scaler.unscale_(opt);
//   clip_grad_norm_(model.parameters(), 1.0)        torch::nn::utils::clip_grad_norm_(ddp.parameters(), 1.0);
//   scaler.step(optimizer); scaler.update()         scaler.step(opt); scaler.update();
// On this CPU build autocast computes in bfloat16 (CUDA builds: float16 on the GPU).
#include <cstdio>

#include <CLI/CLI.hpp>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>

#include "dtrain/dtrain.h"
#include "tutorial_models.h"

int main(int argc, char** argv) {
  CLI::App app{"ddp_amp_train: DDP + autocast + GradScaler (the tutorial's train_ddp_amp.py)"};
  int steps = 20, batch_size = 16;
  double lr = 1e-3, max_norm = 1.0;
  app.add_option("--steps", steps, "training steps");
  app.add_option("--batch_size", batch_size, "samples per rank and step");
  app.add_option("--lr", lr, "Adam learning rate");
  app.add_option("--max_norm", max_norm, "gradient clipping norm");
  CLI11_PARSE(app, argc, argv);
  try {
    // doc:begin setup
    const bool cuda = torch::cuda::is_available();
    dtrain::init_process_group(dtrain::InitOptions().backend(cuda ? "nccl" : "gloo"));
    const at::Device device = cuda ? at::Device(at::kCUDA, dtrain::local_rank()) : at::Device(at::kCPU);

    tutorial::TrainModel model;  // the tutorial's AMPModel has the same layers
    model->to(device);
    dtrain::DistributedDataParallel ddp(model);
    torch::optim::Adam opt(ddp.parameters(), lr);
    dtrain::GradScaler scaler;
    // doc:end setup

    // A fixed synthetic task: 10 classes, each with its own colour (per-channel mean) under noise.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1234 + dtrain::rank());
    at::Tensor class_means =
        at::randn({10, 3, 1, 1}, at::make_generator<at::CPUGeneratorImpl>(7)).expand({10, 3, 32, 32});
    double first_loss = 0, last_loss = 0;
    ddp.train();
    for (int s = 0; s < steps; ++s) {
      at::Tensor labels = at::randint(0, 10, {batch_size}, gen);
      at::Tensor inputs = class_means.index_select(0, labels) + 0.5 * at::randn({batch_size, 3, 32, 32}, gen);
      inputs = inputs.to(device);
      labels = labels.to(device);

      // doc:begin step
      opt.zero_grad();
      at::Tensor loss;
      {
        dtrain::Autocast ac(device.type());
        loss = torch::nn::functional::cross_entropy(ddp(inputs), labels);
      }
      scaler.scale(loss).backward();
      scaler.unscale_(opt);
      torch::nn::utils::clip_grad_norm_(ddp.parameters(), max_norm);
      scaler.step(opt);
      scaler.update();
      // doc:end step

      at::Tensor avg = loss.detach().to(at::kFloat).reshape({1});
      dtrain::all_reduce(avg, dtrain::ReduceOp::AVG);
      if (s == 0) first_loss = avg.item<double>();
      last_loss = avg.item<double>();
      if (dtrain::rank() == 0 && (s % 5 == 0 || s == steps - 1))
        std::printf("step %d loss %.4f scale %.0f\n", s, last_loss, scaler.get_scale());
    }
    if (dtrain::rank() == 0)
      std::printf("RESULT steps=%d first_loss=%.4f final_loss=%.4f\n", steps, first_loss, last_loss);
    dtrain::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_amp_train: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
