// Activation checkpointing: torch.utils.checkpoint in C++ (non-reentrant semantics). A checkpointed
// function keeps only its inputs from forward; backward runs it again, with grad, to get what its
// gradient needs: memory for compute.
//
//   // Python: y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
//   at::Tensor y = dtrain::checkpoint([&](const std::vector<at::Tensor>& in) { return block->forward(in[0]); },
//                                     {x}, dtrain::ActivationCheckpointOptions().parameters(block->parameters()));
//   // Python: model.blocks[i] = checkpoint_wrapper(model.blocks[i])
//   for (auto& block : *seq) dtrain::checkpoint_wrapper(block);   // each element recomputed in backward
//   // Python: y = torch.utils.checkpoint.checkpoint_sequential(seq, 4, x, use_reentrant=False)
//   at::Tensor y = dtrain::checkpoint_sequential(seq, 4, x);
//
// What a caller may rely on:
// - Gradients are those of the function run as is, bit for bit: the recompute replays the same
//   kernels on the same inputs, with the RNG (the default CPU generator, and the current CUDA
//   device's when there is one) put back to its state before the forward (preserve_rng_state), so
//   dropout drops the same elements, and with the forward's autocast state (CPU and CUDA, enabled
//   and dtype). The RNG state outside is as if the recompute had not run.
// - Gradients reach the inputs that require grad and the parameters fn uses. Name the parameters
//   (ActivationCheckpointOptions::parameters; checkpoint_wrapper names its module's): they become
//   inputs of the checkpoint's autograd node, so their gradients are accumulated by the backward
//   pass that is running, as without checkpointing, and DDP's and fully_shard's gradient hooks, and
//   DDP's search for unused parameters, see them as usual. Parameters fn captures without naming
//   them get their gradients from a nested backward inside the checkpoint's (as PyTorch's reentrant
//   checkpoint): fine in one process, not under DDP or fully_shard.
// - When grad mode is off, or no input and no named parameter requires grad, fn runs as is, not
//   checkpointed (there is nothing to recompute, or nothing that would tie fn's parameters to the
//   graph).
// - fn must return a tensor computed from its inputs or parameters: a recomputed output that does
//   not require grad while they do is an error in backward, naming the remedy (PyTorch warns).
// - fn runs twice: side effects (a BatchNorm's running statistics, a counter) happen twice. Collectives
//   inside fn (a tensor-parallel block's all-reduce) run again in the recompute, on every rank in the
//   same order, since every rank's backward reaches the checkpoint's node in the same order.
// - The recompute must give an output of the forward's shape, dtype and device (PyTorch's
//   determinism_check "default"; "none" skips the check): otherwise backward fails naming both.
// - A backward that asks for only some of the gradients (autograd::grad for the input alone, as the
//   zero-bubble pipeline's B does before its W) keeps the recomputed graph, and the backward that
//   asks for the others (W: the parameters) takes its gradients from it: fn is recomputed once.
// - Checkpointing an already checkpointed module (a CheckpointWrapper, or a Sequential element wrapped
//   before) is refused in one line: the recompute would itself be recomputed.
// - C++ modules have no forward hooks, so a wrapped module runs checkpointed through something dtrain
//   owns: the CheckpointWrapper returned, or a Sequential element replaced in place.
// Design: docs/design.md, "Activation checkpointing".
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include "dtrain/detail/arg.h"

namespace dtrain {

struct ActivationCheckpointOptions {
  // Restore the RNG state of the forward around the recompute (PyTorch's preserve_rng_state): off
  // only for a function that draws no random numbers, where saving the state is wasted time.
  DTRAIN_ARG(bool, preserve_rng_state, true)
  // The parameters fn uses besides its inputs (a module's parameters()): see the contract above.
  DTRAIN_ARG(std::vector<at::Tensor>, parameters, {})
  // PyTorch's determinism_check: "default" compares the recomputed output's shape, dtype and device
  // with the forward's output (an error naming both when they differ); "none" turns the check off.
  DTRAIN_ARG(std::string, determinism_check, "default")
};

using CheckpointFunction = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

// torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=False): fn(inputs), keeping only
// `inputs` for backward.
at::Tensor checkpoint(CheckpointFunction fn, const std::vector<at::Tensor>& inputs,
                      const ActivationCheckpointOptions& options = ActivationCheckpointOptions());

// A module whose forward takes and returns one tensor, run checkpointed (PyTorch's
// torch.distributed.algorithms._checkpoint.checkpoint_wrapper). The wrapped module is registered as
// its submodule `module`. Under fully_shard the recompute must run inside the unit (its pre-backward
// gather brings the parameters back first): checkpoint first, then fully_shard, either the wrappers
// pushed into a Sequential (seq->push_back(checkpoint_wrapper(block)), names under `module.`, each
// wrapper a unit) or a Sequential's elements wrapped in place (checkpoint_wrapper(element), then
// fully_shard(element): the unit is the element the Sequential holds, its names kept).
class CheckpointWrapperImpl : public torch::nn::Module {
 public:
  explicit CheckpointWrapperImpl(torch::nn::AnyModule inner,
                                 ActivationCheckpointOptions options = ActivationCheckpointOptions());
  at::Tensor forward(at::Tensor x);
  const torch::nn::AnyModule& inner() const { return inner_; }

 private:
  torch::nn::AnyModule inner_;
  ActivationCheckpointOptions options_;
};
TORCH_MODULE(CheckpointWrapper);

// A module of your own (std::shared_ptr<Block>, or a holder's .ptr()) wrapped: call the result in
// its place. Its parameters are the module's, under the prefix `module.`.
template <typename ModuleType>
CheckpointWrapper checkpoint_wrapper(std::shared_ptr<ModuleType> module,
                                     ActivationCheckpointOptions options = ActivationCheckpointOptions()) {
  return CheckpointWrapper(torch::nn::AnyModule(std::move(module)), std::move(options));
}
// An element of a torch::nn::Sequential (for (auto& block : *seq) checkpoint_wrapper(block)),
// replaced in place by a wrapper that runs it checkpointed, so the Sequential's own forward does.
// Its parameters keep their names in the Sequential. fully_shard(element) after it makes the element
// a unit that runs checkpointed inside (see CheckpointWrapperImpl).
void checkpoint_wrapper(torch::nn::AnyModule& element,
                        ActivationCheckpointOptions options = ActivationCheckpointOptions());

// torch.utils.checkpoint.checkpoint_sequential(seq, segments, x, use_reentrant=False): the elements
// cut into `segments` runs of consecutive elements (as PyTorch: size / segments each, the last one
// the rest), each but the last checkpointed; the last runs as is, since backward starts with it.
// 1 <= segments <= seq->size(). Every element takes and returns one tensor.
at::Tensor checkpoint_sequential(const torch::nn::Sequential& seq, int64_t segments, const at::Tensor& x,
                                 const ActivationCheckpointOptions& options = ActivationCheckpointOptions());

}  // namespace dtrain
