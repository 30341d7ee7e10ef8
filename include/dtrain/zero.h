// ZeroRedundancyOptimizer (ZeRO stage 1): torch.distributed.optim.ZeroRedundancyOptimizer in C++.
// Each rank keeps the optimizer state of only its share of the parameters.
//
//   dtrain::DistributedDataParallel ddp(model);
//   dtrain::ZeroRedundancyOptimizer opt(ddp.parameters(),
//                                       dtrain::optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(1e-3)));
//   loss.backward(); opt.step();            // like any torch::optim::Optimizer (GradScaler, clipping too)
//
// Protocol:
//   1. Construction: the parameters are partitioned over the group's ranks as PyTorch does: sorted
//      by size, largest first, each to the rank with the fewest elements so far. Every rank builds
//      the wrapped optimizer over its own share only, so the state (Adam: two tensors per
//      parameter) exists once in the group instead of once per rank.
//   2. step(): the wrapped optimizer steps this rank's share (gradients are whole on every rank:
//      DDP averaged them); then every share is broadcast from its owner, one flat buffer per rank,
//      so every rank ends the step with all parameters updated.
//   3. Checkpoints: consolidate_state_dict(to) (collective) gathers every share's state on rank `to`
//      into the state an unsharded optimizer of the wrapped type would have; save() writes it there,
//      in that optimizer's own format, so a checkpoint loads into either. load() (every rank) reads a
//      whole state and keeps its own share. dtrain's CheckpointManager does both by itself.
// Join (dtrain/join.h): a Joinable; list it after DistributedDataParallel (Join({&ddp, &opt})). A
// rank that has joined steps its own share, and takes part in the broadcasts, exactly when the
// active ranks call step(), because each step() starts with a Join exchange of its own; not once per
// DDP forward, as PyTorch's hook does, so no_sync micro-batches, forwards under no-grad and steps
// that GradScaler skips are shadowed right. The joined rank steps with its share's gradients as the
// lowest active rank holds them at that step() (unscaled, clipped), sent to it then. Under Join,
// step(closure) is an error (Note [ZeRO under Join] in src/optim/zero.cpp).
// The learning rate and other options of param_groups()[0] (e.g. set by a scheduler) reach the
// wrapped optimizer at every step. One param group.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "dtrain/detail/arg.h"
#include "dtrain/join.h"
#include "dtrain/process_group.h"
#include "dtrain/sharded_optimizer.h"

namespace dtrain {

// Makes the wrapped optimizer over a list of parameters (possibly empty).
using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

// optimizer_factory<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9))
template <typename OptimizerType, typename Options>
OptimizerFactory optimizer_factory(Options options) {
  return [options](std::vector<at::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<OptimizerType>(std::move(params), options);
  };
}

struct ZeroOptions {
  // The group that shares the state (default: the world).
  DTRAIN_ARG(Group, process_group, Group())
};

class ZeroRedundancyOptimizer : public torch::optim::Optimizer, public Joinable, public ShardedOptimizerState {
 public:
  ZeroRedundancyOptimizer(std::vector<at::Tensor> params, OptimizerFactory factory,
                          ZeroOptions options = ZeroOptions());

  at::Tensor step(LossClosure closure = nullptr) override;

  // Collective: every rank of the group calls it. Rank `to` (a global rank) then holds the whole
  // state, for save(); the others hold nothing more.
  void consolidate_state_dict(int to = 0);
  // ShardedOptimizerState: consolidate_state_dict(to).
  void prepare_for_save(int to) override { consolidate_state_dict(to); }
  // On the rank that consolidated last: writes the whole state (the wrapped optimizer's format).
  void save(torch::serialize::OutputArchive& archive) const override;
  // On every rank: a whole state, from save() or from the unsharded optimizer; keeps this rank's share.
  void load(torch::serialize::InputArchive& archive) override;

  // Joinable: a joined rank's shadow of the active ranks' step() is a step() on its share.
  std::unique_ptr<JoinHook> join_hook(const JoinOptions& options) override;
  Group join_process_group() const override { return group_; }

  // The group rank owning each parameter, in the order of the parameters given.
  const std::vector<int>& owners() const { return owner_; }
  // The wrapped optimizer over this rank's share.
  torch::optim::Optimizer& local_optimizer() { return *local_; }
  // Bytes of tensors in this rank's optimizer state (what sharding divides): numel * element_size
  // summed over every tensor of every parameter's state (Adam: exp_avg and exp_avg_sq), no scalars.
  int64_t local_state_bytes() const;

 private:
  at::Tensor step_and_broadcast(LossClosure closure);
  void send_joined_grads(const JoinIteration& it);
  void shadow_step(const JoinIteration& it);
  void broadcast_shares();

  OptimizerFactory factory_;
  Group group_;
  std::vector<at::Tensor> params_;
  std::vector<int> owner_;                       // per parameter
  std::vector<std::vector<at::Tensor>> shares_;  // per group rank, in parameter order
  std::vector<at::Tensor> flats_;                // per group rank: its share's broadcast buffer, kept
  std::unique_ptr<torch::optim::Optimizer> local_;
  std::unique_ptr<torch::optim::Optimizer> consolidated_;  // on the rank that consolidated last
};

}  // namespace dtrain
