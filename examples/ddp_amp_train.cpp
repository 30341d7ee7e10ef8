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
//
// And the tutorial's gradient synchronization options (its section 4.2): --bucket_cap_mb,
// --broadcast_buffers, --gradient_as_bucket_view go to DDPOptions; --accumulate N accumulates N
// micro-batches per step with no_sync() (only the last backward all-reduces). The RESULT line says
// whether every rank ended with the same parameters (params_agree=1).
#include <cstdio>
#include <optional>

#include <CLI/CLI.hpp>

#include "cli_checks.h"
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>

#include "dtrain/dtrain.h"
#include "tutorial_models.h"

int main(int argc, char** argv) {
  CLI::App app{"ddp_amp_train: DDP + autocast + GradScaler (the tutorial's train_ddp_amp.py)"};
  int steps = 20, batch_size = 16, accumulate = 1;
  double lr = 1e-3, max_norm = 1.0, bucket_cap_mb = 25;
  bool broadcast_buffers = true, gradient_as_bucket_view = false;
  app.add_option("--steps", steps, "training steps");
  app.add_option("--batch_size", batch_size, "samples per rank and step");
  app.add_option("--lr", lr, "Adam learning rate");
  app.add_option("--max_norm", max_norm, "gradient clipping norm");
  app.add_option("--bucket_cap_mb", bucket_cap_mb, "DDP gradient bucket size in MiB (PyTorch's default 25)");
  app.add_option("--broadcast_buffers", broadcast_buffers, "DDP broadcasts rank 0's buffers before each forward");
  app.add_option("--gradient_as_bucket_view", gradient_as_bucket_view, "gradients are views into DDP's buckets");
  app.add_option("--accumulate", accumulate, "micro-batches per optimizer step (no_sync for all but the last)")
      ->check(dtrain_cli::positive());
  CLI11_PARSE(app, argc, argv);
  try {
    // doc:begin setup
    const bool cuda = torch::cuda::is_available();
    dtrain::init_process_group(dtrain::InitOptions().backend(cuda ? "nccl" : "gloo"));
    if (cuda) dtrain::set_cuda_device(dtrain::local_rank());  // torch.cuda.set_device(rank)
    const at::Device device = cuda ? at::Device(at::kCUDA, dtrain::local_rank()) : at::Device(at::kCPU);

    tutorial::TrainModel model;  // the tutorial's AMPModel has the same layers
    model->to(device);
    // doc:begin options
    dtrain::DistributedDataParallel ddp(model, dtrain::DDPOptions()
                                                   .bucket_cap_mb(bucket_cap_mb)
                                                   .broadcast_buffers(broadcast_buffers)
                                                   .gradient_as_bucket_view(gradient_as_bucket_view));
    // doc:end options
    torch::optim::Adam opt(ddp.parameters(), lr);
    dtrain::GradScaler scaler;
    // doc:end setup

    // A fixed synthetic task: 10 classes, each with its own colour (per-channel mean) under noise.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1234 + dtrain::rank());
    at::Tensor class_means =
        at::randn({10, 3, 1, 1}, at::make_generator<at::CPUGeneratorImpl>(7)).expand({10, 3, 32, 32});
    double first_loss = 0, last_loss = 0;
    ddp.train();
    auto micro_batch = [&] {
      at::Tensor labels = at::randint(0, 10, {batch_size}, gen);
      at::Tensor inputs = class_means.index_select(0, labels) + 0.5 * at::randn({batch_size, 3, 32, 32}, gen);
      return std::make_pair(inputs.to(device), labels.to(device));
    };
    for (int s = 0; s < steps; ++s) {
      // doc:begin step
      opt.zero_grad();
      at::Tensor loss;
      for (int k = 0; k < accumulate; ++k) {
        auto [inputs, labels] = micro_batch();
        // doc:begin no-sync
        // Gradient accumulation: all but the last micro-batch accumulate locally, without
        // communication; the last backward all-reduces the accumulated sum.
        std::optional<dtrain::NoSyncGuard> no_sync;
        if (k + 1 < accumulate) no_sync.emplace(ddp.no_sync());
        // doc:end no-sync
        {
          dtrain::Autocast ac(device.type());
          loss = torch::nn::functional::cross_entropy(ddp(inputs), labels);
        }
        scaler.scale(loss / accumulate).backward();
      }
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
    // doc:begin params-agree
    // DDP keeps the replicas identical: the sum of all parameters is the same on every rank.
    double sum = 0;
    for (const auto& p : ddp.parameters()) sum += p.detach().to(at::kDouble).sum().item<double>();
    const double lo = dtrain::all_reduce_values(std::vector<double>{sum}, dtrain::ReduceOp::MIN)[0];
    const double hi = dtrain::all_reduce_values(std::vector<double>{sum}, dtrain::ReduceOp::MAX)[0];
    const bool agree = lo == hi;
    // doc:end params-agree
    if (dtrain::rank() == 0)
      std::printf("RESULT steps=%d first_loss=%.4f final_loss=%.4f params_agree=%d\n", steps, first_loss, last_loss,
                  agree ? 1 : 0);
    dtrain::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_amp_train: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
