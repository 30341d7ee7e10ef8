// Tensor parallelism: one layer's weights split over the ranks of a group, which compute its output
// together (PyTorch's torch.distributed.tensor.parallel: parallelize_module, ColwiseParallel,
// RowwiseParallel, loss_parallel; Megatron-LM's column- and row-parallel linears and vocab-parallel
// embedding).
//
//   struct MLPImpl : torch::nn::Module {
//     dtrain::ParallelLinear w1{register_module("w1", dtrain::ParallelLinear(512, 2048))};
//     dtrain::ParallelLinear w2{register_module("w2", dtrain::ParallelLinear(2048, 512))};
//     at::Tensor forward(const at::Tensor& x) { return w2(torch::relu(w1(x))); }
//   };
//   auto mesh = dtrain::init_device_mesh({2, 2}, {"dp", "tp"});
//   MLP mlp;
//   dtrain::parallelize_module(*mlp, mesh["tp"],
//                              {{"w1", dtrain::ColwiseParallel()}, {"w2", dtrain::RowwiseParallel()}});
//   at::Tensor y = mlp(x);  // x and y whole on every tp rank: one all-reduce forward, one backward
//
// Why ParallelLinear and ParallelEmbedding, not torch::nn::Linear: PyTorch changes a module's
// forward with hooks; LibTorch modules have none, and their forward is not virtual. These two are
// torch::nn::Linear and torch::nn::Embedding (derived: the same options, initialization, parameter
// names and state dict) whose forward follows the style parallelize_module gives them; without one
// they are the plain layers. parallelize_module refuses a torch::nn::Linear or Embedding, saying so.
//
// Sharding, exactly as PyTorch's (so state dicts of the shards interoperate):
//                       Linear                               Embedding
//   ColwiseParallel     weight, bias: dim 0 (out_features)   weight: dim 1 (embedding_dim)
//   RowwiseParallel     weight: dim 1 (in_features);         weight: dim 0 (vocabulary), each rank
//                       bias whole, added once after the sum    looking up the indices in its rows
// Each rank keeps its contiguous part in group-rank order (torch.chunk). parallelize_module takes
// the whole parameters from group rank 0 (PyTorch's src_data_rank=0), so ranks may start different.
// Parameters keep their identity (their data is replaced), but build optimizers afterwards. Each
// sharded parameter's ShardSpec (dtrain/shard_spec.h: its whole shape and this rank's part) is
// shard_spec_of(param); call parallelize_module before fully_shard, which cuts TP's parts again.
// A sharded dimension need not divide by the group size: the parts are torch.chunk's (ceil(size / n)
// each, the last ranks fewer or none), as PyTorch's uneven Shard; a ColwiseParallel output gathered
// to Replicate() pads each part to ceil(size / n) for the all-gather and trims the padding.
//
// Layouts of inputs and outputs, PyTorch's defaults:
//   ColwiseParallel: input Replicate() (whole on every rank), output Shard(-1) (this rank's part of
//     the last dimension); output Replicate() all-gathers it; input Shard(d) all-gathers along d.
//   RowwiseParallel: input Shard(-1); output Replicate() (all-reduce), or Shard(d) (reduce-scatter
//     along d, sequence parallelism). For an Embedding too the default input is Shard(-1), as
//     PyTorch's: each rank's indices are all-gathered along it; pass input_layouts(Replicate()) when
//     every rank holds all the indices (PyTorch's tutorial does the same).
// Outputs are plain local tensors (PyTorch's use_local_output=True): there is no DTensor.
// Replicated values count once: the gradient of a replicated output is not summed over ranks.
//
// Sequence parallelism (PyTorch's SequenceParallel, PrepareModuleInput, PrepareModuleOutput): the
// norms between regions run on each rank's part of the sequence, the rowwise layer reduce-scatters
// into it and the next colwise layer all-gathers from it, as PyTorch's Llama plan:
//   dtrain::parallelize_module(*model, mesh["tp"],
//       {{"block.norm1", dtrain::SequenceParallel()},  // any module: LayerNorm, RMSNorm, Dropout
//        {"block.w1", dtrain::ColwiseParallel().input_layouts(dtrain::Shard(1))},
//        {"block.w2", dtrain::RowwiseParallel().output_layouts(dtrain::Shard(1))},
//        {"block.norm2", dtrain::SequenceParallel()}});
//   at::Tensor y = model(x.chunk(tp, 1)[tp_rank]);  // y: this rank's positions of the output
// The module a SequenceParallel names keeps its forward (its input is already the sequence part);
// its parameters stay whole and their gradients are summed over the group in backward (below).
// PrepareModuleInput/Output need the module's forward to call prepare_input/prepare_output.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "dtrain/detail/arg.h"
#include "dtrain/device_mesh.h"
#include "dtrain/process_group.h"
#include "dtrain/shard_spec.h"

namespace dtrain {

// Where a tensor's data sits across a group's ranks (PyTorch's placements, without Partial).
struct Layout {
  enum class Kind { kReplicate, kShard };
  Kind kind = Kind::kReplicate;
  int64_t dim = 0;  // for kShard
};
inline Layout Replicate() { return Layout{}; }
inline Layout Shard(int64_t dim) { return Layout{Layout::Kind::kShard, dim}; }
std::string to_string(const Layout& layout);  // "Replicate()", "Shard(-1)"

struct ColwiseParallel {
  DTRAIN_ARG(Layout, input_layouts, Replicate())
  DTRAIN_ARG(Layout, output_layouts, Shard(-1))
};
struct RowwiseParallel {
  DTRAIN_ARG(Layout, input_layouts, Shard(-1))
  DTRAIN_ARG(Layout, output_layouts, Replicate())
};
// Sequence parallelism for the layers between tensor-parallel regions (LayerNorm, RMSNorm, Dropout:
// anything that acts on each position alone): each rank runs the module on its part of the
// sequence, with the module's parameters whole on every rank (PyTorch's Replicate). The module's
// forward is unchanged: its input is this rank's sequence part (a RowwiseParallel output_layouts
// Shard(1), or PrepareModuleInput's), its output is too (a ColwiseParallel input_layouts Shard(1)
// gathers it). What parallelize_module does: each parameter is broadcast from group rank 0 and gets
// a gradient hook that all-reduces (SUM) its gradient over the group, since each rank's gradient
// holds only its positions' contributions (PyTorch's Partial -> Replicate of the DTensor gradient).
// The parameters get no ShardSpec: they are whole on every rank, so clip_grad_norm_, full_state_dict
// and checkpoints count them once. The hook runs before the gradient accumulates, so DDP over
// "dp", fully_shard over "dp" (call parallelize_module first) and optimizers see the sum.
// PyTorch's sequence_dim has no counterpart: the input is a plain local tensor, taken as the
// sequence part (PyTorch's case for a torch.Tensor input); the dimension is the one the
// neighbouring styles name (Shard(1)).
struct SequenceParallel {};

// Layouts of a module's tensor inputs or outputs, one per tensor in order; std::nullopt leaves that
// one alone (PyTorch's None).
using Layouts = std::vector<std::optional<Layout>>;

// PyTorch's PrepareModuleInput and PrepareModuleOutput: each tensor given in `*_layouts` is
// redistributed to its `desired_*` layout (dtrain::redistribute below). LibTorch has no forward
// hooks, so the module's forward calls them: parallelize_module records the style for the module,
// and dtrain::prepare_input(*this, x) / dtrain::prepare_output(*this, y) apply it (the identity for
// a module that has none, so the same model runs unparallelized):
//   struct BlockImpl : torch::nn::Module {
//     at::Tensor forward(at::Tensor x) {
//       x = dtrain::prepare_input(*this, x);     // e.g. Replicate() -> Shard(1): this rank's part
//       at::Tensor y = ...;
//       return dtrain::prepare_output(*this, y);  // e.g. Shard(1) -> Replicate(): all-gathered
//     }
//   };
//   dtrain::parallelize_module(model, tp, {{"block", dtrain::PrepareModuleInput()
//                                                        .input_layouts({dtrain::Replicate()})
//                                                        .desired_input_layouts({dtrain::Shard(1)})},
//                                          {"block", dtrain::PrepareModuleOutput()
//                                                        .output_layouts({dtrain::Shard(1)})
//                                                        .desired_output_layouts({dtrain::Replicate()})}});
// Outputs are local tensors (there is no DTensor; PyTorch's use_local_output has no counterpart).
struct PrepareModuleInput {
  DTRAIN_ARG(Layouts, input_layouts, {})
  DTRAIN_ARG(Layouts, desired_input_layouts, {})
};
struct PrepareModuleOutput {
  DTRAIN_ARG(Layouts, output_layouts, {})
  DTRAIN_ARG(Layouts, desired_output_layouts, {})
};

using ParallelStyle =
    std::variant<ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput>;
// Submodule names (as named_modules() gives them; "*" matches one name between dots, e.g.
// "layers.*.w1") and their styles, applied in order.
using ParallelizePlan = std::vector<std::pair<std::string, ParallelStyle>>;

namespace tp {
struct Applied;  // a style bound to a group (src/tp/)
}
namespace detail {
struct TensorParallelAccess;  // how parallelize_module sets a layer's style (src/tp/applied.h)
}

class ParallelLinearImpl : public torch::nn::LinearImpl {
 public:
  using torch::nn::LinearImpl::LinearImpl;
  at::Tensor forward(const at::Tensor& input);

 private:
  friend struct detail::TensorParallelAccess;
  std::shared_ptr<tp::Applied> applied_;  // set by parallelize_module; null: a plain Linear
};
TORCH_MODULE(ParallelLinear);

class ParallelEmbeddingImpl : public torch::nn::EmbeddingImpl {
 public:
  using torch::nn::EmbeddingImpl::EmbeddingImpl;
  at::Tensor forward(const at::Tensor& indices);

 private:
  friend struct detail::TensorParallelAccess;
  std::shared_ptr<tp::Applied> applied_;  // set by parallelize_module; null: a plain Embedding
};
TORCH_MODULE(ParallelEmbedding);

// Shards the plan's submodules of `module` over `group` (every rank of the group calls it, with the
// same plan). A mesh must be 1-D (pass mesh["tp"]). Every plan entry must match a submodule.
void parallelize_module(torch::nn::Module& module, const Group& group, const ParallelizePlan& plan);
void parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh, const ParallelizePlan& plan);

namespace tp {
// Every parameter and buffer of `module` by name, whole: dtrain::full_state_dict (shard_spec.h),
// which puts together any sharding, tensor-parallel shards inside fully_shard too (a copy; loads into
// the unsharded model, e.g. by name into its named_parameters(), then torch::save). Collective
// over the shards' groups.
inline std::vector<std::pair<std::string, at::Tensor>> full_state_dict(torch::nn::Module& module) {
  return dtrain::full_state_dict(module);
}
}  // namespace tp

// A local tensor of layout `from` over `group`, as layout `to` (DTensor's redistribute, then
// to_local), differentiable. The gradient of a Replicate() value is whole and counted once (the
// same on every rank), as a local tensor's gradient is in PyTorch:
//   Shard(d) -> Replicate(): all-gather along d; backward keeps this rank's part of the gradient.
//   Replicate() -> Shard(d): this rank's part along d (torch.chunk's); backward all-gathers.
//   Shard(d) -> Shard(e): both of the above. Equal layouts: x itself.
// Sharded sizes must divide by the group size (DTensor.from_local's even parts).
at::Tensor redistribute(const at::Tensor& local, const Layout& from, const Layout& to, const Group& group);

// The inputs (outputs) of `self` redistributed as the PrepareModuleInput (PrepareModuleOutput) that
// parallelize_module gave it, or unchanged where it has none. As many tensors as its layouts.
std::vector<at::Tensor> prepare_input(const torch::nn::Module& self, std::vector<at::Tensor> inputs);
at::Tensor prepare_input(const torch::nn::Module& self, const at::Tensor& input);
std::vector<at::Tensor> prepare_output(const torch::nn::Module& self, std::vector<at::Tensor> outputs);
at::Tensor prepare_output(const torch::nn::Module& self, const at::Tensor& output);

// Cross-entropy of logits whose last dimension (the classes) is sharded over `group` in group-rank
// order as torch.chunk cuts it (a ColwiseParallel output), as PyTorch's loss_parallel(): never
// gathers the logits. Two all-reduces: the max of each sample (and the widest part), then its sum of
// exponentials and its target's logit together; the backward communicates nothing. target holds global class indices,
// whole on every rank; ignore_index as torch's cross_entropy; reduction "mean", "sum" or "none".
at::Tensor parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& target, const Group& group,
                                  int64_t ignore_index = -100, const std::string& reduction = "mean");

}  // namespace dtrain
