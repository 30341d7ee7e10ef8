// What a restore may change in a TrainingState, kept before it starts, so that a checkpoint that
// fails half-way (an optimizer state of another shape, a missing member, a damaged archive) leaves
// the model, the optimizer and the rest as they were: restore is all or nothing.
//
//   const ckpt::Rollback before(state);
//   try { ...restore... } catch (...) { before.put_back(state); throw; }
//
// The price: while a restore runs, one more copy of this rank's parameters, buffers and optimizer
// state (for a fully_shard'ed model, of its shards only).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "dtrain/checkpoint.h"

namespace dtrain::ckpt {

class Rollback {
 public:
  explicit Rollback(const TrainingState& st);
  // Puts every kept part back into `st` (the same members as given to the constructor). Never
  // throws: a part that cannot be put back is a warning naming it.
  void put_back(TrainingState& st) const noexcept;

 private:
  TrainingState plain_;                       // the plain members: step, epoch, values, positions
  std::vector<at::Tensor> tensors_;           // deep copies of the model's parameters, then its buffers
  std::string optimizer_, scaler_, sampler_;  // serialized (empty: not kept)
  std::string rng_;                           // a rank-state pack of the RNGs
};

}  // namespace dtrain::ckpt
