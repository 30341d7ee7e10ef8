// ddp_train: the tutorial's complete DDP training script (train_ddp.py) in C++ — TrainModel on its
// synthetic 1000-sample dataset, sharded by rank with DistributedSampler, averaged gradients with
// DistributedDataParallel, a barrier after every epoch and rank 0 printing the epoch loss.
//
//   ./build/bin/dtrain-run --standalone --nproc_per_node 2 ./build/bin/ddp_train --epochs 2
//
// Python (the tutorial):                             C++ (dtrain):
//   torchrun --nproc_per_node 2 train_ddp.py           dtrain-run --standalone --nproc_per_node 2 ddp_train
//   argparse --epochs --batch_size --lr --local_rank   CLI11, the same flags
//   dist.init_process_group("nccl", rank, world)       dtrain::init_process_group(InitOptions().backend(..))
//   model = DDP(TrainModel().cuda(rank), ...)          dtrain::DistributedDataParallel ddp(TrainModel())
//   optim.Adam(model.parameters(), lr=args.lr)         torch::optim::Adam(ddp.parameters(), AdamOptions(lr))
//   nn.CrossEntropyLoss()                              torch::nn::functional::cross_entropy
//   TensorDataset(randn(1000,3,32,32), randint(..))    two tensors made from a fixed seed (see below)
//   DistributedSampler(dataset, world, rank, True)     dtrain::DistributedSampler(1000)  (same order)
//   DataLoader(dataset, batch_size, sampler)           a plain loop over sampler.indices() in batches
//   sampler.set_epoch(epoch)                           sampler.set_epoch(epoch)
//   for inputs, labels in loader: ... step()           index_select the batch, the same five lines
//   dist.barrier()                                     dtrain::barrier()
//   epoch_loss / len(loader) on rank 0                 the same, averaged over ranks (all_reduce AVG)
//   dist.destroy_process_group()                       dtrain::destroy_process_group()
//
// Differences on purpose: the tutorial draws its random dataset without a seed, so every rank gets a
// different one; here every rank builds the same dataset from --seed. It needs CUDA and NCCL; this runs
// on CPU with Gloo (--backend nccl in a CUDA build of LibTorch). Its printed loss is rank 0's own;
// here it is the average over ranks (one extra all_reduce per epoch).
// The last line (rank 0) is `RESULT epochs=E first_loss=F final_loss=L`: the first and the last
// epoch's loss, averaged over ranks (with 2 or more epochs, L < F shows the model learns).
#include <chrono>
#include <cstdio>
#include <string>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include "cli_checks.h"
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "dtrain/ddp.h"
#include "dtrain/dtrain.h"
#include "tutorial_models.h"

namespace {

constexpr int64_t kDatasetSize = 1000;  // the tutorial's TensorDataset
constexpr int64_t kClasses = 10;

struct Args {
  int epochs = 2;
  int64_t batch_size = 32;
  double lr = 1e-3;
  std::string optimizer = "adam";
  std::string backend = "gloo";
  uint64_t seed = 0;
  int local_rank = -1;
};

// doc:begin dataset
// The tutorial's dataset: randn(1000, 3, 32, 32) images and randint(0, 10, (1000,)) labels, the same
// on every rank.
std::pair<at::Tensor, at::Tensor> make_dataset(uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor images = at::randn({kDatasetSize, 3, 32, 32}, gen);      // (N, C, H, W)
  at::Tensor labels = at::randint(0, kClasses, {kDatasetSize}, gen);  // (N,)
  return {images, labels};
}
// doc:end dataset

void train(const Args& args) {
  // doc:begin init
  dtrain::init_process_group(dtrain::InitOptions().backend(args.backend));
  const int rank = dtrain::rank();
  // doc:end init

  // doc:begin wrap
  // Model: rank 0's initial weights are broadcast to every rank by the DDP constructor (seeded only
  // so that a run can be repeated exactly).
  at::manual_seed(args.seed);
  tutorial::TrainModel model;
  dtrain::DistributedDataParallel ddp(model);

  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (args.optimizer == "adam")
    optimizer = std::make_unique<torch::optim::Adam>(ddp.parameters(), torch::optim::AdamOptions(args.lr));
  else
    optimizer = std::make_unique<torch::optim::SGD>(ddp.parameters(), torch::optim::SGDOptions(args.lr));
  // doc:end wrap

  // doc:begin sampler
  auto [images, labels] = make_dataset(args.seed);
  // shuffle=True, seed 0, no drop_last: as the tutorial's DistributedSampler.
  dtrain::DistributedSampler sampler(static_cast<size_t>(kDatasetSize));
  const int64_t per_rank = static_cast<int64_t>(sampler.size());
  const int64_t batches = (per_rank + args.batch_size - 1) / args.batch_size;  // len(loader)
  // doc:end sampler
  if (rank == 0)
    std::printf("ddp_train: %d ranks (%s), %lld samples per rank in %lld batches of %lld, %s lr=%g\n",
                dtrain::world_size(), dtrain::backend().c_str(), static_cast<long long>(per_rank),
                static_cast<long long>(batches), static_cast<long long>(args.batch_size), args.optimizer.c_str(),
                args.lr);

  double first_loss = 0, final_loss = 0;
  // doc:begin epoch-loop
  for (int epoch = 0; epoch < args.epochs; ++epoch) {
    // Key point of the tutorial: a new shuffle (and so a new split) every epoch.
    sampler.set_epoch(epoch);
    ddp.train();
    const auto t0 = std::chrono::steady_clock::now();

    const std::vector<int64_t> indices = sampler.indices();
    const at::Tensor all = at::tensor(indices, at::kLong);
    double epoch_loss = 0;
    for (int64_t start = 0; start < per_rank; start += args.batch_size) {
      const at::Tensor idx = all.slice(0, start, std::min(start + args.batch_size, per_rank));
      const at::Tensor inputs = images.index_select(0, idx);   // (B, 3, 32, 32)
      const at::Tensor targets = labels.index_select(0, idx);  // (B,)

      optimizer->zero_grad();
      const at::Tensor outputs = ddp(inputs);  // (B, 10)
      const at::Tensor loss = torch::nn::functional::cross_entropy(outputs, targets);
      loss.backward();  // gradients averaged over ranks when this returns
      optimizer->step();

      epoch_loss += loss.item<double>();
    }

    // doc:begin epoch-end
    // Every rank has finished this epoch.
    dtrain::barrier();

    at::Tensor avg = at::tensor({epoch_loss / static_cast<double>(batches)}, at::kDouble);
    dtrain::all_reduce(avg, dtrain::ReduceOp::AVG);
    final_loss = avg.item<double>();
    if (epoch == 0) first_loss = final_loss;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rank == 0) std::printf("Epoch %d/%d, Loss: %.4f (%.2f s)\n", epoch + 1, args.epochs, final_loss, secs);
    // doc:end epoch-end
  }
  // doc:end epoch-loop

  // doc:begin cleanup
  if (rank == 0) std::printf("RESULT epochs=%d first_loss=%.6f final_loss=%.6f\n", args.epochs, first_loss, final_loss);
  dtrain::destroy_process_group();
  // doc:end cleanup
}

}  // namespace

int main(int argc, char** argv) {
  // doc:begin args
  CLI::App app{"ddp_train: the tutorial's train_ddp.py (TrainModel, DDP, DistributedSampler) in C++"};
  Args args;
  app.add_option("--epochs", args.epochs, "epochs to train (default 2)")->check(CLI::NonNegativeNumber);
  app.add_option("--batch_size", args.batch_size, "batch size per rank (default 32)")->check(dtrain_cli::positive());
  app.add_option("--lr", args.lr, "learning rate (default 1e-3)")->check(dtrain_cli::positive());
  app.add_option("--optimizer", args.optimizer, "adam (the tutorial's) or sgd")->check(CLI::IsMember({"adam", "sgd"}));
  app.add_option("--backend", args.backend, "gloo (CPU) or nccl (CUDA builds)");
  app.add_option("--seed", args.seed, "seed of the synthetic dataset, the same on every rank (default 0)");
  app.add_option("--local_rank,--local-rank", args.local_rank, "passed by dtrain-run --use_local_rank_arg");
  CLI11_PARSE(app, argc, argv);
  // doc:end args

  try {
    train(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_train: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
