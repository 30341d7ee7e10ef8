// data_parallel: the tutorial's section 2.1 program in C++ — SimpleModel trained with single-process
// DataParallel (one process, one replica per device, replicas run in threads).
//
//   ./build/bin/data_parallel [--replicas 2] [--steps 30]
//
// Python (the tutorial):                        C++ (dtrain):
//   model = SimpleModel()                         tutorial::SimpleModel model;
//   if torch.cuda.device_count() > 1:             dtrain::DataParallel dp(model,
//       model = nn.DataParallel(model)                DataParallelOptions(device_ids),
//                                                     [] { return tutorial::SimpleModel().ptr(); });
//   model = model.to(device)                      model->to(device_ids[0])   (before wrapping)
//   outputs = model(inputs)                       at::Tensor out = dp(inputs);
//   optimizer = optim.Adam(model.parameters())    torch::optim::Adam opt(dp.parameters(), 1e-3);
//   loss.backward(); optimizer.step()             loss.backward(); opt.step();
// device_ids: every CUDA device when there are 2 or more, else --replicas CPU "devices" (the same
// CPU repeated: each replica is one thread). The third argument is the replica factory: the
// tutorial's models are plain torch::nn::Module, not Cloneable, so DataParallel cannot clone them.
//
// The tutorial's point (end of section 2.2): DataParallel is the easy way, but DistributedDataParallel
// is preferred. Why (bench_data_parallel: 2 replicas vs 2 DDP ranks vs one module, the same global
// batch; numbers in docs/benchmarks.md, "DataParallel vs DDP"): DataParallel pays, every step and
// serially on the caller's thread, for copying the parameters into the replicas, starting and joining
// the replica threads, gathering the outputs and summing the replicas' gradients into the module;
// DDP's ranks do none of that and overlap the gradient all-reduce with backward. So DDP wins on the
// CNN; on the MLP's sub-millisecond steps neither pays off — per-step overheads dominate, use one
// process there. On GPUs DataParallel also
// piles the outputs and gradients on device 0 (the tutorial's "main GPU memory pressure").
#include <cstdio>
#include <vector>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include "cli_checks.h"
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include "dtrain/data_parallel.h"
#include "tutorial_models.h"

int main(int argc, char** argv) {
  CLI::App app{"data_parallel: the tutorial's DataParallel program (section 2.1) in C++"};
  int replicas = 2, steps = 30, batch_size = 32, batches = 10;
  app.add_option("--replicas", replicas, "CPU replicas when fewer than 2 CUDA devices (default 2)")
      ->check(dtrain_cli::positive());
  app.add_option("--steps", steps, "training steps (default 30)")->check(dtrain_cli::positive());
  app.add_option("--batch_size", batch_size, "global batch, split across the replicas (default 32)")
      ->check(dtrain_cli::positive());
  app.add_option("--batches", batches, "distinct random batches, cycled (the tutorial's 10)")
      ->check(dtrain_cli::positive());
  CLI11_PARSE(app, argc, argv);
  try {
    // doc:begin devices
    const int64_t cuda_devices = static_cast<int64_t>(torch::cuda::device_count());
    std::printf("CUDA devices: %lld\n", static_cast<long long>(cuda_devices));
    std::vector<c10::Device> device_ids;
    if (cuda_devices > 1)
      for (int64_t i = 0; i < cuda_devices; ++i) device_ids.emplace_back(at::kCUDA, static_cast<c10::DeviceIndex>(i));
    else
      device_ids.assign(static_cast<size_t>(replicas), c10::Device(at::kCPU));
    const c10::Device device = device_ids[0];
    // doc:end devices

    // doc:begin wrap
    torch::manual_seed(0);
    tutorial::SimpleModel model;
    model->to(device);  // the module lives on device_ids[0]; the replicas are made on the others
    dtrain::DataParallel dp(model, dtrain::DataParallelOptions(device_ids),
                            [] { return tutorial::SimpleModel().ptr(); });
    std::printf("DataParallel: %zu replicas on %s\n", dp.num_replicas(), device.str().c_str());
    torch::optim::Adam opt(dp.parameters(), torch::optim::AdamOptions(1e-3));
    // doc:end wrap

    // doc:begin data
    // The tutorial's simulated data: 10 batches of (32, 128) inputs and labels in [0, 10). Random
    // labels, so the loss falls by the model memorizing these batches.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
    std::vector<std::pair<at::Tensor, at::Tensor>> loader;
    for (int i = 0; i < batches; ++i)
      loader.emplace_back(at::randn({batch_size, 128}, gen), at::randint(0, 10, {batch_size}, gen));
    // doc:end data

    // doc:begin loop
    model->train();
    double first_loss = 0, loss_value = 0;
    for (int s = 0; s < steps; ++s) {
      const auto& [x, y] = loader[s % batches];
      at::Tensor inputs = x.to(device), labels = y.to(device);
      opt.zero_grad();
      at::Tensor outputs = dp(inputs);  // (B, 10): scattered over the replicas, gathered on device
      at::Tensor loss = torch::nn::functional::cross_entropy(outputs, labels);
      loss.backward();  // the replicas' gradients are summed into model's
      opt.step();
      loss_value = loss.item<double>();
      if (s == 0) first_loss = loss_value;
      if (s == 0 || (s + 1) % 10 == 0 || s + 1 == steps)
        std::printf("step %3d: loss=%.4f acc=%.4f\n", s + 1, loss_value,
                    outputs.argmax(1).eq(labels).to(at::kFloat).mean().item<double>());
    }
    // doc:end loop
    std::printf("DataParallel training done: first loss %.4f, final loss %.4f\n", first_loss, loss_value);
    std::printf("RESULT steps=%d first_loss=%.4f final_loss=%.4f\n", steps, first_loss, loss_value);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "data_parallel: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
