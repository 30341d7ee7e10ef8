// One fully_shard unit: its parameters' shards in one flat buffer, the all-gather that makes them
// whole, the reduce-scatter of their gradients (protocol: Note [Sharded storage] in unit.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "compat/autograd_compat.h"
#include "dtrain/fsdp.h"
#include "dtrain/shard_spec.h"

namespace dtrain::detail::fsdp {

class Root;

// A parameter of a unit. `param` is the module's own tensor: its data is `shard` while sharded and
// `full` while whole.
struct ShardedParam {
  std::string name;  // as the unit's module names it
  at::Tensor param;
  std::vector<int64_t> full_shape;  // whole over the unit's group (tensor parallelism's part, if any)
  // Note [Published shard specs]: the spec the parameter had when the unit took it (tensor
  // parallelism's, or none), published while the unit is whole, and it with the unit's cut added,
  // published while sharded.
  std::optional<ShardSpec> base;
  ShardSpec spec;
  int64_t rows = 1;       // dim 0 of the whole parameter
  int64_t row_numel = 1;  // elements per row
  int64_t chunk_rows = 0, local_rows = 0;
  int64_t offset = 0;       // of this parameter's chunk in the unit's flat shard, elements
  at::Tensor shard;         // [local_rows, ...]: a view of the unit's flat shard
  at::Tensor padded;        // n chunks, the all-gather's output; its storage holds no bytes while sharded
  at::Tensor full;          // whole, in the param dtype: a view of `padded`
  at::Tensor sharded_grad;  // the shard's .grad(), set aside while the parameter is whole
  at::Tensor accumulated;   // the whole gradient summed over backward passes without sync
  // Note [zero_grad while whole]: the whole parameter's .grad() while sharded_grad is set aside, and
  // its version then.
  at::Tensor placeholder;
  int64_t placeholder_version = 0;
  compat::NodePtr accumulator;
  bool got_grad = false;  // in this backward

  int64_t chunk_numel() const { return chunk_rows * row_numel; }
  int64_t local_numel() const { return local_rows * row_numel; }
};

class Unit : public std::enable_shared_from_this<Unit> {
 public:
  Unit(const std::shared_ptr<torch::nn::Module>& module, std::vector<ShardedParam> params, at::Tensor flat_shard,
       const FullyShardOptions& o);
  ~Unit();

  const std::string& label() const { return label_; }
  const torch::nn::Module* module() const { return module_; }
  const Group& group() const { return group_; }
  std::vector<ShardedParam>& params() { return params_; }

  // Forward and backward steps (fully_shard.cpp drives them).
  void issue_gather();  // the all-gather, asynchronous (prefetch); no-op if issued or whole
  // Waits for a prefetch nobody used (a unit that did not run after all) and drops it: the shards
  // may change before the unit next runs (the optimizer steps).
  void drop_prefetch();
  void unshard();  // whole parameters (waits for the prefetch, or gathers now)
  void reshard(bool restore_grads = true);
  // After the unit's forward: reshard (keeping the post-forward part under reshard_after_forward(n))
  // or stay whole (Note [Post-forward groups]).
  void post_forward();
  // Drops the post-forward part: a new iteration's forward gathers the shards the optimizer changed.
  void drop_post_forward() { post_forward_shard_ = at::Tensor(); }
  // Bytes held of the gathered parameters beyond the shards (FSDPModule::gathered_bytes).
  int64_t gathered_bytes() const;
  // The unit stays whole while user code runs (after its forward, or unshard()): an optimizer's
  // zero_grad() then must still reach the shards' gradients set aside (Note [zero_grad while whole]).
  void watch_zero_grad();
  bool is_whole() const { return whole_; }
  // Bytes this rank has received through the unit's training collectives (all-gathers and
  // reduce-scatters, padding included): (n - 1) parts of each.
  int64_t received_bytes() const { return received_bytes_; }
  // Gathers this unit found already issued (prefetched) when it needed its parameters.
  int64_t prefetched_gathers() const { return prefetched_; }
  bool reshard_after_forward() const { return reshard_after_forward_; }
  // Unset in the options: the root keeps its parameters after forward (FSDP2's default).
  void make_root_default() {
    if (!reshard_option_) reshard_after_forward_ = false;
  }
  void set_requires_gradient_sync(bool on) { requires_sync_ = on; }
  // reshard_after_forward(n), 1 < n < the group's size: the group of n ranks the post-forward part is
  // sharded over (made once per group and n: fully_shard.cpp's post_forward_group).
  void set_post_forward_group(Group g) { post_forward_group_ = std::move(g); }

  // Called once per gradient accumulated (from autograd); launches the reduce-scatter once every
  // parameter that takes a gradient has one.
  void on_grad_ready(ShardedParam& p);
  // End of backward: launches what waits for unused parameters, then reshards.
  void launch_if_pending();
  // HSDP (Note [Replicate all-reduce in backward]): issues the all-reduce across the replicas once
  // the reduce-scatter has landed; false when it has not yet and `wait` is false. True when issued,
  // or when there is none to issue.
  bool issue_replicate_all_reduce(bool wait);
  // Waits for the reduce-scatter (and the all-reduce across the replicas) and leaves each shard's
  // averaged gradient in .grad().
  void finish_gradients();
  void reset_backward();

  Root* root = nullptr;
  std::shared_ptr<Root> own_root;  // when this unit is a root
  bool pre_backward_done = false;

 private:
  void launch_reduce_scatter();
  void set_divide_factors();
  size_t pooled_bytes();
  void fill_storage(ShardedParam& p, const at::TensorOptions& options);
  at::Tensor padded_gradient(const ShardedParam& p, const at::Tensor& g, const at::TensorOptions& options) const;
  at::ScalarType param_dtype() const;
  at::ScalarType reduce_dtype() const;
  at::ScalarType wire_dtype();  // Note [A reduce dtype the backend lacks]
  at::TensorOptions device_options() const;

  std::string label_;
  const torch::nn::Module* module_;
  Group group_;
  // Note [Post-forward groups]: reshard_after_forward(n)'s group of n, and the part of the whole
  // parameters this rank keeps from forward to backward (n / N of the unit's parts, in the layout the
  // all-gather over that group takes).
  std::optional<Group> post_forward_group_;
  at::Tensor post_forward_shard_;
  std::optional<Group> replicas_;  // HSDP's replicate group (Note [Hybrid sharding])
  // Note [Hybrid sharding]: the gradients' divisions and ops, as FSDP2's _get_gradient_divide_factors.
  double predivide_ = 1, postdivide_ = 1;
  ReduceOp reduce_op_ = ReduceOp::AVG;
  std::vector<ShardedParam> params_;
  MixedPrecisionPolicy mp_;
  std::optional<bool> reshard_option_;
  bool reshard_after_forward_ = true;
  bool requires_sync_ = true;
  at::Tensor flat_shard_;  // every parameter's chunk, padded: the all-gather's input
  int64_t per_rank_ = 0;   // elements of flat_shard_
  int64_t received_bytes_ = 0, prefetched_ = 0;
  bool whole_ = false;
  bool per_param_ = false;     // Note [Collectives per parameter]
  std::vector<Work> gathers_;  // issued, not yet waited for
  at::Tensor gather_in_, gathered_;
  int ready_ = 0, takes_grad_ = 0;
  bool launched_ = false;
  std::vector<Work> scatters_;  // launched, not yet waited for
  std::vector<at::Tensor> scatter_inputs_;
  at::Tensor scatter_out_;
  bool scattering_ = false;                   // the reduce-scatter launched, not yet waited for
  std::vector<Work> replicate_reduces_;       // issued, not yet waited for (Note [Hybrid sharding])
  std::optional<at::ScalarType> wire_dtype_;  // known from the first reduce-scatter on
  std::vector<uintptr_t> hook_keys_;          // per parameter, on its accumulator (0: none yet)
  void hook_accumulators();
};

// Lays out one parameter as FSDP2 does (chunk ceil(d0 / n) rows) and copies this rank's rows.
// `replicas`: HSDP's replicate group, which holds the same rows (no cut; GradScaler agrees over it).
std::vector<ShardedParam> shard_parameters(std::vector<std::pair<std::string, at::Tensor>> named, const Group& group,
                                           const std::optional<Group>& replicas, at::Tensor& flat_shard);

// HSDP (Note [Hybrid sharding]): the group a unit's parameters are replicated over, a 2-D mesh's
// outer dimension; none for a 1-D mesh or a process group.
std::optional<Group> replicate_group(const FullyShardOptions& options);

}  // namespace dtrain::detail::fsdp
