// ShardedOptimizerState: what code that saves optimizers in general (dtrain's CheckpointManager, a
// user's loop) needs of an optimizer whose state is spread over the ranks of a group, so that it can
// save one without knowing its type. ZeroRedundancyOptimizer implements it.
//
//   if (auto* sharded = dynamic_cast<dtrain::ShardedOptimizerState*>(&optimizer))
//     sharded->prepare_for_save(0);   // every rank of the optimizer's group
//   if (dtrain::rank() == 0) optimizer.save(archive);
//
// Loading needs no hook: the optimizer's load() on every rank reads a whole state and keeps that
// rank's share, so any loader that calls load() reshards.
#pragma once

namespace dtrain {

class ShardedOptimizerState {
 public:
  virtual ~ShardedOptimizerState() = default;
  // Collective over the optimizer's group (every member calls it): afterwards save() on global rank
  // `to` writes the whole state, as an unsharded optimizer would.
  virtual void prepare_for_save(int to) = 0;
};

}  // namespace dtrain
