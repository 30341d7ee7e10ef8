// SyncBatchNorm: BatchNorm whose training statistics are those of the global batch, over every rank
// of a process group (torch.nn.SyncBatchNorm in C++).
//
//   auto model = torch::nn::Sequential(torch::nn::Conv2d(3, 16, 3), torch::nn::BatchNorm2d(16), ...);
//   model = dtrain::convert_sync_batchnorm(model);   // every BatchNorm{1,2,3}d becomes a SyncBatchNorm
//   dtrain::DistributedDataParallel ddp(model);
//
// or, in a module of your own, declare the member as one: `dtrain::SyncBatchNorm bn{nullptr};` and
// `bn = register_module("bn", dtrain::SyncBatchNorm(16));` (same parameter and buffer names as
// BatchNorm, so checkpoints of either load into the other).
//
// Training, per forward (see Note [SyncBatchNorm statistics] in src/nn/sync_batchnorm.cpp):
//   1. Each rank computes its per-channel mean and biased variance and counts its values.
//   2. One all_gather of [mean, var, count] per rank; every rank combines them into the global
//      batch's mean and variance, weighting each rank by its own count (ranks may hold batches of
//      different sizes, also empty ones).
//   3. The input is normalized with the global statistics; the running statistics move towards them
//      (unbiased variance of the global batch), the same on every rank.
//   4. Backward: one all_reduce of the per-channel sums of dy and dy * (x - mean); the input
//      gradient is the global batch's. Weight and bias gradients stay local: DDP averages them.
// Eval mode (or a group of one rank) is plain BatchNorm on the running statistics, no communication.
#pragma once

#include <memory>
#include <optional>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include "dtrain/detail/arg.h"
#include "dtrain/process_group.h"

namespace dtrain {

// PyTorch's defaults: eps 1e-5, momentum 0.1 (nullopt: cumulative moving average, the factor being
// 1 / num_batches_tracked), affine, track_running_stats.
struct SyncBatchNormOptions {
  /* implicit */ SyncBatchNormOptions(int64_t num_features) : num_features_(num_features) {}
  // From BatchNorm{1,2,3}d's options (they share the type): the same layer, synchronized.
  /* implicit */ SyncBatchNormOptions(const torch::nn::BatchNormOptions& bn);
  DTRAIN_ARG(int64_t, num_features, 0)
  DTRAIN_ARG(double, eps, 1e-5)
  DTRAIN_ARG(std::optional<double>, momentum, 0.1)
  DTRAIN_ARG(bool, affine, true)
  DTRAIN_ARG(bool, track_running_stats, true)
  // The group whose ranks share the statistics (default: the world).
  DTRAIN_ARG(Group, process_group, Group())
};

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  explicit SyncBatchNormImpl(SyncBatchNormOptions options);
  // Takes over a BatchNorm's parameters and buffers, the same tensors (convert_sync_batchnorm).
  SyncBatchNormImpl(SyncBatchNormOptions options, const torch::nn::Module& batchnorm);
  // input: (N, C) or (N, C, L) or (N, C, H, W) or (N, C, D, H, W), C = num_features.
  at::Tensor forward(const at::Tensor& input);
  void reset() override;
  void reset_running_stats();
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  SyncBatchNormOptions options;
  at::Tensor weight, bias;                                    // undefined unless affine
  at::Tensor running_mean, running_var, num_batches_tracked;  // undefined unless track_running_stats
};
TORCH_MODULE(SyncBatchNorm);

// PyTorch's torch.nn.SyncBatchNorm.convert_sync_batchnorm: returns `module` with every
// BatchNorm{1,2,3}d replaced by a SyncBatchNorm on `group` that shares its parameters and running
// statistics (the same tensors, so an optimizer made before still updates them). A C++ module calls
// its children through its own typed members, which no function can rewire: so the BatchNorms must
// be the module itself or elements of a torch::nn::Sequential; one held by
// another module is an error naming it, with the remedy (declare it as a dtrain::SyncBatchNorm).
std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(std::shared_ptr<torch::nn::Module> module,
                                                          const Group& group = Group());
torch::nn::Sequential convert_sync_batchnorm(const torch::nn::Sequential& module, const Group& group = Group());

}  // namespace dtrain
