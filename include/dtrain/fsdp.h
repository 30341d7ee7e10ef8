// Fully sharded data parallel: torch.distributed.fsdp.fully_shard (FSDP2, ZeRO-3) in C++.
//
//   auto model = std::make_shared<Net>();                 // Net holds a torch::nn::Sequential `blocks`
//   for (auto& block : *model->blocks) dtrain::fully_shard(block);   // each block is a unit
//   auto fsdp = dtrain::fully_shard(model);               // the root: what is left
//   torch::optim::Adam opt(model->parameters(), 1e-3);    // the parameters are now this rank's shards
//   auto loss = torch::mse_loss(fsdp(x), y);              // forward through the handle, not model->forward
//   opt.zero_grad(); loss.backward(); opt.step();         // .grad() holds the shard of the averaged gradient
//
// What a caller may rely on:
// - Sharding as FSDP2's: every parameter is split on dim 0 into group.size() chunks of ceil(d0 / N)
//   rows; group rank r holds chunk r (the last ranks fewer rows, or none). The module's parameters
//   are these local shards (the same tensors as before, resized), so an optimizer built on them
//   holds state for the shard only; so does one built before fully_shard that has not stepped yet.
//   A parameter that already has a gradient (backward ran before fully_shard, and an optimizer may
//   hold state of its whole shape) is refused, naming it.
// - A unit's parameters are whole only while the unit runs: its forward all-gathers them first
//   (prefetched one unit ahead from the second iteration on) and, with reshard_after_forward, frees
//   them after (with reshard_after_forward(n), keeps 1/n of them, over groups of n ranks consecutive
//   within the group, whose backward all-gather then runs in that group only: the same bits, so the
//   same training as true; Note [Post-forward groups]); backward gathers them again and
//   reduce-scatters the gradients, averaged over the
//   group (asynchronously; every one has landed in .grad() when backward() returns). .grad()
//   accumulates over backward passes, as torch's; optimizer.zero_grad() clears it at any time, also
//   between forward and backward while a unit is kept whole (Note [zero_grad while whole]).
// - HSDP (a 2-D mesh {replicate R, shard S}): everything above holds with "the group" the shard
//   dimension's; each rank holds chunk s of S (its shard coordinate), the same rows as the other
//   R - 1 replicas. Backward reduce-scatters over the shard group, then all-reduces the shard's
//   gradient over the replicate group (asynchronously too, while backward goes on: each unit's
//   all-reduce starts before the next unit's reduce-scatter): .grad() is the mean over all R * S
//   ranks, divided as FSDP2
//   divides (AVG in both for float32 and bfloat16 reduce dtypes; otherwise both sum, between a
//   division by a power of two near sqrt(R * S) before and by the rest after). Every rank of the mesh
//   trains its own part of the batch. The ShardSpec has the shard group's cut only, so a checkpoint
//   holds each chunk once and loads on any world, 1-D or 2-D, and clip_grad_norm_ counts each shard
//   once (not R times). received_bytes() counts the shard group's collectives.
// - GradScaler needs nothing more: its unscale_ MAX-reduces the overflow flag over the group of
//   every sharded parameter (each rank sees only its rows' infs), and under HSDP over the replicate
//   group too, so every rank skips together.
// - CheckpointManager saves a sharded model with each rank writing its own chunks into a DCP folder,
//   sharded over the world or over subgroups (replica groups too), and loads it on any world and
//   group size (dtrain/checkpoint.h). Each sharded parameter's ShardSpec is shard_spec_of(param)
//   (dtrain/shard_spec.h): fully_shard's cut of dim 0 after any tensor-parallel cut (call
//   parallelize_module first); 2-D sharded models save and load alike.
// - C++ modules have no forward hooks, so a unit runs through something dtrain owns: the
//   FSDPModule handle fully_shard returns (call it, not module->forward), a torch::nn::Sequential
//   element wrapped in place (fully_shard(AnyModule&): the element must take and return one tensor),
//   or a member declared as FSDPModule<Block> in the parent and called as such. A unit whose forward
//   runs any other way finds its parameters still sharded: torch then reports a shape mismatch.
// - Every rank of the group builds the same model and calls fully_shard on the same modules in the
//   same order (checked: names, shapes and dtypes must agree); as in FSDP2, parameters are not
//   broadcast, so seed every rank alike. A parameter unused in backward gets no gradient, as in one
//   process; it must be unused on every rank alike.
// Design and protocol: docs/design.md, "Fully sharded data parallel", and Note [Sharded storage] in
// src/fsdp/unit.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>

#include "dtrain/detail/arg.h"
#include "dtrain/detail/collect_tensors.h"
#include "dtrain/device_mesh.h"
#include "dtrain/process_group.h"
#include "dtrain/shard_spec.h"

namespace dtrain {

// FSDP2's MixedPrecisionPolicy: the dtype parameters are all-gathered and computed in, and the dtype
// gradients are reduce-scattered in. Shards, their gradients and the optimizer keep the parameters'
// own dtype. Unset: the parameters' dtype.
struct MixedPrecisionPolicy {
  DTRAIN_ARG(std::optional<at::ScalarType>, param_dtype, std::nullopt)
  DTRAIN_ARG(std::optional<at::ScalarType>, reduce_dtype, std::nullopt)
};

// FSDP2's reshard_after_forward, a bool or an int: true frees the gathered parameters after the
// unit's forward and gathers them again over the whole group in backward (ZeRO-3); false keeps them
// whole until the unit's backward (ZeRO-2 for the parameters); an int n (dividing the shard group's
// size N, 1 <= n <= N) keeps 1/n of the whole parameters on each rank after forward, sharded over
// groups of n ranks consecutive within the shard group (FSDP2's post-forward mesh, ZeRO++'s hpZ), so
// backward's all-gather runs within that smaller group: n = N is true, n = 1 is false.
class ReshardAfterForward {
 public:
  ReshardAfterForward(bool reshard) : reshard_(reshard) {}  // NOLINT: as FSDP2's bool
  template <typename Int, std::enable_if_t<std::is_integral_v<Int> && !std::is_same_v<Int, bool>, int> = 0>
  ReshardAfterForward(Int group_size)  // NOLINT: as FSDP2's int
      : reshard_(true), group_size_(static_cast<int64_t>(group_size)) {}
  bool is_int() const { return group_size_.has_value(); }
  // The bool given, or an int's value.
  bool reshard() const { return reshard_; }
  int64_t group_size() const { return group_size_.value_or(0); }

 private:
  bool reshard_;
  std::optional<int64_t> group_size_;
};

struct FullyShardOptions {
  // The group the parameters are sharded over (default: the world).
  DTRAIN_ARG(Group, process_group, Group())
  // Or FSDP2's mesh: a 1-D (sub-)mesh to shard over, as fully_shard(module, mesh=mesh["dp"]); its
  // group takes process_group's place (set one of the two). A 2-D mesh is HSDP, dims (replicate,
  // shard) outer first, as FSDP2's init_device_mesh(..., mesh_dim_names=("replicate", "shard")):
  // parameters are sharded over the shard dimension's group and replicated along the other.
  DTRAIN_ARG(DeviceMesh, mesh, DeviceMesh())
  // What the unit keeps of its gathered parameters from its forward to its backward: true, false or
  // an int n (ReshardAfterForward: reshard_after_forward(2)). Unset, as FSDP2: true, except for the
  // root, whose parameters backward needs first. An int that does not divide the shard group's size
  // is refused in one line.
  DTRAIN_ARG(std::optional<ReshardAfterForward>, reshard_after_forward, std::nullopt)
  DTRAIN_ARG(MixedPrecisionPolicy, mp_policy, MixedPrecisionPolicy())
  // FSDP2's ignored_params: parameters of the module that this unit leaves alone (not sharded, not
  // gathered, their gradients not averaged), as the experts of an expert-parallel MoE layer, which
  // their own layer shards over its ep group (dtrain/expert_parallel.h). Pass them to every
  // fully_shard call whose module holds them (a block's and the root's).
  DTRAIN_ARG(std::vector<at::Tensor>, ignored_params, {})
};

// What FSDPModule::forward and fully_shard need of the units (src/fsdp/), not for users.
namespace detail::fsdp {

class Unit;  // src/fsdp/unit.h

// The unit fully_shard made of `module`, or null.
std::shared_ptr<Unit> find_unit(const torch::nn::Module* module);
std::shared_ptr<Unit> make_unit(const std::shared_ptr<torch::nn::Module>& module, const FullyShardOptions& options);

// A unit's forward: the constructor gathers the parameters (and, for the root, prepares the
// iteration); finish() follows the outputs into backward and frees the parameters if the unit
// reshards after forward. A scope left by an exception leaves the unit as it was before.
class ForwardScope {
 public:
  explicit ForwardScope(std::shared_ptr<Unit> unit);
  ~ForwardScope();
  void finish(const std::vector<at::Tensor>& outputs);
  ForwardScope(const ForwardScope&) = delete;
  ForwardScope& operator=(const ForwardScope&) = delete;

 private:
  std::shared_ptr<Unit> unit_;
  bool finished_ = false;
};

}  // namespace detail::fsdp

namespace fsdp {

// What FSDPModule's methods do, for any module type.
void unshard(const torch::nn::Module& module);
void reshard(const torch::nn::Module& module);
void set_requires_gradient_sync(const torch::nn::Module& module, bool requires_sync, bool recurse);
int64_t received_bytes(const torch::nn::Module& module);
int64_t prefetched_gathers(const torch::nn::Module& module);
int64_t gathered_bytes(const torch::nn::Module& module);
// This rank's local shard of every parameter of the module, by name, as FSDP2's to_local().
std::vector<std::pair<std::string, at::Tensor>> sharded_state_dict(torch::nn::Module& module);

}  // namespace fsdp

// FSDP2's FSDPModule: a handle to a module fully_shard made a unit (or, before that, a plain
// pass-through: a parent may declare its units' members as FSDPModule<Block>).
template <typename ModuleType>
class FSDPModule {
 public:
  FSDPModule(std::nullptr_t) {}  // NOLINT: an empty member, assigned in the parent's constructor
  explicit FSDPModule(std::shared_ptr<ModuleType> module) : module_(std::move(module)) {}

  // Runs the module's forward as a unit (gathering its parameters before, following its outputs
  // into backward after); a module not yet fully_shard'ed runs as is.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    auto unit = detail::fsdp::find_unit(module_.get());
    if (!unit) return module_->forward(std::forward<Args>(args)...);
    detail::fsdp::ForwardScope scope(std::move(unit));
    auto out = module_->forward(std::forward<Args>(args)...);
    std::vector<at::Tensor> tensors;
    detail::collect_tensors(out, tensors);
    scope.finish(tensors);
    return out;
  }
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  const std::shared_ptr<ModuleType>& module() const { return module_; }
  ModuleType* get() const { return module_.get(); }
  std::vector<at::Tensor> parameters(bool recurse = true) const { return module_->parameters(recurse); }

  // Gathers the parameters now and keeps them until reshard() or the unit's next backward.
  void unshard() { fsdp::unshard(*module_); }
  void reshard() { fsdp::reshard(*module_); }
  // FSDP2's no_sync: false makes backward keep each unit's whole gradient, summed over backward
  // passes (memory: one gradient of the unit's parameters, whole, in the reduce dtype), without
  // communicating; the next backward with true reduce-scatters the sum. recurse: the units below too.
  void set_requires_gradient_sync(bool requires_sync, bool recurse = true) {
    fsdp::set_requires_gradient_sync(*module_, requires_sync, recurse);
  }
  // Collective: every parameter whole, then every buffer, by name as module->named_parameters() and
  // named_buffers() give them, on every rank (a copy; loads into an unsharded model of the same
  // architecture with load_state_dict-like code, or into PyTorch by name). It is
  // dtrain::full_state_dict (shard_spec.h): tensor-parallel parts inside are put together too.
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict() { return dtrain::full_state_dict(*module_); }
  // This rank's shards, by name (FSDP2's sharded state dict: to_local() of each DTensor).
  std::vector<std::pair<std::string, at::Tensor>> sharded_state_dict() { return fsdp::sharded_state_dict(*module_); }
  // Bytes this rank has received through the training collectives of the units here and below
  // (all-gathers and reduce-scatters, padding included), since fully_shard: ZeRO-3 receives about
  // 3 * P * (N - 1) / N elements per step, ZeRO-2 about 2 * P * (N - 1) / N.
  int64_t received_bytes() const { return fsdp::received_bytes(*module_); }
  // How many times a unit here or below found its all-gather already issued (prefetched one unit
  // ahead, from the second iteration on) when it needed its parameters.
  int64_t prefetched_gathers() const { return fsdp::prefetched_gathers(*module_); }
  // Bytes the units here and below hold now of their gathered parameters, beyond their shards: the
  // whole parameters (padding included) of a unit that is whole, and a unit's part kept after its
  // forward under reshard_after_forward(n) (1/n of them). Between forward and backward: 0 for
  // true, the whole for false.
  int64_t gathered_bytes() const { return fsdp::gathered_bytes(*module_); }

 private:
  std::shared_ptr<ModuleType> module_;
};

// Makes `module` a unit: its parameters that no unit below it holds are sharded over the group.
// Apply it bottom-up, the root last, as FSDP2's. Collective over the group (and, under HSDP, the
// replicate group: replicas check they hold the same model).
template <typename ModuleType>
FSDPModule<ModuleType> fully_shard(std::shared_ptr<ModuleType> module,
                                   const FullyShardOptions& options = FullyShardOptions()) {
  detail::fsdp::make_unit(module, options);
  return FSDPModule<ModuleType>(std::move(module));
}
template <typename ModuleType>
FSDPModule<ModuleType> fully_shard(torch::nn::ModuleHolder<ModuleType> holder,
                                   const FullyShardOptions& options = FullyShardOptions()) {
  return fully_shard(holder.ptr(), options);
}
template <typename ModuleType>
FSDPModule<ModuleType> fully_shard(FSDPModule<ModuleType>& member,
                                   const FullyShardOptions& options = FullyShardOptions()) {
  return fully_shard(member.module(), options);
}
// An element of a torch::nn::Sequential (for (auto& block : *seq) fully_shard(block)): the element
// becomes a unit and is replaced in place by a wrapper that runs it as one, so the Sequential's own
// forward runs it as a unit. Its parameters keep their names. The element takes and returns one
// tensor. An element checkpointed in place before (checkpoint_wrapper(element)) becomes a unit that
// runs its checkpoint inside, as FSDP2 applied to a checkpoint-wrapped block.
void fully_shard(torch::nn::AnyModule& element, const FullyShardOptions& options = FullyShardOptions());

// torch.nn.utils.clip_grad_norm_ over sharded gradients, as PyTorch's over DTensors: the total norm
// of the whole gradients, then every gradient (a shard or whole) scaled by max_norm / (total + 1e-6)
// when that is below 1. Returns the total norm (pass max_norm = infinity to measure it alone).
// Each gradient is read through its parameter's ShardSpec (shard_spec_of), whatever cut it:
// fully_shard, parallelize_module, both on a 2-D mesh, HSDP. A part cut over groups contributes its
// sum of |g|^p completed over each of them (a Shard placement); a parameter, or a part, whole across
// a group (a Replicate: an RMSNorm weight across tp, a shard across HSDP's replicas) counts once.
// `group`, where given, is what a parameter without a spec is a shard of (each rank's gradient one
// part, summed over the group, as before parameters carried specs); left out, such a parameter is
// whole on every rank, as a plain tensor in torch's. One all-reduce per group the parameters are cut
// over (SUM, or MAX for an infinite norm), the sums of every parameter cut over it in one tensor.
// Collective: every rank of the world calls it, each with its parameters of a model cut alike on
// every rank (the same layers over the same mesh dimensions, whatever the parameters' order): each
// rank all-reduces over its group of each dimension, the dimensions in one order that every rank
// derives from the groups' ranks (Note [Clipping over cuts]).
// `pp_group`, where given, is a group whose ranks hold different parameters, not parts of the same
// ones: pipeline stages (torchtitan's pp_mesh). Each rank's total (of its stage, completed over its
// cuts) is summed over it (MAX for an infinite norm), so every stage clips by the whole model's norm.
double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type = 2.0,
                       const std::optional<Group>& group = std::nullopt,
                       const std::optional<Group>& pp_group = std::nullopt);

}  // namespace dtrain
